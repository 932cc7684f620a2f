"""Per-device memory and collectives of the compiled train step, per ZeRO/TP preset."""

import dataclasses
import math

import jax
import pytest

import model
from sharding import hlo
from sharding.mesh import MeshConfig, make_mesh
from sharding.rules import make_plan
from tests.test_parallel import random_batch, tiny_config
from training import optimizer, state


def compile_step(cfg, mesh_cfg, zero, sp=False, devices=None):
  plan = make_plan(make_mesh(mesh_cfg, devices), zero, sp)
  tx = optimizer.make_optimizer(cfg.optim, 10)
  step = state.make_train_step(cfg, plan, tx, optimizer.lr_schedule(cfg.optim, 10))
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.batch_sharding())
           for k, v in random_batch(cfg).items()}
  compiled = step.lower(state.abstract_state(cfg, plan, tx), batch).compile()
  return hlo.inspect_compiled(compiled), plan, tx


def param_bytes(cfg) -> int:
  return sum(math.prod(s.shape) * s.dtype.itemsize
             for s in jax.tree.leaves(model.abstract_params(cfg.model)))


def test_zero3_argument_memory_falls_as_one_over_n():
  cfg = tiny_config()
  args = {n: compile_step(cfg, MeshConfig(data=1, fsdp=n), 3, devices=jax.devices()[:n])[0]
          .argument_bytes for n in (1, 2, 4, 8)}
  for n in (2, 4, 8):
    assert abs(args[n] * n / args[1] - 1) < 0.10, args


def test_zero1_shards_only_optimizer_state():
  cfg = tiny_config()
  report, plan, tx = compile_step(cfg, MeshConfig(data=1, fsdp=8), 1)
  shardings = state.state_shardings(cfg, plan, tx)
  param_specs = [s.spec for s in jax.tree.leaves(shardings.params)]
  assert all('fsdp' not in tuple(spec) for spec in param_specs)
  adam = [s for s in jax.tree.leaves(shardings.opt_state) if len(s.spec) > 0]
  assert len(adam) == 2 * len(param_specs)   # mu and nu
  assert all('fsdp' in tuple(s.spec) for s in adam)
  # Whole params plus Adam's two moments split eight ways (+ the tiny batch).
  expected = param_bytes(cfg) * (1 + 2 / 8)
  assert abs(report.argument_bytes / expected - 1) < 0.10, (report.argument_bytes, expected)


@pytest.mark.parametrize('tied', [True, False])
def test_data_parallel_all_reduces_gradients_once(tied):
  # A large vocabulary makes the table most of the model: a tied table's two uses
  # (lookup and head) must add up before the all-reduce, not be reduced apart.
  cfg = tiny_config()
  cfg.model = dataclasses.replace(cfg.model, vocab_size=2048, tie_embeddings=tied)
  report = compile_step(cfg, MeshConfig(data=8), 0)[0]
  reduced = report.bytes_of('all-reduce', 'reduce-scatter')
  assert param_bytes(cfg) <= reduced < 1.05 * param_bytes(cfg) + 4096, report.summary()
  assert report.bytes_of('all-gather') == 0, report.summary()


def with_layers(layers: int):
  cfg = tiny_config()
  cfg.model = dataclasses.replace(cfg.model, num_layers=layers)
  return cfg


def test_zero2_shards_gradients_that_zero1_keeps_whole():
  cfg = tiny_config()
  zero1 = compile_step(cfg, MeshConfig(data=1, fsdp=8), 1)[0]
  zero2 = compile_step(cfg, MeshConfig(data=1, fsdp=8), 2)[0]
  assert zero2.argument_bytes == zero1.argument_bytes   # same stored state ...
  # ... but the full fp32 gradient no longer lives on every device at once.
  assert zero1.temp_bytes - zero2.temp_bytes > 0.5 * param_bytes(cfg) * (1 - 1 / 8), \
      (zero1.temp_bytes, zero2.temp_bytes)


