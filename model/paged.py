"""The cached forward pass for serving: the training block, with K/V kept in pages.

Reads top-down: the ragged batch and the cache -> writing new K/V into page slots ->
paged attention (XLA or Pallas, per tensor shard) -> the layer scan -> sampled logits.
Projections, RoPE, norms, the MLP and the residual block are model.transformer's own.

A step takes a flat ragged batch: the tokens of every scheduled chunk (decode tokens and
prefill chunks) concatenated along one axis, then padding up to a bucketed size T.

    tokens     | seq 0: 1 decode token | seq 1: prefill chunk of 5 | pad pad pad |
    slots      | page*size + offset    | ...                        | P*size ...  |  <- past
                                                                                  the end:
    Each layer first scatters the step's K and V into their slots, then attends through
    the ragged paged interface (q [T, Hq, D], pages [P, page, Hkv, D], kv_lens,
    page_indices, cu_q_lens, num_seqs), so a chunk sees its cached prefix and itself;
    the layer's pages are read in place in the stacked cache (layer_pages).

The cache is a pair (k, v), each [L, P, page, Hkv, D], carried through the layer scan and
updated in place (the caller donates it); an 8-bit cache (--kv-cache-dtype, model.kv_quant)
is (k, v, k_scale, v_scale), the scales [L, P, page, Hkv] float32, one per slot and kv
head, written by the same scatter. Padding rows write to slot P * page_size, a
page index past the end that the scatter drops: a negative "no slot" index would wrap
onto the last page.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from model import kv_quant
from model import lora as lora_lib
from model.config import ModelConfig
from model.transformer import (RESIDUAL, Params, Rope, Ropes, by_layer_window,
                               embed_scaled, logits, model_rope, norm, output_projection,
                               project_qkv, residual_block, with_layer_kinds)
from pallas_kernels.paged_attention import paged_attention, paged_attention_xla
from sharding.rules import ShardingPlan, constrain

# Logical axes of one cache array [layers, pages, page slot, kv heads, head dim].
KV_CACHE_AXES = ('layers', None, None, 'kv_heads', 'head_dim')
# ... and of an 8-bit cache's scales [layers, pages, page slot, kv heads].
KV_SCALE_AXES = KV_CACHE_AXES[:-1]
# XLA attention of steps up to SMALL_STEP tokens: every row by itself over key blocks of
# SMALL_STEP_BLOCK_K, which on CPU beat both the by-sequence split and larger blocks
# (benchmarks/results/serving_model_cpu.md). Bigger steps keep the default split (long
# prefills by sequence).
SMALL_STEP, SMALL_STEP_BLOCK_K = 128, 32
# XLA attention of steps with at most this many [T, T] scores per kv-head group (T^2 *
# Hq, 256 tokens at 6 heads) tries the split path (paged_attention_xla's step_dense):
# the step's own rows densely, cached prefixes for the decode rows only. Past this size
# the dense scores cost what they save (benchmarks/results/serving_model_cpu.md).
STEP_DENSE_MAX_SCORES = 1 << 20

KVCache = tuple[jax.Array, ...]   # (k, v) or, 8-bit, (k, v, k_scale, v_scale)


class PagedBatch(NamedTuple):
  """One step's ragged batch; T and S are bucketed sizes, the tails padding."""
  tokens: jax.Array        # [T] int32
  positions: jax.Array     # [T] int32: position of each token in its sequence
  slots: jax.Array         # [T] int32: page * page_size + offset; padding: P * page_size
  kv_lens: jax.Array       # [S] int32: cached tokens after this step, new ones included
  page_indices: jax.Array  # [S, pages_per_seq] int32: each sequence's block table
  cu_q_lens: jax.Array     # [S + 1] int32: where each sequence's tokens start
  num_seqs: jax.Array      # [1] int32: live sequences
  sample_rows: jax.Array   # [R >= S] int32: rows whose logits are wanted (padding: 0)
  row_slot: jax.Array | None = None   # [T] int32: each row's LoRA slot (0: none)


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
  return (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.resolved_head_dim)


