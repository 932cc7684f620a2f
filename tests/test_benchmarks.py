"""The GPU benchmark scripts run end to end (CPU smoke mode: tiny shapes, interpret)."""

import gzip
import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import attention, paged_decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_attention_benchmark_smoke():
  rows = attention.main(['--smoke'])
  assert {r['impl'] for r in rows} == {'pallas', 'xla'}
  assert all('error' not in r and math.isfinite(r['fwd_tflops']) for r in rows), rows


def test_paged_decode_benchmark_smoke():
  rows = paged_decode.main(['--smoke'])
  assert len(rows) == 2
  assert all(r['bandwidth_gbs'] > 0 and math.isfinite(r['fraction_of_copy']) for r in rows)


def test_attention_tile_sweep_smoke():
  rows = attention.main(['--smoke', '--tiles'])
  assert [r['tiles']['block_k_bwd'] for r in rows] == [16]
  assert all('error' not in r and math.isfinite(r['bwd_tflops']) for r in rows), rows


def test_attention_packed_documents_smoke():
  rows = attention.main(['--smoke', '--packed'])
  assert [(r['impl'], r['doc_len']) for r in rows] == [('pallas', 64), ('pallas', 16)]
  assert all('error' not in r and math.isfinite(r['bwd_vs_one_doc']) for r in rows), rows
  one_doc, packed = rows
  for key in ('fwd', 'bwd'):   # the ratios are the one-document row's time over this row's
    ratio = one_doc[f'{key}_ms'] / packed[f'{key}_ms']
    assert packed[f'{key}_vs_one_doc'] == pytest.approx(ratio)
  # Useful FLOPs count each document's own causal half: 4 b hq d t doc_len / 2 (b=1,
  # hq=4, d=32, t=64), not the whole row's triangle.
  for r in rows:
    useful = 4 * 4 * 32 * 64 * r['doc_len'] / 2
    assert r['fwd_tflops'] * r['fwd_ms'] * 1e9 == pytest.approx(useful)


def test_paged_decode_tile_sweep_smoke():
  rows = paged_decode.main(['--smoke', '--tiles'])
  assert [r['tiles'] for r in rows] == [dict(pages_per_block=2, num_warps=4, num_stages=2)]
  assert rows[0]['bandwidth_gbs'] > 0


def test_paged_decode_splits_sweep_smoke():
  rows = paged_decode.main(['--smoke', '--splits'])
  # Each case under the default and each split count, all against one split's output.
  assert [(r['batch'], r['num_kv_splits']) for r in rows] == [
      (b, k) for b in (1, 2) for k in ('default', 1, 2, 4)]
  assert all(r['max_abs_diff'] < 1e-5 and r['bandwidth_gbs'] > 0 for r in rows), rows


def test_planner_check_keeps_the_runs_when_they_alone_cannot_fit(tmp_path, monkeypatch):
  from benchmarks import planner_check   # pylint: disable=import-outside-toplevel
  from sharding import planner   # pylint: disable=import-outside-toplevel
  monkeypatch.setenv('MESHLM_RESULTS_DIR', str(tmp_path))
  runs = [{'layout': 'single zero0 remat=full accum1', 'measured_step_s': 0.02,
           'dot_flops': 1e12, 'dot_bytes': 1e9, 'other_bytes': 1e9, 'launches': 100}]
  monkeypatch.setattr(planner_check, 'check', lambda *a, **k: runs)

  def unfittable(*args, **kwargs):
    raise ValueError('none of the factors can be fitted to these runs')

  monkeypatch.setattr(planner, 'fit_efficiency', unfittable)
  result = planner_check.main(['--configs=default.py', '--device=h200'])
  assert 'fit' not in result and 'cannot be fitted' not in result['fit_error']
  assert 'none of the factors' in result['fit_error']
  [written] = os.listdir(tmp_path)
  assert json.load(open(tmp_path / written))['runs'] == runs


def test_hlo_fingerprint_ignores_names_and_sees_the_program():
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from benchmarks import hlo_fingerprint   # pylint: disable=import-outside-toplevel

  def first_name(x):
    return jnp.sin(x) * 2

  def other_name(y):
    return jnp.sin(y) * 2

  def other_program(x):
    return jnp.cos(x) * 2

  text = lambda f: hlo_fingerprint.canonical(
      jax.jit(f).lower(jnp.ones(8)).compile().as_text())
  assert text(first_name) == text(other_name)
  assert text(first_name) != text(other_program)
  assert 'metadata' not in text(first_name) and 'first_name' not in text(first_name)


