"""A Hugging Face directory (Llama, Mistral, Mixtral, Qwen2, Qwen3) as a model we serve.

config.json -> ModelConfig and *.safetensors (read as numpy, no torch) -> our parameter
tree (model/hf.py, which refuses what its FAMILIES do not compute), tokenizer.json -> HFTokenizer,
tokenizer_config.json -> chat template and special tokens.
"""

import dataclasses
import json
import os

import jax

from model import compressed_tensors, quant
from model.config import ModelConfig
from model.hf import model_config, params_from_hf, read_safetensors
from training.tokenizer import HFTokenizer


@dataclasses.dataclass
class ServedModel:
  model_cfg: ModelConfig
  params: dict                 # our tree (model.param_specs layout)
  tokenizer: object            # training.tokenizer.ByteTokenizer | HFTokenizer
  eos_token_ids: list[int]
  chat_template: str | None    # jinja2 source; None -> a simple built-in one
  name: str                    # served model id (/v1/models)
  # Strings the chat template may use (bos_token, eos_token, ...), from tokenizer_config.
  special_tokens: dict = dataclasses.field(default_factory=dict)
  # Sampling fields a request leaves out take these (generation_config.json's, as vLLM's
  # --generation-config auto); OpenAI's defaults for the rest.
  sampling_defaults: dict = dataclasses.field(default_factory=dict)


_SPECIAL_TOKENS = ('bos_token', 'eos_token', 'unk_token', 'pad_token')
# generation_config.json fields that are sampling defaults (vLLM takes the same ones), and
# transformers' own defaults for them: a file that only restates one sets nothing (vLLM
# reads the file's differences from transformers' defaults).
SAMPLING_DEFAULT_FIELDS = ('temperature', 'top_p', 'top_k', 'min_p', 'repetition_penalty')
_HF_GENERATION_DEFAULTS = {'temperature': 1.0, 'top_p': 1.0, 'top_k': 50,
                           'repetition_penalty': 1.0}
# What the weights, the activations and the KV cache can be served in (--dtype).
SERVE_DTYPES = ('float32', 'bfloat16', 'float16')


def check_dtype(dtype: str, source: str = '--dtype') -> str:
  if dtype not in SERVE_DTYPES:
    raise ValueError(f'{source}={dtype!r} cannot be served: choose one of {SERVE_DTYPES}'
                     f"{'' if source == '--dtype' else ' with --dtype'}.")
  return dtype


def with_dtype(served: ServedModel, dtype: str) -> ServedModel:
  """`served` with its weights, activations and KV cache in `dtype` (itself if they are).

  Each weight keeps its sharding; for a moment both copies of a weight exist, so the
  peak is the old weights plus the new ones."""
  cfg = served.model_cfg
  check_dtype(dtype)
  if cfg.dtype == cfg.param_dtype == dtype:
    return served
  params = served.params
  if params is not None:
    # A quantized weight keeps its values; QArray.astype casts its scales.
    params = jax.tree.map(lambda x: x.astype(dtype), params, is_leaf=quant.is_quantized)
  return dataclasses.replace(
      served, params=params,
      model_cfg=dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype))


def with_quantization(served: ServedModel, fmt: str) -> ServedModel:
  """`served` with its layers' weights quantized to `fmt` (model/quant.py; 'none': as it
  is), scales in the weights' dtype, each weight keeping its sharding."""
  if fmt == 'none':
    return served
  if served.params is not None and quant.describe(served.params):
    raise ValueError(f'--quantization={fmt}: {served.name} is a pre-quantized checkpoint '
                     f'({quant.describe(served.params)} weights); serve it without '
                     '--quantization.')
  quant.check_format(fmt, served.model_cfg)
  params = None if served.params is None else quant.quantize_params(served.params, fmt)
  return dataclasses.replace(served, params=params)


