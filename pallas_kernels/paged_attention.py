"""Ragged paged attention for serving: a Pallas kernel and a pure-jnp reference.

One call attends a mixed batch: decode tokens (one query each) and prefill chunks (many
queries) of up to `max_seqs` sequences, concatenated along the token axis of `q`. Each
sequence's keys and values live in fixed-size pages of a shared pool, listed in order by
its row of `page_indices`:

    q [T, Hq, D]      | seq 0 (q_len 1) | seq 1 (q_len 5)         | seq 2 (q_len 1) | pad |
                      ^ cu_q_lens[0]    ^ cu_q_lens[1]            ^ cu_q_lens[2]    ^ cu_q_lens[3]
    page_indices[1] = [7, 2, 9, ...]   ->  K/V of seq 1 = pool[7] ++ pool[2] ++ pool[9] ...
                                                            (first kv_lens[1] positions)

The new tokens sit at the end of their sequence: query i of a sequence with q_len queries
and kv_len cached tokens (the new ones included) is at position kv_len - q_len + i and
sees keys at positions <= that.

Kernel: grid (sequence, kv head, kv split). A program takes every q head of its kv head's
group and every query token of its sequence (in blocks of `block_q` tokens), and walks its
split's page blocks, gathering pages through the page table; each page block is loaded
once per q block for the whole head group, never once per q head. Each split writes a
normalized partial output and its log-sum-exp; `_merge_splits` combines them.

A sliding window (an int32 operand like the layer, so a model's local and global layers
share one compiled kernel) moves where the walk starts: the splits divide a sequence's
blocks from the first one inside its earliest query's window, and each q block starts at
its own first query's window; blocks before it are never loaded.

A model carrying every layer's cache as one stack [L, P, page_size, Hkv, D] passes it
whole with the layer's index (`layer=`): the kernel adds the layer to its own page
reads, so no layer is copied out of the stack (one layer's pages are a stack of one).

A head group that is not a power of two (7 q heads per kv head, say) is zero-padded to
one for the kernel, whose tiles must be powers of two on GPU, and sliced back after.

Written in the portable Pallas style (pallas_call, grid, BlockSpecs, masked loads and
stores, fori_loop) for the Triton backend on GPU; on CPU it runs in interpret mode.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:  # jax 0.10: masked load/store moved from pl.load/pl.store to the Triton namespace.
  from jax.experimental.pallas import triton as _plgpu
  _masked_load = lambda ref, idx, **kw: _plgpu.load(ref.at[idx], **kw)
  _masked_store = lambda ref, idx, val, **kw: _plgpu.store(ref.at[idx], val, **kw)
except (ImportError, AttributeError):  # pragma: no cover - older or newer jax
  # Older jax has pl.load/pl.store; if neither exists the module still imports and the
  # kernel fails at call time, naming what is missing.
  def _missing(*args, **kwargs):
    raise NotImplementedError('this jax has neither pallas.triton.load/store nor '
                              'pl.load/pl.store: the paged attention kernel needs one.')
  _masked_load = getattr(pl, 'load', _missing)
  _masked_store = getattr(pl, 'store', _missing)

# Finite, so a fully masked row gives exp(mask - mask) = 1 instead of NaN; those
# probabilities are then zeroed explicitly.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Programs to aim for, about two per SM of an H100/H200's 132: with fewer the SMs idle, with
# more the splits' prologues, partial outputs and merge cost more than they hide
# (benchmarks.paged_decode --splits times each choice from 1 to 32 sequences).
_TARGET_PROGRAMS = 256
_MIN_SPLIT_TOKENS = 256  # a shorter split costs more in the merge than it wins
_MAX_SPLITS = 64         # one long request: 8 kv heads x 32 splits fill the GPU
_SPLIT_BYTES = 256 << 20  # cap on the float32 per-split outputs of a prefill-heavy batch
_BLOCK_K_TOKENS = 64     # keys per page block when pages_per_block is None
_BLOCK_ROWS = 64         # q rows (tokens x heads of a group) per block
_MIN_DOT_ROWS = 16       # Triton's tl.dot needs M, N and K >= 16


# ----------------------------------------------------------------------------- reference

def paged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                              num_seqs, *, sm_scale=None, num_kv_splits=None,
                              pages_per_block=None, interpret=None, sliding_window=0,
                              softcap=0.0, k_scale=None, v_scale=None):
  """Float32 jnp version of `paged_attention` (splits/blocks/interpret are ignored);
  sliding_window > 0: each row sees only its last sliding_window positions; softcap > 0:
  scores soft-capped, softcap * tanh(scores / softcap), before the mask; k_scale,
  v_scale: 8-bit pages, dequantized to float32 first.

  Gathers every token's whole sequence of K/V from the pages, so it needs
  O(T * pages_per_seq * page_size) memory: for tests and small batches only.
  """
  del num_kv_splits, pages_per_block, interpret
  _check_args(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, k_scale, v_scale)
  if k_scale is not None:
    k_pages, v_pages = (dequantize(x, s, jnp.float32)
                        for x, s in ((k_pages, k_scale), (v_pages, v_scale)))
  t, hq, d = q.shape
  _, page_size, hkv, _ = k_pages.shape
  scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  seq, pos, live = _token_layout(t, kv_lens, cu_q_lens, num_seqs)
  max_len = page_indices.shape[1] * page_size
  keys_of = lambda pages: pages[page_indices].reshape(-1, max_len, hkv, d)  # [S, L, Hkv, D]
  key_pos = jnp.arange(max_len)
  # Positions past a sequence's end may hold any junk (NaN included): zero them.
  in_seq = key_pos[None, :] < kv_lens[:, None]                           # [S, L]
  k = jnp.where(in_seq[..., None, None], keys_of(k_pages).astype(jnp.float32), 0)[seq]
  v = jnp.where(in_seq[..., None, None], keys_of(v_pages).astype(jnp.float32), 0)[seq]
  qg = q.astype(jnp.float32).reshape(t, hkv, hq // hkv, d)
  hi = jax.lax.Precision.HIGHEST   # no TF32 on GPU: this is the reference
  scores = _cap(jnp.einsum('tkgd,tskd->tkgs', qg, k, precision=hi) * scale, softcap)
  visible = (key_pos[None, :] <= pos[:, None]) & live[:, None]          # [T, L]
  visible &= _in_window(key_pos[None, :], pos[:, None], sliding_window)
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum('tkgs,tskd->tkgd', probs, v, precision=hi).reshape(t, hq, d)
  return jnp.where(live[:, None, None], out, 0).astype(q.dtype)


def _cap(scores, cap):
  return cap * jnp.tanh(scores / cap) if cap else scores


def _in_window(k_pos, q_pos, sliding_window):
  """Whether key position k_pos is within q_pos's sliding window (all: 0)."""
  return k_pos > q_pos - sliding_window if sliding_window else True


