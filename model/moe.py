"""Mixture-of-experts MLP: router, auxiliary losses, capacity and dropless dispatch.

Reads top-down: parameters -> router and its losses -> expert SwiGLU -> capacity dispatch
(fixed buffers, overflow dropped) -> dropless dispatch (sorted tokens, grouped matmul)
-> the layer's MLP. Einsum letters as in model.transformer, plus e experts, c capacity
slots, k the token's chosen experts, n flattened tokens.

Router (float32): 'softmax' takes the top-k of softmax(logits) (Mixtral), 'sigmoid' the
top-k of per-expert sigmoids (DeepSeek-V3). With k > 1 the k weights are normalized to
sum 1 (Mixtral's softmax over the chosen logits is the same thing; DeepSeek-V3 normalizes
its sigmoid scores) unless router_norm_topk is off (Qwen3-MoE's norm_topk_prob=False);
with k = 1 the raw score is kept (Switch), or the router would get no gradient from the
language-model loss.

Capacity groups are sequences: each expert takes at most
C = ceil(capacity_factor * seq_len * k / E) of a sequence's (token, choice) pairs, first
choices before second choices, earlier tokens first; the rest are dropped. "Earlier" is
by original token index: under context load balance the sequence arrives reordered
(sharding.context.token_order), and the queues follow the original order, so what drops
does not depend on the mesh, the context strategy or load balance.

Capacity dispatch is plain jnp that the partitioner splits on the batch, unless
mesh.expert > 1: then sharding.moe's all-to-all exchange in shard_map. Dropless dispatch
with a plan always runs in shard_map (each batch shard sorts its own tokens; all-gather
and reduce-scatter over `expert`, nothing when it is 1). Serving (model/paged.py) runs
MoE layers dropless without a plan, so no token of a request depends on the others.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from sharding import context, moe as moe_sharding
from sharding.rules import ShardingPlan, constrain

# Values each MoE forward reports (mean over MoE layers, dropped summed over them).
AUX_KEYS = ('moe_aux_loss', 'router_z_loss', 'dropped_tokens')
# LoRA targets on the routed experts (model.lora's names) -> the stacked weight each adapts.
LORA_TARGETS = {'experts_gate': 'we_gate', 'experts_up': 'we_up', 'experts_down': 'we_down'}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple]:
  """name -> (shape, logical axes, init) of the MoE layers' MLP, stacked over them."""
  G, D, E = cfg.num_moe_layers, cfg.embed_dim, cfg.num_experts
  F, S = cfg.resolved_moe_mlp_dim, cfg.num_shared_experts
  out = {
      'router': ((G, D, E), ('layers', 'embed', None), 'normal'),
      'we_gate': ((G, E, D, F), ('layers', 'experts', 'embed', 'mlp'), 'normal'),
      'we_up': ((G, E, D, F), ('layers', 'experts', 'embed', 'mlp'), 'normal'),
      'we_down': ((G, E, F, D), ('layers', 'experts', 'mlp', 'embed'), 'residual'),
  }
  if S:
    out['ws_gate'] = ((G, D, S * F), ('layers', 'embed', 'mlp'), 'normal')
    out['ws_up'] = ((G, D, S * F), ('layers', 'embed', 'mlp'), 'normal')
    out['ws_down'] = ((G, S * F, D), ('layers', 'mlp', 'embed'), 'residual')
  return out


def inactive_params(cfg: ModelConfig) -> int:
  """Routed-expert weights a token does not use: (E - k) experts per MoE layer."""
  per_expert = 3 * cfg.embed_dim * cfg.resolved_moe_mlp_dim
  return cfg.num_moe_layers * (cfg.num_experts - cfg.experts_per_token) * per_expert


def zero_aux() -> dict[str, jax.Array]:
  return {k: jnp.zeros((), jnp.float32) for k in AUX_KEYS}


# ------------------------------------------------------------------------- router, losses

def route(x, router_w, cfg: ModelConfig):
  """x [b,t,d] -> expert ids [b,t,k], combine weights [b,t,k] (float32), aux losses."""
  logits = jnp.einsum('btd,de->bte', x.astype(jnp.float32), router_w.astype(jnp.float32))
  if cfg.router == 'softmax':
    scores = probs = jax.nn.softmax(logits, axis=-1)
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  top, ids = jax.lax.top_k(scores, cfg.experts_per_token)
  if cfg.experts_per_token > 1 and cfg.router_norm_topk:
    top = top / jnp.sum(top, axis=-1, keepdims=True)
  losses = {'moe_aux_loss': load_balancing_loss(probs, ids),
            'router_z_loss': jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)}
  return ids, top, losses


def load_balancing_loss(probs, ids):
  """E * sum_i f_i * P_i: f_i the share of (token, choice) pairs routed to expert i (no
  gradient), P_i the mean router probability of expert i. 1 when perfectly balanced."""
  num_experts = probs.shape[-1]
  counts = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=(0, 1, 2))
  f = counts / ids.size
  p = jnp.mean(probs, axis=(0, 1))
  return num_experts * jnp.sum(jax.lax.stop_gradient(f) * p)


