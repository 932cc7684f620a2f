"""Flash attention in Pallas: causal / packed-document / sliding-window, grouped-query.

Layouts follow the model: q [B, T, Hq, D], k and v [B, S, Hkv, D]; query head h reads
kv head h // G with G = Hq // Hkv, picked by the index maps, so K/V are never repeated.

Three kernels, written in the portable Pallas style (grid + BlockSpecs, ref indexing with
pl.ds, lax.fori_loop over blocks) so they lower through Triton on GPU and run in the
interpreter on CPU:

  forward  grid (B, Hq, T/bq)    one q block; loops over the kv blocks it can see
  dk, dv   grid (B, Hkv, S/bk)   one kv block; loops over the G query heads of its
                                 group and, inside, the q blocks that can see it, so a
                                 kv head's gradient is summed in registers, no atomics
  dq       grid (B, Hq, T/bq)    one q block; loops over the kv blocks it can see

  keys ->        kv blocks visited by q block i (causal, window W):
  q   [x . . .]    lo = floor((i*bq - W + 1) / bk)   (0 without a window)
  |   [x x . .]    hi = ceil((i+1)*bq / bk)          (all blocks when not causal)
  v   [. x x .]  blocks outside [lo, hi) are never loaded; the mask only trims the edges.

With segment ids (packed documents) [lo, hi) narrows further to the blocks that hold
the block's own documents (document_block_ranges, [B, blocks, 4] computed outside the
kernels), so packed short documents cost about what each document's attention costs.

Lengths are padded to block multiples outside the custom_vjp (autodiff of pad/slice
then drops padded rows' gradients for free); padded keys are masked, padded rows sliced.
Head dims that are not a power of two >= 16 are zero-padded (Triton tiles need 2^n).
"""

import dataclasses
import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import flash_attention_mgpu
from pallas_kernels.documents import document_block_ranges

try:  # Triton's lowering is deprecated upstream from jax 0.11; the interpreter needs none.
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

# Running max starts finite: exp(m_old - m_new) stays 0 or 1, never NaN, even for a row
# whose every key so far is masked (scores there are -inf, so their p is exactly 0).
_M_INIT = -1e30


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static kernel parameters (hashable: it is a custom_vjp nondiff argument)."""
  causal: bool
  window: int | None
  scale: float
  block_q: int
  block_k: int
  block_q_bwd: int
  block_k_bwd: int
  groups: int             # query heads per kv head
  kv_len: int             # true S, before padding
  mask_kv_padding: bool   # padded keys are not already excluded by the causal mask
  interpret: bool
  num_warps: int
  num_stages: int
  poison: bool = False    # test only: outputs start as NaN, so unwritten blocks show
  # None: the portable kernels below; else flash_attention_mgpu's Hopper forward /
  # backward with these tiles (backend='mosaic_gpu', backend_bwd).
  mosaic_tiles: flash_attention_mgpu.MosaicTiles | None = None
  mosaic_bwd_tiles: flash_attention_mgpu.MosaicBwdTiles | None = None
  softcap: float | None = None   # scores -> softcap * tanh(scores / softcap) (Gemma 2)


# ---------------------------------------------------------------------------- masks, ranges

def _mask(q_pos, k_pos, q_seg, k_seg, cfg):
  """[bq, bk] bool of allowed (query, key) pairs, or None when everything is allowed."""
  q_pos, k_pos = q_pos[:, None], k_pos[None, :]
  conds = []
  if cfg.causal:
    conds.append(k_pos <= q_pos)
  if cfg.window is not None:
    conds.append(k_pos > q_pos - cfg.window)
  if cfg.mask_kv_padding:
    conds.append(k_pos < cfg.kv_len)
  if q_seg is not None:
    conds.append(q_seg[:, None] == k_seg[None, :])
  if not conds:
    return None
  return functools.reduce(jnp.logical_and, conds)


def _scores(q, k, q_pos, k_pos, q_seg, k_seg, cfg):
  """Scaled (and soft-capped) fp32 scores [bq, bk]; disallowed pairs are -inf so their
  p is exactly 0."""
  s = _dot(q, k, trans_b=True) * cfg.scale
  if cfg.softcap:
    s = cfg.softcap * jnp.tanh(s / cfg.softcap)
  mask = _mask(q_pos, k_pos, q_seg, k_seg, cfg)
  return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _uncap(ds, s, cfg):
  """dS of the scores before the soft cap: d(c tanh(x / c))/dx = 1 - (s / c)^2, with s
  the capped scores (-inf where masked, where dS is 0 already)."""
  if not cfg.softcap:
    return ds
  t = jnp.where(jnp.isneginf(s), 0.0, s / cfg.softcap)
  return ds * (1.0 - t * t)


def _dot(a, b, trans_a=False, trans_b=False):
  """fp32-accumulated matmul; fp32 inputs ask for IEEE (Triton defaults to TF32)."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, dims, precision=precision,
                         preferred_element_type=jnp.float32)


