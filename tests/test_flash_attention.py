"""Pallas flash attention (interpret mode on CPU) against its pure-jnp reference.

Shapes are chosen to catch index-map mistakes that the interpreter hides by clamping
block indices: unequal query/kv heads, lengths that are not block multiples, and outputs
poisoned with NaN so that an unwritten block shows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import transformer
from pallas_kernels import flash_attention as fa


def _inputs(seed, b, t, s, hq, hkv, d, dtype):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=shape), dtype)
             for shape in ((b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d)))
  return rng, q, k, v


def _packed_segments(rng, b, t):
  """Random packed documents: ids rise by one at each (random) document start."""
  return jnp.asarray(np.cumsum(rng.random((b, t)) < 0.15, axis=1), jnp.int32)


def _segment_ids(rng, segments, b, t, s):
  """None, 'packed' (documents, one [B, T] array), 'long' (three documents a row, from
  5/8 and 7/8 of T (+16 a row): whole blocks inside one document), 'pair' (random q
  and kv ids) or 'disjoint' (q and kv ids 0 for the first half, then ids they do not
  share: blocks with nothing to attend to)."""
  if segments == 'packed':
    return _packed_segments(rng, b, t)
  if segments == 'long':
    pos, row = np.arange(t), 16 * np.arange(b)[:, None]
    ids = (pos >= 5 * t // 8 + row).astype(int) + (pos >= 7 * t // 8)
    return jnp.asarray(ids, jnp.int32)
  if segments == 'disjoint':
    return tuple(jnp.asarray(np.broadcast_to(np.where(np.arange(n) < n // 2, 0, other),
                                             (b, n)), jnp.int32)
                 for n, other in ((t, 5), (s, 7)))
  if segments == 'pair':
    return (jnp.asarray(rng.integers(0, 3, (b, t)), jnp.int32),
            jnp.asarray(rng.integers(0, 3, (b, s)), jnp.int32))
  assert segments is None, segments
  return None


# Relative error bounds against the fp32 reference, one rule for the Triton and the Mosaic
# GPU kernels: about 10x the largest error measured over this file and
# test_flash_attention_mgpu.py (interpret mode on CPU, jax 0.10.2), by input dtype, for lse
# (always fp32) and for the output and gradients.
TOL = {
    ('float32', 'lse'): 2e-6,       # measured up to 1.4e-7
    ('float32', 'value'): 6e-6,     # measured up to 5.9e-7 (dq, head_dim 256)
    ('bfloat16', 'lse'): 6e-7,      # measured up to 5.9e-8 (Triton 3.8e-8)
    ('bfloat16', 'value'): 2e-2,    # measured up to 4.3e-3 (Mosaic fused dv, exp overflow)
}


def tol(dtype, name: str) -> float:
  return TOL[jnp.dtype(dtype).name, 'lse' if name == 'lse' else 'value']


def _rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _assert_close(got, want, limit, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, what
  assert not np.isnan(got).any(), f'{what}: NaN'
  # lse is -inf exactly where a query sees no key; compare the rest numerically.
  finite = np.isfinite(want)
  np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=what)
  assert _rel_err(got[finite], want[finite]) < limit, (what, _rel_err(got[finite], want[finite]))


def _check_against_reference(seed, b, t, s, hq, hkv, d, dtype, causal, segments, window,
                             blocks, backend='triton', softcap=None):
  """backend: the portable kernels by default (on a Hopper GPU, None would pick Mosaic
  GPU for bf16: test_gpu.py checks that path by name). Returns the kernel's outputs."""
  rng, q, k, v = _inputs(seed, b, t, s, hq, hkv, d, dtype)
  seg = _segment_ids(rng, segments, b, t, s)
  opts = dict(causal=causal, segment_ids=seg, sliding_window=window, return_lse=True)
  if softcap:
    opts['softcap'] = softcap
  # Every output buffer starts as NaN (aliased in): an element no program writes fails.
  tiles = dict(zip(('block_q', 'block_k', 'block_q_bwd', 'block_k_bwd'), blocks))
  kernel = lambda q, k, v: fa.flash_attention(q, k, v, _poison_outputs=True,
                                              backend=backend, **tiles, **opts)
  ref = lambda q, k, v: fa.flash_attention_reference(q, k, v, **opts)
  # Cotangents for both outputs: the lse one exercises dS += dlse * P.
  cot = (jnp.asarray(rng.normal(size=q.shape), dtype),
         jnp.asarray(rng.normal(size=(b, hq, t)), jnp.float32))
  # One jit for both sides: eager dispatch would compile every small op separately.
  got, want = jax.jit(lambda *args: (_value_and_vjp(kernel, *args),
                                     _value_and_vjp(ref, *args)))(q, k, v, cot)
  assert got[0].dtype == q.dtype and got[1].dtype == jnp.float32
  assert got[1].shape == (b, hq, t)
  for name, g, w in zip(('out', 'lse', 'dq', 'dk', 'dv'), got, want):
    assert g.dtype == w.dtype, name
    _assert_close(g, w, tol(dtype, name), name)
  return got


