"""Numerics of the Llama decoder against an independent float64 NumPy reference.

The reference below is written from the published math (HF Llama conventions), not from
model/transformer.py: RoPE is a complex rotation of (first half, second half) pairs,
attention loops over query heads and picks kv head h // (H / K) explicitly, masks are
built from indices. Tolerances are what float32 compute gives on O(1) activations.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import loss as loss_lib
from model import transformer
from model.config import ModelConfig

RTOL = 1e-5   # relative error ||a - b|| / ||b|| allowed between float32 model and float64 ref


def tiny_cfg(**overrides) -> ModelConfig:
  # init_std 0.25 (not 0.02) so attention is far from uniform and RoPE, masking and head
  # grouping move the logits by O(1), not O(1e-3): a wrong convention cannot hide.
  base = ModelConfig(vocab_size=61, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_dim=48, max_seq_len=64, dtype='float32',
                     param_dtype='float32', init_std=0.25)
  cfg = dataclasses.replace(base, **overrides)
  cfg.validate()
  return cfg


def make_params(cfg: ModelConfig, seed: int = 0):
  """init_params, with norm scales moved off 1 so a swapped or dropped scale shows."""
  params = model.init_params(cfg, jax.random.key(seed))
  rng = np.random.default_rng(seed + 100)

  def jitter(x):
    return jnp.asarray(1.0 + 0.3 * rng.standard_normal(x.shape), x.dtype)

  params['final_norm'] = jitter(params['final_norm'])
  for name in ('attn_norm', 'mlp_norm'):
    params['layers'][name] = jitter(params['layers'][name])
  return params


def to64(params):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_tokens(cfg, batch, seq, seed=1):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq), dtype=np.int32)


def model_logits(cfg, params, tokens, positions=None, segment_ids=None):
  fn = jax.jit(lambda p, t, pos, seg: transformer.logits(
      p, transformer.forward(p, t, cfg, positions=pos, segment_ids=seg), cfg))
  return np.asarray(fn(params, tokens, positions, segment_ids))


# ------------------------------------------------------------------ float64 reference

def ref_inv_freq(head_dim: int, theta: float) -> np.ndarray:
  return np.array([theta ** (-2.0 * i / head_dim) for i in range(head_dim // 2)])


def ref_llama3_inv_freq(head_dim, theta, factor, original, low, high) -> np.ndarray:
  """Llama-3.1 rule, one frequency at a time."""
  out = []
  for freq in ref_inv_freq(head_dim, theta):
    wavelength = 2 * math.pi / freq
    if wavelength > original / low:
      out.append(freq / factor)
    elif wavelength < original / high:
      out.append(freq)
    else:
      smooth = (original / wavelength - low) / (high - low)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


def cfg_inv_freq(cfg) -> np.ndarray:
  if cfg.rope_scaling_factor == 1.0:
    return ref_inv_freq(cfg.resolved_head_dim, cfg.rope_theta)
  return ref_llama3_inv_freq(cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling_factor,
                             cfg.rope_original_max_len, cfg.rope_low_freq_factor,
                             cfg.rope_high_freq_factor)


def ref_rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps) * scale


def ref_rope(x, positions, inv_freq):
  """x [b, t, n, e]: element i pairs with i + e/2, rotated as one complex number."""
  half = x.shape[-1] // 2
  z = x[..., :half] + 1j * x[..., half:]
  angle = positions[:, :, None, None] * inv_freq[None, None, None, :]
  z = z * np.exp(1j * angle)
  return np.concatenate([z.real, z.imag], axis=-1)


def ref_softmax(s):
  s = s - s.max(axis=-1, keepdims=True)
  e = np.exp(s)
  return e / e.sum(axis=-1, keepdims=True)


def ref_attention(h, p, l, cfg, positions, segment_ids, inv_freq):
  """p: one model's 'layers' subtree; l: layer index."""
  b, t, d = h.shape
  H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  q = (h @ p['wq'][l].reshape(d, H * E)).reshape(b, t, H, E)
  k = (h @ p['wk'][l].reshape(d, K * E)).reshape(b, t, K, E)
  v = (h @ p['wv'][l].reshape(d, K * E)).reshape(b, t, K, E)
  q, k = ref_rope(q, positions, inv_freq), ref_rope(k, positions, inv_freq)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  allowed = (j <= i)[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
  out = np.zeros((b, t, H, E))
  for head in range(H):
    kv = head // (H // K)
    scores = np.einsum('bte,bse->bts', q[:, :, head], k[:, :, kv]) / math.sqrt(E)
    scores = np.where(allowed, scores, -np.inf)
    out[:, :, head] = np.einsum('bts,bse->bte', ref_softmax(scores), v[:, :, kv])
  return out.reshape(b, t, H * E) @ p['wo'][l].reshape(H * E, d)


def ref_forward_logits(p, tokens, cfg, positions=None, segment_ids=None):
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t), (b, t)) if positions is None else positions
  segment_ids = np.zeros((b, t), int) if segment_ids is None else segment_ids
  positions = np.asarray(positions, np.float64)
  inv_freq, eps = cfg_inv_freq(cfg), cfg.norm_eps
  x, ly = p['embed'][tokens], p['layers']
  for l in range(cfg.num_layers):
    x = x + ref_attention(ref_rms_norm(x, ly['attn_norm'][l], eps), ly, l, cfg,
                          positions, segment_ids, inv_freq)
    h = ref_rms_norm(x, ly['mlp_norm'][l], eps)
    gate, up = h @ ly['w_gate'][l], h @ ly['w_up'][l]
    x = x + (gate / (1 + np.exp(-gate)) * up) @ ly['w_down'][l]
  h = ref_rms_norm(x, p['final_norm'], eps)
  return h @ (p['embed'].T if cfg.tie_embeddings else p['lm_head'])