def _kv_block_range(i, block_q, block_k, num_kv_blocks, cfg):
  """Kv blocks [lo, hi) that q block i can see: the causal and window skipping."""
  lo, hi = 0, num_kv_blocks
  if cfg.causal:
    hi = jnp.minimum(lax.div((i + 1) * block_q + block_k - 1, block_k), num_kv_blocks)
  if cfg.window is not None:
    lo = lax.div(jnp.maximum(i * block_q - cfg.window + 1, 0), block_k)
  return lo, hi


def _clip_to_documents(lo, hi, doc_range_ref):
  """Narrows [lo, hi) to the blocks whose segment ids can meet this block's (packed
  documents: a q block needs only the kv blocks of its own documents, and vice versa)."""
  if doc_range_ref is None:
    return lo, hi
  return jnp.maximum(lo, doc_range_ref[0]), jnp.minimum(hi, doc_range_ref[1])


def _q_block_range(j, block_q, block_k, num_q_blocks, cfg):
  """Q blocks [lo, hi) that can see kv block j (the transpose of _kv_block_range)."""
  lo, hi = 0, num_q_blocks
  if cfg.causal:
    lo = lax.div(j * block_k, block_q)
  if cfg.window is not None:
    last_row = (j + 1) * block_k - 2 + cfg.window  # the last query whose window holds key
    hi = jnp.minimum(lax.div(last_row, block_q) + 1, num_q_blocks)
  return lo, hi


# ---------------------------------------------------------------------------- forward

