"""The mesh planner: its per-layout numbers against independent compiles and analytic
counts, the cost model's orderings on constructed cases, the few-layer extrapolation
against a full compile, and the CLI's refusals."""

import copy
import dataclasses
import math
import os
import re
import subprocess
import sys
import time

import jax
import pytest

import model
from sharding import hlo, planner
from sharding.mesh import MESH_AXES, MeshConfig, make_mesh
from sharding.rules import make_plan
from tests.test_hlo import traffic_with_loops_once, xla_bytes_accessed
from tests.test_parallel import random_batch, tiny_config
from training import describe, optimizer, plan, plan_bound, plan_cache, state

H100 = planner.hardware('h100')


def layout(zero=0, remat='none', accum=1, micro=0, **sizes):
  return planner.Layout({a: sizes.get(a, 1) for a in MESH_AXES}, zero, remat, accum, micro)


def planner_config(layers=2):
  cfg = tiny_config()
  cfg.model = dataclasses.replace(cfg.model, num_layers=layers)
  cfg.data.pack_documents = True   # random_batch's segment ids: the same step as below
  return cfg


LAYOUTS = {
    'dp8': layout(data=8),
    'zero3_fsdp8': layout(fsdp=8, zero=3),
    'tp2_dp4': layout(data=4, tensor=2),
    'fsdp4_tp2': layout(fsdp=4, tensor=2, zero=3),
    'cp2_dp4': layout(data=4, context=2),
    'pp2_dp4': layout(data=4, stage=2, micro=2),
}


def independent_report(cfg, lay):
  """The same step compiled without the planner: the test's own plan and batch; its
  collectives also counted by count_collectives (a second reading of the HLO)."""
  cfg = plan.configure(cfg, lay)
  mesh = make_mesh(cfg.mesh, jax.devices()[:8])
  p = make_plan(mesh, lay.zero_stage, cfg.parallel.sequence_parallel,
                cfg.parallel.context_strategy, cfg.parallel.context_load_balance,
                lay.microbatches or 1)
  tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
  step = state.make_train_step(cfg, p, tx, optimizer.lr_schedule(cfg.optim, cfg.steps))
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=p.batch_sharding())
           for k, v in random_batch(cfg).items()}
  compiled = step.lower(state.abstract_state(cfg, p, tx), batch).compile()
  report = hlo.inspect_compiled(compiled)
  counted = count_collectives(compiled.as_text())
  assert counted.keys() == report.collectives.keys()
  for kind, stats in report.collectives.items():
    assert counted[kind] == pytest.approx((stats.count, stats.bytes)), kind
  # Memory traffic as XLA's own cost analysis counts it (loop bodies once).
  assert traffic_with_loops_once(compiled) == pytest.approx(
      xla_bytes_accessed(compiled), rel=0.01)
  return report


_KINDS = 'all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all'
_BYTES = {'f32': 4, 'bf16': 2, 'f16': 2, 's32': 4, 'u32': 4, 'pred': 1, 's8': 1, 'u8': 1,
          'f64': 8, 's64': 8, 'u64': 8}


def count_collectives(text: str) -> dict[str, tuple[float, float]]:
  """{kind: (executions, result bytes)} per step from compiled HLO text: a second,
  line-regex reading, independent of sharding/hlo.py's parser. Loop bodies count
  known_trip_count times; conditional branches, called and async-wrapped computations
  once; an async collective's bytes are its -done's result."""
  comps, name, entry = {}, None, None
  for line in text.splitlines():
    header = re.match(r'(ENTRY )?%?([\w.\-]+) \(.*\{$', line)
    if header:
      name, comps[header.group(2)] = header.group(2), []
      entry = name if header.group(1) else entry
    elif line.startswith('}'):
      name = None
    elif name is not None:
      # Metadata (source text in quotes) may hold anything; backend_config follows it.
      comps[name].append(re.sub(r'metadata=\{("[^"]*"|[^{}"])*\}', '', line))

  def nbytes(shape):
    return sum(_BYTES[dt] * math.prod(int(d) for d in dims.split(',') if d)
               for dt, dims in re.findall(r'([a-z]+\d*)\[([\d,]*)\]', shape))

  def callees(line):   # (computation, runs per execution of the line's op)
    if ' while(' in line:
      trip = int(re.search(r'"known_trip_count":\{"n":"(\d+)"', line).group(1))
      return [(re.search(r'body=%?([\w.\-]+)', line).group(1), trip)]
    refs = re.findall(r'(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)'
                      r'|false_computation=%?([\w.\-]+)|to_apply=%?([\w.\-]+)'
                      r'|calls=%?([\w.\-]+))', line)
    if not re.search(r' (conditional|call|async-start)\(', line):
      return []
    names = [n for groups in refs for g in groups for n in re.findall(r'[\w.\-]+', g)]
    return [(n.lstrip('%'), 1) for n in names]

  totals = {}

  def visit(comp, times):
    done = {}
    for line in comps[comp]:
      m = re.search(rf'= (.*?) (?:{_KINDS})-done\(.*?%?([\w.\-]+)\)$', line)
      if m:
        done[m.group(2)] = m.group(1)
    for line in comps[comp]:
      m = re.search(rf'%?([\w.\-]+) = (.*?) ({_KINDS})(-start)?\(', line)
      if m:
        shape = done[m.group(1)] if m.group(4) else m.group(2)
        count, total = totals.get(m.group(3), (0.0, 0.0))
        totals[m.group(3)] = (count + times, total + times * nbytes(shape))
      for callee, k in callees(line):
        visit(callee, times * k)

  visit(entry, 1.0)
  return totals


@pytest.fixture(scope='module')
def planned():
  cfg = planner_config()
  rows, rejected = plan.plan_layouts(cfg, 8, 'h100', layouts=list(LAYOUTS.values()))
  assert not rejected, rejected
  return cfg, {r['layout'].name(): r for r in rows}


