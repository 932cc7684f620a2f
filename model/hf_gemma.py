"""Gemma 2 and Gemma 3 (text) config.json fields <-> ModelConfig, for model/hf.py.

What the two families add to a Llama-style decoder, each a ModelConfig field: GeGLU
(mlp_activation='gelu_tanh'), RMSNorm by (1 + w) (norm_plus_one), embeddings times
sqrt(hidden) (embed_scale), norms on the attention's and the MLP's outputs
(sandwich_norms), query_pre_attn_scalar, attention and final logit soft-capping, and
sliding-window layers alternating with global ones (global_every: Gemma 2's every other
layer, Gemma 3's five local to one global), Gemma 3 with q/k norms and its local layers'
own RoPE base (rope_local_theta). Layer patterns other than every N-th layer global are
refused by name.
"""

from model.config import ModelConfig

# The ModelConfig fields both families fix (Family.fields), Gemma 3 adding qk_norm.
FIELDS = {'mlp_activation': 'gelu_tanh', 'norm_plus_one': True, 'embed_scale': True,
          'sandwich_norms': True}
# Their config classes' defaults (transformers' Gemma2Config, Gemma3TextConfig).
GEMMA2_DEFAULTS = {'rms_norm_eps': 1e-6, 'num_key_value_heads': 4, 'head_dim': 256,
                   'max_position_embeddings': 8192, 'tie_word_embeddings': True,
                   'query_pre_attn_scalar': 256, 'sliding_window': 4096,
                   'final_logit_softcapping': 30.0, 'attn_logit_softcapping': 50.0,
                   'sliding_window_pattern': 2}
GEMMA3_DEFAULTS = {'rms_norm_eps': 1e-6, 'num_key_value_heads': 4, 'head_dim': 256,
                   'max_position_embeddings': 131072, 'tie_word_embeddings': True,
                   'rope_theta': 1e6, 'rope_local_base_freq': 1e4,
                   'query_pre_attn_scalar': 256, 'sliding_window': 4096,
                   'final_logit_softcapping': None, 'attn_logit_softcapping': None,
                   'sliding_window_pattern': 6}
# config.json field -> the only value read (the docs' refused column).
REQUIRED = {'hidden_activation': 'gelu_pytorch_tanh', 'attention_bias': False,
            'use_bidirectional_attention': False}
REFUSED = 'layer_types other than every N-th layer global'
REFUSED_GEMMA3 = (f'{REFUSED}; a full_attention rope_type other than linear; the multimodal '
                  'Gemma3ForConditionalGeneration')

# Each layer's four norms, by Gemma's names (input_layernorm and pre_feedforward_layernorm
# before the attention and the MLP, the post_ ones on their outputs).
NORMS = (('input_layernorm.weight', 'attn_norm', None),
         ('post_attention_layernorm.weight', 'post_attn_norm', None),
         ('pre_feedforward_layernorm.weight', 'mlp_norm', None),
         ('post_feedforward_layernorm.weight', 'post_mlp_norm', None))


def check(hf: dict, get) -> None:
  """ValueError naming the first Gemma field ours cannot compute; get(key): config.json's
  value or the family's default."""
  for key, want in REQUIRED.items():
    got = hf.get(key)
    if got not in (want, None):
      raise ValueError(f'config.json {key}={got!r} is not supported: only Gemma models with '
                       f'{key}={want!r} can be read.')
  layer_pattern(hf, get)


def layer_types(hf: dict, get) -> list[str]:
  """Each layer's 'sliding_attention' or 'full_attention', as transformers derives them."""
  if hf.get('layer_types'):
    return list(hf['layer_types'])
  n = get('sliding_window_pattern')
  return ['sliding_attention' if (i + 1) % n else 'full_attention'
          for i in range(hf['num_hidden_layers'])]


def layer_pattern(hf: dict, get) -> tuple[int, int]:
  """(sliding_window, global_every) of the layer types; ValueError for another pattern."""
  types = layer_types(hf, get)
  if 'sliding_attention' not in types or not get('sliding_window'):
    return 0, 0
  if 'full_attention' not in types:
    return get('sliding_window'), 0
  every = types.index('full_attention') + 1
  if types != ['sliding_attention' if (i + 1) % every else 'full_attention'
               for i in range(len(types))]:
    raise ValueError(f'config.json layer_types={types} is not supported: only every N-th '
                     'layer global (full_attention), the rest sliding, can be read.')
  return get('sliding_window'), every


