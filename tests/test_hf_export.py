"""serve/hf_export.py: a train.py run as a Hugging Face Llama directory, checked against
transformers' own Llama (the independent implementation) and read back by serve."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import model
from model.config import ModelConfig
from model.hf import hf_config
from serve import hf_export
from serve.load.checkpoint import load_checkpoint
from serve.load.hf_model import load_hf_model
from training.tokenizer import ByteTokenizer

TEXTS = ['def main(x):\n  return x + 1', 'héllo wörld 世界 🎉', '']


def our_logits(params, cfg, ids):
  hidden = model.forward(params, jnp.asarray(ids), cfg)
  return np.asarray(model.logits(params, hidden, cfg), np.float32)


@pytest.fixture(scope='module')
def exported(tiny_workdir, tmp_path_factory):
  out = tmp_path_factory.mktemp('hf') / 'tiny-hf'
  assert hf_export.main(['--checkpoint', tiny_workdir, '--output', str(out)]) == 0
  return str(out)


def test_transformers_computes_the_same_logits_and_tokens(exported, tiny_workdir):
  """transformers' LlamaForCausalLM on the exported directory gives the training
  forward's logits (float32), and its tokenizer the byte tokenizer's ids and eos."""
  torch = pytest.importorskip('torch')   # not in .ci/newer-jax's environment
  transformers = pytest.importorskip('transformers')
  hf = transformers.LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32)
  served = load_checkpoint(tiny_workdir, dtype='float32')
  ids = np.random.default_rng(0).integers(0, 256, size=(2, 40)).astype(np.int32)
  with torch.no_grad():
    theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, our_logits(served.params, served.model_cfg, ids),
                             atol=2e-5, rtol=1e-5)
  tok, byte = transformers.AutoTokenizer.from_pretrained(exported), ByteTokenizer()
  for text in TEXTS:
    ids = tok(text, add_special_tokens=False)['input_ids']
    assert ids == byte.encode(text).tolist() and tok.decode(ids) == text
  assert tok.eos_token_id == byte.eos_id == hf.config.eos_token_id
  generation = json.load(open(os.path.join(exported, 'generation_config.json')))
  assert generation['eos_token_id'] == byte.eos_id


def test_serve_reads_the_export_back_exactly(exported, tiny_workdir, tmp_path):
  """load_hf_model on the export gives the checkpoint's weights bit for bit; a bfloat16
  export holds their bfloat16 rounding; the files are readable by others."""
  want = load_checkpoint(tiny_workdir, dtype='float32')
  back = load_hf_model(exported, dtype='float32')
  assert back.model_cfg.num_layers == want.model_cfg.num_layers
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               back.params, want.params)
  assert back.eos_token_ids == [ByteTokenizer.eos_id]
  umask = os.umask(0)
  os.umask(umask)
  assert {os.stat(os.path.join(exported, f)).st_mode & 0o777
          for f in os.listdir(exported)} == {0o666 & ~umask}   # as open() would make them
  half = tmp_path / 'bf16'
  assert hf_export.main(['--checkpoint', tiny_workdir, '--output', str(half),
                         '--dtype', 'bfloat16']) == 0
  assert json.load(open(half / 'config.json'))['torch_dtype'] == 'bfloat16'
  rounded = load_hf_model(str(half), dtype='bfloat16')
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(
      np.asarray(a), np.asarray(b).astype(ml_dtypes.bfloat16)), rounded.params, want.params)


def test_a_sharded_export_is_read_by_transformers_and_serve(exported, tiny_workdir,
                                                           tmp_path, capsys):
  """Past --max-shard-size the weights go into model-0000k-of-0000n.safetensors files
  with an index, as transformers writes them: transformers and serve read the same
  weights as from the one-file export, and no file is over the size but a tensor larger
  than it, alone. A size that cannot be read is refused before anything is written."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  one = load_file(os.path.join(exported, 'model.safetensors'))
  limit = sorted(v.nbytes for v in one.values())[-3]   # the third largest: some alone
  out = tmp_path / 'sharded'
  assert hf_export.main(['--checkpoint', tiny_workdir, '--output', str(out),
                         '--max-shard-size', str(limit)]) == 0
  index = json.load(open(out / 'model.safetensors.index.json'))
  files = sorted(f for f in os.listdir(out) if f.endswith('.safetensors'))
  assert len(files) >= 3 and 'model.safetensors' not in files
  assert files == [f'model-{k:05d}-of-{len(files):05d}.safetensors'
                   for k in range(1, len(files) + 1)]
  assert sorted(index['weight_map']) == sorted(one)
  assert index['metadata']['total_size'] == sum(v.nbytes for v in one.values())
  for f in files:
    shard = load_file(out / f)
    assert sorted(shard) == sorted(k for k, v in index['weight_map'].items() if v == f)
    assert sum(v.nbytes for v in shard.values()) <= limit or len(shard) == 1
    for name, value in shard.items():
      np.testing.assert_array_equal(value, one[name])
  back, want = load_hf_model(str(out), dtype='float32'), load_hf_model(exported,
                                                                      dtype='float32')
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               back.params, want.params)
  torch = pytest.importorskip('torch')   # not in .ci/newer-jax's environment
  transformers = pytest.importorskip('transformers')
  hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  ids = np.random.default_rng(2).integers(0, 256, size=(1, 24)).astype(np.int32)
  with torch.no_grad():
    theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, our_logits(want.params, want.model_cfg, ids),
                             atol=2e-5, rtol=1e-5)
  capsys.readouterr()
  assert hf_export.main(['--checkpoint', tiny_workdir, '--output', str(tmp_path / 'bad'),
                         '--max-shard-size', '5G']) == 2
  assert "--max-shard-size '5G': give a positive size" in capsys.readouterr().err
  assert not (tmp_path / 'bad').exists()