def _value_and_vjp(fn, q, k, v, cot):
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  return (out, lse, *vjp(cot))


# b, t, s, hq, hkv, d, dtype, causal, segments, window,
# (block_q, block_k[, block_q_bwd, block_k_bwd])
CASES = {
    'causal_gqa4to1_ragged': (2, 37, 37, 4, 1, 32, jnp.float32, True, None, None, (16, 16)),
    'causal_gqa6to2_window': (1, 64, 64, 6, 2, 16, jnp.float32, True, None, 18, (16, 32)),
    'causal_mha_packed': (2, 48, 48, 4, 4, 64, jnp.float32, True, 'packed', None, (32, 16)),
    'causal_packed_window': (2, 80, 80, 4, 2, 32, jnp.float32, True, 'packed', 13, (16, 16)),
    'window_of_one': (1, 24, 24, 4, 2, 16, jnp.float32, True, None, 1, (16, 16)),
    'cross_pair_segments': (1, 33, 50, 6, 2, 32, jnp.float32, False, 'pair', None, (16, 16)),
    'cross_disjoint_segments': (1, 64, 80, 4, 2, 16, jnp.float32, False, 'disjoint', None,
                                (16, 16)),
    'noncausal_padded_keys': (2, 37, 37, 4, 1, 16, jnp.float32, False, None, None, (16, 32)),
    'head_dim_24': (1, 20, 29, 2, 1, 24, jnp.float32, False, None, None, (16, 16)),
    'length_one': (2, 1, 1, 2, 1, 16, jnp.float32, True, None, None, (None, None)),
    'head_dim_128_default_blocks': (1, 20, 20, 2, 1, 128, jnp.float32, True, None, None,
                                    (None, None)),
    'bf16_gqa_packed_window': (2, 37, 37, 6, 2, 64, jnp.bfloat16, True, 'packed', 9,
                               (16, 16)),
    'bf16_cross': (1, 29, 45, 4, 1, 32, jnp.bfloat16, False, None, None, (16, 16)),
    # Backward tiles set apart from the forward ones, larger: the padding follows the
    # largest tile (48 keys pad to 64 only for the backward's 64-key tile).
    'bwd_tiles_larger': (1, 70, 70, 4, 2, 32, jnp.float32, True, 'packed', 20,
                         (16, 16, 32, 64)),
    'bwd_tiles_pad_keys': (1, 37, 48, 2, 1, 16, jnp.float32, False, None, None,
                           (32, 16, 16, 64)),
}




def random_cases(n, seed=7):
  """Random shapes and options (seeded): whatever the grid, the kernel must agree."""
  rng = np.random.default_rng(seed)
  cases = {}
  for i in range(n):
    causal = i % 2 == 0
    t = int(rng.integers(1, 70))
    s = t if causal else int(rng.integers(1, 70))
    hkv, group = int(rng.choice([1, 2])), int(rng.choice([1, 2, 3]))
    window = int(rng.integers(1, 40)) if causal and rng.random() < 0.5 else None
    segments = 'packed' if causal and rng.random() < 0.5 else None
    blocks = tuple(int(x) for x in rng.choice([16, 32], 2))
    cases[f'random{i}_t{t}_s{s}_h{hkv * group}x{hkv}'] = (
        int(rng.integers(1, 3)), t, s, hkv * group, hkv, int(rng.choice([16, 32, 64])),
        jnp.float32, causal, segments, window, blocks)
  return cases