def ref_summed_nll(p, batch, cfg):
  lg = ref_forward_logits(p, batch['inputs'], cfg, batch.get('positions'),
                          batch.get('segment_ids'))
  logp = lg - lg.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp, batch['targets'][..., None], axis=-1)[..., 0]
  return -np.sum(batch['weights'] * picked)


def packed_layout(lengths):
  """Segment ids 1, 1, ..., 2, 2, ... and positions restarting at 0 per document."""
  seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)]).astype(np.int32)
  pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
  return seg, pos


def make_batch(cfg, batch=2, seq=12, packed=False, seed=3):
  rng = np.random.default_rng(seed)
  out = {'inputs': random_tokens(cfg, batch, seq, seed),
         'targets': rng.integers(0, cfg.vocab_size, (batch, seq), dtype=np.int32),
         'weights': (rng.random((batch, seq)) * (rng.random((batch, seq)) > 0.2))
                    .astype(np.float32)}
  if packed:
    seg, pos = packed_layout([5, seq - 5])
    out['segment_ids'] = np.stack([seg] * batch)
    out['positions'] = np.stack([pos] * batch)
  return out


def loss_and_grads(cfg, params, batch):
  return jax.jit(jax.value_and_grad(lambda p: loss_lib.summed_nll(p, batch, cfg)))(params)


def assert_trees_close(a, b):
  for (path, x), y in zip(jax.tree.flatten_with_path(a)[0], jax.tree.leaves(b)):
    assert rel_err(x, y) < RTOL, (jax.tree_util.keystr(path), rel_err(x, y))


# ------------------------------------------------------------------ logits vs reference

# Original context 64 puts head_dim-8 wavelengths (6.3, 63, 628, 6283) in every branch
# of the Llama-3 rule: kept, blended, divided.
LLAMA3_TINY = dict(rope_scaling_factor=8.0, rope_original_max_len=64,
                   rope_low_freq_factor=1.0, rope_high_freq_factor=4.0)


@pytest.mark.parametrize('overrides', [{}, {'tie_embeddings': False}, LLAMA3_TINY],
                         ids=['tied', 'untied', 'llama3_rope'])
