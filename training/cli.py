"""`python train.py --config=NAME.py[:variant] [--config.a.b=value ...]`."""

import dataclasses
import importlib.util
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from training import checkpoint, trainer
from training import config as config_lib

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           'configs')
_CONFIG = config_flags.DEFINE_config_file(
    'config', os.path.join(CONFIGS_DIR, 'default.py'),
    'A config file: a path, or a bare name in configs/ (e.g. gpt_64k.py:smoke).')


def resolve_config_argv(argv: list[str]) -> list[str]:
  """Rewrites `--config=NAME.py[:variant]` to configs/NAME.py when NAME.py is no path."""
  out = list(argv)
  for i, arg in enumerate(out):
    match = re.fullmatch(r'(--?config=)([^:]+)(:.*)?', arg)
    if match is None:
      continue
    prefix, path, variant = match.group(1), match.group(2), match.group(3) or ''
    bundled = os.path.join(CONFIGS_DIR, path)
    if not os.path.exists(path) and os.path.exists(bundled):
      out[i] = prefix + bundled + variant
    elif not os.path.exists(path):
      names = sorted(f for f in os.listdir(CONFIGS_DIR) if f.endswith('.py'))
      sys.exit(f'error: --config={path}: no such file here or in configs/ (has {names}).')
  return out


def load_config_module(name: str):
  """A config file's module, from a path or a bare name in configs/."""
  path = name if os.path.exists(name) else os.path.join(CONFIGS_DIR, name)
  spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config_file(spec: str) -> config_lib.Config:
  """`NAME.py[:variant]` -> its Config, as `--config=` would load it."""
  name, has_variant, variant = spec.partition(':')
  module = load_config_module(name)
  return module.get_config(variant) if has_variant else module.get_config()


def check_overrides(argv: list[str], root: type = config_lib.Config) -> None:
  """Exits naming the field when `--config.a.b=v` names a field the config lacks."""
  for arg in argv:
    match = re.match(r'--?config\.([\w.]+)', arg)
    if match is None:
      continue
    holder = root
    for depth, name in enumerate(match.group(1).split('.')):
      fields = {f.name: f.type for f in dataclasses.fields(holder)}
      where = '.'.join(['config'] + match.group(1).split('.')[:depth])
      if name not in fields:
        sys.exit(f'error: --{where}.{name}: unknown config field {name!r}; '
                 f'{where} has {sorted(fields)}.')
      holder = fields[name]
      if not dataclasses.is_dataclass(holder):
        break


def run(job=trainer.train) -> None:
  """Parses `--config=...` and its overrides, then calls job(config) with clean errors."""
  sys.argv = resolve_config_argv(sys.argv)
  check_overrides(sys.argv[1:])

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments {argv[1:]}; use --config.FIELD=VALUE.')
    if not flags.FLAGS['verbosity'].present:
      logging.set_verbosity(logging.WARNING)   # orbax logs every file it writes at INFO
    try:
      config_lib.init_distributed(_CONFIG.value.distributed)
      job(_CONFIG.value)
    except (trainer.ConfigError, checkpoint.CheckpointError, FileNotFoundError) as e:
      sys.exit(f'error: {e}')

  app.run(main)
