"""Train state, its shardings under a plan, and the jitted train step."""

import dataclasses
import os
import re
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

import model
from model import lora, moe
from sharding import context, offload
from sharding.rules import BATCH_AXES, ShardingPlan
from training import family
from training.config import Config


@flax.struct.dataclass
class TrainState:
  """params: what trains (with LoRA, the adapters: model/lora.py's tree); frozen: LoRA's
  base weights in the compute dtype (no gradients, no optimizer state, never saved in
  checkpoints), else None."""
  step: jax.Array
  params: Any
  opt_state: Any
  frozen: Any = None


def trainable_axes(cfg: Config):
  """Logical axes of the trained tree: the adapters' with LoRA, else the model's."""
  if cfg.lora.rank:
    return lora.logical_axes(cfg.model, cfg.lora)
  return family.of(cfg).logical_axes()


def trainable_abstract(cfg: Config):
  if cfg.lora.rank:
    return lora.abstract_adapter(cfg.model, cfg.lora, cfg.model.param_dtype)
  return family.of(cfg).abstract_params()


def state_shardings(cfg: Config, plan: ShardingPlan, tx) -> TrainState:
  """Where each leaf of the train state lives: params, then optimizer copies of them
  (with LoRA, the frozen base on the model's parameter layout)."""
  axes = trainable_axes(cfg)
  abstract = jax.eval_shape(tx.init, trainable_abstract(cfg))
  opt_shardings = plan.tree(plan.opt_state, axes)
  opt_state = optax.tree_map_params(
      tx, lambda _, s: s, abstract, opt_shardings,
      transform_non_params=lambda _: plan.replicated())
  if cfg.parallel.offload_optimizer:
    opt_state = offload.with_memory_kind(opt_state, offload.HOST)
  frozen = None
  if cfg.lora.rank:
    frozen = plan.tree(plan.params, model.logical_axes(cfg.model))
  return TrainState(step=plan.replicated(), params=plan.tree(plan.params, axes),
                    opt_state=opt_state, frozen=frozen)


def abstract_state(cfg: Config, plan: ShardingPlan, tx) -> TrainState:
  """ShapeDtypeStructs carrying shardings: a restore target for any mesh."""
  shardings = state_shardings(cfg, plan, tx)
  shapes = jax.eval_shape(lambda: _new_state(cfg, tx, jax.random.key(0)))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def _new_state(cfg: Config, tx, key) -> TrainState:
  if cfg.lora.rank:
    return _state_around(_new_adapter(cfg, key), tx).replace(frozen=_random_base(cfg, key))
  return _state_around(family.of(cfg).init_params(key), tx)


def _random_base(cfg: Config, key):
  dtype = jnp.dtype(cfg.model.dtype)
  return jax.tree.map(lambda w: w.astype(dtype), model.init_params(cfg.model, key))


def _new_adapter(cfg: Config, key):
  return lora.init_adapter(cfg.model, cfg.lora, jax.random.fold_in(key, 1),
                           cfg.model.param_dtype)


def _state_around(params, tx) -> TrainState:
  """Step 0 and a new optimizer state around `params`."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def frozen_base(cfg: Config, plan: ShardingPlan, released=None):
  """LoRA's base on the model's parameter layout, in the compute dtype: `released` (host
  arrays) placed shard by shard, or the seed's random weights."""
  shardings = plan.tree(plan.params, model.logical_axes(cfg.model))
  if released is None:
    init = jax.jit(lambda key: _random_base(cfg, key), out_shardings=shardings)
    return init(jax.random.key(cfg.seed))
  dtype = jnp.dtype(cfg.model.dtype)
  return jax.tree.map(
      lambda host, sh: jax.make_array_from_callback(
          host.shape, sh, lambda i: np.asarray(host[i]).astype(dtype)), released, shardings)


def init_state(cfg: Config, plan: ShardingPlan, tx, params=None, base=None,
               adapter=None) -> TrainState:
  """Fresh state, created directly in its sharded layout: random weights, or `params`
  (host arrays, e.g. a released model's) placed shard by shard, with a new optimizer
  state either way. With LoRA, adapters (new, or `adapter`'s host arrays) train on `base`
  (frozen_base's), else on frozen_base(params)."""
  shardings = state_shardings(cfg, plan, tx)
  if cfg.lora.rank:
    base = frozen_base(cfg, plan, params) if base is None else base
    trained = shardings.replace(frozen=None)
    if adapter is None:
      init = jax.jit(lambda key: _state_around(_new_adapter(cfg, key), tx),
                     out_shardings=trained)
      return init(jax.random.key(cfg.seed)).replace(frozen=base)
    dtype = jnp.dtype(cfg.model.param_dtype)
    adapter = jax.tree.map(lambda host, sh: jax.make_array_from_callback(
        host.shape, sh, lambda i: np.asarray(host[i]).astype(dtype)), adapter,
                           shardings.params)
    return jax.jit(lambda p: _state_around(p, tx), out_shardings=trained)(adapter).replace(
        frozen=base)
  if params is None:
    init = jax.jit(lambda key: _new_state(cfg, tx, key), out_shardings=shardings)
    return init(jax.random.key(cfg.seed))
  # Each device takes only its shard of the host copy (every process holds the whole
  # tree; nothing is gathered or compared across processes).
  params = jax.tree.map(
      lambda host, sh: jax.make_array_from_callback(host.shape, sh, lambda i: host[i]),
      params, shardings.params)
  init = jax.jit(lambda p: _state_around(p, tx), out_shardings=shardings, donate_argnums=0)
  return init(params)


