"""`python -m training.plan_cli`: rank the layouts of a config on N GPUs before touching one.

  python -m training.plan_cli --config=default.py:tiny --devices 8 --device h100 --top 5
      [--batch-size N]

A command-line entry, like train.py. It simulates N CPU devices for its own process (so
jax and the layout compiles are imported inside main(), after that is set), bounds every
candidate layout's step from below without compiling it (training/plan_bound.py),
compiles the train steps of those that could be among the --top rows, best bound first
(layouts that are one program, once: training/plan.py's program_key), predicts each
one's step time on the named GPU (sharding/planner.py) and prints the ranked table: its
rows are a full search's. --output DIR also writes plan.json and
plan.csv, each row with the train.py overrides that run it. Each compile's numbers are
kept in --cache-dir (training/plan_cache.py), so a rerun compiles nothing it has seen.
Progress on stderr names each compile, how many may follow and the best layout so far.
"""

import argparse
import csv
import json
import os
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog='python -m training.plan_cli',
                              description=__doc__.split('\n\n', 1)[0])
  p.add_argument('--config', required=True, help='NAME.py[:variant], as train.py takes it')
  p.add_argument('--devices', type=int, required=True, help='GPUs to plan for')
  p.add_argument('--device', default='h100', help='GPU kind: h100, h200, a100')
  p.add_argument('--hosts', type=int, default=0,
                 help='hosts the GPUs are spread over (default: 8 GPUs per host)')
  p.add_argument('--top', type=int, default=10,
                 help='rows to print; the layouts that cannot be among them are not '
                      'compiled (0: print and compile all)')
  p.add_argument('--max-compiles', type=int, default=0, metavar='K',
                 help='compile at most K layouts, best lower bound first (0: as many as '
                      'the --top rows need); the rows past what K proves are marked')
  p.add_argument('--max-seconds', type=float, default=60.0, metavar='S',
                 help='start no compile after S seconds (those under way finish); the rows '
                      'past what the compiles so far prove are marked, and a second run '
                      'goes on from the cache (0: no limit, the full proof)')
  p.add_argument('--jobs', type=int, default=min(4, os.cpu_count() or 1), metavar='N',
                 help='compiles at once, each in a process of its own (default: the CPU '
                      'count, at most 4)')
  p.add_argument('--cache-dir', default='~/.cache/meshlm/plan',
                 help="where each compile's numbers are kept for later runs ('none': "
                      'off)')
  p.add_argument('--layers', default='', metavar='A,B',
                 help='compile A- and B-layer versions and extrapolate (big models)')
  p.add_argument('--zero', default='0,1,3', help='ZeRO stages to try')
  p.add_argument('--remat', default='none,full', help='remat policies to try')
  p.add_argument('--grad-accum', default='1', help='gradient accumulation counts to try')
  p.add_argument('--microbatches', default='0',
                 help='pipeline microbatch counts to try, for layouts with stage > 1 '
                      "(0: the config's, else one per stage)")
  p.add_argument('--batch-size', type=int, default=0,
                 help="sequences a step (the config's data.batch_size by default); the "
                      'rows\' train.py overrides then set it too')
  p.add_argument('--output', metavar='DIR', help='write plan.json and plan.csv here')
  return p.parse_args(argv)


# LLVM's optimizations off: the planner reads the optimized HLO and the buffer
# assignment, which XLA's own passes make before LLVM runs, so the numbers are the same
# and a compile takes 30-40% less (tests/conftest.py does the same for the suite).
CPU_XLA_FLAGS = '--xla_backend_optimization_level=0'


