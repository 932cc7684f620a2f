"""LoRA on a mixture of experts' routed experts (experts_gate, experts_up, experts_down):
base + adapters computes what the merged weights compute, in both dispatches; the
adapters' gradients are the same on one device and on expert-parallel, FSDP and tensor
meshes; --merge and the PEFT export give what transformers (and peft) compute; serving
them per request is refused with one line naming --merge."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import lora, lora_peft, moe
from model.lora import LoraConfig
from serve.load.lora_checkpoint import load_lora_checkpoint
from tests import layout_matrix as lm
from tests.test_layout_matrix import check
from tests.test_lora import random_adapter
from tests.test_model import make_params, tiny_cfg
from tests.test_train import cache_dir, tiny  # pylint: disable=unused-import

EXPERTS = ('experts_gate', 'experts_up', 'experts_down')


def moe_cfg(dispatch: str):
  # Every second layer routed, so the dense layers' gate/up/down adapt beside the experts';
  # capacity 2.0 with 4 experts keeps every token (dropping is tested by test_moe.py).
  return tiny_cfg(num_layers=4, num_experts=4, experts_per_token=2, moe_every=2,
                  moe_mlp_dim=24, moe_dispatch=dispatch, capacity_factor=2.0)


def _logits(cfg, params, tokens, lora_form=None):
  hidden = model.forward(params, tokens, cfg, lora=lora_form)
  return np.asarray(model.logits(params, hidden, cfg))


@pytest.mark.parametrize('dispatch', ['capacity', 'dropless'])
def test_expert_adapters_equal_merged_weights(dispatch):
  cfg = moe_cfg(dispatch)
  # Layer 1 (routed) left out: its expert adapters are scaled by 0.
  lcfg = LoraConfig(rank=3, alpha=5.0, targets=('q', 'gate', *EXPERTS), layers=(0, 3))
  lcfg.validate(cfg)
  params = make_params(cfg)
  adapter = random_adapter(cfg, lcfg)
  assert adapter['moe_layers']['experts_up']['a'].shape == (2, 4, 32, 3)
  assert adapter['moe_layers']['experts_down']['b'].shape == (2, 4, 3, 32)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  with_adapter = _logits(cfg, params, tokens, lora.layer_form(adapter, lcfg, cfg))
  merged = _logits(cfg, lora.merge(params, adapter, lcfg, cfg), tokens)
  only_experts = {'moe_layers': {t: adapter['moe_layers'][t] for t in EXPERTS}}
  experts_alone = _logits(cfg, params, tokens, lora.layer_form(only_experts, lcfg, cfg))
  base = _logits(cfg, params, tokens)
  assert np.abs(experts_alone - base).max() > 1e-2   # the expert adapters change something
  np.testing.assert_allclose(with_adapter, merged, rtol=2e-5, atol=2e-5)


def test_expert_adapters_follow_the_expert_weights_axes():
  axes = lora.logical_axes(moe_cfg('capacity'), LoraConfig(rank=2, targets=EXPERTS))
  assert axes['moe_layers'] == {
      'experts_gate': {'a': ('layers', 'experts', 'embed', None),
                       'b': ('layers', 'experts', None, 'mlp')},
      'experts_up': {'a': ('layers', 'experts', 'embed', None),
                     'b': ('layers', 'experts', None, 'mlp')},
      'experts_down': {'a': ('layers', 'experts', 'mlp', None),
                       'b': ('layers', 'experts', None, 'embed')}}


@pytest.mark.parametrize('bad,match', [
    (dict(targets=('experts_up',)), r"lora.targets \['experts_up'\]: this model has no such"),
    (dict(targets=('experts_gate',), dropout=0.1), 'adapters on experts take no dropout'),
])
def test_bad_expert_targets_are_refused(bad, match):
  cfg = tiny_cfg() if 'dropout' not in bad else moe_cfg('capacity')
  with pytest.raises(ValueError, match=match):
    LoraConfig(rank=2, **bad).validate(cfg)


# Expert adapters (and q, and the dense layers' gate) on meshes that split the experts
# (capacity all-to-all, dropless all-gather), the batch with ZeRO-3, and the tensor axis.
EXPERT_LAYOUTS = [
    lm.Combo((2, 1, 1, 4, 1, 1), zero=1, moe='capacity'),
    lm.Combo((1, 1, 8, 1, 1, 1), zero=3, moe='capacity'),
    lm.Combo((4, 1, 1, 1, 1, 2), zero=0, moe='capacity'),
    lm.Combo((1, 1, 2, 2, 1, 2), zero=3, moe='dropless'),
]
_REFERENCES = {}


def _expert_lora(combo):
  cfg = lm.config(combo)
  cfg.lora = LoraConfig(rank=4, alpha=8.0, targets=('q', 'gate', *EXPERTS), layers=(0, 1, 3))
  return cfg


@pytest.mark.parametrize('combo', EXPERT_LAYOUTS, ids=[c.name for c in EXPERT_LAYOUTS])
def test_expert_adapters_layout_equals_one_device(combo):
  lm.classify([combo])[0] or pytest.fail(f'validate refuses {combo.name}')
  ref = lm.reference(combo)
  if ref not in _REFERENCES:
    _REFERENCES[ref] = lm.loss_and_grads(_expert_lora(ref), jax.devices()[:1])
  want = _REFERENCES[ref]
  got = lm.loss_and_grads(_expert_lora(combo))
  # every leaf (the expert adapters' too) has a gradient to compare
  assert all(np.abs(g).max() > 0 for g in want[1])
  check(f'{combo.name} expert lora', got, want)


# ------------------------------------------------------------------------ export, serving

@pytest.fixture(scope='module')
def expert_workdir(cache_dir, tmp_path_factory):
  """A LoRA run of q and the experts on a random tiny MoE base (every layer routed, 2 of 4
  experts a token), the base written as hf_export writes a run."""
  from model.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from model.hf import hf_config, hf_tensors  # pylint: disable=import-outside-toplevel
  from serve import hf_export  # pylint: disable=import-outside-toplevel
  from training import trainer  # pylint: disable=import-outside-toplevel
  base_cfg = ModelConfig(vocab_size=320, num_layers=2, embed_dim=64, num_heads=4,
                         num_kv_heads=2, head_dim=16, mlp_dim=128, max_seq_len=64,
                         tie_embeddings=False, num_experts=4, experts_per_token=2,
                         moe_mlp_dim=32, init_std=0.1)
  base = str(tmp_path_factory.mktemp('base'))
  hf_export._write(base, hf_config(base_cfg, 'float32', 256),  # pylint: disable=protected-access
                   hf_tensors(model.init_params(base_cfg, jax.random.key(3)), base_cfg),
                   hf_export.byte_tokenizer_json(), '<|endoftext|>', 64, 256)
  cfg = tiny(tmp_path_factory.mktemp('run'), cache_dir, steps=3, init_from_hf=base,
             sample__num_tokens=0, optim__learning_rate=3e-2, optim__warmup_steps=0)
  cfg.model = dataclasses.replace(cfg.model, moe_dispatch='dropless')
  cfg.lora = LoraConfig(rank=4, alpha=8.0, targets=('q', *EXPERTS))
  trainer.train(cfg)
  return cfg.workdir


def test_merge_export_of_expert_adapters_is_what_transformers_computes(expert_workdir,
                                                                       tmp_path):
  torch = pytest.importorskip('torch')   # not in .ci/newer-jax's environment
  transformers = pytest.importorskip('transformers')
  from serve import hf_export  # pylint: disable=import-outside-toplevel
  run = load_lora_checkpoint(expert_workdir)
  cfg, params = run.served.model_cfg, run.served.params
  assert np.abs(run.adapter['moe_layers']['experts_down']['b']).max() > 0   # trained
  ids = np.random.default_rng(0).integers(0, 257, size=(2, 20))
  assert cfg.num_experts == 4 and cfg.moe_dispatch == 'dropless'   # as transformers: no drops
  want = _logits(cfg, params, jnp.asarray(ids, jnp.int32), lora.layer_form(run.adapter,
                                                                           run.lcfg, cfg))
  assert np.abs(want - _logits(cfg, params, jnp.asarray(ids, jnp.int32))).max() > 1e-3
  out = tmp_path / 'merged'
  assert hf_export.main(['--checkpoint', expert_workdir, '--output', str(out), '--merge',
                         '--dtype', 'float32']) == 0
  net = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  assert type(net).__name__ == 'MixtralForCausalLM'
  with torch.no_grad():
    theirs = net.eval()(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(theirs, want, atol=1e-4, rtol=1e-4)


def test_peft_export_of_expert_adapters_loads_in_peft_to_our_logits(expert_workdir,
                                                                     tmp_path):
  """Without --merge: adapters on transformers' fused expert parameters
  (target_parameters, gate and up as one rank-2r adapter) that peft loads onto the base
  to the logits of our base + adapters, every tensor of the file taken."""
  torch = pytest.importorskip('torch')   # not in .ci/newer-jax's environment
  transformers = pytest.importorskip('transformers')
  peft = pytest.importorskip('peft')
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  from serve import hf_export  # pylint: disable=import-outside-toplevel
  run = load_lora_checkpoint(expert_workdir)
  cfg, params = run.served.model_cfg, run.served.params
  ids = np.random.default_rng(1).integers(0, 257, size=(2, 20))
  want = _logits(cfg, params, jnp.asarray(ids, jnp.int32), lora.layer_form(run.adapter,
                                                                           run.lcfg, cfg))
  out = tmp_path / 'peft'
  assert hf_export.main(['--checkpoint', expert_workdir, '--output', str(out)]) == 0
  net = transformers.AutoModelForCausalLM.from_pretrained(run.base_source,
                                                          dtype=torch.float32)
  net = peft.PeftModel.from_pretrained(net, str(out))
  saved = load_file(str(out / lora_peft.WEIGHTS_FILE))
  loaded = {k.replace('.default', ''): v.numpy()
            for k, v in net.state_dict().items() if '.lora_' in k}
  assert sorted(loaded) == sorted(saved)
  for k, v in saved.items():
    np.testing.assert_array_equal(loaded[k], v)
  with torch.no_grad():
    theirs = net.eval()(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(theirs, want, atol=1e-4, rtol=1e-4)
  from serve.load.peft_adapter import read_peft_adapter  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match='hf_export --merge'):   # --lora-modules of it
    read_peft_adapter('experts', str(out), cfg, max_rank=8)


def test_serving_expert_adapters_per_row_is_refused_naming_merge():
  cfg = moe_cfg('dropless')
  lcfg = LoraConfig(rank=2, targets=EXPERTS)
  adapter = random_adapter(cfg, lcfg)
  layer = {'lora': {**adapter['moe_layers'], 'row_slot': jnp.zeros((4,), jnp.int32)}}
  with pytest.raises(ValueError, match='hf_export --merge'):
    moe.lora_adapters(layer)


def test_lora_modules_with_adapters_on_expert_parameters_are_refused_at_load(tmp_path):
  """A PEFT directory adapting experts (target_parameters, as peft writes it for
  transformers' fused expert tensors) is refused by --lora-modules' reader in one line."""
  import json  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  from serve.load.peft_adapter import read_peft_adapter  # pylint: disable=import-outside-toplevel
  config = {**lora_peft.peft_config(LoraConfig(rank=2, targets=('q',)), moe_cfg('dropless')),
            'target_modules': [], 'target_parameters': ['mlp.experts.gate_up_proj']}
  (tmp_path / lora_peft.CONFIG_FILE).write_text(json.dumps(config))
  key = 'base_model.model.model.layers.0.mlp.experts.lora_A.weight'
  save_file({key: np.zeros((8, 32), np.float32)}, str(tmp_path / lora_peft.WEIGHTS_FILE))
  with pytest.raises(ValueError, match=r'^[^\n]*target_parameters.*hf_export --merge[^\n]*$'):
    read_peft_adapter('ex', str(tmp_path), moe_cfg('dropless'), max_rank=8)
