"""Hugging Face directories of every family model/hf.py reads (Llama, Mistral, Mixtral,
Qwen2, Qwen3) served with our model code: the same logits and greedy tokens as
transformers' *ForCausalLM, the same chat-template text as apply_chat_template, and
anything else refused by name. Everything is built here."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from tokenizers import models, pre_tokenizers

import model
from serve.api.chat_template import render_chat
from serve.load.hf_model import ServedModel, load_hf_model

SPECIALS = ['<unk>', '<s>', '</s>', '<|eot_id|>', '<|begin_of_text|>',
            '<|start_header_id|>', '<|end_header_id|>']
WORDS = [f'w{i}' for i in range(200)]

# A Llama-3-style template, exercising what transformers' environment provides:
# trim_blocks/lstrip_blocks (the indented block tags), raise_exception, tojson.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('role ' + message['role'] + ' is not supported') }}
    {% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message.meta is defined %}
meta: {{ message.meta | tojson }}
    {% endif %}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{% if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""


def write_tokenizer(path, chat_template=None, eos_token='</s>'):
  vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(SPECIALS)
  tok.save(os.path.join(path, 'tokenizer.json'))
  cfg = {'bos_token': '<|begin_of_text|>', 'eos_token': eos_token}
  if chat_template:
    cfg['chat_template'] = chat_template
  with open(os.path.join(path, 'tokenizer_config.json'), 'w') as f:
    json.dump(cfg, f)
  return tok


# family -> the prefix of transformers' config and model classes (the reference).
FAMILIES = {'llama': 'Llama', 'mistral': 'Mistral', 'mixtral': 'Mixtral', 'qwen2': 'Qwen2',
            'qwen3': 'Qwen3', 'qwen3_moe': 'Qwen3Moe', 'gemma2': 'Gemma2', 'gemma3_text': 'Gemma3'}
# Where the config class is not the prefix's (Gemma3Config is the multimodal one).
CONFIG_CLASSES = {'gemma3_text': 'Gemma3TextConfig'}


def config_class(family: str):
  return getattr(transformers, CONFIG_CLASSES.get(family, f'{FAMILIES[family]}Config'))


def save_hf(path, family='llama', shard=False, **overrides):
  """A random transformers model of `family` at a tiny shape, saved to path. Biases and
  norm scales, which transformers initializes to 0 and 1, are drawn too, so that a
  mapping that drops or misplaces one changes the logits."""
  kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            initializer_range=0.1)
  config = config_class(family)(**{**kw, **overrides})
  torch.manual_seed(0)
  hf = getattr(transformers, f'{FAMILIES[family]}ForCausalLM')(config).float().eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if name.endswith('.bias'):
        p.normal_(0.0, 0.5)
      elif name.endswith('norm.weight'):
        p.uniform_(0.5, 1.5)
  hf.save_pretrained(path, safe_serialization=True, **({'max_shard_size': '40KB'} if shard else {}))
  return hf


def save_llama(path, shard=False, **overrides):
  """save_hf of a Llama, or of a Mixtral where overrides give experts."""
  return save_hf(path, 'mixtral' if 'num_local_experts' in overrides else 'llama', shard,
                 **overrides)


def our_logits(served: ServedModel, tokens: np.ndarray) -> np.ndarray:
  cfg = served.model_cfg
  fn = jax.jit(lambda p, t: model.logits(p, model.forward(p, t, cfg), cfg))
  return np.asarray(fn(served.params, jnp.asarray(tokens, jnp.int32)))


def our_greedy(served: ServedModel, prompt: np.ndarray, n: int) -> list[int]:
  """Argmax decoding with the plain training forward, the whole sequence each step."""
  cfg, width = served.model_cfg, len(prompt) + n
  fn = jax.jit(lambda p, t: model.logits(p, model.forward(p, t, cfg), cfg))
  seq = list(prompt)
  for _ in range(n):
    padded = np.zeros((1, width), np.int32)   # causal: the padding after is never seen
    padded[0, :len(seq)] = seq
    seq.append(int(np.argmax(np.asarray(fn(served.params, padded))[0, len(seq) - 1])))
  return seq[len(prompt):]


CASES = {
    'untied_gqa_sharded': dict(shard=True),
    'tied_mha': dict(tie_word_embeddings=True, num_key_value_heads=4),
    'llama3_rope': dict(rope_theta=10000.0, rope_scaling={
        'rope_type': 'llama3', 'factor': 4.0, 'low_freq_factor': 1.0,
        'high_freq_factor': 4.0, 'original_max_position_embeddings': 16}),
    'linear_rope': dict(rope_scaling={'rope_type': 'linear', 'factor': 4.0}),
    # Every MLP routed over 4 experts, 2 a token (the router's weights renormalized).
    'mixtral_sharded': dict(family='mixtral', shard=True, num_local_experts=4,
                            num_experts_per_tok=2),
    # Biased q, k, v projections (none on o); tied, as Qwen2.5's small models are.
    'qwen2_tied': dict(family='qwen2', tie_word_embeddings=True),
    # Per-head q and k norms; head_dim 24, not hidden / heads (16).
    'qwen3_head_dim': dict(family='qwen3', head_dim=24, shard=True),
    # Llama's layout; the window no shorter than the context: plain attention.
    'mistral': dict(family='mistral', sliding_window=128, rope_theta=1e6),
    # Each query sees its last 8 positions (of 60).
    'mistral_window': dict(family='mistral', sliding_window=8),
    # Qwen's window in every layer (max_window_layers=0).
    'qwen2_window': dict(family='qwen2', use_sliding_window=True, sliding_window=8,
                         max_window_layers=0),
    # Qwen3's attention; layers 1 and 3 route over 4 experts of width 32, 2 a token, their
    # router probabilities as they are (norm_topk_prob's default); layers 0 and 2 dense.
    'qwen3_moe_sparse_step': dict(family='qwen3_moe', num_hidden_layers=4, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                  decoder_sparse_step=2),
    # Every layer routed, 3 of 4 experts a token renormalized, tied, sharded.
    'qwen3_moe_normed': dict(family='qwen3_moe', num_experts=4, num_experts_per_tok=3,
                             moe_intermediate_size=32, norm_topk_prob=True,
                             tie_word_embeddings=True, shard=True),
    # Layers 0 and 2 see their last 8 positions, 1 and 3 the whole context; scores and
    # logits soft-capped tightly enough to bend them (Gemma 2's 50 and 30 barely would
    # at this scale); queries scaled by 24**-0.5, not head_dim's 16**-0.5; tied.
    'gemma2': dict(family='gemma2', num_hidden_layers=4, head_dim=16, sliding_window=8,
                   attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                   query_pre_attn_scalar=24, tie_word_embeddings=True),
    # Five local layers (window 8, RoPE base 100) to one global (base 1e6, scaled linearly
    # by 4), q/k norms, no soft-capping; sharded, untied.
    'gemma3': dict(family='gemma3_text', num_hidden_layers=6, head_dim=16, sliding_window=8,
                   rope_local_base_freq=100.0, rope_scaling={'rope_type': 'linear',
                                                             'factor': 4.0},
                   query_pre_attn_scalar=16, shard=True),
    # Every third layer global (layer_types written out), tied.
    'gemma3_every_third': dict(family='gemma3_text', num_hidden_layers=6, head_dim=16,
                               sliding_window=8, layer_types=[
                                   'sliding_attention', 'sliding_attention', 'full_attention'] * 2,
                               rope_local_base_freq=100.0, tie_word_embeddings=True),
}


@pytest.mark.parametrize('case', CASES)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, case):
  overrides = dict(CASES[case])
  shard = overrides.get('shard', False)
  hf = save_hf(tmp_path, **overrides)
  write_tokenizer(tmp_path)
  if shard:
    assert os.path.exists(tmp_path / 'model.safetensors.index.json')
  served = load_hf_model(str(tmp_path))
  assert ('lm_head' in served.params) == (not hf.config.tie_word_embeddings)
  # 60 positions: past original_max_position_embeddings=16, where llama3 scaling acts.
  tokens = np.random.default_rng(0).integers(0, 300, size=(2, 60))
  with torch.no_grad():
    want = hf(torch.as_tensor(tokens)).logits.numpy()
  got = our_logits(served, tokens)
  assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()

  prompt = tokens[0, :12]
  hf.generation_config.eos_token_id = None   # ten tokens whatever they are
  with torch.no_grad():
    out = hf.generate(torch.as_tensor(prompt[None]), max_new_tokens=10, do_sample=False,
                      pad_token_id=0)
  assert our_greedy(served, prompt, 10) == out[0, len(prompt):].tolist()


def test_bfloat16_checkpoints_load_bitwise_and_serve_in_their_dtype(tmp_path):
  """Most Llama checkpoints are stored in bfloat16, which numpy cannot read. Read as
  float32 they give transformers' float32 logits on the same (upcast) weights; under
  'auto' they are served in bfloat16, off those logits by bfloat16 rounding: more than
  float32 would be, no more than twice what transformers' own bfloat16 forward is off."""
  save_llama(tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)
  write_tokenizer(tmp_path)
  assert json.loads((tmp_path / 'config.json').read_text())['dtype'] == 'bfloat16'
  tokens = np.random.default_rng(0).integers(0, 300, size=(2, 60))

  def hf_logits(dtype):
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=dtype).eval()
    with torch.no_grad():
      return hf(torch.as_tensor(tokens)).logits.float().numpy()

  want, hf_b16 = hf_logits(torch.float32), hf_logits(torch.bfloat16)
  f32 = load_hf_model(str(tmp_path), dtype='float32')
  assert {x.dtype for x in jax.tree.leaves(f32.params)} == {jnp.dtype('float32')}
  assert np.abs(our_logits(f32, tokens) - want).max() < 1e-4
  b16 = load_hf_model(str(tmp_path))
  assert (b16.model_cfg.dtype, b16.model_cfg.param_dtype) == ('bfloat16', 'bfloat16')
  assert {x.dtype for x in jax.tree.leaves(b16.params)} == {jnp.dtype('bfloat16')}
  err, hf_err = (np.abs(x - want).max() for x in (our_logits(b16, tokens), hf_b16))
  assert 1e-3 < err < 2 * hf_err, (err, hf_err)


