"""Gemma 2/3's model fields on their own (tests/test_serve_hf.py and test_hf_families.py
check whole models against transformers): the flash kernel's soft cap and per-layer
windows in training, equal loss and gradients on sharded layouts, the scanned serving
forward, and what is refused where it is not computed."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import paged
from model.config import ModelConfig
from tests import flash_cases, test_parallel
from tests.test_paged_attention import rel_err
from training import config as train_config

# A tiny Gemma 2: every other layer windowed, soft caps that bend unit-scale scores.
GEMMA2 = dict(mlp_activation='gelu_tanh', norm_plus_one=True, embed_scale=True,
              sandwich_norms=True, global_every=2, sliding_window=5, attn_softcap=1.5,
              final_softcap=3.0, query_pre_attn_scalar=24)


def random_norms(params, scale=0.5):
  """Norm weights drawn around their identity (0 with norm_plus_one), so that a norm
  applied wrong, or not at all, changes the result."""
  rng = np.random.default_rng(1)
  def draw(path, w):
    if 'norm' in jax.tree_util.keystr(path):
      return w + scale * rng.standard_normal(w.shape).astype(w.dtype)
    return w
  return jax.tree_util.tree_map_with_path(draw, params)


def test_the_flash_kernel_computes_gemma_attention_as_xla():
  """attention_impl=pallas (the flash kernels interpreted on CPU: soft cap, the query
  scale, the window of every other layer chosen in the scan) gives the XLA attention's
  loss and gradients; dropping the cap or the alternation changes the loss."""
  cfg = flash_cases.tiny_config(num_layers=4, **GEMMA2)
  loss_and_grads = flash_cases.loss_and_grads_of(
      cfg, random_norms(model.init_params(cfg, jax.random.key(0))))
  want = flash_cases.assert_flash_equals_xla(loss_and_grads)
  for other in (dict(attn_softcap=0.0), dict(global_every=0), dict(sliding_window=0,
                                                                    global_every=0)):
    assert rel_err(loss_and_grads(**other)[0], want) > 1e-4, other


@pytest.mark.parametrize('layout', ['fsdp2_tp4', 'tp4_sp_dp2'])
def test_a_gemma2_trains_alike_on_every_layout(layout, monkeypatch):
  """A tiny Gemma 2 (random norms) under FSDP with tensor parallelism and under sequence
  parallelism: the loss and every gradient equal one device's."""
  cfg = test_parallel.tiny_config()
  cfg.model = dataclasses.replace(cfg.model, num_layers=4, **GEMMA2)
  init = model.init_params
  monkeypatch.setattr(model, 'init_params', lambda c, key: random_norms(init(c, key)))
  ref_loss, ref_grads = test_parallel.sharded_loss_and_grads(
      cfg, test_parallel.MeshConfig(data=1), 0, False, jax.devices()[:1])
  loss, grads = test_parallel.sharded_loss_and_grads(cfg, *test_parallel.PRESETS[layout])
  assert test_parallel.rel_err(loss, ref_loss) < 1e-5
  errs = jax.tree.map(test_parallel.rel_err, grads, ref_grads)
  assert max(jax.tree.leaves(errs)) < 1e-5, errs
  assert np.any(np.asarray(grads['layers']['post_mlp_norm']))


def test_the_scanned_paged_forward_equals_the_unrolled_one():
  """paged_forward over stacked layers (each layer's local flag traced in the scan: the
  window by a cond, Gemma 3's RoPE base by a select) gives the per-layer loop's logits,
  which the training forward gives too."""
  cfg = ModelConfig(vocab_size=64, num_layers=6, embed_dim=32, num_heads=4, num_kv_heads=2,
                    max_seq_len=64, init_std=0.3, qk_norm=True, rope_local_theta=100.0,
                    rope_theta=1e6, rope_scaling_type='linear', rope_scaling_factor=4.0,
                    **{**GEMMA2, 'global_every': 3})
  params = random_norms(model.init_params(cfg, jax.random.key(0)))
  tokens = np.random.default_rng(0).integers(0, 64, 20).astype(np.int32)
  page = 4
  cache = paged.init_kv_cache(cfg, 8, page)
  batch = paged.PagedBatch(
      tokens=jnp.asarray(tokens), positions=jnp.arange(20, dtype=jnp.int32),
      slots=jnp.arange(20, dtype=jnp.int32), kv_lens=jnp.asarray([20], jnp.int32),
      page_indices=jnp.arange(8, dtype=jnp.int32)[None], cu_q_lens=jnp.asarray([0, 20],
                                                                              jnp.int32),
      num_seqs=jnp.asarray([1], jnp.int32), sample_rows=jnp.arange(20, dtype=jnp.int32))
  run = jax.jit(lambda p, c: paged.sampled_logits(p, c, batch, cfg)[0])
  scanned = run(params, cache)
  unrolled = run(paged.unstack_layers(params, cfg), cache)
  dense = model.logits(params, model.forward(params, jnp.asarray(tokens[None]), cfg), cfg)[0]
  assert rel_err(scanned, unrolled) < 1e-5
  assert rel_err(scanned, dense) < 1e-5
  other = dataclasses.replace(cfg, rope_local_theta=1e6)
  assert rel_err(jax.jit(lambda p, c: paged.sampled_logits(p, c, batch, other)[0])(
      params, cache), scanned) > 1e-4


