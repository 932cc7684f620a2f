"""Context parallelism: attention with the sequence split over the mesh axis 'context'.

The residual stream, queries, keys and values are split on the sequence over N =
mesh.context devices (the 'seq'/'act_seq' rules); everything outside attention is
per-token, so only attention needs the other devices' keys. Two strategies
(parallel.context_strategy):

- all_gather: keys and values are constrained whole on the sequence (XLA all-gathers
  them), queries stay split; each device attends its queries to every key.
- ring: in shard_map, each device keeps its queries and passes its K/V chunk around the
  ring with collective permutes, N steps; each step attends the local queries to the
  visiting chunk (skipped when every pair is masked) and merges the partial results by
  their log-sum-exp. The backward (custom VJP) makes the same trip: the visiting chunk
  comes with accumulators for its dK and dV, which are back at their owner after N
  steps; no step holds more than two chunks of K/V.

Causal load balance (parallel.context_load_balance): with a causal mask, the device with
the last chunk of the sequence has N times the work of the first. The batch is therefore
reordered once at the input (`reorder_batch`): the sequence is cut into 2N chunks and
device i holds chunks i and 2N-1-i, with inputs, targets, weights, positions and segment
ids moved alike (the loss is a sum over tokens, so it does not change). Attention masks
then compare original token indices (`token_order`), not array positions, and MoE
capacity queues tokens by them (model/moe.py: the same tokens drop as on one device).

Packed documents: segment ids travel with their tokens (and with the K/V chunks round
the ring); a query sees keys of its own document only.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AXIS = 'context'
STRATEGIES = ('all_gather', 'ring')
_NEG = -jnp.inf


def context_size(plan) -> int:
  return 1 if plan is None else plan.mesh.shape[AXIS]


def load_balance_order(seq_len: int, n: int) -> np.ndarray:
  """The original index of each array position after the load-balance reorder: the
  sequence cut into 2n chunks, laid out as chunk 0, 2n-1, 1, 2n-2, ..., so device i's
  contiguous share is chunks i and 2n-1-i."""
  if seq_len % (2 * n):
    raise ValueError(f'sequence length {seq_len} does not split into 2 x mesh.context = '
                     f'{2 * n} chunks for causal load balance: choose a multiple of {2 * n}.')
  chunks = np.arange(seq_len).reshape(2 * n, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]])
                         for i in range(n)])


def token_order(plan, seq_len: int) -> np.ndarray:
  """Original token index at each position of the (possibly reordered) sequence."""
  n = context_size(plan)
  if n > 1 and plan.context_load_balance:
    return load_balance_order(seq_len, n)
  return np.arange(seq_len)


def reorder_batch(batch: dict, plan) -> dict:
  """The load-balance reorder of every [batch, seq] array of a training batch (no-op
  without context parallelism or with load balance off)."""
  n = context_size(plan)
  if n == 1 or not plan.context_load_balance:
    return batch
  seq_len = batch['inputs'].shape[1]
  order = jnp.asarray(load_balance_order(seq_len, n))
  return {k: (v[:, order] if v.ndim >= 2 and v.shape[1] == seq_len else v)
          for k, v in batch.items()}


# ---------------------------------------------------------------------- the two strategies

def attention(q, k, v, segment_ids, plan, constrain, flash=None):
  """q [b, t, h, d], k/v [b, t, hkv, d] (split on t over 'context') -> [b, t, h, d].
  `constrain(x, logical_axes, plan)` pins a layout (sharding.rules.constrain). flash:
  the flash-attention kernel (pallas_kernels.flash_attention's signature, with
  return_lse) for the ring's blocks; None: jnp blocks."""
  order = token_order(plan, q.shape[1])
  if plan.context_strategy == 'ring':
    return _ring(q, k, v, segment_ids, plan, order, flash)
  if flash is not None:
    raise ValueError("the flash kernel runs under context parallelism in the 'ring' "
                     'strategy only: set --config.parallel.context_strategy=ring.')
  kv_axes = ('batch', None, 'act_kv_heads', None)   # whole on the sequence: all-gathered
  k, v = constrain(k, kv_axes, plan), constrain(v, kv_axes, plan)
  segs = _segments(segment_ids, q.shape[:2])
  o, _ = _block(q, k, v, jnp.asarray(order), jnp.asarray(order), segs, segs)
  return constrain(o.astype(q.dtype), ('batch', 'act_seq', 'act_heads', None), plan)


def _segments(segment_ids, shape):
  """Segment ids, or one segment for all when there are none."""
  return jnp.zeros(shape, jnp.int32) if segment_ids is None else segment_ids


