"""Orbax checkpoints with checksums, restored onto whatever mesh the new run has.

Each step holds two items: `state` (the sharded train state) and `meta` (JSON: the data
iterator's state and a checksum per state leaf). Orbax itself verifies nothing, so a
restore recomputes the checksums and falls back to the previous step on a mismatch.
"""

import logging
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from training.config import CheckpointConfig

log = logging.getLogger(__name__)
_ITEMS = ('state', 'meta')


class CheckpointError(RuntimeError):
  """Checkpoints exist but none can be restored."""


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """Position-weighted sum of the raw bits mod 2^32: same value on any mesh."""
  bits = x.dtype.itemsize * 8
  raw = jax.lax.bitcast_convert_type(x, jnp.dtype(f'uint{bits}'))
  if bits == 64:
    raw = (raw ^ (raw >> 32)).astype(jnp.uint32)
  raw = raw.astype(jnp.uint32)
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
  return [int(c) for c in jax.tree.leaves(jax.device_get(_checksums(tree)))]


class Checkpointer:
  """Async, atomic saves every N steps keeping the last K; verified restores."""

  def __init__(self, directory: str, cfg: CheckpointConfig):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep, create=True, enable_async_checkpointing=cfg.async_save)
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(self.directory, item_names=_ITEMS, options=options)

  def save(self, step: int, state, extra: dict) -> None:
    """Starts an async save; `extra` (JSON) is stored beside the state's checksums."""
    meta = {**extra, 'step': step, 'checksums': checksums(state)}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore_latest(self, target):
    """(state, meta) of the newest intact checkpoint, or None if the directory is empty.

    Damaged steps newer than the one restored are deleted, so the run can save them
    again. If steps exist but none restores (damaged, or saved by a different model or
    optimizer), this raises rather than silently starting over.
    """
    damaged, last_error = [], None
    for step in reversed(self.steps()):
      try:
        state, meta = self._restore(step, target)
        if checksums(state) == list(meta['checksums']):
          self._delete(damaged)
          return state, meta
        last_error = 'checksum mismatch'
      except Exception as e:  # pylint: disable=broad-except
        last_error = f'{type(e).__name__}: {e}'
      log.warning('checkpoint %d cannot be used (%s); trying an older one', step,
                  str(last_error)[:300])
      damaged.append(step)
    if damaged:
      raise CheckpointError(
          f'no checkpoint in {self.directory} can be restored (newest error: '
          f'{str(last_error)[:500]}). If the model or optimizer config changed, use a new '
          'workdir; to start over, move the checkpoints directory away.')
    return None

  def _restore(self, step: int, target):
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def _delete(self, steps: list[int]) -> None:
    for step in steps:
      log.warning('deleting damaged checkpoint %d', step)
      self._manager.delete(step)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()



def restore_params(directory: str, target) -> tuple[object, int]:
  """(params, step) of the newest checkpoint whose parameters are intact, for serving.

  Reads the `params` subtree of `state` only (orbax partial restore: the optimizer state
  is never read) onto the shardings in `target` (ShapeDtypeStructs in the model's param
  tree). The directory is opened read-only: a damaged newer step is skipped with a
  warning and left as it is, for the training run to deal with.
  """
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'{directory} does not exist: pass the workdir of a train.py '
                            'run (--config.workdir) that has saved a checkpoint.')
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None,
                                         save_interval_steps=0)
  manager = ocp.CheckpointManager(directory, item_names=_ITEMS, options=options)
  steps = sorted(manager.all_steps())
  if not steps:
    raise FileNotFoundError(f'{directory} holds no checkpoint yet: train until one is '
                            'saved (checkpoint.every_steps) or pass another workdir.')
  last_error = None
  for step in reversed(steps):
    try:
      params, meta = _restore_params(manager, step, target)
      # meta['checksums'] follows the TrainState leaves: step, then the params.
      expected = list(meta['checksums'][1:1 + len(jax.tree.leaves(params))])
      if checksums(params) == expected:
        return params, step
      last_error = 'parameter checksum mismatch'
    except Exception as e:  # pylint: disable=broad-except
      last_error = f'{type(e).__name__}: {e}'
    log.warning('checkpoint %d cannot be served (%s); trying an older one', step,
                str(last_error)[:300])
  raise CheckpointError(f'no checkpoint in {directory} has intact parameters of this model '
                        f'(newest error: {str(last_error)[:500]}).')


def _restore_params(manager, step: int, target):
  item = {'params': target}
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(
          item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True),
      meta=ocp.args.JsonRestore()))
  return restored.state['params'], restored.meta
