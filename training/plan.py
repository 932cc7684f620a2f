"""The mesh planner's training side: candidate layouts of a config, each validated with
the checks training uses and compiled from abstract shapes (nothing allocated), then
costed and ranked by sharding/planner.py.

Compiling needs as many devices as the layout has: on a CPU, simulated ones
(`jax_num_cpu_devices`, which `python -m training.plan_cli` sets for its own process).
`layers=(a, b)` compiles a- and b-layer versions of the model and extrapolates memory,
FLOPs and collectives linearly to the config's layer count (every per-layer cost is
linear in the layers of a scanned stack); `check_extrapolation` compares that with a
full compile. `search` compiles only the layouts whose lower bound (plan_bound.py) could
reach the rows asked for, compiling layouts that are one program (program_key) once and
reading and keeping each compile's numbers in a cache (plan_cache.py) when given one.
"""

import concurrent.futures
import contextlib
import copy
import dataclasses
import math
import multiprocessing
import os
import time

import jax

from sharding import hlo, planner
from sharding.mesh import MESH_AXES, MeshConfig, make_mesh
from sharding.rules import make_plan
from training import (config as config_lib, describe, family, optimizer, plan_bound,
                      source_data, state, trainer)

REMAT = ('none', 'full')


def candidates(cfg: config_lib.Config, devices: int, *, axes=None, zero_stages=(0, 1, 3),
               remats=REMAT, grad_accums=(1,), microbatches=(0,)) -> tuple[list, list]:
  """(valid layouts, [(layout, why invalid)]) for `devices`: every factorization over
  `axes` (default: the axes this config can use: expert only with experts, stage only
  if its layers split) x ZeRO stage x remat x grad_accum x pipeline microbatches (for
  layouts with stage > 1; 0: the config's parallel.microbatches, else one per stage),
  pruned by config.validate."""
  if axes is None and family.is_user(cfg):
    axes = ['data', 'fsdp', 'tensor']   # the axes a user model trains on
  if axes is None:
    axes = [a for a in MESH_AXES if a != 'expert' or cfg.model.num_experts]
  valid, rejected = [], []
  for sizes in planner.factorizations(devices, list(axes)):
    mesh = {a: sizes.get(a, 1) for a in MESH_AXES}
    for zero in zero_stages:
      if zero and mesh['fsdp'] == 1:
        continue   # ZeRO over a 1-device fsdp axis is ZeRO-0
      default = config_lib.pipeline_microbatches(cfg, mesh['stage'])   # the config's
      micros = sorted({m or default for m in microbatches}) if mesh['stage'] > 1 else [0]
      for remat in remats:
        for accum in grad_accums:
          for micro in micros:
            layout = planner.Layout(mesh, zero, remat, accum, micro)
            try:
              _validate(configure(cfg, layout), devices)
            except ValueError as e:
              rejected.append((layout, str(e)))
              continue
            valid.append(layout)
  return valid, rejected


def _validate(cfg: config_lib.Config, devices: int) -> None:
  """config.validate; for a user model also its parameters' divisibility on the mesh
  (the built-in model's is implied by validate's checks of its fields)."""
  config_lib.validate(cfg, devices)
  if family.is_user(cfg):
    describe.checked_plan(cfg, devices)


def program_key(layout: planner.Layout) -> tuple:
  """Layouts with one key compile to one program (compile_alike compiles it once).

  At ZeRO-0 nothing names `data` or `fsdp` alone: the rules put only the batch on them,
  as the pair (data, fsdp) (sharding/rules.py BATCH_AXES; the per-shard gradient sums of
  training/state.py vmap over the same pair), and the config multiplies their sizes. With
  stage = 1 the two are neighbours in the mesh, so a pair of sizes (a, b) splits the batch
  into the same a x b pieces on the same devices as (a x b, 1): every sharding in the
  program is the same device-level sharding, and so is the compiled program. Only the
  names of the axes its collectives span differ, which compile_alike reads per layout.
  ZeRO >= 1 shards the optimizer state over fsdp alone, and stage > 1 sits between the
  two: those layouts keep keys of their own."""
  mesh = dict(layout.mesh)
  if layout.zero_stage == 0 and mesh.get('stage', 1) == 1:
    mesh['data'], mesh['fsdp'] = mesh.get('data', 1) * mesh.get('fsdp', 1), 1
  return (tuple(sorted(mesh.items())), layout.zero_stage, layout.remat, layout.grad_accum,
          layout.microbatches)