def test_expert_parallel_layout_matches_an_independent_compile():
  """EP (a MoE config): the planner's numbers and its all-to-all over the expert axis."""
  from tests.test_moe import ep_config  # pylint: disable=import-outside-toplevel
  cfg = ep_config()
  cfg.data.pack_documents = True
  lay = layout(data=2, expert=4)
  rows, rejected = plan.plan_layouts(cfg, 8, 'h100', layouts=[lay])
  assert not rejected, rejected
  got, want = rows[0]['measured'], independent_report(cfg, lay)
  assert got.dot_flops == want.dot_flops
  assert (got.dot_bytes, got.other_bytes) == (want.dot_bytes, want.other_bytes)
  assert got.collectives == {k: (v.count, v.bytes) for k, v in want.collectives.items()}
  assert ('all-to-all', ('expert',)) in got.by_axes, got.by_axes


def analytic_flops_per_device(cfg, lay) -> float:
  """Forward + backward dot FLOPs of the whole step / devices: 6 x matmul parameters x
  tokens, plus attention's QK^T and PV over the full (masked, not skipped) t x t."""
  m = cfg.model
  tokens = cfg.data.batch_size * cfg.data.seq_len
  norms = (2 * m.num_layers + 1) * m.embed_dim
  lookup = 0 if m.tie_embeddings else m.vocab_size * m.embed_dim
  matmul = model.count_params(m) - norms - lookup
  attention = 2 * 2 * m.num_layers * cfg.data.seq_len * m.num_heads * m.resolved_head_dim
  return 3 * (2 * matmul + attention) * tokens / math.prod(lay.mesh.values())


@pytest.mark.parametrize('name', LAYOUTS)
def test_planner_numbers_match_an_independent_compile(name, planned):
  cfg, rows = planned
  lay = LAYOUTS[name]
  got, want = rows[lay.name()]['measured'], independent_report(cfg, lay)
  assert got.peak_bytes == (want.argument_bytes + want.output_bytes - want.alias_bytes
                            + want.temp_bytes)
  assert got.dot_flops == want.dot_flops
  assert (got.dot_bytes, got.other_bytes) == (want.dot_bytes, want.other_bytes)
  assert got.collectives == {k: (v.count, v.bytes) for k, v in want.collectives.items()}
  # Filed by mesh axes, the same bytes; no collective crosses an axis of size 1.
  for kind, (count, nbytes) in got.collectives.items():
    axes_bytes = sum(b for (k, _), (_, b) in got.by_axes.items() if k == kind)
    assert axes_bytes == pytest.approx(nbytes)
  for (_, axes), _ in got.by_axes.items():
    assert all(lay.mesh[a] > 1 for a in axes), (name, axes)
  if name not in ('pp2_dp4', 'cp2_dp4'):   # the bubble / gathered K,V add work
    want_flops = analytic_flops_per_device(cfg, lay)
    assert abs(got.dot_flops / want_flops - 1) < 0.02, (got.dot_flops, want_flops)


def test_pipeline_microbatches_are_a_knob_and_more_of_them_shrink_the_bubble():
  cfg = planner_config()
  valid, _ = plan.candidates(cfg, 8, axes=['data', 'tensor', 'stage'], zero_stages=(0,),
                             remats=('none',), microbatches=(0, 4))
  pp = [lay for lay in valid if lay.mesh['stage'] == 2]
  assert {lay.microbatches for lay in pp} == {2, 4}   # 0 is one per stage
  assert all(lay.microbatches == 0 for lay in valid if lay.mesh['stage'] == 1)
  assert len({lay.name() for lay in valid}) == len(valid)
  lays = [layout(data=2, tensor=2, stage=2, micro=m) for m in (2, 4)]
  rows, rejected = plan.plan_layouts(cfg, 8, 'h100', layouts=lays)
  assert not rejected, rejected
  by_micro = {r['layout'].microbatches: r for r in rows}
  assert '--config.parallel.microbatches=4' in by_micro[4]['layout'].overrides()
  # The bubble's idle iterations are compiled work: (M+S-1)/M times the useful FLOPs.
  flops = {m: by_micro[m]['measured'].dot_flops for m in (2, 4)}
  assert flops[4] < flops[2]
  # Where compute decides (a device 10^6 times slower than an H100: this tiny model is
  # otherwise all collective latency and kernel launches, and more microbatches launch
  # more), the smaller bubble predicts the faster step...
  slow = dataclasses.replace(H100, peak_flops=H100.peak_flops * 1e-6)
  step = {m: planner.predict(by_micro[m]['measured'], by_micro[m]['layout'], slow, 1e12,
                             1000).step_s for m in (2, 4)}
  assert step[4] < step[2]
  # ...and on the real table the price shows: per-microbatch collectives, more of them.
  count = lambda m, axes: sum(c for (_, a), (c, _) in by_micro[m]['measured'].by_axes.items()
                              if a == axes)
  assert count(4, ('tensor',)) > count(2, ('tensor',))
  assert (by_micro[4]['prediction'].comm_s['tensor']
          > by_micro[2]['prediction'].comm_s['tensor'])


def test_memory_orders_zero_stages_and_scales_one_over_n():
  cfg = planner_config()
  rows, _ = plan.plan_layouts(cfg, 8, layouts=[layout(fsdp=8, zero=z) for z in (0, 1, 2, 3)])
  state_bytes = {r['layout'].zero_stage: sum(r['state'].values()) for r in rows}
  assert state_bytes[0] > state_bytes[1] > state_bytes[2] > state_bytes[3], state_bytes
  args = {n: plan.measure(cfg, layout(fsdp=n, zero=3)).argument_bytes for n in (2, 8)}
  assert abs(args[8] * 8 / (args[2] * 2) - 1) < 0.10, args


