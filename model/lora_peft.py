"""PEFT LoRA adapter directories, both ways: adapter_config.json +
adapter_model.safetensors <-> model/lora.py's adapter tree and LoraConfig.

PEFT stores, per adapted module and layer, lora_A.weight [r, in] and lora_B.weight
[out, r] under `base_model.model.model.layers.{i}.{module}`; ours are their transposes
stacked over each layer group (model/lora.py's contract). What our adapters cannot
express (DoRA, per-module ranks or alphas, biases, modules saved whole, Conv1D layouts,
different layers per module) is refused with one line, before any weight is used.
Adapters on a mixture of experts' experts are written (PEFT's target_parameters on
transformers' fused expert tensors, below), not read.
"""

import json
import os
import re

import numpy as np
from safetensors.numpy import save_file

from model import lora
from model.config import ModelConfig
from model.hf import read_safetensors
from model.lora import TARGETS, LoraConfig

CONFIG_FILE, WEIGHTS_FILE = 'adapter_config.json', 'adapter_model.safetensors'
_PREFIX = 'base_model.model.model.layers.'
_KEY = re.compile(r'^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$')
_MODULE_TO_TARGET = {module: t for t, (_, _, module) in TARGETS.items()}
# adapter_config.json fields whose non-default values we cannot compute.
_UNSUPPORTED = {'use_dora': False, 'bias': 'none', 'fan_in_fan_out': False,
                'modules_to_save': None, 'rank_pattern': {}, 'alpha_pattern': {},
                'lora_bias': False, 'target_parameters': None}


# --------------------------------------------------------------------------------- write

def peft_config(lcfg: LoraConfig, cfg: ModelConfig, base_model: str = '') -> dict:
  """adapter_config.json for lcfg's adapters on a base of cfg's architecture."""
  layers = sorted(lcfg.layers) if lcfg.layers else None
  out = {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'base_model_name_or_path':
         base_model or None, 'r': lcfg.rank, 'lora_alpha': lcfg.alpha,
         'lora_dropout': lcfg.dropout, 'use_rslora': lcfg.rslora,
         'target_modules': sorted(TARGETS[t][2].split('.')[-1] for t in lcfg.targets
                                  if t in TARGETS),
         'layers_to_transform': layers, 'bias': 'none', 'fan_in_fan_out': False,
         'init_lora_weights': True, 'use_dora': False, 'modules_to_save': None,
         'rank_pattern': {}, 'alpha_pattern': {}, 'inference_mode': True}
  return {**out, **_expert_config(lcfg)}


