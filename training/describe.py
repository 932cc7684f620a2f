"""What `train.py --help` and `train.py --check` print: the config's fields and a run's size.

Each field's meaning is the docstring under it in its dataclass (one source of truth);
`--check` sizes the train state on an abstract mesh, so nothing is allocated or compiled.
"""

import ast
import dataclasses
import functools
import inspect
import math
import textwrap

import jax
from jax.sharding import AbstractMesh, AxisType

import model
from sharding.mesh import MESH_AXES, mesh_devices, mesh_shape
from sharding.rules import check_divisible, make_plan
from training import config as config_lib, optimizer, state


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
  """{field: the string literal right under it} for a dataclass (attribute docstrings)."""
  body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
  docs = {}
  for node, after in zip(body, body[1:]):
    if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
      docs[node.target.id] = ' '.join(after.value.value.split())
  return docs


def sections(cfg) -> list[tuple[str, object]]:
  """(name, dataclass) for each section of a Config, then ('top level', cfg) itself."""
  nested = [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
            if dataclasses.is_dataclass(getattr(cfg, f.name))]
  return nested + [('top level', cfg)]


def help_text(cfg: config_lib.Config, config_path: str, variants) -> str:
  lines = [
      'usage: python train.py [--config=NAME.py[:variant]] [--check] '
      '[--config.SECTION.FIELD=VALUE ...]', '',
      f'config {config_path}: variants {", ".join(repr(v) for v in variants) or "none"}; '
      'the values below are the chosen config\'s.',
      '  --check   validate the config and the mesh, print the run\'s size, allocate nothing',
      '  --help    this list', '']
  for name, section in sections(cfg):
    lines.append(f'{name}: {inspect.getdoc(type(section)).splitlines()[0]}')
    docs = field_docs(type(section))
    for f in dataclasses.fields(section):
      value = getattr(section, f.name)
      if dataclasses.is_dataclass(value):
        continue
      kind = getattr(f.type, '__name__', str(f.type))
      lines.append(f'  {f.name:<24} {kind:<6} {value!r:<14} {docs.get(f.name, "")}')
    lines.append('')
  return '\n'.join(lines)


def run_size(cfg: config_lib.Config, available_devices: int) -> dict:
  """Validates cfg for the devices its mesh needs; sizes the train state per device."""
  devices = mesh_devices(cfg.mesh, available_devices)
  config_lib.validate(cfg, devices)
  sizes = mesh_shape(cfg.mesh, devices)
  mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                      axis_types=(AxisType.Auto,) * len(MESH_AXES))
  plan = make_plan(mesh, cfg.parallel.zero_stage, cfg.parallel.sequence_parallel,
                     cfg.parallel.context_strategy, cfg.parallel.context_load_balance,
                     config_lib.pipeline_microbatches(cfg, sizes['stage']),
                     cfg.parallel.pipeline_repeats)
  shapes, axes = model.abstract_params(cfg.model), model.logical_axes(cfg.model)
  for rules in (plan.params, plan.grads, plan.opt_state):
    check_divisible(plan, rules, shapes, axes)
  train_state = state.abstract_state(cfg, plan, optimizer.make_optimizer(cfg.optim, cfg.steps))
  # With LoRA only the adapters have gradients and optimizer state; the base is frozen.
  grads = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       state.trainable_abstract(cfg),
                       plan.tree(plan.grads, state.trainable_axes(cfg)))
  return {'parameters': model.count_params(cfg.model), 'mesh': sizes, 'devices': devices,
          'param_bytes': _bytes(train_state.params), 'grad_bytes': _bytes(grads),
          'opt_state_bytes': _bytes(train_state.opt_state),
          'frozen_bytes': _bytes(train_state.frozen),
          'trained': sum(x.size for x in jax.tree.leaves(train_state.params)),
          'batch_tokens': cfg.data.batch_size * cfg.data.seq_len}


def check_report(cfg: config_lib.Config, available_devices: int) -> str:
  size = run_size(cfg, available_devices)
  memory = {'parameters': size['param_bytes'], 'gradients': size['grad_bytes'],
            'optimizer state': size['opt_state_bytes']}
  lora_line = []
  if cfg.lora.rank:
    memory = {f'frozen base ({cfg.model.dtype})': size['frozen_bytes'],
              'adapters': memory.pop('parameters'), **memory}
    lora_line = [f'LoRA          rank {cfg.lora.rank} on {", ".join(cfg.lora.targets)}: '
                 f'{size["trained"]:,} trained parameters '
                 f'({100 * size["trained"] / size["parameters"]:.2f}% of the base)']
  host = ''
  if cfg.parallel.offload_optimizer:   # in host memory between steps
    host = f'; optimizer state {_gib(memory.pop("optimizer state"))} in host memory'
  return '\n'.join([
      f'parameters    {size["parameters"]:,} ({size["parameters"] / 1e9:.2f}B)',
      f'mesh          {size["mesh"]}: needs {size["devices"]} device(s); this machine has '
      f'{available_devices}',
      f'per device    {", ".join(f"{k} {_gib(v)}" for k, v in memory.items())}; '
      f'{_gib(sum(memory.values()))} before activations (ZeRO-{cfg.parallel.zero_stage})'
      f'{host}',
      f'global batch  {cfg.data.batch_size} x {cfg.data.seq_len} = '
      f'{size["batch_tokens"]:,} tokens per step, in {cfg.optim.grad_accum} microbatch(es)',
      *lora_line,
  ])


def _bytes(tree) -> int:
  """Bytes of the largest shard of each leaf, summed: one device's share."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def _gib(n: int) -> str:
  return f'{n / 2**30:.2f} GiB'