def main(argv=None) -> int:
  args = parse_args(argv)
  if CPU_XLA_FLAGS not in os.environ.get('XLA_FLAGS', ''):   # read when the backend starts
    os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {CPU_XLA_FLAGS}'.strip()
  import jax   # pylint: disable=import-outside-toplevel
  # The planner compiles for CPU devices, on a GPU machine too (the Pallas kernels are
  # costed from the interpreter's program): this process only.
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', max(args.devices, 1))
  # pylint: disable=import-outside-toplevel
  import dataclasses
  from sharding import planner
  from training import plan as plan_lib, plan_cache
  from training.cli import load_config_file
  try:
    hw = planner.hardware(args.device)
    if args.devices < 1:
      raise ValueError(f'--devices {args.devices}: give at least 1.')
    if args.hosts:
      if args.devices % args.hosts:
        raise ValueError(f'--hosts {args.hosts} does not divide --devices {args.devices}.')
      hw = dataclasses.replace(hw, gpus_per_host=args.devices // args.hosts)
    planner.HARDWARE[hw.name] = hw
    cfg = load_config_file(args.config)
    if args.batch_size < 0:
      raise ValueError(f'--batch-size {args.batch_size}: give a positive count (0: the '
                       "config's).")
    cfg.data.batch_size = args.batch_size or cfg.data.batch_size
    # Every row's train.py command: this batch too, where it is not the config's.
    extra = [f'--config.data.batch_size={args.batch_size}'] if args.batch_size else []
    ints = lambda s: tuple(int(v) for v in s.split(',') if v)
    layers = ints(args.layers) or None
    if layers is not None and len(layers) != 2:
      raise ValueError(f'--layers {args.layers!r}: give two layer counts, A,B.')
    for flag in ('top', 'max_compiles', 'max_seconds'):
      if getattr(args, flag) < 0:
        raise ValueError(f'--{flag.replace("_", "-")} {getattr(args, flag)}: give a count '
                         '>= 0 (0: no limit).')
    if args.jobs < 1:
      raise ValueError(f'--jobs {args.jobs}: give at least 1.')
    off = args.cache_dir.strip().lower() in ('', 'none')
    cache = None if off else plan_cache.MeasureCache(args.cache_dir)
    progress = lambda k, n, layout, left, best: print(
        f'compiling {k}/{n}: {layout.name()} ({left} left)' + _so_far(best),
        file=sys.stderr, flush=True)
    found = plan_lib.search(
        cfg, args.devices, hw.name, top=args.top, max_compiles=args.max_compiles,
        max_seconds=args.max_seconds, jobs=args.jobs, cache=cache, layers=layers, progress=progress,
        zero_stages=ints(args.zero), remats=tuple(args.remat.split(',')),
        grad_accums=ints(args.grad_accum), microbatches=ints(args.microbatches))
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  _print(args, found, hw, extra)
  if args.output:
    _write(args, found, hw, extra, cfg.data.batch_size)
  return 0


def _so_far(best) -> str:
  """The best layout of the compiles so far: the answer unless a compile left beats it."""
  if best is None:
    return ''
  p = best['prediction']
  return (f"; best so far: {best['layout'].name()}, "
          + (f'{p.step_s * 1e3:.4g} ms a step' if p.fits else 'does not fit'))


def _print(args, found, hw, extra) -> None:
  rows = found.rows
  print(f'{args.config} on {args.devices} x {hw.name} ({hw.gpus_per_host} per host): '
        f'{len(rows) + len(found.pruned)} layouts, {found.compiled} compiled, '
        f'{found.shared} the same program as one compiled, {found.cached} from the cache, '
        f'{len(found.pruned)} not compiled, {len(found.rejected)} rejected by validate')
  from sharding import planner   # pylint: disable=import-outside-toplevel
  print(planner.table(rows, args.top))
  shown = rows[:args.top] if args.top else rows
  if found.exact < len(shown):
    could = sum(1 for _, b in found.pruned
                if planner.rank_key(b) < planner.rank_key(shown[-1]['prediction']))
    stop = (f'--max-compiles {args.max_compiles}' if args.max_compiles
            and found.compiled >= args.max_compiles else f'--max-seconds {args.max_seconds:g}')
    print(f'rows from #{found.exact + 1} on are not proven: {stop} left {could} layouts '
          'uncompiled that could rank among them. Run the same command again to go on '
          '(what compiled is cached), or give --max-seconds 0 for the full search.')
  if rows and rows[0]['prediction'].fits:
    best = 'the best' if found.exact else 'the best found so far'
    print(f'run {best} with: python train.py --config=' + args.config + ' '
          + ' '.join(extra + rows[0]['layout'].overrides()))


def _write(args, found, hw, extra, batch_size) -> None:
  """plan.json (every compiled row, the rejected and the uncompiled layouts) and
  plan.csv (the rows) in --output."""
  from sharding import planner   # pylint: disable=import-outside-toplevel
  os.makedirs(args.output, exist_ok=True)
  records = [planner.as_record(r) for r in found.rows]
  for r in records:
    r['overrides'] = ' '.join(extra + [r['overrides']])
  with open(os.path.join(args.output, 'plan.json'), 'w') as f:
    json.dump({'config': args.config, 'devices': args.devices, 'device': hw.name,
               'batch_size': batch_size, 'rows': records,
               'rejected': [{'layout': l.name(), 'why': w} for l, w in found.rejected],
               'not_compiled': [{'layout': l.name(), 'lower_bound_step_s': b.step_s,
                                 'lower_bound_memory_bytes': b.memory_bytes}
                                for l, b in found.pruned]}, f, indent=2)
  flat = ['layout', 'fits', 'memory_gib', 'headroom_gib', 'step_s', 'tokens_per_s', 'mfu',
          'matmul_s', 'memory_bound_s', 'launch_s',
          'dominant', 'why_not', 'overrides']
  with open(os.path.join(args.output, 'plan.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=flat, extrasaction='ignore')
    writer.writeheader()
    writer.writerows(records)


if __name__ == '__main__':
  sys.exit(main())
