"""A meshlm checkpoint as a LoRA run's frozen base (lora.base_checkpoint), and that run's
workdir served as an adapter with no conversion (--lora-modules NAME=WORKDIR): the base
is the checkpoint's parameters bitwise, a request on the adapter equals the same request
on the merged weights, and a base of another shape, two bases, or an adapter on another
base are each refused in one line."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import lora
from model.lora import LoraConfig
from serve.config import ServeConfig
from serve.engine.core import Engine
from serve.load.checkpoint import load_checkpoint
from serve.load.lora_checkpoint import load_lora_checkpoint
from serve.load.lora_workdir import BaseIdentity
from serve.sampling_params import SamplingParams
from tests.test_train import cache_dir, tiny  # pylint: disable=unused-import
from training import checkpoint, lora_run, trainer
from training.trainer import ConfigError

LORA = LoraConfig(rank=4, alpha=8.0, targets=('q', 'k', 'v', 'o', 'gate', 'up', 'down'))
PROMPT = list(b'def main(argv):\n    ')
TOP = 20   # log-probabilities compared per step: the head of each distribution
ENGINE = dict(num_blocks=32, block_size=8, max_num_seqs=4, max_num_batched_tokens=64)


def lora_cfg(workdir, cache_dir, base, steps=3, **overrides):
  cfg = tiny(workdir, cache_dir, steps=steps, sample__num_tokens=0, optim__warmup_steps=0,
             optim__learning_rate=3e-2, **{'checkpoint__every_steps': steps, **overrides})
  cfg.lora = dataclasses.replace(LORA, base_checkpoint=base)
  return cfg


@pytest.fixture(scope='module')
def lora_workdir(tiny_workdir, cache_dir, tmp_path_factory):
  """A LoRA run of 3 steps on the shared tiny model's newest checkpoint."""
  cfg = lora_cfg(tmp_path_factory.mktemp('lora') / 'run', cache_dir, tiny_workdir)
  trainer.train(cfg)
  return cfg.workdir


def test_the_frozen_base_is_the_checkpoints_params_bitwise(tiny_workdir, lora_workdir,
                                                            cache_dir):
  cfg = lora_cfg(lora_workdir, cache_dir, tiny_workdir)
  meta = checkpoint.latest_meta(f'{lora_workdir}/checkpoints')
  step = checkpoint.latest_meta(f'{tiny_workdir}/checkpoints')['step']
  assert meta['lora_base']['source'] == f'base_checkpoint={tiny_workdir}:{step}'
  base, identity = lora_run.load_base(cfg, trainer.build_plan(cfg))
  assert identity == meta['lora_base']   # what the run froze is what a restart loads
  served = load_checkpoint(tiny_workdir).params   # the serving loader: another path
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(base), jax.device_get(served))


def greedy(engine, lora_name=None):
  """Greedy tokens, and per step the top TOP (token ids [n, TOP], log-probabilities)."""
  params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=TOP, ignore_eos=True)
  res = engine.add_request(PROMPT, params, lora=lora_name).result()
  assert res.error is None, res.error
  top = np.array([[pair for pair in lp.top] for lp in res.logprobs])   # [n, TOP, 2]
  return res.token_ids, top[..., 0].astype(int), top[..., 1]


def merged_logprobs(run, tokens):
  """Teacher-forced on the served tokens, one forward of the merged weights: each
  position's log-probabilities over the tokenizer's ids (float32)."""
  cfg = run.served.model_cfg
  params = lora.merge(run.served.params, run.adapter, run.lcfg, cfg)
  ids = jnp.asarray([PROMPT + tokens[:-1]], jnp.int32)
  logits = model.logits(params, model.forward(params, ids, cfg), cfg)[0, len(PROMPT) - 1:]
  vocab = run.served.tokenizer.vocab_size
  return np.asarray(jax.nn.log_softmax(logits[:, :vocab].astype(jnp.float32)))


def test_the_workdir_served_as_adapter_equals_the_merged_weights(tiny_workdir, lora_workdir):
  with Engine(load_checkpoint(tiny_workdir),
              ServeConfig(**ENGINE, enable_lora=True, max_lora_rank=4,
                          lora_modules=(f'mine={lora_workdir}',))) as eng:
    tokens, ids, logps = greedy(eng, 'mine')
    _, base_ids, base_logps = greedy(eng)
  # the base hf_export --merge reads, with the adapters merged into it
  want = merged_logprobs(load_lora_checkpoint(lora_workdir), tokens)
  assert tokens == list(want.argmax(-1))
  rows = np.arange(len(tokens))[:, None]
  np.testing.assert_allclose(logps, want[rows, ids], rtol=0, atol=1e-5)
  # the adapter trained: it moves what the base alone gives
  assert np.abs(want[rows, base_ids] - base_logps).max() > 1e-2


