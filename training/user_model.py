"""A user's Flax NNX module as the trainer's model.

The trainer works on a pytree of parameters with a tuple of logical axis names per leaf
(the built-in model's contract, training/family.py). An NNX module becomes one by
`nnx.split`: its graph definition is kept here, its `nnx.Param`s become a flat dict
{'path/to/param': array} (plain string keys: optax, orbax and the weight-decay mask read
it as they read the built-in model's), and each Param's sharding annotation
(`nnx.Param(..., sharding=...)`, `nnx.with_partitioning`) becomes its logical axes. The
loss merges the module back from the traced parameters, so jit, grad, scan over
microbatches and the sharding plan see plain arrays.

Axis names resolve through the config's `rules`: a built-in logical name (`embed`,
`mlp`, `heads`, `kv_heads`, `head_dim`, `vocab`, `experts`, `layers`) follows the preset
tables, ZeRO included; `rules` maps the user's own names to a built-in name (an alias,
sharded as that axis) or to mesh axes (fixed in every table).
"""

import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import sys

import jax
from flax import nnx

from sharding import rules as rules_lib
from sharding.mesh import MESH_AXES

BUILTIN_AXES = tuple(rules_lib.REPLICATED.table)


def load(path: str, field: str):
  """'package.module:attribute' -> the attribute; errors name the config field."""
  module_name, _, attr = path.partition(':')
  if not module_name or not attr:
    raise ValueError(f"{field}={path!r}: give an import path 'package.module:Name'.")
  try:
    module = _import(module_name)
  except ImportError as e:
    raise ValueError(f'{field}={path!r}: cannot import {module_name!r} ({e}); run from the '
                     'directory holding it or put it on PYTHONPATH.') from e
  if not hasattr(module, attr):
    raise ValueError(f'{field}={path!r}: {module_name} has no {attr!r}.')
  return getattr(module, attr)


# model.remat for a user module: the policy its remat-wrapped blocks save by (None: no remat).
REMAT_POLICIES = {'none': None, 'full': jax.checkpoint_policies.nothing_saveable,
                  'save_matmuls': jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def remat(name: str):
  """A decorator for a block's function (module, *args) -> out: nnx.remat with the
  policy model.remat names, or the function as it is for 'none'. A module taking a
  `remat` argument gets model.remat there."""
  if name not in REMAT_POLICIES:
    raise ValueError(f'model.remat={name!r} with model.module: choose one of '
                     f'{tuple(REMAT_POLICIES)}.')
  policy = REMAT_POLICIES[name]
  return (lambda f: f) if policy is None else (lambda f: nnx.remat(f, policy=policy))


# The checkout holding training/: meshlm's own examples/ sit beside it.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import(name: str):
  """importlib.import_module; a top-level package of meshlm's checkout that is not
  installed (examples/) is found there from any working directory."""
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    top = name.partition('.')[0]
    if e.name != top or not os.path.isdir(os.path.join(_CHECKOUT, top)):
      raise
  sys.path.append(_CHECKOUT)
  return importlib.import_module(name)


def resolve_rules(user_rules: dict) -> tuple[dict, dict]:
  """(aliases {user name: built-in name}, fixed {user name: mesh axes}); refuses values
  that are neither."""
  aliases, fixed = {}, {}
  for name, target in user_rules.items():
    if target in BUILTIN_AXES:
      aliases[name] = target
      continue
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
      raise ValueError(
          f'rules[{name!r}]={target!r}: {unknown} is neither a built-in logical axis '
          f'{BUILTIN_AXES} nor a mesh axis {MESH_AXES}.')
    fixed[name] = target if target else None
  return aliases, fixed


def _annotation(variable) -> tuple | None:
  """A Param's logical axes: flax 0.12 keeps `sharding=` as `out_sharding`."""
  meta = variable.get_metadata()
  for key in ('out_sharding', 'sharding_names', 'sharding'):
    if meta.get(key) is not None:
      return tuple(meta[key])
  return None


@dataclasses.dataclass(frozen=True)
class UserModel:
  """The trainer's model-family interface over an NNX module class."""
  make: object        # key -> the module (constructor with the config's kwargs)
  loss_fn: object     # (module, batch) -> summed loss over the batch's weights
  graphdef: object
  paths: dict         # flat key -> the Param's path in the module
  variables: dict     # flat key -> the abstract nnx.Param (shape, dtype, metadata)
  axes: dict          # flat key -> logical axes after the rules
  unannotated: tuple  # flat keys of parameters without a sharding annotation

  def abstract_params(self) -> dict:
    return {k: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype)
            for k, v in self.variables.items()}

  def logical_axes(self) -> dict:
    return dict(self.axes)

  def init_params(self, key) -> dict:
    with nnx.use_eager_sharding(False):
      module = self.make(key)
    _, params = nnx.split(module, nnx.Param)
    return {_key(path): var.get_value() for path, var in nnx.to_flat_state(params)}

  def module(self, params: dict):
    """The module with `params` (arrays or tracers) as its parameters."""
    flat = [(self.paths[k], var.replace(value=params[k])) for k, var in self.variables.items()]
    return nnx.merge(self.graphdef, nnx.from_flat_state(flat))

  def summed_nll(self, params: dict, batch: dict, plan=None):
    del plan   # the user's module names its activation layouts itself, if at all
    return self.loss_fn(self.module(params), batch)

  def count_params(self) -> int:
    return sum(math.prod(v.get_value().shape) for v in self.variables.values())

  def flops_per_token(self, seq_len: int) -> float:
    del seq_len
    return 0.0   # unknown for an arbitrary module: no MFU

  def unannotated_notice(self) -> str:
    """One line naming the replicated, unannotated parameters and their bytes ('' if none)."""
    if not self.unannotated:
      return ''
    values = {k: self.variables[k].get_value() for k in self.unannotated}
    sizes = {k: math.prod(v.shape) * v.dtype.itemsize for k, v in values.items()}
    listed = ', '.join(f'{k} ({n:,} B)' for k, n in sizes.items())
    return (f'{len(sizes)} parameters have no sharding annotation and are replicated on '
            f'every device ({sum(sizes.values()):,} bytes): {listed}')


