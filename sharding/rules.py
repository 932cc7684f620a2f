"""Logical-axis rules: the one table that maps model names onto mesh axes.

Model code names only logical axes. A `Rules` table turns a tuple of logical names into a
`PartitionSpec`; a `ShardingPlan` holds one table each for parameters, gradients,
optimizer state and activations, chosen by ZeRO stage:

  stage   params      grads       opt state
  0       replicated  replicated  replicated      (over data/fsdp; tensor always applies)
  1       replicated  replicated  sharded
  2       replicated  sharded     sharded
  3       sharded     sharded     sharded         (FSDP: gathered per layer in the scan)

"Sharded" puts the `embed` dimension, which every weight has, on the `fsdp` mesh axis.
"""

import dataclasses
import functools
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding import context, pipeline

MeshAxes = str | tuple[str, ...] | None
LogicalAxes = tuple[str | None, ...]

BATCH_AXES = ('data', 'fsdp')
# Expert parallelism also splits the batch over `expert` (the dense parts run on different
# sequences per expert device; sharding/moe.py exchanges tokens between them). Only added
# when mesh.expert > 1, so every other layout keeps its exact specs.
EXPERT_BATCH_AXES = BATCH_AXES + ('expert',)

# Tensor parallelism (Megatron layout): heads, kv heads, mlp and vocab split over
# `tensor`; `embed` stays whole so each block needs one reduction per projection pair.
_TENSOR = {
    'vocab': 'tensor', 'embed': None, 'heads': 'tensor', 'kv_heads': 'tensor',
    'head_dim': None, 'mlp': 'tensor', 'experts': 'expert', 'layers': None,
}
# Activations. `seq` is the residual stream's sequence axis at block edges (sequence
# parallelism puts it on `tensor` too); `act_seq` is the sequence inside attention/MLP,
# where `tensor` is taken by heads or mlp.
_ACTIVATIONS = {
    'batch': BATCH_AXES, 'seq': 'context', 'act_seq': 'context', 'act_embed': None,
    'act_heads': 'tensor', 'act_kv_heads': 'tensor', 'act_mlp': 'tensor',
    'act_vocab': 'tensor',
}


@dataclasses.dataclass(frozen=True)
class Rules:
  """Logical axis name -> mesh axes. Unknown names and None are replicated."""
  name: str
  table: Mapping[str, MeshAxes]

  def spec(self, axes: LogicalAxes) -> PartitionSpec:
    owner: dict[str, str] = {}
    out = []
    for logical in axes:
      mesh_axes = self.table.get(logical) if logical else None
      for m in _as_tuple(mesh_axes):
        if m in owner:
          raise ValueError(
              f'rules {self.name!r}: logical axes {owner[m]!r} and {logical!r} of one '
              f'tensor {axes} both map to mesh axis {m!r}. Map one of them elsewhere.')
        owner[m] = logical
      out.append(mesh_axes)
    return PartitionSpec(*out)

  def mesh_axes(self) -> set[str]:
    """Every mesh axis some logical axis is mapped onto."""
    return {m for v in self.table.values() for m in _as_tuple(v)}

  def with_overrides(self, name: str, **entries: MeshAxes) -> 'Rules':
    return Rules(name, {**self.table, **entries})


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
  if mesh_axes is None:
    return ()
  return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


REPLICATED = Rules('replicated', _TENSOR)
ZERO_SHARDED = REPLICATED.with_overrides('zero_sharded', embed='fsdp')
# (params, grads, opt_state) per ZeRO stage.
ZERO_STAGES = {
    0: (REPLICATED, REPLICATED, REPLICATED),
    1: (REPLICATED, REPLICATED, ZERO_SHARDED),
    2: (REPLICATED, ZERO_SHARDED, ZERO_SHARDED),
    3: (ZERO_SHARDED, ZERO_SHARDED, ZERO_SHARDED),
}


