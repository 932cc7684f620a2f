"""LoRA training end to end: only the adapters train (the base stays bitwise), checkpoints
hold the adapters and name their base, resume is exact, evaluation reports a loss, and a
workdir of another base or of a full model is refused with one line."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from model import lora, lora_peft
from model.lora import LoraConfig
from training import checkpoint, describe, lora_run, optimizer, state, trainer
from training.trainer import ConfigError
from tests.test_lora import random_adapter
from tests.test_train import cache_dir, tiny  # pylint: disable=unused-import

LORA = LoraConfig(rank=4, alpha=8.0, targets=('q', 'v', 'o', 'down'))
FIXED = {'optim__decay_steps': 8, 'checkpoint__every_steps': 4, 'sample__num_tokens': 0,
         'optim__learning_rate': 1e-2, 'optim__warmup_steps': 0}


def lora_run_cfg(workdir, cache_dir, lcfg=LORA, **overrides):
  cfg = tiny(workdir, cache_dir, **{**FIXED, **overrides})
  cfg.lora = lcfg
  return cfg


def test_lora_trains_adapters_only_and_resumes_exactly(tmp_path, cache_dir):
  full = trainer.train(lora_run_cfg(tmp_path / 'full', cache_dir, steps=8))
  losses = [r['loss'] for r in full]
  assert losses[-1] < losses[0] - 0.05, losses
  first = trainer.train(lora_run_cfg(tmp_path / 'split', cache_dir, steps=4))
  rest = trainer.train(lora_run_cfg(tmp_path / 'split', cache_dir, steps=8))
  assert [r['step'] for r in rest] == list(range(5, 9))
  np.testing.assert_allclose([r['loss'] for r in first + rest], losses, rtol=1e-6)
  # The checkpoint: the adapters' tree, its optimizer state and step; the base named.
  cfg = lora_run_cfg(tmp_path / 'split', cache_dir, steps=8)
  ckpt = checkpoint.Checkpointer(os.path.join(cfg.workdir, 'checkpoints'), cfg.checkpoint)
  meta = ckpt.latest_meta()
  assert meta['lora_base']['source'] == 'random weights of seed 0'
  plan = trainer.build_plan(cfg)
  tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
  restored, _ = ckpt.restore_latest(state.abstract_state(cfg, plan, tx).replace(frozen=None))
  ckpt.close()
  assert jax.tree.structure(restored.params) == jax.tree.structure(
      lora.abstract_adapter(cfg.model, LORA))
  base, identity = lora_run.load_base(cfg, plan)
  assert identity == meta['lora_base']
  # The base is the seed's weights, untouched: only the adapters moved.
  fresh = state.init_state(cfg, plan, tx)
  assert lora_run.checksum(fresh.frozen) == identity['checksum']
  assert any(np.abs(np.asarray(w)).max() > 0 for w in jax.tree.leaves(
      jax.tree.map(lambda a, b: a - b, restored.params, fresh.params)))


def test_lora_gradients_reach_adapters_only():
  cfg = tiny('/tmp', '/tmp')
  cfg.lora = LORA
  plan = trainer.build_plan(cfg, jax.devices()[:1])
  tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
  st = state.init_state(cfg, plan, tx)
  rng = np.random.default_rng(0)
  batch = {'inputs': rng.integers(0, 256, (8, 32)).astype(np.int32),
           'targets': rng.integers(0, 256, (8, 32)).astype(np.int32),
           'weights': np.ones((8, 32), np.float32)}
  loss, grads = state.loss_and_grads(st.params, batch, cfg, None, frozen=st.frozen)
  assert jax.tree.structure(grads) == jax.tree.structure(st.params)
  # b starts at zero: a's gradient is zero, b's is not (PEFT's start at the base model).
  for t in LORA.targets:
    assert not np.any(np.asarray(grads['layers'][t]['a']))
    assert np.any(np.asarray(grads['layers'][t]['b']))
  assert float(loss) > 0


def test_eval_loss_of_a_lora_run(tmp_path, cache_dir):
  history = trainer.train(lora_run_cfg(tmp_path, cache_dir, steps=4, eval__every_steps=2,
                                       eval__batches=1))
  evals = [r for r in history if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [2, 4]
  assert all(np.isfinite(r['eval_loss']) and r['eval_loss'] > 0 for r in evals)


def test_lora_workdir_of_another_base_is_refused(tmp_path, cache_dir):
  trainer.train(lora_run_cfg(tmp_path, cache_dir, steps=4))
  with pytest.raises(ConfigError, match=r'the LoRA adapters in .* were trained on another '
                     r'base \(random weights of seed 0, checksum \w+; this run\'s is random '
                     r'weights of seed 1') as err:
    trainer.train(lora_run_cfg(tmp_path, cache_dir, steps=8, seed=1))
  assert '\n' not in str(err.value)


def test_full_model_and_lora_workdirs_are_not_mixed(tmp_path, cache_dir):
  trainer.train(tiny(tmp_path / 'full', cache_dir, steps=4, **FIXED))
  with pytest.raises(ConfigError, match='holds full-model checkpoints, not LoRA adapters'):
    trainer.train(lora_run_cfg(tmp_path / 'full', cache_dir, steps=8))
  trainer.train(lora_run_cfg(tmp_path / 'lora', cache_dir, steps=4))
  with pytest.raises(ConfigError, match='holds LoRA adapter checkpoints'):
    trainer.train(tiny(tmp_path / 'lora', cache_dir, steps=8, **FIXED))


def test_bad_lora_config_stops_the_run_with_one_line(tmp_path, cache_dir):
  for lcfg, message in ((LoraConfig(rank=-1), 'lora.rank=-1 must be > 0'),
                        (LoraConfig(rank=2, targets=('qkv',)), r"lora.targets=\('qkv',\)")):
    with pytest.raises(ConfigError, match=message):
      trainer.train(lora_run_cfg(tmp_path, cache_dir, lcfg=lcfg, steps=2))


@pytest.mark.parametrize('zero', [0, 3])
def test_check_counts_the_frozen_base_and_the_adapters(tmp_path, zero):
  """--check's bytes equal the shards of a real LoRA state: the base in the compute
  dtype, gradients and optimizer state of the adapters only."""
  cfg = tiny(tmp_path, str(tmp_path))
  cfg.lora, cfg.model.dtype = LORA, 'bfloat16'
  cfg.mesh.data, cfg.mesh.fsdp = 2, 4
  cfg.parallel.zero_stage = zero
  size = describe.run_size(cfg, 8)
  plan = trainer.build_plan(cfg)
  real = state.init_state(cfg, plan, optimizer.make_optimizer(cfg.optim, cfg.steps))
  device = jax.devices()[0]
  on_device = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree)
                               for s in x.addressable_shards if s.device == device)
  assert size['frozen_bytes'] == on_device(real.frozen)
  assert all(x.dtype == np.dtype('bfloat16') for x in jax.tree.leaves(real.frozen))
  assert size['param_bytes'] == on_device(real.params)
  assert size['opt_state_bytes'] == on_device(real.opt_state)
  assert size['grad_bytes'] == size['param_bytes']
  report = describe.check_report(cfg, 8)
  assert 'frozen base (bfloat16)' in report and 'LoRA          rank 4 on q, v, o, down' in report


def test_training_starts_from_a_peft_adapter(tmp_path, cache_dir):
  """lora.init_from_peft: with a zero learning rate the saved adapters are the PEFT
  directory's exactly; a lora section that differs from them is refused."""
  cfg = lora_run_cfg(tmp_path / 'run', cache_dir, steps=1, optim__learning_rate=0.0)
  adapter = random_adapter(cfg.model, LORA, seed=3)
  lora_peft.write_peft_adapter(str(tmp_path / 'peft'), adapter, LORA, cfg.model)
  cfg.lora = dataclasses.replace(LORA, init_from_peft=str(tmp_path / 'peft'),
                                 targets=('down', 'o', 'v', 'q'))   # any order
  trainer.train(cfg)
  plan = trainer.build_plan(cfg)
  tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
  ckpt = checkpoint.Checkpointer(os.path.join(cfg.workdir, 'checkpoints'), cfg.checkpoint)
  restored, _ = ckpt.restore_latest(state.abstract_state(cfg, plan, tx).replace(frozen=None))
  ckpt.close()
  for t in LORA.targets:
    for k in ('a', 'b'):
      np.testing.assert_array_equal(np.asarray(restored.params['layers'][t][k]),
                                    np.asarray(adapter['layers'][t][k]))
  other = lora_run_cfg(tmp_path / 'other', cache_dir, steps=1)
  other.lora = dataclasses.replace(LORA, rank=8, init_from_peft=str(tmp_path / 'peft'))
  with pytest.raises(ConfigError, match=r"holds adapters with rank=4; set those fields of the "
                     'lora section to match'):
    trainer.train(other)