MY_CONFIG = """
from training.cli import load_config_file

def get_config(variant=''):
  cfg = load_config_file('default.py:tiny')
  cfg.steps, cfg.data.cache_dir = 4, {cache!r}
  return cfg
"""


def test_train_throughput_on_a_config_outside_configs(tmp_path):
  """`python -m benchmarks.train_throughput --config=/some/path/mine.py`: the same
  --config handling as train.py, a path outside configs/ included."""
  (tmp_path / 'mine.py').write_text(MY_CONFIG.format(cache=str(tmp_path / 'cache')))
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'MESHLM_RESULTS_DIR': str(tmp_path / 'out')}
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.train_throughput', f'--config={tmp_path}/mine.py',
       '--config.optim.warmup_steps=1', '--warmup=1', '--profile_steps=2',
       f'--hlo_out={tmp_path}/step.txt.gz'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  [name] = os.listdir(tmp_path / 'out')
  assert name == 'train_mine_cpu.json'
  row = json.load(open(tmp_path / 'out' / name))
  assert row['config'] == 'mine' and row['steps'] == 4
  assert row['overrides'] == ['--config.optim.warmup_steps=1']
  assert row['tokens_per_sec'] == pytest.approx(8 * 32 / row['median_step_time_s'])
  assert math.isfinite(row['first_loss']) and math.isfinite(row['last_loss'])
  assert row['peak_memory_bytes'] is None   # the CPU keeps no memory statistics
  # Where the profiled steps' time went, by model scope: every layer's attention and mlp
  # forward and backward, the optimizer; the shares add up.
  prof = row['profile']
  scopes = {r['scope'] for r in prof['by_scope']}
  assert {'attention (forward)', 'attention (backward)', 'mlp (forward)', 'mlp (backward)',
          'optimizer'} <= scopes, scopes
  assert sum(r['fraction'] for r in prof['by_scope']) == pytest.approx(1)
  assert prof['largest_three'] == [r['scope'] for r in prof['by_scope'][:3]]
  assert 'largest: ' + ', '.join(prof['largest_three']) in result.stdout
  # The profiled step's compiled HLO, for a look at what XLA made of it: every top op is
  # an instruction there.
  with gzip.open(tmp_path / 'step.txt.gz', 'rt') as f:
    text = f.read()
  assert text.startswith('HloModule')
  assert all(f'%{r["op"]} = ' in text for r in prof['top_ops']), prof['top_ops']


def test_profile_files_each_ops_time_under_its_scope():
  """A 512x512 matmul and tanh under 'mlp' against an 8x8 multiply under 'attention':
  the trace must put nearly all the time in mlp, and the matmul first among the ops."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from benchmarks import profile   # pylint: disable=import-outside-toplevel

  def f(a, b):
    with jax.named_scope('mlp'):
      big = jnp.tanh(a @ b)
    with jax.named_scope('attention'):
      small = a[:8, :8] * 2
    return big.sum() + small.sum()

  a = jnp.ones((512, 512), jnp.float32)
  compiled = jax.jit(f).lower(a, a).compile()
  jax.block_until_ready(compiled(a, a))
  summary = profile.profile_compiled(compiled, lambda: compiled(a, a), steps=3)
  shares = {r['scope']: r['fraction'] for r in summary['by_scope']}
  assert shares['mlp (forward)'] > 0.8, shares
  from sharding import hlo   # pylint: disable=import-outside-toplevel
  comps, _ = hlo._parse_module(compiled.as_text())   # pylint: disable=protected-access
  top = next(i for c in comps.values() for i in c.instrs
             if i.name == summary['top_ops'][0]['op'])
  assert hlo._does_matmul(top, comps), top   # pylint: disable=protected-access
  assert summary['top_ops'][0]['scope'] == 'mlp (forward)'
  assert summary['top_ops'][0]['runs_per_step'] == 1
  assert 'mlp' in summary['top_ops'][0]['op_name'].split('/')


def test_profile_counts_an_ops_runs_per_step():
  """An op in a scanned loop runs once per iteration: the summary must say so (a kernel
  that runs more often than the model asks is told apart from a slow one that way)."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from benchmarks import profile   # pylint: disable=import-outside-toplevel
  from sharding import hlo   # pylint: disable=import-outside-toplevel

  def f(a, ws):
    def layer(x, w):
      with jax.named_scope('mlp'):
        return jnp.tanh(x @ w), None
    return jax.lax.scan(layer, a, ws)[0]

  a, ws = jnp.ones((64, 64)), jnp.ones((7, 64, 64))
  text = jax.jit(f).lower(a, ws).compile().as_text()
  comps, _ = hlo._parse_module(text)   # pylint: disable=protected-access
  matmul = hlo._does_matmul   # pylint: disable=protected-access
  dot = next(i.name for c in comps.values() for i in c.instrs if matmul(i, comps))
  summary = profile.summarize({dot: 7.0, 'mystery': 1.0}, text, 1)
  rows = {r['op']: r for r in summary['top_ops']}
  assert rows[dot]['runs_per_step'] == 7 and rows[dot]['scope'] == 'mlp (forward)'
  assert rows['mystery']['runs_per_step'] is None
  assert f'{dot} x7, 1000.000 ms  mlp (forward)' in profile.report(summary)

  # A loop whose trip count is data: its ops' runs are not known, not 1.
  def g(a, n):
    def body(c):
      with jax.named_scope('mlp'):
        return jnp.tanh(c[0] @ c[0]), c[1] + 1
    return jax.lax.while_loop(lambda c: c[1] < n, body, (a, 0))[0]

  text = jax.jit(g).lower(a, 3).compile().as_text()
  comps, _ = hlo._parse_module(text)   # pylint: disable=protected-access
  dot = next(i.name for c in comps.values() for i in c.instrs if matmul(i, comps))
  summary = profile.summarize({dot: 2.0}, text, 1)
  assert summary['top_ops'][0]['runs_per_step'] is None
  assert f'{dot} x?, 2000.000 ms a step  mlp (forward)' in profile.report(summary)


