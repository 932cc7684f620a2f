"""A LoRA run's frozen base: loaded once per start (a meshlm checkpoint's parameters,
init_from_hf's weights, or the seed's), named in every checkpoint by its source and
checksum, and checked against the workdir's checkpoints before any restore.

Checkpoints of a LoRA run hold the adapters and their optimizer state only; their meta
carries `lora_base` = {'source', 'checksum'}. A LoRA run refuses a workdir of full-model
checkpoints, a full-model run refuses one of adapters, and adapters are refused on a
base whose checksum differs: each with one line.
"""

import dataclasses
import hashlib
import json
import os

import jax

import model
from model.config import ModelConfig
from model.lora_peft import read_peft_adapter
from training import checkpoint, pretrained, state
from training.config import Config, read_config_json

_MUST_MATCH = ('rank', 'alpha', 'rslora')
CHECKPOINT_SOURCE = 'base_checkpoint='   # the source of a lora.base_checkpoint base


# Model fields that say how the model is computed, not what its weights are: a base may be
# trained with other values of these than the LoRA run on it uses.
_HOW_COMPUTED = ('dtype', 'param_dtype', 'remat', 'attention_impl', 'pallas_backend',
                 'init_std', 'loss_chunk', 'loss', 'moe_dispatch', 'capacity_factor',
                 'moe_aux_loss_coef', 'router_z_loss_coef')


def load_base(cfg: Config, plan):
  """(the frozen base on the plan's parameter layout in the compute dtype, its identity):
  lora.base_checkpoint's parameters, init_from_hf's weights, else the seed's random ones."""
  if cfg.lora.base_checkpoint:
    base, source = _checkpoint_base(cfg, plan)
    return base, {'source': source, 'checksum': checksum(base)}
  released = pretrained.load_params(cfg) if cfg.init_from_hf else None
  base = state.frozen_base(cfg, plan, released)
  source = (f'init_from_hf={os.path.abspath(os.path.expanduser(cfg.init_from_hf))}'
            if cfg.init_from_hf else f'random weights of seed {cfg.seed}')
  return base, {'source': source, 'checksum': checksum(base)}


def resumed_base(cfg: Config, meta: dict | None) -> Config:
  """cfg with lora.base_checkpoint pinned to the step the workdir's newest checkpoint
  (`meta`) recorded, where it names no step and the same base run: that run may have
  trained on since, and the adapters resume on the base they were trained on."""
  spec = cfg.lora.base_checkpoint
  source = ((meta or {}).get('lora_base') or {}).get('source', '')
  if not spec or parse_base_checkpoint(spec)[1] is not None or not source.startswith(
      CHECKPOINT_SOURCE):
    return cfg
  recorded = source[len(CHECKPOINT_SOURCE):]
  if parse_base_checkpoint(recorded)[0] != parse_base_checkpoint(spec)[0]:
    return cfg   # another base run: check_workdir refuses it
  return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base_checkpoint=recorded))


def parse_base_checkpoint(spec: str) -> tuple[str, int | None]:
  """lora.base_checkpoint's (absolute workdir, step or None for the newest)."""
  head, colon, tail = spec.rpartition(':')
  workdir, step = (head, int(tail)) if colon and tail.isdigit() else (spec, None)
  return os.path.abspath(os.path.expanduser(workdir)), step


def base_model_config(workdir: str, field: str = 'lora.base_checkpoint') -> ModelConfig:
  """The model section of a train.py workdir's config.json (a full-model run's)."""
  raw = read_config_json(workdir, f'{field} takes the workdir of a train.py run (its '
                         '--config.workdir).')
  if (raw.get('lora') or {}).get('rank'):
    raise ValueError(f'{field}={workdir!r} is a LoRA run (its checkpoints hold adapters '
                     'only): name the workdir of a full-model run.')
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(raw.get('model', {})) - known)
  if unknown:
    raise ValueError(f'{workdir}/config.json has model fields {unknown} this version does '
                     'not know: use the meshlm version that trained it.')
  return ModelConfig(**raw.get('model', {}))


