"""A multi-process launch runs one job: every process checks that the others agree.

Processes launched with different configs, device counts or data files would otherwise
meet at the first collective with different programs and hang there, or train on
batches that do not fit together. Each process posts what it will run to the
coordinator's key-value store (no device collective: it works whatever the devices) and
compares every process's post with process 0's, so all of them stop with the same line.
"""

import dataclasses
import json
import os

import jax

from training import config as config_lib

_TIMEOUT_MS = 5 * 60 * 1000   # processes start within this of each other


def fingerprint(cfg: config_lib.Config, data_files: list[str]) -> dict[str, str]:
  """What must be equal on every process, as flat `name: value` strings."""
  flat = _flatten(dataclasses.asdict(cfg))
  flat.pop('distributed.process_id')
  flat['devices per process'] = str(jax.local_device_count())
  flat['data files'] = ', '.join(f'{os.path.basename(p)} ({_size(p)} bytes)'
                                 for p in data_files)
  return flat


def check_agree(cfg: config_lib.Config, data_files: list[str]) -> None:
  """Raises ValueError naming the first value a process disagrees with process 0 on."""
  if jax.process_count() == 1:
    return
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  client = distributed.global_state.client
  client.key_value_set(f'meshlm/setup/{jax.process_index()}',
                       json.dumps(fingerprint(cfg, data_files)), allow_overwrite=True)
  posts = [_post(client, p) for p in range(jax.process_count())]
  for p, theirs in enumerate(posts[1:], 1):
    for name in sorted(posts[0].keys() | theirs.keys()):
      if posts[0].get(name) != theirs.get(name):
        raise ValueError(
            f'the processes disagree on {name}: process 0 has {posts[0].get(name)}, '
            f'process {p} has {theirs.get(name)}. Launch every process with the same '
            'config, device count and data files.')


def _post(client, process: int) -> dict[str, str]:
  try:
    return json.loads(client.blocking_key_value_get(f'meshlm/setup/{process}', _TIMEOUT_MS))
  except Exception as e:  # pylint: disable=broad-except  (jaxlib's error type varies)
    raise ValueError(f'process {process} did not report its setup within '
                     f'{_TIMEOUT_MS // 60000} minutes: it stopped at start (see its output) '
                     'or was never launched.') from e


def _flatten(tree: dict, prefix: str = '') -> dict[str, str]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = json.dumps(value)
  return out


def _size(path: str) -> int:
  try:
    return os.path.getsize(path)
  except OSError:
    return -1