def test_profile_files_ops_outside_the_hlo_apart():
  """A GPU trace with command buffers on times buffers, not instructions (seen on an
  H200): they must show as such, not as forward work of the model."""
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from benchmarks import profile   # pylint: disable=import-outside-toplevel

  def f(a):
    with jax.named_scope('mlp'):
      return jnp.tanh(a @ a)

  text = jax.jit(f).lower(jnp.ones((64, 64))).compile().as_text()
  from sharding import hlo   # pylint: disable=import-outside-toplevel
  comps, _ = hlo._parse_module(text)   # pylint: disable=protected-access
  matmul = hlo._does_matmul   # pylint: disable=protected-access
  dot = next(i.name for c in comps.values() for i in c.instrs if matmul(i, comps))
  summary = profile.summarize({dot: 1.0, 'command_buffer_7': 6.0, 'mystery': 1.0}, text, 2)
  shares = {r['scope']: r['seconds_per_step'] for r in summary['by_scope']}
  assert shares == {
      'command buffers (set XLA_FLAGS=--xla_gpu_enable_command_buffer=)': 3.0,
      'mlp (forward)': 0.5, 'other (not in the HLO)': 0.5}, shares
  assert summary['largest_three'][0].startswith('command buffers')


def test_planner_check_smoke_runs_the_planners_top_layouts_and_fits(tmp_path, monkeypatch,
                                                                    capsys):
  from benchmarks import planner_check   # pylint: disable=import-outside-toplevel
  monkeypatch.setenv('MESHLM_RESULTS_DIR', str(tmp_path))
  result = planner_check.main(['--smoke', '--this-compile', '--batch-size=4'])
  runs = result['runs']
  # Planned and run at 4 sequences of the tiny config's 32 tokens (it has 8).
  assert all(r['tokens_per_step'] == 4 * 32 for r in runs)
  assert all(r['overrides'].startswith('--config.data.batch_size=4 ') for r in runs)
  assert sorted(r['layout'] for r in runs) == ['single zero0 remat=full accum1',
                                                'single zero0 remat=none accum1']
  for r in runs:
    assert r['measured_step_s'] > 0 and len(r['step_times_s']) == 2
    assert r['predicted_step_s'] > 0 and math.isfinite(r['loss'])
    assert r['measured_over_predicted'] == pytest.approx(r['measured_step_s']
                                                         / r['predicted_step_s'])
  # Planned in its own CPU process; on this CPU, the same program as compiled here.
  for r in runs:
    here = r['this_platform_compile']
    assert (here['dot_flops'], here['dot_bytes'], here['other_bytes'], here['launches']) == (
        r['dot_flops'], r['dot_bytes'], r['other_bytes'], r['launches'])
    assert r['launches'] > 0 and r['launch_s'] > 0
    assert here['memory_bytes'] == r['predicted_memory_bytes']
  # remat=full recomputes the forward: more dot FLOPs for the same step.
  flops = {r['layout'].split()[2]: r['dot_flops'] for r in runs}
  assert flops['remat=full'] > flops['remat=none']
  [written] = os.listdir(tmp_path)
  assert json.load(open(tmp_path / written))['fit'] == result['fit']   # floats round-trip
  assert planner_check.main(['--fit', str(tmp_path / written)])['fit'] == result['fit']
  # Planned again (today's planner, a CPU process of its own): the same planner side, the
  # measured times kept, so the same fit.
  replanned = planner_check.main(['--fit', str(tmp_path / written), '--replan'])
  assert replanned['runs'] == runs and replanned['fit'] == result['fit']
  assert replanned['planned_with_jax'] == replanned['runs_planned_with_jax'][0]
  # Runs recorded before launches were counted are refitted only with --replan.
  old = json.load(open(tmp_path / written))
  for r in old['runs']:
    del r['launches']
  json.dump(old, open(tmp_path / 'old.json', 'w'))
  with pytest.raises(SystemExit):
    planner_check.main(['--fit', str(tmp_path / 'old.json')])
  assert 'add --replan' in capsys.readouterr().err
  assert planner_check.main(['--fit', str(tmp_path / 'old.json'),
                             '--replan'])['fit'] == result['fit']