# ------------------------------------------------------------------------------- experts

def swiglu(x, w_gate, w_up, w_down):
  """x [..., d] through one SwiGLU (shared experts)."""
  gate = jnp.einsum('...d,df->...f', x, w_gate.astype(x.dtype))
  up = jnp.einsum('...d,df->...f', x, w_up.astype(x.dtype))
  return jnp.einsum('...f,fd->...d', jax.nn.silu(gate) * up, w_down.astype(x.dtype))


def expert_swiglu(x, w_gate, w_up, w_down, *adapters, targets=()):
  """x [b, e, c, d] through expert e's SwiGLU, weights [e, d, f] / [e, f, d]; adapters:
  per name in `targets` (LORA_TARGETS' order), a [e, in, r] and b [e, r, out], scale in b."""
  ab = _adapter_pairs(targets, adapters)
  gate = _expert_project(x, w_gate, ab.get('experts_gate'))
  up = _expert_project(x, w_up, ab.get('experts_up'))
  return _expert_project(jax.nn.silu(gate) * up, w_down, ab.get('experts_down'))


def _expert_project(x, w, ab):
  """x [b, e, c, i] @ w [e, i, o], plus (x @ a) @ b per expert when ab = (a, b)."""
  y = jnp.einsum('beci,eio->beco', x, w.astype(x.dtype))
  if ab is None:
    return y
  h = jnp.einsum('beci,eir->becr', x, ab[0].astype(x.dtype))
  return y + jnp.einsum('becr,ero->beco', h, ab[1].astype(x.dtype))


def _adapter_pairs(targets, adapters) -> dict:
  return dict(zip(targets, zip(adapters[::2], adapters[1::2])))


def lora_adapters(layer) -> tuple[tuple[str, ...], tuple[jax.Array, ...]]:
  """(the expert targets `layer` adapts, their (a, b * scale) flattened): a layer's
  model.lora entry as extra expert weights, so the adapters take every route and exchange
  the base experts take (each split over `expert` with its expert's weights)."""
  entry = layer.get('lora') or {}
  targets = tuple(t for t in LORA_TARGETS if t in entry)
  if targets and 'scale' not in entry:
    raise ValueError('adapters on experts are not served per row: export the run with '
                     '`python -m serve.hf_export --merge` and serve the merged model.')
  arrays = []
  for t in targets:
    # scale * (x @ a) @ b == (x @ a) @ (scale * b): the scale rides in b.
    arrays += [entry[t]['a'], entry[t]['b'] * entry['scale'].astype(entry[t]['b'].dtype)]
  return targets, tuple(arrays)


# ---------------------------------------------------------------------- capacity dispatch

def capacity(cfg: ModelConfig, seq_len: int) -> int:
  """Slots per expert per sequence."""
  k, e = cfg.experts_per_token, cfg.num_experts
  return max(1, math.ceil(cfg.capacity_factor * seq_len * k / e))


def capacity_queue(ids, cfg: ModelConfig, plan: ShardingPlan | None):
  """capacity_slots of ids [b, t, k] laid out as the plan lays out the sequence."""
  t = ids.shape[1]
  # A queue spans its whole sequence: the ids (small) whole on every context device.
  ids = constrain(ids, ('batch', None, None), plan)
  return capacity_slots(ids, cfg.num_experts, capacity(cfg, t), context.token_order(plan, t))


def capacity_slots(ids, num_experts: int, cap: int, order: np.ndarray | None = None):
  """(slot of each (token, choice) in its sequence's [E * C] buffer, E * C if dropped;
  kept mask), both [b, t, k].

  Queue order within an expert: all first choices, then second choices..., each by
  original token index; order[p] is the original index of position p (None: positions
  are original). A reordered sequence is queued in original order and its slots moved
  back: a gather of the ids, small next to the tokens.
  """
  if order is not None and np.any(order != np.arange(len(order))):
    slots, keep = capacity_slots(ids[:, np.argsort(order)], num_experts, cap)
    return slots[:, order], keep[:, order]
  b, t, k = ids.shape
  by_rank = jnp.swapaxes(ids, 1, 2).reshape(b, k * t)                # [b, k*t]
  onehot = jax.nn.one_hot(by_rank, num_experts, dtype=jnp.int32)     # [b, k*t, e]
  pos = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # place in its queue
  pos = jnp.swapaxes(pos.reshape(b, k, t), 1, 2)                     # [b, t, k]
  keep = pos < cap
  return jnp.where(keep, ids * cap + pos, num_experts * cap), keep


def dispatch(x, slots, num_experts: int, cap: int):
  """x [b,t,d] -> expert buffers [b, e, c, d]; empty slots hold zeros."""
  b, t, k = slots.shape
  token = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, k)).reshape(-1)
  # Which token fills each slot (t: none); the extra last slot collects the dropped.
  source = jnp.full((b, num_experts * cap + 1), t, jnp.int32)
  source = source.at[jnp.arange(b)[:, None], slots.reshape(b, t * k)].set(token[None])
  x_pad = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
  buffers = jnp.take_along_axis(x_pad, source[:, :-1, None], axis=1)
  return buffers.reshape(b, num_experts, cap, x.shape[-1])


