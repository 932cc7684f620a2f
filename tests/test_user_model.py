"""A user's Flax NNX module (model.module) trains through the same trainer: examples/
train, layouts equal one device, checkpoints resume exactly onto another mesh, and
annotations the rules do not know are refused."""

import dataclasses
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from examples import vit
from sharding import planner
from sharding.mesh import MESH_AXES, MeshConfig
from tests.test_parallel import random_batch, rel_err
from training import describe, family, plan, state, trainer, user_model
from training.cli import load_config_file

# (mesh, zero stage, grad_accum): DP, ZeRO-3 over fsdp, FSDP x TP, DP x ZeRO-3 accumulating
LAYOUTS = {
    'dp8': (MeshConfig(data=8), 0, 1),
    'zero3_8': (MeshConfig(data=1, fsdp=8), 3, 1),
    'fsdp2_tp4': (MeshConfig(data=1, fsdp=2, tensor=4), 3, 1),
    'dp2_zero3_4_accum2': (MeshConfig(data=2, fsdp=4), 3, 2),
}


def vit_cfg(tmp_path=None, **mesh):
  cfg = load_config_file('vit.py')
  cfg.data.batch_size = 16
  cfg.mesh = MeshConfig(**mesh) if mesh else MeshConfig(data=1)
  cfg.metrics.progress_bar = cfg.metrics.tensorboard = False
  cfg.checkpoint.async_save = False
  if tmp_path is not None:
    cfg.workdir = str(tmp_path)
  return cfg


def lm_cfg(tmp_path, cache_dir, **mesh):
  cfg = load_config_file('nnx_lm.py')
  cfg.model.kwargs = {'vocab': 320, 'dim': 64, 'depth': 2, 'heads': 4, 'mlp': 128,
                      'max_len': 32}
  cfg.data.seq_len, cfg.data.batch_size = 32, 8
  cfg.data.cache_dir, cfg.data.corpus_max_mb = cache_dir, 1
  cfg.mesh = MeshConfig(**mesh) if mesh else MeshConfig(data=1)
  cfg.metrics.progress_bar = cfg.metrics.tensorboard = False
  cfg.workdir = str(tmp_path)
  return cfg


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('corpus'))


def loss_and_grads(cfg, devices):
  """One batch's loss and gradients under cfg's layout on `devices`."""
  plan = trainer.build_plan(cfg, devices)
  fam = family.of(cfg)
  axes = fam.logical_axes()
  params = jax.device_put(fam.init_params(jax.random.key(0)), plan.tree(plan.params, axes))
  if cfg.data.source:
    host = vit.synthetic_batch(0, 0, cfg.data.batch_size)
    batch = {k: jax.device_put(v, trainer.source_batch_sharding(plan, v.ndim))
             for k, v in host.items()}
  else:
    cfg.model.vocab_size = 320
    batch = jax.device_put(random_batch(cfg), plan.batch_sharding())
  fn = jax.jit(lambda p, b: state.loss_and_grads(p, b, cfg, plan),
               out_shardings=(plan.replicated(), plan.tree(plan.grads, axes)))
  return plan, fn(params, batch)


@pytest.fixture(scope='module')
def vit_reference():
  return loss_and_grads(vit_cfg(), jax.devices()[:1])[1]


@pytest.mark.parametrize('name', LAYOUTS)
def test_vit_layouts_match_one_device(name, vit_reference):
  """Measured: losses equal, gradients within 3.6e-7 relative (float32 reduction
  order); the bounds are the built-in model's parity tests' (tests/test_parallel.py)."""
  mesh, zero, accum = LAYOUTS[name]
  cfg = vit_cfg(**dataclasses.asdict(mesh))
  cfg.parallel.zero_stage, cfg.optim.grad_accum = zero, accum
  plan, (loss, grads) = loss_and_grads(cfg, jax.devices())
  if mesh.tensor > 1:   # the layout really splits the user's axes over `tensor`
    assert 'tensor' in plan.sharding(plan.params, family.of(cfg).logical_axes()['head']).spec
  ref_loss, ref_grads = vit_reference
  assert rel_err(loss, ref_loss) < 1e-6
  errs = jax.tree.map(rel_err, grads, ref_grads)
  assert max(errs.values()) < 1e-5, errs