def test_dp_grads_are_reduced_over_data_and_tp_activations_over_tensor(planned):
  _, rows = planned
  dp = rows[LAYOUTS['dp8'].name()]['measured'].by_axes
  assert {axes for _, axes in dp} == {('data',)}
  tp = rows[LAYOUTS['tp2_dp4'].name()]['measured'].by_axes
  assert ('all-reduce', ('tensor',)) in tp and any(a == ('data',) for _, a in tp)
  pp = rows[LAYOUTS['pp2_dp4'].name()]['measured'].by_axes
  assert ('collective-permute', ('stage',)) in pp


# ------------------------------------------------------------ the cost model's orderings

def synthetic(dot_flops=1e12, memory=1e9, dot_bytes=0.0, other_bytes=0.0, launches=0.0,
              **by_axes):
  """A Measured whose collectives are given as kind__axis=bytes (one execution each)."""
  entries = {(k.split('__')[0].replace('_', '-'), tuple(k.split('__')[1:])): (1.0, v)
             for k, v in by_axes.items()}
  kinds = {}
  for (kind, _), (c, b) in entries.items():
    kinds[kind] = (kinds.get(kind, (0, 0))[0] + c, kinds.get(kind, (0, 0))[1] + b)
  return planner.Measured(memory, 0, 0, 0, dot_flops, kinds, entries, dot_bytes, other_bytes,
                          launches)


def test_memory_bound_work_runs_at_hbm_bandwidth_and_matmuls_at_the_roofline():
  h200 = planner.hardware('h200')   # H100's compute, 4.8 TB/s instead of 3.35
  bandwidth = lambda hw: hw.hbm_bandwidth * planner.HBM_EFFICIENCY
  matmul_s = 1e12 / (H100.peak_flops * planner.MATMUL_EFFICIENCY)            # 1.7 ms
  # 10 GB through norms, softmax, the optimizer: 3.7 ms on an H100, more than the matmuls.
  step = synthetic(dot_flops=1e12, dot_bytes=1e9, other_bytes=10e9)
  p100, p200 = (planner.predict(step, layout(), hw, 1e12, 1000) for hw in (H100, h200))
  assert p100.memory_s == pytest.approx(10e9 / bandwidth(H100))
  assert p100.matmul_s == pytest.approx(matmul_s)     # 1 GB of matmul traffic: compute-bound
  assert p100.step_s == pytest.approx(matmul_s + p100.memory_s + planner.STEP_SECONDS)
  assert p100.dominant == 'memory-bound ops'
  assert p200.step_s < p100.step_s and p200.matmul_s == p100.matmul_s
  # Matmuls with little reuse (10 GB for 1 TFLOP) are bound by their traffic instead.
  thin = planner.predict(synthetic(dot_flops=1e12, dot_bytes=10e9), layout(), H100, 1e12,
                         1000)
  assert thin.matmul_s == pytest.approx(10e9 / bandwidth(H100)) and thin.dominant == 'matmuls'


def test_a_step_of_small_kernels_is_bound_by_their_launches_and_dispatch():
  """Each kernel launched costs LAUNCH_SECONDS and each step STEP_SECONDS on top of the
  roofline: a small model's step (thousands of kernels, a few MB each) is made of those,
  not of its FLOPs or bytes."""
  small = dict(dot_flops=1e9, dot_bytes=1e7, other_bytes=4e9)
  quiet, busy = (planner.predict(synthetic(**small, launches=n), layout(), H100, 1e9, 1000)
                 for n in (0, 5000))
  assert quiet.launch_s == 0 and quiet.dominant == 'memory-bound ops'
  assert quiet.step_s == pytest.approx(quiet.matmul_s + quiet.memory_s
                                       + planner.STEP_SECONDS)
  assert busy.launch_s == pytest.approx(5000 * planner.LAUNCH_SECONDS)
  assert busy.step_s == pytest.approx(quiet.step_s + busy.launch_s)
  assert busy.compute_s == pytest.approx(busy.matmul_s + busy.memory_s + busy.launch_s)
  assert busy.dominant == 'kernel launches'
  tiny = planner.predict(synthetic(dot_flops=1e6, other_bytes=1e6, launches=10), layout(),
                         H100, 1e6, 10)
  assert tiny.dominant == 'step dispatch'
  assert tiny.step_s == pytest.approx(tiny.compute_s + planner.STEP_SECONDS)


def test_tensor_parallel_across_hosts_is_slower_than_within_one():
  measured = synthetic(all_reduce__tensor=4e9)
  lay = layout(tensor=8)
  within = planner.predict(measured, lay, H100, 1e12, 1000)
  across = planner.predict(measured, lay, dataclasses.replace(H100, gpus_per_host=4), 1e12,
                           1000)
  assert across.step_s > within.step_s * 2, (within.step_s, across.step_s)


def test_a_layout_that_does_not_fit_is_never_ranked_first():
  fast_but_big = {'layout': layout(data=8),
                  'prediction': planner.predict(synthetic(memory=200e9), layout(data=8),
                                                H100, 1e12, 1000)}
  slow = {'layout': layout(fsdp=8, zero=3),
          'prediction': planner.predict(synthetic(dot_flops=1e14, memory=10e9),
                                        layout(fsdp=8, zero=3), H100, 1e12, 1000)}
  assert not fast_but_big['prediction'].fits
  assert fast_but_big['prediction'].step_s < slow['prediction'].step_s
  assert planner.rank([fast_but_big, slow])[0] is slow
  assert 'GiB per device' in fast_but_big['prediction'].why_not


