"""A LoRA run on a Hugging Face base, exported by `python -m serve.hf_export`: the PEFT
directory loads in peft onto transformers' Llama, and the --merge directory in
transformers alone, both to the logits our base + adapters compute. A random tiny Llama
built with transformers; nothing downloaded."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import lora, lora_peft
from model.lora import LoraConfig
from serve import hf_export
from serve.load.lora_checkpoint import load_lora_checkpoint
from tests.test_train import cache_dir, tiny  # pylint: disable=unused-import
from sharding.mesh import MeshConfig, make_mesh
from sharding.rules import make_plan
from training import state, trainer

torch = pytest.importorskip('torch')   # not in .ci/newer-jax's environment
transformers = pytest.importorskip('transformers')
peft = pytest.importorskip('peft')

LORA = LoraConfig(rank=4, alpha=8.0, targets=('q', 'k', 'v', 'o', 'gate', 'up', 'down'),
                  layers=(1,))
IDS = np.random.default_rng(0).integers(0, 257, size=(2, 20))


@pytest.fixture(scope='module')
def hf_base(tmp_path_factory):
  """A random tiny Llama with the byte tokenizer, as init_from_hf reads it."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False, initializer_range=0.1)
  path = tmp_path_factory.mktemp('base')
  transformers.LlamaForCausalLM(config).save_pretrained(str(path))
  (path / 'tokenizer.json').write_text(hf_export.byte_tokenizer_json())
  return str(path)


@pytest.fixture(scope='module')
def lora_workdir(hf_base, cache_dir, tmp_path_factory):
  cfg = tiny(tmp_path_factory.mktemp('run'), cache_dir, steps=3, init_from_hf=hf_base,
             sample__num_tokens=0, optim__learning_rate=3e-2, optim__warmup_steps=0)
  cfg.lora = LORA
  trainer.train(cfg)
  return cfg.workdir


def transformers_logits(directory, adapter=None):
  net = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
  if adapter:
    net = peft.PeftModel.from_pretrained(net, adapter)
  with torch.no_grad():
    return net.eval()(torch.tensor(IDS)).logits.numpy()


def ours(run):
  cfg, params = run.served.model_cfg, run.served.params
  hidden = model.forward(params, jnp.asarray(IDS, jnp.int32), cfg,
                         lora=lora.layer_form(run.adapter, run.lcfg, cfg))
  return np.asarray(model.logits(params, hidden, cfg))


def test_peft_export_and_merge_give_our_logits(lora_workdir, hf_base, tmp_path):
  run = load_lora_checkpoint(lora_workdir)
  assert run.lcfg == LORA and run.base_source == hf_base
  want = ours(run)
  assert np.abs(want - transformers_logits(hf_base)).max() > 1e-3   # the adapters trained
  assert hf_export.main(['--checkpoint', lora_workdir, '--output', str(tmp_path / 'peft')]) == 0
  assert sorted(os.listdir(tmp_path / 'peft')) == [lora_peft.CONFIG_FILE,
                                                   lora_peft.WEIGHTS_FILE]
  adapter_cfg = json.loads((tmp_path / 'peft' / lora_peft.CONFIG_FILE).read_text())
  assert adapter_cfg['base_model_name_or_path'] == hf_base
  assert adapter_cfg['layers_to_transform'] == [1]
  np.testing.assert_allclose(transformers_logits(hf_base, str(tmp_path / 'peft')), want,
                             rtol=1e-5, atol=2e-5)
  back, back_cfg = lora_peft.read_peft_adapter(str(tmp_path / 'peft'), run.served.model_cfg)
  assert back_cfg == LORA
  np.testing.assert_array_equal(back['layers']['q']['b'],
                                np.asarray(run.adapter['layers']['q']['b']))
  assert hf_export.main(['--checkpoint', lora_workdir, '--output', str(tmp_path / 'merged'),
                         '--merge']) == 0
  np.testing.assert_allclose(transformers_logits(str(tmp_path / 'merged')), want,
                             rtol=1e-5, atol=2e-5)


def test_merge_of_a_full_model_run_is_refused(tiny_workdir, tmp_path, capsys):
  assert hf_export.main(['--checkpoint', tiny_workdir, '--output', str(tmp_path / 'x'),
                         '--merge']) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: --merge: ') and 'is a full-model run' in err
  assert '\n' not in err


def test_export_onto_a_changed_base_is_refused(lora_workdir, hf_base, tmp_path, capsys):
  changed = tmp_path / 'changed'
  changed.mkdir()
  for name in os.listdir(hf_base):
    shutil.copy(os.path.join(hf_base, name), changed / name)
  net = transformers.LlamaForCausalLM.from_pretrained(str(changed), dtype=torch.float32)
  with torch.no_grad():   # (a uniform shift of a whole tensor can cancel in the checksum)
    net.model.layers[0].mlp.down_proj.weight[0, 0] += 0.25
  net.save_pretrained(str(changed))
  workdir = tmp_path / 'run'
  shutil.copytree(lora_workdir, workdir)
  config = json.loads((workdir / 'config.json').read_text())
  (workdir / 'config.json').write_text(json.dumps({**config, 'init_from_hf': str(changed)}))
  capsys.readouterr()
  assert hf_export.main(['--checkpoint', str(workdir), '--output', str(tmp_path / 'x')]) == 2
  err = capsys.readouterr().err.strip()
  assert 'were trained on a base of checksum' in err and '\n' not in err


def test_serving_a_lora_workdir_directly_says_how_to_serve_it(lora_workdir):
  """Its checkpoints hold the adapters only: load_checkpoint (python -m serve
  --checkpoint, serve.generate) refuses it in one line naming both ways to serve it,
  instead of failing to restore a full model from them."""
  from serve.load.checkpoint import load_checkpoint  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=r'is a LoRA run: .*--merge.*--lora-modules'):
    load_checkpoint(lora_workdir)


def test_a_lora_run_on_the_seeds_random_base_exports(cache_dir, tmp_path):
  """No init_from_hf: the base is the seed's random weights, rebuilt at export exactly
  as training drew them, and the --merge export computes what base + adapters compute."""
  cfg = tiny(tmp_path / 'run', cache_dir, steps=2, sample__num_tokens=0,
             optim__learning_rate=3e-2, optim__warmup_steps=0)
  cfg.lora = LORA
  trainer.train(cfg)
  run = load_lora_checkpoint(cfg.workdir)
  plan = make_plan(make_mesh(MeshConfig(data=1), jax.devices()[:1]), 0)
  want_base = state.frozen_base(cfg, plan)   # what the run trained on
  for got, want in zip(jax.tree.leaves(run.served.params), jax.tree.leaves(want_base)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert hf_export.main(['--checkpoint', cfg.workdir, '--output', str(tmp_path / 'merged'),
                         '--merge']) == 0
  np.testing.assert_allclose(transformers_logits(str(tmp_path / 'merged')), ours(run),
                             rtol=1e-5, atol=2e-5)
