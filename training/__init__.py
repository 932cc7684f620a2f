"""Training: config, data, optimizer, checkpoints and the train loop."""
