"""Weight-only 8-bit quantization: int8 or fp8 (e4m3) weights, one scale per output channel.

qwix, the JAX quantization library of MaxText and tpu-inference, does the numerics:
qwix.quantize (absmax calibration, rounding or the fp8 cast, the scale in the weight's
dtype) gives a qwix.QArray (qvalue, a scale with size 1 on the contracted axes, and a
zero point for asymmetric int8 checkpoints), and qwix.dequantize computes
(qvalue - zero_point) * scale. What meshlm does itself: which weights are quantized
(CONTRACTED), where they are dequantized (dense(), beside each matmul, so XLA fuses the
convert and the multiply into the dot's operand), and the scales' logical axes
(logical_axes: the weight's output axes, so tensor parallelism splits them like the
weight). qwix.quantize_model, its other half, intercepts the einsums inside Flax module
calls; meshlm's model is functions over a plain dict of arrays, so that half has nothing to
intercept.

The embedding and the output head stay in the model's dtype.
"""

import jax
import jax.numpy as jnp
import qwix

from model.config import ModelConfig

# --quantization name -> the stored dtype of the weights.
FORMATS = {'int8': jnp.int8, 'fp8': jnp.float8_e4m3fn}
# Each quantized layer weight (stacked [layers, ...]): the axes its matmul contracts. Every
# other axis, the layers axis included, gets its own scales.
CONTRACTED = {'wq': (1,), 'wk': (1,), 'wv': (1,), 'wo': (1, 2),
              'w_gate': (1,), 'w_up': (1,), 'w_down': (1,)}


def is_quantized(x) -> bool:
  return isinstance(x, qwix.QArray)


def dense(w, dtype):
  """w as a matmul operand in the compute dtype: a quantized weight's scale is cast to
  dtype and the weight dequantized in it, here beside its dot."""
  if is_quantized(w):
    return qwix.dequantize(w.astype(dtype))   # QArray.astype casts the scale
  return w.astype(dtype)


def check_format(fmt: str, cfg: ModelConfig, source: str = '--quantization') -> None:
  """ValueError naming the field and what is supported, before any weight is read."""
  if fmt not in FORMATS:
    raise ValueError(f'{source}={fmt!r} is not supported: choose one of '
                     f'{", ".join(FORMATS)} (8-bit weights, per-channel scales).')
  if cfg.num_experts:
    raise ValueError(f'{source}={fmt}: quantized weights cover dense models only; this '
                     f'model has {cfg.num_experts} experts. Serve it without quantization.')
  check_backend(fmt, f'{source}={fmt}')


def check_backend(fmt: str, source: str, device=None) -> None:
  """ValueError if the device cannot dequantize `fmt`: a tiny conversion is compiled and
  run there, so what the backend lacks is found before any weight reaches it."""
  if fmt != 'fp8':
    return
  device = device or jax.devices()[0]
  try:
    _fp8_probe(device)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'{source}: the {device.platform} backend ({device.device_kind}) '
                     f'cannot convert float8_e4m3fn ({type(e).__name__}); serve int8 '
                     'weights (--quantization int8) or unquantized ones.') from None


def _fp8_probe(device) -> None:
  x = jax.device_put(jnp.arange(4, dtype=jnp.float32), device)
  jax.block_until_ready(jax.jit(lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32))(x))


def quantize_params(params: dict, fmt: str) -> dict:
  """params with each CONTRACTED layer weight quantized to `fmt`, its scales in the
  weight's dtype; everything else as it is. Each weight keeps its sharding."""
  qtype = FORMATS[fmt]
  layers = dict(params['layers'])
  for name, contracted in CONTRACTED.items():
    w = layers[name]
    keep = tuple(a for a in range(w.ndim) if a not in contracted)
    layers[name] = qwix.quantize(w, qtype, channelwise_axes=keep)
  return {**params, 'layers': layers}


def dequantize_params(params: dict, dtype) -> dict:
  """Every quantized weight as the array dense() computes from it: the float model the
  quantized one computes exactly (the tests' reference)."""
  return jax.tree.map(lambda w: dense(w, dtype) if is_quantized(w) else w, params,
                      is_leaf=is_quantized)


def logical_axes(params: dict, axes: dict) -> dict:
  """axes (model.logical_axes) matched to params' quantized weights: the values keep the
  weight's axes, the scales and zero points the output ones (None where the scale has
  size 1 on an axis the weight does not)."""
  def one(w, names):
    if not is_quantized(w):
      return names
    scale = tuple(n if s == q else None
                  for n, s, q in zip(names, w.scale.shape, w.qvalue.shape))
    zero = None if w.zero_point is None else scale
    return qwix.QArray(names, scale, zero, w.qtype)

  return jax.tree.map(one, params, axes, is_leaf=is_quantized)


def describe(params: dict) -> str:
  """'int8' / 'float8_e4m3fn' weights of the tree, or '' for none."""
  kinds = sorted({str(jnp.dtype(w.qtype)) for w in jax.tree.leaves(params, is_leaf=is_quantized)
                  if is_quantized(w)})
  return ', '.join(kinds)
