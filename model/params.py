"""The decoder's parameters, declared abstractly: shapes, logical axis names and
initializers (param_specs), and what is derived from them. Below model.transformer and
model.lora, which both read the specs.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from model import moe
from model.config import ModelConfig

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]   # logical axis names, one per dimension
  init: str                      # 'ones', 'zeros', 'normal' or 'residual' (scaled by depth)


def param_specs(cfg: ModelConfig) -> Params:
  """Every parameter's shape, logical axes and initializer; allocates nothing."""
  L, D, F, V = cfg.num_layers, cfg.embed_dim, cfg.resolved_mlp_dim, cfg.vocab_size
  H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  layers = {
      'attn_norm': ParamSpec((L, D), ('layers', 'embed'), _norm_init(cfg)),
      'wq': ParamSpec((L, D, H, E), ('layers', 'embed', 'heads', 'head_dim'), 'normal'),
      'wk': ParamSpec((L, D, K, E), ('layers', 'embed', 'kv_heads', 'head_dim'), 'normal'),
      'wv': ParamSpec((L, D, K, E), ('layers', 'embed', 'kv_heads', 'head_dim'), 'normal'),
      'wo': ParamSpec((L, H, E, D), ('layers', 'heads', 'head_dim', 'embed'), 'residual'),
      'mlp_norm': ParamSpec((L, D), ('layers', 'embed'), _norm_init(cfg)),
      'w_gate': ParamSpec((L, D, F), ('layers', 'embed', 'mlp'), 'normal'),
      'w_up': ParamSpec((L, D, F), ('layers', 'embed', 'mlp'), 'normal'),
      'w_down': ParamSpec((L, F, D), ('layers', 'mlp', 'embed'), 'residual'),
      **_attention_extras(cfg),
  }
  specs = {
      'embed': ParamSpec((V, D), ('vocab', 'embed'), 'normal'),
      'layers': layers,
      'final_norm': ParamSpec((D,), ('embed',), _norm_init(cfg)),
  }
  if not cfg.tie_embeddings:
    specs['lm_head'] = ParamSpec((D, V), ('embed', 'vocab'), 'normal')
  if cfg.num_experts:
    _moe_param_specs(cfg, specs)
  return specs


def _attention_extras(cfg: ModelConfig) -> Params:
  """Per-layer q/k/v biases (qkv_bias) and q/k head norms (qk_norm)."""
  L, H, K, E = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  norm_init = _norm_init(cfg)
  extras = {}
  if cfg.qkv_bias:
    extras['bq'] = ParamSpec((L, H, E), ('layers', 'heads', 'head_dim'), 'zeros')
    extras['bk'] = ParamSpec((L, K, E), ('layers', 'kv_heads', 'head_dim'), 'zeros')
    extras['bv'] = ParamSpec((L, K, E), ('layers', 'kv_heads', 'head_dim'), 'zeros')
  if cfg.qk_norm:
    extras['q_norm'] = ParamSpec((L, E), ('layers', 'head_dim'), norm_init)
    extras['k_norm'] = ParamSpec((L, E), ('layers', 'head_dim'), norm_init)
  if cfg.sandwich_norms:
    extras['post_attn_norm'] = ParamSpec((L, cfg.embed_dim), ('layers', 'embed'), norm_init)
    extras['post_mlp_norm'] = ParamSpec((L, cfg.embed_dim), ('layers', 'embed'), norm_init)
  return extras


def _norm_init(cfg: ModelConfig) -> str:
  # With norm_plus_one a norm's weight w scales by 1 + w: its identity is w = 0.
  return 'zeros' if cfg.norm_plus_one else 'ones'


def _moe_param_specs(cfg: ModelConfig, specs: Params) -> None:
  """MoE configs: the dense layers stay in 'layers' (num_layers - G of them; none when
  every layer is MoE), the G MoE layers, attention included, stack in 'moe_layers'."""
  layers, num_moe = specs.pop('layers'), cfg.num_moe_layers
  restack = lambda s, n: ParamSpec((n, *s.shape[1:]), s.axes, s.init)
  if num_moe < cfg.num_layers:
    specs['layers'] = {k: restack(s, cfg.num_layers - num_moe) for k, s in layers.items()}
  # Everything but the dense MLP (w_gate, w_up, w_down).
  attn = {k: restack(s, num_moe) for k, s in layers.items() if not k.startswith('w_')}
  specs['moe_layers'] = {**attn, **{k: ParamSpec(*v) for k, v in moe.param_shapes(cfg).items()}}


def abstract_params(cfg: ModelConfig) -> Params:
  dtype = jnp.dtype(cfg.param_dtype)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_specs(cfg))


def logical_axes(cfg: ModelConfig) -> Params:
  return jax.tree.map(lambda s: s.axes, param_specs(cfg))


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  """Initial weights; each leaf's key depends only on its position, not on sharding."""
  specs = param_specs(cfg)
  leaves, treedef = jax.tree.flatten(specs)
  dtype = jnp.dtype(cfg.param_dtype)
  residual_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)

  def one(i, spec):
    if spec.init in ('ones', 'zeros'):
      return (jnp.ones if spec.init == 'ones' else jnp.zeros)(spec.shape, dtype)
    std = residual_std if spec.init == 'residual' else cfg.init_std
    return (std * jax.random.normal(jax.random.fold_in(key, i), spec.shape)).astype(dtype)

  return jax.tree.unflatten(treedef, [one(i, s) for i, s in enumerate(leaves)])


def count_params(cfg: ModelConfig) -> int:
  return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg)))
