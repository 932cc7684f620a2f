"""One tiny trained model shared by every serving test of a session.

tests/conftest.py loads this file as a plugin (`pytest_plugins = ['tests.serve_fixtures']`).
Training takes ~10 s on 2 cores; doing it once keeps the serving tests fast.
"""

import pytest

from training import trainer
from training.cli import load_config_file

TRAIN_STEPS = 30


@pytest.fixture(scope='session')
def tiny_workdir(tmp_path_factory) -> str:
  """A train.py workdir of configs/default.py:tiny after TRAIN_STEPS steps."""
  root = tmp_path_factory.mktemp('served_tiny')
  cfg = load_config_file('default.py:tiny')
  cfg.workdir, cfg.data.cache_dir = str(root / 'run'), str(root / 'corpus')
  cfg.steps, cfg.sample.num_tokens = TRAIN_STEPS, 0
  cfg.metrics.progress_bar = False
  trainer.train(cfg)
  return cfg.workdir


@pytest.fixture(scope='session')
def tiny_served(tiny_workdir):
  """The shared tiny model loaded for serving (params on the default device)."""
  from serve.load.checkpoint import load_checkpoint  # pylint: disable=import-outside-toplevel
  return load_checkpoint(tiny_workdir)