def _block(q, k, v, q_idx, kv_idx, q_seg, kv_seg):
  """Attention of q to one block of keys with its log-sum-exp: o [b, t, h, d] float32,
  lse [b, t, h] (-inf for a query that sees no key here; its o is 0). A query sees keys
  whose original index is not after its own and whose segment is its own."""
  b, t, h, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, t, hkv, h // hkv, d)
  hi = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  scores = jnp.einsum('btkgd,bskd->bkgts', qg, k, precision=hi,
                      preferred_element_type=jnp.float32) / np.sqrt(d)
  mask = (kv_idx[None, None, :] <= q_idx[None, :, None]) & (
      q_seg[:, :, None] == kv_seg[:, None, :])                              # [b, t, s]
  scores = jnp.where(mask[:, None, None], scores, _NEG)
  m = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  e = jnp.exp(scores - m)
  l = jnp.sum(e, axis=-1, keepdims=True)
  o = jnp.einsum('bkgts,bskd->btkgd', e / jnp.where(l > 0, l, 1.0), v.astype(jnp.float32),
                 precision=hi)
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), _NEG)[..., 0]   # [b,k,g,t]
  return o.reshape(b, t, h, d), jnp.moveaxis(lse.reshape(b, h, t), 1, 2)


# ------------------------------------------------------------------------------ the ring

def _ring(q, k, v, segment_ids, plan, order, flash):
  spec = plan.activations.spec
  q_spec = spec(('batch', 'act_seq', 'act_heads', None))
  kv_spec = spec(('batch', 'act_seq', 'act_kv_heads', None))
  seg_spec = spec(('batch', 'act_seq'))
  segs = _segments(segment_ids, q.shape[:2])
  n = context_size(plan)
  block = _block_or_nothing
  if flash is not None:   # sub-chunks of the load-balance layout (2 per device) or 1
    chunks = 2 if plan.context_load_balance else 1
    block = functools.partial(_flash_blocks, flash=flash, chunks=chunks)
  fn = functools.partial(_ring_local, n=n, order=order, block=block)
  out = jax.shard_map(fn, mesh=plan.mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                      out_specs=q_spec, check_vma=False)(q, k, v, segs)
  return out


def _local_order(order, n):
  """This device's original token indices (inside shard_map)."""
  size = len(order) // n
  return lax.dynamic_slice_in_dim(jnp.asarray(order, jnp.int32),
                                  lax.axis_index(AXIS) * size, size)


def _ring_local(q, k, v, seg, *, n, order, block):
  idx = _local_order(order, n)
  return _ring_attention(q, k, v, idx, seg, n, block)


def _shift(xs, n):
  """Every device's chunk to the next device on the ring."""
  perm = [(j, (j + 1) % n) for j in range(n)]
  return jax.tree.map(lambda x: lax.ppermute(x, AXIS, perm), xs)


def _visible(q_idx, kv_idx, q_seg, kv_seg):
  """Whether any query of this device sees any key of the visiting chunk."""
  causal = jnp.min(kv_idx) <= jnp.max(q_idx)
  same_doc = jnp.any(q_seg[:, :, None] == kv_seg[:, None, :])
  return causal & same_doc


def _block_or_nothing(q, k, v, q_idx, kv_idx, q_seg, kv_seg):
  """_block, or (0, -inf) at once when every pair is masked."""
  b, t, h, d = q.shape
  nothing = lambda *_: (jnp.zeros((b, t, h, d), jnp.float32),
                        jnp.full((b, t, h), _NEG, jnp.float32))
  return lax.cond(_visible(q_idx, kv_idx, q_seg, kv_seg), _block, nothing,
                  q, k, v, q_idx, kv_idx, q_seg, kv_seg)


def _flash_blocks(q, k, v, q_idx, kv_idx, q_seg, kv_seg, *, flash, chunks):
  """The visiting K/V attended by the flash kernel: both sides cut into `chunks` pieces
  of consecutive original tokens (aligned to one grid), so each pair of pieces is fully
  visible (causal=False), the same piece (causal=True) or fully masked (skipped)."""
  size = q.shape[1] // chunks
  piece = lambda x, i: lax.slice_in_dim(x, i * size, (i + 1) * size, axis=1)
  b, _, h, d = q.shape

  def full(qa, kb, vb, sa, sb):
    return _flash_out(flash(qa, kb, vb, causal=False, segment_ids=(sa, sb), return_lse=True))

  def diagonal(qa, kb, vb, sa, sb):
    return _flash_out(flash(qa, kb, vb, causal=True, segment_ids=(sa, sb), return_lse=True))

  def nothing(*_):
    return (jnp.zeros((b, size, h, d), jnp.float32),
            jnp.full((b, size, h), _NEG, jnp.float32))

  outs = []
  for a in range(chunks):
    o, lse = nothing()
    q_first = q_idx[a * size]
    for c in range(chunks):
      kv_first = kv_idx[c * size]
      mode = jnp.where(kv_first == q_first, 2, jnp.where(kv_first + size <= q_first, 1, 0))
      o, lse = _merge(o, lse, *lax.switch(
          mode, (nothing, full, diagonal), piece(q, a), piece(k, c), piece(v, c),
          piece(q_seg, a), piece(kv_seg, c)))
    outs.append((o, lse))
  return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*outs))


