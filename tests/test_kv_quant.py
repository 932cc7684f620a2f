"""8-bit KV cache (--kv-cache-dtype): model/kv_quant.py, the scatter, both paged attention
paths, the sizing and the served engine.

The reference for every attention path is numpy float64 attention over the dequantized
K/V (8-bit value times its scale, in float64): over the quantized cache each path must
compute exactly that, up to float32 rounding, on one device and on a tensor=2 mesh.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import kv_quant, paged
from pallas_kernels import paged_attention as pa
from serve.config import KV_CACHE_DTYPE_CHOICES, ServeConfig
from serve.engine import sizing
from serve.engine.core import Engine
from serve.sampling_params import SamplingParams
from serve.worker import kv_cache
from serve.worker.model_runner import serving_plan
from sharding.mesh import MeshConfig, make_mesh
from tests.test_paged_attention import MIXED, make_case
from tests.test_paged_forward import Out, tiny_cfg, tiny_runner
from tests.test_serve_engine import make_prompts

FORMATS = ('int8', 'fp8_e4m3', 'fp8_e5m2')
TOL = 1e-5   # float32 paths against float64, relative to the largest |output|


# --------------------------------------------------------------------------- formats

def test_flag_choices_are_the_formats():
  assert KV_CACHE_DTYPE_CHOICES == kv_quant.KV_CACHE_DTYPES
  assert kv_quant.STORAGE['fp8'] == jnp.float8_e4m3fn   # vLLM's fp8


@pytest.mark.parametrize('name', FORMATS)
def test_quantize_scale_and_error_bound(name):
  """Scale = max |x| / the format's largest value; int8 rounds to the nearest step, fp8
  keeps 3 (e4m3) or 2 (e5m2) mantissa bits: relative error <= 2^-4 or 2^-3 of the value
  for the vector's large values. An all-zero vector stays zero."""
  dtype = kv_quant.STORAGE[name]
  x = np.random.default_rng(0).normal(size=(5, 3, 16)) * np.array([1e-3, 1, 30])[:, None]
  x = x.astype(np.float32)
  x[0, 0] = 0
  q, s = kv_quant.quantize(jnp.asarray(x), dtype)
  assert q.dtype == dtype and s.dtype == jnp.float32 and s.shape == x.shape[:-1]
  amax = np.abs(x).max(-1)
  top = 127 if name == 'int8' else float(jnp.finfo(dtype).max)
  np.testing.assert_allclose(np.asarray(s), np.where(amax > 0, amax / top, 1), rtol=1e-6)
  back = np.asarray(q, np.float64) * np.asarray(s, np.float64)[..., None]
  if name == 'int8':
    assert np.all(np.abs(back - x) <= 0.5 * np.asarray(s)[..., None] * (1 + 1e-6))
  else:
    rel = {'fp8_e4m3': 2.0 ** -4, 'fp8_e5m2': 2.0 ** -3}[name]
    big = np.abs(x) >= amax[..., None] / 8
    assert np.all(np.abs(back - x)[big] <= rel * np.abs(x)[big] * (1 + 1e-6))
  np.testing.assert_array_equal(back[0, 0], 0)
  assert np.all(np.abs(back).max(-1) <= amax * (1 + 1e-6))   # never past the range


# ------------------------------------------------------------- attention vs float64

def quantized_case(name, poison=True, **kw):
  """make_case's pages quantized: (case, (k8, v8, k_scale, v_scale)); a poisoned slot's
  scale is NaN (int8 cannot hold NaN itself), so any read of one shows."""
  case = make_case(MIXED, hq=kw.pop('hq', 4), hkv=kw.pop('hkv', 2), poison=poison,
                   max_seqs=7, **kw)
  k, v = case.args[1:3]
  out = []
  for x in (k, v):
    q, s = kv_quant.quantize(x, kv_quant.STORAGE[name])
    out.append((q, jnp.where(jnp.isnan(x).any(-1), jnp.nan, s)))
  (k8, ks), (v8, vs) = out
  return case, (k8, v8, ks, vs)


