"""A LoRA run's workdir (train.py with a lora section): its base and its adapters.

The checkpoints hold the adapters only; the base is read again from where the run took
it (lora.base_checkpoint's run at the step it read, init_from_hf's directory, or the
seed's random weights) and checked against the checksum the checkpoint recorded, so
adapters are never put on another base.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp

import model
from model import hf as model_hf
from model import lora
from model.lora import LoraConfig
from serve.load.checkpoint import (_model_config, _read_run_config, default_mesh,
                                   param_shardings)
from serve.load.hf_model import ServedModel
from training import checkpoint, lora_run
from training.tokenizer import load_tokenizer


@dataclasses.dataclass
class LoraRun:
  served: ServedModel   # the base, in the run's model.param_dtype
  adapter: dict         # model/lora.py's tree, float32
  lcfg: LoraConfig
  base_source: str      # where the base came from (init_from_hf's directory, or '')


def lora_section(workdir: str) -> LoraConfig | None:
  """The run's lora section, or None for a full-model run."""
  raw = _read_run_config(os.path.expanduser(workdir)).get('lora') or {}
  if not raw.get('rank'):
    return None
  return LoraConfig(**{**raw, 'targets': tuple(raw['targets']),
                       'layers': tuple(raw.get('layers') or ())})


def load_lora_checkpoint(workdir: str, mesh=None) -> LoraRun:
  """The base and the newest intact adapters of a LoRA workdir, on `mesh` (one device by
  default); ValueError where the base is not the one the adapters were trained on."""
  workdir = os.path.expanduser(workdir)
  raw = _read_run_config(workdir)
  model_cfg, lcfg = _model_config(raw, workdir), lora_section(workdir)
  lcfg.validate(model_cfg)
  source = os.path.expanduser(raw.get('init_from_hf') or '')
  directory = os.path.join(workdir, 'checkpoints')
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=_one(mesh)),
                        lora.abstract_adapter(model_cfg, lcfg, model_cfg.param_dtype))
  adapter, step, meta = checkpoint.restore_params_and_meta(directory, target)
  saved = meta.get('lora_base')
  if saved is None:
    raise ValueError(f'step {step} in {directory} records no base (meta lora_base), so the '
                     'adapters cannot be put on the base they were trained on: give a LoRA '
                     'workdir saved by train.py with a lora section.')
  base_run = _base_run(saved)
  base = (_checkpoint_base(model_cfg, *base_run, mesh) if base_run else
          _base(model_cfg, source, raw.get('seed', 0), mesh))
  _check_base(base, model_cfg, directory, saved)
  tokenizer = load_tokenizer(raw.get('data', {}).get('tokenizer', 'byte'))
  served = ServedModel(model_cfg=model_cfg, params=base, tokenizer=tokenizer,
                       eos_token_ids=[tokenizer.eos_id], chat_template=None,
                       name=os.path.basename(os.path.normpath(os.path.abspath(workdir))))
  return LoraRun(served, jax.tree.map(lambda w: w.astype(jnp.float32), adapter), lcfg, source)


def _one(mesh):
  mesh = mesh or default_mesh()
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _base(model_cfg, source: str, seed: int, mesh) -> dict:
  """The base in model.param_dtype: as training read it (pretrained.load_params, or
  state.frozen_base's random init)."""
  shardings = param_shardings(model_cfg, mesh)
  if source:
    host = model_hf.params_from_hf(model_hf.read_safetensors(source), model_cfg, on_host=True)
  else:
    host = jax.jit(lambda key: model.init_params(model_cfg, key))(jax.random.key(seed))
  return jax.tree.map(jax.device_put, host, shardings)


def _base_run(saved: dict) -> tuple[str, int | None] | None:
  """(workdir, step) of a run whose checkpoint is the base (lora.base_checkpoint), else
  None. The step the adapters recorded (`saved`: the restored step's lora_base), not the
  newest: that run may have trained on."""
  source = saved.get('source', '')
  if source.startswith(lora_run.CHECKPOINT_SOURCE):
    return lora_run.parse_base_checkpoint(source[len(lora_run.CHECKPOINT_SOURCE):])
  return None


def _checkpoint_base(model_cfg, workdir: str, step: int | None, mesh) -> dict:
  """The base run's parameters at `step`, in its param_dtype."""
  dtype = lora_run.base_model_config(workdir).param_dtype
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh),
                        model.abstract_params(model_cfg), param_shardings(model_cfg, mesh))
  params, _ = checkpoint.restore_params(os.path.join(workdir, 'checkpoints'), target, step)
  return params


def _check_base(base: dict, model_cfg, directory: str, saved: dict) -> None:
  frozen = jax.tree.map(lambda w: w.astype(model_cfg.dtype), base)
  found = lora_run.checksum(frozen)
  if found != saved['checksum']:
    raise ValueError(f'the adapters in {directory} were trained on a base of checksum '
                     f'{saved["checksum"]} ({saved["source"]}); that base now reads as '
                     f'{found}: its weights changed since training.')