@pytest.mark.parametrize('platform, kind, row', [
    ('gpu', 'NVIDIA H200', 'h200'), ('gpu', 'NVIDIA H100 80GB HBM3', 'h100'),
    ('gpu', 'NVIDIA A100-SXM4-80GB', 'a100'), ('cpu', 'cpu', 'h100'),
    ('gpu', 'NVIDIA B200', None)])
def test_planner_check_reads_the_gpu_kind_for_its_hardware_row(monkeypatch, platform, kind,
                                                               row):
  """The predictions use this GPU's row of the hardware table, not the default's (an H200
  has 4.8 TB/s where an H100 has 3.35); a GPU the table lacks asks for --device."""
  import types   # pylint: disable=import-outside-toplevel
  import jax   # pylint: disable=import-outside-toplevel
  from benchmarks import planner_check   # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(jax, 'devices', lambda: [types.SimpleNamespace(platform=platform,
                                                                      device_kind=kind)])
  if row is None:
    with pytest.raises(ValueError, match="'NVIDIA B200': name one with --device"):
      planner_check.detect_device()
  else:
    assert planner_check.detect_device() == row


def test_guided_decoding_benchmark_smoke():
  """Trains its small BPE, prepares each guide and walks it: every guide timed tokens."""
  from benchmarks import guided_decoding  # pylint: disable=import-outside-toplevel
  out = guided_decoding.main(['--smoke'])
  (vocab, guides), = out['by_vocabulary'].items()
  assert int(vocab) > 1000 and set(guides) == {'regex', 'tool_schema', 'grammar',
                                                'tool_schema_llguidance'}
  assert all(g['tokens_timed'] > 0 and 0 < g['step_ms_median'] <= g['step_ms_max']
             for g in guides.values()), guides
  assert guides['grammar']['library'] == 'llguidance'
  assert guides['grammar']['vocabulary_s'] is not None and guides['regex']['vocabulary_s'] is None


