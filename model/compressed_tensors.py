"""Pre-quantized Hugging Face checkpoints in the compressed-tensors format (the FP8 and
INT8 W8A16 checkpoints published for vLLM, written by llm-compressor).

config.json's quantization_config (quant_method "compressed-tensors") lists groups of
modules, each with its weights' scheme; the safetensors hold each quantized linear layer
as `weight` (float8_e4m3fn or int8; int8 packed four to an int32 `weight_packed`, with
`weight_shape`, in pack-quantized), `weight_scale` (one per output channel, or one for the
tensor) and, for asymmetric int8, `weight_zero_point`. Read here: 8-bit weights, float
or int, per channel or per tensor, in float-quantized, int-quantized or pack-quantized.
The layers' weights become model.quant's qwix.QArrays, computing (q - zero) * scale in the
compute dtype beside each matmul; a quantized embedding or head is dequantized at load.
Activations and the KV cache stay in the compute dtype: a W8A8 checkpoint's
input_activations and kv_cache_scheme (and their input_scale, k_scale, v_scale tensors)
are not applied. Everything else is refused, naming the field, before any weight is read.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import qwix

from model import hf
from model.config import ModelConfig

FORMATS = {'float-quantized': 'float', 'int-quantized': 'int', 'pack-quantized': 'int'}
STRATEGIES = ('channel', 'tensor')
# Tensors of schemes whose activations or KV cache meshlm keeps in the compute dtype.
_UNUSED = ('.input_scale', '.input_zero_point', '.k_scale', '.v_scale', '.output_scale')
_QDTYPES = (np.dtype(np.int8), np.dtype(jnp.float8_e4m3fn))


def quant_method(config: dict) -> str | None:
  """config.json's quantization_config.quant_method, or None for a float checkpoint."""
  qc = config.get('quantization_config')
  return None if qc is None else qc.get('quant_method')


def check_config(config: dict) -> None:
  """ValueError naming the first quantization_config field this reader does not follow."""
  qc = config['quantization_config']
  where = 'config.json quantization_config'
  method = qc.get('quant_method')
  if method != 'compressed-tensors':
    raise ValueError(f'{where}.quant_method={method!r} is not supported: only '
                     "'compressed-tensors' checkpoints (8-bit FP8 or INT8 weights) can be "
                     'read; serve the unquantized model (with --quantization int8 or fp8).')
  for field in ('sparsity_config', 'transform_config'):
    if qc.get(field):
      raise ValueError(f'{where}.{field} is not supported: only quantized weights '
                       '(no sparsity, no transforms) can be read.')
  if qc.get('quantization_status', 'compressed') != 'compressed':
    raise ValueError(f"{where}.quantization_status={qc['quantization_status']!r} is not "
                     "supported: only 'compressed' checkpoints can be read.")
  groups = qc.get('config_groups') or {}
  if not groups:
    raise ValueError(f'{where}.config_groups is empty: nothing says how the weights are '
                     'stored.')
  for name, group in groups.items():
    _check_group(f'{where}.config_groups.{name}', group, qc.get('format'))


def _check_group(where: str, group: dict, default_format: str | None) -> None:
  fmt = group.get('format') or default_format
  if fmt not in FORMATS:
    raise ValueError(f'{where}.format={fmt!r} is not supported: only '
                     f'{", ".join(FORMATS)} can be read.')
  w = group.get('weights')
  if not w:
    raise ValueError(f'{where}.weights is missing: only weight-quantized groups can be read.')
  checks = (
      ('num_bits', w.get('num_bits') == 8, '8 (4-bit schemes such as W4A16, AWQ and GPTQ '
       'are not read)'),
      ('type', w.get('type') == FORMATS[fmt], f'{FORMATS[fmt]!r} in {fmt}'),
      ('strategy', w.get('strategy') in STRATEGIES,
       f'{" or ".join(STRATEGIES)} (one scale per output channel or per tensor)'),
      ('dynamic', not w.get('dynamic'), 'false (scales stored with the weights)'),
      ('actorder', not w.get('actorder'), 'null'),
      ('symmetric', w.get('symmetric', True) or w.get('type') == 'int',
       'true for float weights'))
  for field, ok, supported in checks:
    if not ok:
      raise ValueError(f'{where}.weights.{field}={w.get(field)!r} is not supported: only '
                       f'{supported} can be read.')


@dataclasses.dataclass
class _Quantized:
  """One stored weight, [out, in] as Hugging Face keeps it."""
  values: np.ndarray           # int8 or float8_e4m3fn
  scale: np.ndarray            # float32 [out, 1]
  zero_point: np.ndarray | None   # int8 [out, 1]


