"""The cached forward pass (model/paged.py) against the training forward, and the XLA
paged attention against the jnp reference.

The training `model.forward` + `model.logits` on the whole token sequence is the
independent reference: a prompt prefilled in one chunk, in several chunks, or token by
token through the paged cache must give its logits at every sampled position. Measured
(fp32, logits of magnitude ~8): at most 9e-7 relative to the largest |logit| (1e-5
absolute), XLA and Pallas paths alike.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import paged
from model.config import ModelConfig
from pallas_kernels import paged_attention as pa
from serve.worker.model_runner import ModelRunner, RunnerConfig
from tests.test_paged_attention import MIXED, make_case, rel_err

# Relative to the largest |logit|; fp32 measures ~1e-6.
LOGITS_TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Chunk:
  """Stand-in for serve.engine.scheduler.ScheduledChunk (the runner reads these fields)."""
  token_ids: list
  start_position: int
  block_ids: list
  sample: bool = True
  spec_token_ids: tuple = ()


@dataclasses.dataclass(frozen=True)
class Out:
  chunks: list


def tiny_cfg(**kw) -> ModelConfig:
  # configs/default.py:tiny's shape; init_std 0.3 so the argmax is well separated.
  return ModelConfig(vocab_size=320, num_layers=2, embed_dim=64, num_heads=4,
                     num_kv_heads=2, max_seq_len=64, init_std=0.3, **kw)


def tiny_runner(params, cfg, mesh=None, vocab_size=None, **kw) -> ModelRunner:
  rc = dict(block_size=4, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=32,
            max_model_len=64, attention='xla')
  return ModelRunner(params, cfg, RunnerConfig(**{**rc, **kw}), mesh, vocab_size=vocab_size)


def dense_logits(params, cfg, tokens) -> np.ndarray:
  """[len(tokens), vocab]: the training forward on the whole sequence."""
  hidden = model.forward(params, jnp.asarray([tokens], jnp.int32), cfg)
  return np.asarray(model.logits(params, hidden, cfg)[0])


def err(got, want) -> float:
  return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@pytest.fixture(scope='module')
def setup():
  cfg = tiny_cfg()
  params = model.init_params(cfg, jax.random.key(0))
  prompt = [int(t) for t in np.random.default_rng(0).integers(0, 320, 23)]
  return cfg, params, prompt, dense_logits(params, cfg, prompt)


# ------------------------------------------------------------------- XLA vs reference

DECODE_ONLY = [(1, 9), (1, 30), (1, 1), (1, 17)]


@pytest.mark.parametrize('seqs, row_tokens', [(MIXED, 0), (DECODE_ONLY, 0), (MIXED, 10**6)],
                         ids=['by_sequence', 'by_row', 'mixed_by_row'])
@pytest.mark.parametrize('hq,hkv,block_k,window', [(8, 2, 4, 4), (4, 4, 8, 32),
                                                   (6, 2, 64, 5), (7, 1, 8, 1)])
def test_xla_matches_reference_poisoned(seqs, row_tokens, hq, hkv, block_k, window):
  """Mixed decode/prefill steps (the by-sequence path; chunks over several windows, or by
  row when the step has at most row_tokens rows) and decode-only steps (the by-row
  path), NaN in padding rows, unowned pages and page tails, junk in dead sequence slots:
  live rows equal the reference, padding rows 0."""
  case = make_case(seqs, hq=hq, hkv=hkv, max_seqs=7, seed=hq)
  fn = lambda *a: pa.paged_attention_xla(*a, block_k=block_k, window=window,
                                         row_tokens=row_tokens)
  out = jax.jit(fn)(*case.args)
  ref = pa.paged_attention_reference(*case.args)
  live = np.asarray(out[:case.live_rows])
  assert np.isfinite(live).all()
  assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
  np.testing.assert_array_equal(np.asarray(out[case.live_rows:]), 0)


# Cached prefixes only in the first max_seqs (7) rows: decodes and a continued chunk
# first, then prompts from position 0 (what the scheduler's steps mostly look like).
SPLIT = [(1, 9), (5, 13), (12, 12), (1, 1), (7, 7)]


@pytest.mark.parametrize('hq,hkv,block_k', [(8, 2, 4), (4, 4, 8), (7, 1, 64)])
def test_xla_step_dense_split_matches_reference_poisoned(hq, hkv, block_k):
  """step_dense: the split path (the step's rows densely among themselves, then the first
  S rows' cached prefixes) equals the reference where it applies; where a later row has
  a cached prefix (MIXED: a chunk continued at position 23 in rows 19-25), the split path
  alone would be wrong, and paged_attention_xla falls back to the general one."""
  fn = jax.jit(lambda *a: pa.paged_attention_xla(*a, block_k=block_k, step_dense=True))
  for seqs in (SPLIT, MIXED):
    case = make_case(seqs, hq=hq, hkv=hkv, max_seqs=7, seed=hq)
    ref = pa.paged_attention_reference(*case.args)
    out = fn(*case.args)
    assert np.isfinite(np.asarray(out[:case.live_rows])).all()
    assert rel_err(out, ref) < 1e-5, (seqs, rel_err(out, ref))
    np.testing.assert_array_equal(np.asarray(out[case.live_rows:]), 0)
    q, k_pages, v_pages, *meta = case.args
    split = pa._xla_step_dense(q, (k_pages, v_pages), *meta, ppb=1,
                               scale=1 / np.sqrt(q.shape[-1]))
    if seqs is SPLIT:
      assert rel_err(split, ref) < 1e-5
    else:
      assert not rel_err(split, ref) < 1e-3   # the fallback is needed


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_xla_long_context_and_shared_prefix(dtype, tol):
  for case in (make_case([(1, 200), (9, 200), (4, 37)], hq=8, hkv=2, d=32, page_size=8,
                         dtype=dtype, seed=4),
               make_case([(3, 19), (2, 22), (1, 6)], share_prefix=4, dtype=dtype, seed=3)):
    out = pa.paged_attention_xla(*case.args, block_k=16)
    assert out.dtype == dtype
    assert rel_err(out, pa.paged_attention_reference(*case.args)) < tol


# ------------------------------------------------------- cached forward vs training forward

@pytest.mark.parametrize('splits', [[23], [10, 12, 1], [5, 5, 5, 5, 3], [1] * 23])
def test_chunked_prefill_and_decode_match_forward(setup, splits):
  """One chunk, several, and token-by-token decode: logits at every chunk's last
  position equal the training forward's, and so do the K/V left in the cache."""
  cfg, params, prompt, want = setup
  runner = tiny_runner(params, cfg)
  blocks = [int(b) for b in np.random.default_rng(1).permutation(40)[:6]]
  start = 0
  for n in splits:
    got = runner.execute(Out([Chunk(prompt[start:start + n], start, blocks)]))
    start += n
    assert got.shape == (1, cfg.vocab_size) and got.dtype == jnp.float32
    assert err(got[0], want[start - 1]) < LOGITS_TOL, err(got[0], want[start - 1])


def test_mixed_step_matches_forward(setup):
  """Two prompts' chunks and a third's decode token in one step, sampled and unsampled
  mixed: only the sampled rows come back, in chunk order."""
  cfg, params, _, _ = setup
  rng = np.random.default_rng(2)
  prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (9, 14, 6)]
  want = [dense_logits(params, cfg, p) for p in prompts]
  runner = tiny_runner(params, cfg)
  pool = [int(b) for b in rng.permutation(40)]
  tables = [pool[0:3], pool[3:7], pool[7:9]]
  runner.execute(Out([Chunk(prompts[0][:4], 0, tables[0], False),
                      Chunk(prompts[2][:5], 0, tables[2], False)]))
  got = runner.execute(Out([Chunk(prompts[2][5:], 5, tables[2]),
                            Chunk(prompts[0][4:], 4, tables[0]),
                            Chunk(prompts[1][:7], 0, tables[1], False)]))
  assert got.shape == (2, cfg.vocab_size)
  assert err(got[0], want[2][5]) < LOGITS_TOL
  assert err(got[1], want[0][8]) < LOGITS_TOL