def rope(hf: dict, get, gemma3: bool) -> dict:
  """The RoPE fields: Gemma 2's one base; Gemma 3's global base (its scaling linear or
  none) and local base, from rope_parameters per layer type (transformers 5) or
  rope_theta, rope_local_base_freq and rope_scaling (older)."""
  params = dict(hf.get('rope_parameters') or {})
  if not gemma3 or 'full_attention' not in params:
    full = {**(hf.get('rope_scaling') or {}), **params}
    full.setdefault('rope_theta', get('rope_theta'))
    local = {'rope_theta': get('rope_local_base_freq') if gemma3 else full['rope_theta']}
  else:
    full, local = params['full_attention'], params.get('sliding_attention') or {}
    local.setdefault('rope_theta', get('rope_local_base_freq'))
  for name, p, allowed in (('full_attention', full, ('default', 'linear')),
                           ('sliding_attention', local, ('default',))):
    kind = p.get('rope_type', p.get('type', 'default'))
    if kind not in allowed:
      raise ValueError(f'config.json rope_type={kind!r} of {name} layers is not supported: '
                       f'only {" or ".join(map(repr, allowed))} can be read.')
  out = {'rope_theta': float(full['rope_theta'])}
  if full.get('rope_type', full.get('type')) == 'linear':
    out.update(rope_scaling_type='linear', rope_scaling_factor=float(full['factor']))
  if gemma3:
    out['rope_local_theta'] = float(local['rope_theta'])
  return out


def model_fields(hf: dict, get, gemma3: bool) -> dict:
  """The ModelConfig fields of a Gemma config.json beyond the shared sizes."""
  window, every = layer_pattern(hf, get)
  fields = dict(FIELDS, sliding_window=window, global_every=every,
                query_pre_attn_scalar=float(get('query_pre_attn_scalar')),
                attn_softcap=float(get('attn_logit_softcapping') or 0.0),
                final_softcap=float(get('final_logit_softcapping') or 0.0),
                **rope(hf, get, gemma3))
  if not every:   # every layer alike: the local base where they all slide, else none
    local = fields.pop('rope_local_theta', 0.0)
    if window and gemma3:
      fields.update(rope_theta=local, rope_scaling_factor=1.0)
  if gemma3:
    fields['qk_norm'] = True
  return fields


def check_export(cfg: ModelConfig, arch: str) -> None:
  """ValueError naming the first field that `arch` (a Gemma) cannot express."""
  gemma3 = arch == 'Gemma3ForCausalLM'
  for ok, what in (
      (cfg.qk_norm == gemma3, f'model.qk_norm={cfg.qk_norm}: {arch} has qk_norm={gemma3}'),
      (not cfg.rope_local_theta or gemma3, f'model.rope_local_theta={cfg.rope_local_theta}: '
       'Gemma 2 has one RoPE base'),
      (cfg.rope_scaling_factor == 1.0 or cfg.rope_scaling_type == 'linear',
       f"model.rope_scaling_type={cfg.rope_scaling_type!r}: {arch} scales RoPE linearly"),
      (cfg.rope_scaling_factor == 1.0 or (gemma3 and cfg.rope_local_theta)
       or not cfg.global_every, 'model.rope_scaling_factor with rope_local_theta=0: '
       f'{arch} leaves its local layers unscaled')):
    if not ok:
      raise ValueError(f'{what}; this model has no {arch} form to export to.')


def hf_fields(cfg: ModelConfig, arch: str) -> dict:
  """The config.json fields of a Gemma export beyond the shared sizes."""
  gemma3 = arch == 'Gemma3ForCausalLM'
  local = cfg.layer_is_local()
  if local is None:
    local = [bool(cfg.sliding_window)] * cfg.num_layers
  out = {'model_type': 'gemma3_text' if gemma3 else 'gemma2', **REQUIRED,
         'query_pre_attn_scalar': _number(cfg.query_pre_attn_scalar or cfg.resolved_head_dim),
         'sliding_window': cfg.sliding_window or None,
         'layer_types': ['sliding_attention' if x else 'full_attention' for x in local],
         'attn_logit_softcapping': cfg.attn_softcap or None,
         'final_logit_softcapping': cfg.final_softcap or None,
         'rope_theta': cfg.rope_theta}
  if gemma3:
    out['rope_local_base_freq'] = cfg.rope_local_theta or cfg.rope_theta
  if cfg.rope_scaling_factor != 1.0:
    out['rope_scaling'] = {'rope_type': 'linear', 'factor': cfg.rope_scaling_factor}
  return out


def _number(x: float):
  # transformers' strict config classes take an int where the field is declared one.
  return int(x) if float(x).is_integer() else x