# The batch's row indices, added for LoRA dropout only (see loss_and_grads).
LORA_ROW = 'lora_row'


def objective(cfg: Config, frozen=None, key=None):
  """(params, batch, model config, plan) -> (summed nll, MoE aux): the whole model's, or
  with `frozen` (LoRA's base) the base with the adapters `params` (dropout by `key`); a
  user model's (model.module) loss, with no aux."""
  if family.is_user(cfg):
    fam = family.of(cfg)
    return lambda params, batch, m, plan: (fam.summed_nll(params, batch, plan), moe.zero_aux())
  if frozen is None:
    return model.summed_nll_and_aux

  def with_adapters(adapter, batch, m, plan):
    rows = batch.get(LORA_ROW)
    batch = {k: v for k, v in batch.items() if k != LORA_ROW}
    salted = key if key is None or rows is None else jax.random.fold_in(key, rows[0])
    form = lora.layer_form(adapter, cfg.lora, m, salted)
    return model.summed_nll_and_aux(frozen, batch, m, plan, lora=form)

  return with_adapters


def _summed(nll_and_aux):
  return lambda *args: nll_and_aux(*args)[0]


def model_params(cfg: Config, train_state: TrainState):
  """The model's weights: the trained params, or with LoRA the base with the adapters
  merged in (the compute dtype)."""
  if not cfg.lora.rank:
    return train_state.params
  return lora.merge(train_state.frozen, train_state.params, cfg.lora, cfg.model)


def loss_and_grads(params, batch: dict, cfg: Config, plan: ShardingPlan | None,
                   with_aux: bool = False, frozen=None, key=None):
  """Mean token loss and its gradients over the batch, in `grad_accum` microbatches;
  with_aux: also the MoE aux values (model.moe.AUX_KEYS). With LoRA, `params` are the
  adapters and `frozen` the base (see `objective`).

  MoE: the gradient is that of loss + moe_aux_loss_coef * moe_aux_loss +
  router_z_loss_coef * router_z_loss; the loss returned is the language-model loss alone.
  With grad_accum > 1 the aux losses are computed per microbatch and averaged (dropped
  tokens summed).
  """
  weight = jnp.maximum(jnp.sum(batch['weights'].astype(jnp.float32)), 1.0)
  batch = context.reorder_batch(batch, plan)   # causal load balance under CP
  if key is not None:
    # Each microbatch and batch shard draws its own dropout masks: the objective folds the
    # index of the first row it computes into the key (microbatches take rows i, i+accum..).
    batch = {**batch, LORA_ROW: jnp.arange(batch['inputs'].shape[0], dtype=jnp.int32)}
  accum = cfg.optim.grad_accum
  aux = moe.zero_aux()
  nll_and_aux = objective(cfg, frozen, key)
  if cfg.model.num_experts:
    total, grads, aux = _moe_loss_and_grads(params, batch, cfg, plan, weight, nll_and_aux)
  elif accum == 1:
    total, grads = jax.value_and_grad(_summed(nll_and_aux))(params, batch, cfg.model, plan)
  else:
    micro = _microbatches(batch, accum)
    accumulate = _accumulate_per_shard if _grads_replicated(plan) else _accumulate_sharded
    total, grads = accumulate(params, micro, cfg, plan, _summed(nll_and_aux))
  loss, grads = total / weight, jax.tree.map(lambda g: g / weight, grads)
  return (loss, grads, aux) if with_aux else (loss, grads)


def _microbatches(batch: dict, accum: int) -> dict:
  """[accum, b / accum, ...]: microbatch i takes rows i, i+accum, ..., so each stays spread
  over every batch shard."""
  return jax.tree.map(
      lambda x: jnp.swapaxes(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 0, 1), batch)