def test_what_cannot_be_exported_is_refused_and_nothing_is_left(tiny_workdir, tmp_path,
                                                                 monkeypatch, capsys):
  busy = tmp_path / 'busy'
  busy.mkdir()
  (busy / 'keep.txt').write_text('mine')
  assert hf_export.main(['--checkpoint', tiny_workdir, '--output', str(busy)]) == 2
  assert 'is not an empty directory' in capsys.readouterr().err
  assert os.listdir(busy) == ['keep.txt']
  assert hf_export.main(['--checkpoint', str(tmp_path / 'nope'), '--output',
                         str(tmp_path / 'x')]) == 2
  assert 'takes the workdir of a train.py run' in capsys.readouterr().err
  # Mixtures of experts Mixtral cannot express, each refused by its field.
  for field, value in (('moe_every', 2), ('num_shared_experts', 1), ('router', 'sigmoid'),
                       ('experts_per_token', 1)):
    moe = ModelConfig(num_layers=2, num_experts=4, **{field: value})
    with pytest.raises(ValueError, match=f'model.{field}={value!r}: .* no Mixtral'):
      hf_config(moe, 'float32', 0)
  # Dense models no architecture (or not the one named) computes.
  for fields, message in (
      ({'qkv_bias': True, 'qk_norm': True}, 'model.qk_norm=True: Qwen2ForCausalLM has '
       'qk_norm=False; this model has no Qwen2ForCausalLM form'),
      ({'qkv_bias': True, 'hf_architecture': 'MistralForCausalLM'},
       'model.qkv_bias=True: MistralForCausalLM has qkv_bias=False'),
      ({'num_experts': 4, 'hf_architecture': 'Qwen3ForCausalLM'},
       'model.qk_norm=False: Qwen3ForCausalLM has qk_norm=True'),
      ({'sliding_window': 8, 'hf_architecture': 'LlamaForCausalLM'},
       'model.sliding_window=8: LlamaForCausalLM has no sliding window'),
      ({'hf_architecture': 'GPT2LMHeadModel'},
       "model.hf_architecture='GPT2LMHeadModel' is not one meshlm writes"),
      ({'num_experts': 4, 'router_norm_topk': False}, 'model.router_norm_topk=False: '
       'Mixtral renormalizes .* no Mixtral'),
      ({'num_experts': 4, 'qk_norm': True, 'num_shared_experts': 1},
       'model.num_shared_experts=1: Qwen3-MoE has none; .* no Qwen3-MoE '
       r'\(Qwen3MoeForCausalLM\)'),
      ({'num_experts': 4, 'qk_norm': True, 'router': 'sigmoid'},
       "model.router='sigmoid': Qwen3-MoE's is softmax")):
    with pytest.raises(ValueError, match=message):
      hf_config(ModelConfig(num_layers=2, **fields), 'float32', 0)

  def fail(directory, *args):
    open(os.path.join(directory, 'config.json'), 'w').close()
    raise OSError('disk full')
  monkeypatch.setattr(hf_export, '_write', fail)
  with pytest.raises(OSError, match='disk full'):
    hf_export.export(tiny_workdir, str(tmp_path / 'half'))
  assert sorted(os.listdir(tmp_path)) == ['busy']   # neither the output nor its staging


