"""Which blocks packed documents need: the block skipping behind segment ids.

Every flash-attention kernel (flash_attention.py's portable ones, flash_attention_mgpu's
Hopper ones) walks, for each block of its own rows, a range of blocks of the other side.
With segment ids a row only sees keys of its own document, so of that range only the
blocks that hold one of the row block's documents are needed: for packed sequences of
short documents that is a small part of the causal triangle. The ranges are computed here,
outside the kernels, in a few vectorized ops; each program reads its [lo, hi) pair.
"""

import jax.numpy as jnp


def document_block_ranges(rows_seg, cols_seg, block_rows, block_cols):
  """[B, rows / block_rows, 2] int32: for each block of rows, the [lo, hi) of column
  blocks whose segment-id range meets the rows' own; (0, 0) when none does.

  A block outside that range shares no id with the rows, so every pair there is masked
  and the kernels skip it. Exact for packed (sorted) ids, conservative for any others:
  only blocks whose [min, max] id ranges are disjoint are ever left out."""
  def block_min_max(seg, block):
    seg = seg.reshape(seg.shape[0], -1, block)
    return seg.min(axis=-1), seg.max(axis=-1)
  r_min, r_max = block_min_max(rows_seg, block_rows)
  c_min, c_max = block_min_max(cols_seg, block_cols)
  meets = ((c_max[:, None, :] >= r_min[:, :, None])
           & (c_min[:, None, :] <= r_max[:, :, None]))  # [B, row blocks, col blocks]
  num_cols = meets.shape[-1]
  lo = jnp.argmax(meets, axis=-1)
  hi = num_cols - jnp.argmax(meets[..., ::-1], axis=-1)
  seen = meets.any(axis=-1)
  return jnp.stack([jnp.where(seen, lo, 0), jnp.where(seen, hi, 0)], -1).astype(jnp.int32)