def _fwd_kernel(q_ref,  # [block_q, head_dim]
                k_ref,  # [kv_len_padded, head_dim]  (the kv head of this q head)
                v_ref,  # [kv_len_padded, head_dim]
                q_seg_ref,  # [block_q] int32, or None
                kv_seg_ref,  # [kv_len_padded] int32, or None
                docs_ref,  # [4] int32: kv blocks [lo, hi) of this block's documents, or None
                o_ref,  # [block_q, head_dim]
                lse_ref,  # [block_q] float32
                *, cfg):
  bq, bk = cfg.block_q, cfg.block_k
  i = pl.program_id(2)
  q = q_ref[...]
  q_pos = i * bq + jnp.arange(bq)
  q_seg = None if q_seg_ref is None else q_seg_ref[...]

  def body(j, carry):
    acc, m, l = carry
    keys = pl.ds(j * bk, bk)
    k_seg = None if kv_seg_ref is None else kv_seg_ref[keys]
    s = _scores(q, k_ref[keys, :], q_pos, j * bk + jnp.arange(bk), q_seg, k_seg, cfg)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    alpha = jnp.exp(m - m_new)  # rescales what was summed under the old max
    l = alpha * l + jnp.sum(p, axis=1)
    v = v_ref[keys, :]
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
    return acc, m_new, l

  init = (jnp.zeros((bq, q.shape[-1]), jnp.float32),
          jnp.full((bq,), _M_INIT, jnp.float32), jnp.zeros((bq,), jnp.float32))
  lo, hi = _kv_block_range(i, bq, bk, k_ref.shape[0] // bk, cfg)
  lo, hi = _clip_to_documents(lo, hi, docs_ref)
  acc, m, l = lax.fori_loop(lo, hi, body, init)
  # l == 0 only for a row with no visible key: output 0 and lse -inf, not 0/0.
  seen = l > 0
  o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


# ---------------------------------------------------------------------------- backward

def _dkv_kernel(q_ref,  # [q_len_padded, groups, head_dim]  (the q heads of this kv head)
                k_ref,  # [block_k, head_dim]
                v_ref,  # [block_k, head_dim]
                do_ref,  # [q_len_padded, groups, head_dim]
                lse_ref,  # [groups, q_len_padded] float32, -inf replaced by 0
                delta_ref,  # [groups, q_len_padded] float32: rowsum(dO * O) - dlse
                q_seg_ref,  # [q_len_padded] int32, or None
                kv_seg_ref,  # [block_k] int32, or None
                docs_ref,  # [4] int32: q blocks [lo, hi) of this block's documents, or None
                dk_ref,  # [block_k, head_dim]
                dv_ref,  # [block_k, head_dim]
                *, cfg):
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
  j = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  k_pos = j * bk + jnp.arange(bk)
  k_seg = None if kv_seg_ref is None else kv_seg_ref[...]
  lo, hi = _q_block_range(j, bq, bk, q_ref.shape[0] // bq, cfg)
  lo, hi = _clip_to_documents(lo, hi, docs_ref)

  def q_block(i, carry, g):
    dk, dv = carry
    rows = pl.ds(i * bq, bq)
    q, do = q_ref[rows, g, :], do_ref[rows, g, :]
    q_seg = None if q_seg_ref is None else q_seg_ref[rows]
    s = _scores(q, k, i * bq + jnp.arange(bq), k_pos, q_seg, k_seg, cfg)
    p = jnp.exp(s - lse_ref[g, rows][:, None])
    dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
    # dS = P * (dP - delta); delta already carries -dlse, the lse cotangent's P term.
    ds = p * (_dot(do, v, trans_b=True) - delta_ref[g, rows][:, None])
    ds = _uncap(ds, s, cfg)
    dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
    return dk, dv

  def head(g, carry):
    return lax.fori_loop(lo, hi, functools.partial(q_block, g=g), carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, cfg.groups, head, (zeros, zeros))
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref,  # [block_q, head_dim]
               k_ref,  # [kv_len_padded, head_dim]
               v_ref,  # [kv_len_padded, head_dim]
               do_ref,  # [block_q, head_dim]
               lse_ref,  # [block_q] float32, -inf replaced by 0
               delta_ref,  # [block_q] float32
               q_seg_ref,  # [block_q] int32, or None
               kv_seg_ref,  # [kv_len_padded] int32, or None
               docs_ref,  # [4] int32: kv blocks [lo, hi) of this block's documents, or None
               dq_ref,  # [block_q, head_dim]
               *, cfg):
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
  i = pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
  q_pos = i * bq + jnp.arange(bq)
  q_seg = None if q_seg_ref is None else q_seg_ref[...]

  def body(j, dq):
    keys = pl.ds(j * bk, bk)
    k_seg = None if kv_seg_ref is None else kv_seg_ref[keys]
    k = k_ref[keys, :]
    s = _scores(q, k, q_pos, j * bk + jnp.arange(bk), q_seg, k_seg, cfg)
    p = jnp.exp(s - lse)
    ds = _uncap(p * (_dot(do, v_ref[keys, :], trans_b=True) - delta), s, cfg)
    return dq + _dot(ds.astype(k.dtype), k)

  lo, hi = _kv_block_range(i, bq, bk, k_ref.shape[0] // bk, cfg)
  lo, hi = _clip_to_documents(lo, hi, docs_ref)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


# ---------------------------------------------------------------------------- pallas_call wrappers

def _call(kernel, args, in_specs, out_shapes, out_specs, grid, cfg, name):
  """pallas_call with Triton settings; cfg.poison pre-fills every output with NaN."""
  kernel = functools.partial(kernel, cfg=cfg)
  aliases = {}
  if cfg.poison:
    junk = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shapes]
    first = len(jax.tree.leaves(args))  # aliases count flat inputs; None refs have none
    aliases = {first + n: n for n in range(len(junk))}
    kernel = _skip_junk_refs(kernel, len(args), len(junk))
    args, in_specs = (*args, *junk), [*in_specs, *out_specs]
  params = None
  if plgpu is not None:
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shapes,
      input_output_aliases=aliases, interpret=cfg.interpret, compiler_params=params,
      name=name)(*args)


def _skip_junk_refs(kernel, num_args, num_junk):
  """The aliased NaN buffers arrive as extra input refs; the kernel never reads them."""
  def wrapped(*refs):
    return kernel(*refs[:num_args], *refs[num_args + num_junk:])
  return wrapped


def _seg_spec(seg, block, index_map):
  return None if seg is None else pl.BlockSpec((None, block), index_map)


def _docs(rows_seg, cols_seg, block_rows, block_cols):
  """The document block ranges (document_block_ranges) and their BlockSpec: program
  (b, head, n) reads row block n's [lo, hi); None, None without segment ids."""
  if rows_seg is None:
    return None, None
  ranges = document_block_ranges(rows_seg, cols_seg, block_rows, block_cols)
  return ranges, pl.BlockSpec((None, None, 4), lambda bi, h, n: (bi, n, 0))


