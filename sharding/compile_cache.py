"""jax's persistent compilation cache, on by default for the command lines (train.py,
`python -m serve`, `python -m serve.generate`): a program one process compiled is read
from disk by the next, so a restarted server or a resumed run skips its compiles.

The directory is `~/.cache/meshlm/jax` unless the command names another
(`--compilation-cache-dir`, `--config.compilation_cache_dir`); 'none' or '' turns it off.
A directory the process already has (JAX_COMPILATION_CACHE_DIR, or jax.config set by the
caller) wins, so jax's own setting keeps working. jax keeps programs that took at least
`jax_persistent_cache_min_compile_time_secs` (1 s by default) to compile, keyed by the
program, the devices and the jax version, with no size limit: delete the directory to
reclaim the space. In a multi-process run process 0 writes and every process reads, so
the directory should be one they share. jax fixes the directory at its first use, so a
later `enable` with another path changes nothing.

Here, not in training/, because both training and serving use it (DESIGN.md: serve/
takes nothing else from training/). Library code never turns the cache on; only the
command lines do.
"""

import collections
import contextlib
import os
import sys
import tempfile

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

DEFAULT_DIR = '~/.cache/meshlm/jax'
_HIT = '/jax/compilation_cache/cache_hits'
_PROGRAM = '/jax/compilation_cache/compile_requests_use_cache'
_events = collections.Counter()


def _count(event: str, **kwargs) -> None:
  del kwargs
  if event in (_HIT, _PROGRAM):
    _events[event] += 1


jax.monitoring.register_event_listener(_count)


def enable(path: str, flag: str = '--compilation-cache-dir') -> str:
  """Turns the cache on at `path` ('~' expanded, created if missing) unless the process
  already has a cache directory; 'none' or '' leaves it off. Returns the directory in
  use ('' when off). A directory the command named (`flag`) that cannot be made raises
  ValueError naming `flag`; the default one is warned about and left off, so a command
  without a writable home still runs."""
  current = jax.config.jax_compilation_cache_dir
  off = path.strip().lower() in ('', 'none')
  if current:
    if path != DEFAULT_DIR and (off or _resolve(path) != current):
      print(f'{flag}={path} is not used: JAX_COMPILATION_CACHE_DIR (or jax.config) already '
            f'keeps the compilation cache in {current}.', file=sys.stderr)
    return current
  if off:
    return ''
  resolved = _resolve(path)
  try:
    os.makedirs(resolved, exist_ok=True)
    if not os.access(resolved, os.W_OK):
      raise PermissionError(13, 'not writable')
  except OSError as e:
    why = f'{flag}={resolved}: cannot create or write it ({e.strerror})'
    if path == DEFAULT_DIR:
      print(f'warning: {why}; compiling every program afresh. Name a writable directory '
            f'with {flag}, or none to silence this.', file=sys.stderr)
      return ''
    raise ValueError(f"{why}; give a writable directory, or 'none' to compile every "
                     'program afresh.') from None
  jax.config.update('jax_compilation_cache_dir', resolved)
  return resolved


@contextlib.contextmanager
def fresh():
  """A temporary, empty cache for the block, unless the process has a directory already
  (then that one): the first build of a program inside compiles it, a second reads it.
  Afterwards the process has no cache directory again. Yields the directory in use."""
  if jax.config.jax_compilation_cache_dir:
    yield jax.config.jax_compilation_cache_dir
    return
  with tempfile.TemporaryDirectory() as path:
    jax.config.update('jax_compilation_cache_dir', path)
    try:
      yield path
    finally:
      jax.config.update('jax_compilation_cache_dir', None)
      jax_cache.reset_cache()


def _resolve(path: str) -> str:
  return os.path.abspath(os.path.expanduser(path))


def hits() -> int:
  """Programs this process has read from the persistent cache so far."""
  return _events[_HIT]


def programs() -> int:
  """Programs this process has built so far, compiled or read from the cache (jax counts
  them whether or not a cache directory is set)."""
  return _events[_PROGRAM]
