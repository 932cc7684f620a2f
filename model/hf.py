"""Hugging Face checkpoints, both ways: config.json <-> ModelConfig, safetensors tensors
<-> our parameter tree. Read by serving (`serve/load/hf_model.py`: --hf-model), by training
(init_from_hf: fine-tuning a released model) and written by `serve/hf_export.py`.

FAMILIES is the one table of what is read and written: Llama-style decoders whose
differences are ModelConfig fields (Qwen2's q/k/v biases: qkv_bias; Qwen3's per-head q/k
norms: qk_norm), Mixtral, Llama with every MLP a mixture of experts (a softmax router
over E experts whose top k (k >= 2) weights are renormalized, each expert a SwiGLU, as
model/moe.py computes with router='softmax' and moe_every=1), and Qwen3-MoE, Qwen3 with
every decoder_sparse_step-th MLP routed (moe_every; the top k renormalized or not:
router_norm_topk). Anything else (other
biases, activations, RoPE scalings, a sliding window in some layers only,
architectures, expert layouts) is refused with a ValueError naming it, before any weight
is read, rather than computed wrong.
"""

import dataclasses
import glob
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from model import hf_gemma
from model.config import ModelConfig
from model.transformer import abstract_params

# What transformers' config classes assume for a field config.json leaves out, where every
# family below assumes the same (None: derived, as transformers derives it).
_COMMON_DEFAULTS = {'rope_theta': 10000.0, 'rms_norm_eps': 1e-6, 'num_key_value_heads': None,
                    'head_dim': None, 'tie_word_embeddings': False}
# Qwen2/Qwen3: a sliding window only with use_sliding_window, and then only in the layers
# from max_window_layers on (unless config.json lists layer_types).
_QWEN_WINDOW = {'use_sliding_window': False, 'sliding_window': 4096, 'max_window_layers': 28}


@dataclasses.dataclass(frozen=True)
class Family:
  """One Hugging Face architecture: how its config.json maps onto ModelConfig."""
  model_type: str
  defaults: dict        # its config class's defaults, beyond _COMMON_DEFAULTS
  fields: dict = dataclasses.field(default_factory=dict)   # ModelConfig fields it fixes
  experts: str = ''     # its experts' tensor layout (_EXPERT_LAYOUTS); '': dense
  required: dict = dataclasses.field(default_factory=dict)   # config.json field -> the
  # only value read (its config class has the field; other classes ignore it)
  refused: str = ''     # what else of the family is refused (the docs' table)
  activation: tuple = ('hidden_act', 'silu')   # its config's activation field, the value read

  @property
  def gemma(self) -> bool:
    return self.model_type in ('gemma2', 'gemma3_text')


