"""The training loss: the output head and the summed negative log-likelihood over
model/transformer.py's forward, in chunks of the sequence where model.loss_chunk asks."""

import math

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.params import Params
from model.transformer import forward_with_aux, softcap
from sharding.rules import ShardingPlan, constrain


def _per_shard(w, shards, axes, plan):
  """w broadcast to [shards, *w.shape], the copies laid out like the batch."""
  return constrain(jnp.broadcast_to(w, (shards, *w.shape)), ('batch', *axes), plan)


def batch_shards(plan: ShardingPlan | None) -> int:
  """How many ways the plan splits the batch of activations (1 without a plan)."""
  if plan is None:
    return 1
  axes = plan.activations.table.get('batch') or ()
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(plan.mesh.shape[a] for a in axes)


def _weighted_nll(logits_btv, targets, weights):
  logz = jax.nn.logsumexp(logits_btv, axis=-1)
  picked = jnp.take_along_axis(logits_btv, targets[..., None], axis=-1)[..., 0]
  return jnp.sum((logz - picked) * weights)


@jax.custom_vjp
def head_logits(h: jax.Array, head: jax.Array) -> jax.Array:
  """float32 logits [s, b, c, v] of h [s, b, c, d] (the compute dtype) and the output head
  [s, d, v] (its master dtype, cast to h's here).

  The backward rounds the logits' float32 cotangent to h's dtype, so both its matmuls run
  in the compute dtype, as the forward does. jax's own transpose of the forward would run
  them in float32, since its cotangent is float32: several times the forward matmul's
  time for as many FLOPs on a GPU (docs/benchmarks.md, gpt_64k at 8,192 tokens). The
  head's gradient is accumulated and returned in float32, its master dtype. In float32
  this is the plain einsum's VJP. A custom VJP has no forward-mode rule: jax.jvp (jacfwd,
  hessian) of the loss raises; reverse mode, second order included, works.
  """
  return jnp.einsum('sbcd,sdv->sbcv', h, head.astype(h.dtype),
                    preferred_element_type=jnp.float32)


def _head_logits_fwd(h, head):
  return head_logits(h, head), (h, head)


def _head_logits_bwd(residuals, g):
  h, head = residuals
  g = g.astype(h.dtype)
  dh = jnp.einsum('sbcv,sdv->sbcd', g, head.astype(h.dtype),
                  preferred_element_type=jnp.float32).astype(h.dtype)
  dhead = jnp.einsum('sbcd,sbcv->sdv', h, g, preferred_element_type=jnp.float32)
  return dh, dhead.astype(head.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def summed_nll(params: Params, batch: dict, cfg: ModelConfig, plan=None,
               lora: Params | None = None) -> jax.Array:
  """Sum over tokens of weight * negative log-likelihood (float32)."""
  return summed_nll_and_aux(params, batch, cfg, plan, lora)[0]


def summed_nll_and_aux(params: Params, batch: dict, cfg: ModelConfig, plan=None,
                       lora: Params | None = None):
  """(sum over tokens of weight * negative log-likelihood (float32), MoE aux values).

  The weights that touch the vocabulary enter as one copy per batch shard, laid out like
  the batch (on each device, the gathered weights it would use anyway). Their gradients
  are then per-shard partial sums until the transpose of that copy reduces them, once:
  - a tied table's two uses, the lookup and the head, add up before the reduction (a
    shared table was reduced twice);
  - with loss chunks, the head is gathered once and its gradient reduced once (a shared
    head was gathered and reduced once per chunk).
  The copies keep the master dtype and are cast where used, so gradients add up in fp32.
  The cost is a whole fp32 gradient of those weights (vocab x d / tensor) per device
  while the step runs, which ZeRO-0/1 hold anyway.
  """
  shards = batch_shards(plan)
  embed = None
  if cfg.tie_embeddings:
    embed = _per_shard(params['embed'], shards, ('act_vocab', None), plan)
    head = jnp.swapaxes(embed, 1, 2)                                     # [shards, d, v]
  else:
    head = _per_shard(params['lm_head'], shards, (None, 'act_vocab'), plan)
  hidden, aux = forward_with_aux(params, batch['inputs'], cfg,
                                 positions=batch.get('positions'),
                                 segment_ids=batch.get('segment_ids'), plan=plan, embed=embed,
                                 lora=lora)
  targets, weights = batch['targets'], batch['weights'].astype(jnp.float32)
  t = hidden.shape[1]
  chunk = cfg.loss_chunk if 0 < cfg.loss_chunk < t else t
  if t % chunk:
    raise ValueError(f'model.loss_chunk={chunk} must divide the sequence length {t}.')

  def chunk_nll(h, tg, wt, head):   # h [shards, b / shards, chunk, d]
    with jax.named_scope('lm_head_loss'):
      out = softcap(head_logits(h, head), cfg.final_softcap)
      out = constrain(out, ('batch', None, 'act_seq', 'act_vocab'), plan)
      return _weighted_nll(out, tg, wt)

  if chunk < t:
    # Long sequences: never hold [b, t, vocab] logits; recompute each chunk's in backward.
    chunk_nll = jax.checkpoint(chunk_nll)

  def split(x):   # [b, t, ...] -> [t / chunk, shards, b / shards, chunk, ...]
    x = x.reshape(shards, x.shape[0] // shards, t // chunk, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 2, 0)

  def body(total, xs):
    return total + chunk_nll(*xs, head), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (split(hidden), split(targets), split(weights)))
  return total, aux
