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


# Settings that may differ per process: where each host keeps its caches, how it reaches
# the coordinator, what only process 0 shows; and paths, compared by what they name (the
# same files may be mounted at different paths on different hosts).
_LOCAL = ('distributed.', 'compilation_cache_dir', 'data.cache_dir', 'metrics.progress_bar')
_PATHS = ('data.train_files', 'eval.files', 'data.tokenizer', 'init_from_hf')


def fingerprint(cfg: config_lib.Config, data_files: list[str],
                eval_files: list[str] = (), tokenizer=None) -> dict[str, str]:
  """What must be equal on every process, as flat `name: value` strings: the config but
  for per-host settings, the devices per process, and the files the paths name."""
  flat = {k: v for k, v in _flatten(dataclasses.asdict(cfg)).items()
          if not k.startswith(_LOCAL) and k not in _PATHS}
  flat['devices per process'] = str(jax.local_device_count())
  flat['data files'] = _files(data_files)
  flat['eval files'] = _files(eval_files)
  if tokenizer is not None:
    flat['tokenizer'] = f'{tokenizer.name} (vocab {tokenizer.vocab_size}, eos {tokenizer.eos_id})'
  if cfg.init_from_hf:
    flat['init_from_hf config.json'] = _read(os.path.join(cfg.init_from_hf, 'config.json'))
  return flat


def check_agree(cfg: config_lib.Config) -> None:
  """Raises ValueError naming the first value a process disagrees with process 0 on."""
  if jax.process_count() == 1:
    return
  # pylint: disable-next=import-outside-toplevel
  from training import data, tokenizer as tokenizer_lib
  data_files = data.train_files(cfg.data)
  eval_files = (config_lib.eval_files(cfg.eval)
                if cfg.eval.every_steps and cfg.eval.files else [])
  tokenizer = tokenizer_lib.load_tokenizer(cfg.data.tokenizer)
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  client = distributed.global_state.client
  client.key_value_set(f'meshlm/setup/{jax.process_index()}',
                       json.dumps(fingerprint(cfg, data_files, eval_files, tokenizer)),
                       allow_overwrite=True)
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


def _files(paths) -> str:
  return ', '.join(f'{os.path.basename(p)} ({_size(p)} bytes)' for p in paths)


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError as e:
    return f'unreadable ({e.strerror})'


def _size(path: str) -> int:
  try:
    return os.path.getsize(path)
  except OSError:
    return -1