def test_with_a_tiny_interconnect_communication_dominates_and_pure_dp_falls_behind():
  # Compute 1.7 ms on an H100. DP: 0.8 ms of gradient all-reduce, hidden behind it;
  # TP: 0.3 ms of activation all-reduces on the critical path, less gradient traffic.
  dp = (layout(data=8), synthetic(all_reduce__data=2e8))
  tp = (layout(data=2, tensor=4), synthetic(all_reduce__tensor=1e8, all_reduce__data=5e7))
  def ranked(hw):
    rows = [{'layout': l, 'prediction': planner.predict(m, l, hw, 1e12, 1000)}
            for l, m in (dp, tp)]
    return planner.rank(rows)
  normal = ranked(H100)
  assert normal[0]['layout'] == dp[0]   # DP's reduction hides behind compute
  slow = dataclasses.replace(H100, intra_bandwidth=1e8, inter_bandwidth=1e8)
  tiny = ranked(slow)
  assert tiny[0]['layout'] == tp[0]
  assert tiny[1]['prediction'].dominant.startswith('comm')


# --------------------------------------------------------------------- extrapolation

def test_few_layer_extrapolation_matches_a_full_compile():
  """2- and 3-layer compiles extrapolated to 6 layers. 128-token sequences: at 16 the
  per-layer activations are so small that XLA:CPU's buffer reuse makes the temporaries
  jump around with the layer count (measured up to 20%) and nothing is linear."""
  cfg = planner_config(layers=6)
  cfg.model = dataclasses.replace(cfg.model, max_seq_len=128)
  cfg.data.seq_len = 128
  for lay in (layout(fsdp=8, zero=3, remat='full'), layout(data=4, tensor=2)):
    full = plan.measure(cfg, lay)
    guess = plan.measure(cfg, lay, layers=(2, 3))
    assert abs(guess.peak_bytes / full.peak_bytes - 1) < 0.05, (guess, full)
    # FLOPs are a per-layer cost plus the rest, and so is memory traffic, up to what
    # XLA:CPU chooses to copy or fuse at each depth (a fraction of a percent here).
    assert guess.dot_flops == pytest.approx(full.dot_flops, rel=1e-9)
    for key in ('dot_bytes', 'other_bytes', 'launches'):
      assert getattr(guess, key) == pytest.approx(getattr(full, key), rel=0.01), key
    assert full.launches > 0
    assert guess.by_axes.keys() == full.by_axes.keys()
    for key, (count, nbytes) in full.by_axes.items():
      assert guess.by_axes[key][0] == pytest.approx(count), key
      assert guess.by_axes[key][1] == pytest.approx(nbytes), key


# ------------------------------------------------------------------------------- CLI

def cli(*args):
  # os.environ names the suite's compilation cache (tests/conftest.py)
  return subprocess.run([sys.executable, '-m', 'training.plan_cli', *args], capture_output=True,
                        text=True, timeout=300)


@pytest.mark.parametrize('args, message', [
    (['--devices', '7'], 'no layout of this config runs on 7 devices'),
    (['--devices', '8', '--device', 'tpu9'], "unknown device 'tpu9'"),
    (['--devices', '1', '--zero', '3'], 'no layout tried has fsdp > 1: add ZeRO stage 0'),
    (['--devices', '1', '--batch-size', '-2'], '--batch-size -2: give a positive count'),
    (['--devices', '1', '--max-compiles', '-1'], '--max-compiles -1: give a count >= 0'),
    (['--devices', '1', '--max-seconds', '-5'], '--max-seconds -5.0: give a count >= 0'),
    (['--devices', '1', '--jobs', '0'], '--jobs 0: give at least 1'),
])
def test_cli_rejects_impossible_requests(args, message):
  result = cli('--config=default.py:tiny', *args)
  assert result.returncode == 2, result.stderr[-2000:]
  assert message in result.stderr and 'Traceback' not in result.stderr, result.stderr[-2000:]


def test_cli_ranks_and_writes_json_and_csv(tmp_path):
  """--batch-size 4 (the tiny config has 8): planned at 4 sequences of 32 tokens a step
  (each row's tokens/s is 4 x 32 over its step time), and every train.py command sets it.
  Progress names each compile, how many may follow and, once one has finished, the best
  row so far; a second run reads every layout's numbers from the first's cache and compiles
  nothing."""
  args = ['--config=default.py:tiny', '--devices', '2', '--zero', '0', '--remat', 'full',
          '--batch-size', '4', '--cache-dir', str(tmp_path / 'cache')]
  result = cli(*args, '--output', str(tmp_path))
  assert result.returncode == 0, result.stderr[-2000:]
  progress = re.findall(r'compiling (\d+)/(\d+): (.+) \((\d+) left\)', result.stderr)
  lines = [l for l in result.stderr.splitlines() if l.startswith('compiling')]
  # Two compiles run at once (--jobs: the CPU count): the best so far shows from the
  # first compile to finish on.
  assert 'best so far' not in lines[0] and '; best so far: ' in lines[-1], lines
  assert [int(k) for k, _, _, _ in progress] == list(range(1, len(progress) + 1))
  assert all(int(k) + int(left) == int(n) for k, n, _, left in progress), progress
  # data2 and fsdp2 at ZeRO-0 are one program (plan.program_key): one compile for both.
  assert (': 5 layouts, 4 compiled, 1 the same program as one compiled, 0 from the cache, '
          '0 not compiled') in result.stdout
  again = cli(*args, '--output', str(tmp_path / 'again'))
  assert again.returncode == 0, again.stderr[-2000:]
  assert 'compiling' not in again.stderr
  assert (': 5 layouts, 0 compiled, 0 the same program as one compiled, 5 from the cache, '
          '0 not compiled') in again.stdout
  assert again.stdout.split('\n', 1)[1] == result.stdout.split('\n', 1)[1]
  assert 'GiB/dev' in result.stdout
  assert ('run the best with: python train.py --config=default.py:tiny '
          '--config.data.batch_size=4 --config.mesh.') in result.stdout, result.stdout
  import json  # pylint: disable=import-outside-toplevel
  data = json.loads((tmp_path / 'plan.json').read_text())
  assert data['batch_size'] == 4 and data['rows']
  for r in data['rows']:
    assert r['overrides'].startswith('--config.data.batch_size=4 --config.mesh.data=')
    assert r['tokens_per_s'] == pytest.approx(4 * 32 / r['step_s'])
  assert (tmp_path / 'plan.csv').read_text().startswith('layout,fits,')


