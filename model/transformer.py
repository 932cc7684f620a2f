"""A Llama-family decoder, written once with logical axis names.

Reads top-down: parameters (declared abstractly) -> rope, norm -> attention, mlp ->
block -> forward; the loss over it is model/loss.py. The serving forward (model/paged.py)
runs the same project_qkv, residual_block and mlp with K/V in a paged cache. Einsum
letters: b batch, t/s query/key positions, d embed, h query heads, k kv heads, g query
heads per kv head, e head dim, f mlp, v vocab.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from model import lora as lora_lib
from model import moe
from model.quant import dense
from model.config import ModelConfig
# The parameters' declarations live below this module and model.lora; named here too.
from model.params import (Params, ParamSpec, abstract_params, count_params, init_params,
                          logical_axes, param_specs)
from pallas_kernels.flash_attention import flash_attention
from sharding.rules import ShardingPlan, constrain


# Residual stream at block edges; `seq` picks up `tensor` under sequence parallelism.
RESIDUAL = ('batch', 'seq', 'act_embed')
# Activations named in each block (checkpoint_name) that remat='offload' keeps in host
# memory; the backward pass recomputes everything else from them.
OFFLOADED = ('query', 'key', 'value', 'context', 'mid_residual', 'mlp_gate', 'mlp_up')


# ------------------------------------------------------------------------ rope and norm

def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
  """RoPE inverse frequencies, with Llama-3 (or linear) scaling for contexts past the
  original; local: the sliding-window layers' (rope_local_theta, unscaled)."""
  dim = cfg.resolved_head_dim
  theta = cfg.rope_local_theta if local else cfg.rope_theta
  inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  factor = cfg.rope_scaling_factor
  if factor == 1.0 or local:
    return inv_freq.astype(np.float32)
  if cfg.rope_scaling_type == 'linear':
    return (inv_freq / factor).astype(np.float32)
  wavelen = 2 * np.pi / inv_freq
  low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
  high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
  # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
  smooth = ((cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor)
            / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
  blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  out = np.where(wavelen > low_wavelen, inv_freq / factor,
                 np.where(wavelen < high_wavelen, inv_freq, blended))
  return out.astype(np.float32)


class Rope(NamedTuple):
  """Rotation tables of one forward pass, [b, t, 1, e/2] each, shared by every layer."""
  sin: jax.Array
  cos: jax.Array


class Ropes(NamedTuple):
  """Two bases (rope_local_theta): each layer takes one by its layer['local'] flag."""
  full: Rope
  local: Rope


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> Rope:
  angles = positions[:, :, None].astype(jnp.float32) * inv_freq   # [b, t, e/2]
  return Rope(jnp.sin(angles)[:, :, None], jnp.cos(angles)[:, :, None])


def model_rope(positions: jax.Array, cfg: ModelConfig) -> Rope | Ropes:
  """The tables every layer of cfg uses: one Rope, or Ropes with rope_local_theta."""
  full = rope_tables(positions, rope_inv_freq(cfg))
  if not cfg.rope_local_theta:
    return full
  return Ropes(full, rope_tables(positions, rope_inv_freq(cfg, local=True)))


def layer_rope(rope: Rope | Ropes, layer) -> Rope:
  """The layer's tables: its flag (layer['local'], traced in a scan) picks of Ropes."""
  if not isinstance(rope, Ropes):
    return rope
  local = layer['local']
  if isinstance(local, (bool, np.bool_)):
    return rope.local if local else rope.full
  return Rope(*(jnp.where(local, a, b) for a, b in zip(rope.local, rope.full)))


def with_layer_kinds(layers, cfg: ModelConfig):
  """The stacked layers with cfg.layer_is_local() as layers['local'] [L] (sliced by the
  scan like the weights, no gradient), where global_every alternates them."""
  kinds = cfg.layer_is_local()
  if kinds is None:
    return layers
  return {**layers, 'local': jnp.asarray(kinds)}


def norm(x: jax.Array, scale: jax.Array, cfg: ModelConfig) -> jax.Array:
  """rms_norm by the weight w, or by 1 + w with cfg.norm_plus_one (in float32)."""
  if cfg.norm_plus_one:
    scale = 1.0 + scale.astype(jnp.float32)
  return rms_norm(x, scale, cfg.norm_eps)


def softcap(x: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(x / cap) (cap 0: x)."""
  return cap * jnp.tanh(x / cap) if cap else x


def apply_rope(x: jax.Array, rope: Rope) -> jax.Array:
  """Rotates x [b, t, h, e] by position; halves layout (rotate-half), as in HF Llama."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin], axis=-1)
  return out.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  # Statistics in float32: bf16 loses the small mean of squares of wide rows.
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


# ---------------------------------------------------------------------------- attention

def attention_mask(segment_ids: jax.Array | None, t: int, window: int = 0) -> jax.Array:
  """[b or 1, t, s] boolean: causal, within the last `window` tokens (0: all), and within
  one packed document."""
  causal = jnp.tril(jnp.ones((t, t), dtype=bool))
  if window:
    causal &= ~jnp.tril(jnp.ones((t, t), dtype=bool), -window)
  if segment_ids is None:
    return causal[None]
  same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
  return causal[None] & same_doc


def attention_xla(q, k, v, segment_ids, window: int = 0, scale: float | None = None,
                  cap: float = 0.0):
  """Grouped-query attention without repeating K/V: q [b,t,h,e], k/v [b,s,k,e]; window:
  model.sliding_window; scale: of the scores (None: 1/sqrt(e)); cap: attn_softcap."""
  b, t, h, e = q.shape
  mask = attention_mask(segment_ids, t, window)
  groups = h // k.shape[2]
  q = q.reshape(b, t, k.shape[2], groups, e)
  scores = jnp.einsum('btkge,bske->bkgts', q, k, preferred_element_type=jnp.float32)
  scores = softcap(scores * (e ** -0.5 if scale is None else scale), cap)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum('bkgts,bske->btkge', probs, v)
  return out.reshape(b, t, h, e)


def attention_cudnn(q, k, v, segment_ids, scale: float | None = None):
  # cuDNN's fused kernel on GPU; it does the grouped-query broadcast itself. Packed
  # documents need a dense [b, 1, t, s] mask: fine for short sequences only.
  if segment_ids is None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                        implementation='cudnn')
  mask = attention_mask(segment_ids, q.shape[1])[:, None]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale,
                                      implementation='cudnn')


