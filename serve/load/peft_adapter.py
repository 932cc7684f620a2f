"""A PEFT LoRA adapter directory as the serving engine's slot weights: model.lora_peft
reads it (and refuses what it cannot compute); here the serving checks (the rank against
--max-lora-rank, the base model against the served one) and each layer's scale folded
into b, as the slots hold it."""

import dataclasses
import json
import os


from model import lora as lora_lib
from model.config import ModelConfig
from model.lora_peft import CONFIG_FILE, read_peft_adapter as read_peft_tree

# Base-model config fields that must agree with the served model's (where the adapter's
# base_model_name_or_path is a local directory we can read).
_BASE_FIELDS = (('hidden_size', 'embed_dim'), ('num_hidden_layers', 'num_layers'),
                ('num_attention_heads', 'num_heads'), ('num_key_value_heads', 'num_kv_heads'),
                ('intermediate_size', 'resolved_mlp_dim'), ('vocab_size', 'vocab_size'))


@dataclasses.dataclass
class LoraAdapter:
  name: str
  path: str
  rank: int
  weights: dict             # {target: (a [L, in, r], b [L, r, out])}, each layer's scale in b
  base_model: str | None    # adapter_config.json's base_model_name_or_path


def read_peft_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
  """The adapter in `path`, checked against the served model's config `cfg`; ValueError
  with one line naming what does not fit."""
  path = os.path.expanduser(str(path))
  where = f'LoRA adapter {name!r} ({path})'
  base = _base_model(path)
  _check_base(base, cfg, where)
  try:
    tree, lcfg = read_peft_tree(path, cfg)
  except ValueError as e:   # its message starts with the directory
    raise ValueError(f'LoRA adapter {name!r}: {e}') from None
  if 'moe_layers' in tree:
    raise ValueError(f'{where}: adapters on a mixture-of-experts model are not served.')
  if lcfg.rank > max_rank:
    raise ValueError(f'{where}: rank {lcfg.rank} exceeds --max-lora-rank={max_rank}; restart '
                     f'with --max-lora-rank {lcfg.rank} or more.')
  scale = lora_lib.layer_scales(cfg, lcfg)['layers'][:, None, None]
  weights = {t: (ab['a'], ab['b'] * scale) for t, ab in tree['layers'].items()}
  return LoraAdapter(name, path, lcfg.rank, weights, base)


def _base_model(path: str) -> str | None:
  try:
    with open(os.path.join(path, CONFIG_FILE), encoding='utf-8') as f:
      return json.load(f).get('base_model_name_or_path')
  except (OSError, ValueError):
    return None   # read_peft_tree says what is wrong with the file


def _check_base(base: str | None, cfg: ModelConfig, where: str) -> None:
  """Refuses an adapter whose base model (a local directory we can read) is another
  model than the one served. A hub name cannot be checked offline; shapes always are."""
  file = os.path.join(os.path.expanduser(base), 'config.json') if base else None
  if not file or not os.path.isfile(file):
    return
  with open(file, encoding='utf-8') as f:
    hf = json.load(f)
  for hf_field, ours in _BASE_FIELDS:
    theirs, served = hf.get(hf_field), getattr(cfg, ours)
    if hf_field == 'num_key_value_heads' and theirs is None:
      theirs = hf.get('num_attention_heads')
    if theirs is not None and theirs != served:
      raise ValueError(f'{where}: trained on base model {base!r}, whose {hf_field}={theirs} '
                       f'differs from the served model\'s {served}; serve it on its own base.')


