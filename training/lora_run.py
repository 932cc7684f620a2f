"""A LoRA run's frozen base: loaded once per start, named in every checkpoint by its
source and checksum, and checked against the workdir's checkpoints before any restore.

Checkpoints of a LoRA run hold the adapters and their optimizer state only; their meta
carries `lora_base` = {'source', 'checksum'}. A LoRA run refuses a workdir of full-model
checkpoints, a full-model run refuses one of adapters, and adapters are refused on a
base whose checksum differs: each with one line.
"""

import hashlib
import json
import os

from model.lora_peft import read_peft_adapter
from training import checkpoint, pretrained, state
from training.config import Config

_MUST_MATCH = ('rank', 'alpha', 'rslora')


def load_base(cfg: Config, plan):
  """(the frozen base on the plan's parameter layout in the compute dtype, its identity):
  init_from_hf's weights, else the seed's random ones."""
  released = pretrained.load_params(cfg) if cfg.init_from_hf else None
  base = state.frozen_base(cfg, plan, released)
  source = (f'init_from_hf={os.path.abspath(os.path.expanduser(cfg.init_from_hf))}'
            if cfg.init_from_hf else f'random weights of seed {cfg.seed}')
  return base, {'source': source, 'checksum': checksum(base)}


def checksum(tree) -> str:
  """One hex digest of every leaf's mesh-independent checksum (checkpoint.checksums)."""
  sums = json.dumps(checkpoint.checksums(tree)).encode()
  return hashlib.sha256(sums).hexdigest()[:16]


def check_workdir(meta: dict | None, base: dict | None, directory: str) -> None:
  """ValueError where the newest checkpoint's meta (None: none) does not fit this run:
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
