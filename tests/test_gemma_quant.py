"""A Gemma 2 (soft caps, every other layer windowed) served with 8-bit weights
(--quantization int8) and an 8-bit KV cache (--kv-cache-dtype int8) together.

The reference is the training forward (dense XLA attention, not the paged one) on the
weights dequantized in numpy, with K and V quantized per token and kv head right after
their projection, as the 8-bit cache stores them (benchmarks/kv_cache_perplexity.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from benchmarks import kv_cache_perplexity as bench
from model import paged, quant, transformer
from model.config import ModelConfig
from serve.config import ServeConfig
from serve.engine.core import Engine
from serve.load.hf_model import ServedModel
from serve.sampling_params import SamplingParams
from tests.test_gemma import GEMMA2, random_norms
from tests.test_paged_attention import rel_err
from tests.test_weight_quant import numpy_dequantized
from training.tokenizer import ByteTokenizer

TOL = 1e-5   # float32 paths against each other, relative to the largest |logit|


def gemma_cfg(**fields):
  return ModelConfig(vocab_size=257, num_layers=4, embed_dim=32, num_heads=4, num_kv_heads=2,
                     max_seq_len=64, init_std=0.3, tie_embeddings=False,
                     **{**GEMMA2, **fields})


def dense_logits(params, cfg, tokens, kv_dtype=jnp.int8):
  """Training-forward logits [T, V] with K/V quantized as the 8-bit cache holds them."""
  project = transformer.project_qkv

  def quantized_qkv(*args, **kwargs):
    q, k, v = project(*args, **kwargs)
    return (q, bench.fake_quant(k, kv_dtype, 'token_head'),
            bench.fake_quant(v, kv_dtype, 'token_head'))

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(transformer, 'project_qkv', quantized_qkv)
    fn = jax.jit(lambda p, t: model.logits(p, model.forward(p, t, cfg), cfg))
    return np.asarray(fn(params, jnp.asarray(tokens[None], jnp.int32))[0])


def prefill_batch(n):
  return paged.PagedBatch(
      tokens=jnp.arange(n, dtype=jnp.int32) * 37 % 257, positions=jnp.arange(n, dtype=jnp.int32),
      slots=jnp.arange(n, dtype=jnp.int32), kv_lens=jnp.asarray([n], jnp.int32),
      page_indices=jnp.arange(8, dtype=jnp.int32)[None],
      cu_q_lens=jnp.asarray([0, n], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32),
      sample_rows=jnp.arange(n, dtype=jnp.int32))


def paged_logits(params, cfg, batch, impl='xla', kv_cache_dtype='int8'):
  cache = paged.init_kv_cache(cfg, 8, 4, kv_cache_dtype=kv_cache_dtype)
  fn = jax.jit(lambda p, c: paged.sampled_logits(p, c, batch, cfg, impl=impl)[0])
  return np.asarray(fn(params, cache))


def test_a_quantized_gemma_over_an_8bit_cache_equals_the_dense_forward():
  """Paged prefill (XLA attention: windows, soft caps, 8-bit pages dequantized) of int8
  weights equals the dense forward on their numpy-dequantized values with int8 K/V;
  without the soft cap, or with the model-dtype cache, it does not."""
  cfg = gemma_cfg()
  params = quant.quantize_params(random_norms(model.init_params(cfg, jax.random.key(0))),
                                 'int8')
  batch = prefill_batch(20)
  got = paged_logits(params, cfg, batch)
  want = dense_logits(numpy_dequantized(params, 'float32'), cfg, np.asarray(batch.tokens))
  assert rel_err(got, want) < TOL
  assert rel_err(paged_logits(params, cfg, batch, kv_cache_dtype='auto'), want) > 10 * TOL
  assert rel_err(paged_logits(params, dataclasses.replace(cfg, attn_softcap=0.0), batch),
                 want) > 10 * TOL


def test_the_pallas_kernel_soft_caps_an_8bit_cache_as_xla():
  """Gemma 2's attention without windows (the kernel's case) over an int8 cache with int8
  weights: the Pallas paged kernel (interpreted) gives the XLA path's logits."""
  cfg = gemma_cfg(global_every=0, sliding_window=0)
  params = quant.quantize_params(random_norms(model.init_params(cfg, jax.random.key(1))),
                                 'int8')
  batch = prefill_batch(12)
  want = paged_logits(params, cfg, batch, 'xla')
  assert rel_err(paged_logits(params, cfg, batch, 'pallas'), want) < TOL
  capless = dataclasses.replace(cfg, attn_softcap=0.0)
  assert rel_err(paged_logits(params, capless, batch, 'pallas'), want) > 10 * TOL


def test_the_pallas_kernel_computes_a_windowed_gemma_over_an_8bit_cache():
  """Gemma 2's local (window 5) and global layers in one scan over an int8 cache with
  int8 weights: the Pallas paged kernel (interpreted), each layer's window its operand,
  gives the dense forward's logits; with no layer windowed it does not."""
  cfg = gemma_cfg()
  params = quant.quantize_params(random_norms(model.init_params(cfg, jax.random.key(2))),
                                 'int8')
  batch = prefill_batch(12)
  want = dense_logits(numpy_dequantized(params, 'float32'), cfg, np.asarray(batch.tokens))
  assert rel_err(paged_logits(params, cfg, batch, 'pallas'), want) < TOL
  windowless = gemma_cfg(global_every=0, sliding_window=0)
  assert rel_err(paged_logits(params, windowless, batch, 'pallas'), want) > 10 * TOL


def test_the_engine_serves_a_gemma_with_both_flags_as_the_dense_forward(capsys):
  """Engine(--quantization int8, --kv-cache-dtype int8) on a Gemma 2: greedy tokens
  (prefill, then decode steps reading the 8-bit pages back) are the dense forward's
  argmax, recomputed over the whole sequence at each step."""
  cfg = gemma_cfg()
  params = random_norms(model.init_params(cfg, jax.random.key(2)))
  served = ServedModel(model_cfg=cfg, params=params, tokenizer=ByteTokenizer(),
                       eos_token_ids=[256], chat_template=None, name='gemma2-tiny')
  greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
  prompt = [int(t) for t in ByteTokenizer().encode('soft caps, windows, 8 bits')]
  with Engine(served, ServeConfig(num_blocks=32, max_num_seqs=2, max_num_batched_tokens=64,
                                  kv_cache_dtype='int8', quantization='int8')) as eng:
    got = eng.generate([prompt], greedy)[0].token_ids
  start = capsys.readouterr().out
  assert 'int8 layer weights' in start and 'KV cache (int8, scaled)' in start, start
  dequantized = numpy_dequantized(quant.quantize_params(params, 'int8'), 'float32')
  tokens = list(prompt)
  for _ in range(greedy.max_tokens):
    tokens.append(int(np.argmax(dense_logits(dequantized, cfg, np.asarray(tokens))[-1])))
  assert list(got) == tokens[-greedy.max_tokens:]