def test_dtype_auto_follows_config_json_and_a_flag_overrides_it(llama_dir, tmp_path):
  assert load_hf_model(str(llama_dir)).model_cfg.dtype == 'float32'   # saved in float32
  half = load_hf_model(str(llama_dir), dtype='float16')
  assert {x.dtype for x in jax.tree.leaves(half.params)} == {jnp.dtype('float16')}
  assert half.model_cfg.dtype == 'float16'
  path = tmp_path / 'model'
  shutil.copytree(llama_dir, path)
  config = json.loads((path / 'config.json').read_text())
  config.pop('dtype', None)
  (path / 'config.json').write_text(json.dumps({**config, 'torch_dtype': 'bfloat16'}))
  assert load_hf_model(str(path)).model_cfg.dtype == 'bfloat16'   # transformers < 4.56
  (path / 'config.json').write_text(json.dumps({**config, 'dtype': 'float8_e4m3fn'}))
  with pytest.raises(ValueError, match=r"config.json dtype='float8_e4m3fn' cannot be "
                     r"served: choose one of .* with --dtype"):
    load_hf_model(str(path))
  assert load_hf_model(str(path), dtype='float32').model_cfg.dtype == 'float32'
  with pytest.raises(ValueError, match=r"--dtype='int8' cannot be served"):
    load_hf_model(str(llama_dir), dtype='int8')