def configure(cfg: config_lib.Config, layout: planner.Layout,
              layers: int | None = None) -> config_lib.Config:
  out = copy.deepcopy(cfg)
  out.mesh = MeshConfig(**layout.mesh)
  out.parallel.zero_stage = layout.zero_stage
  out.optim.grad_accum = layout.grad_accum
  if layout.microbatches:
    out.parallel.microbatches = layout.microbatches
  out.model = dataclasses.replace(out.model, remat=layout.remat,
                                  num_layers=layers or out.model.num_layers)
  return out


@dataclasses.dataclass
class Built:
  """A layout's train step, not yet compiled: what compile_layout measures and what
  benchmarks/planner_check.py runs."""
  cfg: config_lib.Config       # the config with the layout applied
  mesh: jax.sharding.Mesh
  plan: object                 # sharding.rules.ShardingPlan
  tx: object                   # the optax optimizer
  step: object                 # jit(state, batch) -> (state, metrics)
  batch: dict                  # name -> ShapeDtypeStruct, sharded

  def compile(self):
    return self.step.lower(state.abstract_state(self.cfg, self.plan, self.tx),
                           self.batch).compile()


def build_layout(cfg: config_lib.Config, layout: planner.Layout, layers: int | None = None,
                 devices=None) -> Built:
  """The layout's train step on the first N of `devices` (default: jax.devices())."""
  cfg = configure(cfg, layout, layers)
  devices = (devices or jax.devices())[:math.prod(layout.mesh.values())]
  mesh = make_mesh(cfg.mesh, devices)
  plan = make_plan(mesh, cfg.parallel.zero_stage, cfg.parallel.sequence_parallel,
                   cfg.parallel.context_strategy, cfg.parallel.context_load_balance,
                   config_lib.pipeline_microbatches(cfg, mesh.shape['stage']),
                   cfg.parallel.pipeline_repeats)
  plan = family.with_user_rules(plan, cfg)
  tx = optimizer.make_optimizer(cfg.optim, max(cfg.steps, 1))
  step = state.make_train_step(cfg, plan, tx, optimizer.lr_schedule(cfg.optim, cfg.steps))
  if cfg.data.source:
    return Built(cfg, mesh, plan, tx, step, _source_batch(cfg, plan))
  shape = (cfg.data.batch_size, cfg.data.seq_len)
  names = [('inputs', 'int32'), ('targets', 'int32'), ('positions', 'int32'),
           ('weights', 'float32')] + ([('segment_ids', 'int32')] if cfg.data.pack_documents
                                      else [])
  batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=plan.batch_sharding())
           for k, dtype in names}
  return Built(cfg, mesh, plan, tx, step, batch)


def _source_batch(cfg: config_lib.Config, plan) -> dict:
  """A data.source's batch as sharded shapes (its first batch made once, on the host)."""
  first = source_data.SourceIterator(cfg.data.source, seed=cfg.seed,
                                     batch_size=cfg.data.batch_size)
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                  sharding=trainer.source_batch_sharding(plan, v.ndim))
          for k, v in next(first).items()}


# Matmuls of one call of each flash kernel, in units of the forward's two (QK^T, PV): the
# dq kernel recomputes QK^T and does dP = dO V^T and dQ = dS K; the dkv kernel recomputes
# QK^T and does dP, dV = P^T dO and dK = dS^T Q.
FLASH_MATMULS = {'flash_attention_fwd': 1.0, 'flash_attention_dq': 1.5,
                 'flash_attention_dkv': 2.0}


def flash_flops(cfg: config_lib.Config, layout: planner.Layout, calls: dict) -> float:
  """Per-device FLOPs of the flash kernels in a step whose compiled program runs them
  `calls` times (hlo.py's kernel_calls): their dots cannot be read from the HLO (GPU:
  custom calls; CPU: the interpreter's loops have no trip counts). One forward pass of
  causal attention over the step's tokens is 2 x 2 x layers x T^2/2 x heads x head_dim
  per sequence, split evenly over the devices; the forward kernel runs once per pass
  (twice with remat recomputing it: counted from the calls), the backward kernels once.
  Not counted: pipeline bubbles (the HLO's own dots include them), and the blocks the
  kernels skip between packed documents (data-dependent): with packed documents this is
  an upper bound."""
  calls = {k: v for k, v in calls.items() if k in FLASH_MATMULS}
  if not calls:
    return 0.0
  m, t = cfg.model, cfg.data.seq_len
  one_pass = (2 * 2 * m.num_layers * t * t / 2 * m.num_heads * m.resolved_head_dim
              * cfg.data.batch_size / math.prod(layout.mesh.values()))
  unit = (calls.get('flash_attention_dq') or calls.get('flash_attention_fwd')
          or max(calls.values()))
  return one_pass * sum(FLASH_MATMULS[k] * n / unit for k, n in calls.items())