CASES.update(random_cases(4))
CASES['head_dim_256_packed'] = (1, 24, 24, 4, 2, 256, jnp.float32, True, 'packed', None,
                                (None, None))


@pytest.mark.parametrize('case', CASES.values(), ids=CASES.keys())
def test_matches_reference(case):
  _check_against_reference(0, *case)


SOFTCAP_CASES = {name: CASES[name] for name in (
    'causal_gqa4to1_ragged', 'causal_packed_window', 'cross_pair_segments', 'bf16_cross',
    'bwd_tiles_larger')}


@pytest.mark.parametrize('case', SOFTCAP_CASES.values(), ids=SOFTCAP_CASES.keys())
def test_soft_capping_matches_reference(case):
  """softcap (Gemma 2's attn_logit_softcapping) at 1.5, where scores of unit scale bend:
  out, lse and every gradient equal the reference's, and differ from uncapped ones."""
  capped = _check_against_reference(0, *case, softcap=1.5)
  plain = _check_against_reference(0, *case)
  assert _rel_err(capped[2], plain[2]) > 1e-2   # dq: the cap's derivative reached it


def test_soft_capping_refuses_the_mosaic_kernels():
  q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match='the Mosaic GPU kernels do not soft-cap'):
    fa.flash_attention(q, q, q, softcap=30.0, backend='mosaic_gpu')


def test_empty_sequence():
  _, q, k, v = _inputs(0, 2, 0, 0, 4, 2, 16, jnp.float32)
  f = lambda q, k, v: fa.flash_attention(q, k, v, return_lse=True)
  (out, lse), vjp = jax.vjp(f, q, k, v)
  assert out.shape == (2, 0, 4, 16) and lse.shape == (2, 4, 0)
  dq, dk, dv = vjp((out, lse))
  assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_queries_without_keys_give_zero_and_minus_inf():
  rng, q, k, v = _inputs(1, 1, 21, 18, 2, 1, 16, jnp.float32)
  # Query ids include 3, which no key has: those rows see nothing.
  q_seg = jnp.asarray(rng.integers(0, 4, (1, 21)), jnp.int32).at[0, :4].set(3)
  kv_seg = jnp.asarray(rng.integers(0, 3, (1, 18)), jnp.int32)
  opts = dict(causal=False, segment_ids=(q_seg, kv_seg), return_lse=True)
  kernel = lambda q, k, v: fa.flash_attention(q, k, v, block_q=16, block_k=16, **opts)
  ref = lambda q, k, v: fa.flash_attention_reference(q, k, v, **opts)
  cot = (jnp.ones_like(q), jnp.ones((1, 2, 21), jnp.float32))
  got, want = jax.jit(lambda *args: (_value_and_vjp(kernel, *args),
                                     _value_and_vjp(ref, *args)))(q, k, v, cot)
  out, lse = got[:2]
  empty = np.asarray(q_seg[0] == 3)
  assert np.all(np.asarray(out)[0, empty] == 0) and np.all(np.isneginf(lse[0][:, empty]))
  assert np.isfinite(lse[0][:, ~empty]).all()
  for name, g, w in zip(('out', 'lse', 'dq', 'dk', 'dv'), got, want):
    _assert_close(g, w, tol(jnp.float32, name), name)
  out, lse = fa.flash_attention(q, k[:, :0], v[:, :0], causal=False, return_lse=True)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse))