def test_config_tokenizer_and_eos_come_from_the_directory(tmp_path):
  save_llama(tmp_path, eos_token_id=[3, 2], rope_theta=500000.0, rms_norm_eps=1e-6)
  tok = write_tokenizer(tmp_path, chat_template=LLAMA3_TEMPLATE, eos_token='<|eot_id|>')
  served = load_hf_model(str(tmp_path))
  cfg = served.model_cfg
  assert (cfg.vocab_size, cfg.num_layers, cfg.embed_dim, cfg.mlp_dim) == (300, 2, 64, 128)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim) == (4, 2, 16)
  assert (cfg.max_seq_len, cfg.rope_theta, cfg.norm_eps) == (128, 500000.0, 1e-6)
  assert cfg.rope_scaling_factor == 1.0 and not cfg.tie_embeddings
  assert served.eos_token_ids == [3, 2]
  assert served.tokenizer.eos_id == tok.token_to_id('<|eot_id|>')
  assert served.tokenizer.decode(served.tokenizer.encode('w5 w7')) == 'w5 w7'
  assert served.chat_template == LLAMA3_TEMPLATE
  assert served.name == os.path.basename(tmp_path)


def test_generation_config_gives_sampling_defaults_and_a_bad_one_is_named(tmp_path):
  save_llama(tmp_path)
  write_tokenizer(tmp_path)
  transformers.GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20,
                                max_new_tokens=64, eos_token_id=2).save_pretrained(tmp_path)
  served = load_hf_model(str(tmp_path))
  assert served.sampling_defaults == {'temperature': 0.6, 'top_p': 0.9, 'top_k': 20}
  gen = json.loads((tmp_path / 'generation_config.json').read_text())
  # transformers' own defaults, written out, set nothing (as vLLM reads the file)
  (tmp_path / 'generation_config.json').write_text(json.dumps(
      {**gen, 'top_k': 50, 'repetition_penalty': 1.0, 'min_p': 0.05}))
  assert load_hf_model(str(tmp_path)).sampling_defaults == {'temperature': 0.6,
                                                            'top_p': 0.9, 'min_p': 0.05}
  (tmp_path / 'generation_config.json').write_text(json.dumps({**gen, 'top_p': 0}))
  with pytest.raises(ValueError, match=r'generation_config.json: top_p: .*--generation-config '
                     'none'):
    load_hf_model(str(tmp_path))
  assert load_hf_model(str(tmp_path), generation_config='none').sampling_defaults == {}


