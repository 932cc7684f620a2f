"""Where a compiled train step's time goes, measured: a jax.profiler trace of a few steps.

  python -m benchmarks.profile --config=default.py:tiny [--config.a.b=value] [--profile_steps=3]

Every op the trace times (on a GPU its kernels, on a CPU the runtime's thunks) is matched
by name to its instruction in the compiled HLO and filed under the model scope its
op_name carries: `embed`, `attention`, `mlp`, `moe`, `lm_head_loss`, `optimizer` (named
scopes in model/ and training/state.py), with the Pallas kernel where one runs
(attention/flash_attention_dq), and whether it is the forward, the backward (a transpose)
or a recomputation (remat); ops outside those scopes are `other`, and the copies XLA
inserts itself (no op_name) `copies XLA inserted`. Control flow (while,
conditional, call) is left out: its body's ops are timed themselves. The summary gives
seconds per step per scope and the ten most expensive ops, and names the three largest
costs. train_throughput --profile_steps uses it; so does the GPU session (issue 16).

On a GPU, XLA runs runs of kernels as command buffers (CUDA graphs), and the trace then
times each buffer as one op that names no instruction: `command buffers` in the summary.
Profile with XLA_FLAGS=--xla_gpu_enable_command_buffer= (gpu_session.sh's train stages
set it) so each kernel is timed under its own instruction. Seen on an H200, 2026-11-26:
with command buffers on, seven buffers held all of gpt_64k's 64K-token step (three of
them 98% of it).
"""

import collections
import glob
import gzip
import os
import re
import tempfile

import jax
from absl import flags
from jax.profiler import ProfileData

from benchmarks.common import train_step_runner
from sharding import hlo, planner
from sharding.mesh import mesh_shape

STEPS = flags.DEFINE_integer('profile_steps', 0, 'steps to trace (this module: 0 means 3; '
                             'train_throughput: 0 means no profile)')
HLO_OUT = flags.DEFINE_string('hlo_out', '', "also write the profiled step's compiled HLO "
                              'text here, gzipped (PATH.txt.gz)')
SCOPES = ('embed', 'attention', 'mlp', 'moe', 'lm_head_loss', 'optimizer')
_CONTROL = ('while', 'conditional', 'call')


def op_seconds(xspace_path: str, module: str) -> dict[str, float]:
  """Seconds per op name of HLO module `module` in a trace: device planes where they
  carry HLO ops (GPU kernels), else the host's (CPU thunks)."""
  data = ProfileData.from_file(xspace_path)
  per_plane = {}
  for plane in data.planes:
    times = collections.Counter()
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if stats.get('hlo_module') == module and 'hlo_op' in stats:
          times[stats['hlo_op']] += event.duration_ns * 1e-9
    if times:
      per_plane[plane.name] = times
  devices = [t for name, t in per_plane.items() if name.startswith('/device:')]
  chosen = devices or list(per_plane.values())
  return dict(sum(chosen, collections.Counter()))


def scope_of(ins, comps) -> str:
  """'attention/flash_attention_dq (backward)'-style label from an op's jax name scope
  (its source_name)."""
  parts = source_name(ins, comps).split('/')
  label = next((p for p in parts if p in SCOPES), 'other')
  if label == 'other' and ins.opcode == 'copy' and not ins.op_name:
    return 'copies XLA inserted'   # layout changes and loop-carried buffers
  kernel = next((p for p in map(hlo.unwrap_scope, parts) if p in hlo.PALLAS_KERNELS), None)
  if kernel:
    label += f'/{kernel}'
  if label.startswith('optimizer'):
    return label
  if 'rematted_computation' in parts:   # remat's forward, run again inside the backward
    return f'{label} (recomputed)'
  if any(p.startswith('transpose(') for p in parts):
    return f'{label} (backward)'
  return f'{label} (forward)'


def source_name(ins, comps) -> str:
  """The jax op_name that says where an op came from. A fusion's own op_name is its
  root's (often a reduction outside any scope), so its body's dots come first, then the
  fusion, then the rest of its body: the first of those inside a known scope, else the
  first at all."""
  body = [i for c in hlo._refs(ins.attrs, 'calls') if c in comps   # pylint: disable=protected-access
          for i in comps[c].instrs if i.op_name]
  names = ([i.op_name for i in body if i.opcode in ('dot', 'convolution', 'custom-call')]
           + [ins.op_name] + [i.op_name for i in body])
  scoped = [n for n in names if any(p in SCOPES for p in n.split('/'))]
  return (scoped or [n for n in names if n] or [''])[0]


def not_in_hlo(op: str) -> str:
  """The scope of a traced op that names no instruction of the module."""
  if op.startswith('command_buffer'):
    return 'command buffers (set XLA_FLAGS=--xla_gpu_enable_command_buffer=)'
  return 'other (not in the HLO)'