# ----------------------------------------------------------------------- padding, impls

def test_padding_writes_nothing(setup):
  """NaN everywhere in the cache; a step of 5 tokens (bucket 8) over 3 of 4 sequence
  slots writes exactly its 5 slots: the last page (where a -1 index would wrap) and
  page 0 (where a 0 index would land) stay NaN, and the logits are finite (no NaN page
  is read)."""
  cfg, params, prompt, want = setup
  runner = tiny_runner(params, cfg)
  runner.cache = tuple(jnp.full_like(c, jnp.nan) for c in runner.cache)
  chunks = [Chunk(prompt[:2], 0, [5]), Chunk(prompt[:1], 0, [9]), Chunk(prompt[:2], 0, [3])]
  batch, _ = runner.build_batch(chunks)
  assert batch.tokens.shape == (8,) and batch.kv_lens.shape == (4,)
  got = runner.execute(Out(chunks))
  assert np.isfinite(np.asarray(got)).all()
  assert err(got[0], want[1]) < LOGITS_TOL and err(got[1], want[0]) < LOGITS_TOL
  written = np.zeros((40, 4), bool)
  written[5, :2] = written[9, 0] = written[3, :2] = True
  for c in runner.cache:
    finite = np.isfinite(np.asarray(c)).all(axis=(-1, -2))       # [L, P, page]
    np.testing.assert_array_equal(finite, np.broadcast_to(written, finite.shape))