def _forward(q, k, v, q_seg, kv_seg, cfg):
  if cfg.mosaic_tiles is not None:
    # Poisoning is built in there: the interpreter fills fresh buffers with NaN.
    return flash_attention_mgpu.forward(q, k, v, cfg, cfg.mosaic_tiles, q_seg, kv_seg)
  b, t, hq, d = q.shape
  s, g, bq = k.shape[1], cfg.groups, cfg.block_q
  q_spec = pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0))
  kv_spec = pl.BlockSpec((None, s, None, d), lambda bi, h, i: (bi, 0, h // g, 0))
  docs, docs_spec = _docs(q_seg, kv_seg, bq, cfg.block_k)
  in_specs = [q_spec, kv_spec, kv_spec,
              _seg_spec(q_seg, bq, lambda bi, h, i: (bi, i)),
              _seg_spec(kv_seg, s, lambda bi, h, i: (bi, 0)), docs_spec]
  out_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, t), jnp.float32)]
  out_specs = [q_spec, pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i))]
  return _call(_fwd_kernel, (q, k, v, q_seg, kv_seg, docs), in_specs, out_shapes,
               out_specs, (b, hq, t // bq), cfg, 'flash_attention_fwd')


def _backward_dkv(q, k, v, do, lse, delta, q_seg, kv_seg, cfg):
  b, t, _, d = q.shape
  s, hkv, g, bk = k.shape[1], k.shape[2], cfg.groups, cfg.block_k_bwd
  # Block index kh on a head axis of block size g selects q heads [kh*g, (kh+1)*g).
  group_spec = pl.BlockSpec((None, t, g, d), lambda bi, kh, j: (bi, 0, kh, 0))
  stat_spec = pl.BlockSpec((None, g, t), lambda bi, kh, j: (bi, kh, 0))
  kv_spec = pl.BlockSpec((None, bk, None, d), lambda bi, kh, j: (bi, j, kh, 0))
  docs, docs_spec = _docs(kv_seg, q_seg, bk, cfg.block_q_bwd)
  in_specs = [group_spec, kv_spec, kv_spec, group_spec, stat_spec, stat_spec,
              _seg_spec(q_seg, t, lambda bi, kh, j: (bi, 0)),
              _seg_spec(kv_seg, bk, lambda bi, kh, j: (bi, j)), docs_spec]
  out_shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype),
                jax.ShapeDtypeStruct(v.shape, v.dtype)]
  return _call(_dkv_kernel, (q, k, v, do, lse, delta, q_seg, kv_seg, docs), in_specs,
               out_shapes, [kv_spec, kv_spec], (b, hkv, s // bk), cfg,
               'flash_attention_dkv')


def _backward_dq(q, k, v, do, lse, delta, q_seg, kv_seg, cfg):
  b, t, hq, d = q.shape
  s, g, bq = k.shape[1], cfg.groups, cfg.block_q_bwd
  q_spec = pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0))
  kv_spec = pl.BlockSpec((None, s, None, d), lambda bi, h, i: (bi, 0, h // g, 0))
  stat_spec = pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i))
  docs, docs_spec = _docs(q_seg, kv_seg, bq, cfg.block_k_bwd)
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec,
              _seg_spec(q_seg, bq, lambda bi, h, i: (bi, i)),
              _seg_spec(kv_seg, s, lambda bi, h, i: (bi, 0)), docs_spec]
  out_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  [dq] = _call(_dq_kernel, (q, k, v, do, lse, delta, q_seg, kv_seg, docs), in_specs,
               out_shapes, [q_spec], (b, hq, t // bq), cfg, 'flash_attention_dq')
  return dq


# ---------------------------------------------------------------------------- custom_vjp

@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, kv_seg, cfg):
  out, lse = _forward(q, k, v, q_seg, kv_seg, cfg)
  return out, lse


def _flash_fwd(q, k, v, q_seg, kv_seg, cfg):
  out, lse = _forward(q, k, v, q_seg, kv_seg, cfg)
  return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _flash_bwd(cfg, res, cotangents):
  q, k, v, q_seg, kv_seg, out, lse = res
  do, dlse = cotangents
  # d lse / d s = P, so dS = P * (dP - rowsum(dO * O) + dlse): fold dlse into delta.
  delta = jnp.einsum('bthd,bthd->bht', do.astype(jnp.float32), out.astype(jnp.float32))
  delta = delta - dlse
  # A row with no visible key has lse -inf and all scores -inf: exp(-inf - 0) = 0.
  lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
  if cfg.mosaic_bwd_tiles is not None:
    dq, dk, dv = flash_attention_mgpu.backward(q, k, v, do, lse, delta, cfg,
                                               cfg.mosaic_bwd_tiles, q_seg, kv_seg)
    return dq, dk, dv, None, None
  dk, dv = _backward_dkv(q, k, v, do, lse, delta, q_seg, kv_seg, cfg)
  dq = _backward_dq(q, k, v, do, lse, delta, q_seg, kv_seg, cfg)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------- public API

def flash_attention(q, k, v, *, causal=True, segment_ids=None, sliding_window=None,
                    return_lse=False, sm_scale=None, block_q=None, block_k=None,
                    block_q_bwd=None, block_k_bwd=None, num_warps=None, num_stages=None,
                    backend=None, backend_bwd=None, interpret=None, softcap=None,
                    _poison_outputs=False):
  """Flash attention with grouped-query heads; differentiable in q, k, v (and lse).

  Args:
    q: [B, T, Hq, D]; k, v: [B, S, Hkv, D] with Hq % Hkv == 0; all one float dtype.
    causal: query t sees keys s <= t (needs T == S).
    segment_ids: [B, T] int32 (needs T == S), or (q_ids [B, T], kv_ids [B, S]);
      a query sees only keys with its id. No gradient flows to them.
    sliding_window: W >= 1; query t sees keys in (t - W, t]. Needs causal=True.
    return_lse: also return lse [B, Hq, T] float32, the log-sum-exp of the scaled
      scores (-inf for a query that sees no key; its output is 0). Differentiable.
    sm_scale: score scale, default 1 / sqrt(D).
    block_q, block_k: forward tiles, powers of two >= 16; defaults fit the sequence and
      head dim.
    block_q_bwd, block_k_bwd: backward tiles (both backward kernels), powers of two >= 16;
      default: the forward tiles capped at 64 (32 for head_dim > 128).
    num_warps, num_stages: Triton launch parameters on GPU (ignored when interpreted);
      default 4 warps for head_dim <= 64, else 8; 2 pipeline stages.
      `benchmarks.attention --tiles` times alternatives.
    backend: the forward kernel. 'triton': the portable kernels above, through Pallas's
      Triton lowering on GPU. 'mosaic_gpu': flash_attention_mgpu's Hopper forward (TMA,
      wgmma, warp-specialized; bf16/fp16, head_dim 64/128/256); there block_k and
      num_stages set its K/V tile and pipeline depth and block_q must be 128 (two
      warpgroups of 64 rows). None (default): `default_backend` picks, 'mosaic_gpu' on
      a Hopper GPU for inputs it takes and no tiles named, else 'triton'.
    backend_bwd: the backward kernels, 'triton', 'mosaic_gpu' (flash_attention_mgpu's
      Hopper backward: bf16/fp16, head_dim 64/128; block_q_bwd and
      block_k_bwd in (64, 128) set its q and kv steps) or 'mosaic_gpu_fused' (its one-
      kernel backward: dQ summed in fp32 by TMA reduce-adds, 5 matmuls a block instead
      of 7, dQ's low bits not deterministic; block_q_bwd 64 only; not vmappable over an
      axis larger than 1: fold it into B). Default: `backend`,
      except that 'mosaic_gpu' at head_dim 256 takes the Triton backward.
    interpret: run the Pallas interpreter; default: when the backend is CPU.
    softcap: > 0: scores soft-capped, softcap * tanh(scores / softcap), after sm_scale
      and before the mask (Gemma 2), forward and backward; the portable kernels only
      (backend 'triton', chosen by default then).
    _poison_outputs: test only; kernel outputs start as NaN so unwritten blocks show.

  Returns:
    out [B, T, Hq, D] in q's dtype, or (out, lse) with return_lse.
  """
  _check_shapes(q, k, v, causal, sliding_window)
  b, t, hq, d = q.shape
  s = k.shape[1]
  q_seg, kv_seg = _split_segment_ids(segment_ids, b, t, s)
  scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
  if b * t * s == 0:
    return _no_keys_result(q, return_lse)
  tiles = dict(block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd,
               block_k_bwd=block_k_bwd, num_warps=num_warps, num_stages=num_stages)
  if backend is None:
    backend = 'triton' if softcap else default_backend(q, tiles, interpret)
  if softcap and (backend != 'triton' or backend_bwd not in (None, 'triton')):
    raise ValueError(f'softcap={softcap}: the Mosaic GPU kernels do not soft-cap; use '
                     "backend='triton' (and backend_bwd).")
  mosaic_tiles = _mosaic_tiles(backend, q, tiles)
  mosaic_bwd_tiles = _mosaic_bwd_tiles(backend, backend_bwd, q, tiles)
  cfg = _make_config(q, k, causal, sliding_window, scale, tiles, interpret, _poison_outputs,
                     mosaic_tiles, mosaic_bwd_tiles)
  cfg = dataclasses.replace(cfg, softcap=float(softcap) if softcap else None)
  t_pad = _round_up(t, _q_multiple(cfg))
  s_pad = _round_up(s, _kv_multiple(cfg))
  if causal:  # one length for both: the kernels' causal block ranges assume T == S
    t_pad = s_pad = _round_up(t, math.lcm(_q_multiple(cfg), _kv_multiple(cfg)))
  d_pad = max(16, pl.next_power_of_2(d))
  q, k, v = (_pad(x, {1: n, 3: d_pad}) for x, n in ((q, t_pad), (k, s_pad), (v, s_pad)))
  if q_seg is not None:
    q_seg, kv_seg = _pad(q_seg, {1: t_pad}), _pad(kv_seg, {1: s_pad})
  out, lse = _flash(q, k, v, q_seg, kv_seg, cfg)
  if (t_pad, d_pad) != (t, d):   # unpadded, out stays the kernel's own (one residual)
    out, lse = out[:, :t, :, :d], lse[:, :, :t]
  return (out, lse) if return_lse else out


def _check_shapes(q, k, v, causal, sliding_window):
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f'flash_attention wants q [B,T,Hq,D] and k, v [B,S,Hkv,D]; got '
                     f'q {q.shape}, k {k.shape}, v {v.shape}.')
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f'q {q.shape} and k {k.shape} differ in batch or head_dim.')
  if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
    raise ValueError(f'query heads ({q.shape[2]}) must be a multiple of kv heads '
                     f'({k.shape[2]}).')
  if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f'q, k, v must share one float dtype; got {q.dtype}, {k.dtype}, '
                     f'{v.dtype}.')
  if causal and q.shape[1] != k.shape[1]:
    raise ValueError(f'causal=True needs as many queries as keys (T={q.shape[1]}, '
                     f'S={k.shape[1]}); pass causal=False for cross attention.')
  if sliding_window is not None and (not causal or int(sliding_window) < 1):
    raise ValueError(f'sliding_window={sliding_window} needs causal=True and W >= 1: '
                     'it admits keys in (t - W, t].')


