"""One benchmark in two checkouts (before and after a change), interleaved.

  python -m benchmarks.ab_checkouts --baseline=/tmp/before --name=train_overlap_cpu \
      --variant=log1:--config.metrics.log_every=1 --variant=log50:--config.metrics.log_every=50 \
      -- -m benchmarks.train_throughput --config=default.py:tiny --config.steps=300 --warmup=20

`--baseline` is another checkout of this repository (`git worktree add /tmp/before REV`);
the command after `--` is run with python in each checkout, once per variant and
repeat, the two sides alternating and the side that goes first alternating too (on a
shared machine a neighbour's load moves single runs by 10-20%). The benchmark must take
`--result_name` and write its JSON to $MESHLM_RESULTS_DIR (benchmarks/common.write_result).
Writes results/NAME.json: every pass's `--keys` and their medians per variant and side.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import write_result

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if '--' not in argv:
    raise SystemExit('usage: python -m benchmarks.ab_checkouts [options] -- BENCHMARK ARGS')
  split = argv.index('--')
  p = argparse.ArgumentParser(prog='python -m benchmarks.ab_checkouts')
  p.add_argument('--baseline', required=True, help='the other checkout (before)')
  p.add_argument('--name', required=True, help='results/NAME.json')
  p.add_argument('--variant', action='append', default=[], metavar='LABEL:ARGS',
                 help='extra arguments (space separated) for one variant; repeatable')
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--keys', default='median_step_time_s,tokens_per_sec')
  args = p.parse_args(argv[:split])
  args.command = argv[split + 1:]
  args.variants = dict(v.split(':', 1) for v in args.variant) or {'': ''}
  return args


def run_pass(checkout: str, command: list[str], extra: str, out_dir: str, name: str) -> dict:
  env = {**os.environ, 'MESHLM_RESULTS_DIR': out_dir, 'PYTHONPATH': checkout}
  subprocess.run([sys.executable, *command, *extra.split(), f'--result_name={name}'],
                 cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
  with open(os.path.join(out_dir, f'{name}.json')) as f:
    return json.load(f)


def main(argv=None) -> int:
  args = parse_args(argv)
  keys = args.keys.split(',')
  sides = {'before': os.path.abspath(args.baseline), 'after': HERE}
  passes = {label: {side: [] for side in sides} for label in args.variants}
  with tempfile.TemporaryDirectory() as out_dir:
    for repeat in range(args.repeats):
      for label, extra in args.variants.items():
        order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]
        for side in order:
          result = run_pass(sides[side], args.command, extra, out_dir, f'{side}_{repeat}')
          passes[label][side].append({k: result.get(k) for k in keys})
          print(f'{label or "run"} {side} pass {repeat}: {passes[label][side][-1]}', flush=True)
  medians = {label: {side: {k: statistics.median(p[k] for p in runs) for k in keys}
                     for side, runs in by_side.items()} for label, by_side in passes.items()}
  print(write_result(args.name, {'command': args.command, 'variants': args.variants,
                                 'baseline': args.baseline, 'repeats': args.repeats,
                                 'medians': medians, 'passes': passes}))
  print(json.dumps(medians, indent=2))
  return 0


if __name__ == '__main__':
  sys.exit(main())
