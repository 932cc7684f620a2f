"""The engine's set-up from ServeConfig: the device mesh, the attention implementation,
the KV cache's size in blocks, and the lines that describe them at start."""

import math

import jax

from model import quant
from serve.config import ServeConfig
from serve.worker import kv_cache
from sharding.mesh import MeshConfig, make_mesh


def build_mesh(cfg: ServeConfig):
  """A mesh of cfg.tensor devices over 'tensor' (every other axis 1)."""
  devices = jax.devices()
  if cfg.tensor > len(devices):
    raise ValueError(f'--tensor={cfg.tensor} but there are only {len(devices)} devices; '
                     f'choose at most {len(devices)}.')
  return make_mesh(MeshConfig(data=1, tensor=cfg.tensor), devices=devices[:cfg.tensor])


def size_cache(served, cfg: ServeConfig, mesh, max_model_len: int) -> int:
  """Number of KV blocks; refuses a cache that cannot hold one full-length request."""
  per_request = math.ceil(max_model_len / cfg.block_size)
  num_blocks = cfg.num_blocks or _blocks_from_memory(served, cfg, mesh, per_request)
  # Block 0 is the scheduler's null block (padding writes land there).
  needed = per_request + 1
  if num_blocks < needed:
    raise ValueError(
        f'The KV cache has {num_blocks} blocks of {cfg.block_size} tokens '
        f'(one reserved), too few for one request of the full context '
        f'(--max-model-len={max_model_len} needs {needed} blocks). Give '
        f'--num-blocks={needed} or more, lower --max-model-len to '
        f'{max(num_blocks - 1, 0) * cfg.block_size} or less, or raise --memory-fraction.')
  return num_blocks


def _blocks_from_memory(served, cfg: ServeConfig, mesh, per_request: int) -> int:
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(served.params)) // cfg.tensor
  blocks = kv_cache.num_blocks_for_memory(
      served.model_cfg, cfg.block_size, fraction=cfg.memory_fraction,
      device=mesh.devices.flat[0], param_bytes=param_bytes, tensor_parallel=cfg.tensor,
      kv_cache_dtype=cfg.kv_cache_dtype)
  if mesh.devices.flat[0].platform == 'cpu':
    # CPU devices share the host's memory with everything else: no more than
    # max_num_seqs full-length requests can use at once.
    blocks = min(blocks, cfg.max_num_seqs * per_request + 1)
  return blocks


def describe_model(served) -> str:
  weights = jax.tree.leaves(served.params, is_leaf=quant.is_quantized)
  count = sum(w.qvalue.size if quant.is_quantized(w) else w.size for w in weights)
  size = sum(x.nbytes for x in jax.tree.leaves(served.params))   # scales included
  count = f'{count / 1e9:.2f}B' if count >= 1e9 else f'{count / 1e6:.2f}M'
  size = f'{size / 2**30:.2f} GiB' if size >= 2**30 else f'{size / 2**20:.2f} MiB'
  cfg = served.model_cfg
  kinds = quant.describe(served.params)
  stored = (f', {kinds} layer weights, the rest in {cfg.param_dtype}' if kinds
            else f' in {cfg.param_dtype}')
  return (f'Model {served.name}: {count} parameters, {size}{stored}; activations and KV '
          f'cache in {cfg.dtype}.')


def describe_cache(num_blocks: int, cfg: ServeConfig, max_model_len: int) -> str:
  tokens = (num_blocks - 1) * cfg.block_size
  stored = '' if cfg.kv_cache_dtype == 'auto' else f' ({cfg.kv_cache_dtype}, scaled)'
  return (f'KV cache{stored}: {num_blocks} blocks of {cfg.block_size} tokens = {tokens} tokens; '
          f'{tokens / max_model_len:.1f} requests at the full context of {max_model_len} '
          'tokens at once.')