def test_logits_match_reference_causal(overrides):
  cfg = tiny_cfg(**overrides)
  params = make_params(cfg)
  tokens = random_tokens(cfg, 2, 12)
  got = model_logits(cfg, params, tokens)
  want = ref_forward_logits(to64(params), tokens, cfg)
  assert rel_err(got, want) < RTOL


@pytest.mark.parametrize('tie', [True, False], ids=['tied', 'untied'])
def test_logits_match_reference_packed(tie):
  cfg = tiny_cfg(tie_embeddings=tie)
  params = make_params(cfg)
  tokens = random_tokens(cfg, 2, 12)
  seg0, pos0 = packed_layout([5, 7])
  seg1, pos1 = packed_layout([3, 4, 5])
  seg, pos = np.stack([seg0, seg1]), np.stack([pos0, pos1])
  got = model_logits(cfg, params, tokens, pos, seg)
  want = ref_forward_logits(to64(params), tokens, cfg, pos, seg)
  assert rel_err(got, want) < RTOL


def test_reference_discriminates():
  """The tolerance is tight enough: wrong grouping or interleaved RoPE fail it."""
  cfg = tiny_cfg()
  p = to64(make_params(cfg))
  tokens = random_tokens(cfg, 2, 12)
  want = ref_forward_logits(p, tokens, cfg)
  # Grouping h -> h % K instead of h // (H / K): permute query heads 1 <-> 2.
  swapped = dict(p, layers=dict(p['layers']))
  swapped['layers']['wq'] = p['layers']['wq'][:, :, [0, 2, 1, 3]]
  swapped['layers']['wo'] = p['layers']['wo'][:, [0, 2, 1, 3]]
  assert rel_err(ref_forward_logits(swapped, tokens, cfg), want) > 1e3 * RTOL
  # Interleaved (GPT-J) pairing instead of halves: permute head_dim of q and k alike.
  perm = [0, 2, 4, 6, 1, 3, 5, 7]
  inter = dict(p, layers=dict(p['layers']))
  for name in ('wq', 'wk'):
    inter['layers'][name] = p['layers'][name][..., perm]
  assert rel_err(ref_forward_logits(inter, tokens, cfg), want) > 1e3 * RTOL


@pytest.mark.parametrize('policy', ['full', 'save_matmuls'])
def test_remat_same_logits_and_grads(policy):
  base = tiny_cfg()
  params = make_params(base)
  batch = make_batch(base, packed=True)
  cfg = tiny_cfg(remat=policy)
  tokens = batch['inputs']
  assert rel_err(model_logits(cfg, params, tokens), model_logits(base, params, tokens)) < RTOL
  loss, grads = loss_and_grads(cfg, params, batch)
  loss0, grads0 = loss_and_grads(base, params, batch)
  assert rel_err(loss, loss0) < RTOL
  assert_trees_close(grads, grads0)


@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
def test_save_attention_runs_no_attention_forward_in_the_backward(moe):
  """remat='save_attention': the same loss and gradients as no remat and as 'full', and
  the compiled step runs the flash forward kernel once a layer (with 'full' twice: the
  backward recomputes it); the backward kernels once either way."""
  from sharding import hlo   # pylint: disable=import-outside-toplevel
  extra = dict(num_experts=4, experts_per_token=2, moe_every=2) if moe else {}
  base = tiny_cfg(attention_impl='pallas', num_layers=4, **extra)
  params = make_params(base)
  batch = make_batch(base, packed=True)
  loss0, grads0 = loss_and_grads(base, params, batch)
  calls = {}
  for policy in ('full', 'save_attention'):
    cfg = dataclasses.replace(base, remat=policy)
    loss, grads = loss_and_grads(cfg, params, batch)
    assert rel_err(loss, loss0) < RTOL, policy
    assert_trees_close(grads, grads0)
    step = jax.jit(jax.grad(lambda p, cfg=cfg: loss_lib.summed_nll(p, batch, cfg)))
    calls[policy] = hlo.hlo_stats(step.lower(params).compile().as_text()).kernel_calls
  layers = base.num_layers
  backward = {'flash_attention_dq': layers, 'flash_attention_dkv': layers}
  assert calls['full'] == {'flash_attention_fwd': 2 * layers, **backward}, calls
  assert calls['save_attention'] == {'flash_attention_fwd': layers, **backward}, calls