def _split_segment_ids(segment_ids, b, t, s):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = segment_ids
  else:
    if t != s:
      raise ValueError(f'one segment_ids array needs T == S (T={t}, S={s}); pass a '
                       '(q_segment_ids, kv_segment_ids) pair.')
    q_seg = kv_seg = segment_ids
  if q_seg.shape != (b, t) or kv_seg.shape != (b, s):
    raise ValueError(f'segment ids must be [B, T] and [B, S] = {(b, t)}, {(b, s)}; got '
                     f'{q_seg.shape}, {kv_seg.shape}.')
  return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def _no_keys_result(q, return_lse):
  """T == 0 gives empty outputs; S == 0 leaves every query without keys: 0 and -inf."""
  b, t, hq, _ = q.shape
  out = jnp.zeros_like(q)
  lse = jnp.full((b, hq, t), -jnp.inf, jnp.float32)
  return (out, lse) if return_lse else out


def default_backend(q, tiles=None, interpret=None, device=None) -> str:
  """The forward kernels when flash_attention is given no backend: 'mosaic_gpu' where it
  runs compiled on a Hopper GPU (compute capability 9.x: wgmma and TMA), takes q's dtype
  and head_dim, and no tile is named (tiles name one backend's own); else 'triton'.

  On Hopper the Mosaic GPU kernels run near cuDNN's speed and about twice the Triton
  ones' forward, as timed in bf16 at head_dim 128 and 64
  (benchmarks/results/attention_NVIDIA_H200.json; docs/benchmarks.md); other head dims,
  fp16 and short sequences are checked for correctness on the GPU (tests/test_gpu.py),
  not timed. Its backward follows it (two kernels: deterministic; the Triton backward at head_dim
  256), as `backend_bwd` says. Tiles are one backend's: a call that names any (tuned
  for the Triton kernels, say) keeps the Triton kernels; name backend='mosaic_gpu' to
  tile those.
  """
  device = device or jax.devices()[0]
  tiles_named = any(v is not None for v in (tiles or {}).values())
  if interpret or tiles_named or device.platform != 'gpu':
    return 'triton'
  if _major_version(getattr(device, 'compute_capability', None)) != 9:
    return 'triton'
  if flash_attention_mgpu.unsupported_reason(q):
    return 'triton'
  return 'mosaic_gpu'