def _flash_kernels(backend: str) -> dict:
  if backend == 'auto':   # flash_attention.default_backend picks, per call
    return {}
  if backend == 'mosaic_gpu_fused':
    return dict(backend='mosaic_gpu', backend_bwd=backend)
  return dict(backend=backend)


def attention_pallas(q, k, v, segment_ids, plan, backend='auto', window: int = 0,
                     scale: float | None = None, cap: float = 0.0):
  """The Pallas flash kernel, run per shard: a pallas_call is opaque to the partitioner.
  backend: model.pallas_backend ('mosaic_gpu_fused': the Mosaic GPU forward and its
  one-kernel backward); window: model.sliding_window; scale, cap: attention_xla's."""
  kernels = {**_flash_kernels(backend), 'sliding_window': window or None, 'sm_scale': scale}
  if cap:
    kernels['softcap'] = cap
  if plan is None:
    return flash_attention(q, k, v, causal=True, segment_ids=segment_ids, **kernels)
  spec = plan.activations.spec
  q_spec = spec(('batch', 'act_seq', 'act_heads', None))
  kv_spec = spec(('batch', 'act_seq', 'act_kv_heads', None))
  args, specs = [q, k, v], [q_spec, kv_spec, kv_spec]
  if segment_ids is not None:
    args.append(segment_ids)
    specs.append(spec(('batch', 'act_seq')))

  def local(q, k, v, segment_ids=None):
    return flash_attention(q, k, v, causal=True, segment_ids=segment_ids, **kernels)

  return jax.shard_map(local, mesh=plan.mesh, in_specs=tuple(specs), out_specs=q_spec,
                       check_vma=False)(*args)