def compile_layout(cfg: config_lib.Config, layout: planner.Layout,
                   layers: int | None = None, devices=None) -> planner.Measured:
  """The layout's train step compiled from abstract shapes (nothing allocated), measured;
  the flash kernels' FLOPs counted analytically (flash_flops)."""
  return compile_alike(cfg, [layout], layers, devices)[0]


def compile_alike(cfg: config_lib.Config, layouts: list, layers: int | None = None,
                  devices=None) -> list[planner.Measured]:
  """compile_layout of each of `layouts`, which share one program_key, from one compile:
  the first one's train step, read once per layout with that layout's mesh (the mesh
  axes each collective's device groups span are the layout's own)."""
  if cfg.model.attention_impl == 'pallas' and jax.default_backend() != 'cpu':
    raise ValueError(
        'model.attention_impl=pallas: the planner costs the flash kernels from a CPU compile '
        '(the Pallas interpreter); compiled for this machine\'s '
        f'{jax.default_backend()} they are calls it cannot read. Plan in a CPU-only process: '
        'python -m training.plan_cli, or JAX_PLATFORMS=cpu.')
  if len({program_key(l) for l in layouts}) != 1:
    raise ValueError(f'compile_alike: {[l.name() for l in layouts]} are not one program.')
  chosen = (devices or jax.devices())[:math.prod(layouts[0].mesh.values())]
  meshes = [make_mesh(configure(cfg, l).mesh, chosen) for l in layouts]
  # One program needs one device order too (jax.make_mesh may order devices by the
  # mesh's shape on some machines): the layouts whose order differs compile apart.
  order = lambda mesh: [d.id for d in mesh.devices.flat]
  apart = [i for i, m in enumerate(meshes) if order(m) != order(meshes[0])]
  out = dict(zip(apart, compile_alike(cfg, [layouts[i] for i in apart], layers, devices)
                 if apart else []))
  built = build_layout(cfg, layouts[0], layers, devices)
  compiled = built.compile()
  for i, (l, mesh) in enumerate(zip(layouts, meshes)):
    if i not in out:
      out[i] = _measured(configure(cfg, l, layers), l, compiled, dict(mesh.shape))
  return [out[i] for i in range(len(layouts))]


def _measured(cfg, layout, compiled, mesh_shape) -> planner.Measured:
  report = hlo.inspect_compiled(compiled, mesh_shape)
  pair = lambda s: (s.count, s.bytes)
  kernels = flash_flops(cfg, layout, report.kernel_calls)
  return planner.Measured(report.argument_bytes, report.output_bytes, report.alias_bytes,
                          report.temp_bytes, report.dot_flops + kernels,
                          {k: pair(v) for k, v in report.collectives.items()},
                          {k: pair(v) for k, v in report.by_axes.items()},
                          report.dot_bytes, report.other_bytes, report.launches)


def extrapolate(a: planner.Measured, b: planner.Measured, la: int, lb: int,
                target: int) -> planner.Measured:
  """Linear in the layer count through the (la, a) and (lb, b) compiles."""
  t = (target - la) / (lb - la)
  line = lambda x, y: x + (y - x) * t
  pairs = lambda p, q: {k: tuple(line(u, v) for u, v in zip(p.get(k, (0, 0)), q.get(k, (0, 0))))
                        for k in set(p) | set(q)}
  return planner.Measured(
      line(a.argument_bytes, b.argument_bytes), line(a.output_bytes, b.output_bytes),
      line(a.alias_bytes, b.alias_bytes), line(a.temp_bytes, b.temp_bytes),
      line(a.dot_flops, b.dot_flops), pairs(a.collectives, b.collectives),
      pairs(a.by_axes, b.by_axes), line(a.dot_bytes, b.dot_bytes),
      line(a.other_bytes, b.other_bytes), line(a.launches, b.launches))


def measure(cfg, layout, layers=None, devices=None, cache=None) -> planner.Measured:
  """Full compile, or with layers=(a, b) the extrapolation from a and b layers; each
  compile read from `cache` (plan_cache.MeasureCache) when it has it, else kept there."""
  return measure_alike(cfg, [layout], layers, devices, cache)[0]


