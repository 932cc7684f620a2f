"""The planner's predicted step times against measured ones, and the efficiency fit.

  python -m benchmarks.planner_check [--configs=default.py,gpt_64k.py] [--device=h200]
      [--top=3] [--steps=10] [--grad-accums=1,2,4] [--batch-size=N] [--this-compile]
  python -m benchmarks.planner_check --fit=results/a.json,results/b.json [--device=h100]
      [--replan]

For each config, `python -m training.plan_cli` ranks the one-device layouts (remat policy x
gradient accumulation; ZeRO and the mesh axes do nothing on one device) in a CPU-only
process of its own, as for a user without a GPU. The top `--top` that fit are then run
on this machine's accelerator: a fresh train state, random tokens, `--steps` timed steps
after two warm-up steps (median), and the device's peak memory where it reports one.
`--device` (the hardware table's row the predictions use) defaults to this GPU's kind,
read from jax (h100 on a CPU). `--batch-size` runs and plans each config at that many
sequences a step instead of its own (gpt_64k's 8 sequences of 64K take about 30 s a
step on one H200; 2 take a quarter of that, and the fit needs only the pairs of times).
`--this-compile` also records this platform's compile of each (its traffic and memory;
the FLOPs of kernel custom-calls, such as flash attention on a GPU, are not in its HLO).

`sharding.planner.fit_efficiency` then fits the cost model's matmul efficiency, its cost
per kernel launch and per step (`--fit-factors`; the HBM efficiency is a copy's measured
bandwidth, held) to the measured times, with the error of the table's factors before and
after (and of the FLOPs alone, fitted: what the other terms earn); all of it goes to
benchmarks/results/planner_check_<platform>_<configs>[_b<batch size>].json.
`--fit` refits over the runs of several such files (e.g. one per config, run in separate
calls) into planner_fit_<device>.json; with `--replan` the runs' FLOPs, bytes and kernel
launches are first taken from today's planner (each config planned again on this CPU),
so a change to the cost model is refitted to the measured times without a GPU
(planner_fit_<device>_replanned.json, the replanned runs in it). The table
(MATMUL_EFFICIENCY, LAUNCH_SECONDS, STEP_SECONDS in sharding/planner.py) is updated by
hand from that, citing the file.

On a CPU (`--smoke`: the tiny config, two layouts, two steps) this only checks that the
script runs: the times say nothing about a GPU.
"""

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import peak_memory_bytes, train_step_runner, write_result
from sharding import hlo, planner
from training import cli, plan


def detect_device() -> str:
  """The hardware table's row for this machine's first device: its kind as jax names it
  ('NVIDIA H200', 'NVIDIA H100 80GB HBM3'), h100 on a CPU; ValueError for a GPU the table
  lacks."""
  device = jax.devices()[0]
  if device.platform == 'cpu':
    return 'h100'
  kind = device.device_kind.lower()
  for name in planner.HARDWARE:
    if re.search(rf'\b{name}\b', kind):
      return name
  raise ValueError(f'no row of the hardware table (sharding/planner.py: '
                   f'{sorted(planner.HARDWARE)}) for this {device.device_kind!r}: name one '
                   'with --device')


def plan_on_cpu(spec: str, hw: planner.Hardware, accums, batch_size: int = 0) -> list[dict]:
  """The planner's ranked one-device rows for `spec` (plan.json records), from
  `python -m training.plan_cli` in its own CPU-only process, as a user without a GPU runs it."""
  with tempfile.TemporaryDirectory() as out:
    cmd = [sys.executable, '-m', 'training.plan_cli', f'--config={spec}', '--devices', '1',
           '--device', hw.name, '--zero', '0', '--remat', 'none,full',
           '--grad-accum', ','.join(str(a) for a in accums), '--output', out]
    cmd += [f'--batch-size={batch_size}'] if batch_size else []
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    print(done.stdout, done.stderr[-2000:] if done.returncode else '', flush=True)
    if done.returncode:
      raise RuntimeError(f'{" ".join(cmd)} failed (exit {done.returncode})')
    with open(os.path.join(out, 'plan.json')) as f:
      return json.load(f)['rows']


def predicted(row: dict) -> dict:
  """A run record's planner side, from its plan.json row."""
  return {'predicted_step_s': row['step_s'], 'matmul_s': row['matmul_s'],
          'memory_bound_s': row['memory_bound_s'], 'launch_s': row['launch_s'],
          'dot_flops': row['dot_flops_per_device'],
          'dot_bytes': row['dot_bytes_per_device'],
          'other_bytes': row['other_bytes_per_device'],
          'launches': row['launches_per_device'],
          'predicted_memory_bytes': row['memory_bytes']}


