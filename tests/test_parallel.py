"""One step on 8 simulated devices equals one device, for every parallel layout."""

import dataclasses

import jax
import numpy as np
import pytest

import model
from model.config import ModelConfig
from sharding.mesh import MeshConfig, make_mesh
from sharding.rules import make_plan
from training import optimizer, state
from training.config import Config

PRESETS = {
    'dp8': (MeshConfig(data=8), 0, False),
    'zero1_8': (MeshConfig(data=1, fsdp=8), 1, False),
    'zero2_8': (MeshConfig(data=1, fsdp=8), 2, False),
    'zero3_8': (MeshConfig(data=1, fsdp=8), 3, False),
    'fsdp2_tp4': (MeshConfig(data=1, fsdp=2, tensor=4), 3, False),
    'tp4_sp_dp2': (MeshConfig(data=2, tensor=4), 0, True),
}


def tiny_config(**mesh) -> Config:
  cfg = Config()
  cfg.model = ModelConfig(vocab_size=64, num_layers=2, embed_dim=64, num_heads=8,
                          num_kv_heads=4, mlp_dim=128, max_seq_len=16)
  cfg.data.batch_size, cfg.data.seq_len = 8, 16
  cfg.optim.warmup_steps = 1
  cfg.mesh = MeshConfig(**mesh) if mesh else cfg.mesh
  return cfg


def random_batch(cfg: Config, seed: int = 0) -> dict:
  """Packed documents: random segment boundaries, positions restart at each."""
  rng = np.random.default_rng(seed)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
  starts = rng.random((b, t)) < 0.15
  starts[:, 0] = True
  segment_ids = np.cumsum(starts, axis=1).astype(np.int32)
  idx = np.arange(t)[None].repeat(b, 0)
  positions = idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
  weights = (rng.random((b, t)) < 0.9).astype(np.float32)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'segment_ids': segment_ids,
          'positions': positions.astype(np.int32), 'weights': weights}


def sharded_loss_and_grads(cfg: Config, mesh_cfg: MeshConfig, zero: int, sp: bool,
                           devices=None):
  plan = make_plan(make_mesh(mesh_cfg, devices), zero, sp)
  axes = model.logical_axes(cfg.model)
  params = jax.device_put(model.init_params(cfg.model, jax.random.key(0)),
                          plan.tree(plan.params, axes))
  batch = jax.device_put(random_batch(cfg), plan.batch_sharding())
  fn = jax.jit(lambda p, b: state.loss_and_grads(p, b, cfg, plan),
               out_shardings=(plan.replicated(), plan.tree(plan.grads, axes)))
  return fn(params, batch)


@pytest.fixture(scope='module')
def reference():
  cfg = tiny_config()
  return sharded_loss_and_grads(cfg, MeshConfig(data=1), 0, False, jax.devices()[:1])


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize('name', PRESETS)
def test_loss_and_grads_match_single_device(name, reference):
  mesh_cfg, zero, sp = PRESETS[name]
  loss, grads = sharded_loss_and_grads(tiny_config(), mesh_cfg, zero, sp)
  ref_loss, ref_grads = reference
  assert rel_err(loss, ref_loss) < 1e-5
  errs = jax.tree.map(rel_err, grads, ref_grads)
  worst = max(jax.tree.leaves(errs))
  assert worst < 1e-5, errs


@pytest.mark.parametrize('name', ['dp8', 'fsdp2_tp4', 'tp4_sp_dp2'])
@pytest.mark.parametrize('tied', [True, False])
def test_chunked_loss_matches_single_device(name, tied):
  """Chunked loss with per-batch-shard head copies equals the whole loss on one device."""
  cfg = tiny_config()
  cfg.model = dataclasses.replace(cfg.model, tie_embeddings=tied)
  ref_loss, ref_grads = sharded_loss_and_grads(cfg, MeshConfig(data=1), 0, False,
                                               jax.devices()[:1])
  cfg.model = dataclasses.replace(cfg.model, loss_chunk=4)
  loss, grads = sharded_loss_and_grads(cfg, *PRESETS[name])
  assert rel_err(loss, ref_loss) < 1e-5
  errs = jax.tree.map(rel_err, grads, ref_grads)
  assert max(jax.tree.leaves(errs)) < 1e-5, errs


ACCUM_LAYOUTS = {
    'zero2_fsdp2_tp2_sp': (MeshConfig(data=2, fsdp=2, tensor=2), 2, True),
    'dp8_per_shard': (MeshConfig(data=8), 0, False),
    'zero1_dp2_fsdp2_tp2_sp_per_shard': (MeshConfig(data=2, fsdp=2, tensor=2), 1, True),
}


@pytest.mark.parametrize('name', ACCUM_LAYOUTS)
def test_grad_accumulation_matches_one_batch(name):
  """4 microbatches of 8 (over every batch shard, as the trainer runs) = one batch of 32."""
  cfg = tiny_config()
  cfg.data.batch_size = 32
  ref_loss, ref_grads = sharded_loss_and_grads(cfg, MeshConfig(data=1), 0, False,
                                               jax.devices()[:1])
  cfg.optim.grad_accum = 4
  loss, grads = sharded_loss_and_grads(cfg, *ACCUM_LAYOUTS[name])
  assert rel_err(loss, ref_loss) < 1e-5
  assert max(jax.tree.leaves(jax.tree.map(rel_err, grads, ref_grads))) < 1e-5


def test_train_step_matches_single_device():
  """The real jitted step (donation, optimizer, constraints) on FSDP x TP vs one device."""
  out = {}
  for name, mesh_cfg, zero, devices in [('one', MeshConfig(data=1), 0, jax.devices()[:1]),
                                        ('fsdp_tp', MeshConfig(fsdp=4, tensor=2, data=1), 3,
                                         None)]:
    cfg = tiny_config()
    plan = make_plan(make_mesh(mesh_cfg, devices), zero)
    tx = optimizer.make_optimizer(cfg.optim, 10)
    step = state.make_train_step(cfg, plan, tx, optimizer.lr_schedule(cfg.optim, 10))
    s = state.init_state(cfg, plan, tx)
    metrics = []
    for i in (0, 1, 0):   # batch 0 again: the update in between must have lowered its loss
      s, m = step(s, jax.device_put(random_batch(cfg, i), plan.batch_sharding()))
      metrics.append(jax.device_get(m))
    out[name] = metrics
  for a, b in zip(out['one'], out['fsdp_tp']):
    for key in ('loss', 'grad_norm', 'lr'):
      assert rel_err(b[key], a[key]) < 1e-5, (key, a, b)
  # Step 1 runs at lr 0 (warmup); step 2's update lowers batch 0's loss (measured 4.202 ->
  # 4.004 on jax 0.10.2).
  assert out['one'][2]['loss'] < out['one'][0]['loss'] - 0.1, out['one']


def test_rules_reject_two_axes_on_one_mesh_axis():
  plan = make_plan(make_mesh(MeshConfig(data=1, fsdp=8)), 3)
  bad = plan.params.with_overrides('bad', mlp='fsdp')
  with pytest.raises(ValueError, match="'embed' and 'mlp'.*'fsdp'"):
    bad.spec(('layers', 'embed', 'mlp'))