def test_dropout_masks_the_adapter_input_by_key():
  """lora.dropout: the adapters' gradients change with the key and repeat with it; the
  base's projections see their input whole (the loss at b = 0 is the base's)."""
  cfg = tiny('/tmp', '/tmp')
  cfg.lora = dataclasses.replace(LORA, dropout=0.5)
  st = state.init_state(cfg, trainer.build_plan(cfg, jax.devices()[:1]),
                        optimizer.make_optimizer(cfg.optim, cfg.steps))
  rng = np.random.default_rng(0)
  batch = {'inputs': rng.integers(0, 256, (8, 32)).astype(np.int32),
           'targets': rng.integers(0, 256, (8, 32)).astype(np.int32),
           'weights': np.ones((8, 32), np.float32)}
  run = lambda key: state.loss_and_grads(st.params, batch, cfg, None, frozen=st.frozen,
                                         key=key)
  plain, one, again, other = run(None), run(jax.random.key(1)), run(jax.random.key(1)), run(
      jax.random.key(2))
  assert float(plain[0]) == float(one[0])
  b = lambda out: np.asarray(out[1]['layers']['q']['b'])
  np.testing.assert_array_equal(b(one), b(again))
  assert np.abs(b(one) - b(other)).max() > 1e-6 and np.abs(b(one) - b(plain)).max() > 1e-6