def measure_alike(cfg, layouts, layers=None, devices=None, cache=None) -> list:
  """measure of each of `layouts`, which share one program_key, compiling it once."""
  if layers is None:
    return _compiled(cfg, layouts, None, devices, cache)
  if family.is_user(cfg):
    raise ValueError(f'--layers {layers}: extrapolating over the layer count needs the '
                     'built-in model; a model.module is compiled at its own size (drop '
                     '--layers).')
  la, lb = layers
  return [extrapolate(a, b, la, lb, cfg.model.num_layers)
          for a, b in zip(_compiled(cfg, layouts, la, devices, cache),
                          _compiled(cfg, layouts, lb, devices, cache))]


def _from_cache(cfg, layout, layers, cache) -> planner.Measured | None:
  """The layout's measurement if `cache` has every compile it needs, else None."""
  if cache is None:
    return None
  if layers is None:
    return cache.get(configure(cfg, layout))
  found = [cache.get(configure(cfg, layout, n)) for n in layers]
  if None in found:
    return None
  return extrapolate(*found, *layers, cfg.model.num_layers)


def _compiled(cfg, layouts, layers, devices, cache) -> list:
  found = [None if cache is None else cache.get(configure(cfg, l, layers)) for l in layouts]
  missing = [l for l, m in zip(layouts, found) if m is None]
  if missing:
    fresh = iter(compile_alike(cfg, missing, layers, devices))
    found = [next(fresh) if m is None else m for m in found]
    for l, m in zip(layouts, found):
      if cache is not None and l in missing:
        cache.put(configure(cfg, l, layers), m)
  return found


def plan_layouts(cfg: config_lib.Config, devices: int, device: str = 'h100', *,
                 layers=None, progress=None, layouts=None, compile_on=None,
                 **candidate_args) -> tuple[list, list]:
  """(ranked rows, rejected layouts with why) for `devices` GPUs of kind `device`: the
  given `layouts` (validated), or the candidates `candidates` enumerates, every one
  compiled. Each row: layout, measured (planner.Measured), prediction
  (planner.Prediction), bound (planner.lower_bound's) and state (per device bytes of
  parameters, gradients and optimizer state, from abstract shapes). compile_on: the jax
  devices to compile for (default jax.devices())."""
  found = search(cfg, devices, device, layers=layers, progress=progress, layouts=layouts,
                 compile_on=compile_on, **candidate_args)
  return found.rows, found.rejected


@dataclasses.dataclass
class Search:
  rows: list          # compiled (or cached) layouts, ranked: plan_layouts' rows
  rejected: list      # [(layout, why)] refused by config.validate
  pruned: list        # [(layout, planner.lower_bound's Prediction)] never compiled
  compiled: int       # compiles this search ran
  cached: int         # layouts read from the cache
  exact: int          # the first `exact` rows are the full search's, whatever it compiled
  shared: int = 0     # layouts read off another layout's compile (one program_key)


def search(cfg: config_lib.Config, devices: int, device: str = 'h100', *, top: int = 0,
           max_compiles: int = 0, max_seconds: float = 0.0, jobs: int = 1, cache=None,
           layers=None, progress=None, layouts=None, compile_on=None, alike=True,
           **candidate_args) -> Search:
  """Ranks the layouts (plan_layouts' rows) compiling only those that could be among the
  `top` best (0: all): every layout gets a lower bound from analytic floors
  (training/plan_bound.py), layouts are compiled in order of it, and the search stops
  when the next one's bound is above the top-th best compiled, since no layout left can
  then be among the top rows. So the first `top` rows are the full search's, in its order.
  max_compiles (0: no cap) and max_seconds (0: no limit; compiles under way finish, and
  the first always runs) stop sooner; then `exact` says how many rows are proven.
  Layouts that share a program_key are compiled once, together (alike=False: each
  apart). jobs > 1 compiles that many programs at once, each in a process of its own
  (XLA's compile holds the GIL: threads would take turns); the cut is then taken over the
  compiles finished, so a few more may compile than one at a time would, and the rows
  are the same. cache: a plan_cache.MeasureCache, read first and written after each
  compile. progress: called before each compile, (k, n, layout, left, best): the k-th
  compile of at most n, left = n - k the compiles after it that could still be needed,
  best the best row so far (None before the first), which the table's first row is
  unless a compile left beats it."""
  hw = planner.hardware(device)
  layouts, rejected = _layouts(cfg, devices, layouts, candidate_args)
  tokens = cfg.data.batch_size * cfg.data.seq_len
  model_flops = family.of(cfg).flops_per_token(cfg.data.seq_len) * tokens
  sizes, bounds = {}, []
  for layout in layouts:
    size = _run_size(cfg, layout, devices, sizes)
    floor = plan_bound.floor(configure(cfg, layout), layout, size)
    bounds.append(planner.lower_bound(floor, layout, hw))
  row = lambda i, m: _row(cfg, layouts[i], m, hw, model_flops, tokens, devices, sizes,
                          bounds[i])
  # Cached layouts cost nothing: known before the first compile, they tighten the cut.
  measured = {i: m for i, layout in enumerate(layouts)
              if (m := _from_cache(cfg, layout, layers, cache)) is not None}
  keys = {i: planner.rank_key(b) for i, b in enumerate(bounds)}
  order = sorted((i for i in keys if i not in measured), key=lambda i: (keys[i], i))
  schedule = _Schedule(
      layouts, keys, {i: program_key(l) if alike else i for i, l in enumerate(layouts)},
      {i: row(i, m) for i, m in measured.items()}, row, top=top, jobs=jobs,
      max_compiles=max_compiles, max_seconds=max_seconds, progress=progress)
  with _compiler(jobs, compile_on, cache) as compile_group:
    schedule.run(order, lambda group: compile_group(cfg, [layouts[j] for j in group],
                                                    layers))
  ranked, pruned, exact = _ranked(layouts, bounds, keys, order, schedule.rows)
  return Search(ranked, rejected, pruned, schedule.compiled, len(measured), exact,
                schedule.shared)