def test_the_pallas_paged_kernel_soft_caps_as_xla():
  """A soft-capped model without windows (Gemma 2's attention, every layer global)
  served through the Pallas paged kernel (interpreted) gives XLA's paged logits."""
  cfg = ModelConfig(vocab_size=64, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                    max_seq_len=64, init_std=0.3, **{**GEMMA2, 'global_every': 0,
                                                     'sliding_window': 0})
  params = random_norms(model.init_params(cfg, jax.random.key(0)))
  n = 12
  batch = paged.PagedBatch(
      tokens=jnp.arange(n, dtype=jnp.int32) * 5 % 64, positions=jnp.arange(n, dtype=jnp.int32),
      slots=jnp.arange(n, dtype=jnp.int32), kv_lens=jnp.asarray([n], jnp.int32),
      page_indices=jnp.arange(4, dtype=jnp.int32)[None],
      cu_q_lens=jnp.asarray([0, n], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32),
      sample_rows=jnp.arange(n, dtype=jnp.int32))
  run = lambda impl, c: jax.jit(lambda p, k: paged.sampled_logits(p, k, batch, c, impl=impl)[0])(
      params, paged.init_kv_cache(c, 4, 4))
  want = run('xla', cfg)
  assert rel_err(run('pallas', cfg), want) < 1e-5
  assert rel_err(run('xla', dataclasses.replace(cfg, attn_softcap=0.0)), want) > 1e-4


