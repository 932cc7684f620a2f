"""A LoRA run's workdir (train.py with a lora section) as an adapter --lora-modules serves,
with no conversion: its newest intact adapters, put on the served base only where the
checksum the run recorded of its frozen base is that of the weights served."""

import dataclasses
import hashlib
import json
import os
import threading

import jax
import numpy as np

from model import lora as lora_lib
from model import quant
from model.config import ModelConfig
from serve.load.checkpoint import _model_config, _read_run_config
from serve.load.lora_checkpoint import _one, lora_section
from serve.load.peft_adapter import LoraAdapter, read_peft_adapter
from training import checkpoint, lora_run


@dataclasses.dataclass(frozen=True)
class BaseIdentity:
  """What a LoRA run recorded of its base, taken of the served weights before any
  quantization: their dtype and lora_run.checksum (None: weights quantized when loaded)."""
  dtype: str
  checksum: str | None

  @classmethod
  def of(cls, served) -> 'BaseIdentity':
    leaves = jax.tree.leaves(served.params, is_leaf=quant.is_quantized)
    known = not any(quant.is_quantized(x) for x in leaves)
    return cls(served.model_cfg.dtype, lora_run.checksum(served.params) if known else None)


class LazyBaseIdentity:
  """BaseIdentity of the served weights computed at the first LoRA workdir load rather
  than at every start (the checksum reads every weight; PEFT adapters never need it),
  from the runner's own arrays: the stacked ones loaded are not kept. Thread-safe."""

  def __init__(self, runner_params, dtype: str):
    self._params, self._dtype = runner_params, dtype
    self._identity, self._lock = None, threading.Lock()

  def get(self) -> BaseIdentity:
    with self._lock:
      if self._identity is None:
        self._identity = BaseIdentity(self._dtype, unstacked_checksum(self._params))
        self._params = None
      return self._identity


def unstacked_checksum(params) -> str:
  """lora_run.checksum of the stacked tree, of params['layers'] unstacked per layer
  (model.paged.unstack_layers) as the serving runner holds them."""
  layers = params['layers']
  if not isinstance(layers, (list, tuple)):
    return lora_run.checksum(params)
  stacked = jax.tree.map(lambda *ws: checkpoint.stacked_checksum(ws), *layers)
  leaves = jax.tree.leaves({**params, 'layers': stacked})
  sums = [x if isinstance(x, int) else checkpoint.checksums(x)[0] for x in leaves]
  return hashlib.sha256(json.dumps(sums).encode()).hexdigest()[:16]


def is_lora_workdir(path: str) -> bool:
  """A train.py workdir of a LoRA run (a PEFT directory has adapter_config.json instead)."""
  path = os.path.expanduser(str(path))
  return os.path.isfile(os.path.join(path, 'config.json')) and lora_section(path) is not None


def read_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int,
                 base: 'BaseIdentity | LazyBaseIdentity | None' = None) -> LoraAdapter:
  """The adapter in `path` (a PEFT directory or a meshlm LoRA workdir) as the slots hold
  it; ValueError with one line naming what does not fit the served model."""
  if is_lora_workdir(path):
    return read_lora_workdir(name, path, cfg, max_rank, base)
  return read_peft_adapter(name, path, cfg, max_rank)


def read_lora_workdir(name: str, path: str, cfg: ModelConfig, max_rank: int,
                      base: 'BaseIdentity | LazyBaseIdentity | None') -> LoraAdapter:
  """The newest intact adapters of the LoRA run in `path`, checked against the served
  model's config `cfg` and its base identity."""
  path = os.path.abspath(os.path.expanduser(str(path)))
  where = f'LoRA adapter {name!r} ({path})'
  run_cfg, lcfg = _model_config(_read_run_config(path), path), lora_section(path)
  differ = lora_run.model_differences(run_cfg, cfg)
  if differ:
    shown = ', '.join(d.replace('this run', 'served') for d in differ)
    raise ValueError(f'{where}: trained on a model with {shown}; serve it on its own base.')
  if run_cfg.num_experts:
    raise ValueError(f'{where}: adapters on a mixture-of-experts model are not served.')
  if lcfg.rank > max_rank:
    raise ValueError(f'{where}: rank {lcfg.rank} exceeds --max-lora-rank={max_rank}; restart '
                     f'with --max-lora-rank {lcfg.rank} or more.')
  directory = os.path.join(path, 'checkpoints')
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=_one(None)),
                        lora_lib.abstract_adapter(run_cfg, lcfg, run_cfg.param_dtype))
  try:
    adapter, step, meta = checkpoint.restore_params_and_meta(directory, target)
  except (FileNotFoundError, checkpoint.CheckpointError) as e:   # a 400, not a 500
    raise ValueError(f'{where}: no intact adapters to serve ({e})') from e
  if isinstance(base, LazyBaseIdentity):
    base = base.get()
  _check_base(meta.get('lora_base'), run_cfg.dtype, base, f'{where}, step {step}')
  scale = lora_lib.layer_scales(cfg, lcfg)['layers'][:, None, None]
  weights = {t: (np.asarray(ab['a'], np.float32), np.asarray(ab['b'], np.float32) * scale)
             for t, ab in adapter['layers'].items()}
  return LoraAdapter(name, path, lcfg.rank, weights, None)


def _check_base(saved: dict | None, dtype: str, base: BaseIdentity | None, where: str) -> None:
  """Refuses adapters whose recorded base (that of the step restored) is not the served
  weights."""
  if base is None:
    return   # no identity: an engine built bare
  if saved is None:
    raise ValueError(f'{where}: its checkpoint records no base (meta lora_base), so the '
                     'adapters cannot be checked against the served weights: serve a LoRA '
                     'workdir saved by train.py with a lora section.')
  if base.checksum is None:
    raise ValueError(f'{where}: the served weights were quantized when loaded, so they '
                     'cannot be checked against the base the adapters were trained on; '
                     'serve the unquantized base (--quantization applies after the check).')
  if base.dtype != dtype:
    raise ValueError(f'{where}: its base was frozen in model.dtype={dtype}, the served '
                     f'weights are {base.dtype}: serve the base with --dtype {dtype}.')
  if base.checksum != saved['checksum']:
    raise ValueError(f'{where}: trained on another base ({saved["source"]}, checksum '
                     f'{saved["checksum"]}; the served weights\' is {base.checksum}): serve '
                     'it on its own base.')