def test_each_microbatch_draws_its_own_dropout_masks():
  """grad_accum=2 over a batch whose two microbatches are the same rows: with one mask for
  both (the key reused), the loss would equal those rows' loss alone, bit for bit."""
  cfg = tiny('/tmp', '/tmp')
  cfg.lora = dataclasses.replace(LORA, dropout=0.5)
  st = state.init_state(cfg, trainer.build_plan(cfg, jax.devices()[:1]),
                        optimizer.make_optimizer(cfg.optim, cfg.steps))
  st = st.replace(params=jax.tree.map(lambda x: x + 0.05, st.params))   # b != 0: masks show
  rng = np.random.default_rng(0)
  half = {'inputs': rng.integers(0, 256, (4, 32)).astype(np.int32),
          'targets': rng.integers(0, 256, (4, 32)).astype(np.int32),
          'weights': np.ones((4, 32), np.float32)}
  # Microbatch i takes rows i, i + accum, ...: interleave so both are `half`.
  doubled = {k: np.repeat(v, 2, axis=0) for k, v in half.items()}
  key = jax.random.key(3)
  alone = state.loss_and_grads(st.params, half, cfg, None, frozen=st.frozen, key=key)[0]
  cfg.optim = dataclasses.replace(cfg.optim, grad_accum=2)
  both = state.loss_and_grads(st.params, doubled, cfg, None, frozen=st.frozen, key=key)[0]
  assert float(both) != float(alone)


def test_checkpoints_saved_before_the_frozen_field_still_restore(tmp_path):
  """A state item of the three fields checkpoints held before TrainState.frozen (a flax
  dataclass step, params, opt_state) restores into TrainState."""
  import flax.struct  # pylint: disable=import-outside-toplevel

  @flax.struct.dataclass
  class OldTrainState:
    step: object
    params: object
    opt_state: object

  cfg = tiny(tmp_path, str(tmp_path))
  plan = trainer.build_plan(cfg, jax.devices()[:1])
  tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
  fresh = state.init_state(cfg, plan, tx)
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'checkpoints'), cfg.checkpoint)
  ckpt.save(1, OldTrainState(fresh.step, fresh.params, fresh.opt_state), {})
  ckpt.wait()
  restored, _ = ckpt.restore_latest(state.abstract_state(cfg, plan, tx))
  ckpt.close()
  assert isinstance(restored, state.TrainState) and restored.frozen is None
  np.testing.assert_array_equal(np.asarray(restored.params['embed']),
                                np.asarray(fresh.params['embed']))
