"""The Mosaic GPU (Hopper) flash kernels, forward and backward: run in Mosaic GPU's CPU
interpreter against the reference, lowered for CUDA at benchmark shapes, and their input
checks.

The interpreter simulates the three warpgroups, the TMA copies and the barriers, fills
fresh buffers with NaN (so an unwritten output fails) and detects races between
warpgroups (from jax 0.11 also between programs, and TMA writes after reads through the
generic proxy); its matmuls are plain dots (flash_attention_mgpu's docstring). The
wgmma path is what the lowering tests check (layouts, shapes, shared memory) and what
tests/test_gpu.py runs on a GPU.
"""

import dataclasses
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_attention as fa
from pallas_kernels import flash_attention_mgpu as fa_mgpu
from tests.test_flash_attention import (_assert_close, _inputs, _segment_ids,
                                        check_other_documents_are_never_read, tol)

try:  # jax >= 0.10, not yet a public name
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interpreter
except ImportError:  # pragma: no cover
  interpreter = None


def _out_lse_grads(fn, q, k, v, cot):
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  return (out, lse, *vjp(cot))


def check_mosaic_against_reference(seed, b, t, s, hq, hkv, d, causal, window, segments=None,
                                   **tiles):
  """Out, lse and the three gradients of backend='mosaic_gpu' (interpreted on CPU,
  compiled on a GPU) against the fp32 reference. segments: None, 'packed' (random
  documents, [B, T] ids) or 'pair' (random q and kv ids)."""
  rng, q, k, v = _inputs(seed, b, t, s, hq, hkv, d, jnp.bfloat16)
  seg = _segment_ids(rng, segments, b, t, s)
  cot = (jnp.asarray(rng.normal(size=q.shape), jnp.bfloat16),
         jnp.asarray(rng.normal(size=(b, hq, t)), jnp.float32))
  opts = dict(causal=causal, sliding_window=window, segment_ids=seg, return_lse=True)
  interpreted = jax.default_backend() == 'cpu'
  if interpreted:
    interpreter.reset_gpu_interpret_mode_state()
  # The kernel alone under jit: one jit with the reference beside it stalls the
  # interpreter's callbacks.
  got = jax.block_until_ready(jax.jit(lambda *a: _out_lse_grads(
      lambda q, k, v: fa.flash_attention(q, k, v, backend='mosaic_gpu', **opts, **tiles),
      *a))(q, k, v, cot))
  if interpreted:
    assert not interpreter.get_races().races_found, 'race between warpgroups or programs'
  want = jax.jit(lambda *a: _out_lse_grads(
      lambda q, k, v: fa.flash_attention_reference(q, k, v, **opts), *a))(q, k, v, cot)
  assert got[0].dtype == jnp.bfloat16 and got[1].shape == (b, hq, t)
  for name, g, w in zip(('out', 'lse', 'dq', 'dk', 'dv'), got, want):
    _assert_close(g, w, tol(jnp.bfloat16, name), name)