def _major_version(capability) -> int | None:
  """9 from '9.0', 9.0, (9, 0) or 9 (jax's CUDA devices say '9.0'); None if unreadable."""
  if isinstance(capability, (tuple, list)):
    capability = capability[0] if capability else None
  try:
    return int(str(capability).split('.')[0])
  except ValueError:
    return None


def _mosaic_tiles(backend, q, tiles):
  """MosaicTiles for backend='mosaic_gpu' (taking block_k and num_stages out of `tiles`),
  None for 'triton'; a clear error for inputs or tiles that backend cannot take."""
  if backend in (None, 'triton'):
    return None
  if backend != 'mosaic_gpu':
    raise ValueError(f"backend={backend!r}: use 'triton' or 'mosaic_gpu'.")
  why = flash_attention_mgpu.unsupported_reason(q)
  if why:
    raise ValueError(f"backend='mosaic_gpu' does not take {why}; use backend='triton'.")
  block_q = tiles.pop('block_q')
  rows = flash_attention_mgpu.COMPUTE_WGS * flash_attention_mgpu.MosaicTiles.block_q
  if block_q not in (None, rows):
    raise ValueError(f"backend='mosaic_gpu' takes block_q={rows} (two warpgroups of "
                     f'{rows // 2} rows); got {block_q}.')
  d = q.shape[-1]
  default = flash_attention_mgpu.MosaicTiles.default(d)
  mosaic = flash_attention_mgpu.MosaicTiles(
      block_k=tiles.pop('block_k') or default.block_k,
      stages=tiles.pop('num_stages') or default.stages)
  if mosaic.block_k % 64 or not 64 <= mosaic.block_k <= 256 or mosaic.stages < 1:
    raise ValueError(f"backend='mosaic_gpu' takes block_k in (64, 128, 192, 256) and "
                     f'num_stages >= 1; got {mosaic.block_k}, {mosaic.stages}.')
  _check_smem(mosaic, d, f'block_k={mosaic.block_k} x num_stages={mosaic.stages}',
              'fewer stages or a smaller block_k')
  return mosaic


