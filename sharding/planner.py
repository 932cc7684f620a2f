"""The mesh planner's cost model: which layout to run, from what the compiler produced.

For each candidate layout (mesh sizes, ZeRO stage, remat policy, gradient-accumulation
microbatches), training/plan.py compiles the train step from abstract shapes and hands
this module what the compiled program says per device: memory (memory_analysis), dot
FLOPs (plus the flash kernels' FLOPs, counted analytically from their calls), memory
traffic, and collective bytes by kind and by the mesh axes they cross (sharding/hlo.py,
loops weighted by trip count). This module turns that into a predicted step time on a
named GPU and ranks the layouts. It imports nothing else of ours.

Step time model (per device; every device runs the same partitioned program):
- compute, a roofline over the kernels hlo.py reads from the compiled program: the matmul
  kernels take max(dot FLOPs / (peak bf16 FLOP/s x MATMUL_EFFICIENCY), their memory
  traffic / (HBM bandwidth x HBM_EFFICIENCY)); every other kernel (norms, softmax,
  elementwise, the optimizer update, copies) is memory-bound and takes its traffic / (HBM
  bandwidth x HBM_EFFICIENCY). The matmul side is summed before the max, so a step mixing
  compute- and memory-bound matmuls is predicted a little fast. Traffic is read from a
  CPU compile, whose fusion choices are not a GPU's: an estimate. Each kernel launched
  adds LAUNCH_SECONDS and each step STEP_SECONDS, the host's dispatch of the step
  program (what a small model's step is made of);
- communication: per collective, alpha-beta: count x latency + bytes x volume factor /
  link bandwidth, the link being NVLink when the devices it spans fit in one host (the
  mesh's inner axes get the closest devices) and the inter-host network otherwise. The
  volume factor is what a ring algorithm moves per device relative to the result bytes
  hlo.py reports: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n (result is
  the gathered array, or the operand for reduce-scatter: XLA:CPU reports it as an
  all-reduce), all-to-all (n-1)/n, collective-permute 1;
- overlap: XLA's latency-hiding scheduler overlaps the parameter all-gathers and
  gradient reductions over data/fsdp/stage axes with the layer compute (they do not
  depend on the layer's own results), so those count as max(compute, comm); collectives
  over tensor, context and expert sit on the critical path (the next matmul needs their
  result) and add.
Memory: the compiled peak per device (arguments + outputs - aliased + temporaries)
against the device's memory, MEMORY_HEADROOM of it kept free for the runtime.
"""

import dataclasses
import itertools
import math

import numpy as np

# Per GPU. Sources: NVIDIA H100 SXM5 datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3,
# 80 GB, NVLink 4 900 GB/s bidirectional = 450 GB/s per direction); H200 SXM datasheet
# (same compute, 4.8 TB/s HBM3e, 141 GB); A100 SXM4 80GB datasheet (312 TFLOP/s bf16,
# 2.04 TB/s, NVLink 3 600 GB/s bidirectional). Inter-host: one 400 Gb/s NDR InfiniBand
# NIC per GPU (50 GB/s), as in DGX H100/A100 systems. Latencies: ~5 us per NVLink
# collective step and ~10 us across InfiniBand (NCCL small-message measurements are of
# this order; not measured here).
@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  peak_flops: float          # dense bf16 FLOP/s
  hbm_bytes: float           # device memory
  hbm_bandwidth: float       # bytes/s
  intra_bandwidth: float     # bytes/s per direction within a host (NVLink)
  inter_bandwidth: float     # bytes/s per GPU across hosts
  intra_latency: float       # seconds per collective step
  inter_latency: float
  gpus_per_host: int = 8