def test_a_base_of_another_model_is_refused_in_one_line(tiny_workdir, cache_dir, tmp_path):
  cfg = lora_cfg(tmp_path, cache_dir, tiny_workdir, steps=1, model__mlp_dim=64,
                 model__rope_theta=500.0)
  with pytest.raises(ConfigError, match=r"is a model with mlp_dim=0 \(this run: 64\), "
                     r"rope_theta=10000.0 \(this run: 500.0\): set those model fields") as e:
    trainer.train(cfg)
  assert '\n' not in str(e.value)


def test_two_bases_are_refused_in_one_line(tiny_workdir, cache_dir, tmp_path):
  cfg = lora_cfg(tmp_path, cache_dir, tiny_workdir, steps=1, init_from_hf=str(tmp_path))
  with pytest.raises(ConfigError, match=r'init_from_hf=.* and lora.base_checkpoint=.* both '
                     'name the base: keep one') as e:
    trainer.train(cfg)
  assert '\n' not in str(e.value)


def test_an_adapter_on_another_base_is_refused_in_one_line(tiny_workdir, lora_workdir):
  """The same shapes, other weights: only the recorded checksum tells them apart."""
  served = load_checkpoint(tiny_workdir)
  other = dataclasses.replace(served, params=jax.tree.map(lambda w: w * 1.5, served.params))
  with pytest.raises(ValueError, match=r"LoRA adapter 'mine' .*: trained on another base "
                     r'\(base_checkpoint=.*; the served weights\' is \w+\): serve it on '
                     'its own base') as e:
    Engine(other, ServeConfig(**ENGINE, enable_lora=True, max_lora_rank=4,
                              lora_modules=(f'mine={lora_workdir}',)))
  assert '\n' not in str(e.value)


def test_serving_the_lora_workdir_itself_names_its_base(tiny_workdir, lora_workdir):
  """--checkpoint of a LoRA workdir (adapters only) says which command serves it."""
  with pytest.raises(ValueError, match=rf'serve its base \(--checkpoint {tiny_workdir}\) with '
                     rf'--enable-lora --lora-modules NAME={lora_workdir}\.$'):
    load_checkpoint(lora_workdir)


# ---------------------------------------- the base of the step restored, not the newest

@pytest.fixture(scope='module')
def moved_base(cache_dir, tmp_path_factory):
  """(base run, LoRA run): the LoRA run of 2 steps (a checkpoint each) on the base run's
  newest step, 2, named with no step; the base run has since trained on to step 3."""
  root = tmp_path_factory.mktemp('moved')
  base = tiny(root / 'base', cache_dir, steps=2, sample__num_tokens=0,
              checkpoint__every_steps=1, checkpoint__keep=5)
  trainer.train(base)
  run = lora_cfg(root / 'lora', cache_dir, base.workdir, steps=2, checkpoint__every_steps=1,
                 checkpoint__keep=5)
  trainer.train(run)
  base.steps = 3
  trainer.train(base)
  return base.workdir, run.workdir


def base_params(workdir, step):
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                        model.abstract_params(load_checkpoint(workdir).model_cfg))
  return checkpoint.restore_params(f'{workdir}/checkpoints', target, step)[0]


def damaged_copy(lora_dir, tmp_path):
  """A copy of the LoRA run whose newest checkpoint's meta is gone (step 1 restores)."""
  copy = tmp_path / 'lora'
  shutil.copytree(lora_dir, copy)
  shutil.rmtree(copy / 'checkpoints' / '2' / 'meta')
  assert checkpoint.latest_meta(str(copy / 'checkpoints')) is None
  return copy


def test_a_resume_reads_the_base_at_the_step_the_adapters_recorded(moved_base, cache_dir,
                                                                   tmp_path):
  base_dir, lora_dir = moved_base
  shutil.copytree(lora_dir, tmp_path / 'lora')
  cfg = lora_cfg(tmp_path / 'lora', cache_dir, base_dir, steps=3, checkpoint__every_steps=1)
  trainer.train(cfg)
  meta = checkpoint.latest_meta(str(tmp_path / 'lora' / 'checkpoints'))
  assert meta['step'] == 3 and meta['lora_base']['source'] == f'base_checkpoint={base_dir}:2'