# An HLO module as XLA dumps it: a 16-step loop whose body calls a Mosaic GPU kernel, and
# CALLS more calls of it beside the first (what a pass that clones the kernel leaves).
PASS_DUMP = """HloModule jit_step

%body (c: (s32[], f32[4])) -> (s32[], f32[4]) {
  %c = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %x = f32[4]{0} get-tuple-element(%c), index=1
  %k = (f32[4]{0}, f32[2]{0}) custom-call(%x), custom_call_target="mosaic_gpu_v2"
CALLS  %y = f32[4]{0} get-tuple-element(%k), index=0
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4]{0}) tuple(%j, %y)
}

%cond (c: (s32[], f32[4])) -> pred[] {
  %c = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(16)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %m = f32[4]{0} custom-call(%p), custom_call_target="__cublas$gemm"
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %m)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"16"}}
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_hlo_pass_trace_names_the_pass_that_adds_kernel_calls(tmp_path):
  """benchmarks/hlo_pass_trace.py on dumps named as XLA names them: read in compilation
  order (before optimizations, the numbered passes by number, after optimizations), each
  change reported with the kernel's calls and runs per step (16, the loop's trip count;
  cuBLAS left out), and the culprit is the pass after which the body calls it twice."""
  from benchmarks import hlo_pass_trace   # pylint: disable=import-outside-toplevel
  clone = ('  %k2 = (f32[4]{0}, f32[2]{0}) custom-call(%x), '
           'custom_call_target="mosaic_gpu_v2"\n')
  dumps = {'module_0007.jit_step.before_optimizations.txt': '',
           'module_0007.jit_step.0009.simplification.after_algsimp.before_dce.txt': '',
           'module_0007.jit_step.0012.dynamic-slice.after_dynamic-slice-fusion-rewriter-v2'
           '.before_pipeline-end.txt': clone,
           'module_0007.jit_step.0100.fusion.after_priority-fusion.before_cse.txt': clone,
           'module_0007.jit_step.sm_9.0a_gpu_after_optimizations.txt': clone}
  for name, calls in dumps.items():
    (tmp_path / name).write_text(PASS_DUMP.replace('CALLS', calls))
  changes = hlo_pass_trace.trace(str(tmp_path))
  kernel = 'mosaic_gpu_v2 (f32[4], f32[2])'
  assert [c['file'] for c in changes] == [
      'module_0007.jit_step.before_optimizations.txt',
      'module_0007.jit_step.0012.dynamic-slice.after_dynamic-slice-fusion-rewriter-v2'
      '.before_pipeline-end.txt']
  assert [c['static'] for c in changes] == [{kernel: 1}, {kernel: 2}]
  assert [c['runs'] for c in changes] == [{kernel: 16.0}, {kernel: 32.0}]
  assert hlo_pass_trace.culprit(changes) == 'dynamic-slice-fusion-rewriter-v2'
  assert hlo_pass_trace.culprit(changes[:1]) == ''


def test_hlo_pass_trace_runs_on_a_config(tmp_path):
  """The command end to end on this CPU (the tiny config, XLA attention: no kernel calls,
  so no culprit), its JSON with the environment; the dumps are removed."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'TMPDIR': str(tmp_path)}
  out = tmp_path / 'trace.json'
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.hlo_pass_trace', '--config=default.py:tiny',
       '--remat=full', '--attention_impl=xla', f'--output={out}',
       f'--culprit_out={tmp_path}/culprit.txt'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'first pass that adds kernel calls: none' in result.stdout
  row = json.load(open(out))
  assert row['environment']['platform'] == 'cpu' and row['culprit'] == ''
  assert row['changes'][0]['file'].endswith('jit_step.before_optimizations.txt')
  assert (tmp_path / 'culprit.txt').read_text() == ''
  assert not list(tmp_path.glob('hlo_passes_*'))


def test_spec_decode_benchmark_smoke(tiny_workdir):
  """Plain decoding and n-gram drafts on the shared tiny model (which repeats itself):
  the run checks the greedy tokens are equal; drafts are accepted and save steps."""
  from benchmarks import spec_decode  # pylint: disable=import-outside-toplevel
  result = spec_decode.main(['--smoke', '--checkpoint', tiny_workdir])
  for mode in ('one_at_a_time', 'batch'):
    rows = result['results'][mode]
    assert rows['plain']['acceptance'] is None
    for name in ('ngram_k2', 'ngram_k4'):
      assert rows[name]['acceptance'] > 0.5
      assert rows[name]['request_steps'] < rows['plain']['request_steps']



def test_sampler_penalties_benchmark_smoke():
  """Both penalty paths draw the same tokens (the benchmark asserts it) and are timed;
  after warm-up the kept state builds no program while serving, the histories counted
  afresh build one per new width."""
  from benchmarks import sampler_penalties  # pylint: disable=import-outside-toplevel
  out = sampler_penalties.main(['--smoke'])
  (shape,) = out['shapes']
  assert all(shape[f'{k}_{path}'] > 0 for k in ('host_ms', 'host_cpu_ms', 'device_ms')
             for path in ('history', 'requests'))
  sequence = out['serving_sequence']
  assert sequence['requests']['programs_built'] == 0
  assert sequence['history']['programs_built'] > 0


