"""Ragged paged attention: the Pallas kernel (interpret mode) against the jnp reference.

Cases are built from a list of (q_len, kv_len) per live sequence. Pages are drawn from a
shuffled pool, so a kernel that reads pages by slot rather than through the table fails.
With `poison=True` every page no live sequence owns, every page tail past a sequence's
end, every junk table slot's page and every padding row of q holds NaN: a live output that
touches any of them is NaN. Dead sequence slots always carry junk kv_lens, page rows and
cu_q_lens entries: a kernel that does not ignore them overwrites live rows.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass
class Case:
  args: tuple          # q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs
  live_rows: int       # cu_q_lens[num_seqs]


def make_case(seqs, *, hq=4, hkv=2, d=16, page_size=4, max_seqs=None, pages_per_seq=None,
              num_pages=None, t=None, share_prefix=0, poison=True, dtype=jnp.float32,
              seed=0):
  """seqs: [(q_len, kv_len)] of the live sequences; share_prefix: full pages seq 1 shares
  with seq 0 (same page ids, so same K/V)."""
  rng = np.random.default_rng(seed)
  max_seqs = max_seqs or len(seqs)
  need = [math.ceil(kv / page_size) for _, kv in seqs]
  pages_per_seq = pages_per_seq or max(need) + 1
  num_pages = num_pages or sum(need) + 5
  t = t or sum(q for q, _ in seqs) + 3
  pool = list(rng.permutation(num_pages))
  table = rng.integers(0, num_pages, (max_seqs, pages_per_seq))   # junk by default
  for s, n in enumerate(need):
    shared = share_prefix if s == 1 else 0
    table[s, :shared] = table[0, :shared]
    table[s, shared:n] = [pool.pop() for _ in range(n - shared)]
  kv_lens = rng.integers(0, pages_per_seq * page_size, max_seqs)  # junk for dead sequences
  kv_lens[:len(seqs)] = [kv for _, kv in seqs]
  cu = np.zeros(max_seqs + 1, np.int64)
  cu[1:len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
  cu[len(seqs) + 1:] = rng.integers(0, t, max_seqs - len(seqs))   # stale junk: dead slots
  q = rng.normal(size=(t, hq, d))
  kv = rng.normal(size=(2, num_pages, page_size, hkv, d))
  if poison:
    q[cu[len(seqs)]:] = np.nan
    kv = np.where(_owned(table, kv_lens, len(seqs), num_pages, page_size)[..., None, None],
                  kv, np.nan)
  cast = lambda x: jnp.asarray(x, dtype)
  args = (cast(q), cast(kv[0]), cast(kv[1]), jnp.asarray(kv_lens, jnp.int32),
          jnp.asarray(table, jnp.int32), jnp.asarray(cu, jnp.int32),
          jnp.asarray([len(seqs)], jnp.int32))
  return Case(args, int(cu[len(seqs)]))


def _owned(table, kv_lens, live, num_pages, page_size):
  """[P, page_size] bool: slots holding a live sequence's token."""
  owned = np.zeros((num_pages, page_size), bool)
  for s in range(live):
    for pos in range(kv_lens[s]):
      owned[table[s, pos // page_size], pos % page_size] = True
  return owned


def rel_err(out, ref):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return np.abs(out - ref).max() / np.abs(ref).max()


def check(case, dtype=jnp.float32, _ref=None, **kwargs):
  out = pa.paged_attention(*case.args, **kwargs)
  ref = pa.paged_attention_reference(*case.args) if _ref is None else _ref
  assert out.shape == case.args[0].shape and out.dtype == case.args[0].dtype
  live = np.asarray(out[:case.live_rows], np.float32)
  assert np.isfinite(live).all(), 'a live output is NaN: unwritten or read a poisoned page'
  assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
  np.testing.assert_array_equal(np.asarray(out[case.live_rows:], np.float32), 0)
  return out


MIXED = [(1, 9), (5, 13), (12, 12), (1, 1), (7, 30)]   # decode, chunk, whole prompt, ...


# ----------------------------------------------------------------------------- reference

def test_reference_matches_dense_causal_attention():
  """The reference on one whole-prompt sequence is plain causal attention (numpy)."""
  case = make_case([(10, 10)], hq=4, hkv=2, max_seqs=1, t=10, poison=False, seed=1)
  q, kp, vp, _, table, _, _ = (np.asarray(a) for a in case.args)
  k = kp[table[0]].reshape(-1, 2, 16)[:10]
  v = vp[table[0]].reshape(-1, 2, 16)[:10]
  kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)   # q head h uses kv head h // 2
  s = np.einsum('thd,shd->hts', q, kk) / 4.0
  s = np.where(np.tril(np.ones((10, 10), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum('hts,shd->thd', p / p.sum(-1, keepdims=True), vv)
  np.testing.assert_allclose(pa.paged_attention_reference(*case.args), want, rtol=1e-5,
                             atol=1e-6)


def dense_per_sequence(seqs, q, k_pages, v_pages, table, hkv):
  """float64 numpy: each live sequence's K/V read page by page from its table row, and
  its q_len rows attending causally at positions kv_len - q_len + i."""
  q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
  page, d, group = k_pages.shape[1], q.shape[-1], q.shape[1] // hkv
  out, row = [], 0
  for s, (q_len, kv_len) in enumerate(seqs):
    k = np.concatenate([k_pages[table[s, j]] for j in range(math.ceil(kv_len / page))])
    v = np.concatenate([v_pages[table[s, j]] for j in range(math.ceil(kv_len / page))])
    k, v = np.repeat(k[:kv_len], group, axis=1), np.repeat(v[:kv_len], group, axis=1)
    for i in range(q_len):
      scores = np.einsum('hd,shd->hs', q[row + i], k[:kv_len - q_len + i + 1]) / np.sqrt(d)
      p = np.exp(scores - scores.max(-1, keepdims=True))
      out.append(np.einsum('hs,shd->hd', p / p.sum(-1, keepdims=True),
                           v[:kv_len - q_len + i + 1]))
    row += q_len
  return np.stack(out)


@pytest.mark.parametrize('hq,hkv', [(8, 2), (7, 1)])
def test_reference_matches_dense_attention_on_a_mixed_batch(hq, hkv):
  """Decode tokens, chunked-prefill chunks and a whole prompt in one ragged batch with dead
  slots and NaN poison: the reference's live rows equal per-sequence dense attention."""
  case = make_case(MIXED, hq=hq, hkv=hkv, max_seqs=7, seed=10 + hq)
  q, kp, vp, _, table, _, _ = case.args
  want = dense_per_sequence(MIXED, q, kp, vp, np.asarray(table), hkv)
  ref = np.asarray(pa.paged_attention_reference(*case.args))
  # measured max |ref - want| 3.9e-7 (float32 reference vs float64), jax 0.10.2
  np.testing.assert_allclose(ref[:case.live_rows], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(ref[case.live_rows:], 0)


# --------------------------------------------------------------------- kernel vs reference

@pytest.mark.parametrize('hq,hkv', [(8, 2), (4, 4), (6, 2), (7, 1)])
def test_mixed_batch_with_padding(hq, hkv):
  # 5 live of 7 sequences; chunks longer than block_q span several q blocks; pages
  # shuffled; kv lengths ending mid-page; NaN padding rows, page tails and free pages.
  case = make_case(MIXED, hq=hq, hkv=hkv, max_seqs=7, seed=hq)
  check(case, num_kv_splits=2, pages_per_block=2, _block_q=4)


def test_shared_prefix_pages():
  case = make_case([(3, 19), (2, 22), (1, 6)], share_prefix=4, seed=3)
  table = np.asarray(case.args[4])
  assert (table[0, :4] == table[1, :4]).all()
  check(case, num_kv_splits=1, pages_per_block=1)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_splits_agree_and_long_context(dtype):
  """200-token context with splits 1, 2, 3: same answer (to fp32 rounding), all correct."""
  case = make_case([(1, 200), (9, 200), (4, 37)], hq=8, hkv=2, d=32, page_size=8,
                   dtype=dtype, seed=4)
  outs = [check(case, dtype, num_kv_splits=k, pages_per_block=2) for k in (1, 2, 3)]
  for out in outs[1:]:
    assert rel_err(out, outs[0]) < TOL[dtype]


def test_bf16_mixed_batch():
  case = make_case(MIXED, hq=8, hkv=2, max_seqs=6, dtype=jnp.bfloat16, seed=5)
  check(case, jnp.bfloat16, num_kv_splits=3, pages_per_block=1)


def test_automatic_choices_and_sm_scale():
  case = make_case(MIXED, d=32, page_size=8, seed=6)
  out = pa.paged_attention(*case.args, sm_scale=0.3)
  ref = pa.paged_attention_reference(*case.args, sm_scale=0.3)
  assert rel_err(out, ref) < 1e-5
  # Few sequences with long contexts get splits; many sequences or short contexts do not.
  assert pa._choose_num_kv_splits(2, 2, 8192, 64) > 4
  assert pa._choose_num_kv_splits(256, 8, 8192, 64) == 1
  assert pa._choose_num_kv_splits(2, 2, 128, 64) == 1
  # ... and a prefill-heavy batch does not pay for K float32 copies of a big output.
  assert pa._choose_num_kv_splits(2, 2, 8192, 64, out_bytes=1 << 30) == 1


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_soft_capping_matches_reference(dtype):
  """softcap (Gemma 2's attn_logit_softcapping) at 1.5, under splits and page blocks:
  the reference's output, which differs from the uncapped one; the XLA paths agree."""
  case = make_case(MIXED, hq=8, hkv=2, d=32, page_size=8, max_seqs=6, dtype=dtype, seed=8)
  out = pa.paged_attention(*case.args, softcap=1.5, num_kv_splits=2, pages_per_block=2,
                           _block_q=4)
  ref = pa.paged_attention_reference(*case.args, softcap=1.5)
  assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
  assert rel_err(pa.paged_attention_reference(*case.args), ref) > 1e-2
  for kw in (dict(block_k=8), dict(block_k=8, row_tokens=10**6),
             dict(block_k=8, step_dense=True)):
    got = pa.paged_attention_xla(*case.args, softcap=1.5, **kw)
    assert rel_err(got[:case.live_rows], ref[:case.live_rows]) < TOL[dtype], kw


# ------------------------------------------------------------------------ sliding window

DECODES = [(1, 30), (1, 17), (1, 5), (1, 9)]
CHUNKS = [(12, 30), (9, 9), (6, 21)]


@pytest.mark.parametrize('window', [3, 6, 100], ids=['under_a_page', 'not_page_multiple',
                                                     'over_the_context'])
@pytest.mark.parametrize('seqs', [DECODES, CHUNKS, MIXED], ids=['decode', 'prefill', 'mixed'])
@pytest.mark.parametrize('softcap', [0.0, 1.5])
def test_sliding_window_matches_reference(window, seqs, softcap):
  """The kernel with a sliding window (pages of 4) under splits, page blocks and q blocks:
  the reference's output, and the XLA path's; a window under the context changes it."""
  case = make_case(seqs, hq=8, hkv=2, max_seqs=6, seed=window)
  live = case.live_rows
  ref = pa.paged_attention_reference(*case.args, sliding_window=window, softcap=softcap)
  for kw in (dict(num_kv_splits=2, pages_per_block=2, _block_q=4),
             dict(num_kv_splits=3, pages_per_block=1, _block_q=2)):
    check(case, sliding_window=window, softcap=softcap, _ref=ref, **kw)
  xla = pa.paged_attention_xla(*case.args, sliding_window=window, softcap=softcap, block_k=8)
  assert rel_err(xla[:live], ref[:live]) < 1e-5
  whole = pa.paged_attention_reference(*case.args, softcap=softcap)
  assert (rel_err(whole[:live], ref[:live]) > 1e-2) == (window < 30)


def test_sliding_window_in_bf16():
  case = make_case(MIXED, hq=8, hkv=2, max_seqs=6, dtype=jnp.bfloat16, seed=12)
  ref = pa.paged_attention_reference(*case.args, sliding_window=6, softcap=1.5)
  check(case, jnp.bfloat16, sliding_window=6, softcap=1.5, num_kv_splits=2,
        pages_per_block=2, _ref=ref)


def test_sliding_window_is_a_runtime_value():
  """One compiled kernel serves a local layer (window 5) and a global one (0), as a
  model's layer scan passes them; each equals the reference."""
  case = make_case(MIXED, hq=4, hkv=2, max_seqs=6, seed=13)
  fn = jax.jit(lambda w, *a: pa.paged_attention(*a, sliding_window=w, num_kv_splits=2,
                                                pages_per_block=2, _block_q=4))
  for window in (5, 0, 11):
    out = fn(jnp.int32(window), *case.args)
    ref = pa.paged_attention_reference(*case.args, sliding_window=window)
    assert rel_err(out, ref) < 1e-5, window
  assert fn._cache_size() == 1


@pytest.mark.parametrize('ppb,splits', [(1, 1), (1, 3), (2, 2)])
def test_pages_before_the_window_are_never_read(ppb, splits):
  """Window 5, pages of 4: NaN in the pages that lie wholly before where a q block's walk
  starts. A decode row at 29 needs keys 25.. (pages 0-5 never read); a chunk at 18..29 in
  q blocks of 4 tokens: its 2nd and 3rd blocks start at keys 18 and 22, so pages 0-3 are
  never read for them (its 1st block, from key 14, does read page 3, and is not checked).
  The checked rows are finite and bitwise the clean run's."""
  case = make_case([(1, 30), (12, 30), (1, 7)], hq=4, hkv=2, page_size=4, seed=14)
  q, kp, vp, kv_lens, table, cu, n = case.args
  kw = dict(sliding_window=5, num_kv_splits=splits, pages_per_block=ppb, _block_q=4)
  clean = pa.paged_attention(*case.args, **kw)
  bad = np.concatenate([np.asarray(table)[0, :6], np.asarray(table)[1, :4]])
  out = pa.paged_attention(q, kp.at[bad].set(jnp.nan), vp.at[bad].set(jnp.nan), kv_lens,
                           table, cu, n, **kw)
  rows = np.r_[0, 5:13, 13]   # seq 0's decode, seq 1's 2nd and 3rd q blocks, seq 2
  assert np.isfinite(np.asarray(out)[rows]).all(), 'a page before the window was read'
  np.testing.assert_array_equal(np.asarray(out)[rows], np.asarray(clean)[rows])
  assert np.isnan(np.asarray(out)[1]).all()   # the poison reaches a row that reads it


# The XLA path's walks (paged_attention_xla): by row (decode rows, or row_tokens), by
# sequence in windows of 4 query rows, and the step-dense split (its cached prefixes by row).
XLA_WALKS = {'by_row': ([(1, 30), (12, 30), (1, 7)], dict(row_tokens=1024)),
             'by_sequence': ([(1, 30), (12, 30), (1, 7)], dict(window=4)),
             'decode': ([(1, 30), (1, 25), (1, 7)], {}),
             'step_dense': ([(1, 30), (1, 25), (6, 6)], dict(step_dense=True))}


def _before_windows(case, seqs, window, page_size=4):
  """Page ids lying wholly before the window of each live sequence's earliest query."""
  table = np.asarray(case.args[4])
  return np.concatenate([table[s, :max(kv - q + 1 - window, 0) // page_size]
                         for s, (q, kv) in enumerate(seqs)])


@pytest.mark.parametrize('kv_format', ['float32', 'int8'])
@pytest.mark.parametrize('walk', list(XLA_WALKS))
def test_the_xla_path_never_reads_pages_before_the_window(walk, kv_format):
  """Window 5, pages of 4, key blocks of 2 pages: NaN in every page (or, 8-bit, every
  page's scales) lying wholly before the window of a sequence's earliest query (seq 0's
  decode at 29: pages 0-5; a chunk at 18..29: pages 0-2, the block of pages 2-3 read
  from page 3 on). Every live row is finite and bitwise the clean run's, which the
  float32 reference gives; NaN in the window's first page reaches the output."""
  seqs, kw = XLA_WALKS[walk]
  case = make_case(seqs, hq=4, hkv=2, page_size=4, seed=15)
  q, kp, vp, kv_lens, table, cu, n = case.args
  pages = [kp, vp]
  if kv_format == 'int8':
    pages = [x for p in pages for x in _int8(p)]   # k, k_scale, v, v_scale
  def args(ps):   # (k, v) or (k, k_scale, v, v_scale) -> positional and keyword arguments
    scales = dict(k_scale=ps[1], v_scale=ps[3]) if len(ps) == 4 else {}
    return (q, ps[0], ps[len(ps) // 2], kv_lens, table, cu, n), scales
  def run(ps):
    a, scales = args(ps)
    return pa.paged_attention_xla(*a, sliding_window=5, block_k=8, **kw, **scales)
  clean = np.asarray(run(pages))[:case.live_rows]
  a, scales = args(pages)
  ref = pa.paged_attention_reference(*a, sliding_window=5, **scales)
  assert rel_err(clean, ref[:case.live_rows]) < 1e-5
  poison = lambda bad: [p.at[bad].set(jnp.nan) if p.dtype != jnp.int8 else p for p in pages]
  bad = _before_windows(case, seqs, 5)
  assert len(bad) >= 6
  out = np.asarray(run(poison(bad)))[:case.live_rows]
  assert np.isfinite(out).all(), 'a page before the window was read'
  np.testing.assert_array_equal(out, clean)
  first = np.asarray(table)[0, 6]   # seq 0's window starts in its page 6
  assert np.isnan(np.asarray(run(poison(first)))[0]).all()


def _int8(pages):
  """(int8 values, float32 scales [P, page, Hkv]) of pages, one scale per slot and head."""
  scale = jnp.max(jnp.abs(jnp.nan_to_num(pages)), axis=-1) / 127
  return jnp.round(jnp.nan_to_num(pages) / scale[..., None]).astype(jnp.int8), scale


def test_splits_divide_the_blocks_inside_the_window():
  """200 cached keys, blocks of 8, a decode row's window of 40 (keys 160..199, blocks
  20-24): the splits share those 5 blocks, none before them."""
  seq = pa._SeqInfo(q_start=0, q_len=1, kv_len=200, layer=0, window=jnp.int32(40),
                    page_size=4, pages_per_block=2)
  ranges = [tuple(int(x) for x in pa._split_range(seq, k, 3)) for k in range(3)]
  assert ranges == [(20, 22), (22, 24), (24, 25)]
  seq.window, seq.first_block = jnp.int32(0), 0
  assert [int(pa._split_range(seq, k, 3)[0]) for k in range(3)] == [0, 9, 18]


def test_bad_sliding_window_refused():
  case = make_case([(2, 5)], seed=9)
  with pytest.raises(ValueError, match='sliding_window=-1 must be >= 0'):
    pa.paged_attention(*case.args, sliding_window=-1)
  with pytest.raises(TypeError, match='sliding_window must be one integer'):
    pa.paged_attention(*case.args, sliding_window=2.5)


# -------------------------------------------------------------------- written, gathered

def test_every_live_output_is_written():
  """Per-split outputs and log-sum-exps start as NaN (aliased in); live rows come out
  finite and equal to the unpoisoned run, so every split wrote every live row."""
  case = make_case(MIXED, hq=8, hkv=2, max_seqs=6, seed=7)
  kwargs = dict(num_kv_splits=3, pages_per_block=1, _block_q=4)
  clean = check(case, **kwargs)
  poisoned = check(case, _poison=np.nan, **kwargs)
  np.testing.assert_array_equal(poisoned, clean)


def test_pages_gathered_through_table():
  """Same inputs with the pool permuted (table remapped) give the same output; the NaN
  in unowned pages proves nothing outside the table is read."""
  case = make_case(MIXED, seed=8)
  q, kp, vp, kv_lens, table, cu, n = case.args
  perm = np.random.default_rng(0).permutation(kp.shape[0])
  inv = np.argsort(perm)
  moved = (q, kp[perm], vp[perm], kv_lens, jnp.asarray(inv[np.asarray(table)], jnp.int32),
           cu, n[0])   # num_seqs as a scalar this time
  kwargs = dict(num_kv_splits=2, pages_per_block=2)
  np.testing.assert_allclose(pa.paged_attention(*moved, **kwargs),
                             check(case, **kwargs), rtol=1e-6, atol=1e-6)


def test_jit_one_compile_many_layouts():
  """Ragged structure is data: one jitted function serves different batches."""
  fn = jax.jit(lambda *a: pa.paged_attention(*a, num_kv_splits=2, pages_per_block=2))
  for seed, seqs in enumerate([[(1, 30), (6, 6), (2, 17)], [(8, 8), (1, 3)]]):
    case = make_case(seqs, max_seqs=4, pages_per_seq=9, num_pages=20, t=12, seed=seed)
    out = fn(*case.args)
    assert rel_err(out, pa.paged_attention_reference(*case.args)) < 1e-5
  assert fn._cache_size() == 1


# ---------------------------------------------------------------------------- arg checks

@pytest.mark.parametrize('change,match', [
    (lambda a: (a[0][:, :3],) + a[1:], 'multiple of kv'),
    (lambda a: (a[0][None],) + a[1:], r'\[T, Hq, D\]'),
    (lambda a: (a[0].astype(jnp.int32),) + a[1:], 'floating'),
    (lambda a: a[:3] + (a[3].astype(jnp.float32),) + a[4:], 'kv_lens'),
    (lambda a: a[:5] + (a[5][:-1],) + a[6:], 'cu_q_lens'),
])
def test_static_errors(change, match):
  case = make_case([(2, 5)], seed=9)
  with pytest.raises((ValueError, TypeError), match=match):
    pa.paged_attention(*change(case.args))


def test_bad_tiling_refused():
  case = make_case([(2, 5)], seed=9)
  with pytest.raises(ValueError, match='must be >= 1'):
    pa.paged_attention(*case.args, num_kv_splits=0)


def test_gpu_tiling_refused_before_lowering():
  case = make_case([(2, 5)], seed=9)   # page_size 4 x 1 page: a 4-key block, too small
  with pytest.raises(ValueError, match='page_size \\* pages_per_block = 4'):
    pa.paged_attention(*case.args, pages_per_block=1, interpret=False)


# ------------------------------------------------------------- stacked cache, layer index

def layer_stack(case, num_layers, seed):
  """K and V stacks [L, P, page, Hkv, D]: each layer its own random pages, with the case's
  NaN poison (unowned pages, page tails) in every layer."""
  rng = np.random.default_rng(seed)
  dtype = case.args[1].dtype
  fill = lambda x: np.where(np.isnan(x), np.nan, rng.normal(size=(num_layers, *x.shape)))
  return tuple(jnp.asarray(fill(np.asarray(x, np.float32)), dtype) for x in case.args[1:3])


def check_layer(out, want, live_rows, dtype=jnp.float32):
  live = np.asarray(out[:live_rows], np.float32)
  assert np.isfinite(live).all(), 'a live output is NaN: read a poisoned page or layer'
  assert rel_err(out, want) < TOL[dtype], rel_err(out, want)
  np.testing.assert_array_equal(np.asarray(out[live_rows:], np.float32), 0)


STACKED_KWARGS = dict(num_kv_splits=2, pages_per_block=2, _block_q=4, _poison=np.nan)


@pytest.mark.parametrize('hq,hkv', [(8, 2), (7, 1)])
def test_stacked_cache_reads_the_named_layer(hq, hkv):
  """A 4-layer stack, each layer its own pages: the kernel given the whole stack and
  layer l equals the reference on layer l's pages, for every l, with the layer traced
  (one compile for all) and as a Python int."""
  case = make_case(MIXED, hq=hq, hkv=hkv, max_seqs=7, seed=20 + hq)
  q, _, _, *meta = case.args
  ks, vs = layer_stack(case, 4, seed=hq)
  fn = jax.jit(lambda k, v, layer: pa.paged_attention(q, k, v, *meta, layer=layer,
                                                      **STACKED_KWARGS))
  wants = [pa.paged_attention_reference(q, ks[l], vs[l], *meta) for l in range(4)]
  for layer, want in enumerate(wants):
    assert rel_err(want, wants[0] if layer else wants[1]) > 0.1   # the layers differ
    check_layer(fn(ks, vs, jnp.asarray([layer], jnp.int32)), want, case.live_rows)
  assert fn._cache_size() == 1
  check_layer(pa.paged_attention(q, ks, vs, *meta, layer=2, **STACKED_KWARGS), wants[2],
              case.live_rows)


def test_stacked_cache_other_layers_never_read():
  """Every layer but the named one NaN throughout: the output equals the single-layer
  call's, bitwise."""
  case = make_case(MIXED, hq=6, hkv=2, max_seqs=7, seed=22)
  q, kp, vp, *meta = case.args
  single = pa.paged_attention(*case.args, **STACKED_KWARGS)
  for layer in (0, 2):
    nan = jnp.full((3, *kp.shape), jnp.nan, kp.dtype)
    out = pa.paged_attention(q, nan.at[layer].set(kp), nan.at[layer].set(vp), *meta,
                             layer=jnp.int32(layer), **STACKED_KWARGS)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(single))


def test_stacked_cache_reaches_the_kernel_whole():
  """Traced, the kernel's K and V operands are the stack arguments themselves, and no
  other equation reads them: no layer is sliced out on the way in."""
  case = make_case(MIXED, seed=23)
  q, _, _, *meta = case.args
  ks, vs = layer_stack(case, 3, seed=0)
  closed = jax.make_jaxpr(lambda k, v, layer: pa.paged_attention(q, k, v, *meta,
                                                                 layer=layer))(ks, vs, 1)
  k_var, v_var, _ = closed.jaxpr.invars
  [call] = [e for e in closed.jaxpr.eqns if e.primitive.name == 'pallas_call']
  assert call.invars[-2:] == [k_var, v_var]
  readers = [e.primitive.name for e in closed.jaxpr.eqns
             if any(x is k_var or x is v_var for x in e.invars)]
  assert readers == ['pallas_call'], readers


@pytest.mark.parametrize('pages,layer,match', [
    ('one', 0, 'stacked cache'), ('stack', None, 'stacked cache'),
    ('stack', 3, 'layer=3 is outside'), ('stack', -1, 'layer=-1 is outside'),
    ('stack', 1.0, 'one integer'), ('stack', jnp.asarray([0, 1]), 'one integer')])
def test_stacked_cache_bad_layer_refused(pages, layer, match):
  case = make_case([(2, 5)], seed=9)
  q, kp, vp, *meta = case.args
  if pages == 'stack':
    kp, vp = jnp.stack([kp] * 3), jnp.stack([vp] * 3)
  with pytest.raises((ValueError, TypeError), match=match):
    pa.paged_attention(q, kp, vp, *meta, layer=layer)


def test_stacked_cache_over_4gib_compiles_for_hopper_with_64_bit_offsets():
  """The kernel on a 32 GiB bf16 stack lowers to Triton and compiles for sm_90a as the
  single-layer one does (no spills, wgmma), its page pointers offset in 64 bits: the
  whole stack's element offsets pass 2^31 (checked on a CPU host: no GPU needed)."""
  pytest.importorskip('triton')
  from benchmarks import kernel_resources as kr   # pylint: disable=import-outside-toplevel
  shape = jax.ShapeDtypeStruct
  pages = shape((32, 32768, 16, 8, 128), jnp.bfloat16)
  args = (shape((64, 32, 128), jnp.bfloat16), pages, pages, shape((64,), jnp.int32),
          shape((64, 512), jnp.int32), shape((65,), jnp.int32), shape((1,), jnp.int32),
          shape((1,), jnp.int32))
  fn = lambda *a: pa.paged_attention(*a[:-1], layer=a[-1], interpret=False)
  [call] = kr.triton_calls(fn, *args)
  assert re.search(r'tt\.addptr .*i64>', call.ttir), 'page offsets are 32-bit'
  res = kr.compile_sm90(call)
  assert res.stack_bytes == 0 and res.registers <= 255 and res.uses_wgmma, res