# ------------------------------------------------------------------ efficiency fit

def test_efficiency_fit_recovers_the_factors_that_made_the_times():
  made = lambda m, e_mm, e_hbm, launch=0.0, step=0.0: (
      m.dot_flops / (H100.peak_flops * e_mm) + m.other_bytes / (H100.hbm_bandwidth * e_hbm)
      + m.launches * launch + step)
  every = list(planner.FACTORS)
  # Five runs with launch counts: all four factors.
  steps = [synthetic(dot_flops=f, other_bytes=b, launches=n)
           for f, b, n in ((1e12, 1e9, 2e3), (1e12, 8e9, 1e3), (4e12, 2e9, 8e3),
                           (1e9, 1e8, 4e3), (2e9, 1e9, 500))]
  fit = planner.fit_efficiency([(m, made(m, 0.45, 0.7, 3e-6, 1e-3)) for m in steps], H100,
                               every)
  assert fit['fitted'] == every
  assert fit['matmul_efficiency'] == pytest.approx(0.45)
  assert fit['hbm_efficiency'] == pytest.approx(0.7)
  assert fit['launch_seconds'] == pytest.approx(3e-6)
  assert fit['step_seconds'] == pytest.approx(1e-3)
  assert fit['rms_relative_error'] == pytest.approx(0, abs=1e-9)
  assert fit['table']['rms_relative_error'] > 0.05
  assert fit['matmul_only']['rms_relative_error'] > 0.05   # the other terms are needed
  # Only the factors named are fitted; the rest keep the table's values.
  table_hbm = [(m, made(m, 0.45, planner.HBM_EFFICIENCY, 3e-6, 1e-3)) for m in steps]
  fit = planner.fit_efficiency(table_hbm, H100,
                               ['matmul_efficiency', 'launch_seconds', 'step_seconds'])
  assert fit['fitted'] == ['matmul_efficiency', 'launch_seconds', 'step_seconds']
  assert fit['hbm_efficiency'] == planner.HBM_EFFICIENCY
  assert fit['launch_seconds'] == pytest.approx(3e-6)
  assert fit['rms_relative_error'] == pytest.approx(0, abs=1e-9)
  # No launch counts (results recorded without them): the launch cost cannot be told
  # apart and keeps the table's (it adds nothing); the rest are fitted.
  steps = [synthetic(dot_flops=f, other_bytes=b)
           for f, b in ((1e12, 1e9), (1e12, 8e9), (4e12, 2e9), (1e9, 1e8))]
  fit = planner.fit_efficiency([(m, made(m, 0.45, 0.7, step=1e-3)) for m in steps], H100,
                               every)
  assert fit['fitted'] == ['matmul_efficiency', 'hbm_efficiency', 'step_seconds']
  assert fit['matmul_efficiency'] == pytest.approx(0.45)
  assert fit['hbm_efficiency'] == pytest.approx(0.7)
  assert fit['launch_seconds'] == planner.LAUNCH_SECONDS
  assert fit['rms_relative_error'] == pytest.approx(0, abs=1e-9)
  # The same mix in every run and no step cost: only the matmul factor.
  same = [synthetic(dot_flops=f, other_bytes=f / 500) for f in (1e12, 2e12)]
  fit = planner.fit_efficiency(
      [(m, made(m, 0.45, planner.HBM_EFFICIENCY, step=planner.STEP_SECONDS)) for m in same],
      H100, ['matmul_efficiency', 'hbm_efficiency'])
  assert fit['fitted'] == ['matmul_efficiency']
  assert fit['matmul_efficiency'] == pytest.approx(0.45)
  assert fit['hbm_efficiency'] == planner.HBM_EFFICIENCY
  # Matmuls bound by their traffic in every run: no FLOPs term, its factor held.
  thin = [synthetic(dot_flops=f, dot_bytes=f, other_bytes=f / 4) for f in (1e9, 2e9, 8e9)]
  took = lambda m: ((m.dot_bytes + m.other_bytes) / (H100.hbm_bandwidth * 0.5)
                    + planner.STEP_SECONDS)
  fit = planner.fit_efficiency([(m, took(m)) for m in thin], H100,
                               ['matmul_efficiency', 'hbm_efficiency'])
  assert fit['fitted'] == ['hbm_efficiency'] and fit['hbm_efficiency'] == pytest.approx(0.5)
  assert fit['matmul_efficiency'] == planner.MATMUL_EFFICIENCY
  assert fit['rms_relative_error'] == pytest.approx(0, abs=1e-9)
  with pytest.raises(ValueError, match='name some of'):
    planner.fit_efficiency([(same[0], 1.0)], H100, ['hbm'])
  with pytest.raises(ValueError, match='no runs'):
    planner.fit_efficiency([], H100)