# b, t, s, hq, hkv, d, causal, window[, flash_attention options]. Lengths are not
# multiples of the 128-row program or the 128-key block; the two warpgroups of a program
# see different key ranges. With d <= 128 the backward is the Mosaic one too, unless the
# case asks for backend_bwd='triton'.
CASES = {
    'causal_gqa2_ragged': (1, 200, 200, 4, 2, 64, True, None),
    # 64-key forward blocks under the backward's 128-key padding multiple: keys 300..319
    # sit in a block before the last, which must still be masked.
    'cross_padded_keys': (1, 130, 300, 2, 1, 64, False, None, dict(block_k=64)),
    'window_gqa2': (1, 512, 512, 2, 1, 64, True, 200),  # unmasked blocks inside the window
    'causal_d128': (1, 256, 256, 2, 2, 128, True, None),
    # 128-row backward steps; a dk/dv program whose q-block count is odd, so three heads'
    # steps rotate through the two slots differently than one head's would.
    'window_gqa3_bwd_steps_128': (1, 320, 320, 3, 1, 64, True, 40,
                                  dict(block_q_bwd=128, block_k_bwd=128)),
    'causal_triton_bwd': (1, 200, 200, 2, 1, 64, True, None, dict(backend_bwd='triton')),
    # Packed documents in two batch rows; random q and kv ids beside padded keys (whose
    # padding id 0 is also a real id).
    'packed_gqa2_window': (2, 256, 256, 4, 2, 64, True, 90, dict(segments='packed')),
    'cross_pair_segments': (1, 130, 300, 2, 1, 64, False, None, dict(segments='pair')),
    # Documents [0, 320), [320, 448), [448, 512): blocks inside one document walk
    # unmasked (rows 128.. over keys ..127), the ones across a boundary masked.
    'long_documents_gqa2': (1, 512, 512, 2, 1, 64, True, None, dict(segments='long')),
    # Programs whose documents meet no block: empty walks in all three kernels.
    'cross_disjoint_segments': (1, 256, 256, 2, 1, 64, False, None,
                                dict(segments='disjoint')),
    # The fused backward (dQ added per step). d 128: the two warpgroups share their dS
    # and each adds half of D; three q heads per kv head, and a window that gives the
    # first program an odd walk (3 q blocks), so the two dS buffers swap roles at each
    # new head.
    'fused_window_d128_gqa3': (1, 320, 320, 3, 1, 128, True, 40,
                               dict(backend_bwd='mosaic_gpu_fused')),
    # d 64: each warpgroup adds its own keys' dQ; packed documents and a window.
    'fused_packed_gqa2_window': (2, 256, 256, 4, 2, 64, True, 90,
                                 dict(segments='packed', backend_bwd='mosaic_gpu_fused')),
    # Padded keys met unmasked by real queries, at d 128 (their dS zeroed for dQ; the
    # overflow test below is the one that fails without it).
    'fused_cross_padded_keys_d128': (1, 130, 300, 2, 1, 128, False, None,
                                     dict(backend_bwd='mosaic_gpu_fused')),
    # Empty walks at d 128: a program with no steps still meets the other warpgroup once
    # before dK overwrites K (_DqAdder.finish), and adds no dQ.
    'fused_disjoint_segments_d128': (1, 256, 256, 2, 1, 128, False, None,
                                     dict(segments='disjoint', backend_bwd='mosaic_gpu_fused')),
}


@pytest.mark.skipif(interpreter is None, reason='this jax has no Mosaic GPU interpreter')
# A barrier deadlock (a wrong slot or phase) hangs the interpreter: fail instead.
@pytest.mark.timeout(300, method='thread')
@pytest.mark.parametrize('case', CASES, ids=list(CASES))
def test_mosaic_kernels_match_reference(case):
  shape, options = CASES[case][:8], (CASES[case][8:] or ({},))[0]
  check_mosaic_against_reference(list(CASES).index(case), *shape, **options)


@pytest.mark.skipif(interpreter is None, reason='this jax has no Mosaic GPU interpreter')
@pytest.mark.timeout(300, method='thread')
@pytest.mark.parametrize('backend_bwd', ['mosaic_gpu', 'mosaic_gpu_fused'])
def test_mosaic_kernels_skip_other_documents_blocks(backend_bwd):
  # Documents of 128 rows: one program each in all three kernels, whose walks must stay
  # inside their own document (the NaN first and last documents show any other read;
  # fused, also any dQ added from another document's keys).
  interpreter.reset_gpu_interpret_mode_state()
  check_other_documents_are_never_read(True, (128, 128, 128), 2, 1, 64, jnp.bfloat16,
                                       backend='mosaic_gpu', backend_bwd=backend_bwd)
  assert not interpreter.get_races().races_found, 'race between warpgroups or programs'


