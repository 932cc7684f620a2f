"""Context parallelism (sharding/context.py): loss and gradients equal to one device for
each strategy, with and without causal load balance and packed documents; CP x FSDP x TP;
the communication each strategy compiles to; the load-balance layout; config checks."""

import dataclasses

import jax
import numpy as np
import pytest

import model
from sharding import context, hlo
from sharding.mesh import MeshConfig, make_mesh
from sharding.rules import make_plan
from tests.test_parallel import random_batch, rel_err, tiny_config
from training import config as config_lib, optimizer, state


def plain_batch(cfg) -> dict:
  """One document per row: no segment ids, positions 0..t-1."""
  batch = random_batch(cfg)
  del batch['segment_ids']
  batch['positions'] = np.broadcast_to(np.arange(cfg.data.seq_len, dtype=np.int32),
                                       batch['inputs'].shape).copy()
  return batch


def loss_and_grads(cfg, mesh_cfg, batch, zero=0, sp=False, strategy='all_gather', lb=False,
                   devices=None):
  plan = make_plan(make_mesh(mesh_cfg, devices), zero, sp, strategy, lb)
  axes = model.logical_axes(cfg.model)
  params = jax.device_put(model.init_params(cfg.model, jax.random.key(0)),
                          plan.tree(plan.params, axes))
  fn = jax.jit(lambda p, b: state.loss_and_grads(p, b, cfg, plan),
               out_shardings=(plan.replicated(), plan.tree(plan.grads, axes)))
  return fn(params, jax.device_put(batch, plan.batch_sharding()))


def assert_equal_to(got, want):
  assert rel_err(got[0], want[0]) < 1e-5, (got[0], want[0])
  errs = jax.tree.map(rel_err, got[1], want[1])
  assert max(jax.tree.leaves(errs)) < 1e-5, errs


@pytest.fixture(scope='module')
def references():
  cfg = tiny_config()
  one = jax.devices()[:1]
  return {packed: loss_and_grads(cfg, MeshConfig(data=1), make(cfg), devices=one)
          for packed, make in ((True, random_batch), (False, plain_batch))}


@pytest.mark.parametrize('packed', [True, False], ids=['packed', 'plain'])
@pytest.mark.parametrize('lb', [True, False], ids=['balanced', 'unbalanced'])
@pytest.mark.parametrize('strategy', context.STRATEGIES)
def test_cp4_equals_one_device(strategy, lb, packed, references):
  cfg = tiny_config()
  batch = random_batch(cfg) if packed else plain_batch(cfg)
  got = loss_and_grads(cfg, MeshConfig(data=2, context=4), batch, strategy=strategy, lb=lb)
  assert_equal_to(got, references[packed])


@pytest.mark.parametrize('strategy', context.STRATEGIES)
def test_cp2_fsdp2_tp2_equals_one_device(strategy, references):
  cfg = tiny_config()
  got = loss_and_grads(cfg, MeshConfig(data=1, fsdp=2, context=2, tensor=2),
                       random_batch(cfg), zero=3, sp=True, strategy=strategy, lb=True)
  assert_equal_to(got, references[True])


def compiled_collectives(strategy):
  cfg = tiny_config()
  cfg.parallel.context_strategy = strategy
  plan = make_plan(make_mesh(MeshConfig(data=2, context=4)), 0, False, strategy, True)
  tx = optimizer.make_optimizer(cfg.optim, 10)
  step = state.make_train_step(cfg, plan, tx, optimizer.lr_schedule(cfg.optim, 10))
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.batch_sharding())
           for k, v in random_batch(cfg).items()}
  return hlo.inspect_compiled(step.lower(state.abstract_state(cfg, plan, tx), batch)
                              .compile()), cfg


def test_ring_permutes_kv_and_gathers_none_all_gather_gathers():
  """Ring (4 devices): per layer, K and V move 3 times forward and 3 times backward, and
  dK and dV 4 times (home again), by collective permutes; no all-gather as large as a
  layer's K chunk is left. all_gather: every layer gathers K and V whole."""
  ring, cfg = compiled_collectives('ring')
  m = cfg.model
  b_local = cfg.data.batch_size // 2
  kv_whole = b_local * cfg.data.seq_len * m.num_kv_heads * m.resolved_head_dim * 4
  chunk = kv_whole // 4
  permuted = ring.collectives.get('collective-permute')
  # (ids and segment ids move too, but are small.)
  assert permuted and permuted.bytes >= m.num_layers * (2 * 3 + 2 * 3 + 2 * 4) * chunk, \
      ring.summary()
  gathered = ring.collectives.get('all-gather')
  assert gathered is None or gathered.bytes < chunk, ring.summary()
  flat, _ = compiled_collectives('all_gather')
  assert flat.bytes_of('all-gather') >= m.num_layers * 2 * kv_whole * (1 - 1e-9), \
      flat.summary()
  assert 'collective-permute' not in flat.collectives or \
      flat.collectives['collective-permute'].bytes < chunk


