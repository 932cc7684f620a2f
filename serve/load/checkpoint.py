"""A train.py workdir as a model we serve: its config, its tokenizer, its parameters.

Only the parameters of the newest intact checkpoint are read (no optimizer state), onto
the serving mesh, and the training run's directory is never written to.
"""

import dataclasses
import os

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import model
from model.config import ModelConfig
from serve.load.hf_model import ServedModel, with_dtype
from sharding.rules import REPLICATED
from training import checkpoint, lora_run
from training.config import read_config_json
from training.tokenizer import load_tokenizer


def default_mesh() -> Mesh:
  """One device, with the `tensor` axis the serving code names."""
  return jax.make_mesh((1,), ('tensor',), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:1])


def param_shardings(model_cfg: ModelConfig, mesh: Mesh | None = None) -> dict:
  """Where each parameter lives when serving: heads, kv heads, mlp and vocab split over
  `tensor` (training's tensor-parallel rules), everything else replicated. Mesh axes the
  rules name but `mesh` lacks are treated as size 1."""
  mesh = mesh or default_mesh()

  def sharding(axes):
    spec = REPLICATED.spec(axes)
    keep = [a if a in mesh.axis_names else None for a in spec]
    return NamedSharding(mesh, PartitionSpec(*keep))

  return jax.tree.map(sharding, model.logical_axes(model_cfg),
                      is_leaf=lambda x: isinstance(x, tuple))


def shard_params(params: dict, model_cfg: ModelConfig, mesh: Mesh | None = None) -> dict:
  """Places a loaded tree (e.g. load_hf_model's) on the serving mesh."""
  return jax.device_put(params, param_shardings(model_cfg, mesh))


def load_checkpoint(workdir: str, mesh: Mesh | None = None,
                    dtype: str = 'auto', check=None) -> ServedModel:
  """The newest intact checkpoint of a train.py workdir, parameters only, on `mesh`, in
  `dtype` ('auto': the run's compute dtype, model.dtype; the master weights a run keeps
  in model.param_dtype are read, checked against their checksums, then cast). `check`:
  called with the model's config before any weight is read (raises to refuse it)."""
  workdir = os.path.expanduser(workdir)
  raw = _read_run_config(workdir)
  if (raw.get('lora') or {}).get('rank'):
    raise ValueError(f'{workdir} is a LoRA run: its checkpoints hold the adapters only. '
                     f'Serve it merged (python -m serve.hf_export --checkpoint {workdir} '
                     '--merge --output DIR, then --hf-model DIR), or serve its base '
                     f'({_base_flag(raw)}) with --enable-lora --lora-modules NAME={workdir}.')
  model_cfg = _model_config(raw, workdir)
  if check is not None:
    check(model_cfg)
  tokenizer = load_tokenizer(raw.get('data', {}).get('tokenizer', 'byte'))
  shardings = param_shardings(model_cfg, mesh)
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        model.abstract_params(model_cfg), shardings)
  params, _ = checkpoint.restore_params(os.path.join(workdir, 'checkpoints'), target)
  served = ServedModel(model_cfg=model_cfg, params=params, tokenizer=tokenizer,
                       eos_token_ids=[tokenizer.eos_id], chat_template=None,
                       name=os.path.basename(os.path.normpath(os.path.abspath(workdir))))
  return with_dtype(served, model_cfg.dtype if dtype == 'auto' else dtype)


def _base_flag(raw: dict) -> str:
  """How to serve a LoRA run's base, from its config.json."""
  if raw['lora'].get('base_checkpoint'):
    return f'--checkpoint {lora_run.parse_base_checkpoint(raw["lora"]["base_checkpoint"])[0]}'
  return f'--hf-model {raw["init_from_hf"]}' if raw.get('init_from_hf') else 'its seed\'s weights'


def _read_run_config(workdir: str) -> dict:
  return read_config_json(workdir, '--checkpoint takes the workdir of a train.py run (its '
                          '--config.workdir).')


def _model_config(raw: dict, workdir: str) -> ModelConfig:
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  given = raw.get('model', {})
  unknown = sorted(set(given) - fields)
  if unknown:
    raise ValueError(f'{workdir}/config.json has model fields {unknown} this version does '
                     'not know: serve it with the meshlm version that trained it.')
  cfg = ModelConfig(**given)
  cfg.validate()
  return cfg