def replan(runs: list[dict], hw: planner.Hardware) -> list[dict]:
  """`runs` (planner_check records) with their planner side from today's planner: each
  config planned again on the CPU at the runs' batch size and gradient accumulations,
  matched by layout; the measured side kept. A refit of the cost model needs no GPU."""
  groups = {}
  for r in runs:
    seq_len = cli.load_config_file(r['config']).data.seq_len
    groups.setdefault((r['config'], r['tokens_per_step'] // seq_len), []).append(r)
  out = []
  for (spec, batch_size), group in groups.items():
    accums = sorted({int(re.search(r'grad_accum=(\d+)', r['overrides']).group(1))
                     for r in group})
    rows = {row['layout']: row for row in plan_on_cpu(spec, hw, accums, batch_size)}
    for r in group:
      if r['layout'] not in rows:
        raise ValueError(f"{spec}: the planner no longer offers {r['layout']!r} (it has "
                         f'{sorted(rows)}): rerun planner_check on a GPU.')
      row = rows[r['layout']]
      out.append({**r, **predicted(row),
                  'measured_over_predicted': r['measured_step_s'] / row['step_s']})
  return out


def run_layout(cfg, layout: planner.Layout, steps: int) -> dict:
  """Median step seconds of `layout` (two warm-up steps left out) and its peak memory.
  The device keeps one peak for the whole process: a layout's own peak is known when it
  raises it (the first layout run always does), else only that it was at most that."""
  before = peak_memory_bytes()
  _, step = train_step_runner(cfg, layout)
  times = []
  for i in range(steps + 2):
    start = time.perf_counter()
    _, metrics = jax.block_until_ready(step())
    if i >= 2:
      times.append(time.perf_counter() - start)
  loss = float(metrics['loss'])
  if not np.isfinite(loss):
    raise RuntimeError(f'{layout.name()}: loss {loss} is not finite')
  after = peak_memory_bytes()
  raised = after is not None and (before is None or after > before)
  return {'measured_step_s': statistics.median(times), 'step_times_s': times,
          'peak_memory_bytes': after if raised else None,
          'peak_memory_at_most_bytes': after, 'loss': loss}


def check(spec: str, hw: planner.Hardware, top: int, steps: int, this_compile: bool,
          accums=(1, 2, 4), batch_size: int = 0) -> list[dict]:
  """Plans `spec` on one device from a CPU compile and runs the top layouts here."""
  cfg = cli.load_config_file(spec)
  cfg.data.batch_size = batch_size or cfg.data.batch_size
  out = []
  for row in [r for r in plan_on_cpu(spec, hw, accums, batch_size) if r['fits']][:top]:
    lay = planner.Layout(row['mesh'], row['zero_stage'], row['remat'], row['grad_accum'],
                         row['microbatches'])
    record = {'config': spec, 'layout': row['layout'], 'overrides': row['overrides'],
              **predicted(row), 'tokens_per_step': cfg.data.batch_size * cfg.data.seq_len,
              **run_layout(cfg, lay, steps)}
    record['measured_over_predicted'] = record['measured_step_s'] / row['step_s']
    if this_compile:   # this platform's compiler (the kernels' FLOPs are not in its HLO)
      report = hlo.inspect_compiled(plan.build_layout(cfg, lay).compile())
      record['this_platform_compile'] = {
          'dot_flops': report.dot_flops, 'dot_bytes': report.dot_bytes,
          'other_bytes': report.other_bytes, 'launches': report.launches,
          'memory_bytes': (report.argument_bytes + report.output_bytes - report.alias_bytes
                           + report.temp_bytes)}
    print(f"{row['layout']}: predicted {row['step_s'] * 1e3:.3f} ms, measured "
          f"{record['measured_step_s'] * 1e3:.3f} ms", flush=True)
    out.append(record)
  return out


FIT_FACTORS = 'matmul_efficiency,launch_seconds,step_seconds'


def fit(runs: list[dict], hw: planner.Hardware, factors: str = FIT_FACTORS) -> dict:
  """planner.fit_efficiency over run records (this run's or read from result files)."""
  measured = [(planner.Measured(0, 0, 0, 0, r['dot_flops'], {}, {}, r['dot_bytes'],
                                r['other_bytes'], r['launches']),
               r['measured_step_s']) for r in runs]
  out = planner.fit_efficiency(measured, hw, factors.split(','))
  print(f"fit over {len(runs)} runs ({', '.join(out['fitted'])} fitted): matmul efficiency "
        f"{out['matmul_efficiency']:.3f}, HBM efficiency {out['hbm_efficiency']:.3f}, "
        f"{out['launch_seconds'] * 1e6:.2f} us a kernel launch, "
        f"{out['step_seconds'] * 1e3:.3f} ms a step; rms relative error "
        f"{out['table']['rms_relative_error']:.1%} with the table's factors, "
        f"{out['rms_relative_error']:.1%} fitted" + (
            f", {out['matmul_only']['rms_relative_error']:.1%} fitting the FLOPs alone"
            if 'matmul_only' in out else '') + ('' if out['converged'] else
                                                 ' (the classification did not settle)'))
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog='python -m benchmarks.planner_check',
                              description=__doc__.split('\n\n', 1)[0])
  p.add_argument('--configs', default='default.py,gpt_64k.py')
  p.add_argument('--device', default='',
                 help="this GPU's row of the hardware table (default: read from jax)")
  p.add_argument('--top', type=int, default=3)
  p.add_argument('--steps', type=int, default=10)
  p.add_argument('--grad-accums', default='1,2,4')
  p.add_argument('--batch-size', type=int, default=0,
                 help="sequences a step for every config (default: each config's own)")
  p.add_argument('--this-compile', action='store_true',
                 help="also record this platform's compile of each run layout")
  p.add_argument('--fit', metavar='JSON,JSON',
                 help='fit over the runs of these planner_check results instead of running')
  p.add_argument('--fit-factors', default=FIT_FACTORS,
                 help='the factors fitted (of sharding.planner.FACTORS; the rest stay the '
                      "table's). The HBM efficiency is measured, not fitted: a copy's "
                      'bandwidth (sharding/planner.py)')
  p.add_argument('--replan', action='store_true',
                 help="with --fit: the runs' FLOPs, bytes and launches from today's "
                      'planner (a CPU compile), their measured times kept')
  p.add_argument('--smoke', action='store_true', help='CPU: the tiny config, two steps')
  args = p.parse_args(argv)
  try:
    hw = planner.hardware(args.device or detect_device())
  except ValueError as e:
    p.error(str(e))
  if args.fit:
    files = args.fit.split(',')
    loaded = {f: json.load(open(f)) for f in files}
    runs = [r for data in loaded.values() for r in data['runs']]
    result = {'hardware': dataclasses.asdict(hw), 'from': files}
    if args.replan:
      # The counts come from this jax's CPU compile; the runs', from their machine's.
      result['planned_with_jax'] = jax.__version__
      result['runs_planned_with_jax'] = sorted({
          data.get('environment', {}).get('jax_version', '?') for data in loaded.values()})
      runs = result['runs'] = replan(runs, hw)
    elif any('launches' not in r for r in runs):
      p.error(f'{args.fit}: runs recorded before the planner counted kernel launches; '
              "add --replan to take today's planner's counts (their measured times kept).")
    result['fit'] = fit(runs, hw, args.fit_factors)
    print(write_result(f'planner_fit_{hw.name}' + '_replanned' * args.replan, result))
    return result
  accums = tuple(int(a) for a in args.grad_accums.split(','))
  if args.smoke:
    args.configs, args.top, args.steps, accums = 'default.py:tiny', 2, 2, (1,)
  runs = [r for spec in args.configs.split(',')
          for r in check(spec, hw, args.top, args.steps, args.this_compile, accums=accums,
                         batch_size=args.batch_size)]
  result = {'hardware': dataclasses.asdict(hw), 'runs': runs}
  name = '_'.join(c.replace('.py', '').replace(':', '-') for c in args.configs.split(','))
  name += f'_b{args.batch_size}' if args.batch_size else ''   # beside the config's own
  name = f'planner_check_{jax.devices()[0].platform}_{name}'
  write_result(name, result)   # the measurements first: a fit that fails keeps them
  try:
    result['fit'] = fit(runs, hw, args.fit_factors)
  except ValueError as e:
    # Runs of one kind (all memory-bound, say) leave some factors unfittable; --fit over
    # these and other results' runs still can.
    result['fit_error'] = str(e)
    print(f'no fit over these runs alone: {e}')
  print(write_result(name, result))
  return result


if __name__ == '__main__':
  main()
