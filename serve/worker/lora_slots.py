"""The runner's LoRA slot arrays: per target projection, a [L, slots, in, r_max] and
b [L, slots, r_max, out] (model.lora's serving form: each slot's scale folded into its b),
slot 0 all zeros for the base.
Their shapes never change, so writing an adapter into a slot or clearing it recompiles
no step; under tensor parallelism each is split like its base weight (B on the output
of q, k, v, gate and up; A on the input of o and down)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.lora import TARGETS

# (logical axis of the input features, of the output features) per target.
_AXES = {'q': ('embed', 'heads'), 'k': ('embed', 'kv_heads'), 'v': ('embed', 'kv_heads'),
         'o': ('heads', 'embed'), 'gate': ('embed', 'mlp'), 'up': ('embed', 'mlp'),
         'down': ('mlp', 'embed')}


def features(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """(in_features, out_features) of each target's base projection, as PEFT counts them."""
  d, e = cfg.embed_dim, cfg.resolved_head_dim
  q, kv, f = cfg.num_heads * e, cfg.num_kv_heads * e, cfg.resolved_mlp_dim
  return {'q': (d, q), 'k': (d, kv), 'v': (d, kv), 'o': (q, d), 'gate': (d, f),
          'up': (d, f), 'down': (f, d)}


def logical_axes(target: str):
  """(a_slots' axes, b_slots' axes)."""
  i, o = _AXES[target]
  return ('layers', None, i, None), ('layers', None, None, o)


class LoraSlots:
  """max_loras adapters' slots (1..max_loras) beside slot 0, in the compute dtype."""

  def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, plan=None):
    self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
    self._shardings = None
    if plan is not None:
      self._shardings = {t: dict(zip('ab', (plan.sharding(plan.params, ax)
                                             for ax in logical_axes(t)))) for t in TARGETS}
    slots, L = max_loras + 1, cfg.num_layers
    self.arrays = {}
    for t, (fin, fout) in features(cfg).items():
      shapes = {'a': (L, slots, fin, max_rank), 'b': (L, slots, max_rank, fout)}
      self.arrays[t] = {k: self._put(np.zeros(s, cfg.dtype), t, k) for k, s in shapes.items()}
    # Not donated: a step dispatched before the write may still read the old arrays.
    self._write = jax.jit(lambda arr, slot, value: arr.at[:, slot].set(value))
    self._lock = threading.Lock()

  def _put(self, x, target: str, half: str):
    sharding = None if self._shardings is None else self._shardings[target][half]
    return jax.device_put(jnp.asarray(x), sharding)

  def write(self, slot: int, weights: dict) -> None:
    """Puts an adapter in `slot`: weights {target: (a [L, in, r], b [L, r, out])}, scale
    folded into b; zero-padded to max_rank; targets it lacks are zeroed."""
    if not 1 <= slot <= self.max_loras:
      raise ValueError(f'LoRA slot {slot} is outside 1..{self.max_loras}.')
    with self._lock:   # loads, unloads and the engine's releases write from their threads
      self._write_locked(slot, weights)

  def _write_locked(self, slot: int, weights: dict) -> None:
    for t, arrs in self.arrays.items():
      new = {k: np.zeros((x.shape[0],) + x.shape[2:], x.dtype) for k, x in arrs.items()}
      if t in weights:
        a, b = weights[t]
        r = a.shape[-1]
        new['a'][:, :, :r], new['b'][:, :r, :] = a, b
      self.arrays[t] = {k: self._write(arrs[k], slot, new[k]) for k in arrs}

  def clear(self, slot: int) -> None:
    self.write(slot, {})