MESSAGES = [
    {'role': 'system', 'content': 'You are terse.  '},
    {'role': 'user', 'content': 'w1 w2 héllo', 'meta': {'lang': 'français'}},
    {'role': 'assistant', 'content': 'w3'},
    {'role': 'user', 'content': 'w4?'},
]


@pytest.mark.parametrize('add_generation_prompt', [True, False])
def test_chat_template_renders_as_transformers_does(tmp_path, add_generation_prompt):
  save_llama(tmp_path)
  tok = write_tokenizer(tmp_path, chat_template=LLAMA3_TEMPLATE, eos_token='<|eot_id|>')
  served = load_hf_model(str(tmp_path))
  hf_tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token='<|begin_of_text|>', eos_token='<|eot_id|>')
  hf_tok.chat_template = LLAMA3_TEMPLATE
  want = hf_tok.apply_chat_template(MESSAGES, tokenize=False,
                                    add_generation_prompt=add_generation_prompt)
  got = render_chat(served, MESSAGES, add_generation_prompt=add_generation_prompt)
  assert got == want
  # Written out: the whitespace control of trim_blocks/lstrip_blocks, and tojson keeping ç.
  expected = ('<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.'
              '<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nmeta: {"lang": '
              '"français"}\nw1 w2 héllo<|eot_id|><|start_header_id|>assistant<|end_header_id|>'
              '\n\nw3<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nw4?<|eot_id|>')
  if add_generation_prompt:
    expected += '<|start_header_id|>assistant<|end_header_id|>\n\n'
  assert got == expected
  with pytest.raises(ValueError, match='role tool is not supported'):
    render_chat(served, [{'role': 'tool', 'content': 'x'}])