def peft_tensors(adapter: dict, lcfg: LoraConfig, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """The adapted layers' lora_A [r, in] and lora_B [out, r], float32."""
  chosen = set(lcfg.layers) if lcfg.layers else set(range(cfg.num_layers))
  out = {}
  for stack, indices in lora.stack_layer_indices(cfg).items():
    targets = adapter.get(stack, {})
    for t, ab in targets.items():
      if t in TARGETS:
        a, b = np.asarray(ab['a'], np.float32), np.asarray(ab['b'], np.float32)
        for n, i in enumerate(indices):
          if i in chosen:
            name = f'{_PREFIX}{i}.{TARGETS[t][2]}'
            out[f'{name}.lora_A.weight'] = np.ascontiguousarray(a[n].T)
            out[f'{name}.lora_B.weight'] = np.ascontiguousarray(b[n].T)
    for n, i in enumerate(indices):
      if i in chosen:
        out.update(_expert_tensors(f'{_PREFIX}{i}.mlp.experts', targets, n))
  return out


# ---------------------------------------------------------------- experts (write only)
#
# transformers holds a layer's experts as two parameters, gate_up_proj [E, 2F, D] (gate
# then up along 2F) and down_proj [E, D, F], which PEFT adapts through target_parameters:
# per parameter lora_A [r * E, in] (expert-major rows) and lora_B [out, r * E]
# (rank-major columns). Our gate and up adapters become one gate_up_proj adapter of rank
# 2r: a = [a_gate | a_up], b = [[b_gate, 0], [0, b_up]], alpha scaled so alpha / rank is
# unchanged. With both parameters adapted, PEFT nests the down_proj wrapper around the
# gate_up_proj one, whose keys then go under base_layer.

def _gate_up(lcfg: LoraConfig) -> list[str]:
  return [t for t in ('experts_gate', 'experts_up') if t in lcfg.targets]


def _expert_config(lcfg: LoraConfig) -> dict:
  fused = _gate_up(lcfg)
  params = (['mlp.experts.down_proj'] if 'experts_down' in lcfg.targets else []) + (
      ['mlp.experts.gate_up_proj'] if fused else [])
  if not params:
    return {}
  out = {'target_parameters': params}
  if len(fused) == 2:
    # alpha / r (or alpha / sqrt(r)) at rank 2r equals ours at rank r.
    alpha = lcfg.alpha * (np.sqrt(2.0) if lcfg.rslora else 2.0)
    out.update(rank_pattern={'gate_up_proj': 2 * lcfg.rank},
               alpha_pattern={'gate_up_proj': float(alpha)})
  return out


def _expert_tensors(module: str, targets: dict, n: int) -> dict[str, np.ndarray]:
  """Layer position n's expert adapters as PEFT's gate_up_proj / down_proj tensors."""
  halves = [t for t in ('experts_gate', 'experts_up') if t in targets]
  out = {}
  inner = '.base_layer' if halves and 'experts_down' in targets else ''
  if halves:
    a = np.concatenate([np.asarray(targets[t]['a'][n], np.float32) for t in halves], -1)
    bs = [np.asarray(targets[t]['b'][n], np.float32) for t in halves]   # [E, r, F]
    e, r, f = bs[0].shape
    b = np.zeros((e, r * len(halves), 2 * f), np.float32)
    for k, t in enumerate(halves):
      col = 0 if t == 'experts_gate' else f
      b[:, k * r:(k + 1) * r, col:col + f] = bs[k]
    out.update(_peft_pair(f'{module}{inner}', a, b))
  if 'experts_down' in targets:
    ab = targets['experts_down']
    out.update(_peft_pair(module, np.asarray(ab['a'][n], np.float32),
                          np.asarray(ab['b'][n], np.float32)))
  return out


def _peft_pair(name: str, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
  """a [E, in, r], b [E, r, out] -> lora_A [E * r, in], lora_B [out, r * E]."""
  e, fan_in, r = a.shape
  return {f'{name}.lora_A.weight': np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * r,
                                                                                    fan_in)),
          f'{name}.lora_B.weight': np.ascontiguousarray(b.transpose(2, 1, 0).reshape(-1, r * e))}


def write_peft_adapter(directory: str, adapter: dict, lcfg: LoraConfig, cfg: ModelConfig,
                       base_model: str = '') -> None:
  """adapter_config.json and adapter_model.safetensors into `directory` (created)."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, CONFIG_FILE), 'w', encoding='utf-8') as f:
    json.dump(peft_config(lcfg, cfg, base_model), f, indent=2)
  save_file(peft_tensors(adapter, lcfg, cfg), os.path.join(directory, WEIGHTS_FILE),
            metadata={'format': 'pt'})


# ---------------------------------------------------------------------------------- read

def read_peft_adapter(directory: str, cfg: ModelConfig) -> tuple[dict, LoraConfig]:
  """(adapter tree in float32 numpy, its LoraConfig) of a PEFT LoRA directory, for a base
  of cfg's shape; ValueError with one line where it does not fit."""
  hf = _read_config(directory)
  tensors = {k: np.asarray(v, np.float32) for k, v in read_safetensors(directory).items()}
  bad = sorted(k for k, v in tensors.items() if not np.isfinite(v).all())
  if bad:
    raise ValueError(f'{directory}: {bad[0]} has non-finite values (NaN or inf)'
                     + (f', and {len(bad) - 1} more tensors' if len(bad) > 1 else '')
                     + '; an adapter must be finite to be served or trained.')
  found = _parse_keys(tensors, directory)
  targets = tuple(t for t in TARGETS if any(t == k[1] for k in found))
  layer_sets = {t: sorted({i for i, tt in found if tt == t}) for t in targets}
  if len({tuple(v) for v in layer_sets.values()}) > 1:
    raise ValueError(f'{directory}: the adapter adapts different layers per module '
                     f'({layer_sets}), which one LoraConfig cannot express.')
  used = layer_sets[targets[0]]
  lcfg = LoraConfig(rank=int(hf['r']), alpha=float(hf['lora_alpha']),
                    dropout=float(hf.get('lora_dropout') or 0.0), targets=targets,
                    layers=() if len(used) == cfg.num_layers else tuple(used),
                    rslora=bool(hf.get('use_rslora', False)))
  try:
    lcfg.validate(cfg)
  except ValueError as e:
    raise ValueError(f'{directory} does not fit this base model: {e}') from None
  return _stack(found, lcfg, cfg, directory), lcfg


