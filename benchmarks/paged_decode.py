"""Decode attention bandwidth of the ragged paged kernel vs the device's copy bandwidth.

  python -m benchmarks.paged_decode           # GPU: batch x context 8x4K .. 256x8K
  python -m benchmarks.paged_decode --smoke   # CPU: tiny shapes, interpret mode
  python -m benchmarks.paged_decode --tiles   # GPU: the kernel's tile choices side by side

One query token per sequence, 32 query / 8 KV heads, head_dim 128, bf16, pages of 16
tokens scattered randomly over the pool. Bandwidth = KV bytes read / time; the
reference is a device-to-device copy measured in the same run ((read + write) / time).
Target: >= 75% of the copy bandwidth. Writes benchmarks/results/paged_decode_<device>.json.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_time, write_result
from pallas_kernels.paged_attention import paged_attention


def copy_bandwidth(num_bytes: int, iters: int) -> float:
  x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
  seconds = median_time(jax.jit(lambda x: x + jnp.ones((), x.dtype)), x, iters=iters,
                        inner=4)
  return 2 * num_bytes / seconds


def decode_inputs(batch, context, hq, hkv, d, page, dtype, seed=0):
  rng = np.random.default_rng(seed)
  pages_per_seq = context // page
  num_pages = batch * pages_per_seq
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (batch, hq, d), dtype)
  k_pages = jax.random.normal(keys[1], (num_pages, page, hkv, d), dtype)
  v_pages = jax.random.normal(keys[2], (num_pages, page, hkv, d), dtype)
  page_indices = rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32)
  kv_lens = np.full((batch,), context, np.int32)
  cu_q_lens = np.arange(batch + 1, dtype=np.int32)
  num_seqs = np.array([batch], np.int32)
  return q, k_pages, v_pages, jnp.asarray(kv_lens), jnp.asarray(page_indices), \
      jnp.asarray(cu_q_lens), jnp.asarray(num_seqs)


# (pages_per_block, num_warps, num_stages); the first is the default at pages of 16.
TILES = [(4, 4, 2), (4, 4, 3), (4, 8, 2), (8, 4, 2), (8, 8, 2), (8, 4, 3), (2, 4, 3)]
TILE_NAMES = ('pages_per_block', 'num_warps', 'num_stages')


def run_case(batch, context, hq, hkv, d, page, dtype, iters, **kernel_kwargs) -> dict:
  args = decode_inputs(batch, context, hq, hkv, d, page, dtype)
  kv_bytes = 2 * batch * context * hkv * d * jnp.dtype(dtype).itemsize
  row = {'batch': batch, 'context': context, 'q_heads': hq, 'kv_heads': hkv, 'head_dim': d,
         'page_size': page, 'dtype': jnp.dtype(dtype).name, 'kv_bytes': kv_bytes}
  kernel = jax.jit(functools.partial(paged_attention, **kernel_kwargs))
  seconds = median_time(kernel, *args, iters=iters, inner=20)
  row.update(time_us=seconds * 1e6, bandwidth_gbs=kv_bytes / seconds / 1e9)
  return row


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--smoke', action='store_true', help='tiny CPU run; writes nothing')
  parser.add_argument('--iters', type=int, default=50)
  parser.add_argument('--tiles', action='store_true',
                      help='time each tile choice in TILES at 8x4K, 64x8K and 256x8K')
  args = parser.parse_args(argv)
  if args.smoke:
    cases, shape, iters = [(2, 64), (3, 32)], (4, 2, 16, 8, jnp.float32), 1
    tiles = [(2, 4, 2)]
  else:
    cases = [(b, c) for c in (4096, 8192) for b in (8, 32, 64, 128, 256)]
    shape, iters, tiles = (32, 8, 128, 16, jnp.bfloat16), args.iters, TILES
  if args.tiles:
    cases = cases[:1] if args.smoke else [(8, 4096), (64, 8192), (256, 8192)]
  else:
    tiles = [()]   # the defaults
  copy_gbs = copy_bandwidth(2**30 if not args.smoke else 2**20, iters) / 1e9
  rows = []
  for tile in tiles:
    kwargs = dict(zip(TILE_NAMES, tile))
    for b, c in cases:
      rows.append({**run_case(b, c, *shape, iters, **kwargs), 'tiles': kwargs})
  print(f'device-to-device copy: {copy_gbs:.0f} GB/s')
  print(f"{'tiles (ppb warps stages)':26}{'batch':>6}{'context':>9}{'us':>10}{'GB/s':>9}"
        f"{'of copy':>9}")
  for r in rows:
    r['fraction_of_copy'] = r['bandwidth_gbs'] / copy_gbs
    label = ' '.join(str(v) for v in r['tiles'].values()) or 'default'
    print(f"{label:26}{r['batch']:>6}{r['context']:>9}{r['time_us']:>10.1f}"
          f"{r['bandwidth_gbs']:>9.0f}{r['fraction_of_copy']:>9.2f}")
  if not args.smoke:
    name = 'paged_decode_tiles' if args.tiles else 'paged_decode'
    print(write_result(f'{name}_{jax.devices()[0].device_kind.replace(" ", "_")}',
                       {'copy_bandwidth_gbs': copy_gbs, 'rows': rows}))
  return rows

if __name__ == '__main__':
  main()