def _flash_out(out):
  o, lse = out                                               # [b, t, h, d], [b, h, t]
  return o.astype(jnp.float32), jnp.moveaxis(lse, 1, 2)


def _merge(o, lse, o_blk, lse_blk):
  """Two partial results by their log-sum-exps; -inf (no key seen) on either side or
  both, with gradients free of NaN (it is differentiated inside _flash_blocks)."""
  m = jnp.maximum(lse, lse_blk)
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  w_old, w_blk = jnp.exp(lse - m), jnp.exp(lse_blk - m)   # exp(-inf) = 0
  total = w_old + w_blk
  seen = total > 0
  total = jnp.where(seen, total, 1.0)
  new = jnp.where(seen, m + jnp.log(total), _NEG)
  return (o * (w_old / total)[..., None] + o_blk * (w_blk / total)[..., None]), new


def _forward(q, k, v, idx, seg, n, block):
  b, t, h, d = q.shape

  def attend(o, lse, kv):
    return _merge(o, lse, *block(q, kv[0], kv[1], idx, kv[2], seg, kv[3]))

  def step(_, carry):
    o, lse, kv = carry
    return *attend(o, lse, kv), _shift(kv, n)

  init = (jnp.zeros((b, t, h, d), jnp.float32), jnp.full((b, t, h), _NEG, jnp.float32),
          (k, v, idx, seg))
  o, lse, kv = lax.fori_loop(0, n - 1, step, init)
  return attend(o, lse, kv)   # the last chunk stays where it is


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring_attention(q, k, v, idx, seg, n, block):
  """block(q, k, v, q_idx, kv_idx, q_seg, kv_seg) -> (o float32, lse) of one visiting
  chunk: _block_or_nothing (jnp) or _flash_blocks."""
  return _forward(q, k, v, idx, seg, n, block)[0].astype(q.dtype)


def _ring_fwd(q, k, v, idx, seg, n, block):
  o, lse = _forward(q, k, v, idx, seg, n, block)
  return o.astype(q.dtype), (q, k, v, idx, seg, o, lse)


def _ring_bwd(n, block, res, do):
  """Each step recomputes one block's (o_s, lse_s) under jax.vjp and pulls back the
  merged output's cotangent: d o_s = w_s do and d lse_s = w_s (<do, o_s> - <do, o>),
  with w_s = exp(lse_s - lse). dq stays here; dK and dV ride with their chunk."""
  q, k, v, idx, seg, o, lse = res
  do = do.astype(jnp.float32)
  do_o = jnp.sum(do * o, axis=-1)                                           # [b, t, h]
  zero_grads = lambda k_, v_: (jnp.zeros(k_.shape, jnp.float32),
                               jnp.zeros(v_.shape, jnp.float32))

  def one_block(q, k_, v_, kv_idx, kv_seg):
    (o_s, lse_s), pull = jax.vjp(
        lambda q, k_, v_: block(q, k_, v_, idx, kv_idx, seg, kv_seg), q, k_, v_)
    w = jnp.where(jnp.isneginf(lse_s), 0.0, jnp.exp(lse_s - jnp.where(
        jnp.isneginf(lse), 0.0, lse)))
    d_lse = w * (jnp.sum(do * o_s, axis=-1) - do_o)
    dq, dk, dv = pull((w[..., None] * do, d_lse))
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

  def nothing(q, k_, v_, kv_idx, kv_seg):
    del kv_idx, kv_seg
    return (jnp.zeros(q.shape, jnp.float32), *zero_grads(k_, v_))

  def attend(dq, kv, dkv):
    k_, v_, kv_idx, kv_seg = kv
    dq_s, dk_s, dv_s = lax.cond(_visible(idx, kv_idx, seg, kv_seg), one_block, nothing,
                                q, k_, v_, kv_idx, kv_seg)
    return dq + dq_s, (dkv[0] + dk_s, dkv[1] + dv_s)

  def step(_, carry):
    dq, kv, dkv = carry
    dq, dkv = attend(dq, kv, dkv)
    return dq, _shift(kv, n), _shift(dkv, n)

  init = (jnp.zeros(q.shape, jnp.float32), (k, v, idx, seg), zero_grads(k, v))
  dq, kv, dkv = lax.fori_loop(0, n - 1, step, init)
  dq, dkv = attend(dq, kv, dkv)
  dk, dv = _shift(dkv, n)   # the n-th move brings each chunk's dK, dV home
  # Integer inputs take no cotangent (float0 zeros).
  none = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), none(idx), none(seg)


_ring_attention.defvjp(_ring_fwd, _ring_bwd)