@pytest.mark.skipif(interpreter is None, reason='this jax has no Mosaic GPU interpreter')
@pytest.mark.timeout(300, method='thread')
def test_fused_backward_under_shard_map():
  # As the model runs it: per shard, jitted, differentiated. The fused kernel's in-place
  # dQ buffer (a jax Ref) must survive shard_map. One device: the interpreter stalls
  # when two devices run Mosaic kernels at once (the two-kernel backward too).
  rng, q, k, v = _inputs(3, 2, 128, 128, 2, 1, 64, jnp.bfloat16)
  do = jnp.asarray(rng.normal(size=q.shape), jnp.bfloat16)
  mesh = jax.make_mesh((1,), ('x',), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  spec = jax.sharding.PartitionSpec('x')

  def grads(attend):
    fn = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                       check_vma=False)
    return jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v)[1](do))(q, k, v)

  interpreter.reset_gpu_interpret_mode_state()
  got = jax.block_until_ready(grads(lambda q, k, v: fa.flash_attention(
      q, k, v, backend='mosaic_gpu', backend_bwd='mosaic_gpu_fused')))
  want = grads(fa.flash_attention_reference)
  for name, g, w in zip(('dq', 'dk', 'dv'), got, want):
    _assert_close(g, w, tol(jnp.bfloat16, name), name)


@pytest.mark.skipif(interpreter is None, reason='this jax has no Mosaic GPU interpreter')
@pytest.mark.timeout(300, method='thread')
def test_fused_dq_ignores_padded_keys_when_exp_overflows():
  # Real scores are -300 +- 40, so lse is about -200, and a padded key's unmasked score of
  # 0 gives exp(0 - lse) = inf in the fused kernel's dS. Its K row is 0, but inf * 0 is
  # NaN: dQ stays finite only if padded keys' dS is zeroed.
  rng = np.random.default_rng(4)
  d, t, s = 64, 64, 130
  u = rng.normal(size=d)
  u *= math.sqrt(300 * math.sqrt(d)) / np.linalg.norm(u)     # -u . u / sqrt(d) = -300
  q = jnp.asarray(np.broadcast_to(-u, (1, t, 2, d)), jnp.bfloat16)
  noise = rng.normal(size=(1, s, 1, d)) * np.linalg.norm(u) / math.sqrt(d)
  k = jnp.asarray(np.broadcast_to(u, (1, s, 1, d)) + noise, jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(1, s, 1, d)), jnp.bfloat16)
  do = jnp.asarray(rng.normal(size=q.shape), jnp.bfloat16)

  def grads(attend):
    return jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1](do))(q, k, v)

  interpreter.reset_gpu_interpret_mode_state()
  got = jax.block_until_ready(grads(lambda q, k, v: fa.flash_attention(
      q, k, v, causal=False, backend='mosaic_gpu', backend_bwd='mosaic_gpu_fused')))
  want = grads(lambda q, k, v: fa.flash_attention_reference(q, k, v, causal=False))
  lse = fa.flash_attention_reference(q, k, v, causal=False, return_lse=True)[1]
  assert float(lse.max()) < -90  # exp(-lse) overflows fp32
  for name, g, w in zip(('dq', 'dk', 'dv'), got, want):
    _assert_close(g, w, tol(jnp.bfloat16, name), name)


def test_walk_is_unmasked_only_inside_one_document():
  # The 'long' documents [0, 320), [320, 448), [448, 512); 128-row programs, 128-key
  # blocks, causal. (lo, lo_full, hi_full, hi): blocks [lo_full, hi_full) run unmasked.
  seg = _segment_ids(None, 'long', 1, 512, 512)
  docs = fa_mgpu._SegmentSpec(seg, seg, True, 64, 128, 2).documents()
  segs = types.SimpleNamespace(docs_ref=docs)
  cfg = _config(64)
  walks = [tuple(int(x) for x in fa_mgpu._in_documents(
      segs, fa_mgpu._kv_ranges(n * 128, 128, 128, 4, cfg), 0, n)) for n in range(4)]
  assert walks == [
      (0, 0, 0, 1),  # rows 0..127: the diagonal block only
      (0, 0, 1, 2),  # rows 128..255 (document 0): keys 0..127 unmasked, the diagonal not
      (0, 0, 0, 3),  # rows 256..383 cross a boundary: all masked
      (2, 2, 2, 4),  # rows 384..511 (documents 1, 2): keys 0..255 (document 0) skipped
  ]