def test_write_kv_drops_out_of_range_slot():
  cache = (jnp.zeros((1, 2, 2, 1, 1)), jnp.zeros((1, 2, 2, 1, 1)))
  ones = jnp.ones((2, 1, 1))
  k, _ = paged.write_kv(cache, jnp.int32(0), ones, ones, jnp.asarray([1, 4]))
  np.testing.assert_array_equal(np.asarray(k).ravel(), [0, 1, 0, 0])


def test_pallas_equals_xla(setup):
  """The Pallas kernel (interpret mode) and the XLA path: same logits, same cache."""
  cfg, params, prompt, _ = setup
  runners = [tiny_runner(params, cfg, attention=a) for a in ('xla', 'pallas')]
  steps = [[Chunk(prompt[:9], 0, [4, 7, 1], False), Chunk(prompt[3:8], 0, [2, 0])],
           [Chunk(prompt[9:11], 9, [4, 7, 1]), Chunk(prompt[8:9], 5, [2, 0])]]
  for chunks in steps:
    xla, pallas = (np.asarray(r.execute(Out(chunks))) for r in runners)
    assert err(pallas, xla) < 1e-6
  # Layer 0's K/V are bitwise equal; layer 1's follow layer 0's attention output.
  for a, b in zip(*(r.cache for r in runners)):
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert err(b, np.asarray(a)) < 1e-6


# ------------------------------------------------- Pallas: the stacked cache, layer by index

@pytest.mark.parametrize('form', ['scanned', 'unrolled'])
def test_pallas_layers_read_their_own_pages(form):
  """A 3-layer model, its cache NaN before the first step, prefilled in chunks through
  the kernel on the stacked cache: the layer index traced (scan) or a Python int
  (unstack_layers' loop), every sampled logit equals the training forward's. A layer
  reading another's pages gets that layer's K/V, not its own."""
  cfg = dataclasses.replace(tiny_cfg(), num_layers=3)
  params = model.init_params(cfg, jax.random.key(3))
  prompt = [int(t) for t in np.random.default_rng(3).integers(0, 320, 23)]
  want = dense_logits(params, cfg, prompt)
  runner = tiny_runner(params, cfg, attention='pallas')
  if form == 'scanned':
    assert not isinstance(params['layers'], (list, tuple))
  else:
    params = paged.unstack_layers(params, cfg)
  step = jax.jit(functools.partial(paged.sampled_logits, cfg=cfg, impl='pallas'))
  cache = tuple(jnp.full_like(c, jnp.nan) for c in runner.cache)
  blocks, start = [17, 3, 29, 8, 11, 0], 0
  for n in (10, 12, 1):
    batch, _ = runner.build_batch([Chunk(prompt[start:start + n], start, blocks)])
    got, cache = step(params, cache, batch)
    start += n
    assert err(got[0], want[start - 1]) < LOGITS_TOL, err(got[0], want[start - 1])