@pytest.mark.parametrize('zero', [0, 1])
def test_grad_accumulation_reduces_gradients_once(zero):
  """ZeRO-0/1 with 4 microbatches: partial gradients stay on their shard until the end."""
  cfg = tiny_config()
  cfg.data.batch_size, cfg.optim.grad_accum = 32, 4
  mesh = MeshConfig(data=8) if zero == 0 else MeshConfig(data=1, fsdp=8)
  report = compile_step(cfg, mesh, zero)[0]
  reduced = report.bytes_of('all-reduce', 'reduce-scatter')
  assert reduced < 1.1 * param_bytes(cfg) + 4096, report.summary()


def test_fsdp_all_gathers_weights_per_layer():
  """Each extra layer adds its own weight gathers (forward and backward), inside the scan."""
  reports = {l: compile_step(with_layers(l), MeshConfig(data=1, fsdp=8), 3)[0] for l in (2, 4)}
  layer_bytes = (param_bytes(with_layers(4)) - param_bytes(with_layers(2))) / 2
  extra = {k: reports[4].collectives['all-gather'].__dict__[k]
           - reports[2].collectives['all-gather'].__dict__[k] for k in ('count', 'bytes')}
  assert extra['count'] >= 2 * 2, extra
  assert extra['bytes'] >= 2 * 2 * layer_bytes * 0.99, (extra, layer_bytes)


@pytest.mark.parametrize('sp', [False, True])
def test_tensor_parallel_reduces_per_layer(sp):
  """Each extra layer adds two activation reductions (attention, mlp) per direction; with
  sequence parallelism the residual stream is also re-gathered per layer."""
  reports = {l: compile_step(with_layers(l), MeshConfig(data=2, tensor=4), 0, sp)[0]
             for l in (2, 4)}
  cfg = tiny_config()
  act_bytes = cfg.data.batch_size // 2 * cfg.data.seq_len * cfg.model.embed_dim * 4
  reduce_kinds = ('all-reduce', 'reduce-scatter')
  extra = reports[4].bytes_of(*reduce_kinds) - reports[2].bytes_of(*reduce_kinds)
  # XLA:CPU writes a reduce-scatter as all-reduce + slice: full bytes either way.
  assert extra / 2 / act_bytes >= 2 * 2 * 0.99, (extra, reports[4].summary())
  gathers = {l: reports[l].bytes_of('all-gather') for l in (2, 4)}
  if sp:   # seq-sharded residual gathered before attention and mlp, each layer
    assert (gathers[4] - gathers[2]) / 2 / act_bytes >= 2 * 0.99, gathers
  else:
    assert gathers[4] == gathers[2] == 0, gathers


@pytest.mark.parametrize('mesh_cfg, zero', [(MeshConfig(data=2, tensor=4), 0),
                                            (MeshConfig(data=1, fsdp=2, tensor=4), 3)])
def test_chunked_loss_moves_the_head_once(mesh_cfg, zero):
  """Four loss chunks cost no more collectives than one: the head is gathered once and
  its gradient reduced once (a shared head was gathered and reduced per chunk)."""
  cfg = tiny_config()
  cfg.model = dataclasses.replace(cfg.model, vocab_size=4096)   # the head dominates
  whole = compile_step(cfg, mesh_cfg, zero, True)[0]
  cfg.model = dataclasses.replace(cfg.model, loss_chunk=4)
  chunked = compile_step(cfg, mesh_cfg, zero, True)[0]
  head_bytes = 4096 * cfg.model.embed_dim * 4 / 4   # fp32, vocab over tensor=4
  for kinds in (('all-gather',), ('all-reduce', 'reduce-scatter')):
    extra = chunked.bytes_of(*kinds) - whole.bytes_of(*kinds)
    assert extra < 0.1 * head_bytes, (kinds, extra, head_bytes, chunked.summary())
