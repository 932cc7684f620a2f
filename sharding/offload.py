"""Host offload: which memory an array lives in (its memory kind), beside how it is split.

A memory kind changes only where each shard is stored, never the layout: a ZeRO-sharded
optimizer state offloaded to `pinned_host` keeps its spec. Inside jit, `jax.device_put` to a
sharding of another memory kind is the transfer; on GPU and TPU it lowers to an
`annotate_device_placement` custom call that XLA turns into host<->device copies.

jax 0.10.2 on CPU: devices list the memory kinds `device`, `pinned_host` and
`unpinned_host`; arrays can be placed in each and a jitted function's arguments and results
keep theirs (the compiled entry layout marks host buffers `S(5)`), but a `device_put`
inside jit lowers to nothing there: on CPU, host and device memory are the same RAM.
"""

import jax

HOST = 'pinned_host'


def memory_kinds(device: jax.Device) -> set[str]:
  """Memory kinds a device can address ('device', 'pinned_host', ...)."""
  return {m.kind for m in device.addressable_memories()}


def _local_default_kind(devices) -> str:
  """The default memory kind of this process's first device among `devices` (another
  process's devices cannot be asked)."""
  device = next(d for d in devices if d.process_index == jax.process_index())
  return device.default_memory().kind


def default_kind(mesh: jax.sharding.Mesh) -> str:
  """The memory kind arrays get when none is named (the accelerator's own memory)."""
  return _local_default_kind(mesh.devices.flat)


def is_offloaded(x) -> bool:
  """Whether x is an array placed in host memory."""
  return isinstance(x, jax.Array) and x.sharding.memory_kind in (HOST, 'unpinned_host')


def to_default_memory(x: jax.Array) -> jax.Array:
  """A copy of x in its devices' default memory, same sharding otherwise."""
  return jax.device_put(x, x.sharding.with_memory_kind(_local_default_kind(x.devices())))


def with_memory_kind(shardings, kind: str):
  """The same shardings (a tree of them), placed in memory `kind`."""
  return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def host_memory_error(field: str, value, fix: str, device: jax.Device) -> str | None:
  """An error message if `device` has no pinned host memory for `field`, else None."""
  kinds = memory_kinds(device)
  if HOST in kinds:
    return None
  return (f'{field}={value} needs {HOST!r} host memory, and {device.platform} devices offer '
          f'only {sorted(kinds)}: {fix}.')