def load_hf_model(path: str, dtype: str = 'auto',
                  generation_config: str = 'auto', check=None,
                  quantization: str = 'none') -> ServedModel:
  """The model in a local Hugging Face directory, weights cast to `dtype` ('auto':
  the dtype config.json names, float32 where it names none); its sampling defaults from
  generation_config.json unless generation_config is 'none'. `check`: called with the
  model's config before any weight is read (raises to refuse it). A compressed-tensors
  checkpoint (model/compressed_tensors.py) keeps its 8-bit weights; `quantization`, the
  --quantization the caller will apply, is refused for one."""
  path = os.path.expanduser(path)
  hf = _read_json(os.path.join(path, 'config.json'), required=True)
  prequantized = _check_quantization(path, hf, quantization)
  if dtype == 'auto':
    # transformers >= 4.56 writes `dtype`, older versions `torch_dtype`.
    stored = hf.get('dtype') or hf.get('torch_dtype') or 'float32'
    dtype = check_dtype(stored, source=f'{path}/config.json dtype')
  model_cfg = model_config(hf, check_dtype(dtype))
  if check is not None:
    check(model_cfg)
  tok_cfg = _read_json(os.path.join(path, 'tokenizer_config.json'))
  gen_cfg = _read_json(os.path.join(path, 'generation_config.json'))
  eos_ids = _as_ids(gen_cfg.get('eos_token_id', hf.get('eos_token_id')))
  tokenizer = _tokenizer(path, tok_cfg, eos_ids)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(f'{path}: tokenizer.json has {tokenizer.vocab_size} tokens but '
                     f'config.json vocab_size={model_cfg.vocab_size}: they do not belong '
                     'together.')
  if prequantized:
    _check_prequantized(hf, model_cfg)
    params = compressed_tensors.params(read_safetensors(path), model_cfg)
  else:
    params = params_from_hf(read_safetensors(path), model_cfg)
  specials = {k: _token_text(tok_cfg.get(k)) for k in _SPECIAL_TOKENS}
  return ServedModel(model_cfg=model_cfg, params=params, tokenizer=tokenizer,
                     eos_token_ids=eos_ids or [tokenizer.eos_id],
                     chat_template=_chat_template(path, tok_cfg),
                     name=os.path.basename(os.path.normpath(path)),
                     special_tokens={k: v for k, v in specials.items() if v is not None},
                     sampling_defaults=({} if generation_config == 'none' else
                                        _sampling_defaults(path, gen_cfg,
                                                           tokenizer.vocab_size)))


def _check_quantization(path: str, hf: dict, quantization: str) -> bool:
  """Whether config.json names a quantization (then checked: ValueError naming the
  field meshlm does not read, or --quantization given with it)."""
  if 'quantization_config' not in hf:
    return False
  compressed_tensors.check_config(hf)
  if quantization != 'none':
    raise ValueError(f'--quantization={quantization}: {path} is already quantized '
                     '(config.json quantization_config); serve it without --quantization.')
  return True


def _check_prequantized(hf: dict, model_cfg: ModelConfig) -> None:
  if model_cfg.num_experts:
    raise ValueError('config.json quantization_config: pre-quantized checkpoints are read '
                     f'for dense models only; this one has {model_cfg.num_experts} experts.')
  groups = hf['quantization_config']['config_groups'].values()
  if any(g['weights']['type'] == 'float' for g in groups):
    quant.check_backend('fp8', 'config.json quantization_config (float8_e4m3fn weights)')


def _sampling_defaults(path: str, gen_cfg: dict, vocab_size: int) -> dict:
  """The sampling fields generation_config.json sets, checked as a request's would be."""
  from serve.sampling_params import (  # pylint: disable=import-outside-toplevel
      SamplingParams, SamplingParamsError)
  defaults = {k: gen_cfg[k] for k in SAMPLING_DEFAULT_FIELDS
              if gen_cfg.get(k) is not None and gen_cfg[k] != _HF_GENERATION_DEFAULTS.get(k)}
  try:
    SamplingParams(**defaults).validate(vocab_size)
  except SamplingParamsError as e:
    raise ValueError(f'{path}/generation_config.json: {e}; fix the file, or serve with '
                     '--generation-config none for OpenAI\'s defaults.') from None
  return defaults


def _read_json(path: str, required: bool = False) -> dict:
  if not os.path.isfile(path):
    if required:
      raise FileNotFoundError(f'{path} not found: --hf-model takes a local Hugging Face '
                              'model directory (config.json, *.safetensors, tokenizer.json).')
    return {}
  with open(path) as f:
    return json.load(f)


def _as_ids(value) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in (value if isinstance(value, list) else [value])]


def _token_text(token) -> str | None:
  # tokenizer_config stores a special token as a string or an AddedToken dict.
  return token.get('content') if isinstance(token, dict) else token


# ------------------------------------------------------------------------------ tokenizer

def _tokenizer(path: str, tok_cfg: dict, eos_ids: list[int]) -> HFTokenizer:
  file = os.path.join(path, 'tokenizer.json')
  if not os.path.isfile(file):
    raise FileNotFoundError(f'{path} has no tokenizer.json (the fast tokenizer file); '
                            'save the tokenizer with tokenizers or transformers first.')
  eos = _token_text(tok_cfg.get('eos_token')) or (eos_ids[0] if eos_ids else None)
  return HFTokenizer(file, eos=eos)


def _chat_template(path: str, tok_cfg: dict) -> str | None:
  """chat_template.jinja (transformers 5 saves it there), else tokenizer_config's."""
  file = os.path.join(path, 'chat_template.jinja')
  if os.path.isfile(file):
    with open(file) as f:
      return f.read()
  template = tok_cfg.get('chat_template')
  if isinstance(template, list):   # named templates: serve the default one
    named = {t['name']: t['template'] for t in template}
    template = named.get('default')
  return template