@pytest.mark.parametrize('policy, forwards', [('full', 2), ('save_attention', 1)])
def test_train_step_lowered_for_cuda_calls_the_mosaic_forward(policy, forwards, monkeypatch):
  """gpt_64k's train step (shrunk: 2 layers, 512 tokens) with the Mosaic GPU kernels,
  lowered for CUDA here (no GPU: lowered, not compiled): under save_attention the layer
  scan calls the forward kernel once, under full twice (the backward recomputes it), and
  the two backward kernels either way. On an H200, save_attention's profile showed two
  forward kernels a step: this says jax emits one. The second was XLA's
  (dynamic-slice-fusion-rewriter-v2, named by benchmarks/hlo_pass_trace.py), which
  training/state.py now turns off for that policy."""
  import functools   # pylint: disable=import-outside-toplevel
  from pallas_kernels import flash_attention as fa   # pylint: disable=import-outside-toplevel
  from sharding.mesh import make_mesh   # pylint: disable=import-outside-toplevel
  from sharding.rules import make_plan   # pylint: disable=import-outside-toplevel
  from training import state   # pylint: disable=import-outside-toplevel
  from training.cli import load_config_file   # pylint: disable=import-outside-toplevel
  # Compiled kernels, not the interpreter this CPU would pick.
  monkeypatch.setattr(transformer, 'flash_attention',
                      functools.partial(fa.flash_attention, interpret=False))
  cfg = load_config_file('gpt_64k.py:smoke')
  m = cfg.model
  m.attention_impl, m.pallas_backend, m.remat = 'pallas', 'mosaic_gpu', policy
  m.head_dim, m.dtype = 64, 'bfloat16'
  cfg.mesh.fsdp, cfg.mesh.context = 1, 1
  t = cfg.data.seq_len
  plan = make_plan(make_mesh(cfg.mesh, jax.devices()[:1]), 3)
  params = jax.eval_shape(lambda: model.init_params(m, jax.random.key(0)))
  batch = {'inputs': jnp.zeros((1, t), jnp.int32), 'targets': jnp.zeros((1, t), jnp.int32),
           'weights': jnp.ones((1, t), jnp.float32),
           'positions': jnp.arange(t, dtype=jnp.int32)[None]}
  step = jax.jit(lambda p, b: state.loss_and_grads(p, b, cfg, plan))
  text = step.trace(params, batch).lower(lowering_platforms=('cuda',)).as_text()
  # Each kernel call: its result types, (out, lse) for the forward, dq alone, (dk, dv).
  calls = re.findall(r'custom_call @mosaic_gpu\w*\(.*\) -> (\(.*\)|tensor<[^>]*>)', text)
  results = [c.count('tensor<') for c in calls]
  lse = [c for c in calls if 'xf32>' in c]   # only the forward returns float32 (the lse)
  assert len(calls) == forwards + 2 and len(lse) == forwards, (policy, calls)
  assert sorted(results) == sorted([2] * forwards + [1, 2]), results