HARDWARE = {
    'h100': Hardware('h100', 989e12, 80e9, 3.35e12, 450e9, 50e9, 5e-6, 10e-6),
    'h200': Hardware('h200', 989e12, 141e9, 4.8e12, 450e9, 50e9, 5e-6, 10e-6),
    'a100': Hardware('a100', 312e12, 80e9, 2.04e12, 300e9, 25e9, 5e-6, 10e-6),
}
# All four fitted together (fit_efficiency) to one-GPU step times on an H200 of three kinds
# of step, from the counts a CPU compile gives, as predict uses them: launch-bound
# (default.py at its own batch), memory-bound (default.py at 512 sequences, which pins
# HBM_EFFICIENCY: without it a small model's traffic and its launches trade places in a
# fit) and matmul-bound (gpt_64k.py). benchmarks/results/planner_fit_h200_replanned.json
# has the fit, docs/benchmarks.md how well it fits. HBM_EFFICIENCY is bytes as the CPU
# compile counts them over the time they took on the GPU, so it absorbs what a GPU's
# fusion reads less. MATMUL_EFFICIENCY blends flash-attention kernels and plain matmuls,
# as the fitted steps do.
MATMUL_EFFICIENCY = 0.563   # achieved / peak bf16 FLOP/s of the matmul kernels
HBM_EFFICIENCY = 0.905      # achieved / peak bandwidth of a streaming kernel
LAUNCH_SECONDS = 1.18e-6    # per kernel launched (with command buffers: CUDA graphs)
STEP_SECONDS = 0.652e-3     # per step: the host dispatches the step program
MEMORY_HEADROOM = 0.1
OVERLAPPED_AXES = ('data', 'fsdp', 'stage')
_VOLUME = {'all-reduce': lambda n: 2 * (n - 1) / n, 'all-gather': lambda n: (n - 1) / n,
           'reduce-scatter': lambda n: (n - 1) / n, 'all-to-all': lambda n: (n - 1) / n,
           'collective-permute': lambda n: 1.0}


def hardware(name: str) -> Hardware:
  if name not in HARDWARE:
    raise ValueError(f'unknown device {name!r}: choose one of {sorted(HARDWARE)}.')
  return HARDWARE[name]


@dataclasses.dataclass(frozen=True)
class Layout:
  mesh: dict                 # mesh axis -> size, in mesh order
  zero_stage: int = 0
  remat: str = 'full'
  grad_accum: int = 1
  microbatches: int = 0      # pipeline microbatches (mesh.stage > 1)

  def name(self) -> str:
    axes = 'x'.join(f'{a}{n}' for a, n in self.mesh.items() if n > 1) or 'single'
    micro = f' micro{self.microbatches}' if self.microbatches else ''
    return f'{axes} zero{self.zero_stage} remat={self.remat} accum{self.grad_accum}{micro}'

  def overrides(self) -> list[str]:
    """The train.py flags that run this layout."""
    out = [f'--config.mesh.{a}={n}' for a, n in self.mesh.items()]
    out += [f'--config.parallel.zero_stage={self.zero_stage}',
            f'--config.model.remat={self.remat}', f'--config.optim.grad_accum={self.grad_accum}']
    if self.microbatches:
      out.append(f'--config.parallel.microbatches={self.microbatches}')
    return out


@dataclasses.dataclass
class Measured:
  """What one layout's compiled step says, per device."""
  argument_bytes: float
  output_bytes: float
  alias_bytes: float
  temp_bytes: float
  dot_flops: float
  collectives: dict          # kind -> (count, bytes)
  by_axes: dict              # (kind, axes tuple) -> (count, bytes)
  dot_bytes: float = 0.0     # memory traffic of matmul kernels
  other_bytes: float = 0.0   # memory traffic of every other kernel
  launches: float = 0.0      # kernels launched per step

  @property
  def peak_bytes(self) -> float:
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass
class Prediction:
  step_s: float
  compute_s: float           # matmul_s + memory_s + launch_s
  comm_s: dict               # mesh axes label -> seconds
  exposed_comm_s: float
  fits: bool
  memory_bytes: float
  headroom_bytes: float
  tokens_per_s: float
  mfu: float
  dominant: str
  why_not: str = ''
  matmul_s: float = 0.0      # the matmul kernels: FLOPs or their traffic, the larger
  memory_s: float = 0.0      # the memory-bound kernels
  launch_s: float = 0.0      # the fixed cost of each kernel launched
  # step_s = max(compute_s, overlapped comm) + exposed_comm_s + STEP_SECONDS (the host's
  # dispatch of the step program, once a step)