FAMILIES = {
    'LlamaForCausalLM': Family('llama', {'max_position_embeddings': 2048},
                               required={'attention_bias': False, 'mlp_bias': False}),
    'MistralForCausalLM': Family('mistral', {'max_position_embeddings': 4096 * 32,
                                             'num_key_value_heads': 8, 'sliding_window': 4096}),
    'MixtralForCausalLM': Family(
        'mixtral', {'rope_theta': 1e6, 'rms_norm_eps': 1e-5,
                    'max_position_embeddings': 4096 * 32, 'num_key_value_heads': 8,
                    'sliding_window': None, 'num_local_experts': 8, 'num_experts_per_tok': 2},
        experts='mixtral', refused='num_experts_per_tok=1; experts fused in one tensor '
                                   '(mlp.experts.gate_up_proj)'),
    'Qwen2ForCausalLM': Family('qwen2', {'max_position_embeddings': 32768,
                                         'num_key_value_heads': 32, **_QWEN_WINDOW},
                               fields={'qkv_bias': True}),
    'Qwen3ForCausalLM': Family('qwen3', {'max_position_embeddings': 32768,
                                         'num_key_value_heads': 32, 'head_dim': 128,
                                         **_QWEN_WINDOW},
                               fields={'qk_norm': True}, required={'attention_bias': False}),
    # Qwen3's attention, every decoder_sparse_step-th layer's MLP routed.
    'Qwen3MoeForCausalLM': Family(
        'qwen3_moe', {'max_position_embeddings': 32768, 'num_key_value_heads': 4,
                      'use_sliding_window': False, 'sliding_window': 4096,
                      'num_experts': 128, 'num_experts_per_tok': 8, 'norm_topk_prob': False,
                      'decoder_sparse_step': 1, 'moe_intermediate_size': 768,
                      'mlp_only_layers': []},
        fields={'qk_norm': True}, experts='qwen3_moe', required={'attention_bias': False},
        refused='mlp_only_layers; a decoder_sparse_step not dividing num_hidden_layers; '
                'num_experts_per_tok=1 with norm_topk_prob; experts fused in one tensor'),
    'Gemma2ForCausalLM': Family('gemma2', hf_gemma.GEMMA2_DEFAULTS, fields=hf_gemma.FIELDS,
                                required=hf_gemma.REQUIRED, refused=hf_gemma.REFUSED,
                                activation=('hidden_activation', 'gelu_pytorch_tanh')),
    'Gemma3ForCausalLM': Family('gemma3_text', hf_gemma.GEMMA3_DEFAULTS,
                                fields={**hf_gemma.FIELDS, 'qk_norm': True},
                                required=hf_gemma.REQUIRED, refused=hf_gemma.REFUSED_GEMMA3,
                                activation=('hidden_activation', 'gelu_pytorch_tanh')),
}
# Refused in every family (the docs' table): other activations, RoPE scalings and windows.
REFUSED_EVERYWHERE = ('an activation other than the family\'s (silu; Gemma: gelu_pytorch_tanh)',
                      "rope scaling other than 'llama3' or 'linear'",
                      'a sliding window in some layers only (max_window_layers, layer_types), '
                      'but Gemma\'s every N-th layer global')
# ModelConfig fields a family may fix (Family.fields); the others' are at their defaults.
_FAMILY_FIELDS = ('qkv_bias', 'qk_norm', 'mlp_activation', 'norm_plus_one', 'embed_scale',
                  'sandwich_norms')


def _architecture(hf: dict) -> str:
  return (hf.get('architectures') or ['LlamaForCausalLM'])[0]


def _get(hf: dict, key: str):
  """config.json's `key`, or what transformers' config class assumes when it is absent."""
  if key in hf:
    return hf[key]
  return {**_COMMON_DEFAULTS, **FAMILIES[_architecture(hf)].defaults}[key]


def check_supported(hf: dict) -> None:
  """Raises ValueError naming the first thing our model would compute differently."""
  archs = hf.get('architectures') or ['LlamaForCausalLM']
  if len(archs) != 1 or archs[0] not in FAMILIES:
    raise ValueError(f'config.json architectures={archs} is not supported: only '
                     f'{", ".join(FAMILIES)} can be read.')
  family = FAMILIES[archs[0]]
  if family.gemma:
    hf_gemma.check(hf, lambda key: _get(hf, key))
  activation = dict([family.activation])
  for key, want in {'model_type': family.model_type, **activation, **family.required}.items():
    got = hf.get(key, want)
    if got is None and family.gemma:   # transformers' Gemma configs save None for False
      continue
    if got != want:
      raise ValueError(f'config.json {key}={got!r} is not supported: only {archs[0]} '
                       f'models with {key}={want!r} can be read.')
  window, every_layer = _sliding_window(hf)
  if window and not every_layer:
    raise ValueError(f'config.json sliding_window={window} is not supported in some layers '
                     f'only (max_window_layers={_get(hf, "max_window_layers")}, layer_types): '
                     'a window in every layer (max_window_layers=0), or none, can be read.')
  if family.experts == 'mixtral' and _get(hf, 'num_experts_per_tok') < 2:
    raise ValueError(f'config.json num_experts_per_tok={hf["num_experts_per_tok"]} is '
                     'not supported: with one expert a token, Mixtral weighs it 1 and '
                     'model/moe.py by its router probability; 2 or more can be read.')
  if family.experts == 'qwen3_moe':
    _check_qwen3_moe(hf)