def kv_cache_axes(kv_cache_dtype: str = 'auto') -> tuple[tuple, ...]:
  """Logical axes of each array of the cache init_kv_cache makes."""
  scales = (KV_SCALE_AXES,) * 2 if kv_quant.is_quantized(kv_cache_dtype) else ()
  return (KV_CACHE_AXES,) * 2 + scales


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, sharding=None,
                  kv_cache_dtype: str = 'auto') -> KVCache:
  """Zeroed K and V pages in the compute dtype (auto) or 8-bit with float32 scales.
  sharding: one for every array, or a tuple of one per array (kv_cache_axes)."""
  shape = kv_cache_shape(cfg, num_pages, page_size)
  dtype = kv_quant.storage_dtype(kv_cache_dtype, cfg.dtype)
  specs = [(shape, dtype)] * 2
  if kv_quant.is_quantized(kv_cache_dtype):
    specs += [(shape[:-1], kv_quant.SCALE_DTYPE)] * 2
  if not isinstance(sharding, (tuple, list)):
    sharding = (sharding,) * len(specs)
  return tuple(jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sh)()
               for (shape, dtype), sh in zip(specs, sharding))


# ------------------------------------------------------------------------- write, attend

def write_kv(cache: KVCache, layer: jax.Array, k, v, slots) -> KVCache:
  """Scatters k, v [T, Hkv, D] into layer `layer`'s slots (an 8-bit cache: quantized,
  with their scales); out-of-range slots drop."""
  page_size = cache[0].shape[2]
  pages, offsets = slots // page_size, slots % page_size
  put = lambda c, x: c.at[layer, pages, offsets].set(x.astype(c.dtype), mode='drop')
  if len(cache) == 2:
    return put(cache[0], k), put(cache[1], v)
  (qk, sk), (qv, sv) = (kv_quant.quantize(x, cache[0].dtype) for x in (k, v))
  return put(cache[0], qk), put(cache[1], qv), put(cache[2], sk), put(cache[3], sv)


def _pallas_stacked(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, layer,
                    window, **kwargs):
  """The kernel on the stacked cache [L, P, page, Hkv, D], reading layer `layer` ([1])
  with sliding window `window` ([1]; 0: none), both runtime values."""
  return paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                         layer=layer, sliding_window=window, **kwargs)


PAGED_ATTENTION = {'xla': paged_attention_xla, 'pallas': _pallas_stacked}


def check_impl(cfg: ModelConfig, impl: str) -> None:
  """ValueError where `impl` is no paged attention (both compute every model's, sliding
  windows and soft caps included)."""
  del cfg
  if impl not in PAGED_ATTENTION:
    raise ValueError(f'paged attention {impl!r} is unknown; use one of '
                     f'{sorted(PAGED_ATTENTION)}.')


def paged_attend(q, k_pages, v_pages, meta, impl: str, plan, sliding_window: int = 0,
                 sm_scale: float | None = None, softcap: float = 0.0, scales=()):
  """q [T, Hq, D] over pages [..., page, Hkv, D] (layer_pages' form); with a plan, each
  tensor shard attends its own kv heads and their q heads (the kernel is opaque to the
  partitioner). sliding_window: the layer's window (0: none); an int, or for pallas also
  an int32 array (traced in the layer scan: one kernel for local and global layers);
  softcap: model.attn_softcap; sm_scale: the scores' scale (None: 1/sqrt(D)). scales: an
  8-bit cache's (k_scale, v_scale) [..., page, Hkv] in the pages' form, sharded alike."""
  fn = functools.partial(PAGED_ATTENTION[impl], sm_scale=sm_scale)
  if impl == 'pallas':   # an operand, replicated like the layer index
    meta = meta + (jnp.asarray(sliding_window, jnp.int32).reshape(1),)
  elif sliding_window:
    fn = functools.partial(fn, sliding_window=sliding_window)
  if softcap:
    fn = functools.partial(fn, softcap=softcap)
  if impl == 'xla' and q.shape[0] <= SMALL_STEP:
    fn = functools.partial(fn, block_k=SMALL_STEP_BLOCK_K, row_tokens=SMALL_STEP)
  if impl == 'xla' and q.shape[0] ** 2 * q.shape[1] <= STEP_DENSE_MAX_SCORES:
    fn = functools.partial(fn, step_dense=True)
  if scales:
    fn = _with_scales(fn, len(meta))
  if plan is None:
    return fn(q, k_pages, v_pages, *meta, *scales)
  spec = plan.activations.spec
  q_spec = spec((None, 'act_heads', None))
  kv_spec = spec((None,) * (k_pages.ndim - 2) + ('act_kv_heads', None))
  scale_spec = spec((None,) * (k_pages.ndim - 2) + ('act_kv_heads',))
  rep = jax.sharding.PartitionSpec()
  in_specs = (q_spec, kv_spec, kv_spec) + (rep,) * len(meta) + (scale_spec,) * len(scales)
  return jax.shard_map(fn, mesh=plan.mesh, in_specs=in_specs, out_specs=q_spec,
                       check_vma=False)(q, k_pages, v_pages, *meta, *scales)