def _key(path) -> str:
  return '/'.join(str(p) for p in path)


def build(model_cfg, user_rules: dict) -> UserModel:
  """The UserModel of model.module/kwargs/loss under the config's rules (cached)."""
  return _build(model_cfg.module, json.dumps(dict(model_cfg.kwargs), sort_keys=True),
                model_cfg.loss, json.dumps(dict(user_rules), sort_keys=True), model_cfg.remat)


@functools.lru_cache(maxsize=16)
def _build(module: str, kwargs: str, loss: str, user_rules: str, remat: str) -> UserModel:
  make = _constructor(module, json.loads(kwargs), remat)
  loss_fn = load(loss, 'model.loss')
  try:
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(lambda: make(jax.random.key(0)))
  except TypeError as e:
    raise ValueError(f'model.kwargs={kwargs}: {module}(**model.kwargs, rngs=...) fails: '
                     f'{e}. Fix model.kwargs in the config.') from e
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  others = [_key(p) for p, _ in nnx.to_flat_state(rest)]
  if others:
    raise ValueError(f'model.module={module}: the trainer trains nnx.Param state only, and '
                     f'this module also holds {others[:4]}{" ..." if len(others) > 4 else ""} '
                     '(e.g. BatchNorm statistics, Dropout rngs): make those plain constants '
                     'or pass the randomness in the batch.')
  return UserModel(make, loss_fn, graphdef, *_named_axes(params, json.loads(user_rules)))


def _constructor(module: str, kwargs: dict, remat_name: str):
  """key -> the module; model.remat goes to a `remat` argument where there is one."""
  cls = load(module, 'model.module')
  if 'remat' in inspect.signature(cls.__init__).parameters:
    kwargs = {**kwargs, 'remat': remat_name}
  elif remat_name != 'none':
    raise ValueError(f'model.remat={remat_name!r}: {module} takes no `remat` argument to '
                     'pass it to; add one (and wrap its blocks in nnx.remat), or set '
                     'model.remat=none.')
  return lambda key: cls(**kwargs, rngs=nnx.Rngs(key))


def _named_axes(params, user_rules: dict) -> tuple[dict, dict, dict, tuple]:
  """(paths, variables, logical axes, unannotated keys) of the Params, by flat key; an
  axis name the rules do not know is refused."""
  aliases, fixed = resolve_rules(user_rules)
  known = set(BUILTIN_AXES) | set(aliases) | set(fixed)
  paths, variables, axes, unannotated = {}, {}, {}, []
  for path, var in nnx.to_flat_state(params):
    key, names = _key(path), _annotation(var)
    if names is None:
      unannotated.append(key)
      names = (None,) * var.get_value().ndim
    bad = [n for n in names if n is not None and n not in known]
    if bad:
      raise ValueError(
          f'parameter {key} names logical axes {bad}, which the rules do not know: the '
          f'rules map {sorted(known)}. Add them to the config\'s rules (a built-in name to '
          'shard them like it, or mesh axes), or rename them.')
    paths[key], variables[key] = path, var
    axes[key] = tuple(aliases.get(n, n) for n in names)
  return paths, variables, axes, tuple(unannotated)
