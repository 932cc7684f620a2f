"""What a layout's train step must at least do, per device, known without compiling it:
the floors sharding/planner.py's lower_bound turns into a step time no compile of the
layout can be predicted under, so the search compiles only the layouts that could rank
among the rows it prints.

Each floor is below the number sharding/hlo.py reads from the compiled step, whatever
XLA makes of the program, for these reasons:
- dot FLOPs: the model's matmuls, forward and backward (model.flops_per_token's count:
  every weight once per token, causal attention at half the square, which a compiled
  XLA attention computes whole and the flash kernels are counted at), spread evenly over
  the devices: each runs the same partitioned program, so at least the average. On top,
  what the layout must redo: under remat='full' the forward matmuls whose outputs the
  backward reads, and a pipeline's bubble (each device runs its stage's layers on
  M + S - 1 iterations for M microbatches). Routed experts are left out: below a
  capacity factor of one, fewer than k experts a token are computed.
- memory: the step's arguments hold the train state, parameters and optimizer state as
  `train.py --check` sizes them per device; the compiled peak holds its arguments
  (optimizer state in host memory is left out).
- memory-bound traffic: the optimizer reads and writes its state once a step, in kernels
  of its own (the update needs the clipped, reduced gradients: it cannot ride inside a
  matmul); left out when the state is offloaded.
- exposed collectives, counted, not sized (their latency): a layer's attention and MLP
  each end in a sum over tensor shards, forward and backward (the layer's output is
  replicated over tensor, or sequence-sharded, at its edges: DESIGN.md), and the next
  block needs it, so the collectives cannot merge; context parallelism moves K/V to the
  queries forward and their gradients back; an MoE layer over `expert` dispatches and
  combines by all-to-all both ways. lower_bound counts only the costliest of these: one
  collective over several axes could serve two of them.
What it cannot bound (kernel launches, the matmuls' traffic, collective bytes, the
overlapped collectives) is taken as zero, so on a small model, whose step is launches
and dispatch, the bound is far below the compiled step and prunes little; on a large
one, whose step is matmuls, it is close. tests/test_planner.py checks each floor
against the compiled step for every layout of a tiny config (DP, FSDP at ZeRO 0, 1
and 3, TP, CP, PP; remat none and full).
"""

import math

import model
from sharding import planner
from training import config as config_lib, family


def floor(cfg: config_lib.Config, layout: planner.Layout, size: dict) -> planner.Floor:
  """cfg: the config with the layout applied; size: describe.run_size's for it. A user
  model's (model.module) matmuls and collectives are unknown until compiled: its floor
  is the optimizer's traffic and the state's bytes alone."""
  offloaded = cfg.parallel.offload_optimizer
  opt = 0 if offloaded else size['opt_state_bytes']
  user = family.is_user(cfg)
  return planner.Floor(dot_flops=0.0 if user else dot_flops(cfg, layout), other_bytes=2 * opt,
                       memory_bytes=size['param_bytes'] + size.get('frozen_bytes', 0) + opt,
                       exposed={} if user else exposed(cfg, layout))


def dot_flops(cfg: config_lib.Config, layout: planner.Layout) -> float:
  m, t = cfg.model, cfg.data.seq_len
  norms = (2 * m.num_layers + 1) * m.embed_dim
  lookup = 0 if m.tie_embeddings else m.vocab_size * m.embed_dim
  routed = (m.num_moe_layers * m.num_experts * 3 * m.embed_dim * m.resolved_moe_mlp_dim
            if m.num_experts else 0)
  head = m.vocab_size * m.embed_dim
  layer_params = model.count_params(m) - norms - lookup - routed - head
  attention = 2 * 2 * m.num_layers * t * m.num_heads * m.resolved_head_dim * 0.5
  layer_forward = 2 * layer_params + attention      # per token
  recompute = _recomputed(m, attention) if m.remat == 'full' else 0
  if cfg.lora.rank:
    # A frozen base has no weight gradients: its weights' matmuls run forward and for the
    # input gradient only, which the first layer's input (the frozen embedding) does not
    # need; the adapters' own matmuls are left out (a floor may leave out).
    layers = (2 * layer_params * (2 - 1 / m.num_layers) + 3 * attention + recompute)
    head_passes = 2
  else:
    layers, head_passes = 3 * layer_forward + recompute, 3
  stages, micro = layout.mesh['stage'], _microbatches(cfg, layout)
  bubble = (micro + stages - 1) / micro
  tokens = cfg.data.batch_size * t
  return tokens * (layers * bubble + head_passes * 2 * head) / math.prod(layout.mesh.values())


def _recomputed(m, attention: float) -> float:
  """Per token, the forward matmuls remat='full' must run again: those whose outputs the
  backward reads (attention's projections, its two products, a dense MLP's gate and up);
  an MLP's last matmul only feeds the residual, which is saved, so it is not redone."""
  d = m.resolved_head_dim
  attention_params = m.embed_dim * d * (2 * m.num_heads + 2 * m.num_kv_heads)
  gate_up = 2 * m.embed_dim * m.resolved_mlp_dim
  return 2 * (m.num_layers * attention_params
              + (m.num_layers - m.num_moe_layers) * gate_up) + attention


def exposed(cfg: config_lib.Config, layout: planner.Layout) -> dict:
  """{(axis,): collectives at least over it, on the critical path}."""
  m, mesh = cfg.model, layout.mesh
  # Layer passes one device runs a step: its stage's layers, each microbatch.
  per_layer = layout.grad_accum * _microbatches(cfg, layout) / mesh['stage']
  floors = {}
  if mesh['tensor'] > 1:
    floors[('tensor',)] = 2 * 2 * m.num_layers * per_layer
  if mesh['context'] > 1:
    floors[('context',)] = 2 * m.num_layers * per_layer
  if mesh['expert'] > 1 and m.num_experts:
    floors[('expert',)] = 2 * 2 * m.num_moe_layers * per_layer
  return floors


def _microbatches(cfg, layout) -> int:
  if layout.mesh['stage'] == 1:
    return 1
  return layout.microbatches or config_lib.pipeline_microbatches(cfg, layout.mesh['stage'])