def test_efficiency_fit_uses_predicts_model_and_settles_which_matmuls_are_traffic_bound(
    monkeypatch):
  """Step times made by predict itself under other factors, some runs' matmuls bound by
  their traffic under those factors but not under the table's (or the other way): the fit
  classifies them again until it settles, and recovers all four factors exactly."""
  truth = {'MATMUL_EFFICIENCY': 0.3, 'HBM_EFFICIENCY': 0.9, 'LAUNCH_SECONDS': 2e-6,
           'STEP_SECONDS': 1e-3}
  ratio = H100.peak_flops / H100.hbm_bandwidth
  # (FLOPs, matmul traffic time over FLOPs time at peak, other bytes, launches)
  shapes = ((1e12, 0.1, 1e9, 1e3), (1e12, 2.0, 8e9, 3e3), (4e12, 0.5, 2e9, 2e4),
            (1e9, 5.0, 1e8, 4e3), (2e10, 2.0, 1e9, 500), (5e11, 0.2, 3e10, 100))
  steps = [synthetic(dot_flops=f, dot_bytes=r * f / ratio, other_bytes=b, launches=n)
           for f, r, b, n in shapes]
  bound = lambda m, e_mm, e_hbm: (m.dot_flops / (H100.peak_flops * e_mm)
                                  < m.dot_bytes / (H100.hbm_bandwidth * e_hbm))
  table = [bound(m, planner.MATMUL_EFFICIENCY, planner.HBM_EFFICIENCY) for m in steps]
  true = [bound(m, 0.3, 0.9) for m in steps]
  assert table != true   # the table misjudges some: the fit must find out
  with monkeypatch.context() as patched:
    for name, value in truth.items():
      patched.setattr(planner, name, value)
    times = [planner.predict(m, layout(), H100, 1e12, 1000).step_s for m in steps]
  fit = planner.fit_efficiency(list(zip(steps, times)), H100)
  assert fit['fitted'] == list(planner.FACTORS) and fit['converged']
  for name, value in zip(planner.FACTORS, truth.values()):
    assert fit[name] == pytest.approx(value, rel=1e-6), name
  assert fit['rms_relative_error'] == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_flash_kernels_are_costed_analytically_and_the_rest_matches_xla_attention(remat):
  """attention_impl=pallas runs the flash kernels, whose dots the HLO cannot count (the
  interpreter's loops have no trip counts; on a GPU they are custom calls): the planner
  counts them analytically from the kernel calls. Everything else is the same program as
  with XLA's attention, whose dots hlo.py counts exactly: 2 T^2 H D per matmul of a
  sequence's layer, 2 matmuls forward, 4 backward, 2 more when remat recomputes them."""
  lay = layout(data=8, remat=remat)
  flops = {}
  for impl in ('xla', 'pallas'):
    cfg = planner_config()
    cfg.model = dataclasses.replace(cfg.model, attention_impl=impl)
    flops[impl] = plan.compile_layout(cfg, lay).dot_flops
  m, t = cfg.model, cfg.data.seq_len
  per_matmul = (2 * t * t * m.num_heads * m.resolved_head_dim * m.num_layers
                * cfg.data.batch_size / 8)
  recompute = 2 if remat == 'full' else 0
  xla_attention = (2 + 4 + recompute) * per_matmul
  # Flash: causal halves every matmul; forward 2 (+2 recomputed), dq 3, dkv 4.
  flash = (2 + 3 + 4 + recompute) * per_matmul / 2
  assert flops['pallas'] == pytest.approx(flops['xla'] - xla_attention + flash, rel=1e-9)


def test_pallas_attention_is_planned_from_a_cpu_compile_only(monkeypatch):
  """On a GPU the flash kernels compile to calls the planner cannot cost: it says where
  to plan instead of returning a step without their FLOPs."""
  cfg = planner_config()
  cfg.model = dataclasses.replace(cfg.model, attention_impl='pallas')
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  with pytest.raises(ValueError, match='python -m training.plan_cli'):
    plan.compile_layout(cfg, layout(data=8))


# ------------------------------------------------- the pruned search and its lower bound

SEARCH = dict(zero_stages=(0, 1, 3), remats=('none', 'full'))   # 14 layouts on 2 devices
# Compute a million times slower than an H100's: the tiny model's step is its matmuls,
# as a large model's is, so the bound is close and prunes (on the real table this model
# is launches and dispatch, which the bound cannot see, and it prunes nothing).
SLOW = dataclasses.replace(H100, name='slow', peak_flops=H100.peak_flops * 1e-6)
# Every layout's parameters and optimizer state overflow it: ranked by memory instead.
SMALL = dataclasses.replace(H100, name='small', hbm_bytes=1e3)


@pytest.fixture(scope='module')
def searches():
  """The pruned search on SLOW (top 2), then the full search on H100 with every layout
  compiled apart (alike=False), each compile run once (memoized across the two: a
  layout compiled for itself, or first of the layouts one compile stood for); the
  layouts the pruned search compiled, or read off another's compile."""
  cfg = planner_config()
  memo, compiled = {}, []
  real = plan.compile_alike

  def compile_once(cfg, lays, layers=None, devices=None):
    compiled.extend(lay.name() for lay in lays)
    if len(lays) > 1 or lays[0].name() not in memo:
      found = real(cfg, lays, layers, devices)
      memo.setdefault(lays[0].name(), found[0])
      return found
    return [memo[lays[0].name()]]

  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(planner.HARDWARE, 'slow', SLOW)
    patch.setattr(plan, 'compile_alike', compile_once)
    pruned = plan.search(cfg, 2, 'slow', top=2, **SEARCH), list(compiled)
    full = plan.search(cfg, 2, 'h100', alike=False, **SEARCH)
  assert not full.rejected and full.compiled == len(full.rows), full
  return cfg, pruned, full.rows


def full_ranking(full, hw, cfg):
  """The full search's rows re-predicted on `hw` (the same compiles), ranked."""
  tokens = cfg.data.batch_size * cfg.data.seq_len
  flops = model.flops_per_token(cfg.model, cfg.data.seq_len) * tokens
  return planner.rank([{**r, 'prediction': planner.predict(r['measured'], r['layout'], hw,
                                                           flops, tokens)} for r in full])