def _walks_of_random_documents(rng, trials):
  """(walk, visible, real, rows, block, num_blocks) for each program of both walk
  directions (forward and dq over kv blocks, dk/dv over q blocks) on random packed
  documents, lengths and masks. visible, needed: [rows, columns] of the program's rows,
  whether the pair attends, whether its mask matters: padded query rows are sliced off,
  and so are padded keys' dK, dV rows, where padded (zero) queries add nothing either;
  but a real query must never see a padded key."""
  x = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  for _ in range(trials):
    causal = rng.random() < 0.6
    window = int(rng.integers(1, 300)) if causal and rng.random() < 0.4 else None
    rows, block = int(rng.choice([64, 128])), int(rng.choice([64, 128]))
    t = int(rng.integers(1, 600))
    s = t if causal else int(rng.integers(1, 600))
    n = math.lcm(rows, block)
    tp, sp = (-(-t // n) * n, -(-s // n) * n)
    if causal:
      tp = sp = max(tp, sp)
    cfg = dataclasses.replace(fa._make_config(x, x, True, None, 0.1, {}, False, False),
                              causal=causal, window=window, kv_len=s,
                              mask_kv_padding=not causal and sp != s)
    doc_rate = rng.choice([0.0, 0.003, 0.02, 0.1])  # 0: one document, padding ids too
    ids = lambda n: np.cumsum(rng.random(n) < doc_rate)
    q_ids = ids(t)
    kv_ids = q_ids if causal else ids(s)
    qs, ks = (np.pad(i, (0, p - len(i))) for i, p in ((q_ids, tp), (kv_ids, sp)))
    qp, kp = np.arange(tp)[:, None], np.arange(sp)[None, :]
    real = (qp < t) & (kp < s)
    visible = (qs[:, None] == ks[None, :]) & real
    if causal:
      visible &= kp <= qp
    if window is not None:
      visible &= kp > qp - window
    needed_fwd = np.broadcast_to(qp < t, real.shape)
    for own, other, ranges, vis, ok in ((qs, ks, fa_mgpu._kv_ranges, visible, needed_fwd),
                                        (ks, qs, fa_mgpu._q_ranges, visible.T, real.T)):
      spec = fa_mgpu._SegmentSpec(jnp.asarray(own[None], jnp.int32),
                                  jnp.asarray(other[None], jnp.int32), True, rows // 2, block, 2)
      segs = types.SimpleNamespace(docs_ref=spec.documents())
      for p in range(len(own) // rows):
        walk = fa_mgpu._in_documents(
            segs, ranges(p * rows, rows, block, len(other) // block, cfg), 0, p)
        mine = slice(p * rows, (p + 1) * rows)
        yield walk, vis[mine], ok[mine], block, len(other) // block


def test_walks_visit_every_visible_block_and_unmask_only_whole_ones():
  # For any lengths, masks and packed documents: a block with a visible pair is in
  # [lo, hi), and in a block walked unmasked every pair whose mask matters is visible.
  rng = np.random.default_rng(21)
  unmasked = 0
  for walk, visible, needed, block, num_blocks in _walks_of_random_documents(rng, 30):
    lo, lo_full, hi_full, hi = (int(x) for x in walk)
    assert 0 <= lo <= lo_full <= hi_full <= hi <= num_blocks, walk
    for j in range(num_blocks):
      cols = slice(j * block, (j + 1) * block)
      assert not visible[:, cols].any() or lo <= j < hi, (walk, j)
      if lo_full <= j < hi_full:
        assert (visible[:, cols] | ~needed[:, cols]).all(), (walk, j)
        unmasked += 1
  assert unmasked > 0


def _lower_for_h100(fn, *args):
  gpu = jax.sharding.AbstractDevice(device_kind='NVIDIA H100', num_cores=None, platform='gpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=gpu)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',)).as_text()


@pytest.mark.parametrize('d, window, causal', [
    (d, None, causal) for d in (64, 128, 256) for causal in (True, False)] + [
    (128, 4096, True)])   # a window needs causal
def test_mosaic_kernels_lower_for_hopper(d, window, causal):
  """The wgmma path (not interpreted) passes Mosaic GPU's lowering at the benchmark
  shapes: register layouts, wgmma operand shapes, and shared memory under 227 KiB. The
  forward at every head dim; the backward (the gradient) where it runs, d <= 128."""
  q = jax.ShapeDtypeStruct((1, 8192, 32, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 8192, 8, d), jnp.bfloat16)
  fn = lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, sliding_window=window,
                                          backend='mosaic_gpu', interpret=False)
  assert _mosaic_calls(_lower_for_h100(fn, q, kv, kv)) == 1
  if d in fa_mgpu.BWD_HEAD_DIMS:  # forward, dq, dk/dv
    grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    assert _mosaic_calls(_lower_for_h100(grad, q, kv, kv)) == 3


@pytest.mark.parametrize('d', [64, 128, 256])
def test_mosaic_kernels_lower_with_segment_ids(d):
  """Packed documents: int32 ids streamed beside K/V (or Q/dO) and compared in wgmma's
  row and column layouts."""
  q = jax.ShapeDtypeStruct((1, 8192, 32, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 8192, 8, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 8192), jnp.int32)
  fn = lambda q, k, v, seg: fa.flash_attention(q, k, v, segment_ids=seg,
                                               backend='mosaic_gpu', interpret=False)
  grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  want = 3 if d in fa_mgpu.BWD_HEAD_DIMS else 1
  assert _mosaic_calls(_lower_for_h100(grad, q, kv, kv, seg)) == want


@pytest.mark.parametrize('block_q_bwd, block_k_bwd', [(64, 128), (128, 64), (128, 128)])
def test_mosaic_backward_steps_lower_for_hopper(block_q_bwd, block_k_bwd):
  q = jax.ShapeDtypeStruct((1, 8192, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16)
  grad = jax.grad(lambda *a: fa.flash_attention(
      *a, backend='mosaic_gpu', block_q_bwd=block_q_bwd, block_k_bwd=block_k_bwd,
      interpret=False).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  assert _mosaic_calls(_lower_for_h100(grad, q, kv, kv)) == 3


@pytest.mark.parametrize('d, causal, segments, s', [
    (128, True, False, 8192), (128, False, False, 8000), (128, True, True, 8192),
    (64, True, False, 8192), (64, False, True, 8192)])
def test_fused_backward_lowers_for_hopper(d, causal, segments, s):
  """backend_bwd='mosaic_gpu_fused' lowers at the benchmark shapes: one kernel after the
  forward, which takes the fp32 dQ buffer in place (an aliased operand) and issues the
  transposed-dS wgmma, the column halves of K (d 128), the padded keys' dS mask
  (S = 8000) and the TMA reduce-adds."""
  q = jax.ShapeDtypeStruct((1, 8192, 32, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, s, 8, d), jnp.bfloat16)
  seg = (jax.ShapeDtypeStruct((1, 8192), jnp.int32), jax.ShapeDtypeStruct((1, s), jnp.int32))
  fn = lambda q, k, v, seg: fa.flash_attention(
      q, k, v, causal=causal, segment_ids=seg if segments else None, backend='mosaic_gpu',
      backend_bwd='mosaic_gpu_fused', interpret=False)
  grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  text = _lower_for_h100(grad, q, kv, kv, seg)
  assert _mosaic_calls(text) == 2
  assert 'output_operand_aliases' in text


def _mosaic_calls(lowered_text):
  return len(re.findall(r'custom_call @mosaic_gpu', lowered_text))


def _config(d):
  x = jnp.zeros((1, 256, 2, d), jnp.bfloat16)
  return fa._make_config(x, x, True, None, 0.1, {}, False, False)


def test_shared_memory_estimate_is_what_the_lowering_enforces():
  """Tiles that MosaicTiles / MosaicBwdTiles count as too big also fail Mosaic GPU's own
  check; the defaults fit."""
  q = jax.ShapeDtypeStruct((1, 256, 2, 256), jnp.bfloat16)
  too_big = fa_mgpu.MosaicTiles(block_k=128, stages=3)
  assert too_big.smem_bytes(256) > fa_mgpu.SMEM_LIMIT
  with pytest.raises(ValueError, match='shared memory'):
    _lower_for_h100(lambda q, k, v: fa_mgpu.forward(q, k, v, _config(256), too_big), q, q, q)
  q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  stats = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)
  too_big = fa_mgpu.MosaicBwdTiles(block_q=128, block_k=128, stages=3)
  assert too_big.smem_bytes(128) > fa_mgpu.SMEM_LIMIT
  with pytest.raises(ValueError, match='shared memory'):
    _lower_for_h100(lambda *a: fa_mgpu.backward(*a, _config(128), too_big),
                    q, q, q, q, stats, stats)
  fused = fa_mgpu.MosaicBwdTiles(block_q=128, fused=True)
  assert fused.smem_bytes(128) > fa_mgpu.SMEM_LIMIT  # fits unfused (below)
  with pytest.raises(ValueError, match='shared memory'):
    _lower_for_h100(lambda *a: fa_mgpu.backward(*a, _config(128), fused),
                    q, q, q, q, stats, stats)
  for d in fa_mgpu.SUPPORTED_HEAD_DIMS:
    assert fa_mgpu.MosaicTiles.default(d).smem_bytes(d) <= fa_mgpu.SMEM_LIMIT
  for d in fa_mgpu.BWD_HEAD_DIMS:
    for bq in (64, 128):
      for bk in (64, 128):
        assert fa_mgpu.MosaicBwdTiles(bq, bk).smem_bytes(d) <= fa_mgpu.SMEM_LIMIT
    assert fa_mgpu.MosaicBwdTiles(fused=True).smem_bytes(d) <= fa_mgpu.SMEM_LIMIT


@pytest.mark.parametrize('kwargs, dtype, d, message', [
    (dict(backend='mosaic_gpu'), jnp.float32, 64, "backend='mosaic_gpu' does not take dtype"),
    (dict(backend='mosaic_gpu'), jnp.bfloat16, 96, 'head_dim 96'),
    (dict(backend='mosaic_gpu', block_q=64), jnp.bfloat16, 64, 'block_q=128'),
    (dict(backend='mosaic_gpu', block_k=96), jnp.bfloat16, 64, 'block_k in'),
    (dict(backend='mosaic_gpu', block_k=128, num_stages=3), jnp.bfloat16, 256,
     'KiB of shared memory'),
    (dict(backend_bwd='mosaic_gpu'), jnp.bfloat16, 256,
     "backend_bwd='mosaic_gpu' does not take head_dim 256"),
    (dict(backend_bwd='mosaic_gpu'), jnp.float32, 64,
     "backend_bwd='mosaic_gpu' does not take dtype"),
    (dict(backend='mosaic_gpu', block_q_bwd=32), jnp.bfloat16, 64, 'block_k_bwd in'),
    (dict(backend_bwd='mosaic_gpu_fused'), jnp.bfloat16, 256,
     "backend_bwd='mosaic_gpu_fused' does not take head_dim 256"),
    (dict(backend_bwd='mosaic_gpu_fused', block_q_bwd=128), jnp.bfloat16, 128,
     'KiB of shared memory'),
])
def test_mosaic_backend_rejects_what_it_cannot_run(kwargs, dtype, d, message):
  q = jnp.zeros((1, 256, 2, d), dtype)
  with pytest.raises(ValueError, match=message):
    fa.flash_attention(q, q, q, **kwargs)


@pytest.mark.parametrize('kwargs', [dict(backend='cuda'), dict(backend_bwd='cuda')])
def test_unknown_backend_is_named(kwargs):
  q = jnp.zeros((1, 16, 1, 16), jnp.float32)
  with pytest.raises(ValueError, match="'triton',? (or )?'mosaic_gpu'"):
    fa.flash_attention(q, q, q, **kwargs)


@pytest.mark.parametrize('backend, backend_bwd, d, want', [
    ('mosaic_gpu', None, 128, fa_mgpu.MosaicBwdTiles()),
    ('mosaic_gpu', None, 256, None),        # no Mosaic backward at d 256: Triton's
    ('mosaic_gpu', 'triton', 64, None),
    (None, 'mosaic_gpu', 64, fa_mgpu.MosaicBwdTiles()),
    ('mosaic_gpu', 'mosaic_gpu_fused', 128, fa_mgpu.MosaicBwdTiles(fused=True)),
    (None, None, 128, None),
])
def test_backward_kernel_choice(backend, backend_bwd, d, want):
  q = jnp.zeros((1, 256, 2, d), jnp.bfloat16)
  tiles = dict(block_q_bwd=None, block_k_bwd=None)
  assert fa._mosaic_bwd_tiles(backend, backend_bwd, q, tiles) == want
