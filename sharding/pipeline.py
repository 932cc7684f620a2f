"""Pipeline parallelism over the mesh axis 'stage': GPipe, with circular repeats.

The layer stack [L, ...] is viewed as [R, S, Lc, ...] (R = parallel.pipeline_repeats,
S = mesh.stage, Lc = L / (R S)): stage s holds layers (r S + s) Lc + j for every repeat
r. With R = 1 that is a contiguous block of the stack, which is how the 'layers' axis
is split over 'stage' in the parameter rules, so the view moves nothing. With R > 1 the
partitioner moves the layers that a contiguous split put elsewhere once per step (the
checkpointed tree keeps one layer order for every layout).

The batch is cut into M microbatches (parallel.microbatches, rows m, m + M, ... so each
stays spread over the batch shards). A loop of M R + S - 1 iterations carries a state
[S, b/M, t, d] split over 'stage': each iteration every stage runs its Lc layers on the
microbatch it holds (vmap over the stage axis, spmd_axis_name='stage', so the block's
sharding constraints keep the stage split and the other mesh axes keep their meaning),
then the state rolls one stage on, which the partitioner compiles to a collective
permute. Stage 0 takes microbatch i mod M: fresh for the first repeat, else the last
stage's output of the previous repeat, kept in a buffer (M >= S makes it ready in
time). Iterations where a stage holds no microbatch compute on stale data that is never
used: the bubble, (S - 1) / (M R + S - 1) of the layer FLOPs.

Embedding, final norm and head stay outside, replicated over 'stage'.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

AXIS = 'stage'
_FREE = PartitionSpec.UNCONSTRAINED


def stages(plan) -> int:
  return 1 if plan is None else plan.mesh.shape[AXIS]


def bubble_fraction(stages_: int, microbatches: int, repeats: int) -> float:
  return (stages_ - 1) / (microbatches * repeats + stages_ - 1)


def _pin(x, plan, dim: int):
  """x split over 'stage' on `dim`, its other dimensions left to the partitioner."""
  spec = [_FREE] * x.ndim
  spec[dim] = AXIS
  for d in range(dim):
    spec[d] = None
  return lax.with_sharding_constraint(x, NamedSharding(plan.mesh, PartitionSpec(*spec)))


def run_layers(layer_for, x, positions, segment_ids, layers, remat, plan):
  """The model's layer stack through the pipeline (ShardingPlan.layer_stack):
  layer_for(positions, segment_ids) -> ((x, weights) -> x) makes one layer for a
  microbatch's tokens, whose positions and segment ids travel with it through the
  stages; remat wraps the layer as the model's scan body is."""
  def layer(carry, weights):
    x, pos, seg = carry
    return (layer_for(pos, seg)(x, weights), pos, seg), None

  return run(remat(layer), x, positions, segment_ids, layers, plan)


def run(layer_fn, x, positions, segment_ids, layers, plan):
  """The layer stack applied to x [b, t, d] by the pipeline; layer_fn((x, positions,
  segment_ids), layer) -> ((x, positions, segment_ids), None) is one layer (the scan
  body the model uses without a pipeline, remat included)."""
  s_count, m_count, r_count = stages(plan), plan.pipeline_microbatches, plan.pipeline_repeats
  num_layers = jax.tree.leaves(layers)[0].shape[0]
  per_stage = num_layers // (r_count * s_count)
  w = jax.tree.map(lambda a: _pin(a.reshape(r_count, s_count, per_stage, *a.shape[1:]),
                                  plan, 1), layers)
  b = x.shape[0]
  split = lambda a: None if a is None else jnp.swapaxes(
      a.reshape(b // m_count, m_count, *a.shape[1:]), 0, 1)             # [M, b/M, ...]
  inputs = (split(x), split(positions), split(segment_ids))
  state = jax.tree.map(lambda a: _pin(jnp.zeros((s_count, *a.shape[1:]), a.dtype), plan, 0),
                       inputs)

  def stage(carry, stage_layers):
    carry, _ = lax.scan(layer_fn, carry, stage_layers)
    return carry

  run_stages = jax.vmap(stage, spmd_axis_name=AXIS)
  stage_ids = jnp.arange(s_count)

  def iteration(carry, i):
    state, buffer = carry
    m, r = i % m_count, i // m_count
    first = jax.tree.map(lambda fresh: fresh[m], inputs)
    first = (jnp.where(r == 0, first[0], buffer[m]), *first[1:])   # later repeats: buffer
    state = jax.tree.map(lambda s, v: s.at[0].set(v), state, first)
    repeat = jnp.clip((i - stage_ids) // m_count, 0, r_count - 1)
    here = jax.tree.map(lambda a: jax.vmap(lambda a_s, rep: a_s[rep], in_axes=(1, 0))(
        a, repeat), w)
    out = run_stages(state, here)
    done = i - (s_count - 1)     # the microbatch the last stage finished, if any
    buffer = jnp.where(done >= 0, buffer.at[done % m_count].set(out[0][s_count - 1]),
                       buffer)
    out = jax.tree.map(lambda a: _pin(jnp.roll(a, 1, axis=0), plan, 0), out)
    return (out, buffer), None

  init = (state, jnp.zeros_like(inputs[0]))
  (_, buffer), _ = lax.scan(iteration, init, jnp.arange(m_count * r_count + s_count - 1))
  return jnp.swapaxes(buffer, 0, 1).reshape(x.shape)