def _token_layout(t, kv_lens, cu_q_lens, num_seqs):
  """Per query row: its sequence, its absolute position, and whether it is live."""
  num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
  rows = jnp.arange(t, dtype=jnp.int32)
  # Entries past num_seqs may be stale junk: hide them from the search.
  cu_live = jnp.where(jnp.arange(cu_q_lens.shape[0]) <= num_seqs, cu_q_lens,
                      jnp.iinfo(jnp.int32).max)
  # compare_all: [T, S] comparisons, no loop (the default bisects in a while loop).
  seq = jnp.searchsorted(cu_live, rows, side='right', method='compare_all').astype(jnp.int32)
  seq = seq - 1
  seq = jnp.clip(seq, 0, kv_lens.shape[0] - 1)
  q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
  pos = kv_lens[seq] - q_len + (rows - cu_q_lens[seq])
  live = rows < cu_q_lens[num_seqs]
  return seq, pos, live


# ------------------------------------------------------------------------ XLA (serving)

_XLA_WINDOW = 32   # query rows per work item of the by-sequence path


def paged_attention_xla(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                        sm_scale=None, block_k=None, window=None, row_tokens=0,
                        step_dense=False, sliding_window=0, softcap=0.0, k_scale=None,
                        v_scale=None):
  """Ragged paged attention in plain jnp for serving without the kernel (CPU default).

  Flash-style (online softmax over key blocks of `block_k` tokens), so no step ever
  holds a row's whole context, by one of two paths chosen at run time (lax.cond, one
  program):
  - decode-only steps (every q_len 1), by row: each key block is gathered for all rows
    at once ([T, block_k, Hkv, D]), the loop running to the longest live context.
  - steps with a prefill chunk, by sequence: for each live sequence, for each window of
    `window` of its query rows, each key block is gathered once and shared by the
    window's rows ([window, Hq] x [block_k] scores). A gather per row would copy a
    chunk's keys once per row (measured 20x slower than the dense forward on CPU).
  Working memory: O(T * block_k) and O(window * block_k) (plus q and out); FLOPs: the
  live keys, rounded up to a block (and a decode row sharing a mixed step is padded to
  a window). Same arguments and output as `paged_attention`; padding rows give 0.
  row_tokens: steps of at most this many rows (T, static) take the by-row path even with
  prefill chunks: at small T its gathers cost less than the by-sequence path's loops and
  padded windows (measured on CPU: 128 rows, 15 decodes + a 100-token chunk, 40% faster).
  step_dense: first, at run time, the split path when it applies: every query row
  attends the step's own rows densely ([T, T] scores, block-diagonal causal), and only
  the first S rows (S = sequence slots) attend their cached prefix, by row. It applies
  when no row past the first S has a cached prefix: decode rows first, then prefill
  chunks starting at position 0, which is how the scheduler orders a step without
  chunked-prefill continuations or prefix hits. Memory O(T * T * Hq): the caller enables
  it for small T only.
  sliding_window > 0: each row sees only its last sliding_window positions, and the
  pages wholly before a row's window (by row) or its query window's earliest row's (by
  sequence) are never read: the walk starts at the key block holding the window's first
  page, on the same block grid as without a window, and that block's earlier table slots
  read page 0, masked (so the output is bitwise the masked walk's, and a decode step
  loops over about window / block_k blocks, not the whole context). softcap > 0: scores
  soft-capped (Gemma 2), as in paged_attention_reference.
  k_scale, v_scale [P, page_size, Hkv]: pages stored 8-bit (see `paged_attention`).
  """
  _check_args(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, k_scale, v_scale)
  page_size = k_pages.shape[1]
  ppb = max(1, min((block_k or _BLOCK_K_TOKENS) // page_size, page_indices.shape[1]))
  scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else sm_scale
  kv_lens, cu_q_lens, page_indices = (
      jnp.asarray(x, jnp.int32) for x in (kv_lens, cu_q_lens, page_indices))
  num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
  # Whole blocks of table slots; slots past a sequence's pages read page 0 (masked).
  table = jnp.pad(page_indices, ((0, 0), (0, -page_indices.shape[1] % ppb)))
  pages = (k_pages, v_pages) if k_scale is None else (k_pages, v_pages, k_scale, v_scale)
  args = (q, pages, kv_lens, table, cu_q_lens, num_seqs)
  by_row = functools.partial(_xla_by_row, ppb=ppb, scale=scale, sliding=sliding_window,
                             cap=softcap)
  by_seq = functools.partial(_xla_by_sequence, ppb=ppb, scale=scale,
                             window=min(window or _XLA_WINDOW, q.shape[0]),
                             sliding=sliding_window, cap=softcap)
  if q.shape[0] <= row_tokens:
    general = by_row
  else:
    general = lambda *a: lax.cond(cu_q_lens[num_seqs] == num_seqs, by_row, by_seq, *a)
  if not step_dense:
    return general(*args).astype(q.dtype)
  split = functools.partial(_xla_step_dense, ppb=ppb, scale=scale, sliding=sliding_window,
                            cap=softcap)
  prefix = _prefix_lens(q.shape[0], kv_lens, cu_q_lens, num_seqs)
  fits = jnp.all(prefix[min(page_indices.shape[0], q.shape[0]):] == 0)
  return lax.cond(fits, split, general, *args).astype(q.dtype)


def _prefix_lens(t, kv_lens, cu_q_lens, num_seqs):
  """Per query row: how many of its sequence's keys were cached before this step."""
  seq, _, live = _token_layout(t, kv_lens, cu_q_lens, num_seqs)
  return jnp.where(live, kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]), 0)