def split(tensors: dict) -> tuple[dict, dict]:
  """(the tensors with each quantized weight's values in float32 (exact) under its
  `.weight` name, {that name: _Quantized}). ValueError naming a quantized tensor without
  its scale."""
  tensors = {k: v for k, v in tensors.items() if not k.endswith(_UNUSED)}
  quantized = {}
  for key in [k for k in tensors if k.endswith('.weight_scale')]:
    name = key.removesuffix('_scale')
    values = _values(tensors, name)
    out = values.shape[0]
    scale = np.broadcast_to(np.asarray(tensors.pop(key), np.float32).reshape(-1, 1), (out, 1))
    zero = tensors.pop(f'{name}_zero_point', None)
    if zero is not None:
      zero = _unpack(zero, (out, 1), dim=0) if zero.dtype == np.int32 else zero
      zero = np.asarray(zero, np.int8).reshape(out, 1)
    quantized[name] = _Quantized(values, np.ascontiguousarray(scale), zero)
    tensors[name] = values.astype(np.float32)
  for key, value in tensors.items():
    if key.endswith(('.weight', '.weight_packed')) and (
        value.dtype in _QDTYPES or key.endswith('_packed')):
      raise ValueError(f'{key} is stored as {value.dtype} but the checkpoint has no '
                       f'{key.removesuffix("_packed").removesuffix(".weight")}.weight_scale: '
                       'every quantized weight needs its scale.')
  return tensors, quantized


def _values(tensors: dict, name: str) -> np.ndarray:
  """The int8 or fp8 values of weight `name` [out, in] (unpacked from weight_packed)."""
  if f'{name}_packed' in tensors:
    shape = tuple(int(d) for d in np.asarray(tensors.pop(f'{name}_shape')))
    return _unpack(tensors.pop(f'{name}_packed'), shape, dim=1)
  if name not in tensors:
    raise ValueError(f'{name}_scale has no {name} (nor {name}_packed) beside it: not a '
                     'complete compressed-tensors checkpoint.')
  values = np.asarray(tensors[name])
  if values.dtype not in _QDTYPES:
    raise ValueError(f'{name} is stored as {values.dtype} beside its scale: only int8 and '
                     'float8_e4m3fn weights can be read.')
  return values


def _unpack(packed: np.ndarray, shape: tuple, dim: int) -> np.ndarray:
  """pack-quantized's 8-bit layout: four values to an int32 along `dim`, value i in bits
  8i..8i+7 (little-endian bytes), each stored plus 128."""
  packed = np.asarray(packed, np.int32)
  if dim == 0:
    packed = packed.T
  as_bytes = packed.astype('<i4').view(np.uint8).reshape(packed.shape[0], -1)
  values = (as_bytes.astype(np.int16) - 128).astype(np.int8)
  rows, cols = (shape[1], shape[0]) if dim == 0 else shape
  values = values[:rows, :cols]
  return values.T if dim == 0 else values


def params(tensors: dict, cfg: ModelConfig) -> dict:
  """Our tree from a compressed-tensors checkpoint's tensors: the layers' quantized
  weights as qwix.QArrays (values as stored, scales in cfg.param_dtype), the rest in
  cfg.param_dtype."""
  plain, quantized = split(tensors)
  for name in [n for n in quantized if not n.startswith('model.layers.')]:
    plain[name] = _dequantized(quantized.pop(name))   # an embedding or a head
  f32 = dataclasses.replace(cfg, param_dtype='float32')
  tree = hf.params_from_hf(plain, f32, on_host=True)
  dtype = jnp.dtype(cfg.param_dtype)
  out = {k: v for k, v in tree.items() if k not in ('layers', 'moe_layers')}
  for group, indices, table, _ in hf._layer_groups(cfg):  # pylint: disable=protected-access
    out[group] = {ours: _layer_weight(tree[group][ours], quantized, indices, name, in_axes,
                                      dtype) for name, ours, in_axes in table}
  return _to_device(out, dtype)


def _layer_weight(stacked, quantized, indices, name, in_axes, dtype):
  """One stacked weight [L, in..., out...]: a QArray if every layer's is quantized, a
  float array if none is."""
  names = [f'model.layers.{i}.{name}' for i in indices]
  stored = [quantized.get(n) for n in names]
  if all(s is None for s in stored):
    return stacked.astype(dtype)
  if any(s is None for s in stored):
    raise ValueError(f'{names[stored.index(None)]} is not quantized but {name} of other '
                     'layers is: meshlm reads a weight quantized in every layer or in none.')
  first = stored[0]
  shape = stacked.shape[1:]
  scale_shape = (1,) * in_axes + shape[in_axes:]
  stack = lambda arrays: np.stack([a.T.reshape(scale_shape) for a in arrays])
  zero = None if first.zero_point is None else stack([s.zero_point for s in stored])
  return qwix.QArray(stacked.astype(first.values.dtype),
                     stack([s.scale for s in stored]).astype(dtype), zero, first.values.dtype)


def _dequantized(q: _Quantized) -> np.ndarray:
  values = q.values.astype(np.float32)
  if q.zero_point is not None:
    values = values - q.zero_point.astype(np.float32)
  return values * q.scale


def _to_device(tree, dtype):
  if isinstance(tree, dict):
    return {k: _to_device(v, dtype) for k, v in tree.items()}
  if isinstance(tree, qwix.QArray):
    return qwix.QArray(*(None if x is None else jnp.asarray(x)
                         for x in (tree.qvalue, tree.scale, tree.zero_point)), tree.qtype)
  return jnp.asarray(tree, dtype)