def test_pruned_search_prints_the_full_searchs_top_rows_compiling_fewer(searches):
  cfg, (found, compiled), full = searches
  assert len(full) == 14
  assert found.compiled + found.shared == len(compiled) < len(full), compiled
  assert len(compiled) + len(found.pruned) == len(full) and found.exact >= 2
  want = full_ranking(full, SLOW, cfg)[:2]
  got = found.rows[:2]
  assert [r['layout'] for r in got] == [r['layout'] for r in want]
  assert [r['prediction'].step_s for r in got] == [r['prediction'].step_s for r in want]
  # What it skipped could not have ranked there: its bound is above the second row.
  for _, bound in found.pruned:
    assert planner.rank_key(bound) > planner.rank_key(want[1]['prediction'])


def test_layouts_of_one_program_compile_once_and_read_as_their_own_compiles(monkeypatch):
  """ZeRO-0 layouts that split the batch over data and fsdp differently (stage 1) are
  one program: the search compiles it once and reads it as each layout, and every
  number and prediction equals that layout's own compile. The split moves collectives
  over part of the batch devices between the axes (data2xfsdp2: over fsdp, two devices;
  fsdp4: four), which changes their predicted time: each layout's collectives are read
  against its own mesh, not copied. ZeRO-1 shards over fsdp alone: compiled apart."""
  cfg = planner_config()
  lays = [layout(data=4, tensor=2), layout(fsdp=4, tensor=2),
          layout(data=2, fsdp=2, tensor=2), layout(fsdp=4, tensor=2, zero=1)]
  calls, real = [], plan.compile_alike
  def counted(cfg, group, layers=None, devices=None):
    calls.append([lay.name() for lay in group])
    return real(cfg, group, layers, devices)
  monkeypatch.setattr(plan, 'compile_alike', counted)
  shared = plan.search(cfg, 8, 'h100', layouts=lays)
  assert sorted(map(len, calls)) == [1, 3], calls
  assert (shared.compiled, shared.shared) == (2, 2)
  own = plan.search(cfg, 8, 'h100', layouts=lays, alike=False)
  assert own.compiled == 4 and own.shared == 0
  assert [r['layout'] for r in shared.rows] == [r['layout'] for r in own.rows]
  for a, b in zip(shared.rows, own.rows):
    assert a['measured'] == b['measured'], a['layout'].name()
    assert a['prediction'] == b['prediction'], a['layout'].name()
  by_name = {r['layout'].name(): r for r in own.rows}
  axes = [{a for _, a in by_name[lay.name()]['measured'].by_axes} for lay in lays[:3]]
  assert axes[0] != axes[1] != axes[2], axes
  assert len({by_name[lay.name()]['prediction'].step_s for lay in lays[:3]}) > 1


@pytest.mark.parametrize('hw', [H100, SLOW, SMALL], ids=lambda hw: hw.name)
def test_lower_bound_is_below_every_compiled_prediction(hw, searches):
  """For every layout of the search (DP, FSDP at ZeRO 0/1/3, TP, CP, PP; remat none and
  full): the bound from analytic floors against the compiled step's own prediction."""
  cfg, _, full = searches
  for row in full_ranking(full, hw, cfg):
    lay, got, m = row['layout'], row['prediction'], row['measured']
    size = describe.run_size(plan.configure(cfg, lay), 2)
    floor = plan_bound.floor(plan.configure(cfg, lay), lay, size)
    bound = planner.lower_bound(floor, lay, hw)
    assert bound.step_s <= got.step_s, (lay.name(), bound, got)
    assert planner.rank_key(bound) <= planner.rank_key(got), lay.name()
    assert floor.dot_flops <= m.dot_flops and floor.other_bytes <= m.other_bytes, lay.name()
    assert floor.memory_bytes <= m.argument_bytes, lay.name()
    for axes, count in floor.exposed.items():
      crossing = sum(c for (_, a), (c, _) in m.by_axes.items() if set(axes) <= set(a))
      assert count <= crossing, (lay.name(), axes, count, m.by_axes)


def test_cache_keys_the_whole_program_and_reads_back_what_it_kept(tmp_path, monkeypatch):
  """An entry comes back equal for the same config and layout; another layout, another
  field of the config, other source code or other XLA flags each miss; a damaged entry
  misses (it is compiled again) instead of failing the search."""
  cfg = plan.configure(planner_config(), layout(fsdp=2, zero=3))
  measured = synthetic(dot_flops=3e9, dot_bytes=1e8, other_bytes=2e8, launches=700,
                       all_gather__fsdp=1e6, all_reduce__data__tensor=5e5)
  cache = plan_cache.MeasureCache(str(tmp_path))
  assert cache.get(cfg) is None
  cache.put(cfg, measured)
  assert cache.get(cfg) == measured and cache.get(copy.deepcopy(cfg)) == measured
  assert cache.get(plan.configure(cfg, layout(fsdp=2, zero=1))) is None
  other = copy.deepcopy(cfg)
  other.optim.learning_rate *= 2
  assert cache.get(other) is None
  monkeypatch.setattr(plan_cache, 'source_digest', lambda: 'edited')
  assert cache.get(cfg) is None
  monkeypatch.undo()
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  assert cache.get(cfg) is None
  monkeypatch.undo()
  (tmp_path / f'{cache.key(cfg)}.json').write_text('{"dot_flops": ')
  assert cache.get(cfg) is None