def test_without_a_template_a_plain_one_is_used(tmp_path):
  served = ServedModel(model_cfg=None, params={}, tokenizer=None, eos_token_ids=[0],
                       chat_template=None, name='m')
  text = render_chat(served, [{'role': 'system', 'content': 'Be brief.'},
                              {'role': 'user', 'content': 'Hi'}])
  assert text == 'system: Be brief.\nuser: Hi\nassistant: '
  assert render_chat(served, [{'role': 'user', 'content': 'Hi'}],
                     add_generation_prompt=False) == 'user: Hi\n'


@pytest.mark.parametrize('messages, message', [
    ([], 'non-empty list'),
    ('hello', 'non-empty list'),
    (['hello'], r'messages\[0\] must be an object'),
    ([{'content': 'x'}], r'messages\[0\].role=None'),
    ([{'role': 'user', 'content': 'x'}, {'role': 'robot', 'content': 'x'}],
     r"messages\[1\].role='robot'"),
    ([{'role': 'user', 'content': [{'type': 'text', 'text': 'x'}]}],
     r'messages\[0\].content must be a string'),
])
def test_bad_messages_are_named(messages, message):
  served = ServedModel(model_cfg=None, params={}, tokenizer=None, eos_token_ids=[0],
                       chat_template=None, name='m')
  with pytest.raises(ValueError, match=message):
    render_chat(served, messages)


@pytest.fixture(scope='module')
def llama_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp('llama')
  save_llama(path)
  write_tokenizer(path)
  return path


# A Llama directory's config.json made to claim Mixtral.
MIXTRAL = {'architectures': ['MixtralForCausalLM'], 'model_type': 'mixtral',
           'num_local_experts': 4, 'num_experts_per_tok': 2}
QWEN2 = {'architectures': ['Qwen2ForCausalLM'], 'model_type': 'qwen2'}
QWEN3 = {'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3'}
QWEN3_MOE = {'architectures': ['Qwen3MoeForCausalLM'], 'model_type': 'qwen3_moe',
             'num_experts': 4, 'num_experts_per_tok': 2}


@pytest.mark.parametrize('edit, message', [
    ({'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2'},
     r"architectures=\['GPT2LMHeadModel'\] is not supported"),
    ({'model_type': 'mistral'}, "model_type='mistral' is not supported"),
    ({'attention_bias': True}, 'attention_bias=True is not supported'),
    ({'mlp_bias': True}, 'mlp_bias=True is not supported'),
    ({'hidden_act': 'gelu'}, "hidden_act='gelu' is not supported"),
    ({'rope_parameters': {'rope_type': 'yarn', 'factor': 2.0, 'rope_theta': 1e4}},
     "rope_type='yarn' is not supported"),
    ({'rope_parameters': None, 'rope_scaling': {'type': 'dynamic', 'factor': 2.0}},
     "rope_type='dynamic' is not supported"),
    ({**MIXTRAL, 'num_experts_per_tok': 1}, 'num_experts_per_tok=1 is not supported'),
    ({**MIXTRAL, 'model_type': 'llama'}, "model_type='llama' is not supported"),
    (MIXTRAL, "no 'model.layers.0.block_sparse_moe.gate.weight': not a complete Mixtral"),
    ({**QWEN3, 'attention_bias': True}, 'attention_bias=True is not supported'),
    ({**QWEN2, 'use_sliding_window': True, 'sliding_window': 64, 'max_window_layers': 1},
     r'sliding_window=64 is not supported in some layers only \(max_window_layers=1, '),
    ({**QWEN2, 'layer_types': ['full_attention', 'sliding_attention'],
      'use_sliding_window': True, 'sliding_window': 64}, 'sliding_window=64 is not supported'),
    (QWEN2, "no 'model.layers.0.self_attn.q_proj.bias': not a complete Qwen2ForCausalLM"),
    ({**QWEN3_MOE, 'mlp_only_layers': [0]}, r'mlp_only_layers=\[0\] is not supported: '
     r'only \[\] \(every decoder_sparse_step-th layer routed\)'),
    ({**QWEN3_MOE, 'decoder_sparse_step': 3}, 'decoder_sparse_step=3 is not supported: only '
     'a divisor of num_hidden_layers=2'),
    ({**QWEN3_MOE, 'num_experts_per_tok': 1, 'norm_topk_prob': True},
     'norm_topk_prob=True is not supported'),
    ({**QWEN3_MOE, 'num_experts': 0}, 'num_experts=0 is not supported'),
    ({**QWEN3_MOE, 'attention_bias': True}, 'attention_bias=True is not supported'),
])
def test_other_architectures_are_refused_by_name(llama_dir, tmp_path, edit, message):
  path = tmp_path / 'model'
  shutil.copytree(llama_dir, path)
  config = json.loads((path / 'config.json').read_text())
  (path / 'config.json').write_text(json.dumps({**config, **edit}))
  with pytest.raises(ValueError, match=message):
    load_hf_model(str(path))