def _with_scales(fn, num_meta: int):
  """fn taking the scales as two more positional arguments after the metadata (what
  shard_map passes) rather than as k_scale=, v_scale=."""
  def call(q, k_pages, v_pages, *rest):
    meta, (k_scale, v_scale) = rest[:num_meta], rest[num_meta:]
    return fn(q, k_pages, v_pages, *meta, k_scale=k_scale, v_scale=v_scale)
  return call


def layer_pages(cache: KVCache, index, batch: PagedBatch, impl: str):
  """Layer `index`'s K and V pages as `impl` reads them, and the metadata that indexes
  them, without slicing the layer out of the stacked cache: a slice copies that layer's
  whole K and V pool, every layer of every step.

  XLA: every layer's pages as one pool [L * P, page, Hkv, D] (a free reshape of the
  carried cache), this layer's at page offset index * P. Pallas: the stacked cache
  [L, P, page, Hkv, D] as it is, and the layer index, which the kernel adds to its own
  page reads (its offsets go 64-bit for a stack over 4 GiB: Pallas's Triton lowering).
  """
  meta = (batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs)
  if impl == 'pallas':
    return cache[0], cache[1], meta + (jnp.asarray(index, jnp.int32).reshape(1),)
  pool = [c.reshape(-1, *c.shape[2:]) for c in cache[:2]]
  offset = batch.page_indices + index * cache[0].shape[1]
  return pool[0], pool[1], (batch.kv_lens, offset, batch.cu_q_lens, batch.num_seqs)


def layer_scales(cache: KVCache, impl: str) -> tuple:
  """An 8-bit cache's scales in layer_pages' form (the same page offsets index them);
  () for a cache of the model's dtype."""
  if impl == 'pallas':
    return tuple(cache[2:])
  return tuple(c.reshape(-1, *c.shape[2:]) for c in cache[2:])


def paged_attention_layer(x, layer, index, cache, batch, cfg, rope, impl, plan):
  """x [1, T, d] -> (attention output [1, T, d], cache with this layer's K/V written)."""
  q, k, v = project_qkv(x, layer, cfg, rope, plan)
  cache = write_kv(cache, index, k[0], v[0], batch.slots)
  k_pages, v_pages, meta = layer_pages(cache, index, batch, impl)
  scales = layer_scales(cache, impl)
  attend = lambda window: paged_attend(q[0], k_pages, v_pages, meta, impl, plan, window,
                                       cfg.attention_scale, cfg.attn_softcap, scales)
  if impl == 'pallas':
    out = attend(_layer_window(layer.get('local'), cfg.sliding_window))
  else:   # XLA's window is static: a traced layer kind is a cond of both
    out = by_layer_window(layer.get('local'), attend, cfg.sliding_window)
  return output_projection(out[None], layer), cache


def _layer_window(local, window: int):
  """The layer's sliding window for the kernel: `window` where `local` (by_layer_window's
  flag: None, a bool, or traced in the scan), else 0."""
  if local is None:
    return window
  if not isinstance(local, jax.Array):   # a Python or numpy bool: the unrolled layers
    return window if local else 0
  return jnp.where(local, window, 0).astype(jnp.int32)


# -------------------------------------------------------------------------------- forward

def rope_table(cfg: ModelConfig, max_len: int) -> Rope | Ropes:
  """sin/cos of every position below max_len ([1, max_len, 1, e/2] each), for
  paged_forward's `rope`: computed by rope_tables itself, so the rows are the values a
  step would compute (bitwise; checked). A step then gathers its rows: XLA:CPU otherwise
  fuses a sin and a cos per element into every layer's q and k, a few percent of a step
  (benchmarks/results/serving_model_cpu.md)."""
  tables = jax.jit(functools.partial(model_rope, cfg=cfg))
  return tables(jnp.arange(max_len, dtype=jnp.int32)[None])


