"""Hugging Face checkpoints, both ways: config.json <-> ModelConfig, safetensors tensors
<-> our parameter tree. Read by serving (`serve/hf_llama.py`: --hf-model), by training
(init_from_hf: fine-tuning a released model) and written by `serve/hf_export.py`.

FAMILIES is the one table of what is read and written: Llama-style decoders whose
differences are ModelConfig fields (Qwen2's q/k/v biases: qkv_bias; Qwen3's per-head q/k
norms: qk_norm) and Mixtral, Llama with every MLP a mixture of experts (a softmax router
over E experts whose top k (k >= 2) weights are renormalized, each expert a SwiGLU, as
model/moe.py computes with router='softmax' and moe_every=1). Anything else (other
biases, activations, RoPE scalings, sliding-window attention shorter than the context,
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
  experts: bool = False   # every layer's MLP a Mixtral mixture of experts
  refused: str = ''       # what of the family is refused (the docs' table)


FAMILIES = {
    'LlamaForCausalLM': Family('llama', {'max_position_embeddings': 2048},
                               refused='attention_bias or mlp_bias true'),
    'MistralForCausalLM': Family('mistral', {'max_position_embeddings': 4096 * 32,
                                             'num_key_value_heads': 8, 'sliding_window': 4096}),
    'MixtralForCausalLM': Family(
        'mixtral', {'rope_theta': 1e6, 'rms_norm_eps': 1e-5,
                    'max_position_embeddings': 4096 * 32, 'num_key_value_heads': 8,
                    'sliding_window': None, 'num_local_experts': 8, 'num_experts_per_tok': 2},
        experts=True, refused='num_experts_per_tok=1; the fused experts layout '
                              '(mlp.experts.gate_up_proj)'),
    'Qwen2ForCausalLM': Family('qwen2', {'max_position_embeddings': 32768,
                                         'num_key_value_heads': 32, **_QWEN_WINDOW},
                               fields={'qkv_bias': True}),
    'Qwen3ForCausalLM': Family('qwen3', {'max_position_embeddings': 32768,
                                         'num_key_value_heads': 32, 'head_dim': 128,
                                         **_QWEN_WINDOW},
                               fields={'qk_norm': True}, refused='attention_bias true'),
}
# Refused in every family: other activations, RoPE scalings and sliding windows.
REFUSED_EVERYWHERE = ("hidden_act other than silu; rope scaling other than 'llama3'; a "
                      'sliding_window shorter than max_position_embeddings')
# HF config field -> the value it must have for our model to compute the same thing.
_REQUIRED = {'hidden_act': 'silu', 'attention_bias': False, 'mlp_bias': False}
# ModelConfig fields a family may fix (Family.fields); the others' are off.
_FAMILY_FIELDS = ('qkv_bias', 'qk_norm')


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
  for key, want in {'model_type': family.model_type, **_REQUIRED}.items():
    got = hf.get(key, want)
    if got != want:
      raise ValueError(f'config.json {key}={got!r} is not supported: only {archs[0]} '
                       f'models with {key}={want!r} can be read.')
  window, longest = _sliding_window(hf), _get(hf, 'max_position_embeddings')
  if window is not None and window < longest:
    raise ValueError(f'config.json sliding_window={window} is not supported: attention here '
                     f'sees the whole context, so only a window of null or at least '
                     f'max_position_embeddings ({longest}) can be read (setting '
                     f'max_position_embeddings to {window} runs the model within its window).')
  if family.experts and _get(hf, 'num_experts_per_tok') < 2:
    raise ValueError(f'config.json num_experts_per_tok={hf["num_experts_per_tok"]} is '
                     'not supported: with one expert a token, Mixtral weighs it 1 and '
                     'model/moe.py by its router probability; 2 or more can be read.')


def _sliding_window(hf: dict) -> int | None:
  """The window of the layers that slide, as transformers reads config.json (None: no
  layer slides)."""
  defaults = FAMILIES[_architecture(hf)].defaults
  if 'sliding_window' not in defaults:   # Llama has no sliding window
    return None
  window = _get(hf, 'sliding_window')
  if 'use_sliding_window' in defaults:   # Qwen
    if not _get(hf, 'use_sliding_window'):
      return None
    first = _get(hf, 'max_window_layers')
    types = hf.get('layer_types') or ['sliding_attention' if i >= first else 'full_attention'
                                      for i in range(hf['num_hidden_layers'])]
    if 'sliding_attention' not in types:
      return None
  return window


def _rope(hf: dict) -> tuple[float, dict]:
  """(theta, scaling) from transformers 5's rope_parameters or the older rope_scaling."""
  params = dict(hf.get('rope_parameters') or hf.get('rope_scaling') or {})
  theta = float(params.get('rope_theta', _get(hf, 'rope_theta')))
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind not in ('default', 'llama3'):
    raise ValueError(f"config.json rope scaling rope_type={kind!r} is not supported: only "
                     "'llama3' scaling (or none) can be read.")
  return theta, (params if kind == 'llama3' else {})