def project_qkv(x, layer, cfg: ModelConfig, rope: Rope, plan):
  """q [b,t,h,e], k/v [b,t,k,e]: projections (with cfg.qkv_bias, biased; with
  cfg.qk_norm, each head normed) and RoPE, shared by training and serving."""
  dtype = x.dtype
  q = lora_lib.apply(layer, 'q', x, jnp.einsum('btd,dhe->bthe', x, dense(layer['wq'], dtype)))
  k = lora_lib.apply(layer, 'k', x, jnp.einsum('btd,dke->btke', x, dense(layer['wk'], dtype)))
  v = lora_lib.apply(layer, 'v', x, jnp.einsum('btd,dke->btke', x, dense(layer['wv'], dtype)))
  if cfg.qkv_bias:
    q, k, v = (y + layer[b].astype(dtype) for y, b in ((q, 'bq'), (k, 'bk'), (v, 'bv')))
  if cfg.qk_norm:
    q, k = norm(q, layer['q_norm'], cfg), norm(k, layer['k_norm'], cfg)
  q_axes = ('batch', 'act_seq', 'act_heads', None)
  kv_axes = ('batch', 'act_seq', 'act_kv_heads', None)
  rope = layer_rope(rope, layer)
  q = constrain(apply_rope(q, rope), q_axes, plan)
  k = constrain(apply_rope(k, rope), kv_axes, plan)
  v = constrain(v, kv_axes, plan)
  return checkpoint_name(q, 'query'), checkpoint_name(k, 'key'), checkpoint_name(v, 'value')


def attention(x, layer, cfg: ModelConfig, rope: Rope, segment_ids, plan):
  q, k, v = project_qkv(x, layer, cfg, rope, plan)
  out = attention_core(q, k, v, cfg, segment_ids, plan, layer.get('local'))
  return output_projection(checkpoint_name(out, 'context'), layer)


def by_layer_window(local, attend, window: int):
  """attend(window) of a layer: the sliding window where `local` (global_every's flag
  of the layer: a bool, or traced in a scan, then a cond of both), else the whole
  context (0); local None: every layer's `window`."""
  if local is None:
    return attend(window)
  if isinstance(local, (bool, np.bool_)):
    return attend(window if local else 0)
  return jax.lax.cond(local, lambda: attend(window), lambda: attend(0))


def attention_core(q, k, v, cfg: ModelConfig, segment_ids, plan, local=None):
  """Attention itself, between the projections: q [b,t,h,e], k/v [b,t,k,e] -> [b,t,h,e],
  by cfg.attention_impl. The layout decides how it spans devices (ShardingPlan.attention:
  over the context axis where the sequence is split). local: the layer's flag
  (by_layer_window)."""
  if local is not None:
    return by_layer_window(local, lambda w: attention_core(
        q, k, v, dataclasses.replace(cfg, sliding_window=w, global_every=0), segment_ids,
        plan), cfg.sliding_window)
  local = functools.partial(local_attention, cfg=cfg, plan=plan)
  if plan is None:
    return local(q, k, v, segment_ids)
  flash = None
  if cfg.attention_impl == 'pallas':   # the kernel for blocks of a split sequence
    flash = functools.partial(flash_attention, **_flash_kernels(cfg.pallas_backend))
  return plan.attention(q, k, v, segment_ids, local, flash)


def local_attention(q, k, v, segment_ids, *, cfg: ModelConfig, plan):
  """Attention where every device holds whole sequences, by cfg.attention_impl."""
  if cfg.attention_impl == 'xla':
    return attention_xla(q, k, v, segment_ids, cfg.sliding_window, cfg.attention_scale,
                         cfg.attn_softcap)
  if cfg.attention_impl == 'cudnn':
    return attention_cudnn(q, k, v, segment_ids, cfg.attention_scale)
  return attention_pallas(q, k, v, segment_ids, plan, cfg.pallas_backend, cfg.sliding_window,
                          cfg.attention_scale, cfg.attn_softcap)


