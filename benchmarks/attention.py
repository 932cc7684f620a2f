"""Causal attention forward and backward TFLOP/s: our Pallas kernels vs cuDNN vs XLA.

`pallas` is the portable kernel set (Triton lowering); `pallas_mosaic` runs the Mosaic GPU
Hopper kernels (flash_attention_mgpu), forward and backward; `pallas_mosaic_fused` the same
forward with the one-kernel backward (dQ by TMA reduce-add). `tokamax_mosaic` and
`tokamax_triton` are tokamax's flash attention (the Pallas kernel library MaxText uses),
timed when tokamax is installed: a second anchor beside cuDNN (the GPU image lacks it:
benchmarks/gpu_wheels.sh --tokamax fetches its wheels).

  python -m benchmarks.attention            # GPU: 8K, 16K, 64K tokens; MHA and GQA 32/8
  python -m benchmarks.attention --impls=pallas_mosaic,xla   # some implementations only
  python -m benchmarks.attention --smoke    # CPU: tiny shapes, interpret mode (no timing claims)
  python -m benchmarks.attention --tiles    # GPU: our kernel's tile choices at 8K, side by side
  python -m benchmarks.attention --packed   # GPU: 8K rows packed with documents of 8K/2K/512

bf16, head_dim 128, 64K tokens per batch (batch = 65536 / seq_len). FLOPs count the
causal half only: forward 4*B*T*T*Hq*D/2, backward 2.5x that. Writes
benchmarks/results/attention_<device>.json and prints a table with ratios to cuDNN
(targets: forward >= 0.9x, backward >= 0.85x).

--packed times our kernels on 8K-token rows holding documents of 8192, 2048 and 512
tokens (segment ids). The kernels skip blocks of other documents, so the time should fall
with the document length; `useful TF/s` counts each document's own causal FLOPs, and
`vs one doc` is the time of the one-document row over this one (T / doc_len at best).
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.common import median_time, write_result
from pallas_kernels.flash_attention import flash_attention

TOKENS = 65_536


def implementations(smoke: bool) -> dict:
  """The timed implementations, cuDNN (the reference) first and XLA last: a run that
  stops part way still has the ratios of what it timed."""
  impls = {}
  if not smoke:
    impls['cudnn'] = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                       implementation='cudnn')
  impls['pallas'] = functools.partial(flash_attention, causal=True, backend='triton')
  if not smoke:
    impls['pallas_mosaic'] = functools.partial(flash_attention, causal=True,
                                               backend='mosaic_gpu')
    impls['pallas_mosaic_fused'] = functools.partial(
        flash_attention, causal=True, backend='mosaic_gpu', backend_bwd='mosaic_gpu_fused')
    impls.update(tokamax_implementations())
  impls['xla'] = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                   implementation='xla')
  return impls


def tokamax_implementations() -> dict:
  """tokamax's Mosaic GPU and Triton flash attention, if it imports (it needs jax >= 0.11
  and Python >= 3.12); none otherwise. Same [B, T, N, H] layout and GQA as ours."""
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except Exception as e:  # pylint: disable=broad-except
    print(f'tokamax not timed: {type(e).__name__}: {e}')
    return {}
  return {f'tokamax_{impl}': functools.partial(tokamax.dot_product_attention, is_causal=True,
                                               implementation=impl)
          for impl in ('mosaic', 'triton')}


def inputs(key, b, t, hq, hkv, d, dtype):
  kq, kk, kv, kg = jax.random.split(key, 4)
  return (jax.random.normal(kq, (b, t, hq, d), dtype), jax.random.normal(kk, (b, t, hkv, d), dtype),
          jax.random.normal(kv, (b, t, hkv, d), dtype), jax.random.normal(kg, (b, t, hq, d), dtype))


def measure(fn, q, k, v, do, iters) -> tuple[float, float]:
  """(forward seconds, backward-only seconds)."""
  fwd = jax.jit(fn)
  fwd_s = median_time(fwd, q, k, v, iters=iters)
  _, vjp = jax.vjp(fn, q, k, v)
  bwd = jax.jit(lambda vjp, do: vjp(do))
  bwd_s = median_time(bwd, vjp, do, iters=iters)
  return fwd_s, bwd_s


def forward_error(fn, q, k, v, rows=256) -> float:
  """Relative error of fn's output on the last `rows` queries (those that see every key)
  against a float32 XLA reference at HIGHEST precision: a timed kernel must be right."""
  rows = min(rows, q.shape[1])
  out = jax.jit(fn)(q, k, v)[:, -rows:].astype(jnp.float32)
  f32 = lambda x: x.astype(jnp.float32)
  group = q.shape[2] // k.shape[2]
  kk, vv = (jnp.repeat(f32(x), group, axis=2) for x in (k, v))
  scores = jnp.einsum('bqhd,bkhd->bhqk', f32(q[:, -rows:]), kk,
                      precision=jax.lax.Precision.HIGHEST) / q.shape[-1] ** 0.5
  t = k.shape[1]
  causal = jnp.arange(t - rows, t)[:, None] >= jnp.arange(t)[None, :]
  probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  ref = jnp.einsum('bhqk,bkhd->bqhd', probs, vv, precision=jax.lax.Precision.HIGHEST)
  return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def run_case(impls, b, t, hq, hkv, d, dtype, iters) -> list[dict]:
  q, k, v, do = inputs(jax.random.key(t + hkv), b, t, hq, hkv, d, dtype)
  fwd_flops = 4 * b * t * t * hq * d / 2
  rows = []
  for name, fn in impls.items():
    row = {'impl': name, 'batch': b, 'seq_len': t, 'q_heads': hq, 'kv_heads': hkv,
           'head_dim': d, 'dtype': jnp.dtype(dtype).name}
    try:
      row['fwd_rel_err'] = forward_error(fn, q, k, v)
      fwd_s, bwd_s = measure(fn, q, k, v, do, iters)
      row.update(fwd_ms=fwd_s * 1e3, bwd_ms=bwd_s * 1e3, fwd_tflops=fwd_flops / fwd_s / 1e12,
                 bwd_tflops=2.5 * fwd_flops / bwd_s / 1e12)
    except Exception as e:  # pylint: disable=broad-except
      row['error'] = f'{type(e).__name__}: {str(e)[:200]}'   # e.g. XLA out of memory at 64K
    rows.append(row)
  return rows


# (block_q, block_k, block_q_bwd, block_k_bwd, num_warps, num_stages). The first is the
# default at head_dim 128. Each fits sm_90's shared memory; three stages or four warps
# spill a little in dk/dv (tests/test_kernel_resources.py, benchmarks.kernel_resources).
TILES = [(128, 64, 64, 64, 8, 2), (128, 64, 64, 64, 8, 3), (128, 128, 64, 64, 8, 2),
         (128, 128, 64, 64, 8, 3), (128, 64, 128, 64, 8, 2), (128, 128, 128, 64, 8, 2),
         (64, 64, 64, 64, 4, 2), (64, 128, 64, 64, 4, 2)]
TILE_NAMES = ('block_q', 'block_k', 'block_q_bwd', 'block_k_bwd', 'num_warps', 'num_stages')
# The Mosaic GPU kernels' tiles: the forward's (block_k, num_stages), the first its
# default at head_dim 128, then the backward's (block_q_bwd, block_k_bwd) steps.
MOSAIC_TILES = ([dict(block_k=bk, num_stages=n)
                 for bk, n in [(128, 2), (64, 2), (64, 3), (64, 4), (128, 1), (192, 1)]] +
                [dict(block_q_bwd=bq, block_k_bwd=bk) for bq, bk in [(64, 128), (128, 64)]])


def run_tiles(tiles, b, t, hq, hkv, d, dtype, iters) -> list[dict]:
  """Our kernel alone under each tile choice; the table shows which to make the default."""
  rows = []
  for tile in tiles:
    kwargs = dict(zip(TILE_NAMES, tile))
    impl = {'pallas': functools.partial(flash_attention, causal=True, **kwargs)}
    for row in run_case(impl, b, t, hq, hkv, d, dtype, iters):
      rows.append({**row, 'tiles': kwargs})
  return rows


def run_mosaic_tiles(tiles, b, t, hq, hkv, d, dtype, iters) -> list[dict]:
  rows = []
  for kwargs in tiles:
    impl = {'pallas_mosaic': functools.partial(flash_attention, causal=True,
                                               backend='mosaic_gpu', **kwargs)}
    for row in run_case(impl, b, t, hq, hkv, d, dtype, iters):
      rows.append({**row, 'tiles': kwargs})
  return rows


def add_ratios(rows):
  cudnn = {(r['seq_len'], r['kv_heads']): r for r in rows if r['impl'] == 'cudnn'}
  for r in rows:
    ref = cudnn.get((r['seq_len'], r['kv_heads']))
    if ref and 'error' not in r and 'error' not in ref:
      r['fwd_vs_cudnn'] = r['fwd_tflops'] / ref['fwd_tflops']
      r['bwd_vs_cudnn'] = r['bwd_tflops'] / ref['bwd_tflops']


def print_table(rows, header=True, flush=False):
  if header:
    print(f"{'impl':20}{'T':>7}{'Hkv':>5}{'fwd TF/s':>10}{'bwd TF/s':>10}"
          f"{'fwd/cuDNN':>11}{'bwd/cuDNN':>11}{'fwd err':>10}")
  for r in rows:
    if 'error' in r:
      print(f"{r['impl']:20}{r['seq_len']:>7}{r['kv_heads']:>5}  {r['error'][:60]}",
            flush=flush)
      continue
    ratios = ''.join(f"{r[k]:>11.2f}" if k in r else f"{'':>11}"
                     for k in ('fwd_vs_cudnn', 'bwd_vs_cudnn'))
    err = f"{r['fwd_rel_err']:>10.1e}" if 'fwd_rel_err' in r else ''
    print(f"{r['impl']:20}{r['seq_len']:>7}{r['kv_heads']:>5}{r['fwd_tflops']:>10.1f}"
          f"{r['bwd_tflops']:>10.1f}{ratios}{err}", flush=flush)


DOC_LENS = (8192, 2048, 512)


def run_packed(impls, b, t, hq, hkv, d, dtype, iters, doc_lens) -> list[dict]:
  """Each impl on rows packed with documents of each length in doc_lens."""
  q, k, v, do = inputs(jax.random.key(t), b, t, hq, hkv, d, dtype)
  assert doc_lens[0] == t, 'the first row, one document, is the baseline'
  rows = []
  for name, fn in impls.items():
    base = None
    for doc_len in doc_lens:
      seg = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // doc_len, (b, t))
      flops = 4 * b * hq * d * t * doc_len / 2  # each document's own causal half
      row = {'impl': name, 'batch': b, 'seq_len': t, 'doc_len': doc_len, 'q_heads': hq,
             'kv_heads': hkv, 'head_dim': d, 'dtype': jnp.dtype(dtype).name}
      try:
        fwd_s, bwd_s = measure(functools.partial(fn, segment_ids=seg), q, k, v, do, iters)
        row.update(fwd_ms=fwd_s * 1e3, bwd_ms=bwd_s * 1e3,
                   fwd_tflops=flops / fwd_s / 1e12, bwd_tflops=2.5 * flops / bwd_s / 1e12)
        if doc_len == doc_lens[0]:  # the one-document row is the baseline
          base = (fwd_s, bwd_s)
        if base:
          row.update(fwd_vs_one_doc=base[0] / fwd_s, bwd_vs_one_doc=base[1] / bwd_s)
      except Exception as e:  # pylint: disable=broad-except
        row['error'] = f'{type(e).__name__}: {str(e)[:200]}'
      rows.append(row)
  return rows


def main_packed(args):
  if args.smoke:
    impls = {'pallas': implementations(True)['pallas']}
    case, d, dtype, iters, doc_lens = (1, 64, 4, 2), 32, jnp.float32, 1, (64, 16)
  else:
    impls = {k: v for k, v in implementations(False).items() if k.startswith('pallas')}
    case, d, dtype, iters, doc_lens = (TOKENS // 8192, 8192, 32, 8), 128, jnp.bfloat16, \
        args.iters, DOC_LENS
  rows = run_packed(impls, *case, d, dtype, iters, doc_lens)
  print(f"{'impl':20}{'doc':>6}{'fwd ms':>9}{'bwd ms':>9}{'useful fwd TF/s':>17}"
        f"{'bwd TF/s':>10}{'fwd vs one doc':>16}{'bwd':>6}")
  for r in rows:
    if 'error' in r:
      print(f"{r['impl']:20}{r['doc_len']:>6}  {r['error'][:60]}")
      continue
    ratios = (f"{r['fwd_vs_one_doc']:>16.2f}{r['bwd_vs_one_doc']:>6.2f}"
              if 'fwd_vs_one_doc' in r else '')
    print(f"{r['impl']:20}{r['doc_len']:>6}{r['fwd_ms']:>9.2f}{r['bwd_ms']:>9.2f}"
          f"{r['fwd_tflops']:>17.1f}{r['bwd_tflops']:>10.1f}{ratios}")
  if not args.smoke:
    print(write_result(f'attention_packed_{jax.devices()[0].device_kind.replace(" ", "_")}',
                       {'rows': rows}))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--smoke', action='store_true', help='tiny CPU run; writes nothing')
  parser.add_argument('--iters', type=int, default=20)
  parser.add_argument('--impls', default='',
                      help='comma-separated implementations to time (default: all but xla; '
                      'a subset writes attention_<device>_<impls>.json)')
  parser.add_argument('--seq_lens', default='8192,16384,65536',
                      help='comma-separated sequence lengths (each run at 64K tokens)')
  parser.add_argument('--tiles', action='store_true',
                      help='time our kernel under each tile choice in TILES (8K tokens)')
  parser.add_argument('--packed', action='store_true',
                      help='time our kernels on rows packed with documents (DOC_LENS)')
  args = parser.parse_args(argv)
  if args.tiles:
    return main_tiles(args)
  if args.packed:
    return main_packed(args)
  if args.smoke:
    cases, d, dtype, iters = [(2, 64, 4, 4), (2, 64, 4, 2)], 32, jnp.float32, 1
  else:
    seq_lens = [int(t) for t in args.seq_lens.split(',')]
    cases = [(TOKENS // t, t, 32, hkv) for t in seq_lens for hkv in (32, 8)]
    d, dtype, iters = 128, jnp.bfloat16, args.iters
  impls = implementations(args.smoke)
  # Default: all but XLA on a GPU (it materializes the scores: out of memory at 64K).
  default = [k for k in impls if k != 'xla' or args.smoke]
  names = args.impls.split(',') if args.impls else default
  unknown = set(names) - set(impls)
  if unknown:
    parser.error(f'--impls: unknown {sorted(unknown)}; choose from {sorted(impls)}')
  impls = {k: impls[k] for k in names}
  name = f'attention_{jax.devices()[0].device_kind.replace(" ", "_")}'
  if names != default:   # a partial run does not overwrite the full table
    name += '_' + '-'.join(names)
  # One implementation at a time over every shape, each row printed as it is measured and
  # the JSON rewritten after each implementation: a kernel that crashes the process or a
  # time limit that stops it leaves the rows before it.
  rows = []
  print_table([], flush=True)
  for impl, fn in impls.items():
    for b, t, hq, hkv in cases:
      rows += run_case({impl: fn}, b, t, hq, hkv, d, dtype, iters)
      print_table(rows[-1:], header=False, flush=True)
    if not args.smoke:
      add_ratios(rows)
      write_result(name, {'rows': rows})
  add_ratios(rows)
  print_table(rows)
  if not args.smoke:
    print(write_result(name, {'rows': rows}))
  return rows


def main_tiles(args):
  if args.smoke:
    cases, tiles, d, dtype, iters = [(1, 64, 4, 2)], [(16, 32, 32, 16, 4, 2)], 32, jnp.float32, 1
  else:
    cases = [(TOKENS // 8192, 8192, 32, hkv) for hkv in (32, 8)]
    tiles, d, dtype, iters = TILES, 128, jnp.bfloat16, args.iters
  rows = []
  for b, t, hq, hkv in cases:
    rows += run_tiles(tiles, b, t, hq, hkv, d, dtype, iters)
    if not args.smoke:
      rows += run_mosaic_tiles(MOSAIC_TILES, b, t, hq, hkv, d, dtype, iters)
  print(f"{'tiles (bq bk bq_bwd bk_bwd warps stages | mosaic: as named)':62}{'Hkv':>5}"
        f"{'fwd TF/s':>10}{'bwd TF/s':>10}")
  for r in rows:
    values = r['tiles'].items()
    label = r['impl'] + ' ' + ' '.join(
        f'{k}={v}' if r['impl'] == 'pallas_mosaic' else str(v) for k, v in values)
    numbers = (r['error'][:40] if 'error' in r else
               f"{r['fwd_tflops']:>10.1f}{r['bwd_tflops']:>10.1f}")
    print(f"{label:62}{r['kv_heads']:>5}{numbers}")
  if not args.smoke:
    print(write_result(f'attention_tiles_{jax.devices()[0].device_kind.replace(" ", "_")}',
                       {'rows': rows}))
  return rows


if __name__ == '__main__':
  main()
