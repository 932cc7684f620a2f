"""`python train.py --config=NAME.py[:variant] [--config.a.b=value ...]`."""

import dataclasses
import functools
import importlib.util
import logging as std_logging
import os
import re
import sys

import jax
from absl import flags, logging
from ml_collections import config_flags

from sharding import compile_cache
from training import checkpoint, describe, resilience, trainer
from training import config as config_lib

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           'configs')


@functools.cache
def _config_flag():
  # Defined on first use, after check_overrides: at definition ml_collections already
  # reads sys.argv's overrides, and an unknown field there raises a bare KeyError.
  return config_flags.DEFINE_config_file(
      'config', os.path.join(CONFIGS_DIR, 'default.py'),
      'A config file: a path, or a bare name in configs/ (e.g. gpt_64k.py:smoke).')


def fail(message: str) -> None:
  """Bad input at start: one line on stderr, exit status 2, never a traceback."""
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


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
      fail(f'--config={path}: no such file here or in configs/ (has {names}).')
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
        fail(f'--{where}.{name}: unknown config field {name!r}; {where} has '
             f'{sorted(fields)}. `python train.py --help` lists them all.')
      holder = fields[name]
      if not dataclasses.is_dataclass(holder):
        if depth + 1 < len(match.group(1).split('.')):
          fail(f'--{where}.{name}: {name!r} is a {holder.__name__}, not a section.')
        break


def config_spec(argv: list[str]) -> str:
  """The `--config=` value (resolved path and variant), or the default file; the last
  one given counts, as for absl's flags."""
  for arg in reversed(argv):
    match = re.fullmatch(r'--?config=(.+)', arg)
    if match:
      return match.group(1)
  return os.path.join(CONFIGS_DIR, 'default.py')


def check_config_file(spec: str) -> None:
  """Exits with one line if `NAME.py[:variant]` does not give a Config."""
  try:
    loaded = load_config_file(spec)   # a raising get_config or unknown variant
  except Exception as e:  # pylint: disable=broad-except
    fail(f'--config={spec}: get_config failed: {type(e).__name__}: {e}')
  if not isinstance(loaded, config_lib.Config):
    fail(f'--config={spec}: get_config returned a {type(loaded).__name__}, not a '
         'training.config.Config: build one (see configs/default.py) and return it.')


def parse(argv: list[str]) -> tuple[config_lib.Config, str]:
  """(config with overrides, its file spec); every problem is one line and exit 2."""
  spec = config_spec(argv)
  # absl loads every --config= given (the last one counts): each must load cleanly.
  for given in [a.partition('=')[2] for a in argv if re.match(r'--?config=', a)] or [spec]:
    check_config_file(given)
  config = _config_flag()
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e).replace('\n', ' '))
  if len(rest) > 1:
    fail(f'unexpected arguments {rest[1:]}; use --config.FIELD=VALUE (see --help).')
  return config.value, spec


def run(job=trainer.train) -> None:
  """`train.py [--help | --check]`: parses the config and its overrides, then runs."""
  argv = resolve_config_argv(sys.argv)
  modes = {a for a in argv[1:] if a in ('--help', '-h', '--check')}
  argv = [a for a in argv if a not in modes]
  check_overrides(argv[1:])
  cfg, spec = parse(argv)
  if modes & {'--help', '-h'}:
    module = load_config_module(spec.partition(':')[0])
    print(describe.help_text(cfg, spec, getattr(module, 'VARIANTS', ())))
    return
  if '--check' in modes:
    try:
      print(describe.check_report(cfg, jax.device_count()))
    except ValueError as e:
      fail(str(e))
    return
  try:   # before the step compiles: jax fixes the cache directory at its first use
    compile_cache.enable(cfg.compilation_cache_dir, '--config.compilation_cache_dir')
  except ValueError as e:
    fail(str(e))
  logging.set_verbosity(logging.WARNING)   # orbax logs every file it writes at INFO
  # orbax logs a failed save with a traceback from each of its threads; the trainer
  # reports it in one line (training.trainer._save_failed).
  std_logging.getLogger('absl').addFilter(
      lambda r: r.levelno < std_logging.ERROR or 'orbax' not in r.pathname)
  try:
    config_lib.init_distributed(cfg.distributed)
    job(cfg)
  except (trainer.ConfigError, checkpoint.CheckpointError, FileNotFoundError) as e:
    fail(str(e))
  except resilience.RunStopped as e:   # preempted, non-finite steps, a failed save
    print(f'stopped: {e}', file=sys.stderr)
    sys.exit(e.exit_status)
  except KeyboardInterrupt:
    print('stopped: interrupted (Ctrl-C); run the same command again to resume from the '
          'newest checkpoint.', file=sys.stderr)
    sys.exit(resilience.EXIT_INTERRUPTED)
