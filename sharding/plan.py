"""`python -m sharding.plan`: rank the layouts of a config on N GPUs before touching one.

  python -m sharding.plan --config=default.py:tiny --devices 8 --device h100 --top 5
      [--batch-size N]

A command-line entry, like train.py: it sits on top and imports training (the layout
compiles) inside main(). It simulates N CPU devices for its own process, compiles each
candidate layout's train step from abstract shapes, predicts its step time on the named
GPU (sharding/planner.py) and prints the ranked table; --output DIR also writes
plan.json and plan.csv, each row with the train.py overrides that run it.
"""

import argparse
import csv
import json
import os
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog='python -m sharding.plan',
                              description=__doc__.split('\n\n', 1)[0])
  p.add_argument('--config', required=True, help='NAME.py[:variant], as train.py takes it')
  p.add_argument('--devices', type=int, required=True, help='GPUs to plan for')
  p.add_argument('--device', default='h100', help='GPU kind: h100, h200, a100')
  p.add_argument('--hosts', type=int, default=0,
                 help='hosts the GPUs are spread over (default: 8 GPUs per host)')
  p.add_argument('--top', type=int, default=10, help='rows to print')
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


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax   # pylint: disable=import-outside-toplevel
  # The planner compiles for CPU devices, on a GPU machine too (the Pallas kernels are
  # costed from the interpreter's program): this process only.
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', max(args.devices, 1))
  # pylint: disable=import-outside-toplevel
  import dataclasses
  from sharding import planner
  from training import plan as plan_lib
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
    progress = lambda i, n, layout: print(f'[{i + 1}/{n}] compiling {layout.name()}',
                                          file=sys.stderr, flush=True)
    rows, rejected = plan_lib.plan_layouts(
        cfg, args.devices, hw.name, layers=layers, progress=progress,
        zero_stages=ints(args.zero), remats=tuple(args.remat.split(',')),
        grad_accums=ints(args.grad_accum), microbatches=ints(args.microbatches))
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'{args.config} on {args.devices} x {hw.name} ({hw.gpus_per_host} per host): '
        f'{len(rows)} layouts compiled, {len(rejected)} rejected by validate')
  print(planner.table(rows, args.top))
  if rows and rows[0]['prediction'].fits:
    print('run the best with: python train.py --config=' + args.config + ' '
          + ' '.join(extra + rows[0]['layout'].overrides()))
  if args.output:
    os.makedirs(args.output, exist_ok=True)
    records = [planner.as_record(r) for r in rows]
    for r in records:
      r['overrides'] = ' '.join(extra + [r['overrides']])
    with open(os.path.join(args.output, 'plan.json'), 'w') as f:
      json.dump({'config': args.config, 'devices': args.devices, 'device': hw.name,
                 'batch_size': cfg.data.batch_size, 'rows': records,
                 'rejected': [{'layout': l.name(), 'why': w} for l, w in rejected]}, f,
                indent=2)
    flat = ['layout', 'fits', 'memory_gib', 'headroom_gib', 'step_s', 'tokens_per_s', 'mfu',
            'matmul_s', 'memory_bound_s', 'launch_s',
            'dominant', 'why_not', 'overrides']
    with open(os.path.join(args.output, 'plan.csv'), 'w', newline='') as f:
      writer = csv.DictWriter(f, fieldnames=flat, extrasaction='ignore')
      writer.writeheader()
      writer.writerows(records)
  return 0


if __name__ == '__main__':
  sys.exit(main())