def model_differences(theirs: ModelConfig, ours: ModelConfig) -> list[str]:
  """'field=theirs (ours)' for each model field that changes the weights or what they
  compute and differs."""
  return [f'{f.name}={getattr(theirs, f.name)!r} (this run: {getattr(ours, f.name)!r})'
          for f in dataclasses.fields(ModelConfig)
          if f.name not in _HOW_COMPUTED and getattr(theirs, f.name) != getattr(ours, f.name)]


def _checkpoint_base(cfg: Config, plan):
  """lora.base_checkpoint's parameters (read in the base run's param_dtype, checked against
  their checksums) on the plan's layout, cast to the compute dtype; and their source."""
  workdir, step = parse_base_checkpoint(cfg.lora.base_checkpoint)
  theirs = base_model_config(workdir)
  differ = model_differences(theirs, cfg.model)
  if differ:
    raise ValueError(f'lora.base_checkpoint={cfg.lora.base_checkpoint!r} is a model with '
                     f'{", ".join(differ)}: set those model fields to the base run\'s.')
  shardings = plan.tree(plan.params, model.logical_axes(cfg.model))
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, theirs.param_dtype,
                                                           sharding=sh),
                        model.abstract_params(cfg.model), shardings)
  params, step = checkpoint.restore_params(os.path.join(workdir, 'checkpoints'), target, step)
  base = jax.tree.map(lambda w: w.astype(cfg.model.dtype), params)
  return base, f'{CHECKPOINT_SOURCE}{workdir}:{step}'


def checksum(tree) -> str:
  """One hex digest of every leaf's mesh-independent checksum (checkpoint.checksums)."""
  sums = json.dumps(checkpoint.checksums(tree)).encode()
  return hashlib.sha256(sums).hexdigest()[:16]


def check_workdir(meta: dict | None, base: dict | None, directory: str) -> None:
  """ValueError where a checkpoint's meta (None: none) does not fit this run:
  `base` is this LoRA run's base identity, None for a full-model run."""
  if meta is None:
    return
  saved = meta.get('lora_base')
  if base is None and saved:
    raise ValueError(f'{directory} holds LoRA adapter checkpoints (base: {saved["source"]}): '
                     'resume them with the same lora section, or give a new '
                     '--config.workdir.')
  if base is not None and not saved:
    raise ValueError(f'{directory} holds full-model checkpoints, not LoRA adapters: a LoRA '
                     'run needs a workdir of its own (--config.workdir).')
  if base is not None and saved['checksum'] != base['checksum']:
    raise ValueError(f'the LoRA adapters in {directory} were trained on another base '
                     f'({saved["source"]}, checksum {saved["checksum"]}; this run\'s is '
                     f'{base["source"]}, checksum {base["checksum"]}): start from that base '
                     '(same weights and model.dtype) or give a new --config.workdir.')


def peft_adapter(cfg: Config) -> dict:
  """lora.init_from_peft's adapters (host float32), checked against the lora section."""
  path = os.path.expanduser(cfg.lora.init_from_peft)
  adapter, found = read_peft_adapter(path, cfg.model)
  chosen = lambda c: sorted(c.layers or range(cfg.model.num_layers))
  differ = [f for f in _MUST_MATCH if getattr(found, f) != getattr(cfg.lora, f)]
  differ += ['targets'] * (sorted(found.targets) != sorted(cfg.lora.targets))
  differ += ['layers'] * (chosen(found) != chosen(cfg.lora))
  if differ:
    theirs = ', '.join(f'{f}={getattr(found, f)!r}' for f in differ)
    raise ValueError(f'lora.init_from_peft={path!r} holds adapters with {theirs}; set '
                     'those fields of the lora section to match.')
  return adapter