def _check_smem(mosaic, d, tiles_named, fix):
  need = mosaic.smem_bytes(d)
  if need > flash_attention_mgpu.SMEM_LIMIT:
    raise ValueError(f'{tiles_named} at head_dim {d} needs {need // 1024} KiB of shared '
                     f'memory, over the {flash_attention_mgpu.SMEM_LIMIT // 1024} KiB of an '
                     f'H100: use {fix}.')


def _mosaic_bwd_tiles(backend, backend_bwd, q, tiles):
  """MosaicBwdTiles when the backward runs on Mosaic GPU (taking block_q_bwd and
  block_k_bwd out of `tiles`), else None; a clear error for what it cannot take."""
  d = q.shape[-1]
  if backend_bwd is None:
    backend_bwd = backend
    if backend == 'mosaic_gpu' and d not in flash_attention_mgpu.BWD_HEAD_DIMS:
      backend_bwd = 'triton'
  if backend_bwd in (None, 'triton'):
    return None
  if backend_bwd not in ('mosaic_gpu', 'mosaic_gpu_fused'):
    raise ValueError(f"backend_bwd={backend_bwd!r}: use 'triton', 'mosaic_gpu' or "
                     "'mosaic_gpu_fused'.")
  why = flash_attention_mgpu.unsupported_reason(q)
  if why is None and d not in flash_attention_mgpu.BWD_HEAD_DIMS:
    why = f'head_dim {d} (it takes {flash_attention_mgpu.BWD_HEAD_DIMS})'
  if why:
    raise ValueError(f"backend_bwd={backend_bwd!r} does not take {why}; use "
                     "backend_bwd='triton'.")
  mosaic = flash_attention_mgpu.MosaicBwdTiles(
      block_q=tiles.pop('block_q_bwd') or flash_attention_mgpu.MosaicBwdTiles.block_q,
      block_k=tiles.pop('block_k_bwd') or flash_attention_mgpu.MosaicBwdTiles.block_k,
      fused=backend_bwd == 'mosaic_gpu_fused')
  if mosaic.block_q not in (64, 128) or mosaic.block_k not in (64, 128):
    raise ValueError(f'backend_bwd={backend_bwd!r} takes block_q_bwd and block_k_bwd in '
                     f'(64, 128); got {mosaic.block_q}, {mosaic.block_k}.')
  _check_smem(mosaic, d, f'block_q_bwd={mosaic.block_q}, block_k_bwd={mosaic.block_k}',
              '64 for both')
  return mosaic