def test_search_compiles_by_bound_until_no_layout_left_can_reach_the_top_rows(
    tmp_path, monkeypatch):
  """Bounds and compiled steps made up (milliseconds over the dispatch): the search
  compiles by bound, stops once the next bound is above the second-best compile, reports
  each compile with how many may follow, vouches only for the rows --max-compiles
  proves, and a second search reads the first's cache and compiles nothing."""
  names = ['dp8', 'zero3_fsdp8', 'tp2_dp4', 'fsdp4_tp2', 'cp2_dp4', 'pp2_dp4']
  bound_ms = dict(zip(names, [1, 2, 3, 4, 5, 6]))
  step_ms = dict(zip(names, [5, 2.5, 3.5, 4.5, 5.5, 6.5]))
  flops = lambda ms: ms * 1e-3 * H100.peak_flops * planner.MATMUL_EFFICIENCY
  by_layout = {LAYOUTS[n].name(): n for n in names}
  monkeypatch.setattr(plan_bound, 'floor', lambda cfg, lay, size: planner.Floor(
      flops(bound_ms[by_layout[lay.name()]]), 0.0, 0.0, {}))
  compiled = []
  def fake_compile(cfg, lays, layers=None, devices=None):
    assert len(lays) == 1   # no two of these layouts are one program
    compiled.append(by_layout[lays[0].name()])
    return [synthetic(dot_flops=flops(step_ms[by_layout[lays[0].name()]]))]
  monkeypatch.setattr(plan, 'compile_alike', fake_compile)
  cfg, lays = planner_config(), [LAYOUTS[n] for n in names]
  seen = []
  progress = lambda k, n, lay, left, best: seen.append(
      (k, n, by_layout[lay.name()], left, best and by_layout[best['layout'].name()]))
  cache = plan_cache.MeasureCache(str(tmp_path))
  found = plan.search(cfg, 8, top=2, layouts=lays, progress=progress, cache=cache)
  assert compiled == ['dp8', 'zero3_fsdp8', 'tp2_dp4']
  # After two compiles the cut is the second best, 5 ms: bounds 4 and 5 may still need one.
  # Each compile names the best row so far: the answer once the compiles left are done.
  assert seen == [(1, 6, 'dp8', 5, None), (2, 6, 'zero3_fsdp8', 4, 'dp8'),
                  (3, 5, 'tp2_dp4', 2, 'zero3_fsdp8')]
  ranked = [by_layout[r['layout'].name()] for r in found.rows]
  assert ranked[:2] == ['zero3_fsdp8', 'tp2_dp4'] and found.exact == 2   # as a full search
  assert [by_layout[l.name()] for l, _ in found.pruned] == ['fsdp4_tp2', 'cp2_dp4', 'pp2_dp4']
  assert (found.compiled, found.cached) == (3, 0)
  compiled.clear()
  again = plan.search(cfg, 8, top=2, layouts=lays, cache=cache)
  assert compiled == [] and (again.compiled, again.cached) == (0, 3)
  assert [r['layout'] for r in again.rows] == [r['layout'] for r in found.rows]
  # Two compiles only: dp8 (5 ms) may be beaten by tp2_dp4 (bound 3): one row vouched for.
  capped = plan.search(cfg, 8, top=2, layouts=lays, max_compiles=2)
  assert [by_layout[r['layout'].name()] for r in capped.rows] == ['zero3_fsdp8', 'dp8']
  assert capped.exact == 1


def test_search_in_worker_processes_equals_one_at_a_time(tmp_path):
  """jobs=2 compiles in two spawned processes (each with this process's 8 CPU devices
  and XLA_FLAGS): the same rows, numbers and predictions as compiling here one at a
  time, and the workers' compiles land in the cache the next search reads."""
  cfg = planner_config()
  lays = [layout(data=8), layout(fsdp=8, zero=3), layout(data=4, tensor=2),
          layout(fsdp=4, tensor=2, zero=1)]
  here = plan.search(cfg, 8, 'h100', layouts=lays)
  cache = plan_cache.MeasureCache(str(tmp_path))
  pooled = plan.search(cfg, 8, 'h100', layouts=lays, jobs=2, cache=cache)
  assert pooled.compiled == here.compiled == 4
  assert [r['layout'] for r in pooled.rows] == [r['layout'] for r in here.rows]
  for a, b in zip(pooled.rows, here.rows):
    assert a['measured'] == b['measured'] and a['prediction'] == b['prediction']
  again = plan.search(cfg, 8, 'h100', layouts=lays, cache=cache)
  assert (again.compiled, again.cached) == (0, 4)


def test_search_stops_at_its_time_budget_and_vouches_only_for_what_it_proved(monkeypatch):
  """max_seconds: the first compile always runs; once the budget is spent no new one
  starts, the layouts left are listed as not compiled and `exact` counts only the rows
  no uncompiled layout's bound could beat."""
  cfg = planner_config()
  lays = [layout(data=8), layout(fsdp=8, zero=3), layout(data=4, tensor=2)]
  real, calls = plan.compile_alike, []
  def slow(cfg, group, layers=None, devices=None):
    calls.append(group)
    out = real(cfg, group, layers, devices)
    time.sleep(0.2)
    return out
  monkeypatch.setattr(plan, 'compile_alike', slow)
  found = plan.search(cfg, 8, 'h100', layouts=lays, max_seconds=0.1)
  assert found.compiled == len(calls) == 1 and len(found.pruned) == 2
  least = min(planner.rank_key(b) for _, b in found.pruned)
  assert found.exact == sum(planner.rank_key(r['prediction']) < least for r in found.rows)


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_lower_bound_of_a_lora_run_is_below_its_compiled_step(remat):
  """A LoRA run's frozen base has no weight gradients: its compiled step does about two
  forwards of the base, not three, and the floor must stay below it (a floor above the
  compile would prune layouts that rank first)."""
  cfg = planner_config()
  cfg.lora = dataclasses.replace(cfg.lora, rank=4)
  for lay in (layout(data=8, remat=remat), layout(fsdp=4, tensor=2, zero=3, remat=remat)):
    size = describe.run_size(plan.configure(cfg, lay), 8)
    floor = plan_bound.floor(plan.configure(cfg, lay), lay, size)
    got = plan.compile_layout(cfg, lay)
    assert 0.5 * got.dot_flops < floor.dot_flops <= got.dot_flops, (lay.name(), floor, got)
    assert floor.memory_bytes <= got.argument_bytes, lay.name()