def activation_rules(sequence_parallel: bool) -> Rules:
  base = Rules('activations', _ACTIVATIONS)
  if sequence_parallel:
    return base.with_overrides('activations_sp', seq=('context', 'tensor'))
  return base


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """Where every parameter, gradient, optimizer-state leaf and activation lives."""
  mesh: Mesh
  params: Rules
  grads: Rules
  opt_state: Rules
  activations: Rules
  # Context parallelism (sharding.context), when the mesh's context axis is > 1.
  context_strategy: str = 'all_gather'   # 'all_gather' | 'ring'
  context_load_balance: bool = False     # the batch is reordered for causal balance
  # Pipeline parallelism (sharding.pipeline), when the mesh's stage axis is > 1.
  pipeline_microbatches: int = 1
  pipeline_repeats: int = 1

  # The model's two seams where a layout changes how it computes, not only where values
  # live (model/transformer.py asks; it knows no strategy): attention over a sequence
  # split across devices, and the layer stack across pipeline stages.
  def attention(self, q, k, v, segment_ids, local, flash=None):
    """q [b,t,h,e], k/v [b,t,k,e] -> [b,t,h,e]. `local(q, k, v, segment_ids)` where each
    device holds whole sequences; over the 'context' axis (sharding.context, this plan's
    strategy) where the sequence is split, with `flash` (the flash-attention kernel, or
    None for XLA) for the blocks."""
    if context.context_size(self) > 1:
      return context.attention(q, k, v, segment_ids, self, constrain, flash)
    return local(q, k, v, segment_ids)

  def layer_stack(self):
    """The runner of the model's layer stack for this layout, (layer_for, x, positions,
    segment_ids, layers, remat) -> x: the pipeline over 'stage' (sharding.pipeline) when
    the mesh has stages, else None (the model scans its layers)."""
    if pipeline.stages(self) > 1:
      return functools.partial(pipeline.run_layers, plan=self)
    return None

  def sharding(self, rules: Rules, axes: LogicalAxes) -> NamedSharding:
    return NamedSharding(self.mesh, rules.spec(axes))

  def tree(self, rules: Rules, axes_tree):
    """Shardings for a tree whose leaves are logical-axes tuples."""
    return jax.tree.map(lambda a: self.sharding(rules, a), axes_tree, is_leaf=_is_axes)

  def batch_sharding(self) -> NamedSharding:
    batch = self.activations.table['batch']
    return NamedSharding(self.mesh, PartitionSpec(batch, self.activations.table['seq']))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def process_rows(self, batch_size: int, seq_len: int) -> dict[int, tuple[int, int]]:
    """Rows [lo, hi) of the global [batch_size, seq_len] batch that each process's
    devices hold, by process index.

    A model axis (stage, context, tensor) spanning processes gives several processes the
    same rows, each loading them whole; the rows a process loads must be one run of
    consecutive whole chunks (batch_size / (hi - lo) of them) for the data pipeline to
    read just those. Raises ValueError naming the axes when a layout splits otherwise.
    """
    held: dict[int, set[int]] = {}
    for device, index in self.batch_sharding().devices_indices_map(
        (batch_size, seq_len)).items():
      held.setdefault(device.process_index, set()).update(range(batch_size)[index[0]])
    rows = {}
    for process, owned in sorted(held.items()):
      lo, hi = min(owned), max(owned) + 1
      if len(owned) != hi - lo or batch_size % (hi - lo) or lo % (hi - lo):
        raise ValueError(self._rows_error(process, sorted(owned), batch_size))
      rows[process] = (lo, hi)
    return rows

  def _rows_error(self, process: int, owned: list[int], batch_size: int) -> str:
    processes = len({d.process_index for d in self.mesh.devices.flat})
    spanning = [a for a in self.mesh.axis_names if _spans_processes(self.mesh, a)]
    shown = owned if len(owned) <= 8 else owned[:4] + ['...'] + owned[-2:]
    return (f'the batch of {batch_size} rows does not split into whole chunks per process '
            f'on this mesh {dict(self.mesh.shape)}: process {process}\'s devices hold rows '
            f'{shown} (mesh axes {spanning} span the {processes} processes). Make mesh.data '
            f'a multiple of the process count, e.g. --config.mesh.data={processes} with '
            'the other axes dividing each process\'s devices.')


def _spans_processes(mesh: Mesh, axis: str) -> bool:
  """Whether devices along `axis` (the others fixed) belong to different processes."""
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  along = np.moveaxis(procs, mesh.axis_names.index(axis), 0)
  return bool((along != along[:1]).any())


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def make_plan(mesh: Mesh, zero_stage: int, sequence_parallel: bool = True,
              context_strategy: str = 'all_gather',
              context_load_balance: bool = False, pipeline_microbatches: int = 1,
              pipeline_repeats: int = 1) -> ShardingPlan:
  if zero_stage not in ZERO_STAGES:
    raise ValueError(f'parallel.zero_stage={zero_stage}: choose one of {sorted(ZERO_STAGES)}.')
  params, grads, opt_state = ZERO_STAGES[zero_stage]
  sp = sequence_parallel and mesh.shape['tensor'] > 1
  activations = activation_rules(sp)
  if mesh.shape['expert'] > 1:
    activations = activations.with_overrides(f'{activations.name}_ep', batch=EXPERT_BATCH_AXES)
  if mesh.shape['stage'] > 1:   # the layer stack split over pipeline stages
    params, grads, opt_state = (r.with_overrides(f'{r.name}_pp', layers='stage')
                                for r in (params, grads, opt_state))
  return ShardingPlan(mesh, params, grads, opt_state, activations, context_strategy,
                      context_load_balance, pipeline_microbatches, pipeline_repeats)


def constrain(x: jax.Array, axes: LogicalAxes, plan: ShardingPlan | None) -> jax.Array:
  """Pins an activation's layout at a block edge; a no-op without a plan."""
  if plan is None:
    return x
  return jax.lax.with_sharding_constraint(x, plan.sharding(plan.activations, axes))


def check_divisible(plan: ShardingPlan, rules: Rules, shapes, axes_tree,
                    field_of: Mapping[str, str] | None = None) -> None:
  """Fails early, naming the config field, when a dimension does not split evenly."""
  field_of = field_of or {}
  sizes = plan.mesh.shape
  flat_shapes, _ = jax.tree.flatten_with_path(shapes)
  flat_axes = jax.tree.leaves(axes_tree, is_leaf=_is_axes)
  for (path, shape), axes in zip(flat_shapes, flat_axes):
    for dim, logical in zip(shape.shape, axes):
      n = 1
      for m in _as_tuple(rules.table.get(logical) if logical else None):
        n *= sizes[m]
      if dim % n:
        field = field_of.get(logical, logical)
        raise ValueError(
            f'parameter {jax.tree_util.keystr(path)}: its {logical!r} dimension ({dim}) does '
            f'not split over mesh axes {rules.table[logical]!r} of total size {n}. Choose '
            f'{field} divisible by {n}, or change the mesh.')