def output_projection(out, layer):
  # One [b, t, h*e] x [h*e, d] matmul: as a two-axis contraction, XLA:CPU copied wo into
  # another layout every call (benchmarks/results/serving_model_cpu.md).
  b, t, h, e = out.shape
  wo = dense(layer['wo'], out.dtype)
  flat = out.reshape(b, t, h * e)
  projected = jnp.einsum('btx,xd->btd', flat, wo.reshape(h * e, -1))
  return lora_lib.apply(layer, 'o', flat, projected)


# ---------------------------------------------------------------------------- mlp, block

ACTIVATIONS = {'silu': jax.nn.silu, 'gelu_tanh': functools.partial(jax.nn.gelu, approximate=True)}


def mlp(x, layer, plan, activation: str = 'silu'):
  """The gated MLP: SwiGLU, or GeGLU with activation='gelu_tanh' (model.mlp_activation)."""
  dtype = x.dtype
  project = lambda name, target, h: lora_lib.apply(
      layer, target, h, jnp.einsum('btd,df->btf', h, dense(layer[name], dtype)))
  gate = checkpoint_name(project('w_gate', 'gate', x), 'mlp_gate')
  up = checkpoint_name(project('w_up', 'up', x), 'mlp_up')
  hidden = constrain(ACTIVATIONS[activation](gate) * up, ('batch', 'act_seq', 'act_mlp'), plan)
  return project('w_down', 'down', hidden)


def block(x, layer, cfg: ModelConfig, rope: Rope, segment_ids, plan):
  if cfg.remat == 'save_attention':
    return _block_saving_attention(x, layer, cfg, rope, segment_ids, plan,
                                   _dense_ffn(cfg, plan), 'mlp')[0]
  attend = lambda h: (attention(h, layer, cfg, rope, segment_ids, plan), None)
  return residual_block(x, layer, cfg, plan, attend)[0]


def residual_block(x, layer, cfg: ModelConfig, plan, attend):
  """Pre-norm attention and MLP with residuals. attend(h) -> (out [b,t,d], aux): the
  serving path's attention also returns its updated KV cache as aux."""
  with jax.named_scope('attention'):
    h, aux = attend(norm(x, layer['attn_norm'], cfg))
    x = _mid_residual(x, _post_norm(h, layer, 'post_attn_norm', cfg), plan)
  return _ffn_half(x, layer, cfg, plan, _dense_ffn(cfg, plan), 'mlp')[0], aux


def _post_norm(h, layer, name: str, cfg: ModelConfig):
  """sandwich_norms: a block half's output normed before its residual add."""
  return norm(h, layer[name], cfg) if name in layer else h


def _mid_residual(x, attention_out, plan):
  return checkpoint_name(constrain(x + attention_out, RESIDUAL, plan), 'mid_residual')


def _dense_ffn(cfg: ModelConfig, plan):
  """feed_forward as _ffn_half takes it: (h, layer) -> (out, no aux)."""
  return lambda h, layer: (feed_forward(h, layer, cfg, plan), None)


def _ffn_half(x, layer, cfg: ModelConfig, plan, ffn, scope):
  """A block's second half: ffn(h, layer) -> (out, aux) on the normed x, plus x.
  Returns (x, aux)."""
  with jax.named_scope(scope):
    h, aux = ffn(norm(x, layer['mlp_norm'], cfg), layer)
    return constrain(x + _post_norm(h, layer, 'post_mlp_norm', cfg), RESIDUAL, plan), aux


def feed_forward(h, layer, cfg: ModelConfig, plan):
  """The layer's MLP. A MoE layer here (serving) runs dropless without its aux values,
  with the partitioner left to split it."""
  if 'router' not in layer:
    return mlp(h, layer, plan, cfg.mlp_activation)
  return moe.moe_mlp(h, layer, dataclasses.replace(cfg, moe_dispatch='dropless'), None)[0]