def factorizations(n: int, axes) -> list[dict]:
  """Every way to write n as a product of sizes over `axes` (in order)."""
  if not axes:
    return [{}] if n == 1 else []
  out = []
  for size in (d for d in range(1, n + 1) if n % d == 0):
    out += [{axes[0]: size, **rest} for rest in factorizations(n // size, axes[1:])]
  return out


def _span_devices(layout: Layout, axes) -> tuple[int, int]:
  """(devices in one group of the axes, how many consecutive devices a group reaches
  over): the mesh's inner axes are the closest devices, so a group over axes A reaches
  over the outermost axis of A and every axis inside it."""
  names = list(layout.mesh)
  group = math.prod(layout.mesh[a] for a in axes)
  outer = min(names.index(a) for a in axes)
  return group, math.prod(layout.mesh[a] for a in names[outer:])


def collective_seconds(kind: str, axes, count: float, nbytes: float, layout: Layout,
                       hw: Hardware) -> float:
  if not axes:
    return 0.0
  group, span = _span_devices(layout, axes)
  if group <= 1:
    return 0.0
  within = span <= hw.gpus_per_host
  bandwidth = hw.intra_bandwidth if within else hw.inter_bandwidth
  latency = hw.intra_latency if within else hw.inter_latency
  return count * latency * (group - 1) + nbytes * _VOLUME[kind](group) / bandwidth


def predict(measured: Measured, layout: Layout, hw: Hardware, model_flops: float,
            tokens: int) -> Prediction:
  """model_flops: the step's useful FLOPs summed over devices (6 N T plus attention);
  tokens: per step."""
  devices = math.prod(layout.mesh.values())
  bandwidth = hw.hbm_bandwidth * HBM_EFFICIENCY
  matmul = max(measured.dot_flops / (hw.peak_flops * MATMUL_EFFICIENCY),
               measured.dot_bytes / bandwidth)
  memory_bound = measured.other_bytes / bandwidth
  launch = measured.launches * LAUNCH_SECONDS
  compute = matmul + memory_bound + launch
  comm, overlapped, exposed = {}, 0.0, 0.0
  for (kind, axes), (count, nbytes) in measured.by_axes.items():
    t = collective_seconds(kind, axes, count, nbytes, layout, hw)
    label = '+'.join(axes) or 'none'
    comm[label] = comm.get(label, 0.0) + t
    if set(axes) <= set(OVERLAPPED_AXES):
      overlapped += t
    else:
      exposed += t
  step = max(compute, overlapped) + exposed + STEP_SECONDS
  memory = measured.peak_bytes
  budget = hw.hbm_bytes * (1 - MEMORY_HEADROOM)
  fits = memory <= budget
  costs = {'matmuls': matmul, 'memory-bound ops': memory_bound, 'kernel launches': launch,
           'step dispatch': STEP_SECONDS,
           **{f'comm {k}': v for k, v in comm.items()}}
  dominant = max(costs, key=costs.get)
  return Prediction(
      step_s=step, compute_s=compute, comm_s=comm, exposed_comm_s=exposed, fits=fits,
      memory_bytes=memory, headroom_bytes=budget - memory, tokens_per_s=tokens / step,
      mfu=model_flops / (step * hw.peak_flops * devices), dominant=dominant,
      why_not='' if fits else
      f'needs {memory / 2**30:.1f} GiB per device, {budget / 2**30:.1f} GiB usable',
      matmul_s=matmul, memory_s=memory_bound, launch_s=launch)


@dataclasses.dataclass(frozen=True)
class Floor:
  """What a layout's step must at least do per device, known without compiling it
  (training/plan_bound.py says why each is a floor of what the compiled step holds)."""
  dot_flops: float
  other_bytes: float         # memory-bound traffic
  memory_bytes: float        # of the compiled peak
  exposed: dict              # mesh axes (tuple) -> collectives on the critical path


def lower_bound(floor: Floor, layout: Layout, hw: Hardware) -> Prediction:
  """A prediction no compile of `layout` can beat: predict's own terms with each count at
  its floor and what has none (kernel launches, the matmuls' traffic, collective bytes,
  the overlapped collectives) at zero. Every term of predict grows with its counts, and
  max(compute, overlapped) >= compute, so step_s <= predict(...).step_s and
  memory_bytes <= its memory_bytes for any compile whose numbers are above the floor's."""
  bandwidth = hw.hbm_bandwidth * HBM_EFFICIENCY
  matmul = floor.dot_flops / (hw.peak_flops * MATMUL_EFFICIENCY)
  memory_bound = floor.other_bytes / bandwidth
  # One collective may span several axes and serve two floors: only the costliest counts.
  exposed = max([collective_seconds('all-reduce', axes, count, 0.0, layout, hw)
                 for axes, count in floor.exposed.items()], default=0.0)
  step = matmul + memory_bound + exposed + STEP_SECONDS
  budget = hw.hbm_bytes * (1 - MEMORY_HEADROOM)
  return Prediction(
      step_s=step, compute_s=matmul + memory_bound, comm_s={}, exposed_comm_s=exposed,
      fits=floor.memory_bytes <= budget, memory_bytes=floor.memory_bytes,
      headroom_bytes=budget - floor.memory_bytes, tokens_per_s=0.0, mfu=0.0,
      dominant='lower bound', matmul_s=matmul, memory_s=memory_bound)


def rank_key(p: Prediction) -> tuple:
  """Layouts that fit first, fastest first; then those that do not, by memory. A lower
  bound's key is below the key of any compile it bounds."""
  return (not p.fits, p.step_s if p.fits else p.memory_bytes)


FACTORS = ('matmul_efficiency', 'hbm_efficiency', 'launch_seconds', 'step_seconds')


def fit_efficiency(runs, hw: Hardware, free=FACTORS) -> dict:
  """The cost model's factors that best predict measured one-device step times.

  runs: [(Measured, measured seconds)]. On one device the model is predict's: t =
  max(dot FLOPs / (peak x e_matmul), dot bytes / (HBM bandwidth x e_hbm)) + other bytes /
  (HBM bandwidth x e_hbm) + launches x launch_seconds + step_seconds. With each run's
  matmuls taken as compute- or traffic-bound, that is linear in (1/e_matmul, 1/e_hbm,
  launch_seconds, step_seconds): least squares on the relative error, then each run
  classified again with the factors found, until no run changes side. Of the factors
  named in `free` (FACTORS' names; the rest stay the table's), the most the runs can tell
  apart are fitted: each subset is tried, and the largest with a positive, well-conditioned
  solution wins (the lowest error among subsets of one size). Runs with no launch counts,
  the same mix of terms in all, or matmuls all bound by their traffic (no FLOPs term) fit
  fewer. `matmul_only` is the fit with e_matmul alone and no other term, to compare (when
  some run has dot FLOPs); `converged`, whether the classification settled (if not, the
  last fit found stands)."""
  if not runs:
    raise ValueError('no runs to fit: measure at least one layout.')
  if not free or set(free) - set(FACTORS):
    raise ValueError(f'free={list(free)}: name some of {FACTORS}.')
  flops = np.array([m.dot_flops / hw.peak_flops / t for m, t in runs])
  dots = np.array([m.dot_bytes / hw.hbm_bandwidth / t for m, t in runs])
  rest = np.array([[m.other_bytes / hw.hbm_bandwidth / t, m.launches / t, 1 / t]
                   for m, t in runs])
  # Relative step times: model seconds / measured seconds, for factors x.
  model = lambda x: np.maximum(flops * x[0], dots * x[1]) + rest @ x[1:]
  error = lambda x: float(np.sqrt(np.mean((model(x) - 1) ** 2)))
  factors = lambda x: {'matmul_efficiency': 1 / x[0],
                       'hbm_efficiency': 1 / x[1] if x[1] else math.inf,
                       'launch_seconds': x[2], 'step_seconds': x[3]}
  table = np.array([1 / MATMUL_EFFICIENCY, 1 / HBM_EFFICIENCY, LAUNCH_SECONDS,
                    STEP_SECONDS])
  out = {'table': {'matmul_efficiency': MATMUL_EFFICIENCY, 'hbm_efficiency': HBM_EFFICIENCY,
                   'launch_seconds': LAUNCH_SECONDS, 'step_seconds': STEP_SECONDS,
                   'rms_relative_error': error(table)}}
  # The FLOPs alone (no other term), fitted: what the other terms earn.
  if flops.any():
    alone = float(flops @ flops / flops.sum())
    out['matmul_only'] = {'matmul_efficiency': alone, 'rms_relative_error': error(
        np.array([1 / alone, 0.0, 0.0, 0.0]))}
  named = [i for i, name in enumerate(FACTORS) if name in free]
  bound, best, converged = flops * table[0] < dots * table[1], None, False
  for _ in range(len(runs) + 1):
    a = np.column_stack([np.where(bound, 0.0, flops), rest + np.outer(bound * dots,
                                                                      [1, 0, 0])])
    found = _least_squares(a, table, named)
    if found is None:
      break   # the last fit found stands, not converged
    best = found
    now = flops * best[1][0] < dots * best[1][1]
    converged = bool((now == bound).all())
    if converged:
      break
    bound = now
  if best is None:
    raise ValueError(
        f'none of {list(free)} can be fitted to these runs: no positive, well-conditioned '
        'solution (launch_seconds needs runs with launch counts; matmul_efficiency runs '
        "whose matmuls are compute-bound; and the table's other terms must leave part of "
        'each measured step).')
  fitted, x = best
  # A factor held keeps the table's value exactly (not the round trip through 1/x).
  held = {name: value for name, value in out['table'].items()
          if name in FACTORS and FACTORS.index(name) not in fitted}
  return {**out, 'fitted': [FACTORS[i] for i in fitted], **factors(x), **held,
          'rms_relative_error': error(x), 'converged': converged}


def _least_squares(a, table, named):
  """(fitted indices, factors): a @ x = 1 over the largest subset of `named` whose
  solution is positive and well conditioned, the rest held at `table`; None if none is."""
  for size in range(len(named), 0, -1):
    found = []
    for free in map(list, itertools.combinations(named, size)):
      cols = a[:, free]
      norms = np.linalg.norm(cols, axis=0)
      if len(a) < len(free) or not norms.all() or np.linalg.cond(cols / norms) > 1e3:
        continue
      held = [i for i in range(len(table)) if i not in free]
      sol, *_ = np.linalg.lstsq(cols, 1 - a[:, held] @ table[held], rcond=None)
      if (sol > 0).all():
        x = table.copy()
        x[free] = sol
        found.append((float(np.sum((a @ x - 1) ** 2)), tuple(free), x))
    if found:
      # The lowest error; of equal ones (runs that one factor explains as well as
      # another), the subset first in FACTORS' order.
      _, free, x = min(found, key=lambda f: (round(f[0], 12), f[1]))
      return free, x
  return None


def rank(rows: list[dict]) -> list[dict]:
  """Layouts that fit first, fastest first; then those that do not, by memory."""
  return sorted(rows, key=lambda r: rank_key(r['prediction']))


def table(rows: list[dict], top: int | None = None) -> str:
  head = (f'{"#":>3}  {"layout":<44}{"GiB/dev":>9}{"headroom":>10}{"step s":>10}'
          f'{"tok/s":>12}{"MFU":>7}  dominant / why not')
  lines = [head]
  for i, r in enumerate(rows[:top] if top else rows, 1):
    p = r['prediction']
    lines.append(
        f'{i:>3}  {r["layout"].name():<44}{p.memory_bytes / 2**30:>9.2f}'
        f'{p.headroom_bytes / 2**30:>10.2f}{p.step_s:>10.4g}{p.tokens_per_s:>12.4g}'
        f'{p.mfu:>7.1%}  {p.dominant if p.fits else "DOES NOT FIT: " + p.why_not}')
  return '\n'.join(lines)


def as_record(row: dict) -> dict:
  """One ranked row as plain JSON/CSV values."""
  p, layout = row['prediction'], row['layout']
  m = row['measured']
  return {'layout': layout.name(), 'mesh': layout.mesh, 'zero_stage': layout.zero_stage,
          'remat': layout.remat, 'grad_accum': layout.grad_accum,
          'microbatches': layout.microbatches, 'memory_bytes': p.memory_bytes,
          'fits': p.fits, 'memory_gib': p.memory_bytes / 2**30,
          'headroom_gib': p.headroom_bytes / 2**30, 'step_s': p.step_s,
          'tokens_per_s': p.tokens_per_s, 'mfu': p.mfu, 'dominant': p.dominant,
          'why_not': p.why_not, 'compute_s': p.compute_s, 'matmul_s': p.matmul_s,
          'memory_bound_s': p.memory_s, 'launch_s': p.launch_s,
          'comm_s': p.comm_s, 'dot_flops_per_device': m.dot_flops,
          'launches_per_device': m.launches,
          'hbm_bytes_per_device': m.dot_bytes + m.other_bytes,
          'dot_bytes_per_device': m.dot_bytes, 'other_bytes_per_device': m.other_bytes,
          'collectives': {k: {'count': c, 'bytes': b}
                          for k, (c, b) in m.collectives.items()},
          'overrides': ' '.join(layout.overrides())}
