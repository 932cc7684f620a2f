"""User models trained by meshlm's trainer through model.module (docs/own_model.md)."""