def _check_qwen3_moe(hf: dict) -> None:
  """ValueError naming the first Qwen3-MoE field our layer pattern and router cannot
  follow: MoE layers are every moe_every-th (decoder_sparse_step), none skipped."""
  layers, step = hf['num_hidden_layers'], _get(hf, 'decoder_sparse_step')
  for ok, field, supported in (
      (not _get(hf, 'mlp_only_layers'), 'mlp_only_layers', '[] (every '
       'decoder_sparse_step-th layer routed)'),
      (step >= 1 and layers % step == 0, 'decoder_sparse_step',
       f'a divisor of num_hidden_layers={layers}'),
      (_num_experts(hf) > 0, 'num_experts', 'at least 1 (without experts: '
       'Qwen3ForCausalLM)'),
      (_get(hf, 'num_experts_per_tok') > 1 or not _get(hf, 'norm_topk_prob'),
       'norm_topk_prob', 'false with num_experts_per_tok=1 (model/moe.py keeps one '
       "expert's router probability)")):
    if not ok:
      raise ValueError(f'config.json {field}={hf.get(field, _get(hf, field))!r} is not '
                       f'supported: only {supported} can be read.')


def _num_experts(hf: dict) -> int:
  # Qwen3MoeConfig reads num_experts, and saves it as num_local_experts.
  return hf.get('num_experts', hf.get('num_local_experts', _get(hf, 'num_experts')))


def _sliding_window(hf: dict) -> tuple[int, bool]:
  """(the window of the layers that slide, whether every layer does), as transformers
  reads config.json; (0, True) where none does, or the window spans the context."""
  defaults = FAMILIES[_architecture(hf)].defaults
  if 'sliding_window' not in defaults or FAMILIES[_architecture(hf)].gemma:
    # Llama has no sliding window; Gemma's alternates (hf_gemma.layer_pattern)
    return 0, True
  window = _get(hf, 'sliding_window')
  if 'use_sliding_window' in defaults and not _get(hf, 'use_sliding_window'):   # Qwen
    return 0, True
  if not window or window >= _get(hf, 'max_position_embeddings'):
    return 0, True
  if 'max_window_layers' not in defaults:
    return window, True
  first = _get(hf, 'max_window_layers')   # Qwen2, Qwen3: only some layers
  types = hf.get('layer_types') or ['sliding_attention' if i >= first else 'full_attention'
                                    for i in range(hf['num_hidden_layers'])]
  if 'sliding_attention' not in types:
    return 0, True
  return window, 'full_attention' not in types


def _rope(hf: dict) -> tuple[float, dict]:
  """(theta, scaling) from transformers 5's rope_parameters or the older rope_scaling."""
  params = dict(hf.get('rope_parameters') or hf.get('rope_scaling') or {})
  theta = float(params.get('rope_theta', _get(hf, 'rope_theta')))
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind not in ('default', 'llama3', 'linear'):
    raise ValueError(f"config.json rope scaling rope_type={kind!r} is not supported: only "
                     "'llama3' or 'linear' scaling (or none) can be read.")
  return theta, (params if kind != 'default' else {})