def model_config(hf: dict, dtype: str = 'float32') -> ModelConfig:
  """Our ModelConfig for a config.json dict of one of FAMILIES."""
  check_supported(hf)
  theta, scaling = _rope(hf)
  arch = _architecture(hf)
  family, heads = FAMILIES[arch], hf['num_attention_heads']
  experts = {}
  if family.experts:   # every layer's MLP routed; an expert is intermediate_size wide
    experts = dict(num_experts=_get(hf, 'num_local_experts'),
                   experts_per_token=_get(hf, 'num_experts_per_tok'), moe_every=1,
                   num_shared_experts=0, moe_mlp_dim=0, router='softmax',
                   moe_dispatch='dropless')   # every token to its experts, as Mixtral
  cfg = ModelConfig(
      vocab_size=hf['vocab_size'], num_layers=hf['num_hidden_layers'],
      embed_dim=hf['hidden_size'], mlp_dim=hf['intermediate_size'], num_heads=heads,
      num_kv_heads=_get(hf, 'num_key_value_heads') or heads,
      head_dim=_get(hf, 'head_dim') or hf['hidden_size'] // heads,
      max_seq_len=_get(hf, 'max_position_embeddings'), rope_theta=theta,
      norm_eps=_get(hf, 'rms_norm_eps'), tie_embeddings=bool(_get(hf, 'tie_word_embeddings')),
      dtype=dtype, param_dtype=dtype, hf_architecture=arch, **family.fields, **experts)
  if scaling:
    cfg.rope_scaling_factor = float(scaling['factor'])
    cfg.rope_original_max_len = int(scaling['original_max_position_embeddings'])
    cfg.rope_low_freq_factor = float(scaling.get('low_freq_factor', 1.0))
    cfg.rope_high_freq_factor = float(scaling.get('high_freq_factor', 4.0))
  cfg.validate()
  return cfg


def export_architecture(cfg: ModelConfig) -> str:
  """The architecture `cfg` exports as: model.hf_architecture, or the one its fields give;
  ValueError naming the first field that architecture cannot express."""
  arch = _architecture_of(cfg)
  if arch not in FAMILIES:
    raise ValueError(f'model.hf_architecture={arch!r} is not one meshlm writes: choose one '
                     f'of {", ".join(FAMILIES)}, or leave it empty.')
  family = FAMILIES[arch]
  for field in _FAMILY_FIELDS:
    want = family.fields.get(field, False)
    if getattr(cfg, field) != want:
      raise ValueError(f'model.{field}={getattr(cfg, field)}: {arch} has '
                       f'{field}={want}; this model has no {arch} form to export to.')
  if bool(cfg.num_experts) != family.experts:
    raise ValueError(f'model.num_experts={cfg.num_experts}: {arch} has '
                     f'{"experts" if family.experts else "no experts"}; this model has no '
                     f'{arch} form to export to.')
  if family.experts:
    _check_mixtral(cfg)
  return arch


def _architecture_of(cfg: ModelConfig) -> str:
  return cfg.hf_architecture or (
      'MixtralForCausalLM' if cfg.num_experts else 'Qwen2ForCausalLM' if cfg.qkv_bias
      else 'Qwen3ForCausalLM' if cfg.qk_norm else 'LlamaForCausalLM')


def _check_mixtral(cfg: ModelConfig) -> None:
  """ValueError naming the first MoE field Mixtral cannot express."""
  for ok, what in (
      (cfg.moe_every == 1, f'model.moe_every={cfg.moe_every}: Mixtral routes every layer\'s '
       'MLP (1)'),
      (cfg.num_shared_experts == 0, f'model.num_shared_experts={cfg.num_shared_experts}: '
       'Mixtral has none'),
      (cfg.router == 'softmax', f'model.router={cfg.router!r}: Mixtral\'s is softmax'),
      (cfg.experts_per_token >= 2, f'model.experts_per_token={cfg.experts_per_token}: '
       'with one expert a token Mixtral weighs it 1, model/moe.py by its router '
       'probability')):
    if not ok:
      raise ValueError(f'{what}; this mixture of experts has no Mixtral '
                       '(MixtralForCausalLM) form to export to.')