def test_train_step_compiles_without_the_passes_its_remat_policy_turns_off(monkeypatch):
  """state.PASSES_OFF reaches XLA through the train step's jit: a pass named for the
  step's remat policy does not run, the other policies keep it. On a GPU,
  save_attention's and none's entry (dynamic-slice-fusion-rewriter-v2, which cloned the
  attention forward: benchmarks/hlo_pass_trace.py) is no pass of this CPU's, so this puts the CPU's
  loop trip-count annotator under 'full', whose known_trip_count leaves the compiled text
  of the layer scan."""
  from sharding import planner   # pylint: disable=import-outside-toplevel
  from training import plan, state   # pylint: disable=import-outside-toplevel
  from training.cli import load_config_file   # pylint: disable=import-outside-toplevel
  def config(remat):
    cfg = load_config_file('default.py:tiny')
    cfg.model = dataclasses.replace(cfg.model, remat=remat)
    return cfg

  for remat in ('save_attention', 'none'):   # both save the kernel's output in the scan
    assert state.compiler_options(config(remat)) == {
        'xla_disable_hlo_passes': 'dynamic-slice-fusion-rewriter-v2'}
  assert state.compiler_options(config('full')) == {}
  # Passes XLA_FLAGS turns off stay off: the jit's list replaces the flag's.
  monkeypatch.setenv('XLA_FLAGS', '--xla_foo=1 --xla_disable_hlo_passes=cse,algsimp')
  assert state.compiler_options(config('save_attention')) == {
      'xla_disable_hlo_passes': 'cse,algsimp,dynamic-slice-fusion-rewriter-v2'}
  monkeypatch.delenv('XLA_FLAGS')
  monkeypatch.setitem(state.PASSES_OFF, 'full', ('while-loop-trip-count-annotator',))
  one = {'data': 1, 'stage': 1, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1}
  annotated = {}
  for remat in ('full', 'none'):
    built = plan.build_layout(config(remat), planner.Layout(one, 0, remat, 1, 0))
    annotated[remat] = 'known_trip_count' in built.compile().as_text()
  assert annotated == {'full': False, 'none': True}


