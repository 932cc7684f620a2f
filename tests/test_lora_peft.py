"""PEFT adapter directories (model/lora_peft.py) against peft itself on transformers'
Llama: ours load in peft to our logits, peft's load in ours to peft's logits. A random
tiny Llama built with transformers; nothing downloaded."""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import hf, lora, lora_peft
from model.lora import LoraConfig
from tests.test_lora import random_adapter

torch = pytest.importorskip('torch')   # not in .ci/newer-jax's environment
transformers = pytest.importorskip('transformers')
peft = pytest.importorskip('peft')


@pytest.fixture(scope='module')
def hf_llama(tmp_path_factory):
  """(directory, transformers model, our config, our params) of a random tiny Llama."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False, initializer_range=0.2)
  net = transformers.LlamaForCausalLM(config).eval()
  path = str(tmp_path_factory.mktemp('llama'))
  net.save_pretrained(path)
  with open(os.path.join(path, 'config.json')) as f:
    cfg = hf.model_config(json.load(f))
  params = hf.params_from_hf(hf.read_safetensors(path), cfg)
  return path, cfg, params


IDS = np.random.default_rng(0).integers(0, 97, size=(2, 12))


def ours(cfg, params, lora_form=None):
  hidden = model.forward(params, jnp.asarray(IDS, jnp.int32), cfg, lora=lora_form)
  return np.asarray(model.logits(params, hidden, cfg))


def peft_logits(base_path, adapter_dir):
  net = transformers.LlamaForCausalLM.from_pretrained(base_path, dtype=torch.float32)
  net = peft.PeftModel.from_pretrained(net, adapter_dir).eval()
  with torch.no_grad():
    return net(torch.tensor(IDS)).logits.numpy()


@pytest.mark.parametrize('lcfg', [
    LoraConfig(rank=4, alpha=8.0, targets=tuple(lora.TARGETS)),
    LoraConfig(rank=2, alpha=3.0, targets=('k', 'o', 'up'), layers=(0, 2), rslora=True),
])
def test_our_adapter_loads_in_peft_to_the_same_logits(hf_llama, tmp_path, lcfg):
  path, cfg, params = hf_llama
  adapter = random_adapter(cfg, lcfg, std=0.2)
  if lcfg.layers:   # what training leaves at unadapted layers: the initial zeros
    keep = np.isin(np.arange(cfg.num_layers), lcfg.layers)[:, None, None]
    adapter = {s: {t: {k: w * keep for k, w in ab.items()} for t, ab in tg.items()}
               for s, tg in adapter.items()}
  lora_peft.write_peft_adapter(str(tmp_path), adapter, lcfg, cfg, base_model=path)
  mine = ours(cfg, params, lora.layer_form(adapter, lcfg, cfg))
  assert np.abs(mine - ours(cfg, params)).max() > 1e-2
  np.testing.assert_allclose(peft_logits(path, str(tmp_path)), mine, rtol=1e-5, atol=2e-5)
  back, back_cfg = lora_peft.read_peft_adapter(str(tmp_path), cfg)
  assert back_cfg == lcfg
  for s in adapter:
    for t in adapter[s]:
      for k in ('a', 'b'):
        np.testing.assert_array_equal(back[s][t][k], np.asarray(adapter[s][t][k]))


def test_peft_trained_adapter_loads_to_peft_logits(hf_llama, tmp_path):
  path, cfg, params = hf_llama
  net = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
  config = peft.LoraConfig(r=3, lora_alpha=7, target_modules=['q_proj', 'v_proj', 'down_proj'],
                           layers_to_transform=[1], task_type='CAUSAL_LM')
  net = peft.get_peft_model(net, config)
  torch.manual_seed(1)
  with torch.no_grad():
    for name, p in net.named_parameters():
      if 'lora_B' in name:
        p.normal_(0, 0.3)
  net.save_pretrained(str(tmp_path))
  adapter, lcfg = lora_peft.read_peft_adapter(str(tmp_path), cfg)
  assert (lcfg.rank, lcfg.alpha, lcfg.targets, lcfg.layers) == (3, 7.0, ('q', 'v', 'down'),
                                                                (1,))
  np.testing.assert_allclose(ours(cfg, params, lora.layer_form(adapter, lcfg, cfg)),
                             peft_logits(path, str(tmp_path)), rtol=1e-5, atol=2e-5)


def _written(tmp_path, cfg, lcfg, **config_changes):
  lora_peft.write_peft_adapter(str(tmp_path), random_adapter(cfg, lcfg), lcfg, cfg)
  cfg_path = tmp_path / lora_peft.CONFIG_FILE
  hf_cfg = json.loads(cfg_path.read_text())
  cfg_path.write_text(json.dumps({**hf_cfg, **config_changes}))
  return str(tmp_path)


@pytest.mark.parametrize('changes,message', [
    ({'use_dora': True}, 'sets use_dora=True, which meshlm adapters cannot compute'),
    ({'rank_pattern': {'q_proj': 8}}, 'sets rank_pattern='),
    ({'peft_type': 'IA3'}, "peft_type 'IA3'; only LORA adapters load"),
])
def test_unsupported_peft_config_is_refused(hf_llama, tmp_path, changes, message):
  _, cfg, _ = hf_llama
  directory = _written(tmp_path, cfg, LoraConfig(rank=2, targets=('q',)), **changes)
  with pytest.raises(ValueError, match=message) as err:
    lora_peft.read_peft_adapter(directory, cfg)
  assert '\n' not in str(err.value)


def test_adapter_of_another_base_is_refused(hf_llama, tmp_path):
  _, cfg, _ = hf_llama
  wider = dataclasses.replace(cfg, embed_dim=48, head_dim=8)
  directory = _written(tmp_path, wider, LoraConfig(rank=2, targets=('q',)))
  with pytest.raises(ValueError, match=r'layer 0 self_attn.q_proj.lora_A has shape \(2, 48\), '
                     r'this base needs \(2, 32\).*trained on another model'):
    lora_peft.read_peft_adapter(directory, cfg)
  deeper = dataclasses.replace(cfg, num_layers=5)
  directory = _written(tmp_path / 'deep', deeper, LoraConfig(rank=2, targets=('q',)))
  with pytest.raises(ValueError, match=r'does not fit this base model: lora.layers='):
    lora_peft.read_peft_adapter(directory, cfg)


def test_not_an_adapter_directory(tmp_path):
  with pytest.raises(ValueError, match='not a PEFT adapter directory'):
    lora_peft.read_peft_adapter(str(tmp_path), None)