def test_nnx_lm_tensor_and_fsdp_match_one_device(tmp_path, cache_dir):
  """The decoder LM (segment-masked attention, tied head) under FSDP 2 x TP 4.
  Measured: loss within 8.3e-8, gradients within 4.3e-7 relative."""
  ref = loss_and_grads(lm_cfg(tmp_path, cache_dir), jax.devices()[:1])[1]
  cfg = lm_cfg(tmp_path, cache_dir, data=1, fsdp=2, tensor=4)
  cfg.parallel.zero_stage = 3
  _, (loss, grads) = loss_and_grads(cfg, jax.devices())
  assert rel_err(loss, ref[0]) < 1e-6
  errs = jax.tree.map(rel_err, grads, ref[1])
  assert max(errs.values()) < 1e-5, errs


def test_vit_trains_and_names_unannotated_params(tmp_path, capsys):
  cfg = vit_cfg(tmp_path, data=2, fsdp=2, tensor=2)
  cfg.parallel.zero_stage, cfg.steps = 3, 30
  history = trainer.train(cfg)
  losses = [r['loss'] for r in history]
  assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5]), losses
  err = capsys.readouterr().err
  assert ('10 parameters have no sharding annotation and are replicated on every device '
          '(2,560 bytes): blocks/0/norm1/bias (256 B)') in err


def test_nnx_lm_trains_on_the_default_corpus(tmp_path, cache_dir):
  cfg = lm_cfg(tmp_path, cache_dir, data=4, tensor=2)
  cfg.steps, cfg.optim.warmup_steps = 20, 5
  losses = [r['loss'] for r in trainer.train(cfg)]
  assert losses[-1] < 0.75 * losses[0], losses


def test_vit_resumes_exactly_onto_another_mesh(tmp_path):
  """4 steps under DP over 8, then 4 more under FSDP 4 x TP 2 (ZeRO-3), remat on: the
  losses of an uninterrupted DP run."""
  def run(workdir, steps, **mesh):
    cfg = vit_cfg(tmp_path / workdir, **mesh)
    cfg.steps, cfg.optim.decay_steps, cfg.checkpoint.every_steps = steps, 8, 4
    if mesh.get('tensor'):
      cfg.parallel.zero_stage, cfg.model.remat = 3, 'full'
    return [r['loss'] for r in trainer.train(cfg)]
  full = run('full', 8, data=8)
  first = run('split', 4, data=8)
  rest = run('split', 8, fsdp=4, tensor=2)
  np.testing.assert_allclose(first, full[:4], rtol=1e-6)
  np.testing.assert_allclose(rest, full[4:], rtol=1e-5)


class Unknown(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 8)),
                       out_sharding=('embed', 'hidden'))


def test_an_axis_the_rules_do_not_know_is_refused(monkeypatch):
  monkeypatch.setattr(vit, 'Unknown', Unknown, raising=False)
  cfg = vit_cfg(data=8)
  cfg.model.module, cfg.model.kwargs = 'examples.vit:Unknown', {}
  with pytest.raises(ValueError, match=r"parameter w names logical axes \['hidden'\], which "
                     r"the rules do not know: the rules map \[.*'classes', 'embed'"):
    family.of(cfg)
  cfg.rules = {'hidden': 'tensor'}   # a mesh axis: now known, and laid out there
  plan = trainer.build_plan(cfg, jax.devices())
  assert plan.sharding(plan.params, family.of(cfg).logical_axes()['w']).spec[1] == 'tensor'


def test_bad_rules_and_paths_say_what_to_fix():
  with pytest.raises(ValueError, match=r"rules\['x'\]='tensr': \['tensr'\] is neither"):
    user_model.resolve_rules({'x': 'tensr'})
  with pytest.raises(ValueError, match="model.module='examples.vit:Nope': examples.vit has "
                     "no 'Nope'"):
    user_model.load('examples.vit:Nope', 'model.module')
  cfg = vit_cfg()
  cfg.model.kwargs = {'depht': 3}
  with pytest.raises(ValueError, match=r"model.kwargs=\{\"depht\": 3\}: .*unexpected keyword"):
    family.of(cfg)


