"""Orbax checkpoints with checksums, restored onto whatever mesh the new run has.

Each step holds two items: `state` (the sharded train state) and `meta` (JSON: the data
iterator's state and a checksum per state leaf). Orbax itself verifies nothing, so a
restore recomputes the checksums and falls back to the previous step on a mismatch;
the damaged steps are moved aside into `damaged/`, never deleted.
"""

import json
import logging
import os
import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from sharding import offload
from training.config import CheckpointConfig

log = logging.getLogger(__name__)
_ITEMS = ('state', 'meta')
DAMAGED_DIR = 'damaged'   # not a step number, so orbax neither lists nor prunes it


@flax.struct.dataclass
class _Saved:
  """A checkpoint's `state` item: the train state without a LoRA run's frozen base, the
  three fields every checkpoint has held (so older ones restore)."""
  step: Any
  params: Any
  opt_state: Any


def _saved(state):
  if not hasattr(state, 'frozen'):
    return state
  return _Saved(step=state.step, params=state.params, opt_state=state.opt_state)


def _unsaved(restored, target):
  if not hasattr(target, 'frozen'):
    return restored
  return target.replace(step=restored.step, params=restored.params,
                        opt_state=restored.opt_state, frozen=None)


class CheckpointError(RuntimeError):
  """Checkpoints exist but none can be restored."""


def _raw(x: jax.Array) -> jax.Array:
  bits = x.dtype.itemsize * 8
  raw = jax.lax.bitcast_convert_type(x, jnp.dtype(f'uint{bits}'))
  if bits == 64:
    raw = (raw ^ (raw >> 32)).astype(jnp.uint32)
  return raw.astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """Position-weighted sum of the raw bits mod 2^32: same value on any mesh."""
  raw = _raw(x)
  index = jnp.zeros(x.shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(x.ndim)):
    index += jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * jnp.uint32(stride)
    stride *= x.shape[dim]
  return jnp.sum(raw * (2 * index + 1), dtype=jnp.uint32)


@jax.jit
def _checksums(tree):
  return jax.tree.map(_leaf_checksum, tree)


def checksums(tree) -> list[int]:
  """One checksum per leaf. Leaves offloaded to host memory (a jitted computation reads
  one memory kind) are copied to the device one at a time, never all at once."""
  leaves = jax.tree.leaves(tree)
  on_host = [offload.is_offloaded(x) for x in leaves]
  sums = iter(jax.device_get(_checksums([x for x, h in zip(leaves, on_host) if not h])))
  return [int(_checksums(offload.to_default_memory(x)) if h else next(sums))
          for x, h in zip(leaves, on_host)]


@jax.jit
def _checksum_and_sum(x):
  return _leaf_checksum(x), jnp.sum(_raw(x), dtype=jnp.uint32)


def stacked_checksum(pieces) -> int:
  """The checksum of jnp.stack(pieces) without stacking them: the stacked index of an
  element of piece j is j * piece.size plus its index in the piece."""
  total = 0
  for j, piece in enumerate(pieces):
    own, raw_sum = jax.device_get(_checksum_and_sum(piece))
    total += int(own) + 2 * j * piece.size * int(raw_sum)
  return total % 2**32