def test_a_resume_past_a_damaged_newest_meta_reads_the_restored_steps_base(
    moved_base, cache_dir, tmp_path):
  """No :STEP and the newest meta unreadable: the base is read at the step the restored
  (older) adapters recorded (2), not the base run's newest (3), and the run goes on."""
  base_dir, lora_dir = moved_base
  copy = damaged_copy(lora_dir, tmp_path)
  cfg = lora_cfg(copy, cache_dir, base_dir, steps=3, checkpoint__every_steps=1)
  trainer.train(cfg)
  meta = checkpoint.latest_meta(str(copy / 'checkpoints'))
  assert meta['step'] == 3 and meta['lora_base']['source'] == f'base_checkpoint={base_dir}:2'


def test_a_resume_checks_the_base_of_the_step_it_restores(moved_base, cache_dir, tmp_path):
  """The newest step's meta does not read, the older one's records another base: the
  resume is refused, not run on adapters of another base."""
  base_dir, lora_dir = moved_base
  copy = damaged_copy(lora_dir, tmp_path)
  path = copy / 'checkpoints' / '1' / 'meta' / 'metadata'
  meta = json.loads(path.read_text())
  meta['lora_base']['checksum'] = '0' * 16
  path.write_text(json.dumps(meta))
  cfg = lora_cfg(copy, cache_dir, f'{base_dir}:2', steps=3, checkpoint__every_steps=1)
  with pytest.raises(ConfigError, match='were trained on another base'):
    trainer.train(cfg)


def test_a_damaged_newest_meta_does_not_skip_the_base_check(moved_base, tmp_path):
  """Served and exported from the older step restored: checked against its meta, on the
  base step it recorded (2, not the base run's newest, 3)."""
  base_dir, lora_dir = moved_base
  copy = damaged_copy(lora_dir, tmp_path)
  served = load_checkpoint(base_dir)   # step 3: not the adapters' base
  with pytest.raises(ValueError, match=r'step 1: trained on another base'):
    Engine(served, ServeConfig(**ENGINE, enable_lora=True, max_lora_rank=4,
                               lora_modules=(f'mine={copy}',)))
  run = load_lora_checkpoint(str(copy))
  recorded = base_params(base_dir, 2)
  for got, want in zip(jax.tree.leaves(run.served.params), jax.tree.leaves(recorded)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_lora_workdir_with_no_intact_adapters_is_refused_in_one_line(tiny_workdir,
                                                                       lora_workdir, tmp_path):
  """No checkpoint yet, or every step damaged: ValueError (a 400 over HTTP, not a 500)
  naming the adapter and its directory; nothing is loaded."""
  empty, damaged = tmp_path / 'empty', tmp_path / 'damaged'
  empty.mkdir()
  shutil.copy(f'{lora_workdir}/config.json', empty)
  shutil.copytree(lora_workdir, damaged)
  for step in os.listdir(damaged / 'checkpoints'):
    if step.isdigit():
      shutil.rmtree(damaged / 'checkpoints' / step / 'state')
  engine = Engine(load_checkpoint(tiny_workdir),
                  ServeConfig(**ENGINE, enable_lora=True, max_lora_rank=4))
  try:
    for path, why in ((empty, 'does not exist'), (damaged, 'has intact parameters')):
      with pytest.raises(ValueError, match=rf"LoRA adapter 'x' \({path}\): no intact adapters "
                         rf'to serve \(.*{why}') as e:
        engine.lora.load('x', str(path))
      assert '\n' not in str(e.value) and engine.lora.names() == []
  finally:
    engine.shutdown()


@pytest.mark.parametrize('tensor', [1, 2])
def test_the_base_checksum_is_taken_at_the_first_lora_workdir_load_not_at_start(
    tiny_workdir, lora_workdir, monkeypatch, tensor):
  """--enable-lora with no LoRA workdir loaded reads no weight for a checksum; the first
  load takes it of the runner's per-layer arrays (sharded on tensor=2), equal to that of
  the stacked tree."""
  served = load_checkpoint(tiny_workdir)
  want = lora_run.checksum(served.params)
  calls, real = [], checkpoint.checksums
  monkeypatch.setattr(checkpoint, 'checksums', lambda tree: calls.append(1) or real(tree))
  engine = Engine(served, ServeConfig(**ENGINE, enable_lora=True, max_lora_rank=4,
                                      tensor=tensor))
  try:
    assert calls == []
    engine.lora.load('mine', str(lora_workdir))
    assert engine.lora.base.get() == BaseIdentity(served.model_cfg.dtype, want)
  finally:
    engine.shutdown()