def test_the_docs_page_walks_through_the_example_in_under_60_lines():
  """docs/own_model.md's code is examples/vit.py's: same parameters, same loss."""
  import pathlib, re   # pylint: disable=import-outside-toplevel,multiple-imports
  page = (pathlib.Path(__file__).parent.parent / 'docs' / 'own_model.md').read_text()
  blocks = re.findall(r'```python\n(.*?)```', page, re.S)
  assert sum(1 for b in blocks for line in b.splitlines() if line.strip()) < 60
  shown = {}
  exec(blocks[0] + blocks[1], shown)   # pylint: disable=exec-used
  with nnx.use_eager_sharding(False):   # annotations only: no mesh outside the trainer
    ours, theirs = shown['ViT'](rngs=nnx.Rngs(0)), vit.ViT(rngs=nnx.Rngs(0))
  shapes = lambda m: jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(nnx.state(m, nnx.Param)))
  assert shapes(ours) == shapes(theirs)
  batch = vit.synthetic_batch(0, 3, 4)
  np.testing.assert_array_equal(shown['synthetic_batch'](0, 3, 4)['images'], batch['images'])
  np.testing.assert_allclose(shown['loss'](ours, batch), vit.loss(theirs, batch), rtol=1e-6)


def test_check_and_the_planner_take_a_user_model():
  """--check sizes it and names the unannotated parameters; the planner compiles and
  ranks its layouts, refusing one its parameters do not split over."""
  cfg = vit_cfg(fsdp=2, tensor=4)
  cfg.parallel.zero_stage = 3
  report = describe.check_report(cfg, 8)
  assert 'parameters    70,784' in report and '10 parameters have no sharding' in report
  layouts = [planner.Layout({**{a: 1 for a in MESH_AXES}, **mesh}, zero, 'none', 1, 0)
             for mesh, zero in (({'fsdp': 2, 'tensor': 4}, 3), ({'data': 8}, 0),
                                ({'tensor': 8}, 0))]
  rows, rejected = plan.plan_layouts(cfg, 8, layouts=layouts)
  assert sorted(r['layout'].name() for r in rows) == sorted(l.name() for l in layouts[:2])
  assert "'heads' dimension (4) does not split over mesh axes 'tensor'" in rejected[0][1]


def poisoned_batch(seed, index, batch_size):
  """examples/vit.py's batches, batch 2 (step 3) with a NaN pixel."""
  batch = vit.synthetic_batch(seed, index, batch_size)
  if index == 2:
    batch['images'][0, 0, 0, 0] = np.nan
  return batch


def test_a_non_finite_step_of_a_user_model_is_skipped(tmp_path, monkeypatch):
  """Fault tolerance is the trainer's: the poisoned step is skipped and the run goes on;
  the steps before it are a clean run's."""
  monkeypatch.setattr(vit, 'poisoned_batch', poisoned_batch, raising=False)
  cfg = vit_cfg(tmp_path / 'poisoned', data=8)
  cfg.data.source, cfg.steps = 'examples.vit:poisoned_batch', 4
  cfg.optim.warmup_steps, cfg.optim.decay_steps = 1, 4
  history = trainer.train(cfg)
  assert [r['skipped'] for r in history] == [None, None, 'non-finite loss', None]
  assert np.isfinite(history[3]['loss'])
  clean = vit_cfg(tmp_path / 'clean', data=8)
  clean.steps, clean.optim.warmup_steps, clean.optim.decay_steps = 2, 1, 4
  np.testing.assert_allclose([r['loss'] for r in history[:2]],
                             [r['loss'] for r in trainer.train(clean)], rtol=1e-6)


def test_the_bundled_examples_import_from_any_directory(tmp_path, monkeypatch):
  """`python -m training.plan_cli --config=vit.py` from anywhere: examples/ is in the
  checkout, not installed."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, 'path', [p for p in sys.path if os.path.abspath(p or '.') != root])
  for name in [m for m in sys.modules if m.partition('.')[0] == 'examples']:
    monkeypatch.delitem(sys.modules, name)
  assert user_model.load('examples.vit:ViT', 'model.module').__name__ == 'ViT'