def two_step_batches(a, b, page=4):
  """Two sequences in two steps: a[:12] and b[:8] as prefill chunks, then a[12:] (a chunk
  continuing its cached prefix) and b[8] (a decode row); pages of 4, a's 0-4, b's 5-7."""
  table = jnp.asarray([[0, 1, 2, 3, 4], [5, 6, 7, 0, 0]], jnp.int32)
  def batch(parts):
    tokens, positions, slots, cu = [], [], [], [0]
    for s, (seq, lo, hi) in enumerate(parts):
      pos = np.arange(lo, hi)
      tokens += list(seq[lo:hi])
      positions += list(pos)
      slots += list(np.asarray(table)[s, pos // page] * page + pos % page)
      cu.append(cu[-1] + hi - lo)
    as32 = lambda x: jnp.asarray(x, jnp.int32)
    return paged.PagedBatch(tokens=as32(tokens), positions=as32(positions),
                            slots=as32(slots), kv_lens=as32([hi for _, _, hi in parts]),
                            page_indices=table, cu_q_lens=as32(cu), num_seqs=as32([2]),
                            sample_rows=as32(np.arange(cu[-1])))
  return batch([(a, 0, 12), (b, 0, 8)]), batch([(a, 12, len(a)), (b, 8, len(b))])


@pytest.mark.parametrize('fields', [GEMMA2, dict(sliding_window=5)], ids=['gemma2', 'mistral'])
def test_windowed_models_served_through_the_pallas_paged_kernel_equal_xla(fields):
  """A tiny Gemma 2 (local and global layers alternating, soft caps) and a Mistral with a
  window of 5, served in two steps (prefill chunks, then a continuing chunk and a decode
  row) through the Pallas paged kernel (interpreted), scanned and unrolled: XLA's paged
  logits, and the training forward's at the same positions."""
  cfg = ModelConfig(vocab_size=64, num_layers=4, embed_dim=32, num_heads=4, num_kv_heads=2,
                    max_seq_len=64, init_std=0.3, **fields)
  params = random_norms(model.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)
  a, b = (rng.integers(0, 64, n).astype(np.int32) for n in (20, 9))
  steps = two_step_batches(a, b)
  def serve(p, impl):
    cache, out = paged.init_kv_cache(cfg, 8, 4), []
    for batch in steps:
      logits, cache = jax.jit(functools.partial(paged.sampled_logits, batch=batch, cfg=cfg,
                                                impl=impl))(p, cache)
      out.append(logits)
    return jnp.concatenate(out)
  want = serve(params, 'xla')
  dense = lambda t: model.logits(params, model.forward(params, jnp.asarray(t[None]), cfg),
                                 cfg)[0]
  da, db = dense(a), dense(b)
  assert rel_err(want, jnp.concatenate([da[:12], db[:8], da[12:], db[8:]])) < 1e-5
  for p in (params, paged.unstack_layers(params, cfg)):
    assert rel_err(serve(p, 'pallas'), want) < 1e-5
  whole = dataclasses.replace(cfg, sliding_window=0, global_every=0)
  assert rel_err(jax.jit(functools.partial(paged.sampled_logits, batch=steps[0], cfg=whole,
                                           impl='pallas'))(
      params, paged.init_kv_cache(cfg, 8, 4))[0], want[:20]) > 1e-4


def test_soft_capping_is_refused_where_it_is_not_computed():
  """cuDNN, the Mosaic kernels and context parallelism do not soft-cap attention:
  refused at start, by name; both paged attentions do."""
  with pytest.raises(ValueError, match=r"attn_softcap=50.0 runs with attention_impl xla or "
                                       r"pallas \(it is 'cudnn'\)"):
    ModelConfig(attn_softcap=50.0, attention_impl='cudnn').validate()
  with pytest.raises(ValueError, match='the Mosaic GPU kernels do not soft-cap'):
    ModelConfig(attn_softcap=50.0, attention_impl='pallas', pallas_backend='mosaic_gpu',
                dtype='bfloat16').validate()
  for impl in ('xla', 'pallas'):
    paged.check_impl(ModelConfig(attn_softcap=50.0), impl)
  cfg = train_config.Config()
  cfg.model.attn_softcap, cfg.mesh.context, cfg.mesh.data = 50.0, 2, 4
  with pytest.raises(ValueError, match='mesh.context=2 with model.attn_softcap=50.0'):
    train_config.validate(cfg, 8)


GEMMA3_JSON = {'architectures': ['Gemma3ForCausalLM'], 'model_type': 'gemma3_text',
               'vocab_size': 300, 'hidden_size': 64, 'intermediate_size': 128,
               'num_hidden_layers': 6, 'num_attention_heads': 4, 'head_dim': 16}


@pytest.mark.parametrize('edit, message', [
    ({'layer_types': ['sliding_attention', 'full_attention', 'full_attention'] * 2},
     "layer_types=.* is not supported: only every N-th layer global"),
    ({'hidden_activation': 'gelu'}, "hidden_activation='gelu' is not supported"),
    ({'use_bidirectional_attention': True}, 'use_bidirectional_attention=True is not '
                                            'supported'),
    ({'rope_parameters': {'full_attention': {'rope_type': 'yarn', 'factor': 2.0,
                                             'rope_theta': 1e6},
                          'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}},
     "rope_type='yarn' of full_attention layers is not supported"),
    ({'architectures': ['Gemma3ForConditionalGeneration'], 'model_type': 'gemma3'},
     'Gemma3ForConditionalGeneration.* is not supported'),
])
def test_what_gemma_config_json_holds_that_ours_cannot_compute_is_refused(edit, message):
  """One line naming config.json's field, from model_config: before any weight."""
  from model.hf import model_config   # pylint: disable=import-outside-toplevel
  model_config(GEMMA3_JSON)   # the unedited one reads
  with pytest.raises(ValueError, match=message):
    model_config({**GEMMA3_JSON, **edit})


def test_a_gemma_model_is_exported_only_as_a_gemma():
  """Llama has no (1 + w) norms or soft caps, Gemma 2 no second RoPE base: refused by
  the field, before anything is written."""
  from model.hf import export_architecture   # pylint: disable=import-outside-toplevel
  gemma2 = ModelConfig(**GEMMA2)
  assert export_architecture(gemma2) == 'Gemma2ForCausalLM'
  assert export_architecture(dataclasses.replace(gemma2, qk_norm=True)) == 'Gemma3ForCausalLM'
  with pytest.raises(ValueError, match="model.mlp_activation='gelu_tanh': LlamaForCausalLM "
                                       "has mlp_activation='silu'"):
    export_architecture(dataclasses.replace(gemma2, hf_architecture='LlamaForCausalLM'))
  with pytest.raises(ValueError, match='model.attn_softcap=1.5: LlamaForCausalLM has none'):
    export_architecture(ModelConfig(attn_softcap=1.5))
  with pytest.raises(ValueError, match='rope_local_theta=100.0: Gemma 2 has one RoPE base'):
    export_architecture(dataclasses.replace(gemma2, rope_local_theta=100.0))


def test_embeddings_are_scaled_in_the_compute_dtype_as_transformers_does():
  """sqrt(3072) = 55.43 is 55.5 in bfloat16: transformers' Gemma multiplies the bfloat16
  embeddings by that rounded factor, in bfloat16, and so does embed_scaled."""
  import torch  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig(embed_dim=3072, num_heads=24, dtype='bfloat16', embed_scale=True)
  x = np.random.default_rng(0).standard_normal((4, 3072)).astype(np.float32)
  got = np.asarray(model.transformer.embed_scaled(jnp.asarray(x), cfg), np.float32)
  rows = torch.as_tensor(x).to(torch.bfloat16)
  want = (rows * torch.tensor(3072 ** 0.5).to(torch.bfloat16)).float().numpy()
  np.testing.assert_array_equal(got, want)
  f32 = (rows.float() * 3072 ** 0.5).to(torch.bfloat16).float().numpy()
  assert np.any(want != f32)   # the unrounded factor would give other embeddings
