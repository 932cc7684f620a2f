"""Which blocks packed documents need: the block skipping behind segment ids.

Every flash-attention kernel (flash_attention.py's portable ones, flash_attention_mgpu's
Hopper ones) walks, for each block of its own rows, a range of blocks of the other side.
With segment ids a row only sees keys of its own document, so of that range only the
blocks that hold one of the row block's documents are needed: for packed sequences of
short documents that is a small part of the causal triangle. And of those blocks, the
ones whose rows and columns all hold one document need no segment mask. Both ranges are
computed here, outside the kernels, in a few vectorized ops; each program reads its own.
"""

import jax.numpy as jnp


def document_block_ranges(rows_seg, cols_seg, block_rows, block_cols):
  """[B, rows / block_rows, 4] int32: for each block of rows (lo, hi, same_lo, same_hi).

  [lo, hi): the column blocks whose segment-id range meets the rows' own; (0, 0) when
  none does. A block outside it shares no id with the rows, so every pair there is
  masked and the kernels skip it. Sound for any ids (only blocks whose [min, max] id
  ranges are disjoint are left out), exact for packed (sorted) ids.

  [same_lo, same_hi): a run of column blocks in which every row and every column holds
  one and the same id, so no pair needs the segment mask (the Mosaic GPU kernels walk it
  unmasked where causality allows); empty (0, 0) when there is none. For packed ids it
  is all such blocks; for others the first run of them."""
  def block_min_max(seg, block):
    seg = seg.reshape(seg.shape[0], -1, block)
    return seg.min(axis=-1), seg.max(axis=-1)
  r_min, r_max = block_min_max(rows_seg, block_rows)
  c_min, c_max = block_min_max(cols_seg, block_cols)
  r_min, r_max, c_min, c_max = (r_min[:, :, None], r_max[:, :, None], c_min[:, None, :],
                                c_max[:, None, :])  # [B, row blocks, col blocks]
  meets = (c_max >= r_min) & (c_min <= r_max)
  same = (r_min == r_max) & (c_min == c_max) & (c_min == r_min)
  num_cols = meets.shape[-1]
  cols = jnp.arange(num_cols)
  lo = jnp.argmax(meets, axis=-1)
  hi = num_cols - jnp.argmax(meets[..., ::-1], axis=-1)
  same_lo = jnp.argmax(same, axis=-1)
  past = ~same & (cols >= same_lo[..., None])  # the first block after same_lo that is not
  same_hi = jnp.where(past.any(axis=-1), jnp.argmax(past, axis=-1), num_cols)
  ranges = [(lo, hi, meets), (same_lo, same_hi, same)]
  return jnp.stack([jnp.where(found.any(axis=-1), x, 0) for a, b, found in ranges
                    for x in (a, b)], axis=-1).astype(jnp.int32)