def float64_attention(case, pages, window: int = 0) -> np.ndarray:
  """Causal attention of every live row over its sequence's dequantized keys, float64;
  window > 0: each row over its last `window` positions only."""
  q, _, _, kv_lens, table, cu, num_seqs = (np.asarray(a) for a in case.args)
  k8, v8, ks, vs = (np.asarray(a, np.float64) for a in pages)
  k, v = k8 * ks[..., None], v8 * vs[..., None]
  t, hq, d = q.shape
  page, group = k.shape[1], hq // k.shape[2]
  out = np.zeros((t, hq, d))
  for s in range(int(num_seqs[0])):
    q_len, kv_len = cu[s + 1] - cu[s], kv_lens[s]
    pos = np.arange(kv_len)
    keys, vals = (x[table[s, pos // page], pos % page] for x in (k, v))   # [L, Hkv, D]
    for i in range(q_len):
      row, seen = cu[s] + i, kv_len - q_len + i + 1
      first = max(seen - window, 0) if window else 0
      for h in range(hq):
        scores = keys[first:seen, h // group] @ q[row, h].astype(np.float64) / np.sqrt(d)
        p = np.exp(scores - scores.max())
        out[row, h] = p @ vals[first:seen, h // group] / p.sum()
  return out


def assert_equals_float64(out, want, live_rows):
  out = np.asarray(out, np.float64)
  assert np.isfinite(out[:live_rows]).all(), 'read a poisoned slot'
  err = np.abs(out[:live_rows] - want[:live_rows]).max() / np.abs(want).max()
  assert err < TOL, err
  np.testing.assert_array_equal(out[live_rows:], 0)


XLA_VARIANTS = {'by_row': dict(row_tokens=1000), 'by_sequence': dict(window=4),
                'step_dense': dict(step_dense=True, row_tokens=1000)}


@pytest.mark.parametrize('name', FORMATS)
@pytest.mark.parametrize('path', ['pallas', *XLA_VARIANTS])
def test_attention_over_quantized_cache_equals_float64_over_dequantized(name, path):
  case, pages = quantized_case(name, seed=3)
  q, _, _, *meta = case.args
  k8, v8, ks, vs = pages
  if path == 'pallas':
    out = pa.paged_attention(q, k8, v8, *meta, k_scale=ks, v_scale=vs, num_kv_splits=2,
                             pages_per_block=2, _poison=np.nan)
  else:
    out = pa.paged_attention_xla(q, k8, v8, *meta, k_scale=ks, v_scale=vs, block_k=8,
                                 **XLA_VARIANTS[path])
  want = float64_attention(case, pages)
  assert_equals_float64(out, want, case.live_rows)
  # The 8-bit rounding is visible: the unquantized pages give another answer.
  assert np.abs(float64_attention(case, (*case.args[1:3], jnp.ones_like(ks),
                                         jnp.ones_like(vs))) - want).max() > 10 * TOL


@pytest.mark.parametrize('window', [3, 6])
def test_kernel_with_a_sliding_window_over_int8_pages_equals_float64(window):
  """A window under a page (3) and one across pages (6, pages of 4), under splits and
  page blocks: the kernel dequantizes the blocks its walk loads (those before a q block's
  window are skipped) as float64 windowed attention over the dequantized K/V; a poisoned
  slot past a sequence's end would show as NaN."""
  case, pages = quantized_case('int8', seed=7)
  q, _, _, *meta = case.args
  k8, v8, ks, vs = pages
  want = float64_attention(case, pages, window)
  for kw in (dict(num_kv_splits=2, pages_per_block=2), dict(num_kv_splits=3,
                                                            pages_per_block=1)):
    out = pa.paged_attention(q, k8, v8, *meta, k_scale=ks, v_scale=vs,
                             sliding_window=window, _poison=np.nan, **kw)
    assert_equals_float64(out, want, case.live_rows)
  # The window is visible: the whole context gives another answer.
  assert np.abs(float64_attention(case, pages) - want).max() > 10 * TOL


@pytest.mark.parametrize('name', FORMATS)
def test_kernel_equals_xla_path_on_a_stacked_cache(name):
  """The kernel reads layer 1 of a 3-layer stack in place, scales included; the XLA path
  reads the same layer out of the pool (layer_pages' form)."""
  case, pages = quantized_case(name, poison=False, seed=5)
  q, _, _, kv_lens, table, cu, num_seqs = case.args
  rng = np.random.default_rng(1)
  stack = [jnp.stack([x, *(jnp.asarray(rng.permutation(np.asarray(x).ravel()).reshape(
      x.shape)) for _ in range(2))])[jnp.array([1, 0, 2])] for x in pages]
  kernel = pa.paged_attention(q, *stack[:2], kv_lens, table, cu, num_seqs, layer=1,
                              k_scale=stack[2], v_scale=stack[3], num_kv_splits=2)
  pool = [x.reshape(-1, *x.shape[2:]) for x in stack]
  num_pages = pages[0].shape[0]
  xla = pa.paged_attention_xla(q, *pool[:2], kv_lens, table + num_pages, cu, num_seqs,
                               k_scale=pool[2], v_scale=pool[3])
  n = case.live_rows
  np.testing.assert_allclose(np.asarray(kernel)[:n], np.asarray(xla)[:n], rtol=0, atol=TOL)
  assert_equals_float64(kernel, float64_attention(case, pages), n)


@pytest.fixture(scope='module')
def tensor_plan():
  return serving_plan(make_mesh(MeshConfig(data=1, tensor=2), devices=jax.devices()[:2]))


@pytest.mark.parametrize('name', FORMATS)
@pytest.mark.parametrize('impl', ['xla', 'pallas'])
def test_tensor_parallel_attention_over_quantized_cache(tensor_plan, name, impl):
  """paged_attend on a tensor=2 mesh: each shard its kv heads, their pages and their
  scales (4 kv heads, 2 a shard) equals float64 over the whole dequantized cache."""
  case, pages = quantized_case(name, hq=8, hkv=4, seed=7)
  q, _, _, *meta = case.args
  k8, v8, ks, vs = pages
  if impl == 'pallas':   # the stacked form: one layer, its index
    k8, v8, ks, vs = (x[None] for x in pages)
    meta = (*meta, jnp.zeros((1,), jnp.int32))
  out = jax.jit(lambda *a: paged.paged_attend(*a[:3], a[3:-2], impl, tensor_plan,
                                              scales=a[-2:]))(q, k8, v8, *meta, ks, vs)
  assert_equals_float64(out, float64_attention(case, pages), case.live_rows)


# ------------------------------------------------------------------ scatter, runner

def test_write_kv_stores_values_and_scales_drops_padding():
  cfg = tiny_cfg()
  cache = paged.init_kv_cache(cfg, 5, 4, kv_cache_dtype='int8')
  assert [c.dtype for c in cache] == [jnp.int8] * 2 + [jnp.float32] * 2
  assert cache[2].shape == paged.kv_cache_shape(cfg, 5, 4)[:-1]
  rng = np.random.default_rng(0)
  k, v = (jnp.asarray(rng.normal(size=(3, 2, 16)), jnp.float32) for _ in range(2))
  slots = jnp.asarray([6, 13, 5 * 4])   # the last is padding: past the end
  out = paged.write_kv(cache, 1, k, v, slots)
  for x, vals, scales in ((k, out[0], out[2]), (v, out[1], out[3])):
    q, s = kv_quant.quantize(x[:2], jnp.int8)
    np.testing.assert_array_equal(vals[1, [1, 3], [2, 1]], q)
    np.testing.assert_array_equal(scales[1, [1, 3], [2, 1]], s)
  written = np.zeros((2, 5, 4), bool)
  written[1, 1, 2] = written[1, 3, 1] = True
  for c in out:
    assert not np.asarray(c)[~written].any(), 'padding or another slot was written'


def decode_logits(runner, prompt, steps=4):
  """Logits of a prefill and `steps` decodes of the prompt's own next tokens."""
  from tests.test_paged_forward import Chunk   # pylint: disable=import-outside-toplevel
  blocks = list(range(1, 1 + -(-len(prompt) // 4)))
  rows = [runner.execute(Out([Chunk(prompt[:-steps], 0, blocks)]))[0]]
  for i in range(len(prompt) - steps, len(prompt)):
    rows.append(runner.execute(Out([Chunk(prompt[i:i + 1], i, blocks)]))[0])
  return np.asarray(jnp.stack(rows))


# tensor=2 computes K and V with another float32 rounding than one device; a value that
# lands on an 8-bit rounding boundary then takes the neighbouring step (fp8_e4m3: 1/16 of
# the value), which moves the logits by ~5e-5 of their largest: not the 1e-5 of equal
# computations, and still far below what 8-bit storage itself moves them (>= 1.7e-2).
TP_TOL = 1e-3


@pytest.mark.parametrize('name', FORMATS)
def test_runner_on_tensor_mesh_equals_one_device(name):
  """The served step with an 8-bit cache: tensor=2 (pages and scales sharded over kv
  heads) stores the one-device cache (all but boundary roundings) and gives its logits;
  both differ from the unquantized cache's."""
  cfg = tiny_cfg()
  params = model.init_params(cfg, jax.random.key(0))
  prompt = [int(t) for t in np.random.default_rng(0).integers(0, 320, 23)]
  single = tiny_runner(params, cfg, kv_cache_dtype=name)
  one = decode_logits(single, prompt)
  mesh = make_mesh(MeshConfig(data=1, tensor=2), devices=jax.devices()[:2])
  runner = tiny_runner(params, cfg, mesh, kv_cache_dtype=name)
  shard = lambda x: x.addressable_shards[0].data.shape   # noqa: E731
  assert shard(runner.cache[0])[3] == shard(runner.cache[2])[3] == cfg.num_kv_heads // 2
  two = decode_logits(runner, prompt)
  for a, b in zip(single.cache[:2], runner.cache[:2]):
    assert (np.asarray(a) != np.asarray(b)).mean() < 1e-3
  full = decode_logits(tiny_runner(params, cfg), prompt)
  scale = np.abs(full).max()
  assert np.abs(two - one).max() / scale < TP_TOL
  assert np.abs(full - one).max() / scale > 10 * TP_TOL


# ------------------------------------------------------------------------ capacity

def test_capacity_about_doubles_at_the_same_memory(monkeypatch):
  """bfloat16 model, head_dim 64: 128 bytes a token and kv head become 64 + a 4-byte
  scale, so 128 / 68 = 1.88x the blocks, tokens and full-length requests."""
  cfg = dataclasses.replace(tiny_cfg(), embed_dim=256, dtype='bfloat16')
  assert cfg.resolved_head_dim == 64
  auto, int8 = (kv_cache.kv_bytes_per_block(cfg, 16, kv_cache_dtype=n) for n in ('auto', 'int8'))
  assert (auto, int8) == (2 * 2 * 2 * 128 * 16, 2 * 2 * 2 * 68 * 16)
  counts = {}
  for name in ('auto', 'int8', 'fp8'):
    counts[name] = kv_cache.num_blocks_for_memory(cfg, 16, fraction=1.0, param_bytes=0,
                                                  memory_bytes=1 << 24, kv_cache_dtype=name)
  assert counts['int8'] == counts['fp8'] == (1 << 24) // int8
  assert counts['int8'] / counts['auto'] == pytest.approx(128 / 68, rel=1e-3)
  line = sizing.describe_cache(counts['int8'], ServeConfig(kv_cache_dtype='int8'), 64)
  assert line.startswith(f'KV cache (int8, scaled): {counts["int8"]} blocks of 16 tokens')


def test_engine_start_line_counts_the_smaller_cache(monkeypatch, tiny_served, capsys):
  """The engine sized from memory (the CPU cap lifted): the 8-bit cache's start-up line
  holds 2 * head_dim / (head_dim + 4) times the tokens."""
  monkeypatch.setattr(kv_cache, 'device_memory_bytes', lambda device=None: 64 << 20)
  tokens = {}
  for name in ('auto', 'int8'):
    cfg = ServeConfig(num_blocks=0, max_num_seqs=256, max_num_batched_tokens=256,
                      memory_fraction=0.02, kv_cache_dtype=name)
    with Engine(tiny_served, cfg) as eng:
      tokens[name] = (eng.num_blocks - 1) * 16
      assert eng.num_blocks < 256 * 4 + 1   # memory, not the CPU cap, sized it
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith('KV cache')]
    assert f' = {tokens[name]} tokens; ' in line, line
  d = tiny_served.model_cfg.resolved_head_dim
  want = 4 * d / (d + 4)   # float32 model: 4 bytes a value
  assert tokens['int8'] / tokens['auto'] == pytest.approx(want, rel=0.01)


# ------------------------------------------------------------------------ bad input

def test_unknown_format_refused():
  with pytest.raises(ValueError, match=r"--kv-cache-dtype='fp4': choose one of"):
    ServeConfig(kv_cache_dtype='fp4').validate()


def test_backend_without_fp8_refused_in_one_line(monkeypatch):
  """A backend whose fp8 round trip fails: fp8 refused naming the flag and the formats
  that do work; int8 accepted. This CPU backend runs them all (XLA emulates fp8)."""
  for name in KV_CACHE_DTYPE_CHOICES:
    kv_quant.check_backend(name)
  real = kv_quant.quantize

  def no_fp8(x, dtype):
    if jnp.dtype(dtype) != jnp.int8:
      raise RuntimeError('fp8 unsupported')
    return real(x, dtype)

  monkeypatch.setattr(kv_quant, 'quantize', no_fp8)
  kv_quant.check_backend('int8')
  with pytest.raises(ValueError) as e:
    kv_quant.check_backend('fp8_e5m2')
  assert '\n' not in str(e.value)
  assert str(e.value).startswith('--kv-cache-dtype=fp8_e5m2: cpu device')
  assert str(e.value).endswith('choose one of auto, int8.')


# ---------------------------------------------------------------------- served model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Measured share of each format's greedy tokens equal to the model-dtype cache's, on
# the trained tiny model (32 prompts x 12 tokens); the floors sit at the measurement.
AGREEMENT_FLOOR = {'int8': 1.0, 'fp8_e4m3': 1.0, 'fp8_e5m2': 1.0}


@pytest.fixture(scope='module')
def served_runs(tiny_served):
  """Greedy tokens of the trained tiny model with each cache format, twice (the second
  pass hits the prefix cache), and the step programs compiled by the runner's warmup
  (every token bucket) and after both passes."""
  prompts = make_prompts(32)
  runs = {}
  for name in ('auto', *FORMATS):
    with Engine(tiny_served, ServeConfig(num_blocks=200, max_num_seqs=32,
                                         max_num_batched_tokens=64,
                                         kv_cache_dtype=name)) as eng:
      eng.runner.warmup()   # idle engine: its loop touches the runner only for requests
      compiles = eng.runner.num_compiles
      first = [r.token_ids for r in eng.generate(prompts, GREEDY)]
      again = [r.token_ids for r in eng.generate(prompts, GREEDY)]
      runs[name] = (first, again, compiles, eng.runner.num_compiles)
  return runs


@pytest.mark.parametrize('name', FORMATS)
def test_served_greedy_with_8bit_cache_agrees_with_model_dtype_cache(served_runs, name):
  want = np.asarray(served_runs['auto'][0])
  first, again, compiles, compiles_after = served_runs[name]
  got = np.asarray(first)
  assert got.shape == want.shape
  agree = (got == want).mean()
  same_prefix = np.mean([np.argmin(np.append(g == w, False)) for g, w in zip(got, want)])
  print(f'{name}: {agree:.3f} of greedy tokens agree with the model-dtype cache; '
        f'{same_prefix:.2f} tokens before the first difference; distinct outputs '
        f'{len({tuple(x) for x in first})}')
  assert agree >= AGREEMENT_FLOOR[name], agree
  assert again == first   # prefix-cache hits read the 8-bit blocks back alike
  assert compiles_after == compiles == served_runs['auto'][2]   # no recompiles


def test_served_perplexity_equals_training_forward_with_quantized_kv(tiny_served):
  """benchmarks/kv_cache_perplexity.py's two measures agree: the serving cache of each
  format scores held-out text as the training forward (dense attention) does with K and
  V quantized per token and kv head right after their projection."""
  from benchmarks import kv_cache_perplexity as bench  # pylint: disable=import-outside-toplevel
  text = np.frombuffer(open(kv_quant.__file__.replace('kv_quant', 'transformer'),
                            'rb').read(), np.uint8)
  wins = np.stack([text[i * 33:(i + 1) * 33] for i in range(8)]).astype(np.int32)
  params, cfg = tiny_served.params, tiny_served.model_cfg
  for name in ('auto', 'int8', 'fp8_e5m2'):
    dtype = None if name == 'auto' else kv_quant.STORAGE[name]
    served = bench.served_perplexity(params, cfg, wins, name)
    dense = bench.simulated_perplexity(params, cfg, wins, dtype, 'token_head')
    assert served == pytest.approx(dense, rel=1e-5), name


def test_cli_refuses_a_format_the_device_lacks_before_any_weight(monkeypatch, tiny_workdir):
  import argparse  # pylint: disable=import-outside-toplevel
  from serve import config as serve_config  # pylint: disable=import-outside-toplevel
  from serve.load import checkpoint  # pylint: disable=import-outside-toplevel
  args = serve_config.add_engine_args(argparse.ArgumentParser()).parse_args(
      ['--checkpoint', tiny_workdir, '--kv-cache-dtype', 'fp8'])
  monkeypatch.setattr(kv_quant, '_works', lambda name, device, attention: name in ('auto',
                                                                                    'int8'))
  monkeypatch.setattr(checkpoint, 'load_checkpoint',
                      lambda *a, **k: pytest.fail('weights read before the refusal'))
  with pytest.raises(ValueError, match=r'^--kv-cache-dtype=fp8: .* choose one of auto, int8\.$'):
    serve_config.load_served_model(args)
