"""Decode attention bandwidth of the ragged paged kernel vs the device's copy bandwidth.

  python -m benchmarks.paged_decode           # GPU: batch x context 8x4K .. 256x8K
  python -m benchmarks.paged_decode --smoke   # CPU: tiny shapes, interpret mode
  python -m benchmarks.paged_decode --tiles   # GPU: the kernel's tile choices side by side
  python -m benchmarks.paged_decode --splits  # GPU: KV splits per sequence at few sequences
  python -m benchmarks.paged_decode --step    # GPU: a model's decode step at a full cache
  python -m benchmarks.paged_decode --step --smoke   # CPU: a tiny model, interpret mode

One query token per sequence, 32 query / 8 KV heads, head_dim 128, bf16, pages of 16
tokens scattered randomly over the pool. Bandwidth = KV bytes read / time; the
reference is a device-to-device copy measured in the same run ((read + write) / time).
Target: >= 75% of the copy bandwidth. Writes benchmarks/results/paged_decode_<device>.json.

--step: model.paged's decode step of a Llama-3.2-1B-shaped model (random bf16 weights,
its layers unrolled as the serving runner holds them) with every page of its stacked
cache in use, the kernel reading each layer in place (`stacked`) against each layer
sliced out first (`sliced`, a copy of its pool). From the compiled step: values of one
layer's pool shape (slices), copies of the whole cache, kernel calls given the whole
cache, temp bytes; then the step's median time, the cache donated as the runner does.
On CPU (--smoke) the counts differ from a GPU's: interpret mode runs the kernel as a
loop that carries its inputs, copying the cache.
Writes benchmarks/results/paged_step_<device>.json.

--splits: at 1 to 32 sequences, each number of KV splits per (sequence, kv head) in SPLITS
under each tile choice in SPLIT_TILES, and the default's choice; every output is compared
with one split's (a wrong merge shows as max_abs_diff). Writes
benchmarks/results/paged_decode_splits_<device>.json.
"""

import argparse
import contextlib
import functools
import re
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import model
from benchmarks.common import median_time, write_result
from model import paged
from model.config import ModelConfig
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


def run_case(batch, context, hq, hkv, d, page, dtype, iters, args=None, kernel=None,
             **kernel_kwargs) -> dict:
  args = args or decode_inputs(batch, context, hq, hkv, d, page, dtype)
  kv_bytes = 2 * batch * context * hkv * d * jnp.dtype(dtype).itemsize
  row = {'batch': batch, 'context': context, 'q_heads': hq, 'kv_heads': hkv, 'head_dim': d,
         'page_size': page, 'dtype': jnp.dtype(dtype).name, 'kv_bytes': kv_bytes}
  kernel = kernel or jax.jit(functools.partial(paged_attention, **kernel_kwargs))
  seconds = median_time(kernel, *args, iters=iters, inner=20)
  row.update(time_us=seconds * 1e6, bandwidth_gbs=kv_bytes / seconds / 1e9)
  return row


# --splits: (sequences, context) from one long request to where the default already
# fills the GPU; splits per (sequence, kv head); (pages_per_block, num_warps, num_stages).
SPLIT_CASES = [(1, 32768), (4, 8192), (8, 4096), (8, 8192), (16, 8192), (32, 4096)]
SPLITS = (1, 2, 4, 8, 16, 32, 64)
SPLIT_TILES = [(4, 4, 2), (8, 4, 3)]


def run_splits(cases, splits, tiles, shape, iters) -> list[dict]:
  """Each case under each (splits, tiles) and the default; max_abs_diff against the
  output of one split with the same tiles."""
  rows = []
  for b, c in cases:
    args = decode_inputs(b, c, *shape)
    for tile in tiles:
      kwargs = dict(zip(TILE_NAMES, tile))
      ref = np.asarray(jax.jit(functools.partial(
          paged_attention, num_kv_splits=1, **kwargs))(*args), np.float32)
      for k in (None, *splits):
        kernel = jax.jit(functools.partial(paged_attention, num_kv_splits=k, **kwargs))
        diff = float(np.abs(np.asarray(kernel(*args), np.float32) - ref).max())
        row = run_case(b, c, *shape, iters, args=args, kernel=kernel)
        rows.append({**row, 'tiles': kwargs, 'num_kv_splits': k or 'default',
                     'max_abs_diff': diff})
        print(f"{' '.join(map(str, tile)):10}{b:>6}{c:>7}{str(k or 'default'):>9}"
              f"{row['time_us']:>10.1f}{row['bandwidth_gbs']:>9.0f}{diff:>10.2e}",
              flush=True)
  return rows