def model_config(hf: dict, dtype: str = 'float32') -> ModelConfig:
  """Our ModelConfig for a config.json dict of one of FAMILIES."""
  check_supported(hf)
  arch = _architecture(hf)
  family, heads = FAMILIES[arch], hf['num_attention_heads']
  if family.gemma:   # its own fields, the RoPE bases and the layers' windows included
    extra = hf_gemma.model_fields(hf, lambda key: _get(hf, key), arch == 'Gemma3ForCausalLM')
    theta, scaling = extra.pop('rope_theta'), {}
  else:
    extra, (theta, scaling) = _experts(hf, family), _rope(hf)
  fields = {'sliding_window': _sliding_window(hf)[0], **family.fields, **extra}
  cfg = ModelConfig(
      vocab_size=hf['vocab_size'], num_layers=hf['num_hidden_layers'],
      embed_dim=hf['hidden_size'], mlp_dim=hf['intermediate_size'], num_heads=heads,
      num_kv_heads=_get(hf, 'num_key_value_heads') or heads,
      head_dim=_get(hf, 'head_dim') or hf['hidden_size'] // heads,
      max_seq_len=_get(hf, 'max_position_embeddings'), rope_theta=theta,
      norm_eps=_get(hf, 'rms_norm_eps'), tie_embeddings=bool(_get(hf, 'tie_word_embeddings')),
      dtype=dtype, param_dtype=dtype, hf_architecture=arch, **fields)
  if scaling.get('rope_type', scaling.get('type')) == 'linear':
    cfg.rope_scaling_type, cfg.rope_scaling_factor = 'linear', float(scaling['factor'])
  elif scaling:
    cfg.rope_scaling_factor = float(scaling['factor'])
    cfg.rope_original_max_len = int(scaling['original_max_position_embeddings'])
    cfg.rope_low_freq_factor = float(scaling.get('low_freq_factor', 1.0))
    cfg.rope_high_freq_factor = float(scaling.get('high_freq_factor', 4.0))
  cfg.validate()
  return cfg


def _experts(hf: dict, family: Family) -> dict:
  """The ModelConfig MoE fields of a config.json: routed every token to its experts
  (dropless), as transformers does."""
  if family.experts == 'mixtral':   # every layer's MLP routed; intermediate_size wide
    return dict(num_experts=_get(hf, 'num_local_experts'),
                experts_per_token=_get(hf, 'num_experts_per_tok'), moe_every=1,
                num_shared_experts=0, moe_mlp_dim=0, router='softmax',
                router_norm_topk=True, moe_dispatch='dropless')
  if family.experts == 'qwen3_moe':   # dense layers intermediate_size wide, experts not
    return dict(num_experts=_num_experts(hf), experts_per_token=_get(hf, 'num_experts_per_tok'),
                moe_every=_get(hf, 'decoder_sparse_step'), num_shared_experts=0,
                moe_mlp_dim=_get(hf, 'moe_intermediate_size'), router='softmax',
                router_norm_topk=bool(_get(hf, 'norm_topk_prob')), moe_dispatch='dropless')
  return {}


def export_architecture(cfg: ModelConfig) -> str:
  """The architecture `cfg` exports as: model.hf_architecture, or the one its fields give;
  ValueError naming the first field that architecture cannot express."""
  arch = _architecture_of(cfg)
  if arch not in FAMILIES:
    raise ValueError(f'model.hf_architecture={arch!r} is not one meshlm writes: choose one '
                     f'of {", ".join(FAMILIES)}, or leave it empty.')
  family = FAMILIES[arch]
  for field in _FAMILY_FIELDS:
    want = family.fields.get(field, ModelConfig.__dataclass_fields__[field].default)
    if getattr(cfg, field) != want:
      raise ValueError(f'model.{field}={getattr(cfg, field)!r}: {arch} has '
                       f'{field}={want!r}; this model has no {arch} form to export to.')
  if family.gemma:
    hf_gemma.check_export(cfg, arch)
    return arch
  for field in ('global_every', 'rope_local_theta', 'query_pre_attn_scalar', 'attn_softcap',
                'final_softcap'):
    if getattr(cfg, field):
      raise ValueError(f'model.{field}={getattr(cfg, field)}: {arch} has none (Gemma 2 and 3 '
                       f'do); this model has no {arch} form to export to.')
  if cfg.sliding_window and 'sliding_window' not in family.defaults:
    raise ValueError(f'model.sliding_window={cfg.sliding_window}: {arch} has no sliding '
                     f'window; this model has no {arch} form to export to.')
  if bool(cfg.num_experts) != bool(family.experts):
    raise ValueError(f'model.num_experts={cfg.num_experts}: {arch} has '
                     f'{"experts" if family.experts else "no experts"}; this model has no '
                     f'{arch} form to export to.')
  if family.experts:
    _check_experts(cfg, arch)
  return arch