# config.json fields each family's export writes beyond the shared ones: no biases, no
# sliding window, no router noise.
_EXPORT_FIELDS = {
    'llama': {'attention_bias': False, 'mlp_bias': False},
    'mistral': {'sliding_window': None},
    'mixtral': {'sliding_window': None, 'router_jitter_noise': 0.0,
                'output_router_logits': False},
    'qwen2': {'use_sliding_window': False, 'sliding_window': None},
    'qwen3': {'use_sliding_window': False, 'sliding_window': None, 'attention_bias': False},
}


def hf_config(cfg: ModelConfig, dtype: str, eos_id: int, bos_id: int | None = None) -> dict:
  """model_config's inverse: the config.json dict of export_architecture(cfg) computing
  what `cfg` computes; ValueError naming the first field it cannot express."""
  arch = export_architecture(cfg)
  family = FAMILIES[arch]
  out = {
      'architectures': [arch], 'model_type': family.model_type,
      **_EXPORT_FIELDS[family.model_type], 'hidden_act': 'silu', 'vocab_size': cfg.vocab_size,
      'num_hidden_layers': cfg.num_layers, 'hidden_size': cfg.embed_dim,
      'intermediate_size': (cfg.resolved_moe_mlp_dim if cfg.num_experts
                            else cfg.resolved_mlp_dim), 'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads, 'head_dim': cfg.resolved_head_dim,
      'max_position_embeddings': cfg.max_seq_len, 'rope_theta': cfg.rope_theta,
      'rms_norm_eps': cfg.norm_eps, 'tie_word_embeddings': cfg.tie_embeddings,
      'torch_dtype': dtype, 'eos_token_id': eos_id, 'bos_token_id': bos_id,
      'initializer_range': cfg.init_std}
  if family.experts:
    out.update({'num_local_experts': cfg.num_experts,
                'num_experts_per_tok': cfg.experts_per_token,
                'router_aux_loss_coef': cfg.moe_aux_loss_coef})
  if cfg.rope_scaling_factor != 1.0:
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
      with safe_open(file, framework='flax') as f:
        for key in f.keys():
          tensors[key] = np.asarray(f.get_tensor(key))
  return tensors


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
_ROUTER = (('block_sparse_moe.gate.weight', 'router', 1),)   # [D, E]
_EXPERT = (('block_sparse_moe.experts.{j}.w1.weight', 'we_gate'),   # [D, F] each
           ('block_sparse_moe.experts.{j}.w3.weight', 'we_up'),
           ('block_sparse_moe.experts.{j}.w2.weight', 'we_down'))   # [F, D]


def _layer_tables(cfg: ModelConfig) -> tuple[str, tuple]:
  """(our tree's layer group, its per-layer tensor table) for cfg: Llama's, or Mixtral's
  after _check_mixtral; with the q/k/v biases and q/k norms cfg has."""
  extras = (_QKV_BIAS if cfg.qkv_bias else ()) + (_QK_NORM if cfg.qk_norm else ())
  if not cfg.num_experts:
    return 'layers', _LAYER + extras
  _check_mixtral(cfg)
  return 'moe_layers', _ATTENTION + extras + _ROUTER


def params_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig,
                   on_host: bool = False) -> dict:
  """Our tree: per-layer weights stacked on a leading layers axis, [in, out] layouts, in
  cfg.param_dtype; on the default device, or as numpy arrays with on_host."""
  shapes = abstract_params(cfg)
  used = set()

  def take(name, shape, in_axes=None):
    if name not in tensors:
      if any('.mlp.experts.gate_up_proj' in k for k in tensors):
        raise ValueError('these safetensors hold Mixtral\'s experts fused '
                         '(mlp.experts.gate_up_proj, transformers 5\'s in-memory layout, '
                         'saved with save_original_format=False), which is not read: save '
                         'the model in the original layout (block_sparse_moe.experts.N.w1).')
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
  group, table = _layer_tables(cfg)
  layers = shapes[group]
  tree[group] = {ours: np.stack([take(f'model.layers.{i}.{name}', layers[ours].shape[1:],
                                      in_axes) for i in range(cfg.num_layers)])
                 for name, ours, in_axes in table}
  for name, ours in _EXPERT if cfg.num_experts else ():
    tree[group][ours] = np.stack([np.stack([
        take(f'model.layers.{i}.{name.format(j=j)}', layers[ours].shape[2:], 1)
        for j in range(cfg.num_experts)]) for i in range(cfg.num_layers)])
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
  group, table = _layer_tables(cfg)
  for i in range(cfg.num_layers):
    out.update({f'model.layers.{i}.{name}': llama(host[group][ours][i], in_axes)
                for name, ours, in_axes in table})
    for name, ours in _EXPERT if cfg.num_experts else ():
      out.update({f'model.layers.{i}.{name.format(j=j)}': llama(host[group][ours][i, j], 1)
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