def test_every_output_element_is_written():
  # GQA 6/2 and T=37 with 16-blocks: a head or block index map that is off would
  # leave some block NaN here (the interpreter clamps, so it could not fail loudly).
  rng, q, k, v = _inputs(2, 2, 37, 37, 6, 2, 32, jnp.float32)
  seg = _packed_segments(rng, 2, 37)
  cot = (jnp.ones_like(q), jnp.ones((2, 6, 37), jnp.float32))

  def run(poison):
    f = lambda q, k, v: fa.flash_attention(
        q, k, v, segment_ids=seg, sliding_window=11, return_lse=True, block_q=16,
        block_k=16, _poison_outputs=poison)
    return jax.jit(lambda *args: _value_and_vjp(f, *args))(q, k, v, cot)

  for name, poisoned, clean in zip(('out', 'lse', 'dq', 'dk', 'dv'), run(True), run(False)):
    assert np.isfinite(poisoned).all(), name
    np.testing.assert_array_equal(poisoned, clean, err_msg=name)


def test_poison_shows_an_unwritten_output(monkeypatch):
  # The check above is only worth something if a kernel that skips its stores fails it.
  monkeypatch.setattr(fa, '_fwd_kernel', lambda *refs, cfg: None)
  _, q, k, v = _inputs(3, 1, 16, 16, 2, 1, 16, jnp.float32)
  out = fa.flash_attention(q, k, v, block_q=16, block_k=16, _poison_outputs=True)
  assert np.isnan(out).all()


@pytest.mark.parametrize('t, block_q, block_k, window', [
    (80, 16, 16, None), (80, 32, 16, None), (80, 16, 64, None), (37, 16, 32, None),
    (80, 16, 16, 13), (80, 32, 16, 1), (80, 16, 32, 40), (64, 64, 16, 20),
    (80, 16, 16, 2), (80, 32, 16, 34), (80, 16, 32, 18)])