def test_head_logits_backward_runs_in_the_compute_dtype():
  """The loss head's two backward matmuls take bfloat16 operands when the model computes in
  bfloat16 (the logits' float32 cotangent rounded once), give the float64 gradients within
  that rounding, and return the head's gradient in its float32 master dtype; in float32
  they are the plain einsum's VJP."""
  rng = np.random.default_rng(0)
  h = rng.normal(size=(2, 3, 8, 16))
  head = rng.normal(size=(2, 16, 40)) / 4
  g = rng.normal(size=(2, 3, 8, 40))

  def vjp(f, h, head):
    _, pull = jax.vjp(f, h, head)
    return pull(jnp.asarray(g, jnp.float32))

  plain = lambda h, head: jnp.einsum('sbcd,sdv->sbcv', h, head.astype(h.dtype),
                                     preferred_element_type=jnp.float32)
  h32, head32 = jnp.asarray(h, jnp.float32), jnp.asarray(head, jnp.float32)
  for got, want in zip(vjp(loss_lib.head_logits, h32, head32), vjp(plain, h32, head32)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

  h16 = jnp.asarray(h, jnp.bfloat16)
  dh, dhead = vjp(loss_lib.head_logits, h16, head32)
  assert dh.dtype == jnp.bfloat16 and dhead.dtype == jnp.float32
  h64 = np.asarray(h16, np.float64)
  head64 = np.asarray(head32.astype(jnp.bfloat16), np.float64)   # as the forward uses it
  want_dh = np.einsum('sbcv,sdv->sbcd', g, head64)
  want_dhead = np.einsum('sbcd,sbcv->sdv', h64, g)
  for got, want in ((dh, want_dh), (dhead, want_dhead)):
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2   # bfloat16: 2^-8
  # Every matmul of the forward and the backward, in the program jax emits: its operands.
  text = jax.jit(lambda h, head: vjp(loss_lib.head_logits, h, head)).lower(
      h16, head32).as_text()
  operands = re.findall(r'stablehlo.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)', text)
  assert len(operands) == 2, text   # dh and dhead (the unused logits are dropped)
  assert all(a.endswith('bf16>') and b.endswith('bf16>') for a, b in operands), operands


def test_save_attention_needs_a_fused_kernel():
  with pytest.raises(ValueError, match="set model.attention_impl to pallas or cudnn"):
    tiny_cfg(remat='save_attention')
  tiny_cfg(remat='save_attention', attention_impl='cudnn')


# -------------------------------------------------------------------------------- loss

@pytest.mark.parametrize('packed', [False, True], ids=['causal', 'packed'])
def test_summed_nll_matches_reference(packed):
  cfg = tiny_cfg(tie_embeddings=not packed)
  params = make_params(cfg)
  batch = make_batch(cfg, packed=packed)
  got = jax.jit(lambda p: loss_lib.summed_nll(p, batch, cfg))(params)
  assert rel_err(got, ref_summed_nll(to64(params), batch, cfg)) < RTOL


@pytest.mark.parametrize('chunk', [3, 4])
def test_loss_chunk_same_value_and_grads(chunk):
  base = tiny_cfg()
  params = make_params(base)
  batch = make_batch(base, packed=True)
  loss0, grads0 = loss_and_grads(base, params, batch)
  loss, grads = loss_and_grads(tiny_cfg(loss_chunk=chunk), params, batch)
  assert rel_err(loss, loss0) < RTOL
  assert_trees_close(grads, grads0)


# -------------------------------------------------------------------------- invariances

def test_appending_tokens_keeps_earlier_logits():
  cfg = tiny_cfg()
  params = make_params(cfg)
  tokens = random_tokens(cfg, 2, 12)
  short = model_logits(cfg, params, tokens[:, :7])
  assert rel_err(model_logits(cfg, params, tokens)[:, :7], short) < RTOL


def test_packed_document_matches_document_alone():
  cfg = tiny_cfg()
  params = make_params(cfg)
  tokens = random_tokens(cfg, 2, 12)
  seg, pos = packed_layout([5, 7])
  packed = model_logits(cfg, params, tokens, np.stack([pos] * 2), np.stack([seg] * 2))
  alone = model_logits(cfg, params, tokens[:, 5:])
  assert rel_err(packed[:, 5:], alone) < RTOL


def test_gqa_equals_mha_with_repeated_kv_heads():
  gqa = tiny_cfg()
  mha = tiny_cfg(num_kv_heads=gqa.num_heads)
  params = make_params(gqa)
  group = gqa.num_heads // gqa.num_kv_heads
  # Query head h reads kv head h // group: repeat each kv head `group` times in a row.
  mha_params = dict(params, layers=dict(params['layers']))
  for name in ('wk', 'wv'):
    mha_params['layers'][name] = jnp.repeat(params['layers'][name], group, axis=2)
  tokens = random_tokens(gqa, 2, 12)
  assert rel_err(model_logits(mha, mha_params, tokens), model_logits(gqa, params, tokens)) < RTOL


# ------------------------------------------------------------------------- rope, flops

def test_rope_inv_freq_llama3_scaling():
  cfg = ModelConfig(head_dim=64, embed_dim=256, num_heads=4, rope_theta=500000.0,
                    rope_scaling_factor=8.0, rope_original_max_len=8192,
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0)
  want = ref_llama3_inv_freq(64, 500000.0, 8.0, 8192, 1.0, 4.0)
  plain = ref_inv_freq(64, 500000.0)
  wavelength = 2 * np.pi / plain
  # All three branches of the rule occur at these settings.
  assert (wavelength > 8192).any() and (wavelength < 2048).any()
  assert ((wavelength >= 2048) & (wavelength <= 8192)).any()
  got = transformer.rope_inv_freq(cfg)
  assert got.shape == (32,)
  np.testing.assert_allclose(got, want, rtol=1e-6)   # float32 rounding of a float64 value
  unscaled = transformer.rope_inv_freq(dataclasses.replace(cfg, rope_scaling_factor=1.0))
  np.testing.assert_allclose(unscaled, plain, rtol=1e-6)


@pytest.mark.parametrize('extras', [{}, {'qkv_bias': True, 'qk_norm': True}],
                         ids=['llama', 'qkv_bias_qk_norm'])
@pytest.mark.parametrize('tie', [True, False], ids=['tied', 'untied'])
def test_flops_per_token_hand_count(tie, extras):
  """Biases and norm scales are no matmul weights."""
  cfg = tiny_cfg(tie_embeddings=tie, **extras)
  L, D, V, F, T = 2, 32, 61, 48, 12
  H, K, E = 4, 2, 8
  per_layer = D * H * E + 2 * D * K * E + H * E * D + 3 * D * F
  matmul_weights = L * per_layer + D * V   # output head; embedding lookup is free
  want = 6 * matmul_weights + 3 * 2 * 2 * L * T * H * E * 0.5
  assert model.flops_per_token(cfg, T) == pytest.approx(want, rel=1e-12)