def test_a_runs_own_tokenizer_json_goes_as_it_is(tmp_path):
  from tests.test_serve_detokenizer import make_tokenizer  # pylint: disable=import-outside-toplevel
  tok = make_tokenizer(tmp_path, 'bytelevel')
  text, eos = hf_export.tokenizer_files(tok)
  assert text == open(tok.path, encoding='utf-8').read() and eos == '<|endoftext|>'


def same_in_transformers(directory, cfg, params, architecture: str) -> None:
  """Writes params as export writes them, loads the directory with transformers'
  `architecture` class and compares its logits with the training forward's."""
  torch = pytest.importorskip('torch')   # not in .ci/newer-jax's environment
  transformers = pytest.importorskip('transformers')
  from model.hf import hf_tensors  # pylint: disable=import-outside-toplevel
  config = hf_config(cfg, 'float32', 299)
  assert config['architectures'] == [architecture]
  hf_export._write(directory, config, hf_tensors(params, cfg),  # pylint: disable=protected-access
                   hf_export.byte_tokenizer_json(), '<|endoftext|>', cfg.max_seq_len, 299)
  hf = getattr(transformers, architecture).from_pretrained(directory, dtype=torch.float32)
  ids = np.random.default_rng(1).integers(0, 300, size=(2, 96)).astype(np.int32)
  with torch.no_grad():
    theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, our_logits(params, cfg, ids), atol=1e-4, rtol=1e-4)


MOE = ModelConfig(vocab_size=300, num_layers=2, embed_dim=48, num_heads=6, num_kv_heads=2,
                  head_dim=12, mlp_dim=80, max_seq_len=128, tie_embeddings=False,
                  num_experts=4, experts_per_token=2, moe_dispatch='dropless', init_std=0.2)


def test_a_mixture_of_experts_is_the_same_in_transformers_mixtral(tmp_path):
  """A random MoE model (every layer routed, 2 of 4 experts a token, dropless) written as
  export writes it: transformers' MixtralForCausalLM computes its logits, serve reads it
  back bit for bit, and init_from_hf starts a run of the same architecture from it."""
  from training import pretrained  # pylint: disable=import-outside-toplevel
  from training.config import Config  # pylint: disable=import-outside-toplevel
  params = model.init_params(MOE, jax.random.key(4))
  same_in_transformers(str(tmp_path), MOE, params, 'MixtralForCausalLM')

  served = load_hf_model(str(tmp_path))
  assert served.model_cfg.num_experts == 4 and served.model_cfg.experts_per_token == 2
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(served.params),
               jax.device_get(params))

  cfg = Config()
  cfg.init_from_hf = str(tmp_path)
  cfg, changed = pretrained.with_pretrained(cfg)
  assert 'model.num_experts=4' in changed and cfg.model.moe_dispatch == 'capacity'   # the run's
  jax.tree.map(np.testing.assert_array_equal, pretrained.load_params(cfg),
               jax.device_get(params))


def test_an_untied_rope_scaled_model_is_the_same_in_transformers(tmp_path):
  """The mapping beyond the tiny run: a separate lm_head, Llama-3 RoPE scaling, head_dim
  not embed / heads, GQA 3:1; random weights written as export writes them."""
  cfg = ModelConfig(vocab_size=300, num_layers=2, embed_dim=48, num_heads=6, num_kv_heads=2,
                    head_dim=12, mlp_dim=80, max_seq_len=128, tie_embeddings=False,
                    rope_theta=5e5, rope_scaling_factor=8.0, rope_original_max_len=32,
                    init_std=0.2)
  same_in_transformers(str(tmp_path), cfg, model.init_params(cfg, jax.random.key(3)),
                       'LlamaForCausalLM')