def paged_forward(params: Params, cache: KVCache, batch: PagedBatch, cfg: ModelConfig, *,
                  impl: str = 'xla', plan: ShardingPlan | None = None,
                  rope: Rope | Ropes | None = None, lora=None):
  """Final hidden states [1, T, d] of the batch's tokens, and the updated cache. rope:
  rope_table's output covering every position in the batch (else computed here). lora:
  LoRA slot arrays {target: {'a': [L, slots, in, r], 'b': [L, slots, r, out]}} (model.lora's
  serving form), each token row adding its batch.row_slot's adapter; None: the base alone."""
  check_impl(cfg, impl)
  if lora is not None:
    if cfg.num_experts:
      raise ValueError('LoRA adapters on a mixture-of-experts model are not served; serve '
                       'it without --enable-lora.')
    row_slot = jnp.broadcast_to(batch.row_slot, (cfg.num_layers,) + batch.row_slot.shape)
    params = lora_lib.attach(params, {'layers': {**lora, 'row_slot': row_slot}})
  if rope is None:
    rope = model_rope(batch.positions[None], cfg)
  else:
    rope = jax.tree.map(lambda x: x[:, batch.positions], rope)
  x = embed_scaled(params['embed'][batch.tokens[None]], cfg)
  x = constrain(x, RESIDUAL, plan)

  def body(carry, layer_and_index):
    x, cache = carry
    layer, index = layer_and_index
    attend = lambda h: paged_attention_layer(h, layer, index, cache, batch, cfg, rope, impl,
                                             plan)
    return residual_block(x, layer, cfg, plan, attend), None

  kinds = cfg.layer_is_local()
  if isinstance(params.get('layers'), (list, tuple)):   # unstack_layers' form
    for index, layer in enumerate(params['layers']):
      if kinds is not None:   # a Python bool: this layer's attention alone is traced
        layer = {**layer, 'local': bool(kinds[index])}
      (x, cache), _ = body((x, cache), (layer, index))
  elif cfg.num_experts:
    x, cache = _moe_groups(body, (x, cache), params, cfg)
  else:
    layers = (with_layer_kinds(params['layers'], cfg), jnp.arange(cfg.num_layers))
    (x, cache), _ = jax.lax.scan(body, (x, cache), layers)
  return norm(x, params['final_norm'], cfg), cache


def unstack_layers(params: Params, cfg: ModelConfig) -> Params:
  """Dense configs: params['layers'] as a tuple of per-layer trees, which paged_forward
  runs as an unrolled loop. A scan slices each layer's weights out of the stacked arrays,
  a copy of every weight every step (benchmarks/results/serving_model_cpu.md); separate
  arrays are read in place. The stacked arrays are copied, not moved: memory holds both
  until the caller drops its tree (the serving engine keeps no reference to it). A
  sharded leaf's layers keep its sharding. MoE configs keep the scanned groups."""
  if cfg.num_experts or isinstance(params['layers'], (list, tuple)):
    return params
  leaves, treedef = jax.tree.flatten(params['layers'])
  per_leaf = []
  for w in leaves:
    layer_of = lambda j, w=w: w[j]   # one device: stays uncommitted, as the cache is
    if isinstance(w.sharding, jax.sharding.NamedSharding):
      sharding = w.sharding.update(spec=w.sharding.spec[1:])
      layer_of = lambda j, w=w, sharding=sharding: jax.device_put(w[j], sharding)
    per_leaf.append([layer_of(j) for j in range(w.shape[0])])
  layers = tuple(jax.tree.unflatten(treedef, [ws[j] for ws in per_leaf])
                 for j in range(cfg.num_layers))
  return {**params, 'layers': layers}


def _moe_groups(body, carry, params: Params, cfg: ModelConfig):
  """MoE configs: the training forward's groups of moe_every layers (the dense ones of a
  group, then its MoE layer), each layer at its absolute index in the cache."""
  num_moe = cfg.num_moe_layers
  index = jnp.arange(cfg.num_layers).reshape(num_moe, cfg.moe_every)
  dense = None
  if 'layers' in params:
    dense = jax.tree.map(lambda w: w.reshape(num_moe, -1, *w.shape[1:]), params['layers'])

  def group(carry, xs):
    dense_layers, moe_layer, idx = xs
    if dense_layers is not None:
      carry, _ = jax.lax.scan(body, carry, (dense_layers, idx[:-1]))
    return body(carry, (moe_layer, idx[-1]))

  carry, _ = jax.lax.scan(group, carry, (dense, params['moe_layers'], index))
  return carry


def sampled_logits(params: Params, cache: KVCache, batch: PagedBatch, cfg: ModelConfig, *,
                   impl: str = 'xla', plan: ShardingPlan | None = None,
                   rope: Rope | Ropes | None = None, lora=None):
  """float32 logits [R, vocab] of the batch's sample rows (only those reach the head),
  and the updated cache."""
  hidden, cache = paged_forward(params, cache, batch, cfg, impl=impl, plan=plan, rope=rope,
                                lora=lora)
  rows = hidden[:, batch.sample_rows]                                  # [1, R, d]
  return logits(params, rows, cfg, plan)[0], cache