# --step: Llama-3.2-1B's shape; 64 sequences of 8K tokens in pages of 16 fill the cache
# (2 x 16 layers x 32768 pages x 16 x 8 x 64 x 2 bytes = 17.2 GB).
STEP_MODEL = dict(vocab_size=128256, num_layers=16, embed_dim=2048, num_heads=32,
                  num_kv_heads=8, mlp_dim=8192, max_seq_len=8192, dtype='bfloat16',
                  param_dtype='bfloat16')
STEP_SHAPE = (64, 8192, 16)   # sequences, context, page size
SMOKE_STEP_MODEL = dict(vocab_size=320, num_layers=2, embed_dim=64, num_heads=4,
                        num_kv_heads=2, max_seq_len=64)
SMOKE_STEP_SHAPE = (3, 32, 4)


def _sliced_layer_pages(cache, index, batch, impl):
  """The old model.paged way, for comparison: the layer sliced out of the stack (a copy
  of its pool) and handed to the kernel as a stack of one."""
  del impl
  meta = (batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs)
  return cache[0][index][None], cache[1][index][None], meta + (jnp.zeros((1,), jnp.int32),)


STEP_VARIANTS = {'stacked': contextlib.nullcontext,
                 'sliced': lambda: mock.patch.object(paged, 'layer_pages', _sliced_layer_pages)}


def decode_batch(cfg, batch, context, page) -> paged.PagedBatch:
  """One decode token per sequence at position context - 1; the sequences own every page
  of the pool, scattered at random."""
  pages_per_seq = context // page
  table = np.random.default_rng(0).permutation(batch * pages_per_seq)
  table = table.reshape(batch, pages_per_seq).astype(np.int32)
  seqs = np.arange(batch, dtype=np.int32)
  return jax.device_put(paged.PagedBatch(
      tokens=seqs % cfg.vocab_size, positions=np.full(batch, context - 1, np.int32),
      slots=table[:, -1] * page + (context - 1) % page,
      kv_lens=np.full(batch, context, np.int32), page_indices=table,
      cu_q_lens=np.arange(batch + 1, dtype=np.int32),
      num_seqs=np.array([batch], np.int32), sample_rows=seqs))


# name = type opcode(operands): the type an array (layout dropped) or a tuple.
_HLO_LINE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*(\(.*?\)|\w+\[[\d,]*\])\S*\s+'
                       r'([\w-]+)\(([^)]*)\)')
_FREE = ('parameter', 'get-tuple-element', 'tuple', 'bitcast')
_KERNEL = ('ragged_paged_attention', '__gpu$xla.gpu.triton')


def cache_traffic(hlo: str, cache_shape, dtype) -> dict:
  """Counts in a step's HLO text. Outside fused computations: values of one layer's pool
  shape ([P, page, Hkv, D], or with a leading 1) that are not free views (each a slice
  of the cache), and copies of the whole cache. Anywhere (XLA may wrap a custom call in
  a fusion that hands it a slice by address): the kernel's custom calls, and those whose
  operands include the whole cache twice (K and V)."""
  name = jnp.dtype(dtype).name.replace('float', 'f')   # bfloat16 -> bf16, float32 -> f32
  dims = lambda shape: f"{name}[{','.join(map(str, shape))}]"
  whole, layer = dims(cache_shape), (dims(cache_shape[1:]), dims((1, *cache_shape[1:])))
  fused = set(re.findall(r'\bfusion\(.*?calls=%?([\w.-]+)', hlo))
  counts = dict(layer_slices=0, cache_copies=0, kernel_calls=0, kernel_calls_on_whole_cache=0)
  types, skip = {}, False
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith('{'):
      skip = line.split()[0].lstrip('%') in fused   # a computation starts (or ENTRY)
    m = _HLO_LINE.match(line)
    if not m:
      continue
    value_name, value, op, operands = m.groups()
    types[value_name] = value
    if op == 'custom-call' and any(k in line for k in _KERNEL):
      operand_types = [types.get(x.split()[-1].lstrip('%')) for x in operands.split(',')]
      counts['kernel_calls'] += 1
      counts['kernel_calls_on_whole_cache'] += operand_types.count(whole) == 2
    if not skip:
      counts['layer_slices'] += value in layer and op not in _FREE
      counts['cache_copies'] += value == whole and op in ('copy', 'copy-start')
  return counts


def _time_donated(step, params, cache, batch, iters, warmup=3):
  """Median seconds of a step; its cache threads through, donated, as in the runner."""
  times = []
  for i in range(warmup + iters):
    start = time.perf_counter()
    logits, cache = step(params, cache, batch)
    jax.block_until_ready(logits)
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return statistics.median(times), cache


