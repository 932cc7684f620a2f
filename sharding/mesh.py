"""Device mesh from config: six named axes, outermost first, Auto axis types."""

import dataclasses
import math

import jax
from jax.sharding import AxisType, Mesh

# Outermost first: the innermost axis gets the fastest links.
MESH_AXES = ('data', 'stage', 'fsdp', 'expert', 'context', 'tensor')


@dataclasses.dataclass
class MeshConfig:
  """Size of each mesh axis; one may be -1 (takes the remaining devices)."""
  data: int = -1
  """Data parallelism: batch split, everything else replicated."""
  stage: int = 1
  """Pipeline parallelism: the layer stack split into stages (parallel.microbatches,
  parallel.pipeline_repeats); dense models with model.attention_impl=xla, mesh.context=1."""
  fsdp: int = 1
  """Batch split whose devices also share the ZeRO-sharded state (parallel.zero_stage)."""
  expert: int = 1
  """Expert parallelism: MoE experts split (model.num_experts), and the batch too."""
  context: int = 1
  """Context parallelism: each sequence split over devices (parallel.context_strategy)."""
  tensor: int = 1
  """Tensor parallelism: heads, MLP and vocab split (Megatron layout)."""


def mesh_shape(cfg: MeshConfig, num_devices: int) -> dict[str, int]:
  """Resolves -1 and checks the sizes multiply to the device count."""
  sizes = {a: getattr(cfg, a) for a in MESH_AXES}
  bad = [a for a, s in sizes.items() if s == 0 or s < -1]
  if bad:
    raise ValueError(f'mesh.{bad[0]}={sizes[bad[0]]}: each mesh axis size must be '
                     'a positive integer or -1 (the remaining devices).')
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f'mesh axes {free} are all -1; at most one may take the remaining '
                     'devices. Give the others explicit sizes.')
  fixed = math.prod(s for s in sizes.values() if s != -1)
  named = ' x '.join(f'mesh.{a}={s}' for a, s in sizes.items() if s > 1) or 'all axes 1'
  if free:
    if num_devices % fixed:
      raise ValueError(
          f'{named} (product {fixed}) does not divide the {num_devices} devices, so '
          f'mesh.{free[0]}=-1 cannot take the rest. Choose sizes whose product divides '
          f'{num_devices}.{_simulate_hint(fixed, num_devices)}')
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(
        f'{named} multiply to {fixed} but there are {num_devices} devices. Set one axis '
        f'to -1 (e.g. --config.mesh.data=-1) or make the product {num_devices}.'
        f'{_simulate_hint(fixed, num_devices)}')
  return sizes


def mesh_devices(cfg: MeshConfig, available: int) -> int:
  """Devices the mesh asks for: the product of its sizes, or `available` with a -1."""
  sizes = [getattr(cfg, a) for a in MESH_AXES]
  return available if -1 in sizes else math.prod(sizes)


def _simulate_hint(wanted: int, have: int) -> str:
  if wanted <= have:
    return ''
  # JAX reads JAX_NUM_CPU_DEVICES (its jax_num_cpu_devices option) before the first use.
  return (f' To try this layout on a CPU, simulate the devices: '
          f'JAX_NUM_CPU_DEVICES={wanted} python train.py ...')


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
  """A mesh over `devices` (default: all) with compiler-propagated (Auto) axes."""
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(cfg, len(devices))
  dims = tuple(shape[a] for a in MESH_AXES)
  # jax.make_mesh orders devices so inner axes get the fastest links.
  return jax.make_mesh(dims, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)