def combine(y, slots, weights):
  """Expert outputs [b, e, c, d] -> [b, t, d]: each token's k outputs, weighted."""
  b, t, k = slots.shape
  y = y.reshape(b, -1, y.shape[-1])
  y_pad = jnp.concatenate([y, jnp.zeros_like(y[:, :1])], axis=1)     # dropped: zeros
  picked = jnp.take_along_axis(y_pad, slots.reshape(b, t * k, 1), axis=1)
  return jnp.einsum('btkd,btk->btd', picked.reshape(b, t, k, -1), weights.astype(y.dtype))


def capacity_experts(x, ids, weights, experts, cfg: ModelConfig, plan, targets=()):
  """(out [b,t,d], dropped (token, choice) pairs). experts: the three expert weights,
  then the adapters of `targets` (lora_adapters)."""
  cap = capacity(cfg, x.shape[1])
  slots, keep = capacity_queue(ids, cfg, plan)
  buffers = dispatch(x, slots, cfg.num_experts, cap)
  ffn = functools.partial(expert_swiglu, targets=targets)
  if moe_sharding.expert_shards(plan) > 1:
    y = moe_sharding.all_to_all_experts(plan, ffn, buffers, experts)
  else:
    buffers = constrain(buffers, ('batch', None, None, 'act_embed'), plan)
    y = ffn(buffers, *experts)
  dropped = jnp.sum(1 - keep.astype(jnp.float32))
  return combine(y, slots, weights), dropped


# ---------------------------------------------------------------------- dropless dispatch

def dropless_local(x, ids, weights, first_expert, w_gate, w_up, w_down, *adapters,
                   targets=()):
  """x [n, d]; ids, weights [n, k]. The output [n, d] of experts first_expert ... +
  len(w_gate) - 1 only: their (token, choice) pairs sorted by expert, one grouped matmul
  (jax.lax.ragged_dot; on CPU a masked dense matmul, local experts x the FLOPs), and the
  adapters of `targets` as two more grouped matmuls each."""
  n, k = ids.shape
  num_local = w_gate.shape[0]
  expert = ids.reshape(-1) - first_expert
  mine = (expert >= 0) & (expert < num_local)
  key = jnp.where(mine, expert, num_local)                    # others sort last, unused
  order = jnp.argsort(key, stable=True)
  sizes = jnp.sum(jax.nn.one_hot(key, num_local, dtype=jnp.int32), axis=0)
  xs = x[order // k]
  ab = _adapter_pairs(targets, adapters)
  gate = _grouped_project(xs, w_gate, ab.get('experts_gate'), sizes)
  up = _grouped_project(xs, w_up, ab.get('experts_up'), sizes)
  ys = _grouped_project(jax.nn.silu(gate) * up, w_down, ab.get('experts_down'), sizes)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
  y = ys[inverse].reshape(n, k, -1)                           # rows past the groups: 0
  return jnp.einsum('nkd,nk->nd', y, weights.astype(x.dtype))


def _grouped_project(xs, w, ab, sizes):
  """Rows xs [m, i] sorted by expert (group sizes `sizes`) @ their expert's w [e, i, o],
  plus (xs @ a) @ b of their expert when ab = (a, b)."""
  y = jax.lax.ragged_dot(xs, w.astype(xs.dtype), sizes)
  if ab is None:
    return y
  h = jax.lax.ragged_dot(xs, ab[0].astype(xs.dtype), sizes)
  return y + jax.lax.ragged_dot(h, ab[1].astype(xs.dtype), sizes)


def dropless_experts(x, ids, weights, experts, plan, targets=()):
  local = functools.partial(dropless_local, targets=targets)
  if plan is not None:
    return moe_sharding.all_gather_experts(plan, local, x, ids, weights, experts)
  b, t, d = x.shape
  y = local(x.reshape(b * t, d), ids.reshape(b * t, -1), weights.reshape(b * t, -1),
            0, *experts)
  return y.reshape(b, t, d)


# ------------------------------------------------------------------------------ the layer

def moe_mlp(x, layer, cfg: ModelConfig, plan: ShardingPlan | None):
  """x [b,t,d] (normed) -> (routed + shared expert output [b,t,d], aux values)."""
  ids, weights, aux = route(x, layer['router'], cfg)
  targets, adapters = lora_adapters(layer)
  experts = (layer['we_gate'], layer['we_up'], layer['we_down']) + adapters
  if cfg.moe_dispatch == 'dropless':
    out, dropped = dropless_experts(x, ids, weights, experts, plan, targets), jnp.zeros(())
  else:
    out, dropped = capacity_experts(x, ids, weights, experts, cfg, plan, targets)
  if cfg.num_shared_experts:
    out = out + swiglu(x, layer['ws_gate'], layer['ws_up'], layer['ws_down'])
  return out, {**aux, 'dropped_tokens': dropped.astype(jnp.float32)}
