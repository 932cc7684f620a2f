"""Pipeline parallelism (sharding/pipeline.py): loss and gradients equal to one device for
GPipe, circular repeats and PP x FSDP x TP; the bubble read from the compiled step's dot
FLOPs; the communication it compiles to; a short training run; config checks."""

import dataclasses

import jax
import pytest

import model
from sharding import hlo, pipeline
from sharding.mesh import MeshConfig, make_mesh
from sharding.rules import make_plan
from tests.test_parallel import random_batch, rel_err, tiny_config
from training import config as config_lib, optimizer, state, trainer

LAYERS = 8


def pp_config(layers=LAYERS, **mesh):
  cfg = tiny_config(**mesh)
  cfg.model = dataclasses.replace(cfg.model, num_layers=layers)
  return cfg


def plan_for(mesh_cfg, zero=0, sp=False, micro=1, repeats=1, devices=None):
  return make_plan(make_mesh(mesh_cfg, devices), zero, sp, pipeline_microbatches=micro,
                   pipeline_repeats=repeats)


def loss_and_grads(cfg, plan):
  axes = model.logical_axes(cfg.model)
  params = jax.device_put(model.init_params(cfg.model, jax.random.key(0)),
                          plan.tree(plan.params, axes))
  fn = jax.jit(lambda p, b: state.loss_and_grads(p, b, cfg, plan),
               out_shardings=(plan.replicated(), plan.tree(plan.grads, axes)))
  return fn(params, jax.device_put(random_batch(cfg), plan.batch_sharding()))


@pytest.fixture(scope='module')
def reference():
  return loss_and_grads(pp_config(), plan_for(MeshConfig(data=1), devices=jax.devices()[:1]))


@pytest.mark.parametrize('mesh, zero, sp, micro, repeats', [
    (MeshConfig(data=2, stage=4), 0, False, 4, 1),
    (MeshConfig(data=2, stage=4), 0, False, 4, 2),
    (MeshConfig(data=1, stage=2, fsdp=2, tensor=2), 3, True, 2, 1),
], ids=['pp4_gpipe', 'pp4_circular', 'pp2_fsdp2_tp2'])
def test_pipeline_equals_one_device(mesh, zero, sp, micro, repeats, reference):
  loss, grads = loss_and_grads(pp_config(), plan_for(mesh, zero, sp, micro, repeats))
  assert rel_err(loss, reference[0]) < 1e-5
  errs = jax.tree.map(rel_err, grads, reference[1])
  assert max(jax.tree.leaves(errs)) < 1e-5, errs


def compiled(layers, mesh_cfg, micro=1, repeats=1, devices=None):
  cfg = pp_config(layers)
  plan = plan_for(mesh_cfg, micro=micro, repeats=repeats, devices=devices)
  tx = optimizer.make_optimizer(cfg.optim, 10)
  step = state.make_train_step(cfg, plan, tx, optimizer.lr_schedule(cfg.optim, 10))
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.batch_sharding())
           for k, v in random_batch(cfg).items()}
  return hlo.inspect_compiled(step.lower(state.abstract_state(cfg, plan, tx), batch)
                              .compile())


@pytest.fixture(scope='module')
def one_device_layer_flops():
  """Dot FLOPs of LAYERS layers (forward and backward) on one device: the step with 2x
  the layers minus the step with 1x, so embedding, head and loss cancel."""
  one = jax.devices()[:1]
  return (compiled(2 * LAYERS, MeshConfig(data=1), devices=one).dot_flops
          - compiled(LAYERS, MeshConfig(data=1), devices=one).dot_flops)


@pytest.mark.parametrize('micro, repeats', [(4, 1), (4, 2), (8, 1)])
def test_bubble_from_the_compiled_step_matches_the_schedule(micro, repeats,
                                                            one_device_layer_flops):
  """Per device, the layers' dot FLOPs in the pipelined step, against the useful share
  (one device's / 4 stages): the excess is the bubble, (S-1)/(M R + S-1) within 5%."""
  four = jax.devices()[:4]
  mesh = MeshConfig(data=1, stage=4)
  per_device = (compiled(2 * LAYERS, mesh, micro, repeats, four).dot_flops
                - compiled(LAYERS, mesh, micro, repeats, four).dot_flops)
  measured = 1 - (one_device_layer_flops / 4) / per_device
  want = pipeline.bubble_fraction(4, micro, repeats)
  assert abs(measured - want) <= 0.05 * want, (measured, want)


def test_stages_talk_by_collective_permutes_and_gather_no_parameters():
  report = compiled(LAYERS, MeshConfig(data=2, stage=4), micro=4)
  assert report.collectives.get('collective-permute'), report.summary()
  assert 'all-gather' not in report.collectives, report.summary()
  circular = compiled(LAYERS, MeshConfig(data=2, stage=4), micro=4, repeats=2)
  assert 'all-gather' not in circular.collectives, circular.summary()


def test_pipeline_trains_through_the_trainer(tmp_path):
  cfg = pp_config(4, data=4, stage=2)
  cfg.model = dataclasses.replace(cfg.model, vocab_size=320)   # the byte tokenizer's 257
  cfg.parallel.microbatches = 2
  cfg.steps, cfg.workdir, cfg.data.cache_dir = 3, str(tmp_path), str(tmp_path / 'cache')
  cfg.data.corpus_max_mb, cfg.metrics.progress_bar = 1, False
  cfg.checkpoint.every_steps = 3
  cfg.optim.learning_rate = 3e-3
  history = trainer.train(cfg)
  assert [r['step'] for r in history] == [1, 2, 3]
  assert all(r['loss'] == r['loss'] for r in history)   # finite, not NaN


def test_validate_stage_axis():
  cfg = pp_config(data=2, stage=4)
  config_lib.validate(cfg, 8)
  assert config_lib.pipeline_microbatches(cfg, 4) == 4
  cfg.model = dataclasses.replace(cfg.model, num_layers=6)
  with pytest.raises(ValueError, match='model.num_layers=6 does not split into mesh.stage'):
    config_lib.validate(cfg, 8)
  cfg.model = dataclasses.replace(cfg.model, num_layers=8)
  cfg.parallel.pipeline_repeats, cfg.parallel.microbatches = 2, 2
  with pytest.raises(ValueError, match='parallel.microbatches=2 is below mesh.stage=4'):
    config_lib.validate(cfg, 8)
  cfg.parallel.pipeline_repeats, cfg.parallel.microbatches = 1, 8   # 8 rows / (8 x 2)
  with pytest.raises(ValueError, match='not divisible by parallel.microbatches'):
    config_lib.validate(cfg, 8)
  cfg.parallel.microbatches = 4
  cfg.model = dataclasses.replace(cfg.model, attention_impl='pallas')
  with pytest.raises(ValueError, match='mesh.stage=4 runs dense models'):
    config_lib.validate(cfg, 8)


def test_pipeline_under_gradient_accumulation_equals_one_device():
  """ZeRO-0 accumulation (per batch shard, vmapped) around the pipeline's own vmap."""
  cfg = pp_config()
  cfg.data.batch_size = 16
  want = loss_and_grads(cfg, plan_for(MeshConfig(data=1), devices=jax.devices()[:1]))
  cfg.optim.grad_accum = 2
  loss, grads = loss_and_grads(cfg, plan_for(MeshConfig(data=2, stage=4), micro=4))
  assert rel_err(loss, want[0]) < 1e-5
  assert max(jax.tree.leaves(jax.tree.map(rel_err, grads, want[1]))) < 1e-5
