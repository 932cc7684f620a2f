"""8-bit KV cache formats: what --kv-cache-dtype stores, and how a step's K/V get there.

A quantized cache keeps each page slot's kv head, a vector of head_dim values, as 8-bit
values and one float32 scale (the vector's largest |value| over the format's largest
value), so x ~= q * scale:

    k pages   [L, P, page, Hkv, D]  int8 | float8_e4m3fn | float8_e5m2
    k scales  [L, P, page, Hkv]     float32            (v alike)

Per token and kv head: the step's scatter writes a slot's values and its scale together,
and no block already written is ever rescaled; the attention paths dequantize a page
block right after loading it (pallas_kernels.paged_attention.dequantize). Of the
granularities measured on the trained tiny model this one loses least (docs/serving/
kv-cache.md has the numbers).
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import dequantize  # noqa: F401  (re-exported)

# vLLM's names (fp8 is fp8_e4m3), and MaxText's int8.
KV_CACHE_DTYPES = ('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8')
STORAGE = {'fp8': jnp.float8_e4m3fn, 'fp8_e4m3': jnp.float8_e4m3fn,
           'fp8_e5m2': jnp.float8_e5m2, 'int8': jnp.int8}
SCALE_DTYPE = jnp.float32


def check_name(kv_cache_dtype: str) -> None:
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f'--kv-cache-dtype={kv_cache_dtype!r}: choose one of '
                     f'{", ".join(KV_CACHE_DTYPES)}.')


def storage_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
  """The pages' dtype: the model's for auto, else the 8-bit format's."""
  check_name(kv_cache_dtype)
  return jnp.dtype(model_dtype if kv_cache_dtype == 'auto' else STORAGE[kv_cache_dtype])


def is_quantized(kv_cache_dtype: str) -> bool:
  check_name(kv_cache_dtype)
  return kv_cache_dtype != 'auto'


def max_value(dtype) -> float:
  dtype = jnp.dtype(dtype)
  if dtype == jnp.int8:
    return 127.0
  return float(jnp.finfo(dtype).max)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """x [..., D] -> (values [..., D] in the 8-bit `dtype`, float32 scales [...])."""
  x = x.astype(jnp.float32)
  top = max_value(dtype)
  amax = jnp.max(jnp.abs(x), axis=-1)
  # An all-zero vector keeps scale 1: its values are 0 whatever the scale.
  scale = jnp.where(amax > 0, amax / top, 1.0).astype(SCALE_DTYPE)
  y = x / scale[..., None]
  if jnp.dtype(dtype) == jnp.int8:
    y = jnp.round(y)
  # amax / scale may land an ulp past top; float8_e4m3fn has no inf, and a value past
  # its range casts to NaN: keep every code in range whatever the rounding.
  return jnp.clip(y, -top, top).astype(dtype), scale


def check_backend(kv_cache_dtype: str, device=None, attention: str = 'xla') -> None:
  """ValueError (one line, naming the flag and the formats that work) where `device`
  cannot store and convert the format: probed by a round trip through it, and for the
  Pallas kernel on a GPU, fp8 needs compute capability 8.9 (Triton's fp8 converts)."""
  if not is_quantized(kv_cache_dtype):
    return
  device = device or jax.devices()[0]
  if not _works(kv_cache_dtype, device, attention):
    working = [name for name in KV_CACHE_DTYPES if _works(name, device, attention)]
    raise ValueError(f'--kv-cache-dtype={kv_cache_dtype}: {device.platform} device '
                     f'{device.device_kind!r} with --attention {attention} cannot store it; '
                     f'choose one of {", ".join(working)}.')


def _works(name: str, device, attention: str) -> bool:
  if name == 'auto':
    return True
  dtype = STORAGE[name]
  if attention == 'pallas' and device.platform == 'gpu' and dtype != jnp.int8:
    if float(getattr(device, 'compute_capability', '0')) < 8.9:
      return False
  x = np.linspace(-3, 3, 16, dtype=np.float32).reshape(2, 8)
  try:
    q, s = jax.jit(quantize, static_argnums=1)(jax.device_put(x, device), dtype)
    back = np.asarray(jax.jit(lambda q, s: dequantize(q, s, jnp.float32))(q, s))
  except Exception:  # pylint: disable=broad-except  # any failure means: not here
    return False
  return bool(np.all(np.abs(back - x) <= 0.25 * np.abs(x).max(axis=-1, keepdims=True)))
