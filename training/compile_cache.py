"""jax's persistent compilation cache, on by default for the command lines (train.py,
`python -m serve`, `python -m serve.generate`): a program one process compiled is read
from disk by the next, so a restarted server or a resumed run skips its compiles (a 1B
model's serving warm-up compiled 15 programs in 135 s on an H200).

The directory is `~/.cache/meshlm/jax` unless the command says otherwise
(`--compilation-cache-dir`, `--config.compilation_cache_dir`); 'none' or '' turns it off.
A directory the process already has (JAX_COMPILATION_CACHE_DIR, or jax.config set by the
caller) wins, so jax's own setting keeps working. jax caches programs that took at least
`jax_persistent_cache_min_compile_time_secs` (1 s by default) to compile, keyed by the
program, the devices and the jax version, and checks whether the cache is on once per
process, at its first compile: `enable` must run before that. Library code never turns
the cache on; only the command lines do.
"""

import collections
import os

import jax

DEFAULT_DIR = '~/.cache/meshlm/jax'
_HIT = '/jax/compilation_cache/cache_hits'
_LOOKUP = '/jax/compilation_cache/compile_requests_use_cache'
_events = collections.Counter()


def _count(event: str, **kwargs) -> None:
  del kwargs
  if event in (_HIT, _LOOKUP):
    _events[event] += 1


jax.monitoring.register_event_listener(_count)


def enable(path: str, flag: str = '--compilation-cache-dir') -> str:
  """Turns the cache on at `path` ('~' expanded, created if missing) unless the process
  already has a cache directory; 'none' or '' leaves it off. Returns the directory in
  use ('' when off). Raises ValueError naming `flag` when the directory cannot be made."""
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  if path.strip().lower() in ('', 'none'):
    return ''
  path = os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f'{flag}={path}: cannot create it ({e.strerror}); give a writable '
                     "directory, or 'none' to compile every program afresh.") from None
  if not os.access(path, os.W_OK):
    raise ValueError(f'{flag}={path}: not writable; give a writable directory, or '
                     "'none' to compile every program afresh.")
  jax.config.update('jax_compilation_cache_dir', path)
  return path


def hits() -> int:
  """Programs this process has read from the persistent cache so far."""
  return _events[_HIT]


def programs() -> int:
  """Programs this process has built so far, compiled or read from the cache (jax counts
  them whether or not a cache directory is set)."""
  return _events[_LOOKUP]