def _architecture_of(cfg: ModelConfig) -> str:
  if cfg.hf_architecture:
    return cfg.hf_architecture
  if cfg.num_experts:
    return 'Qwen3MoeForCausalLM' if cfg.qk_norm else 'MixtralForCausalLM'
  if cfg.sandwich_norms:
    return 'Gemma3ForCausalLM' if cfg.qk_norm else 'Gemma2ForCausalLM'
  return ('Qwen2ForCausalLM' if cfg.qkv_bias else 'Qwen3ForCausalLM' if cfg.qk_norm
          else 'MistralForCausalLM' if cfg.sliding_window else 'LlamaForCausalLM')


def _check_experts(cfg: ModelConfig, arch: str) -> None:
  """ValueError naming the first MoE field `arch` cannot express."""
  mixtral = FAMILIES[arch].experts == 'mixtral'
  name = 'Mixtral' if mixtral else 'Qwen3-MoE'
  for ok, what in (
      (cfg.moe_every == 1 or not mixtral, f'model.moe_every={cfg.moe_every}: Mixtral '
       'routes every layer\'s MLP (1)'),
      (cfg.num_shared_experts == 0, f'model.num_shared_experts={cfg.num_shared_experts}: '
       f'{name} has none'),
      (cfg.router == 'softmax', f'model.router={cfg.router!r}: {name}\'s is softmax'),
      (cfg.experts_per_token >= 2 or not mixtral, f'model.experts_per_token='
       f'{cfg.experts_per_token}: with one expert a token Mixtral weighs it 1, '
       'model/moe.py by its router probability'),
      (cfg.router_norm_topk or not mixtral, 'model.router_norm_topk=False: Mixtral '
       'renormalizes the chosen weights')):
    if not ok:
      raise ValueError(f'{what}; this mixture of experts has no {name} ({arch}) form to '
                       'export to.')


# config.json fields each family's export writes beyond the shared ones: no biases, no
# router noise, no sliding window (hf_config writes model.sliding_window's).
_EXPORT_FIELDS = {
    'llama': {'attention_bias': False, 'mlp_bias': False},
    'mistral': {'sliding_window': None},
    'mixtral': {'sliding_window': None, 'router_jitter_noise': 0.0,
                'output_router_logits': False},
    'qwen2': {'use_sliding_window': False, 'sliding_window': None},
    'qwen3': {'use_sliding_window': False, 'sliding_window': None, 'attention_bias': False},
    'qwen3_moe': {'use_sliding_window': False, 'sliding_window': None, 'attention_bias': False,
                  'mlp_only_layers': [], 'output_router_logits': False},
}