def _xla_step_dense(q, pages, kv_lens, table, cu_q_lens, num_seqs, *, ppb, scale, sliding=0,
                    cap=0.0):
  """The split path (see paged_attention_xla's step_dense): the step's rows among
  themselves, one dense online-softmax block, then the first S rows' cached prefixes."""
  t, hq, d = q.shape
  hkv, page_size = pages[0].shape[2], pages[0].shape[1]
  seq, pos, live = _token_layout(t, kv_lens, cu_q_lens, num_seqs)
  qg = q.reshape(t, hkv, hq // hkv, d)
  # This step's K/V, read back from the slots the step has just written.
  page = jnp.where(live, table[seq, pos // page_size], 0)
  k, v = _read_kv(pages, (page, pos % page_size), q.dtype)                  # [T, Hkv, D]
  v = jnp.where(live[:, None, None], v, 0)   # padding rows' slots hold junk, maybe NaN
  # A sequence's rows are contiguous and in position order: row r sees the rows from its
  # sequence's first up to itself. (Comparing row indices, not gathered sequence ids and
  # positions, which XLA:CPU would re-gather per score element.)
  rows = jnp.arange(t)
  first = jnp.where(live, cu_q_lens[seq], t)                      # padding rows: none
  visible = (rows[None, :] >= first[:, None]) & (rows[None, :] <= rows[:, None])   # [T, T]
  visible &= _in_window(rows[None, :], rows[:, None], sliding)   # rows are positions apart
  # Heads leading: XLA:CPU runs these dots much faster than with the token axis first.
  to_heads = lambda x: jnp.moveaxis(x, 0, -2)                    # [T, Hkv, (G,) D] -> heads
  m, l, acc = _softmax_step(_softmax_init((hkv, hq // hkv, t), d), to_heads(qg),
                            to_heads(k), to_heads(v), visible, scale,
                            'kgtd,kud->kgtu', 'kgtu,kud->kgtd', cap)
  m, l, acc = (jnp.moveaxis(x, 2, 0) for x in (m, l, acc))                # rows leading
  n = min(table.shape[0], t)
  prefix = _prefix_lens(t, kv_lens, cu_q_lens, num_seqs)[:n]
  first = _first_pages(pos[:n], prefix > 0, sliding, page_size)
  step = functools.partial(_xla_row_block, qg=qg[:n], pages=pages, table=table[seq[:n]],
                           pos=pos[:n], row_len=prefix, ppb=ppb, scale=scale, sliding=sliding,
                           cap=cap, first=first)
  num_blocks = _row_blocks(prefix, first, ppb, page_size)
  head = lax.fori_loop(0, num_blocks, step, (m[:n], l[:n], acc[:n]))
  l, acc = (jnp.concatenate([h, x[n:]]) for h, x in zip(head[1:], (l, acc)))
  out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(t, hq, d)
  return jnp.where(live[:, None, None], out, 0)


def _xla_by_row(q, pages, kv_lens, table, cu_q_lens, num_seqs, *, ppb, scale, sliding=0,
                cap=0.0):
  t, hq, d = q.shape
  hkv = pages[0].shape[2]
  seq, pos, live = _token_layout(t, kv_lens, cu_q_lens, num_seqs)
  row_len = jnp.where(live, kv_lens[seq], 0)
  first = _first_pages(pos, live, sliding, pages[0].shape[1])
  step = functools.partial(_xla_row_block, qg=q.reshape(t, hkv, hq // hkv, d), pages=pages,
                           table=table[seq], pos=pos, row_len=row_len, ppb=ppb, scale=scale,
                           sliding=sliding, cap=cap, first=first)
  num_blocks = _row_blocks(row_len, first, ppb, pages[0].shape[1])
  _, l, acc = lax.fori_loop(0, num_blocks, step, _softmax_init((t, hkv, hq // hkv), d))
  out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(t, hq, d)
  return jnp.where(live[:, None, None], out, 0)


def _first_pages(pos, live, sliding, page_size):
  """Per row: the page holding the first key of its window (0 without a window, or for a
  row that reads nothing); None without a window (the walk from page 0)."""
  if not sliding:
    return None
  return jnp.where(live, jnp.maximum(pos - sliding + 1, 0) // page_size, 0)


def _row_blocks(row_len, first, ppb, page_size):
  """Key blocks of the by-row walk: the most any row needs from its first block on."""
  block_k = ppb * page_size
  start = 0 if first is None else first // ppb * block_k
  return pl.cdiv(jnp.max(jnp.maximum(row_len - start, 0)), block_k)


def _xla_row_block(j, carry, *, qg, pages, table, pos, row_len, ppb, scale, sliding=0,
                   cap=0.0, first=None):
  """Key block j of every row's own sequence: k, v [T, block_k, Hkv, D]. first [T]: each
  row's window's first page (_first_pages); its walk's block j is then the j-th from the
  block holding that page, whose slots before it read page 0, masked."""
  t = qg.shape[0]
  block_k = ppb * pages[0].shape[1]
  if first is None:
    k_pos = (j * block_k + jnp.arange(block_k))[None, :]                    # [1, block_k]
    k_ok = k_pos < row_len[:, None]                                         # [T, block_k]
    ids = lax.dynamic_slice_in_dim(table, j * ppb, ppb, axis=1)             # [T, ppb]
  else:
    block = first // ppb + j                                                # [T]
    k_pos = block[:, None] * block_k + jnp.arange(block_k)                  # [T, block_k]
    k_ok = (k_pos < row_len[:, None]) & (k_pos >= first[:, None] * pages[0].shape[1])
    # Clipped: a row past its own last block reads nothing (k_ok is False there).
    ids = jnp.take_along_axis(table, block[:, None] * ppb + jnp.arange(ppb), axis=1,
                              mode='clip')
  ids = jnp.where(k_ok.reshape(t, ppb, -1)[:, :, 0], ids, 0)
  k, v = _read_kv(pages, (ids,), qg.dtype, (t, block_k, *pages[0].shape[2:]))
  # Junk past a sequence's end may be NaN, and 0 * NaN would poison p @ v.
  v = jnp.where(k_ok[..., None, None], v, 0)
  visible = k_ok & (k_pos <= pos[:, None]) & _in_window(k_pos, pos[:, None], sliding)
  visible = visible[:, None, None]                                          # [T,1,1,bk]
  return _softmax_step(carry, qg, k, v, visible, scale, 'tkgd,tskd->tkgs', 'tkgs,tskd->tkgd',
                       cap)


def _xla_by_sequence(q, pages, kv_lens, table, cu_q_lens, num_seqs, *, ppb, scale, window,
                     sliding=0, cap=0.0):
  """fori over live sequences, then over windows of their query rows."""
  t, hq, d = q.shape
  hkv = pages[0].shape[2]
  q = jnp.pad(q, ((0, window), (0, 0), (0, 0)))   # a sequence's last window may run past T
  block_k = ppb * pages[0].shape[1]

  def one_window(w, out, s):
    q_start, q_len, kv_len = cu_q_lens[s], cu_q_lens[s + 1] - cu_q_lens[s], kv_lens[s]
    r0 = q_start + w * window
    rows = w * window + jnp.arange(window)
    qw = lax.dynamic_slice_in_dim(q, r0, window).reshape(window, hkv, hq // hkv, d)
    q_pos = kv_len - q_len + rows
    # The earliest row's window: the pages before its first are never read.
    first = _first_pages(q_pos[0], True, sliding, pages[0].shape[1])
    step = functools.partial(_xla_seq_block, qw=qw, pages=pages, row=table[s], q_pos=q_pos,
                             kv_len=kv_len, ppb=ppb, scale=scale, sliding=sliding, cap=cap,
                             first=first)
    # Causal: keys up to the window's last live row.
    keys = kv_len - q_len + jnp.minimum((w + 1) * window, q_len)
    lo = 0 if first is None else first // ppb
    _, l, acc = lax.fori_loop(lo, jnp.maximum(pl.cdiv(keys, block_k), lo), step,
                              _softmax_init((window, hkv, hq // hkv), d))
    new = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(window, hq, d)
    old = lax.dynamic_slice_in_dim(out, r0, window)
    # Rows past q_len belong to the next sequence (or are padding): keep them.
    new = jnp.where((rows < q_len)[:, None, None], new, old)
    return lax.dynamic_update_slice_in_dim(out, new, r0, axis=0)

  def one_sequence(s, out):
    q_len = cu_q_lens[s + 1] - cu_q_lens[s]
    return lax.fori_loop(0, pl.cdiv(q_len, window),
                         functools.partial(one_window, s=s), out)

  out = lax.fori_loop(0, num_seqs, one_sequence, jnp.zeros((t + window, hq, d), jnp.float32))
  return out[:t]


def _xla_seq_block(j, carry, *, qw, pages, row, q_pos, kv_len, ppb, scale, sliding=0,
                   cap=0.0, first=None):
  """Key block j of one sequence, shared by a window of its rows: k, v [block_k, Hkv, D].
  first: the earliest row's window's first page; the block's slots before it read page
  0, masked."""
  block_k = ppb * pages[0].shape[1]
  k_pos = j * block_k + jnp.arange(block_k)
  k_ok = k_pos < kv_len
  if first is not None:
    k_ok &= k_pos >= first * pages[0].shape[1]
  ids = jnp.where(k_ok.reshape(ppb, -1)[:, 0], lax.dynamic_slice_in_dim(row, j * ppb, ppb), 0)
  k, v = _read_kv(pages, (ids,), qw.dtype, (block_k, *pages[0].shape[2:]))
  v = jnp.where(k_ok[:, None, None], v, 0)   # junk past the end may be NaN
  visible = (k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
             & _in_window(k_pos[None, :], q_pos[:, None], sliding))[:, None, None]
  return _softmax_step(carry, qw, k, v, visible, scale, 'qkgd,skd->qkgs', 'qkgs,skd->qkgd',
                       cap)


def _read_kv(pages, index, dtype, shape=None):
  """K and V at `index` of pages (k, v) or, stored 8-bit, (k, v, k_scale, v_scale),
  in `dtype`, each reshaped to `shape` if given (K's gather and reshape, then V's: the
  order of the program before 8-bit pages, which auto keeps)."""
  shaped = (lambda x: x) if shape is None else (lambda x: x.reshape(shape))
  if len(pages) == 2:
    return tuple(shaped(p[index]) for p in pages)
  return tuple(shaped(dequantize(p[index], s[index], dtype))
               for p, s in zip(pages[:2], pages[2:]))


def dequantize(x, scale, dtype):
  """8-bit values x [..., D] times their scales [...] (float32), in `dtype`."""
  return (x.astype(jnp.float32) * scale[..., None]).astype(dtype)


def _softmax_init(rows_shape, d):
  return (jnp.full(rows_shape, _MASK_VALUE, jnp.float32), jnp.zeros(rows_shape, jnp.float32),
          jnp.zeros((*rows_shape, d), jnp.float32))


def _softmax_step(carry, q, k, v, visible, scale, qk, pv, cap=0.0):
  """One online-softmax update; q [..., Hkv, G, D], scores [..., Hkv, G, block_k]; cap:
  the scores' soft cap (0: none)."""
  m_prev, l_prev, acc_prev = carry
  hi = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  scores = jnp.einsum(qk, q, k, precision=hi, preferred_element_type=jnp.float32) * scale
  scores = _cap(scores, cap)
  scores = jnp.where(visible, scores, _MASK_VALUE)
  m = jnp.maximum(m_prev, scores.max(axis=-1))
  p = jnp.where(visible, jnp.exp(scores - m[..., None]), 0.0)
  alpha = jnp.exp(m_prev - m)
  out = jnp.einsum(pv, p.astype(v.dtype), v, precision=hi, preferred_element_type=jnp.float32)
  return m, alpha * l_prev + p.sum(axis=-1), alpha[..., None] * acc_prev + out


# --------------------------------------------------------------------------------- kernel

def _paged_attention_kernel(
    num_seqs_ref,    # [1] int32
    layer_ref,       # [1] int32: the layer of the stacked cache to read
    window_ref,      # [1] int32: the sliding window (0: the whole context)
    kv_lens_ref,     # [max_seqs] int32
    cu_q_lens_ref,   # [max_seqs + 1] int32
    page_row_ref,    # [pages_per_seq] int32: this sequence's page table row
    q_ref,           # [T, G, D]: the G q heads of this kv head
    k_ref,           # [L, P, page_size, D]: this kv head of every page of every layer
    v_ref,           # [L, P, page_size, D]
    *refs,           # 8-bit pages: k_scale, v_scale [L, P, page_size] f32; then (aliased
                     # inputs, only when poisoned), o [T, G, D] f32, lse [T, G] f32
    block_q, pages_per_block, num_kv_splits, sm_scale, softcap, quantized):
  o_ref, lse_ref = refs[-2:]
  kv_refs = (k_ref, v_ref) + (refs[:2] if quantized else ())
  # Program ids are read here, outside any control flow: interpret mode resolves them
  # only at the kernel's top level.
  s, split = pl.program_id(0), pl.program_id(2)
  layer, window = layer_ref[0], window_ref[0]

  @pl.when(s < num_seqs_ref[0])
  def _():
    q_start = cu_q_lens_ref[s]
    seq = _SeqInfo(q_start=q_start, q_len=cu_q_lens_ref[s + 1] - q_start,
                   kv_len=kv_lens_ref[s], layer=layer, window=window,
                   page_size=k_ref.shape[2], pages_per_block=pages_per_block)
    lo, hi = _split_range(seq, split, num_kv_splits)
    attend = functools.partial(_attend_q_block, seq=seq, block_lo=lo, block_hi=hi,
                               refs=(page_row_ref, q_ref, kv_refs, o_ref, lse_ref),
                               block_q=block_q, sm_scale=sm_scale, softcap=softcap)
    # Every q block is visited even when the split holds no keys for it: that writes
    # o = 0 and lse = -inf, which the merge needs.
    def q_block(i, carry):
      attend(i)
      return carry
    lax.fori_loop(0, pl.cdiv(seq.q_len, block_q), q_block, 0)


class _SeqInfo:
  """Scalars of the sequence a program works on (traced values)."""

  def __init__(self, *, q_start, q_len, kv_len, layer, window, page_size, pages_per_block):
    self.q_start, self.q_len, self.kv_len, self.layer = q_start, q_len, kv_len, layer
    self.window = window
    self.page_size, self.pages_per_block = page_size, pages_per_block
    self.block_k = page_size * pages_per_block
    self.num_pages = pl.cdiv(kv_len, page_size)
    self.num_blocks = pl.cdiv(kv_len, self.block_k)
    # The block holding the first key any of this step's queries sees.
    self.first_block = self.window_block(kv_len - q_len)

  def window_block(self, q_pos):
    """The page block of query position q_pos's first visible key (0 without a window)."""
    first_key = jnp.where(self.window > 0, q_pos - self.window + 1, 0)
    return jnp.maximum(first_key, 0) // self.block_k


def _split_range(seq, split, num_kv_splits):
  # Splits divide this sequence's own page blocks from the first inside its window (not
  # the padded table, nor the blocks before the window), so a short sequence or a short
  # window keeps all its keys in split 0 and its later splits are empty.
  per_split = pl.cdiv(seq.num_blocks - seq.first_block, num_kv_splits)
  lo = jnp.minimum(seq.first_block + split * per_split, seq.num_blocks)
  return lo, jnp.minimum(lo + per_split, seq.num_blocks)


def _attend_q_block(qb, *, seq, block_lo, block_hi, refs, block_q, sm_scale, softcap):
  """Online softmax of one block of query tokens (all G heads) over the split's keys."""
  page_row_ref, q_ref, kv_refs, o_ref, lse_ref = refs
  _, groups, d = q_ref.shape
  rows = block_q * groups
  tok = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
  tok_ok = tok < seq.q_len
  q_rows = pl.ds(seq.q_start + qb * block_q, block_q)
  # Masked: the block's tail belongs to the next sequence or runs past T.
  q = _masked_load(q_ref, (q_rows,), mask=tok_ok[:, None, None], other=0)
  q = q.reshape(rows, d)
  # Row r is token r // G, head r % G (the layout of q's [block_q, G, D] block).
  q_pos = seq.kv_len - seq.q_len + qb * block_q + (
      lax.broadcasted_iota(jnp.int32, (rows,), 0) // groups)
  # Causal: no key past the block's last live query is needed.
  last_pos = seq.kv_len - seq.q_len + jnp.minimum((qb + 1) * block_q, seq.q_len) - 1
  hi = jnp.minimum(block_hi, last_pos // seq.block_k + 1)
  # Window: no key before the block's first query's window is needed (never loaded).
  lo = jnp.maximum(block_lo, seq.window_block(seq.kv_len - seq.q_len + qb * block_q))
  carry = (jnp.full((rows,), _MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, d), jnp.float32))
  body = functools.partial(_attend_page_block, q=q, q_pos=q_pos, seq=seq,
                           refs=(page_row_ref, kv_refs), sm_scale=sm_scale,
                           softcap=softcap)
  m, l, acc = lax.fori_loop(lo, jnp.maximum(hi, lo), body, carry)
  # l == 0: no visible key in this split; o = 0 and lse = -inf give it weight 0.
  has_keys = l > 0
  out = acc / jnp.where(has_keys, l, 1.0)[:, None]
  lse = jnp.where(has_keys, m + jnp.log(jnp.where(has_keys, l, 1.0)), -jnp.inf)
  _masked_store(o_ref, (q_rows,), out.reshape(block_q, groups, d).astype(o_ref.dtype),
                mask=tok_ok[:, None, None])
  _masked_store(lse_ref, (q_rows,), lse.reshape(block_q, groups), mask=tok_ok[:, None])


def _attend_page_block(blk, carry, *, q, q_pos, seq, refs, sm_scale, softcap):
  """One flash-attention step over page block `blk` of the sequence."""
  page_row_ref, kv_refs = refs
  m_prev, l_prev, acc_prev = carry
  ppb, d = seq.pages_per_block, q.shape[-1]
  slot = blk * ppb + lax.broadcasted_iota(jnp.int32, (ppb,), 0)
  slot_ok = slot < seq.num_pages
  # Table slots past the sequence's last page hold junk ids: read page 0 instead.
  page_ids = _masked_load(page_row_ref, (pl.ds(blk * ppb, ppb),), mask=slot_ok, other=0)
  page_ids = jnp.where(slot_ok, page_ids, 0)
  # Gather [ppb, page_size, D] -> [block_k, D] from this layer, in place in the stack;
  # 8-bit pages are dequantized right after the load, with their [ppb, page_size] scales.
  k, v = (r[seq.layer, page_ids].reshape(seq.block_k, d) for r in kv_refs[:2])
  if len(kv_refs) == 4:
    k, v = (dequantize(x, r[seq.layer, page_ids].reshape(seq.block_k), q.dtype)
            for x, r in zip((k, v), kv_refs[2:]))
  k_pos = blk * seq.block_k + lax.broadcasted_iota(jnp.int32, (seq.block_k,), 0)
  k_ok = k_pos < seq.kv_len
  # A page's tail past kv_len (and page 0 above) may hold NaN. NaN scores are replaced
  # by the mask below, but p = 0 times a NaN value is NaN in p @ v: zero those values.
  v = jnp.where(k_ok[:, None], v, jnp.zeros_like(v))
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32
  scores = _cap(lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale, softcap)
  visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
  # The window's first block may start before some rows' windows: mask those keys (they
  # are real, finite keys of the sequence).
  visible &= (seq.window <= 0) | (k_pos[None, :] > q_pos[:, None] - seq.window)
  scores = jnp.where(visible, scores, _MASK_VALUE)
  m = jnp.maximum(m_prev, scores.max(axis=1))
  p = jnp.where(visible, jnp.exp(scores - m[:, None]), 0.0)
  alpha = jnp.exp(m_prev - m)
  pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                       preferred_element_type=jnp.float32)
  return m, alpha * l_prev + p.sum(axis=1), alpha[:, None] * acc_prev + pv


# -------------------------------------------------------------------------------- wrapper

def paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                    layer=None, sm_scale=None, num_kv_splits=None, pages_per_block=None,
                    num_warps=None, num_stages=None, interpret=None, softcap=0.0,
                    sliding_window=0, k_scale=None, v_scale=None, _block_q=None,
                    _poison=None):
  """Ragged paged attention; returns out [T, Hq, D] in q's dtype.

  q [T, Hq, D]; k_pages, v_pages [P, page_size, Hkv, D], or every layer's cache
  [L, P, page_size, Hkv, D] with `layer` (an int, or an int32 scalar or [1] array, traced
  or not) naming the layer to attend: the kernel reads that layer's pages where they lie
  in the stack, so a model carrying a stacked cache copies no layer out of it (a slice
  is a copy of the layer's whole pool). A traced `layer` must be in [0, L): on GPU an
  index past the stack reads other memory. kv_lens [max_seqs] (cached tokens
  including the new ones, >= that sequence's q_len); page_indices [max_seqs, pages_per_seq];
  cu_q_lens [max_seqs + 1] (non-decreasing up to cu_q_lens[num_seqs] <= T; entries past
  num_seqs, like kv_lens and page_indices rows of dead sequences, are never read);
  num_seqs [1] or [].
  k_scale, v_scale: pages stored 8-bit (int8, float8_e4m3fn or float8_e5m2), each slot's
  kv head a vector of D values times its float32 scale: [P, page_size, Hkv], or
  [L, P, page_size, Hkv] with a stacked cache; the kernel dequantizes a page block into
  q's dtype right after loading it.
  num_kv_splits, pages_per_block: default from the shapes; num_warps, num_stages: Triton
  launch parameters on GPU (default 4 and 2; `benchmarks.paged_decode --tiles` times
  alternatives), ignored when interpreted. softcap > 0: scores soft-capped (Gemma 2), as
  in paged_attention_reference.
  sliding_window: each row sees only its last sliding_window positions (0: the whole
  context), as in paged_attention_reference; an int or an int32 [] / [1] array, traced or
  not, so one compiled kernel serves a model's local and global layers. Each q block's loop
  over page blocks starts at the block of its first query's first visible key: blocks
  wholly before it are never loaded; the keys of that first block before a row's window
  are loaded and masked (they must be finite, as a sequence's kept pages are).
  Rows at or past cu_q_lens[num_seqs] are padding: their output is exactly 0 (even if
  their q is NaN). `_block_q` and `_poison` (a fill value for the per-split outputs before
  the kernel runs, to prove every live element gets written) are for tests.
  """
  ops = _operands(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  layer=layer, sliding_window=sliding_window, k_scale=k_scale,
                  v_scale=v_scale)
  t, hq, d = q.shape
  _, _, page_size, hkv, _ = ops.k_pages.shape
  max_seqs, pages_per_seq = ops.page_indices.shape
  groups = hq // hkv
  padded_groups = pl.next_power_of_2(groups)
  ops = ops._replace(q=_pad_groups(q, hkv, padded_groups))
  if interpret is None:
    interpret = jax.default_backend() == 'cpu'
  ppb = pages_per_block
  if ppb is None:
    ppb = _choose_pages_per_block(page_size, pages_per_seq)
  splits = num_kv_splits
  if splits is None:
    splits = _choose_num_kv_splits(max_seqs, hkv, pages_per_seq * page_size, ppb * page_size,
                                   out_bytes=t * hq * d * 4)
  block_q = _choose_block_q(t, padded_groups) if _block_q is None else _block_q
  _check_tiling(splits, ppb, block_q, interpret, padded_groups, d, page_size)
  kernel = functools.partial(
      _paged_attention_kernel, block_q=block_q, pages_per_block=ppb, num_kv_splits=splits,
      sm_scale=1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale),
      softcap=float(softcap or 0.0), quantized=ops.k_scale is not None)
  o, lse = _call_kernel(kernel, ops, grid=(max_seqs, hkv, splits), poison=_poison,
                        interpret=interpret, gpu_params=(num_warps or 4, num_stages or 2))
  out = _merge_splits(o, lse)
  if padded_groups != groups:
    out = out.reshape(t, hkv, padded_groups, d)[:, :, :groups].reshape(t, hq, d)
  live = jnp.arange(t) < ops.cu_q_lens[ops.num_seqs[0]]
  return jnp.where(live[:, None, None], out, 0).astype(q.dtype)


class _Operands(NamedTuple):
  """The kernel's inputs by name, in the order of _paged_attention_kernel's refs; the
  scales are None for pages not stored 8-bit (and then not passed)."""
  num_seqs: jax.Array       # [1] int32
  layer: jax.Array          # [1] int32
  window: jax.Array         # [1] int32
  kv_lens: jax.Array        # [max_seqs] int32
  cu_q_lens: jax.Array      # [max_seqs + 1] int32
  page_indices: jax.Array   # [max_seqs, pages_per_seq] int32
  q: jax.Array              # [T, Hkv * padded groups, D]
  k_pages: jax.Array        # [L, P, page_size, Hkv, D]
  v_pages: jax.Array        # [L, P, page_size, Hkv, D]
  k_scale: jax.Array | None = None   # [L, P, page_size, Hkv] f32
  v_scale: jax.Array | None = None


def _operands(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, layer,
              sliding_window, k_scale, v_scale) -> _Operands:
  """paged_attention's arguments checked and in the kernel's form: pages (and scales) as
  a stack of layers, layer and window as [1] int32, the index arrays int32."""
  if k_scale is not None and k_pages.ndim == 4 and layer is None:
    k_scale, v_scale = k_scale[None], v_scale[None]
  k_pages, v_pages, layer = _as_stacked(k_pages, v_pages, layer)
  window = _as_window(sliding_window)
  one_layer = lambda x: x if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  _check_args(q, one_layer(k_pages), one_layer(v_pages), kv_lens, page_indices, cu_q_lens,
              one_layer(k_scale), one_layer(v_scale))
  kv_lens, cu_q_lens, page_indices = (
      jnp.asarray(x, jnp.int32) for x in (kv_lens, cu_q_lens, page_indices))
  return _Operands(jnp.asarray(num_seqs, jnp.int32).reshape(1), layer, window, kv_lens,
                   cu_q_lens, page_indices, q, k_pages, v_pages, k_scale, v_scale)


def _pad_groups(q, hkv, padded_groups):
  """q [T, Hq, D] with each kv head's group of q heads padded with zero heads to
  padded_groups: Triton tiles need power-of-2 sizes, and a q block holds a whole head
  group (Qwen2.5-7B has 7); the padding's rows are dropped after."""
  t, hq, d = q.shape
  groups = hq // hkv
  if padded_groups == groups:
    return q
  q = jnp.pad(q.reshape(t, hkv, groups, d),
              ((0, 0), (0, 0), (0, padded_groups - groups), (0, 0)))
  return q.reshape(t, hkv * padded_groups, d)


def _call_kernel(kernel, ops: _Operands, *, grid, poison, interpret, gpu_params):
  """pallas_call over (sequence, kv head, split); returns o [K, T, Hq, D], lse [K, T, Hq]."""
  t, hq, d = ops.q.shape
  num_layers, num_pages, page_size, hkv, _ = ops.k_pages.shape
  groups, splits = hq // hkv, grid[2]
  whole = lambda x: pl.BlockSpec(x.shape, lambda s, h, k: (0,) * x.ndim)
  # Every layer's pages in the block: Triton has no scalar prefetch to put the layer in
  # the index map, so the kernel indexes the layer itself (pointer arithmetic on GPU, no
  # copy; interpret mode, a CPU loop over the programs, copies the stack in).
  pages = pl.BlockSpec((num_layers, num_pages, page_size, None, d),
                       lambda s, h, k: (0, 0, 0, h, 0))
  # 8-bit pages' scales [L, P, page_size, Hkv], this kv head's, like the pages.
  scales = pl.BlockSpec((num_layers, num_pages, page_size, None),
                        lambda s, h, k: (0, 0, 0, h))
  specs = _Operands(
      num_seqs=whole(ops.num_seqs), layer=whole(ops.layer), window=whole(ops.window),
      kv_lens=whole(ops.kv_lens), cu_q_lens=whole(ops.cu_q_lens),
      page_indices=pl.BlockSpec((None, ops.page_indices.shape[1]), lambda s, h, k: (s, 0)),
      q=pl.BlockSpec((t, groups, d), lambda s, h, k: (0, h, 0)),
      k_pages=pages, v_pages=pages, k_scale=scales, v_scale=scales)
  given = [name for name in _Operands._fields if getattr(ops, name) is not None]
  args = [getattr(ops, name) for name in given]
  in_specs = [getattr(specs, name) for name in given]
  out_specs = [pl.BlockSpec((None, t, groups, d), lambda s, h, k: (k, 0, h, 0)),
               pl.BlockSpec((None, t, groups), lambda s, h, k: (k, 0, h))]
  # One split needs no merge, so it writes the final dtype (half the bytes for bf16).
  out_dtype = ops.q.dtype if splits == 1 else jnp.float32
  out_shape = [jax.ShapeDtypeStruct((splits, t, hq, d), out_dtype),
               jax.ShapeDtypeStruct((splits, t, hq), jnp.float32)]
  aliases = {}
  if poison is not None:
    aliases = {len(args): 0, len(args) + 1: 1}
    args += [jnp.full(s.shape, poison, s.dtype) for s in out_shape]
    in_specs += out_specs
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, interpret=interpret, name='ragged_paged_attention',
      compiler_params=_gpu_params(*gpu_params),
  )(*args)


def _merge_splits(o, lse):
  """Combine per-split outputs o [K, T, Hq, D] by their log-sum-exps lse [K, T, Hq]."""
  if o.shape[0] == 1:
    return o[0]
  top = lse.max(axis=0)
  # A row with no keys in any split (padding only) has top = -inf; keep it finite.
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.exp(lse - top)                                              # [K, T, Hq]
  return (w[..., None] * o).sum(axis=0) / jnp.maximum(w.sum(axis=0), 1e-30)[..., None]


# ------------------------------------------------------------------ static choices, checks

def _gpu_params(num_warps, num_stages):
  # The defaults are an untuned starting point for H100; ignored in interpret mode.
  try:
    return _plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  except (NameError, AttributeError):  # pragma: no cover - no Triton namespace
    return None


def _choose_pages_per_block(page_size, pages_per_seq):
  ppb = max(1, _BLOCK_K_TOKENS // page_size)
  return min(ppb, pl.next_power_of_2(pages_per_seq))


def _choose_num_kv_splits(max_seqs, num_kv_heads, max_kv_len, block_k, out_bytes=0):
  """Splits from static shapes: more when few (sequence, kv head) programs face long
  contexts; few when the batch has many tokens (each split holds a float32 copy of out)."""
  programs = max_seqs * num_kv_heads
  # The power of two at or below: the counts the --splits benchmark times (a short
  # context or the outputs' memory may cap it at another count).
  wanted = 1 << (pl.cdiv(_TARGET_PROGRAMS, programs).bit_length() - 1)
  worth = max(1, max_kv_len // max(_MIN_SPLIT_TOKENS, block_k))
  affordable = max(1, _SPLIT_BYTES // max(out_bytes, 1))
  return max(1, min(wanted, worth, affordable, _MAX_SPLITS))


def _choose_block_q(t, groups):
  # A block's q rows are block_q tokens x G heads; decode-only batches need few tokens.
  block_q = min(max(1, _BLOCK_ROWS // groups), pl.next_power_of_2(t))
  return max(block_q, pl.cdiv(_MIN_DOT_ROWS, groups))


def _as_stacked(k_pages, v_pages, layer):
  """Pages as a stack [L, P, page_size, Hkv, D] and the layer to read as [1] int32; one
  layer's pages become a stack of one (a free reshape)."""
  if k_pages.ndim == 4 and layer is None:
    return k_pages[None], v_pages[None], jnp.zeros((1,), jnp.int32)
  if k_pages.ndim != 5 or v_pages.ndim != 5 or layer is None:
    raise ValueError(f'paged_attention: pass k_pages and v_pages as one layer\'s pages '
                     f'[P, page_size, Hkv, D] without layer, or as a stacked cache '
                     f'[L, P, page_size, Hkv, D] with layer=; got k_pages {k_pages.shape}, '
                     f'v_pages {v_pages.shape}, layer={layer!r}.')
  known = _one_integer('layer', layer, '')   # None when traced (the docstring says so)
  if known is not None and not 0 <= known < k_pages.shape[0]:
    raise ValueError(f'paged_attention: layer={known} is outside the stacked cache\'s '
                     f'{k_pages.shape[0]} layers.')
  return k_pages, v_pages, jnp.asarray(layer, jnp.int32).reshape(1)


def _as_window(sliding_window):
  """The sliding window as [1] int32 (0: none); ValueError for a known negative one."""
  known = _one_integer('sliding_window', sliding_window, '; 0: no window')
  if known is not None and known < 0:   # traced: a negative value acts as no window
    raise ValueError(f'paged_attention: sliding_window={known} must be >= 0 (0: the whole '
                     f'context).')
  return jnp.asarray(sliding_window, jnp.int32).reshape(1)


def _one_integer(name: str, value, hint: str) -> int | None:
  """`value`'s integer where it is known at trace time, None where traced; TypeError
  unless it is one integer."""
  if jnp.size(value) != 1 or not jnp.issubdtype(jnp.result_type(value), jnp.integer):
    raise TypeError(f'paged_attention: {name} must be one integer (an int or an int32 '
                    f'[] or [1] array{hint}); got shape {jnp.shape(value)} dtype '
                    f'{jnp.result_type(value)}.')
  try:
    return int(np.asarray(value).reshape(-1)[0])
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def _check_args(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, k_scale=None,
                v_scale=None):
  if q.ndim != 3 or k_pages.ndim != 4:
    raise ValueError(f'paged_attention: q must be [T, Hq, D] and k_pages '
                     f'[P, page_size, Hkv, D]; got q {q.shape}, k_pages {k_pages.shape}.')
  if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
    raise ValueError(f'paged_attention: k_pages {k_pages.shape} {k_pages.dtype} and v_pages '
                     f'{v_pages.shape} {v_pages.dtype} must match.')
  if q.shape[2] != k_pages.shape[3]:
    raise ValueError(f'paged_attention: head_dim of q ({q.shape[2]}) != head_dim of pages '
                     f'({k_pages.shape[3]}).')
  if q.shape[1] % k_pages.shape[2]:
    raise ValueError(f'paged_attention: q heads ({q.shape[1]}) must be a multiple of kv '
                     f'heads ({k_pages.shape[2]}).')
  if k_scale is not None or v_scale is not None:
    _check_scales(k_pages, k_scale, v_scale)
  elif not jnp.issubdtype(k_pages.dtype, jnp.floating):
    raise TypeError(f'paged_attention: pages of dtype {k_pages.dtype} need k_scale and '
                    'v_scale (8-bit pages); unscaled pages must be floating.')
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f'paged_attention: q must be floating; got {q.dtype}.')
  _check_int_arrays(kv_lens, page_indices, cu_q_lens)


QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)


def _check_scales(k_pages, k_scale, v_scale):
  if k_scale is None or v_scale is None:
    raise ValueError('paged_attention: give both k_scale and v_scale, or neither.')
  if k_pages.dtype not in QUANTIZED_DTYPES:
    raise TypeError(f'paged_attention: scaled pages must be 8-bit '
                    f'({", ".join(jnp.dtype(d).name for d in QUANTIZED_DTYPES)}); got '
                    f'{k_pages.dtype}.')
  for name, s in (('k_scale', k_scale), ('v_scale', v_scale)):
    if s.shape != k_pages.shape[:-1] or s.dtype != jnp.float32:
      raise ValueError(f'paged_attention: {name} must be float32 {k_pages.shape[:-1]} (one '
                       f'per page slot and kv head); got {s.dtype} {s.shape}.')


def _check_int_arrays(kv_lens, page_indices, cu_q_lens):
  for name, x, ndim in (('kv_lens', kv_lens, 1), ('page_indices', page_indices, 2),
                        ('cu_q_lens', cu_q_lens, 1)):
    if jnp.ndim(x) != ndim or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise TypeError(f'paged_attention: {name} must be a rank-{ndim} integer array; got '
                      f'shape {jnp.shape(x)} dtype {jnp.result_type(x)}.')
  max_seqs = page_indices.shape[0]
  if kv_lens.shape != (max_seqs,) or cu_q_lens.shape != (max_seqs + 1,):
    raise ValueError(f'paged_attention: with page_indices {page_indices.shape}, kv_lens must '
                     f'be [{max_seqs}] and cu_q_lens [{max_seqs + 1}]; got {kv_lens.shape}, '
                     f'{cu_q_lens.shape}.')


def _check_tiling(splits, ppb, block_q, interpret, groups, d, page_size):
  if min(splits, ppb, block_q) < 1:
    raise ValueError(f'paged_attention: num_kv_splits={splits}, pages_per_block={ppb} and '
                     f'block_q={block_q} must be >= 1.')
  if interpret:
    return
  # Triton tensors need power-of-2 sizes, and tl.dot needs every dimension >= 16.
  for name, n in (('block_q * q heads per kv head (rounded up to 2^n)', groups * block_q),
                  ('head_dim', d), ('page_size * pages_per_block', page_size * ppb)):
    if n & (n - 1) or n < _MIN_DOT_ROWS:
      raise ValueError(f'paged_attention on GPU (Triton): {name} = {n} must be a power of 2 '
                       f'and >= {_MIN_DOT_ROWS}.')