def cuda_step(cfg, params, runner, monkeypatch):
  """A Pallas step as jax lowers it for CUDA (the Triton kernel, not the interpreter),
  on this host."""
  monkeypatch.setitem(paged.PAGED_ATTENTION, 'pallas',
                      functools.partial(paged._pallas_stacked, interpret=False))
  batch, _ = runner.build_batch([Chunk([1, 2, 3], 0, [5])])
  gpu = jax.sharding.AbstractDevice(device_kind='NVIDIA H100', num_cores=None, platform='gpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=gpu)
  step = jax.jit(functools.partial(paged.sampled_logits, cfg=cfg, impl='pallas'))
  with jax.sharding.use_abstract_mesh(mesh):
    return step.trace(params, runner.cache, batch).lower(lowering_platforms=('cuda',))


@pytest.mark.parametrize('form', ['scanned', 'unrolled'])
def test_pallas_step_slices_no_layer_out_of_the_cache(setup, form, monkeypatch):
  """Lowered for CUDA, every Triton kernel call takes the whole stacked cache as K and
  V, and no value anywhere in the step has one layer's pool shape ([P, page, Hkv, D],
  with or without a leading 1): no slice of a layer is taken."""
  cfg, params, _, _ = setup
  runner = tiny_runner(params, cfg, attention='pallas')
  if form == 'unrolled':
    params = paged.unstack_layers(params, cfg)
  text = cuda_step(cfg, params, runner, monkeypatch).as_text()
  dims = 'x'.join(map(str, runner.cache[0].shape[1:]))
  whole = f'tensor<{cfg.num_layers}x{dims}xf32>'
  calls = [line for line in text.splitlines() if '__gpu$xla.gpu.triton' in line]
  assert len(calls) == (cfg.num_layers if form == 'unrolled' else 1), calls
  for line in calls:
    operands = line[line.rindex(' : ('):line.rindex(') -> ')]
    assert operands.count(whole) == 2, operands
  assert not re.search(rf'tensor<(1x)?{dims}xf32>', text), 'a layer is sliced out'


def test_step_benchmark_counts_see_the_slice_in_the_cuda_step(setup, monkeypatch):
  """benchmarks.paged_decode's HLO counts (what its GPU stage reports of the compiled
  step) on the unrolled step lowered for CUDA here: the stacked step's kernel calls each
  take the whole cache and no value has a layer's shape; the sliced (old) step's calls
  take K and V slices of each layer."""
  from benchmarks import paged_decode   # pylint: disable=import-outside-toplevel
  cfg, params, _, _ = setup
  runner = tiny_runner(params, cfg, attention='pallas')
  params = paged.unstack_layers(params, cfg)
  counts = {}
  for variant, patch in paged_decode.STEP_VARIANTS.items():
    with patch():
      hlo = cuda_step(cfg, params, runner, monkeypatch).compiler_ir('hlo').as_hlo_text()
    counts[variant] = paged_decode.cache_traffic(hlo, runner.cache[0].shape, cfg.dtype)
  layers = cfg.num_layers
  assert counts['stacked'] == dict(layer_slices=0, cache_copies=0, kernel_calls=layers,
                                   kernel_calls_on_whole_cache=layers)
  assert counts['sliced']['kernel_calls'] == layers
  assert counts['sliced']['kernel_calls_on_whole_cache'] == 0
  assert counts['sliced']['layer_slices'] >= 2 * layers


def test_paged_step_benchmark_smoke():
  """benchmarks.paged_decode --step runs (CPU, interpret mode), and its HLO count sees
  what it is for: the sliced step holds each layer's K and V slices, the stacked none."""
  from benchmarks import paged_decode   # pylint: disable=import-outside-toplevel
  stacked, sliced = paged_decode.main(['--smoke', '--step'])
  assert (stacked['variant'], sliced['variant']) == ('stacked', 'sliced')
  assert stacked['layer_slices'] == 0
  assert sliced['layer_slices'] >= 2 * sliced['layers'], sliced
  assert all(r['step_ms'] > 0 and r['cache_bytes'] > 0 for r in (stacked, sliced))
