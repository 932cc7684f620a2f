"""Expert parallelism: the MoE exchanges that need explicit collectives, in shard_map.

Experts are split over mesh axis `expert` (the rules map logical 'experts' there), and so
is the batch: a plan with mesh.expert > 1 puts `expert` in the activations' 'batch' rule,
so the devices of one expert group hold different sequences for the dense parts, as in
Megatron-Core and MaxText. The two exchanges:

- capacity: every device fills fixed-size buffers [b, E, C, d] for its own sequences, an
  all-to-all over `expert` sends each expert's buffers to the device holding it (and
  brings back [n*b, E/n, C, d]), the local experts run, and a second all-to-all returns
  the outputs. Fixed shapes: what XLA:CPU and TPU run.
- dropless: lax.ragged_all_to_all is not implemented on XLA:CPU, so this is Megatron's
  "allgather" dispatcher instead: the expert group all-gathers its tokens and routing,
  each device sorts the (token, choice) pairs routed to its own experts and runs them as
  one grouped matmul (lax.ragged_dot), and a reduce-scatter over `expert` sums the
  partial outputs back onto the devices that own the tokens.

Both run the expert weights whole on each device apart from the expert split: inside the
shard_map their other dimensions (fsdp, tensor) are gathered first, like ZeRO-3 does.
"""

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from sharding.rules import ShardingPlan

EXPERT_AXIS = 'expert'


def expert_shards(plan: ShardingPlan | None) -> int:
  """How many ways the plan splits the experts (1 without a plan)."""
  return 1 if plan is None else plan.mesh.shape[EXPERT_AXIS]


def _batch_spec(plan: ShardingPlan, ndim: int) -> P:
  return P(plan.activations.table.get('batch'), *([None] * (ndim - 1)))


def all_to_all_experts(plan: ShardingPlan, ffn: Callable, buffers: jax.Array,
                       weights: tuple[jax.Array, ...]) -> jax.Array:
  """ffn(x [b', E/n, C, d], *local expert weights) applied to buffers [b, E, C, d]
  (batch-sharded); weights [E, ...] each, split over `expert`."""
  spec = _batch_spec(plan, buffers.ndim)

  def local(x, *w):
    x = jax.lax.all_to_all(x, EXPERT_AXIS, split_axis=1, concat_axis=0, tiled=True)
    y = ffn(x, *w)
    return jax.lax.all_to_all(y, EXPERT_AXIS, split_axis=0, concat_axis=1, tiled=True)

  return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec,) + (P(EXPERT_AXIS),) * len(weights),
                       out_specs=spec, check_vma=False)(buffers, *weights)


def all_gather_experts(plan: ShardingPlan, local_experts: Callable, x: jax.Array,
                       ids: jax.Array, combine: jax.Array,
                       weights: tuple[jax.Array, ...]) -> jax.Array:
  """Dropless dispatch. local_experts(x [n, d], ids [n, k], combine [n, k], first_expert,
  *local weights) -> [n, d] (the local experts' share); x [b, t, d], ids/combine [b, t, k]
  batch-sharded."""
  specs = tuple(_batch_spec(plan, a.ndim) for a in (x, ids, combine))

  def local(x, ids, combine, *w):
    gather = lambda a: jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)
    xg, idg, cg = gather(x), gather(ids), gather(combine)
    first = jax.lax.axis_index(EXPERT_AXIS) * w[0].shape[0]
    k = ids.shape[-1]
    y = local_experts(xg.reshape(-1, x.shape[-1]), idg.reshape(-1, k), cg.reshape(-1, k),
                      first, *w)
    return jax.lax.psum_scatter(y.reshape(xg.shape), EXPERT_AXIS, scatter_dimension=0,
                                tiled=True)

  return jax.shard_map(local, mesh=plan.mesh,
                       in_specs=specs + (P(EXPERT_AXIS),) * len(weights),
                       out_specs=specs[0], check_vma=False)(x, ids, combine, *weights)