def _moe_loss_and_grads(params, batch: dict, cfg: Config, plan, weight, nll_and_aux):
  """(summed nll, gradients of summed nll + weight * aux penalty, aux values); each
  microbatch is differentiated and its gradient accumulated (sharded, as ZeRO-2/3)."""
  m, accum = cfg.model, cfg.optim.grad_accum

  def objective(p, mb):
    total, aux = nll_and_aux(p, mb, m, plan)
    penalty = m.moe_aux_loss_coef * aux['moe_aux_loss'] + m.router_z_loss_coef * aux[
        'router_z_loss']
    return total + weight / accum * penalty, (total, aux)

  grad_fn = jax.grad(objective, has_aux=True)
  if accum == 1:
    grads, (total, aux) = grad_fn(params, batch)
    return total, grads, aux
  micro = _microbatches(batch, accum)
  grad_sh = None if plan is None else plan.tree(plan.grads, trainable_axes(cfg))

  def body(acc, mb):
    grads, out = grad_fn(params, mb)
    acc = jax.tree.map(jnp.add, acc, (grads, out))
    if grad_sh is not None:
      acc = (jax.lax.with_sharding_constraint(acc[0], grad_sh), acc[1])
    return acc, None

  zeros = jax.tree.map(jnp.zeros_like, (params, (jnp.zeros(()), moe.zero_aux())))
  (grads, (total, aux)), _ = jax.lax.scan(body, zeros, micro)
  aux = {k: v if k == 'dropped_tokens' else v / accum for k, v in aux.items()}
  return total, grads, aux


def _grads_replicated(plan: ShardingPlan | None) -> bool:
  """ZeRO-0/1: gradients end up whole on every batch shard."""
  return plan is not None and not set(BATCH_AXES) & plan.grads.mesh_axes()


def _accumulate_sharded(params, micro, cfg: Config, plan, summed_nll):
  """ZeRO-2/3 (or no plan): each microbatch's gradient is reduce-scattered as it comes."""
  grad_fn = jax.value_and_grad(summed_nll)
  grad_sh = None if plan is None else plan.tree(plan.grads, trainable_axes(cfg))

  def body(carry, mb):
    total, grads = grad_fn(params, mb, cfg.model, plan)
    acc = jax.tree.map(jnp.add, carry[1], grads)
    if grad_sh is not None:
      acc = jax.lax.with_sharding_constraint(acc, grad_sh)
    return (carry[0] + total, acc), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  (total, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
  return total, grads


def _accumulate_per_shard(params, micro, cfg: Config, plan: ShardingPlan, summed_nll):
  """ZeRO-0/1: each batch shard sums its own microbatch gradients, reduced once at the end.

  The gradient is vmapped over a leading batch-shard axis mapped onto (data, fsdp), so a
  microbatch's partial gradient stays on its shard instead of being all-reduced.
  """
  shards = plan.mesh.shape['data'] * plan.mesh.shape['fsdp']
  local = dataclasses.replace(
      plan, activations=plan.activations.with_overrides('per_shard', batch=None))
  grad_fn = jax.vmap(lambda p, mb: jax.value_and_grad(summed_nll)(p, mb, cfg.model, local),
                     in_axes=(None, 0), spmd_axis_name=BATCH_AXES)
  carry_sh = plan.tree(plan.grads.with_overrides('per_shard', shard=BATCH_AXES),
                       jax.tree.map(lambda a: ('shard', *a), trainable_axes(cfg),
                                    is_leaf=lambda x: isinstance(x, tuple)))

  def body(carry, mb):
    mb = jax.tree.map(lambda x: x.reshape(shards, x.shape[0] // shards, *x.shape[1:]), mb)
    total, grads = grad_fn(params, mb)
    acc = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, carry[1], grads), carry_sh)
    return (carry[0] + total, acc), None

  zeros = jax.tree.map(lambda p: jnp.zeros((shards, *p.shape), p.dtype), params)
  (total, grads), _ = jax.lax.scan(body, (jnp.zeros((shards,), jnp.float32), zeros), micro)
  return jnp.sum(total), jax.tree.map(lambda g: jnp.sum(g, axis=0), grads)


def skip_if_not_finite(new: TrainState, old: TrainState, loss, grad_norm):
  """(new, True) after a finite step, else (old, False): the step changes nothing.

  Selected leaf by leaf, so each keeps its (ZeRO) sharding and the old state comes back
  bitwise. `step` counts applied updates (it drives the schedule, like the optimizer's own
  count). optax.apply_if_finite would wrap the optimizer state (old checkpoints would no
  longer restore), look at the updates only, and apply a bad update after its limit.
  """
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old), ok