def test_load_balance_layout_gives_every_device_the_same_causal_work():
  n, seq = 4, 32
  order = context.load_balance_order(seq, n)
  assert sorted(order) == list(range(seq))
  chunks = order.reshape(2 * n, -1)[:, 0] // (seq // (2 * n))
  np.testing.assert_array_equal(chunks.reshape(n, 2), [[i, 2 * n - 1 - i] for i in range(n)])
  per_device = order.reshape(n, -1)
  work = [int(np.sum(np.arange(seq)[None, :] <= q[:, None])) for q in per_device]
  assert len(set(work)) == 1, work
  plain = np.arange(seq).reshape(n, -1)
  assert len({int(np.sum(np.arange(seq)[None, :] <= q[:, None])) for q in plain}) == n


def test_reorder_moves_every_array_alike_and_keeps_the_loss():
  cfg = tiny_config()
  plan = make_plan(make_mesh(MeshConfig(data=2, context=4)), 0, False, 'ring', True)
  batch = random_batch(cfg)
  moved = context.reorder_batch(batch, plan)
  order = context.token_order(plan, cfg.data.seq_len)
  for key, value in batch.items():
    np.testing.assert_array_equal(np.asarray(moved[key]), value[:, order])


def test_validate_context_axis():
  cfg = tiny_config(data=2, context=4)
  config_lib.validate(cfg, 8)
  cfg.parallel.context_strategy = 'ulysses'
  with pytest.raises(ValueError, match="parallel.context_strategy='ulysses'"):
    config_lib.validate(cfg, 8)
  cfg.parallel.context_strategy = 'ring'
  cfg.data.seq_len = 12   # 4 sequence shards, but not 8 load-balance chunks
  with pytest.raises(ValueError, match='data.seq_len=12 does not split into 2 x mesh.context'):
    config_lib.validate(cfg, 8)
  cfg.parallel.context_load_balance = False
  config_lib.validate(cfg, 8)
  cfg.model = dataclasses.replace(cfg.model, attention_impl='pallas')
  config_lib.validate(cfg, 8)   # the flash kernel inside the ring
  for strategy, impl in (('all_gather', 'pallas'), ('ring', 'cudnn')):
    cfg.parallel.context_strategy = strategy
    cfg.model = dataclasses.replace(cfg.model, attention_impl=impl)
    with pytest.raises(ValueError, match=f"runs model.attention_impl=xla.*not '{impl}'"):
      config_lib.validate(cfg, 8, platform='gpu')


@pytest.mark.parametrize('lb, remat', [(True, 'none'), (False, 'none'),
                                       (True, 'save_attention')],
                         ids=['balanced', 'unbalanced', 'balanced-save_attention'])
def test_ring_with_the_flash_kernel_equals_one_device(lb, remat):
  """attention_impl=pallas: the ring's blocks are flash-kernel calls (interpreted on CPU)
  on 16-token pieces, merged by the kernel's log-sum-exp; packed documents. With
  remat='save_attention' the ring runs between the block's two checkpointed parts."""
  cfg = tiny_config()
  cfg.model = dataclasses.replace(cfg.model, num_heads=4, num_kv_heads=2, max_seq_len=64,
                                  attention_impl='pallas', remat=remat)
  cfg.data.batch_size, cfg.data.seq_len = 2, 64
  batch = random_batch(cfg)
  want = loss_and_grads(dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, attention_impl='xla')), MeshConfig(data=1), batch, devices=jax.devices()[:1])
  got = loss_and_grads(cfg, MeshConfig(data=1, context=2), batch, strategy='ring', lb=lb,
                       devices=jax.devices()[:2])
  assert_equal_to(got, want)


def test_ring_under_gradient_accumulation_equals_one_device():
  """ZeRO-0 accumulation (per batch shard, vmapped) around the ring's shard_map."""
  cfg = tiny_config()
  cfg.data.batch_size = 16
  batch = random_batch(cfg)
  want = loss_and_grads(cfg, MeshConfig(data=1), batch, devices=jax.devices()[:1])
  cfg.optim.grad_accum = 2
  got = loss_and_grads(cfg, MeshConfig(data=2, context=4), batch, strategy='ring', lb=True)
  assert_equal_to(got, want)