def test_serve_throughput_smoke_has_a_marginal_rate_and_names_the_missing_peer():
  """--smoke times every side on all requests and on the first marginal_from alone; without
  --llama-server the llama.cpp peer is skipped with a note, not an error."""
  from benchmarks import serve_throughput  # pylint: disable=import-outside-toplevel
  out = serve_throughput.main(['--smoke'])
  assert set(out['passes'][0]) >= {'continuous_s', 'continuous_first_s', 'static_s',
                                   'static_first_s'}
  assert set(out['marginal_output_tokens_per_s']) == {'continuous_batching',
                                                      'transformers_static'}
  # a rate, or None where the smoke run's milliseconds leave no time difference to divide by
  assert all(r is None or r > 0 for r in out['marginal_output_tokens_per_s'].values())
  assert 'first 4' in out['marginal_definition']
  assert out['llama_cpp'].startswith('not run: give --llama-server')


def test_serve_throughput_marginal_rate_is_the_median_of_each_pass_difference():
  """Extra tokens over the median of per-pass differences (a pass's two runs share its
  load), not over a difference of medians."""
  from benchmarks import serve_throughput  # pylint: disable=import-outside-toplevel
  passes = [{'continuous_s': 10.0, 'continuous_first_s': 4.0},
            {'continuous_s': 6.0, 'continuous_first_s': 3.0},
            {'continuous_s': 7.0, 'continuous_first_s': 1.0}]
  seconds, per_s, marginal = serve_throughput.rates(passes, ['continuous'], 900, 300)
  assert seconds == {'continuous_s': 7.0}
  assert per_s == {'continuous': 900 / 7.0}
  assert marginal == {'continuous': 600 / 6.0}   # differences 6, 3, 6; medians' would be 4


_STAND_IN_SERVER = '''
import http.server, json, sys
args = sys.argv[1:]
log = args[args.index('-m') + 1] + '.log'
with open(log, 'a') as f:
  f.write(json.dumps({'argv': args}) + '\\n')
sys.stderr.write('a chatty log line\\n' * 20000)   # more than a pipe holds
sys.stderr.flush()


class Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *a):
    pass

  def _answer(self, payload):
    data = json.dumps(payload).encode()
    self.send_response(200)
    self.send_header('Content-Length', str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def do_GET(self):
    self._answer({'status': 'ok'})

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
    with open(log, 'a') as f:
      f.write(json.dumps({'body': body}) + '\\n')
    self._answer({'tokens': [body['prompt'][0]] * body['n_predict']})


http.server.ThreadingHTTPServer(('127.0.0.1', int(args[args.index('--port') + 1])),
                                Handler).serve_forever()
'''


def test_llama_server_peer_runs_a_server_and_always_stops_it(tmp_path):
  """A stand-in llama-server: started on 127.0.0.1 with the slots, threads and context
  asked, its log never blocking it, sent greedy fixed-length uncached requests, and
  stopped on leaving (also when the body raises)."""
  import urllib.request  # pylint: disable=import-outside-toplevel
  from benchmarks import llama_server  # pylint: disable=import-outside-toplevel
  server = tmp_path / 'llama-server'
  server.write_text(f'#!{sys.executable}\n{_STAND_IN_SERVER}')
  server.chmod(0o755)
  gguf = tmp_path / 'model.gguf'
  with pytest.raises(KeyError), llama_server.serve(str(server), str(gguf), slots=3,
                                                   threads=2, slot_len=64,
                                                   start_timeout_s=30) as url:
    _, outputs = llama_server.time_requests(url, [[5, 6], [7], [8, 9, 10]], [3, 1, 2], 3)
    assert outputs == [[5, 5, 5], [7], [8, 8]]
    raise KeyError('the body fails')
  with pytest.raises(OSError):   # stopped: nothing answers on its port any more
    urllib.request.urlopen(f'{url}/health', timeout=5)
  log = [json.loads(line) for line in open(f'{gguf}.log')]
  argv = log[0]['argv']
  flags = {k: argv[argv.index(k) + 1] for k in ('--host', '-np', '-t', '-c')}
  assert flags == {'--host': '127.0.0.1', '-np': '3', '-t': '2', '-c': str(3 * 64)}
  bodies = sorted((e['body'] for e in log[1:]), key=lambda b: b['prompt'])
  assert [b['n_predict'] for b in bodies] == [3, 1, 2]
  assert all(b['temperature'] == 0 and b['ignore_eos'] and not b['cache_prompt']
             for b in bodies)


def test_llama_server_peer_says_what_is_missing(tmp_path):
  from benchmarks import llama_server  # pylint: disable=import-outside-toplevel
  assert llama_server.missing(None, None).startswith('not run: give --llama-server')
  note = llama_server.missing(str(tmp_path / 'nope'), str(tmp_path / 'nope.py'))
  assert note == f'not run: --llama-server={tmp_path / "nope"} does not exist'