def _make_config(q, k, causal, window, scale, tiles, interpret, poison, mosaic_tiles=None,
                 mosaic_bwd_tiles=None):
  _, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  if interpret is None:
    interpret = jax.default_backend() == 'cpu'
  default_q, default_k = (128, 64) if d <= 128 else (64, 32)
  # Backward tiles hold two fp32 accumulators per program: keep them smaller.
  bwd_cap = 64 if d <= 128 else 32
  if q.dtype == jnp.float32 and not interpret:
    # fp32 dots run on FMA units with operands in registers: Triton's sm_90 code for
    # 128x64 tiles spills ~10 KB per thread, 64x32 none (benchmarks.kernel_resources).
    default_q, default_k, bwd_cap = min(default_q, 64), min(default_k, 32), 32
  block_q = tiles.get('block_q') or _fit_block(default_q, t)
  block_k = tiles.get('block_k') or _fit_block(default_k, s)
  block_q_bwd = tiles.get('block_q_bwd') or min(block_q, bwd_cap)
  block_k_bwd = tiles.get('block_k_bwd') or min(block_k, bwd_cap)
  for name, block in (('block_q', block_q), ('block_k', block_k),
                      ('block_q_bwd', block_q_bwd), ('block_k_bwd', block_k_bwd)):
    if block < 16 or block & (block - 1):
      raise ValueError(f'{name}={block} must be a power of two >= 16.')
  num_warps = tiles.get('num_warps') or (4 if d <= 64 else 8)
  num_stages = tiles.get('num_stages') or 2
  cfg = _Config(
      causal=causal, window=None if window is None else int(window), scale=scale,
      block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd, block_k_bwd=block_k_bwd,
      groups=hq // hkv, kv_len=s, mask_kv_padding=False, interpret=bool(interpret),
      num_warps=num_warps, num_stages=num_stages, poison=poison, mosaic_tiles=mosaic_tiles,
      mosaic_bwd_tiles=mosaic_bwd_tiles)
  # Causal attention never lets a real query see a padded key; other masks must.
  return dataclasses.replace(cfg, mask_kv_padding=not causal and s % _kv_multiple(cfg) != 0)


def _q_multiple(cfg):
  """Padded lengths serve the forward and both backward kernels."""
  fwd = cfg.block_q
  if cfg.mosaic_tiles is not None:
    fwd = flash_attention_mgpu.COMPUTE_WGS * cfg.mosaic_tiles.block_q
  bwd = cfg.mosaic_bwd_tiles
  bwd = cfg.block_q_bwd if bwd is None else math.lcm(_mosaic_bwd_rows(bwd), bwd.block_q)
  return math.lcm(fwd, bwd)


def _kv_multiple(cfg):
  fwd = cfg.block_k if cfg.mosaic_tiles is None else cfg.mosaic_tiles.block_k
  bwd = cfg.mosaic_bwd_tiles
  bwd = cfg.block_k_bwd if bwd is None else math.lcm(_mosaic_bwd_rows(bwd), bwd.block_k)
  return math.lcm(fwd, bwd)


def _mosaic_bwd_rows(tiles):
  """Rows (query rows in dq, key rows in dk/dv) of one Mosaic backward program."""
  return flash_attention_mgpu.COMPUTE_WGS * tiles.rows


def _fit_block(default, length):
  """Short sequences get a smaller tile, so a 20-token sequence is not padded to 128."""
  return max(16, min(default, pl.next_power_of_2(length)))


def _round_up(n, block):
  return -(-n // block) * block


def _pad(x, sizes):
  """Zero-pads the axes in `sizes` (axis -> new length) at the end."""
  widths = [(0, sizes.get(axis, n) - n) for axis, n in enumerate(x.shape)]
  return jnp.pad(x, widths) if any(w for _, w in widths) else x


# ---------------------------------------------------------------------------- reference

def flash_attention_reference(q, k, v, *, causal=True, segment_ids=None,
                              sliding_window=None, sm_scale=None, return_lse=False,
                              softcap=None):
  """Pure jnp, fp32 math, same semantics; GQA by reshaping q to [B,T,Hkv,G,D]."""
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
  hi = lax.Precision.HIGHEST
  scores = jnp.einsum('btkgd,bskd->bkgts', qg, k.astype(jnp.float32), precision=hi) * scale
  if softcap:
    scores = softcap * jnp.tanh(scores / softcap)
  mask = _reference_mask(t, s, causal, sliding_window, segment_ids)
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  # Softmax is shift invariant, so the max needs no gradient; a row with no key has
  # max -inf, shifted by 0 instead so that exp gives 0 rather than NaN.
  m = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf))
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  e = jnp.exp(scores - m)
  l = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(l > 0, l, 1.0)
  out = jnp.einsum('bkgts,bskd->btkgd', p, v.astype(jnp.float32), precision=hi)
  out = out.reshape(b, t, hq, d).astype(q.dtype)
  if not return_lse:
    return out
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return out, lse[..., 0].reshape(b, hq, t)


def _reference_mask(t, s, causal, window, segment_ids):
  """[B or 1, T, S] bool."""
  q_pos, k_pos = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
  mask = jnp.ones((1, t, s), bool)
  if causal:
    mask = mask & (k_pos <= q_pos)
  if window is not None:
    mask = mask & (k_pos > q_pos - window)
  if segment_ids is not None:
    q_seg, kv_seg = (segment_ids if isinstance(segment_ids, (tuple, list))
                     else (segment_ids, segment_ids))
    mask = mask & (jnp.asarray(q_seg)[:, :, None] == jnp.asarray(kv_seg)[:, None, :])
  return mask
