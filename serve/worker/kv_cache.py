"""KV cache sizing: how many blocks fit, from a fraction of the memory the weights leave.

Like vLLM's gpu_memory_utilization, but of the memory left after the weights:

    blocks = floor(fraction * (device memory - param_bytes) / kv bytes per block)

The rest, (1 - fraction) of what the weights leave, is headroom for activations, logits
and the compiled programs. Device memory is `device.memory_stats()['bytes_limit']` on
GPU; on CPU, where memory_stats() is None, it is the machine's physical memory
(os.sysconf), which every CPU device shares: pass an explicit block count there when
several processes or simulated devices share the machine. All sizes are per device:
under tensor parallelism pass `tensor_parallel`, which splits each block's kv heads.
"""

import os

import jax
import numpy as np

from model import kv_quant
from model.config import ModelConfig


def kv_bytes_per_block(model_cfg: ModelConfig, block_size: int,
                       tensor_parallel: int = 1, kv_cache_dtype: str = 'auto') -> int:
  """Bytes of one block's K and V over all layers (on one device of `tensor_parallel`);
  an 8-bit cache's: a byte a value and a float32 scale per token and kv head."""
  kv_heads = model_cfg.num_kv_heads // tensor_parallel
  per_head = model_cfg.resolved_head_dim * kv_quant.storage_dtype(
      kv_cache_dtype, model_cfg.dtype).itemsize
  if kv_quant.is_quantized(kv_cache_dtype):
    per_head += np.dtype(kv_quant.SCALE_DTYPE).itemsize
  return 2 * model_cfg.num_layers * kv_heads * per_head * block_size


def device_memory_bytes(device=None) -> int:
  """Memory of `device` (default: the first): the allocator's limit, or on CPU the
  machine's physical memory."""
  device = device or jax.devices()[0]
  stats = device.memory_stats()
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def num_blocks_for_memory(model_cfg: ModelConfig, block_size: int, *, fraction: float,
                          device=None, param_bytes: int, tensor_parallel: int = 1,
                          memory_bytes: int | None = None,
                          kv_cache_dtype: str = 'auto') -> int:
  """Blocks that fit in `fraction` of the device memory left after `param_bytes` of
  weights (per device). `memory_bytes` overrides the measured device memory."""
  if not 0 < fraction <= 1:
    raise ValueError(f'kv cache memory fraction={fraction} must be in (0, 1].')
  if param_bytes < 0:
    raise ValueError(f'param_bytes={param_bytes} must be >= 0.')
  total = device_memory_bytes(device) if memory_bytes is None else memory_bytes
  left = total - param_bytes
  blocks = int(fraction * left) // kv_bytes_per_block(model_cfg, block_size, tensor_parallel,
                                                      kv_cache_dtype)
  if blocks <= 0:
    raise ValueError(f'no KV cache blocks fit: the weights take {param_bytes / 2**30:.2f} '
                     f'GiB of {total / 2**30:.2f} GiB. Use a larger device, more tensor '
                     'parallelism, a larger memory fraction, or an explicit block count.')
  return blocks


def describe_capacity(num_blocks: int, block_size: int, max_model_len: int) -> str:
  """One line for the start-up log; ValueError when one full-length request cannot fit."""
  tokens = num_blocks * block_size
  per_request = -(-max_model_len // block_size)
  if num_blocks < per_request:
    raise ValueError(f'the KV cache holds {tokens} tokens ({num_blocks} blocks of '
                     f'{block_size}), fewer than one request of max_model_len='
                     f'{max_model_len} needs ({per_request} blocks). Lower max_model_len or '
                     'give the cache more memory or blocks.')
  return (f'KV cache: {num_blocks} blocks x {block_size} tokens = {tokens} tokens; '
          f'{num_blocks / per_request:.2f}x concurrency at max_model_len={max_model_len}.')