def run_step(smoke: bool, iters: int) -> list[dict]:
  cfg = ModelConfig(**(SMOKE_STEP_MODEL if smoke else STEP_MODEL))
  batch_size, context, page = SMOKE_STEP_SHAPE if smoke else STEP_SHAPE
  params = paged.unstack_layers(model.init_params(cfg, jax.random.key(0)), cfg)
  batch = decode_batch(cfg, batch_size, context, page)
  cache = paged.init_kv_cache(cfg, batch_size * context // page, page)
  rows = []
  for variant, patch in STEP_VARIANTS.items():
    # A jit of its own per variant: jit caches its trace, which would skip the patch.
    step = jax.jit(functools.partial(paged.sampled_logits, cfg=cfg, impl='pallas'),
                   donate_argnums=1)
    with patch():
      compiled = step.lower(params, cache, batch).compile()
    seconds, cache = _time_donated(compiled, params, cache, batch, iters)
    rows.append({'variant': variant, 'batch': batch_size, 'context': context,
                 'page_size': page, 'layers': cfg.num_layers, 'dtype': cfg.dtype,
                 'cache_bytes': 2 * cache[0].nbytes, 'step_ms': seconds * 1e3,
                 'temp_bytes': compiled.memory_analysis().temp_size_in_bytes,
                 **cache_traffic(compiled.as_text(), cache[0].shape, cfg.dtype)})
  return rows


def main_step(args) -> list[dict]:
  rows = run_step(args.smoke, 1 if args.smoke else args.iters)
  print(f"{'variant':9}{'layers':>7}{'cache GB':>9}{'step ms':>9}{'temp MB':>9}"
        f"{'slices':>7}{'copies':>7}{'kernels':>8}{'on whole':>9}")
  for r in rows:
    print(f"{r['variant']:9}{r['layers']:>7}{r['cache_bytes'] / 1e9:>9.2f}{r['step_ms']:>9.2f}"
          f"{r['temp_bytes'] / 1e6:>9.1f}{r['layer_slices']:>7}{r['cache_copies']:>7}"
          f"{r['kernel_calls']:>8}{r['kernel_calls_on_whole_cache']:>9}")
  if not args.smoke:
    print(write_result(f'paged_step_{jax.devices()[0].device_kind.replace(" ", "_")}',
                       {'model': STEP_MODEL, 'rows': rows}))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--smoke', action='store_true', help='tiny CPU run; writes nothing')
  parser.add_argument('--iters', type=int, default=50)
  parser.add_argument('--tiles', action='store_true',
                      help='time each tile choice in TILES at 8x4K, 64x8K and 256x8K')
  parser.add_argument('--step', action='store_true',
                      help="model.paged's decode step at a full cache: the kernel on the "
                           'stacked cache vs a layer sliced out first')
  parser.add_argument('--splits', action='store_true',
                      help='time each number of KV splits (SPLITS) at 1 to 32 sequences')
  args = parser.parse_args(argv)
  if args.step:
    return main_step(args)
  if args.splits:
    return main_splits(args)
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

def main_splits(args) -> list[dict]:
  if args.smoke:
    cases, splits, tiles = [(1, 64), (2, 32)], (1, 2, 4), [(2, 4, 2)]
    shape, iters = (4, 2, 16, 8, jnp.float32), 1
  else:
    cases, splits, tiles = SPLIT_CASES, SPLITS, SPLIT_TILES
    shape, iters = (32, 8, 128, 16, jnp.bfloat16), args.iters
  copy_gbs = copy_bandwidth(2**30 if not args.smoke else 2**20, iters) / 1e9
  print(f'device-to-device copy: {copy_gbs:.0f} GB/s')
  print(f"{'tiles':10}{'batch':>6}{'context':>7}{'splits':>9}{'us':>10}{'GB/s':>9}"
        f"{'max diff':>10}")
  rows = run_splits(cases, splits, tiles, shape, iters)
  for r in rows:
    r['fraction_of_copy'] = r['bandwidth_gbs'] / copy_gbs
  best = {}
  for r in rows:
    key = (r['batch'], r['context'])
    if key not in best or r['time_us'] < best[key]['time_us']:
      best[key] = r
  print('fastest per case (tiles, splits, fraction of copy):')
  for (b, c), r in best.items():
    print(f"  {b:>3} x {c:>6}: {r['tiles']} splits={r['num_kv_splits']} "
          f"{r['fraction_of_copy']:.2f}")
  if not args.smoke:
    print(write_result(f'paged_decode_splits_{jax.devices()[0].device_kind.replace(" ", "_")}',
                       {'copy_bandwidth_gbs': copy_gbs, 'rows': rows}))
  return rows


if __name__ == '__main__':
  main()