def hf_config(cfg: ModelConfig, dtype: str, eos_id: int, bos_id: int | None = None) -> dict:
  """model_config's inverse: the config.json dict of export_architecture(cfg) computing
  what `cfg` computes; ValueError naming the first field it cannot express."""
  arch = export_architecture(cfg)
  family = FAMILIES[arch]
  out = {
      'architectures': [arch], 'model_type': family.model_type,
      **_EXPORT_FIELDS.get(family.model_type, {}), 'hidden_act': 'silu',
      'vocab_size': cfg.vocab_size,
      'num_hidden_layers': cfg.num_layers, 'hidden_size': cfg.embed_dim,
      'intermediate_size': (cfg.resolved_moe_mlp_dim if family.experts == 'mixtral'
                            else cfg.resolved_mlp_dim), 'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads, 'head_dim': cfg.resolved_head_dim,
      'max_position_embeddings': cfg.max_seq_len, 'rope_theta': cfg.rope_theta,
      'rms_norm_eps': cfg.norm_eps, 'tie_word_embeddings': cfg.tie_embeddings,
      'torch_dtype': dtype, 'eos_token_id': eos_id, 'bos_token_id': bos_id,
      'initializer_range': cfg.init_std}
  if family.gemma:
    del out['hidden_act'], out['rope_theta']
    return {**out, **hf_gemma.hf_fields(cfg, arch)}
  if family.experts == 'mixtral':
    out.update({'num_local_experts': cfg.num_experts})
  elif family.experts == 'qwen3_moe':
    out.update({'num_experts': cfg.num_experts, 'decoder_sparse_step': cfg.moe_every,
                'moe_intermediate_size': cfg.resolved_moe_mlp_dim,
                'norm_topk_prob': cfg.router_norm_topk and cfg.experts_per_token > 1})
  if family.experts:
    out.update({'num_experts_per_tok': cfg.experts_per_token,
                'router_aux_loss_coef': cfg.moe_aux_loss_coef})
  if cfg.sliding_window:   # in every layer
    out['sliding_window'] = cfg.sliding_window
    if 'use_sliding_window' in family.defaults:   # Qwen
      out['use_sliding_window'] = True
    if 'max_window_layers' in family.defaults:   # Qwen2, Qwen3: from the first layer on
      out['max_window_layers'] = 0
  if cfg.rope_scaling_factor != 1.0 and cfg.rope_scaling_type == 'linear':
    out['rope_scaling'] = {'rope_type': 'linear', 'factor': cfg.rope_scaling_factor}
  elif cfg.rope_scaling_factor != 1.0:
    out['rope_scaling'] = {
        'rope_type': 'llama3', 'factor': cfg.rope_scaling_factor,
        'original_max_position_embeddings': cfg.rope_original_max_len,
        'low_freq_factor': cfg.rope_low_freq_factor,
        'high_freq_factor': cfg.rope_high_freq_factor}
  return out


# -------------------------------------------------------------------------------- weights