def _ranked(layouts, bounds, keys, order, rows) -> tuple[list, list, int]:
  """(ranked rows, pruned layouts with their bounds, how many leading rows are the full
  search's: those no uncompiled layout's bound could beat)."""
  # Enumeration order before ranking: ties fall as in a full search.
  ranked = planner.rank([rows[i] for i in sorted(rows)])
  pruned = [(layouts[i], bounds[i]) for i in order if i not in rows]
  least = min((keys[i] for i in order if i not in rows), default=None)
  exact = sum(least is None or planner.rank_key(r['prediction']) < least for r in ranked)
  return ranked, pruned, exact


@dataclasses.dataclass
class _Schedule:
  """search's compile loop: takes layouts in bound order, submits each program (its
  layouts of one program_key together) while the bound is under the cut and the budget
  (max_compiles, max_seconds) lasts, at most `jobs` under way, and fills `rows` with each
  finished compile's rows."""
  layouts: list
  keys: dict          # layout index -> rank key of its lower bound
  program: dict       # layout index -> what it compiles as (layouts alike share one)
  rows: dict          # layout index -> row; cached ones before the loop
  row: object         # (index, Measured) -> row
  top: int = 0
  jobs: int = 1
  max_compiles: int = 0
  max_seconds: float = 0.0
  progress: object = None
  compiled: int = 0
  shared: int = 0     # layouts read off another layout's compile
  running: dict = dataclasses.field(default_factory=dict)   # future -> its indices

  def run(self, order: list, submit) -> None:
    """Compiles down `order` through `submit` (group of indices -> future of their
    Measured list) until the cut or the budget stops it, then waits for all."""
    started, position = time.monotonic(), 0
    while position < len(order):
      i = order[position]
      if self._busy(i):
        position += 1
        continue
      cut = _cut(self.rows, self.top)
      if self.keys[i] > cut or self._spent(started):
        if self.running:   # a compile under way may lower the cut: wait for it, look again
          self._finish()
          continue
        break
      self._report(i, self._left(order, position, cut))
      group = [j for j in order[position:]
               if self.program[j] == self.program[i] and not self._busy(j)]
      self.running[submit(group)] = group
      self.compiled += 1
      if len(self.running) >= max(self.jobs, 1):
        self._finish()
    if self.running:
      self._finish(wait_for_all=True)

  def _busy(self, j) -> bool:
    return j in self.rows or any(j in g for g in self.running.values())

  def _spent(self, started: float) -> bool:
    return bool((self.max_compiles and self.compiled >= self.max_compiles) or
                (self.max_seconds and self.compiled and
                 time.monotonic() - started > self.max_seconds))

  def _left(self, order, position, cut) -> int:
    """The programs after order[position] that could still need a compile."""
    i = order[position]
    left = len({self.program[j] for j in order[position + 1:]
                if not self._busy(j) and self.keys[j] <= cut} - {self.program[i]})
    if self.max_compiles:
      left = min(left, self.max_compiles - self.compiled - 1)
    return left

  def _report(self, i, left) -> None:
    if self.progress:
      best = min(self.rows.values(), key=lambda r: planner.rank_key(r['prediction']),
                 default=None)
      self.progress(self.compiled + 1, self.compiled + 1 + left, self.layouts[i], left,
                    best)

  def _finish(self, wait_for_all=False) -> None:
    done, _ = concurrent.futures.wait(
        self.running, return_when=(concurrent.futures.ALL_COMPLETED if wait_for_all else
                                   concurrent.futures.FIRST_COMPLETED))
    for future in done:
      group = self.running.pop(future)
      self.shared += len(group) - 1
      for j, m in zip(group, future.result()):
        self.rows[j] = self.row(j, m)