def test_block_ranges_are_exactly_the_visible_blocks(t, block_q, block_k, window):
  # Causal skipping must bound the loops, not only mask: a block outside the range has
  # no visible pair, and every block inside has at least one.
  # Padded as flash_attention pads: queries and keys may get different padded lengths.
  nq, nk = -(-t // block_q), -(-t // block_k)
  cfg = fa._make_config(jnp.zeros((1, t, 1, 16)), jnp.zeros((1, t, 1, 16)),
                        True, window, 1.0, dict(block_q=block_q, block_k=block_k), True,
                        False)
  rows, cols = np.arange(nq * block_q)[:, None], np.arange(nk * block_k)[None, :]
  visible = (cols <= rows) & (cols > rows - (window or 10**6))
  blocks = visible.reshape(nq, block_q, nk, block_k).any(axis=(1, 3))
  for i in range(nq):
    lo, hi = fa._kv_block_range(i, block_q, block_k, nk, cfg)
    assert list(range(int(lo), int(hi))) == list(np.flatnonzero(blocks[i])), ('kv', i)
  for j in range(nk):
    lo, hi = fa._q_block_range(j, block_q, block_k, nq, cfg)
    assert list(range(int(lo), int(hi))) == list(np.flatnonzero(blocks[:, j])), ('q', j)


@pytest.mark.parametrize('packed', [True, False])
def test_document_block_ranges_hold_every_shared_id_block(packed):
  # Sound for any ids: a row block and a column block that share an id are never apart,
  # and a block in the `same` run holds one id, the rows' one. Tight for packed ids: the
  # first and last blocks of the range do share one, and the `same` run is every block
  # that holds only the rows' one id.
  rng = np.random.default_rng(11 + packed)
  b, t, s, block_rows, block_cols = 3, 256, 128, 16, 32
  if packed:
    rows = cols = np.cumsum(rng.random((b, t)) < 0.02, axis=1)
    s = t
  else:  # mostly one id, so that some blocks hold it alone
    rows, cols = (np.where(rng.random(n) < 0.98, 1, rng.integers(0, 6, n))
                  for n in ((b, t), (b, s)))
  ranges = np.asarray(fa.document_block_ranges(
      jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32), block_rows, block_cols))
  assert ranges.shape == (b, t // block_rows, 4) and ranges.dtype == np.int32
  num_same = 0
  for bi in range(b):
    for i in range(t // block_rows):
      mine = set(rows[bi, i * block_rows:(i + 1) * block_rows])
      col_ids = [set(cols[bi, j * block_cols:(j + 1) * block_cols])
                 for j in range(s // block_cols)]
      shared = [j for j, ids in enumerate(col_ids) if mine & ids]
      same = [j for j, ids in enumerate(col_ids) if len(mine) == 1 and ids == mine]
      lo, hi, same_lo, same_hi = ranges[bi, i]
      assert all(lo <= j < hi for j in shared), (bi, i, lo, hi, shared)
      assert set(range(same_lo, same_hi)) <= set(same), (bi, i, same_lo, same_hi, same)
      num_same += same_hi - same_lo
      if packed:
        assert (lo, hi) == ((shared[0], shared[-1] + 1) if shared else (0, 0)), (bi, i)
        assert list(range(same_lo, same_hi)) == same, (bi, i, same_lo, same_hi, same)
  assert num_same > 0  # the case must hold some


def check_other_documents_are_never_read(causal, lengths, hq, hkv, d, dtype, **kernel_opts):
  """Three documents of `lengths` (block-aligned) with the first and last NaN in q, k and
  v: the middle one's out, lse and gradients stay finite only if no kernel loads another
  document's block (a loaded but masked block still multiplies 0 by NaN)."""
  t = sum(lengths)
  rng, q, k, v = _inputs(5, 1, t, t, hq, hkv, d, dtype)
  seg = jnp.asarray(np.repeat([[0, 1, 2]], lengths, axis=1), jnp.int32)
  mid = slice(lengths[0], lengths[0] + lengths[1])
  outside = (seg != 1)[:, :, None, None]
  cot = (jnp.asarray(rng.normal(size=q.shape), dtype), jnp.zeros((1, hq, t)))
  opts = dict(causal=causal, segment_ids=seg, return_lse=True)
  # The kernel and the reference in separate jits (one jit stalls the Mosaic interpreter).
  got = jax.jit(lambda *a: _value_and_vjp(
      lambda q, k, v: fa.flash_attention(q, k, v, **kernel_opts, **opts), *a))(
          *(jnp.where(outside, jnp.nan, x) for x in (q, k, v)), cot)
  want = jax.jit(lambda *a: _value_and_vjp(
      lambda q, k, v: fa.flash_attention_reference(q, k, v, **opts), *a))(
          *(jnp.where(outside, 0, x) for x in (q, k, v)), cot)
  for name, g, w in zip(('out', 'lse', 'dq', 'dk', 'dv'), got, want):
    g, w = (x[:, :, mid] if name == 'lse' else x[:, mid] for x in (g, w))
    _assert_close(g, w, tol(dtype, name), name)


@pytest.mark.parametrize('causal', [True, False])
def test_blocks_of_other_documents_are_never_read(causal):
  check_other_documents_are_never_read(causal, (32, 16, 16), 4, 2, 16, jnp.float32,
                                       block_q=16, block_k=16)


def test_model_layout_jitted_with_gradients():
  # As model/transformer.py's attention() calls it: q [b,t,h,e], k/v [b,s,k,e], packed ids.
  rng, q, k, v = _inputs(4, 2, 40, 40, 4, 2, 16, jnp.float32)
  seg = _packed_segments(rng, 2, 40)
  cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def loss(attn):
    return jax.jit(jax.value_and_grad(
        lambda q, k, v: jnp.sum(attn(q, k, v) * cot), argnums=(0, 1, 2)))

  value, grads = loss(lambda q, k, v: fa.flash_attention(q, k, v, segment_ids=seg))(q, k, v)
  # Float32 matmuls at full precision: on a GPU XLA's default for float32 dots is TF32,
  # whose error (2.3e-3 of this loss on an H200) is the reference's, not the kernel's.
  with jax.default_matmul_precision('highest'):
    ref_value, ref_grads = loss(
        lambda q, k, v: transformer.attention_xla(q, k, v, seg))(q, k, v)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for got, want in zip(grads, ref_grads):
    _assert_close(got, want, tol(jnp.float32, 'grad'), 'grad')


@pytest.mark.parametrize('shapes, kwargs, match', [
    (((1, 8, 2, 16), (1, 12, 2, 16)), {}, 'causal=True needs as many queries as keys'),
    (((1, 8, 3, 16), (1, 8, 2, 16)), {}, 'multiple of kv heads'),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(causal=False, sliding_window=4), 'causal=True'),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(block_q=24), 'power of two'),
    (((1, 8, 2, 16), (1, 8, 2, 16)), dict(block_k_bwd=8), 'block_k_bwd=8 must be a power'),
    (((1, 8, 2, 16), (1, 12, 2, 16)), dict(causal=False, segment_ids=np.zeros((1, 8))),
     'pair'),
])
def test_rejects_bad_arguments(shapes, kwargs, match):
  q, k = jnp.zeros(shapes[0]), jnp.zeros(shapes[1])
  with pytest.raises(ValueError, match=match):
    fa.flash_attention(q, k, k, **kwargs)


class _FakeDevice:
  def __init__(self, platform, compute_capability=None):
    self.platform, self.compute_capability = platform, compute_capability


HOPPER, AMPERE, BLACKWELL = (_FakeDevice('gpu', c) for c in ('9.0', '8.0', '10.0'))


@pytest.mark.parametrize('device, dtype, d, tiles, interpret, want', [
    (HOPPER, jnp.bfloat16, 128, {}, None, 'mosaic_gpu'),
    (HOPPER, jnp.float16, 64, {}, None, 'mosaic_gpu'),
    (HOPPER, jnp.bfloat16, 256, dict(block_q=None), None, 'mosaic_gpu'),
    (HOPPER, jnp.float32, 128, {}, None, 'triton'),                  # its dtypes: bf16/fp16
    (HOPPER, jnp.bfloat16, 80, {}, None, 'triton'),                  # its head dims
    (HOPPER, jnp.bfloat16, 128, dict(num_warps=4), None, 'triton'),  # Triton's tiles named
    (HOPPER, jnp.bfloat16, 128, dict(block_k=128), None, 'triton'),
    (HOPPER, jnp.bfloat16, 128, {}, True, 'triton'),                 # the Pallas interpreter
    (AMPERE, jnp.bfloat16, 128, {}, None, 'triton'),                 # no wgmma or TMA
    (BLACKWELL, jnp.bfloat16, 128, {}, None, 'triton'),
    (_FakeDevice('cpu'), jnp.bfloat16, 128, {}, None, 'triton'),
    (_FakeDevice('gpu', 9.0), jnp.bfloat16, 128, {}, None, 'mosaic_gpu'),   # other spellings
    (_FakeDevice('gpu', (9, 0)), jnp.bfloat16, 128, {}, None, 'mosaic_gpu'),
    (_FakeDevice('gpu', '9.0a'), jnp.bfloat16, 128, {}, None, 'mosaic_gpu'),
    (_FakeDevice('gpu', (10, 0)), jnp.bfloat16, 128, {}, None, 'triton'),
    (_FakeDevice('gpu'), jnp.bfloat16, 128, {}, None, 'triton'),             # none given
])
def test_default_backend_is_mosaic_only_where_it_runs(device, dtype, d, tiles, interpret,
                                                      want):
  from pallas_kernels import flash_attention_mgpu
  q = jax.ShapeDtypeStruct((1, 256, 4, d), dtype)
  if flash_attention_mgpu.plgpu is None:   # a jax without Pallas Mosaic GPU
    want = 'triton'
  assert fa.default_backend(q, tiles, interpret, device) == want


def test_flash_attention_asks_default_backend_only_when_none_is_named(monkeypatch):
  seen, real = [], fa.default_backend

  def recording(q, tiles, interpret):
    seen.append(dict(tiles))
    return 'triton'

  monkeypatch.setattr(fa, 'default_backend', recording)
  _, q, k, v = _inputs(5, 1, 32, 32, 2, 1, 16, jnp.float32)
  fa.flash_attention(q, k, v, block_k=16)
  fa.flash_attention(q, k, v, backend='triton')
  assert seen == [dict(block_q=None, block_k=16, block_q_bwd=None, block_k_bwd=None,
                       num_warps=None, num_stages=None)]
  # On this (CPU) machine the default is the portable kernels.
  assert real(q) == 'triton'