def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of the model, from one file or the shards an index names."""
  index = os.path.join(path, 'model.safetensors.index.json')
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
    files = [os.path.join(path, f) for f in files]
  else:
    files = sorted(glob.glob(os.path.join(path, '*.safetensors')))
  if not files:
    raise FileNotFoundError(f'{path} has no *.safetensors weights (PyTorch .bin files are '
                            'not read): save the model with safe_serialization=True.')
  tensors = {}
  # numpy has no bfloat16, the dtype most Llama checkpoints are stored in: read through
  # jax on the host (the arrays come out as numpy arrays of ml_dtypes' bfloat16).
  with jax.default_device(host_device()):
    for file in files:
      float8 = _float8_tensors(file)
      with safe_open(file, framework='flax') as f:
        for key in f.keys():
          tensors[key] = float8[key] if key in float8 else np.asarray(f.get_tensor(key))
  return tensors


# safetensors' readers make float8 tensors through numpy, which has no float8 types (the
# FP8 checkpoints of model/compressed_tensors.py): those are read from their bytes.
_FLOAT8 = {'F8_E4M3': jnp.float8_e4m3fn, 'F8_E5M2': jnp.float8_e5m2}


def _float8_tensors(file: str) -> dict[str, np.ndarray]:
  with open(file, 'rb') as f:
    size = int.from_bytes(f.read(8), 'little')
    header = json.loads(f.read(size))
  data = np.memmap(file, np.uint8, 'r', offset=8 + size)
  out = {}
  for key, info in header.items():
    if key != '__metadata__' and info['dtype'] in _FLOAT8:
      lo, hi = info['data_offsets']
      out[key] = np.array(data[lo:hi]).view(_FLOAT8[info['dtype']]).reshape(info['shape'])
  return out


def host_device():
  """A CPU device to read weights onto (None: the default device, where jax was started
  without its CPU backend)."""
  try:
    return jax.local_devices(backend='cpu')[0]
  except RuntimeError:
    return None


# Each layer's tensors: (Hugging Face's name, ours, how many leading axes of ours are the
# input; None: a vector, flat in HF's). HF stores a matrix [out, in], ours are
# [in..., out...]. Llama's layers are the attention and the dense MLP, Mixtral's the
# attention, the router and per expert j the three (w1 gate, w3 up, w2 down), which ours
# stack on an experts axis after the layers axis. qkv_bias and qk_norm add theirs to the
# attention's.
_ATTENTION = (
    ('input_layernorm.weight', 'attn_norm', None),
    ('self_attn.q_proj.weight', 'wq', 1),       # [D, H, E]
    ('self_attn.k_proj.weight', 'wk', 1),       # [D, K, E]
    ('self_attn.v_proj.weight', 'wv', 1),
    ('self_attn.o_proj.weight', 'wo', 2),       # [H, E, D]
    ('post_attention_layernorm.weight', 'mlp_norm', None),
)
_LAYER = _ATTENTION + (
    ('mlp.gate_proj.weight', 'w_gate', 1),      # [D, F]
    ('mlp.up_proj.weight', 'w_up', 1),
    ('mlp.down_proj.weight', 'w_down', 1),      # [F, D]
)
_QKV_BIAS = (('self_attn.q_proj.bias', 'bq', None),   # [H, E]
             ('self_attn.k_proj.bias', 'bk', None),   # [K, E]
             ('self_attn.v_proj.bias', 'bv', None))
_QK_NORM = (('self_attn.q_norm.weight', 'q_norm', None),   # [E]
            ('self_attn.k_norm.weight', 'k_norm', None))
# Each expert layout: the router's tensor, and per expert j the three of its SwiGLU.
_EXPERT_LAYOUTS = {
    'mixtral': (('block_sparse_moe.gate.weight', 'router', 1),   # [D, E]
                (('block_sparse_moe.experts.{j}.w1.weight', 'we_gate'),   # [D, F] each
                 ('block_sparse_moe.experts.{j}.w3.weight', 'we_up'),
                 ('block_sparse_moe.experts.{j}.w2.weight', 'we_down'))),   # [F, D]
    'qwen3_moe': (('mlp.gate.weight', 'router', 1),
                  (('mlp.experts.{j}.gate_proj.weight', 'we_gate'),
                   ('mlp.experts.{j}.up_proj.weight', 'we_up'),
                   ('mlp.experts.{j}.down_proj.weight', 'we_down'))),
}


def _layer_groups(cfg: ModelConfig) -> list[tuple[str, list[int], tuple, tuple]]:
  """(our tree's layer group, the HF layer indices stacked in it, its per-layer tensor
  table, its per-expert table) for each group cfg has: 'layers' the dense layers,
  'moe_layers' every moe_every-th (model.transformer's groups), after _check_experts."""
  extras = (_QKV_BIAS if cfg.qkv_bias else ()) + (_QK_NORM if cfg.qk_norm else ())
  if cfg.sandwich_norms:   # Gemma: its four norms in place of Llama's two
    table = tuple(t for t in _LAYER if t[1] not in ('attn_norm', 'mlp_norm'))
    return [('layers', list(range(cfg.num_layers)), hf_gemma.NORMS + table + extras, ())]
  if not cfg.num_experts:
    return [('layers', list(range(cfg.num_layers)), _LAYER + extras, ())]
  arch = export_architecture(cfg)
  router, experts = _EXPERT_LAYOUTS[FAMILIES[arch].experts]
  routed = [i for i in range(cfg.num_layers) if (i + 1) % cfg.moe_every == 0]
  dense = [i for i in range(cfg.num_layers) if (i + 1) % cfg.moe_every]
  groups = [('moe_layers', routed, _ATTENTION + extras + (router,), experts)]
  return groups + ([('layers', dense, _LAYER + extras, ())] if dense else [])


def params_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig,
                   on_host: bool = False) -> dict:
  """Our tree: per-layer weights stacked on a leading layers axis, [in, out] layouts, in
  cfg.param_dtype; on the default device, or as numpy arrays with on_host."""
  shapes = abstract_params(cfg)
  used = set()

  def take(name, shape, in_axes=None):
    if name not in tensors:
      if any('.mlp.experts.gate_up_proj' in k for k in tensors):
        raise ValueError('these safetensors hold the experts fused '
                         '(mlp.experts.gate_up_proj, transformers 5\'s in-memory layout, '
                         'saved with save_original_format=False), which is not read: save '
                         'the model in the original layout (one tensor per expert).')
      raise ValueError(f'the safetensors files have no {name!r}: not a complete '
                       f'{_architecture_of(cfg)} checkpoint.')
    used.add(name)
    w = tensors[name] if in_axes is None else tensors[name].T
    if w.size != math.prod(shape):
      raise ValueError(f'{name} has shape {tensors[name].shape}, which config.json\'s '
                       f'sizes do not give ({shape} in our layout).')
    return w.reshape(shape)

  tree = {'embed': take('model.embed_tokens.weight', shapes['embed'].shape),
          'final_norm': take('model.norm.weight', shapes['final_norm'].shape)}
  for group, indices, table, experts in _layer_groups(cfg):
    layers = shapes[group]
    tree[group] = {ours: np.stack([take(f'model.layers.{i}.{name}', layers[ours].shape[1:],
                                        in_axes) for i in indices])
                   for name, ours, in_axes in table}
    for name, ours in experts:
      tree[group][ours] = np.stack([np.stack([
          take(f'model.layers.{i}.{name.format(j=j)}', layers[ours].shape[2:], 1)
          for j in range(cfg.num_experts)]) for i in indices])
  if not cfg.tie_embeddings:
    tree['lm_head'] = take('lm_head.weight', shapes['lm_head'].shape, 1)
  used.add('lm_head.weight')   # a tied model may still store its (equal) head
  _check_all_used(tensors, used, cfg)
  dtype = jnp.dtype(cfg.param_dtype)
  if on_host:   # numpy, for the caller to place (training shards them straight away)
    return jax.tree.map(lambda v: np.ascontiguousarray(v).astype(dtype), tree)
  return {k: _to_jax(v, dtype) for k, v in tree.items()}


def hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """params_from_hf's inverse: our tree as the checkpoint's tensors, [out, in], one per
  layer (and expert)."""
  host = jax.tree.map(np.asarray, jax.device_get(params))

  def llama(w, in_axes):
    return w.reshape(-1) if in_axes is None else w.reshape(math.prod(w.shape[:in_axes]), -1).T

  out = {'model.embed_tokens.weight': host['embed'], 'model.norm.weight': host['final_norm']}
  for group, indices, table, experts in _layer_groups(cfg):
    for n, i in enumerate(indices):
      out.update({f'model.layers.{i}.{name}': llama(host[group][ours][n], in_axes)
                  for name, ours, in_axes in table})
      for name, ours in experts:
        out.update({f'model.layers.{i}.{name.format(j=j)}': llama(host[group][ours][n, j], 1)
                    for j in range(cfg.num_experts)})
  if not cfg.tie_embeddings:
    out['lm_head.weight'] = llama(host['lm_head'], 1)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _check_all_used(tensors: dict, used: set, cfg: ModelConfig) -> None:
  # Weights we do not map (biases, extra norms) mean a model we would compute wrong.
  extra = sorted(k for k in tensors if k not in used and not k.endswith('rotary_emb.inv_freq'))
  if extra:
    raise ValueError(f'unsupported weights {extra[:5]} (of {len(extra)}): this is not a '
                     f'{_architecture_of(cfg)} checkpoint as config.json describes it.')


def _to_jax(tree, dtype):
  if isinstance(tree, dict):
    return {k: _to_jax(v, dtype) for k, v in tree.items()}
  return jnp.asarray(np.ascontiguousarray(tree), dtype=dtype)