@contextlib.contextmanager
def _compiler(jobs: int, compile_on, cache):
  """A function (cfg, layouts, layers) -> future of measure_alike's list: run here and
  now (jobs <= 1, or given devices, which cannot leave this process), else in a pool of
  `jobs` processes, each with this process's device count and XLA_FLAGS."""
  if jobs <= 1 or compile_on is not None:
    def inline(cfg, group, layers):
      future = concurrent.futures.Future()
      future.set_result(measure_alike(cfg, group, layers, compile_on, cache))
      return future
    yield inline
    return
  directory = None if cache is None else str(cache.directory)
  pool = concurrent.futures.ProcessPoolExecutor(
      jobs, mp_context=multiprocessing.get_context('spawn'), initializer=_worker_setup,
      initargs=(jax.device_count(), os.environ.get('XLA_FLAGS', '')))
  try:
    yield lambda cfg, group, layers: pool.submit(_worker_measure, cfg, group, layers,
                                                 directory)
  finally:
    pool.shutdown(cancel_futures=True)


def _worker_setup(device_count: int, xla_flags: str) -> None:
  """A compile worker's jax: CPU, with the parent's device count and flags (the cache
  keys both, so the worker's entries are the parent's)."""
  os.environ['XLA_FLAGS'] = xla_flags
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', device_count)


def _worker_measure(cfg, group, layers, directory):
  from training import plan_cache   # pylint: disable=import-outside-toplevel
  cache = None if directory is None else plan_cache.MeasureCache(directory)
  return measure_alike(cfg, group, layers, None, cache)


def _cut(rows: dict, top: int):
  """The top-th best rank key among the rows (no cut until there are `top` rows)."""
  keys = sorted(planner.rank_key(r['prediction']) for r in rows.values())
  return keys[top - 1] if top and len(keys) >= top else (True, math.inf)


def _row(cfg, layout, measured, hw, model_flops, tokens, devices, sizes, bound):
  size = _run_size(cfg, layout, devices, sizes)
  return {'layout': layout, 'measured': measured, 'bound': bound,
          'prediction': planner.predict(measured, layout, hw, model_flops, tokens),
          'state': {k: size[f'{k}_bytes'] for k in ('param', 'grad', 'opt_state')}}


def _run_size(cfg, layout, devices, sizes: dict) -> dict:
  """describe.run_size of the layout; the same for every remat and accumulation."""
  key = (tuple(layout.mesh.items()), layout.zero_stage)
  if key not in sizes:
    sizes[key] = describe.run_size(configure(cfg, layout), devices)
  return sizes[key]


def _layouts(cfg, devices, layouts, candidate_args):
  layouts_given = layouts
  if layouts is None:
    layouts, rejected = candidates(cfg, devices, **candidate_args)
  else:
    layouts, rejected = _validated(cfg, layouts, devices)
  if not layouts:
    reasons = sorted({why for _, why in rejected})[:3]
    if not reasons and layouts_given is None:   # candidates skips ZeRO >= 1 at fsdp 1
      zero = candidate_args.get('zero_stages', (0, 1, 3))
      reasons = [f'the ZeRO stages asked for, {zero}, shard over mesh.fsdp, and no layout '
                 'tried has fsdp > 1: add ZeRO stage 0 (--zero 0)']
    elif not reasons:
      reasons = ['no layout was given']
    raise ValueError(f'no layout of this config runs on {devices} devices; e.g. '
                     + ' | '.join(reasons))
  return layouts, rejected


def _validated(cfg, layouts, devices):
  valid, rejected = [], []
  for layout in layouts:
    try:
      _validate(configure(cfg, layout), devices)
      valid.append(layout)
    except ValueError as e:
      rejected.append((layout, str(e)))
  return valid, rejected
