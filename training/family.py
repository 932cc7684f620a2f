"""The model the trainer trains: the built-in transformer, or a user's Flax NNX module.

Both answer the same questions, the only ones the trainer asks of a model: parameter
shapes (abstractly), logical axes per parameter, fresh parameters from a key, the summed
loss of a batch, the parameter count and the FLOPs per token. Everything else (meshes,
ZeRO, tensor parallelism, accumulation, checkpoints, resume) is the same code for both.
"""

import dataclasses

import model
from sharding.rules import ShardingPlan
from training import user_model


@dataclasses.dataclass(frozen=True)
class Builtin:
  """meshlm's own transformer (model/), configured by cfg.model."""
  cfg: model.ModelConfig

  def abstract_params(self):
    return model.abstract_params(self.cfg)

  def logical_axes(self):
    return model.logical_axes(self.cfg)

  def init_params(self, key):
    return model.init_params(self.cfg, key)

  def summed_nll(self, params, batch: dict, plan: ShardingPlan | None):
    return model.summed_nll(params, batch, self.cfg, plan)

  def count_params(self) -> int:
    return model.count_params(self.cfg)

  def flops_per_token(self, seq_len: int) -> float:
    return model.flops_per_token(self.cfg, seq_len)

  def unannotated_notice(self) -> str:
    return ''


def is_user(cfg) -> bool:
  """Whether cfg trains a user's module (model.module) instead of the built-in model."""
  return bool(cfg.model.module)


def of(cfg) -> 'Builtin | user_model.UserModel':
  if is_user(cfg):
    return user_model.build(cfg.model, cfg.rules)
  return Builtin(cfg.model)


def with_user_rules(plan: ShardingPlan, cfg) -> ShardingPlan:
  """The plan with the config's rules that name mesh axes added to the parameter,
  gradient and optimizer-state tables (the same axes at every ZeRO stage)."""
  if not is_user(cfg):
    return plan
  _, fixed = user_model.resolve_rules(dict(cfg.rules))
  if not fixed:
    return plan
  return dataclasses.replace(plan, **{
      name: getattr(plan, name).with_overrides(f'{getattr(plan, name).name}_user', **fixed)
      for name in ('params', 'grads', 'opt_state')})
