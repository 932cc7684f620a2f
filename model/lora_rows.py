"""Many LoRA adapters in one step: each token row adds the low-rank delta of its own
adapter's slot, with no merged copy of any base weight (vLLM's multi-LoRA, punica's
batched low-rank matmuls).

An adapter registry keeps, per target projection, fixed-shape slot arrays

    a_slots [slots, in, r_max]    b_slots [slots, r_max, out]     slot 0: zeros (no adapter)

an adapter's A and B zero-padded to r_max and its scale (alpha / r) folded into B. Fixed
shapes mean loading or unloading an adapter changes values only: no step recompiles.

A step's rows name their slot (row_slot [T]); the delta is two dense matmuls over every
slot at once, the middle masked to each row's own slot:

    x [T, in] @ a_slots -> [T, slots, r_max] * (row_slot == slot) @ b_slots -> [T, out]

slots * r_max is small (max_loras + 1 times the largest rank), so both are plain GEMMs,
on CPU and under tensor parallelism alike (b_slots split like the base weight's output,
a_slots like its input).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Target projections: the base weight each adds to (model.transformer's names).
TARGETS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
BASE_WEIGHT = {'q': 'wq', 'k': 'wk', 'v': 'wv', 'o': 'wo', 'gate': 'w_gate', 'up': 'w_up',
               'down': 'w_down'}


class LoraLayer(NamedTuple):
  """One layer's slot arrays {target: (a_slots, b_slots)} and the step's row slots [T]."""
  slots: dict
  row_slot: jax.Array


def delta_rows(x, a_slots, b_slots, row_slot):
  """x [T, in] -> [T, out]: row t's x @ A @ B of the adapter in slot row_slot[t]."""
  h = jnp.einsum('ti,sir->tsr', x, a_slots.astype(x.dtype))
  mine = row_slot[:, None] == jnp.arange(a_slots.shape[0], dtype=row_slot.dtype)
  h = h * mine[:, :, None].astype(h.dtype)
  return jnp.einsum('tsr,sro->to', h, b_slots.astype(x.dtype))


def add(y, x, layer, target: str):
  """y (a projection of x [b, t, in], any trailing shape) plus the rows' adapter deltas
  for `target`, or y itself where the layer carries no adapters."""
  lora = layer.get('lora') if isinstance(layer, dict) else None
  if lora is None or target not in lora.slots:
    return y
  a, b = lora.slots[target]
  flat = x.reshape(-1, x.shape[-1])
  return y + delta_rows(flat, a, b, lora.row_slot).reshape(y.shape).astype(y.dtype)


def with_layer(layer, slots, row_slot):
  """The layer dict as model.transformer reads it, carrying this layer's slot arrays."""
  if slots is None:
    return layer
  return {**layer, 'lora': LoraLayer(slots, row_slot)}
