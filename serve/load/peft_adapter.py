"""A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) as
the serving engine's slot weights: per target, a [layers, in, r] = lora_A.weight.T and
b [layers, r, out] = lora_B.weight.T * scale (alpha / r, or alpha / sqrt(r) with
use_rslora), layers it does not transform left zero. Everything it cannot serve exactly
is refused with one line naming the field and the fix."""

import dataclasses
import json
import math
import os
import re

import numpy as np

from model.config import ModelConfig
from model.hf import read_safetensors
from serve.worker.lora_slots import features

MODULE_TARGET = {'q_proj': 'q', 'k_proj': 'k', 'v_proj': 'v', 'o_proj': 'o',
                 'gate_proj': 'gate', 'up_proj': 'up', 'down_proj': 'down'}
_KEY = re.compile(r'(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?'
                  r'\.weight$')
# Base-model config fields that must agree with the served model's (where the adapter's
# base_model_name_or_path is a local directory we can read).
_BASE_FIELDS = (('hidden_size', 'embed_dim'), ('num_hidden_layers', 'num_layers'),
                ('num_attention_heads', 'num_heads'), ('num_key_value_heads', 'num_kv_heads'),
                ('intermediate_size', 'resolved_mlp_dim'), ('vocab_size', 'vocab_size'))


@dataclasses.dataclass
class LoraAdapter:
  name: str
  path: str
  rank: int                 # the largest of its modules' ranks
  weights: dict             # {target: (a [L, in, r], b [L, r, out])}, scale in b
  base_model: str | None    # adapter_config.json's base_model_name_or_path


def read_peft_adapter(name: str, path: str, cfg: ModelConfig,
                      max_rank: int) -> LoraAdapter:
  """The adapter in `path`, checked against the served model's config `cfg`."""
  where = f'LoRA adapter {name!r} ({path})'
  conf = _read_config(path, where)
  _check_config(conf, where)
  _check_base(conf.get('base_model_name_or_path'), cfg, where)
  tensors = _read_tensors(path, where)
  pairs = _pairs(tensors, cfg, where)
  rank = max(a.shape[0] for a, _ in pairs.values())
  if rank > max_rank:
    raise ValueError(f'{where}: rank {rank} exceeds --max-lora-rank={max_rank}; restart '
                     f'with --max-lora-rank {rank} or more.')
  weights = _stack(pairs, conf, cfg)
  return LoraAdapter(name, path, rank, weights, conf.get('base_model_name_or_path'))


def _read_config(path: str, where: str) -> dict:
  file = os.path.join(path, 'adapter_config.json')
  try:
    with open(file, encoding='utf-8') as f:
      return json.load(f)
  except OSError as e:
    raise ValueError(f'{where}: cannot read adapter_config.json ({e.strerror}); give a PEFT '
                     'adapter directory.') from None
  except json.JSONDecodeError as e:
    raise ValueError(f'{where}: adapter_config.json is not JSON ({e}).') from None


def _check_config(conf: dict, where: str) -> None:
  if conf.get('peft_type', 'LORA') != 'LORA':
    raise ValueError(f'{where}: peft_type {conf["peft_type"]!r}; only LORA adapters are served.')
  refused = [('use_dora', conf.get('use_dora')), ('modules_to_save', conf.get('modules_to_save')),
             ('alpha_pattern', conf.get('alpha_pattern')),
             ('fan_in_fan_out', conf.get('fan_in_fan_out'))]
  for field, value in refused:
    if value:
      raise ValueError(f'{where}: adapter_config.json {field}={value!r} is not served; train '
                       f'the adapter without it (or merge it: python -m serve.hf_export --merge).')
  if conf.get('bias', 'none') != 'none':
    raise ValueError(f'{where}: adapter_config.json bias={conf["bias"]!r}: adapters that '
                     'train biases are not served; use bias="none".')


def _check_base(base: str | None, cfg: ModelConfig, where: str) -> None:
  """Refuses an adapter whose base model (a local directory we can read) is another
  model than the one served. A hub name cannot be checked offline: shapes still are."""
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


def _read_tensors(path: str, where: str) -> dict:
  file = os.path.join(path, 'adapter_model.safetensors')
  if not os.path.isfile(file):
    raise ValueError(f'{where}: no adapter_model.safetensors (PEFT\'s safe_serialization '
                     'format, save_pretrained\'s default); save the adapter with it.')
  return read_safetensors(path)


def _pairs(tensors: dict, cfg: ModelConfig, where: str) -> dict:
  """{(target, layer): (A [r, in], B [out, r])}, each shape checked against the base."""
  found, shapes = {}, features(cfg)
  for key, w in tensors.items():
    m = _KEY.match(key)
    if not m or m.group(2) not in MODULE_TARGET:
      raise ValueError(f'{where}: tensor {key!r} targets no projection this server adapts '
                       f'(LoRA on {", ".join(MODULE_TARGET)} of the decoder layers only).')
    layer, target = int(m.group(1)), MODULE_TARGET[m.group(2)]
    if layer >= cfg.num_layers:
      raise ValueError(f'{where}: tensor {key!r} is for layer {layer}, but the served model '
                       f'has {cfg.num_layers} layers: a different base model.')
    found.setdefault((target, layer), {})[m.group(3)] = w
  pairs = {}
  for (target, layer), ab in found.items():
    if set(ab) != {'A', 'B'}:
      raise ValueError(f'{where}: layer {layer} {target} has lora_{"".join(ab)} without its pair.')
    a, b = ab['A'], ab['B']
    fin, fout = shapes[target]
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fin or b.shape[0] != fout or (
        a.shape[0] != b.shape[1]):
      raise ValueError(f'{where}: layer {layer} {target}: lora_A {a.shape} and lora_B {b.shape} '
                       f'do not fit the base projection ({fin} -> {fout} features): a '
                       'different base model.')
    pairs[(target, layer)] = (a, b)
  if not pairs:
    raise ValueError(f'{where}: adapter_model.safetensors holds no LoRA weights.')
  return pairs


def _stack(pairs: dict, conf: dict, cfg: ModelConfig) -> dict:
  """{target: (a [L, in, r_t], b [L, r_t, out] scaled)}, zero where a layer has none."""
  alpha = conf.get('lora_alpha', conf.get('r', 8))
  out, shapes = {}, features(cfg)
  for target in {t for t, _ in pairs}:
    rank = max(a.shape[0] for (t, _), (a, _) in pairs.items() if t == target)
    fin, fout = shapes[target]
    a_all = np.zeros((cfg.num_layers, fin, rank), np.float32)
    b_all = np.zeros((cfg.num_layers, rank, fout), np.float32)
    for (t, layer), (a, b) in pairs.items():
      if t != target:
        continue
      r = a.shape[0]
      scale = alpha / math.sqrt(r) if conf.get('use_rslora') else alpha / r
      a_all[layer, :, :r] = a.T
      b_all[layer, :r, :] = b.T.astype(np.float32) * scale
    out[target] = (a_all, b_all)
  return out