def _read_config(directory: str) -> dict:
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
    raise ValueError(f'{directory}: not a PEFT adapter directory (needs {CONFIG_FILE} and '
                     f'{WEIGHTS_FILE}).')
  with open(path, encoding='utf-8') as f:
    hf = json.load(f)
  if hf.get('peft_type', 'LORA') != 'LORA':
    raise ValueError(f'{directory}: peft_type {hf["peft_type"]!r}; only LORA adapters load.')
  if hf.get('target_parameters'):
    raise ValueError(f'{directory}: {CONFIG_FILE} sets target_parameters='
                     f'{hf["target_parameters"]!r} (adapters on expert parameters), which '
                     'meshlm does not read or serve per request: merge them into the base '
                     '(peft merge_and_unload, or `python -m serve.hf_export --merge` of a '
                     'meshlm run) and serve that.')
  for key, default in _UNSUPPORTED.items():
    if hf.get(key, default) not in (default, None, {}, []):
      raise ValueError(f'{directory}: {CONFIG_FILE} sets {key}={hf[key]!r}, which meshlm '
                       'adapters cannot compute; retrain or merge it with peft.')
  return hf


def _parse_keys(tensors: dict, directory: str) -> dict:
  """{(layer, target): {'A': array, 'B': array}}."""
  found = {}
  for key, value in tensors.items():
    m = _KEY.match(key)
    if not m or m.group(2) not in _MODULE_TO_TARGET:
      raise ValueError(f'{directory}: tensor {key!r} is not a LoRA weight of a Llama-family '
                       f'projection ({", ".join(_MODULE_TO_TARGET)}).')
    found.setdefault((int(m.group(1)), _MODULE_TO_TARGET[m.group(2)]), {})[m.group(3)] = value
  if not found:
    raise ValueError(f'{directory}: {WEIGHTS_FILE} holds no LoRA weights.')
  return found


def _stack(found: dict, lcfg: LoraConfig, cfg: ModelConfig, directory: str) -> dict:
  specs = lora.adapter_specs(cfg, lcfg)
  out = {}
  for stack, indices in lora.stack_layer_indices(cfg).items():
    for t, spec in specs.get(stack, {}).items():
      a, b = np.zeros(spec['a'][0], np.float32), np.zeros(spec['b'][0], np.float32)
      for n, i in enumerate(indices):
        if (i, t) not in found:
          continue
        pair = found[(i, t)]
        want = {'A': (a.shape[2], a.shape[1]), 'B': (b.shape[2], b.shape[1])}
        for half, shape in want.items():
          got = pair.get(half)
          if got is None or got.shape != shape:
            raise ValueError(
                f'{directory}: layer {i} {TARGETS[t][2]}.lora_{half} has shape '
                f'{None if got is None else got.shape}, this base needs {shape} (rank '
                f'{lcfg.rank}): the adapter was trained on another model.')
        a[n], b[n] = pair['A'].T, pair['B'].T
      out.setdefault(stack, {})[t] = {'a': a, 'b': b}
  missing = {k for k in found if k[0] >= cfg.num_layers}
  if missing:
    raise ValueError(f'{directory}: adapts layer {max(missing)[0]}, this base has '
                     f'{cfg.num_layers} layers: the adapter was trained on another model.')
  return out