def summarize(times: dict[str, float], hlo_text: str, steps: int, top: int = 10) -> dict:
  """Seconds per step by scope, and the `top` ops: each with its scope, its runs per
  step (its computation's, loops weighed by trip count: a kernel in a 16-layer scan runs
  16 times; None outside the HLO or inside a loop of unknown trip count) and its jax
  op_name, which show where an op came from when the scope alone does not (a kernel run
  more often than the model asks, say)."""
  # pylint: disable=protected-access
  comps, entry = hlo._parse_module(hlo_text)
  runs, unknown = hlo._multiplicities(comps, entry)
  uncounted = hlo._reachable(comps, [c for comp in comps.values() for i in comp.instrs
                                     if i.name in unknown for c, _ in hlo._callees(i)[0]])
  # pylint: enable=protected-access
  instrs = {i.name: (i, c) for c, comp in comps.items() for i in comp.instrs}
  by_scope, ops = collections.Counter(), []
  for op, seconds in times.items():
    ins, comp = instrs.get(op, (None, None))
    if ins is not None and ins.opcode in _CONTROL:
      continue
    scope = scope_of(ins, comps) if ins is not None else not_in_hlo(op)
    by_scope[scope] += seconds / steps
    ops.append({'op': op, 'opcode': ins.opcode if ins else '?', 'scope': scope,
                'seconds_per_step': seconds / steps,
                'runs_per_step': None if ins is None or comp in uncounted else runs.get(comp),
                'op_name': source_name(ins, comps)[:400] if ins is not None else ''})
  total = sum(by_scope.values())
  rows = [{'scope': s, 'seconds_per_step': t, 'fraction': t / total}
          for s, t in by_scope.most_common()]
  ops.sort(key=lambda r: -r['seconds_per_step'])
  for r in ops:
    r['fraction'] = r['seconds_per_step'] / total
  return {'op_seconds_per_step': total, 'by_scope': rows, 'top_ops': ops[:top],
          'largest_three': [r['scope'] for r in rows[:3]]}


def layout_of(cfg) -> planner.Layout:
  return planner.Layout(mesh_shape(cfg.mesh, jax.device_count()), cfg.parallel.zero_stage,
                        cfg.model.remat, cfg.optim.grad_accum, cfg.parallel.microbatches)


def profile_config(cfg, steps: int = 3) -> dict:
  """Traces `steps` train steps of cfg (random weights and tokens, after two untraced
  ones) on this machine's devices and summarizes where their time goes."""
  compiled, step = train_step_runner(cfg, layout_of(cfg))
  for _ in range(2):
    jax.block_until_ready(step())
  return profile_compiled(compiled, step, steps, HLO_OUT.value)


def profile_compiled(compiled, run, steps: int, hlo_out: str = '') -> dict:
  """Traces `steps` calls of run() (which runs `compiled`) and summarizes them; hlo_out:
  also write compiled's HLO text there, gzipped."""
  text = compiled.as_text()
  if hlo_out:
    with gzip.open(hlo_out, 'wt') as f:
      f.write(text)
  module = re.match(r'HloModule\s+([^\s,]+)', text).group(1)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      out = None
      for _ in range(steps):
        out = run()
      jax.block_until_ready(out)
    [path] = glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'), recursive=True)
    times = op_seconds(path, module)
  if not times:
    raise RuntimeError(f'the trace has no op of module {module}: nothing to summarize.')
  return {'steps': steps, **summarize(times, text, steps)}


def report(summary: dict) -> str:
  lines = [f"{summary['op_seconds_per_step'] * 1e3:.2f} ms of ops per step; largest: "
           + ', '.join(summary['largest_three'])]
  lines += [f"  {r['fraction']:6.1%} {r['seconds_per_step'] * 1e3:9.3f} ms  {r['scope']}"
            for r in summary['by_scope']]
  lines += ['top ops (runs per step, seconds a run):']
  lines += [f"  {r['fraction']:6.1%} {r['op']} " + (
      f"x{r['runs_per_step']:g}, {r['seconds_per_step'] / r['runs_per_step'] * 1e3:.3f} ms"
      if r['runs_per_step'] else f"x?, {r['seconds_per_step'] * 1e3:.3f} ms a step")
            + f"  {r['scope']}" for r in summary['top_ops'][:5]]
  return '\n'.join(lines)


def main(cfg) -> dict:
  summary = profile_config(cfg, STEPS.value or 3)
  print(report(summary))
  return summary


if __name__ == '__main__':
  from training import cli   # pylint: disable=import-outside-toplevel
  cli.run(main)