def moe_block(x, layer, cfg: ModelConfig, rope: Rope, segment_ids, plan):
  """A block whose MLP is the mixture of experts: (x, its aux values)."""
  ffn = lambda h, layer: moe.moe_mlp(h, layer, cfg, plan)
  if cfg.remat == 'save_attention':
    return _block_saving_attention(x, layer, cfg, rope, segment_ids, plan, ffn, 'moe')
  with jax.named_scope('attention'):
    h = norm(x, layer['attn_norm'], cfg)
    h = attention(h, layer, cfg, rope, segment_ids, plan)
    x = constrain(x + _post_norm(h, layer, 'post_attn_norm', cfg), RESIDUAL, plan)
  return _ffn_half(x, layer, cfg, plan, ffn, 'moe')


def _block_saving_attention(x, layer, cfg: ModelConfig, rope: Rope, segment_ids, plan, ffn,
                            scope):
  """remat='save_attention': a block recomputed in the backward pass as under 'full',
  except attention itself. The fused kernel (pallas or cudnn) runs outside the two
  checkpointed parts, so autodiff keeps what its backward needs (q, k, v, the output
  and the log-sum-exp) and the backward runs no attention forward again (with context
  parallelism the ring's own backward still reruns each block's forward): at long
  sequences that forward costs more than every matmul of the block. ffn(h, layer) ->
  (out, aux). Returns (x, aux)."""
  def before(x, layer):
    with jax.named_scope('attention'):
      return project_qkv(norm(x, layer['attn_norm'], cfg), layer, cfg, rope, plan)

  def after(x, out, layer):
    with jax.named_scope('attention'):
      x = _mid_residual(x, _post_norm(output_projection(out, layer), layer, 'post_attn_norm',
                                      cfg), plan)
    return _ffn_half(x, layer, cfg, plan, ffn, scope)

  q, k, v = jax.checkpoint(before)(x, layer)
  with jax.named_scope('attention'):
    out = attention_core(q, k, v, cfg, segment_ids, plan, layer.get('local'))
  return jax.checkpoint(after)(x, out, layer)


def _remat(fn, policy: str):
  if policy in ('none', 'save_attention'):   # save_attention: the block checkpoints its parts
    return fn
  if policy == 'full':
    return jax.checkpoint(fn)
  if policy == 'offload':
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=OFFLOADED,
        offload_src='device', offload_dst='pinned_host'))
  # Keep projection outputs; recompute elementwise work and attention scores.
  return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


# -------------------------------------------------------------------------------- forward

def forward(params: Params, tokens: jax.Array, cfg: ModelConfig, *,
            positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
            plan: ShardingPlan | None = None, embed: jax.Array | None = None,
            lora: Params | None = None) -> jax.Array:
  """Final hidden states [b, t, d] for tokens [b, t]; see forward_with_aux."""
  return forward_with_aux(params, tokens, cfg, positions=positions, segment_ids=segment_ids,
                          plan=plan, embed=embed, lora=lora)[0]


