"""Starting a run from a released model: a Hugging Face directory of one of the
architectures model/hf.py's FAMILIES reads (init_from_hf).

The directory decides what the weights are: its config.json's architecture replaces the
shape fields of `model`, the experts' included (the training knobs, dtype, remat,
attention, moe_dispatch and the auxiliary losses' weights, stay the run's),
and its tokenizer.json becomes `data.tokenizer` unless the run names a tokenizer file of
its own. The weights are read on the host (every process reads them whole) and each
device takes its shard, with a fresh optimizer state. The directory's config.json (and
tokenizer.json, when it is data.tokenizer) are read at every start, its weights only at
a fresh one: a run that has a checkpoint resumes from it.
"""

import dataclasses
import glob
import os

from model import hf as model_hf
from training.config import read_config_json

# ModelConfig fields the Hugging Face config decides.
ARCHITECTURE = ('vocab_size', 'num_layers', 'embed_dim', 'mlp_dim', 'num_heads',
                'num_kv_heads', 'head_dim', 'max_seq_len', 'rope_theta',
                'rope_scaling_factor', 'rope_original_max_len', 'rope_low_freq_factor',
                'rope_high_freq_factor', 'norm_eps', 'tie_embeddings', 'qkv_bias', 'qk_norm',
                'sliding_window', 'global_every', 'rope_scaling_type', 'rope_local_theta',
                'mlp_activation', 'norm_plus_one', 'embed_scale', 'sandwich_norms',
                'query_pre_attn_scalar', 'attn_softcap', 'final_softcap',
                'hf_architecture', 'num_experts', 'experts_per_token', 'num_shared_experts',
                'moe_every', 'moe_mlp_dim', 'router', 'router_norm_topk')


def with_pretrained(cfg):
  """(cfg with the directory's architecture and tokenizer, the fields that changed), or
  (cfg, []) without init_from_hf; ValueError for a model ours cannot be."""
  directory = os.path.expanduser(cfg.init_from_hf)
  if not directory:
    return cfg, []
  try:
    released = model_hf.model_config(
        read_config_json(directory, 'init_from_hf takes a local Hugging Face model '
                         'directory (config.json, *.safetensors, tokenizer.json).'),
        cfg.model.param_dtype)
  except (ValueError, KeyError) as e:
    what = f'config.json lacks {e}' if isinstance(e, KeyError) else str(e)
    raise ValueError(f'init_from_hf={directory!r}: {what}') from None
  if not glob.glob(os.path.join(directory, '*.safetensors')):
    raise FileNotFoundError(f'init_from_hf={directory!r} has no *.safetensors weights '
                            '(PyTorch .bin files are not read).')
  shape = {f: getattr(released, f) for f in ARCHITECTURE}
  changed = [f'model.{f}={v!r}' for f, v in shape.items() if getattr(cfg.model, f) != v]
  data = cfg.data
  if data.tokenizer == 'byte':   # the default: the model's own tokenizer instead
    tokenizer = os.path.join(directory, 'tokenizer.json')
    if not os.path.isfile(tokenizer):
      raise FileNotFoundError(f'init_from_hf={directory!r} has no tokenizer.json: add it, '
                              'or name the tokenizer the model was trained with in '
                              'data.tokenizer.')
    data = dataclasses.replace(data, tokenizer=tokenizer)
    changed.append(f'data.tokenizer={tokenizer!r}')
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape),
                             data=data), changed


def load_params(cfg) -> dict:
  """The directory's weights as our parameter tree, numpy arrays in model.param_dtype."""
  directory = os.path.expanduser(cfg.init_from_hf)
  return model_hf.params_from_hf(model_hf.read_safetensors(directory), cfg.model,
                                 on_host=True)