class Checkpointer:
  """Async, atomic saves every N steps keeping the last K; verified restores."""

  def __init__(self, directory: str, cfg: CheckpointConfig):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep, create=True, enable_async_checkpointing=cfg.async_save)
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(self.directory, item_names=_ITEMS, options=options)
    self.rejected: list[dict] = []   # what the last restore_latest moved aside, and why

  def save(self, step: int, state, extra: dict) -> None:
    """Starts an async save; `extra` (JSON) is stored beside the state's checksums."""
    state = _saved(state)
    meta = {**extra, 'step': step, 'checksums': checksums(state)}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore_latest(self, target):
    """(state, meta) of the newest intact checkpoint, or None if the directory is empty.

    Damaged steps newer than the one restored are moved aside into `damaged/` (see
    `_quarantine`), so the run saves them again and nothing the user saved is lost;
    `self.rejected` lists them. If steps exist but none restores (damaged, or saved by a
    different model or optimizer), this raises and moves nothing.
    """
    damaged, self.rejected = [], []
    for step in reversed(self.steps()):
      reason, error, restored = self._try_restore(step, target)
      if reason is None:
        self.rejected = [self._quarantine(s, r, e) for s, r, e in damaged]
        return restored
      log.warning('checkpoint %d cannot be used (%s); trying an older one', step, error[:300])
      damaged.append((step, reason, error))
    if damaged:
      raise CheckpointError(
          f'no checkpoint in {self.directory} can be restored (newest error: '
          f'{damaged[0][2][:500]}). If the model or optimizer config changed, use a new '
          'workdir; to start over, move the checkpoints directory away.')
    return None

  def latest_meta(self) -> dict | None:
    """The newest step's meta (JSON) alone, or None: no step, or one whose meta does not
    read (restore_latest then deals with it)."""
    steps = self.steps()
    if not steps:
      return None
    try:
      return self._manager.restore(steps[-1], args=ocp.args.Composite(
          meta=ocp.args.JsonRestore())).meta
    except Exception:  # pylint: disable=broad-except
      return None

  def _try_restore(self, step: int, target):
    """(reason, error, None) for a step that cannot be used, else (None, None, restored)."""
    try:
      restored = self._restore(step, target)
    except Exception as e:  # pylint: disable=broad-except
      return type(e).__name__, f'{type(e).__name__}: {e}', None
    if checksums(restored[0]) != list(restored[1]['checksums']):
      return 'checksum-mismatch', 'checksum mismatch', None
    return None, None, restored

  def _restore(self, step: int, target):
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_saved(target)), meta=ocp.args.JsonRestore()))
    return _unsaved(restored.state, target), restored.meta

  def _quarantine(self, step: int, reason: str, error: str) -> dict:
    """Moves a damaged step to damaged/<step>-<reason>[-n]/, a name orbax never lists,
    and appends why to damaged/rejected.jsonl."""
    base = os.path.join(self.directory, DAMAGED_DIR, f'{step}-{reason}')
    dest, n = base, 1
    while os.path.exists(dest):
      n += 1
      dest = f'{base}-{n}'
    record = {'step': step, 'reason': reason, 'error': error[:2000], 'moved_to': dest,
              'time': time.time()}
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      os.rename(os.path.join(self.directory, str(step)), dest)
      with open(os.path.join(self.directory, DAMAGED_DIR, 'rejected.jsonl'), 'a') as f:
        f.write(json.dumps(record) + '\n')
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'meshlm quarantine {step}')
    log.warning('damaged checkpoint %d (%s) moved to %s; this run saves step %d again',
                step, reason, dest, step)
    self._manager.reload()
    return record

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()



def restore_params(directory: str, target, step: int | None = None) -> tuple[object, int]:
  """(params, step) of the newest checkpoint whose parameters are intact (or of `step`
  alone), for serving and as a LoRA run's base (restore_params_and_meta)."""
  params, step, _ = restore_params_and_meta(directory, target, step)
  return params, step


def restore_params_and_meta(directory: str, target,
                            step: int | None = None) -> tuple[object, int, dict]:
  """(params, step, meta) of the newest checkpoint whose parameters are intact (or of
  `step` alone): what is checked against the meta is that step's, not the newest one's.

  Reads the `params` subtree of `state` only (orbax partial restore: the optimizer state
  is never read) onto the shardings in `target` (ShapeDtypeStructs in the model's param
  tree). The directory is opened read-only: a damaged newer step is skipped with a
  warning and left as it is, for the training run to deal with.
  """
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'{directory} does not exist: pass the workdir of a train.py '
                            'run (--config.workdir) that has saved a checkpoint.')
  directory = os.path.abspath(directory)   # orbax refuses relative paths
  manager = _read_only(directory)
  steps = sorted(manager.all_steps())
  if not steps:
    raise FileNotFoundError(f'{directory} holds no checkpoint yet: train until one is '
                            'saved (checkpoint.every_steps) or pass another workdir.')
  if step is not None and step not in steps:
    raise FileNotFoundError(f'{directory} has no checkpoint of step {step} (it holds steps '
                            f'{steps}): name one of those, or none for the newest.')
  if step is not None:
    steps = [step]
  last_error = None
  for step in reversed(steps):
    try:
      params, meta = _restore_params(manager, step, target)
      # meta['checksums'] follows the TrainState leaves: step, then the params.
      expected = list(meta['checksums'][1:1 + len(jax.tree.leaves(params))])
      if checksums(params) == expected:
        return params, step, meta
      last_error = 'parameter checksum mismatch'
    except Exception as e:  # pylint: disable=broad-except
      last_error = f'{type(e).__name__}: {e}'
    log.warning('checkpoint %d cannot be served (%s); trying an older one', step,
                str(last_error)[:300])
  raise CheckpointError(f'no checkpoint in {directory} has intact parameters of this model '
                        f'(newest error: {str(last_error)[:500]}).')


def _read_only(directory: str):
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None,
                                         save_interval_steps=0)
  return ocp.CheckpointManager(directory, item_names=_ITEMS, options=options)


def latest_meta(directory: str) -> dict | None:
  """The newest step's meta (JSON) of a checkpoints directory, opened read-only; None
  where there is none or it does not read."""
  if not os.path.isdir(directory):
    return None
  manager = _read_only(os.path.abspath(directory))
  steps = sorted(manager.all_steps())
  try:
    return manager.restore(steps[-1], args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta if steps else None
  except Exception:  # pylint: disable=broad-except
    return None


def _restore_params(manager, step: int, target):
  item = {'params': target}
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(
          item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True),
      meta=ocp.args.JsonRestore()))
  return restored.state['params'], restored.meta