def test_what_config_json_refuses_is_refused_before_any_weight_is_read(llama_dir, tmp_path,
                                                                     monkeypatch):
  from serve.load import hf_model  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(hf_model, 'read_safetensors',
                      lambda *a: pytest.fail('weights read before the refusal'))
  for edit, field in (({**QWEN3, 'attention_bias': True}, 'attention_bias'),
                      ({**QWEN2, 'use_sliding_window': True, 'sliding_window': 64,
                        'max_window_layers': 1}, 'sliding_window'),
                      ({**QWEN3_MOE, 'mlp_only_layers': [1]}, 'mlp_only_layers'),
                      ({'rope_parameters': {'rope_type': 'yarn', 'factor': 2.0}},
                       'rope_type')):
    path = tmp_path / field
    shutil.copytree(llama_dir, path)
    config = json.loads((path / 'config.json').read_text())
    (path / 'config.json').write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=f'config.json (rope scaling )?{field}='):
      load_hf_model(str(path))


def test_biased_weights_and_missing_files_are_refused(llama_dir, tmp_path):
  """A Llama saved with q/k/v/o biases (attention_bias=True) whose config claims none."""
  biased = tmp_path / 'biased'
  save_llama(biased, attention_bias=True)
  write_tokenizer(biased)
  config = json.loads((biased / 'config.json').read_text())
  (biased / 'config.json').write_text(json.dumps({**config, 'attention_bias': False}))
  with pytest.raises(ValueError, match=r'unsupported weights .*q_proj.bias'):
    load_hf_model(str(biased))
  with pytest.raises(FileNotFoundError, match='config.json not found'):
    load_hf_model(str(tmp_path / 'nowhere'))
  no_tok = tmp_path / 'no_tok'
  shutil.copytree(llama_dir, no_tok)
  os.remove(no_tok / 'tokenizer.json')
  with pytest.raises(FileNotFoundError, match='no tokenizer.json'):
    load_hf_model(str(no_tok))