def forward_with_aux(params: Params, tokens: jax.Array, cfg: ModelConfig, *,
                     positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                     plan: ShardingPlan | None = None, embed: jax.Array | None = None,
                     lora: Params | None = None):
  """(final hidden states [b, t, d] for tokens [b, t], MoE aux values: moe.AUX_KEYS,
  zeros for a dense model).

  `embed` replaces params['embed'] for the lookup: [v, d], or [shards, v, d] holding one
  copy per batch shard (shard i looks up rows i*b/shards onwards of the batch).
  `lora`: adapters in model.lora's layer form, added after their projections.
  """
  params = lora_lib.attach(params, lora)
  b, t = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  # The layout's runner of the layer stack (ShardingPlan.layer_stack: the pipeline over
  # 'stage'), or None: the scan below. MoE layers run their own scan.
  runner = None if plan is None or cfg.num_experts else plan.layer_stack()
  # Once for every layer; a runner makes its own per microbatch (layer_for).
  rope = None if runner else model_rope(positions, cfg)
  table = params['embed'] if embed is None else embed
  with jax.named_scope('embed'):   # named scopes: what benchmarks/profile.py files time under
    if table.ndim == 2:
      x = table[tokens]
    else:
      shards = table.shape[0]
      x = jax.vmap(lambda rows, tok: rows[tok])(table, tokens.reshape(shards, b // shards, t))
      x = x.reshape(b, t, -1)
    x = constrain(embed_scaled(x, cfg), RESIDUAL, plan)

  def layer_for(positions, segment_ids):
    """One layer, (x, weights) -> x, on tokens at `positions` (a runner's microbatch)."""
    tables = rope if rope is not None else model_rope(positions, cfg)
    return lambda x, layer: block(x, layer, cfg, tables, segment_ids, plan)

  remat = functools.partial(_remat, policy=cfg.remat)
  if cfg.num_experts:
    x, aux = _moe_layers(x, params, cfg, rope, segment_ids, plan)
  else:
    run = runner or scan_layers
    x = run(layer_for, x, positions, segment_ids, with_layer_kinds(params['layers'], cfg),
            remat)
    aux = moe.zero_aux()
  return norm(x, params['final_norm'], cfg), aux


def embed_scaled(x: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Looked-up embeddings in the compute dtype, times sqrt(embed_dim) there with
  cfg.embed_scale (as transformers' Gemma: the factor rounded to that dtype)."""
  x = x.astype(cfg.dtype)
  if cfg.embed_scale:
    x = x * jnp.asarray(math.sqrt(cfg.embed_dim), cfg.dtype)
  return x


def scan_layers(layer_for, x, positions, segment_ids, layers, remat):
  """The layer stack [L, ...] applied to x [b, t, d] by a scan (remat: the policy's
  wrapper of the scan body)."""
  layer = layer_for(positions, segment_ids)
  x, _ = jax.lax.scan(remat(lambda x, weights: (layer(x, weights), None)), x, layers)
  return x


def _moe_layers(x, params, cfg: ModelConfig, rope: Rope, segment_ids, plan):
  """Scan over G groups of moe_every layers: the group's dense layers (an inner scan),
  then its MoE layer. Aux losses averaged over MoE layers, dropped pairs summed."""
  num_moe = cfg.num_moe_layers

  def dense(x, layer):
    return block(x, layer, cfg, rope, segment_ids, plan), None

  def group(x, layers):
    if layers[0] is not None:
      x, _ = jax.lax.scan(_remat(dense, cfg.remat), x, layers[0])
    return _remat(lambda x, layer: moe_block(x, layer, cfg, rope, segment_ids, plan),
                  cfg.remat)(x, layers[1])

  grouped = None
  if 'layers' in params:
    grouped = jax.tree.map(lambda w: w.reshape(num_moe, -1, *w.shape[1:]), params['layers'])
  x, aux = jax.lax.scan(group, x, (grouped, params['moe_layers']))
  aux = {k: jnp.sum(v) if k == 'dropped_tokens' else jnp.mean(v) for k, v in aux.items()}
  return x, aux


def output_weights(params: Params, cfg: ModelConfig) -> jax.Array:
  """[d, v]: the untied head, or the embedding table transposed."""
  w = params['embed'].T if cfg.tie_embeddings else params['lm_head']
  return w.astype(cfg.dtype)


def logits(params: Params, hidden: jax.Array, cfg: ModelConfig, plan=None) -> jax.Array:
  out = jnp.einsum('btd,dv->btv', hidden, output_weights(params, cfg),
                   preferred_element_type=jnp.float32)
  return constrain(softcap(out, cfg.final_softcap), ('batch', 'act_seq', 'act_vocab'), plan)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3x forward), causal attention halved.
  MoE: only the experts a token uses count (k routed + the shared ones), and the router."""
  # Every weight multiplies once per token except the embedding lookup, the norms' scales
  # and the biases; a tied table is used once, as the output head.
  norms = sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg))
              if s.init in ('ones', 'zeros'))
  lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed_dim
  matmul_params = count_params(cfg) - norms - lookup - moe.inactive_params(cfg)
  attn = 2 * 2 * cfg.num_layers * seq_len * cfg.num_heads * cfg.resolved_head_dim * 0.5
  return 3 * (2 * matmul_params + attn)