def make_eval_step(cfg: Config, plan: ShardingPlan):
  """jit(params, batch, frozen) -> (summed nll, summed weight) of a held-out batch: the
  training loss's forward, no gradients, in the same grad_accum microbatches (so it fits
  wherever the train step does); frozen: LoRA's base, else None."""
  def step(params, batch: dict, frozen):
    def summed(params, batch):
      return objective(cfg, frozen)(params, context.reorder_batch(batch, plan), cfg.model,
                                    plan)[0]

    weight = jnp.sum(batch['weights'].astype(jnp.float32))
    if cfg.optim.grad_accum == 1:
      return summed(params, batch), weight
    total, _ = jax.lax.scan(lambda acc, mb: (acc + summed(params, mb), None),
                            jnp.zeros((), jnp.float32),
                            _microbatches(batch, cfg.optim.grad_accum))
    return total, weight

  params_sh = plan.tree(plan.params, trainable_axes(cfg))
  frozen_sh = plan.tree(plan.params, model.logical_axes(cfg.model)) if cfg.lora.rank else None
  return jax.jit(step, in_shardings=(params_sh, batch_shardings(cfg, plan), frozen_sh),
                 out_shardings=plan.replicated())


# XLA passes the train step compiles without, by remat policy. Under 'save_attention' and
# 'none' the layer scan saves the attention kernel's output, and the GPU pass
# dynamic-slice-fusion-rewriter-v2 fuses a copy of the kernel with the writes of that
# output (and its log-sum-exp) into the saved residuals while keeping the original for the
# layer's own output: the step would run the kernel twice a layer where jax lowers one
# call (tests/test_model.py; benchmarks/hlo_pass_trace.py names the pass). Runs with and
# without it: benchmarks/results/passes_off_gpu.md. A CPU has no such pass: naming it
# there changes nothing; nor does a name an XLA version lacks (it is not checked).
PASSES_OFF = {'save_attention': ('dynamic-slice-fusion-rewriter-v2',),
              'none': ('dynamic-slice-fusion-rewriter-v2',)}


def compiler_options(cfg: Config) -> dict[str, str]:
  """XLA options for cfg's train step (jax.jit's compiler_options). The jit's
  xla_disable_hlo_passes replaces XLA_FLAGS' for that program, so the passes named there
  are kept in the list."""
  passes = PASSES_OFF.get(cfg.model.remat, ())
  if not passes:
    return {}
  flags = re.findall(r'--xla_disable_hlo_passes=(\S*)', os.environ.get('XLA_FLAGS', ''))
  users = [p for given in flags for p in given.split(',') if p]
  return {'xla_disable_hlo_passes': ','.join(dict.fromkeys([*users, *passes]))}


def batch_shardings(cfg: Config, plan: ShardingPlan):
  """The batch's layout: token batches one sharding for every array; a data.source's
  arrays each their own (training/trainer.py assembles them), so it is left to them."""
  return None if cfg.data.source else plan.batch_sharding()


def make_train_step(cfg: Config, plan: ShardingPlan, tx, schedule):
  """jit(state, batch) -> (state, metrics); the state buffer is donated."""
  shardings = state_shardings(cfg, plan, tx)
  grad_shardings = plan.tree(plan.grads, trainable_axes(cfg))
  device_opt_shardings = offload.with_memory_kind(shardings.opt_state,
                                                  offload.default_kind(plan.mesh))

  def step(state: TrainState, batch: dict):
    key = jax.random.fold_in(jax.random.key(cfg.seed), state.step) if cfg.lora.dropout else None
    loss, grads, aux = loss_and_grads(state.params, batch, cfg, plan, with_aux=True,
                                      frozen=state.frozen, key=key)
    # ZeRO-2/3: the constraint turns the gradient all-reduce into a reduce-scatter.
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
    if cfg.parallel.offload_optimizer:
      # Host -> device for the update only; out_shardings send the new state back.
      state = state.replace(opt_state=jax.device_put(state.opt_state, device_opt_shardings))
    with jax.named_scope('optimizer'):
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      params = jax.lax.with_sharding_constraint(params, shardings.params)
      grad_norm = optax.tree.norm(grads)
      new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
      # The frozen base passes through untouched (selecting it would copy it every step).
      new, ok = skip_if_not_finite(new, state.replace(frozen=None), loss, grad_norm)
      new = new.replace(frozen=state.frozen)
    metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': schedule(state.step),
               'skipped': 1 - ok.astype(jnp.int32)}
    if cfg.model.num_experts:
      metrics.update(aux)
    return new, metrics

  batch_sh = batch_shardings(cfg, plan)
  return jax.jit(step, in_shardings=(shardings, batch_sh),
                 out_shardings=(shardings, plan.replicated()), donate_argnums=0,
                 compiler_options=compiler_options(cfg))