def test_a_mixtral_serves_through_the_engine_as_transformers_generates(tmp_path):
  """serve.generate --hf-model on a Mixtral (the paged forward, MoE layers dropless):
  greedy tokens of three prompts batched together equal transformers' generate, one by
  one. The model's vocabulary is the tokenizer's, which the engine samples from."""
  hf = save_llama(tmp_path, num_local_experts=4, num_experts_per_tok=2,
                  vocab_size=len(SPECIALS + WORDS))
  write_tokenizer(tmp_path)
  prompts = [np.random.default_rng(i).integers(7, 200, 9).tolist() for i in range(3)]
  with open(tmp_path / 'prompts.jsonl', 'w') as f:
    for p in prompts:
      f.write(json.dumps({'prompt_token_ids': p, 'max_tokens': 8, 'temperature': 0,
                          'ignore_eos': True}) + '\n')
  result = subprocess.run(
      [sys.executable, '-m', 'serve.generate', '--hf-model', str(tmp_path), '--prompts',
       str(tmp_path / 'prompts.jsonl'), '--output', str(tmp_path / 'out.jsonl'),
       '--no-warmup', '--max-model-len', '128'],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
      text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  got = [json.loads(line)['token_ids'] for line in open(tmp_path / 'out.jsonl')]
  hf.generation_config.eos_token_id = None
  want = []
  for p in prompts:
    with torch.no_grad():
      out = hf.generate(torch.as_tensor([p]), max_new_tokens=8, do_sample=False,
                        pad_token_id=0)
    want.append(out[0, len(p):].tolist())
  assert got == want


@pytest.mark.parametrize('arch', FAMILIES)
def test_fields_config_json_leaves_out_take_transformers_defaults(arch):
  """A hand-written config.json with only the sizes: what it leaves out (RoPE theta, norm
  epsilon, context, KV heads, head width, experts) is what transformers' own config class
  assumes (Mistral's: a sliding window of 4096)."""
  from model.hf import model_config   # pylint: disable=import-outside-toplevel
  sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=32)   # Qwen's default kv heads: 32
  name = f'{FAMILIES[arch]}ForCausalLM'
  ours = model_config({'architectures': [name], 'model_type': arch, **sizes})
  theirs = config_class(arch)(**sizes)
  model = getattr(transformers, name)
  rope = theirs.rope_parameters
  if arch == 'gemma3_text':   # two sliding layers: the local base is every layer's
    assert theirs.layer_types == ['sliding_attention'] * 2
    rope = rope['sliding_attention']
  assert ours.rope_theta == rope['rope_theta']
  assert (ours.norm_eps, ours.max_seq_len, ours.num_kv_heads) == (
      theirs.rms_norm_eps, theirs.max_position_embeddings, theirs.num_key_value_heads)
  assert ours.tie_embeddings == theirs.tie_word_embeddings
  assert ours.sliding_window == (getattr(theirs, 'sliding_window', None) or 0)
  attention = model(theirs).model.layers[0].self_attn   # the width transformers builds
  assert ours.resolved_head_dim == attention.head_dim
  assert (ours.qkv_bias, ours.qk_norm) == (attention.q_proj.bias is not None,
                                           hasattr(attention, 'q_norm'))
  assert ours.hf_architecture == name
  if arch == 'mixtral':
    assert (ours.num_experts, ours.experts_per_token) == (theirs.num_local_experts,
                                                          theirs.num_experts_per_tok)
  if arch == 'qwen3_moe':
    assert (ours.num_experts, ours.experts_per_token, ours.router_norm_topk, ours.moe_every,
            ours.moe_mlp_dim) == (theirs.num_experts, theirs.num_experts_per_tok,
                                  theirs.norm_topk_prob, theirs.decoder_sparse_step,
                                  theirs.moe_intermediate_size)


def test_a_mixtral_saved_in_the_fused_layout_is_refused_by_name():
  from model.hf import model_config, params_from_hf   # pylint: disable=import-outside-toplevel
  cfg = model_config({**MIXTRAL, 'vocab_size': 300, 'hidden_size': 64,
                      'intermediate_size': 128, 'num_hidden_layers': 1,
                      'num_attention_heads': 4, 'num_key_value_heads': 2})
  tensors = {'model.embed_tokens.weight': np.zeros((300, 64), np.float32),
             'model.norm.weight': np.ones(64, np.float32),
             'model.layers.0.mlp.experts.gate_up_proj': np.zeros((4, 256, 64), np.float32)}
  with pytest.raises(ValueError, match='experts fused .* not read: save the model in the '
                                       'original layout'):
    params_from_hf(tensors, cfg)
