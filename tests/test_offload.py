"""Host offload: the optimizer state in pinned host memory, and remat='offload'.

What jax 0.10.2 on CPU does with memory kinds: a CPU device addresses 'device',
'pinned_host' and 'unpinned_host'; arrays are placed in each and a jitted step's arguments
and results keep their kind (the compiled entry layout marks host buffers S(5)), so the
offloaded train step runs here for real. A `device_put` inside jit, though, lowers to
nothing on CPU (host and device memory are the same RAM), so the transfers themselves
are read from the step lowered for GPU (`lowering_platforms=('cuda',)`): there they are
`annotate_device_placement` custom calls, which XLA turns into host<->device copies.
"""

import dataclasses
import os
import re

import jax
import numpy as np
import pytest

import model
from sharding import offload
from sharding.mesh import MeshConfig, make_mesh
from sharding.rules import make_plan
from tests.test_parallel import random_batch, rel_err, sharded_loss_and_grads, tiny_config
from tests.test_train import ROOT, tiny
from training import checkpoint, optimizer, prepare, state, trainer
from training import config as config_lib
from training.config import CheckpointConfig

# ZeRO-3 on FSDP 4 x TP 2: test_parallel's train-step layout (its resident run compiles once).
MESH, ZERO = MeshConfig(data=1, fsdp=4, tensor=2), 3
_PLACEMENT = re.compile(
    r'(%[\w#]+) = stablehlo\.custom_call @annotate_device_placement\((%[\w#]+)\).*'
    r'_xla_buffer_placement = "(\w+)".*-> tensor<([^>]*)>')


def offload_config(offload_optimizer=True, remat='none'):
  cfg = tiny_config()
  cfg.parallel.offload_optimizer = offload_optimizer
  cfg.model = dataclasses.replace(cfg.model, remat=remat)
  return cfg


def setup_step(cfg, mesh_cfg=MESH, zero=ZERO, devices=None):
  plan = make_plan(make_mesh(mesh_cfg, devices), zero)
  tx = optimizer.make_optimizer(cfg.optim, 10)
  return plan, tx, state.make_train_step(cfg, plan, tx, optimizer.lr_schedule(cfg.optim, 10))


def train(cfg, mesh_cfg=MESH, zero=ZERO, devices=None):
  """States and metrics after each of 3 steps (batches 0, 1, 0)."""
  plan, tx, step = setup_step(cfg, mesh_cfg, zero, devices)
  s = state.init_state(cfg, plan, tx)
  states, metrics = [], []
  for i in (0, 1, 0):
    s, m = step(s, jax.device_put(random_batch(cfg, i), plan.batch_sharding()))
    states.append(s)
    metrics.append(jax.device_get(m))
  return states, metrics


@pytest.fixture(scope='module')
def runs():
  return {'one': train(offload_config(False), MeshConfig(data=1), 0, jax.devices()[:1]),
          'mesh': train(offload_config(False)),
          'offload': train(offload_config(True))}


def memory_kinds(tree) -> set[str]:
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def test_optimizer_state_stays_in_host_memory(runs):
  for s in runs['offload'][0]:
    assert memory_kinds(s.opt_state) == {offload.HOST}
    assert memory_kinds(s.params) == {'device'}
  assert memory_kinds(runs['mesh'][0][-1].opt_state) == {'device'}


def test_offloaded_step_matches_one_device_and_resident_state(runs):
  for ref, got in zip(runs['one'][1], runs['offload'][1]):
    for key in ('loss', 'grad_norm', 'lr'):
      assert rel_err(got[key], ref[key]) < 1e-5, (key, ref, got)
  # The same step with the state resident: only where the state lives differs, so the
  # params and optimizer state after 3 steps are bitwise equal.
  resident, offloaded = runs['mesh'][0][-1], runs['offload'][0][-1]
  for a, b in zip(jax.tree.leaves(resident), jax.tree.leaves(offloaded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Step 3 reruns batch 0 after a real update (step 1 runs at warmup lr 0).
  assert runs['offload'][1][2]['loss'] < runs['offload'][1][0]['loss'] - 0.1


@pytest.mark.parametrize('zero', [0, 1, 2, 3])
def test_offload_keeps_each_zero_layout(zero):
  plan = make_plan(make_mesh(MESH), zero)
  tx = optimizer.make_optimizer(offload_config().optim, 10)
  resident = jax.tree.leaves(state.state_shardings(offload_config(False), plan, tx))
  offloaded = jax.tree.leaves(state.state_shardings(offload_config(True), plan, tx))
  n_opt = len(jax.tree.leaves(state.state_shardings(offload_config(), plan, tx).opt_state))
  assert [s.spec for s in resident] == [s.spec for s in offloaded]
  kinds = [s.memory_kind for s in offloaded]   # TrainState leaves: step, params, opt_state
  assert kinds[-n_opt:] == [offload.HOST] * n_opt and offload.HOST not in kinds[:-n_opt]


def _abstract_args(cfg, plan, tx):
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.batch_sharding())
           for k, v in random_batch(cfg).items()}
  return state.abstract_state(cfg, plan, tx), batch


def test_compiled_step_takes_and_returns_optimizer_state_in_host_memory():
  """The CPU program's entry layout: every optimizer-state buffer (its ZeRO shard) in
  host memory space S(5), in and out; parameters and batch in device memory."""
  cfg = offload_config()
  plan, tx, step = setup_step(cfg)
  args = _abstract_args(cfg, plan, tx)
  header = step.lower(*args).compile().as_text().splitlines()[0]
  layout = re.search(r'entry_computation_layout=\{\((.*)\)->\((.*)\)\}', header)
  on_host = lambda part: [array for array, layout in
                          re.findall(r'(\w+\[[^\]]*\])(\{[^}]*\})?', part) if 'S(5)' in layout]
  shards = [f'{x.dtype.name.replace("float", "f").replace("int", "s")}'
            f'[{",".join(map(str, x.sharding.shard_shape(x.shape)))}]'
            for x in jax.tree.leaves(args[0].opt_state)]
  assert on_host(layout.group(1)) == shards
  assert on_host(layout.group(2)) == shards


def _placements(text: str) -> list[tuple[str, str, str, str]]:
  """(result, operand, memory kind, result type) of each annotate_device_placement."""
  return [m.group(1, 2, 3, 4) for m in _PLACEMENT.finditer(text)]


def test_gpu_lowering_moves_optimizer_state_in_and_out():
  """Lowered for GPU: each host argument is moved to the device before the update and
  each new optimizer-state leaf back to host; without offload, no transfers at all."""
  cfg = offload_config()
  plan, tx, step = setup_step(cfg)
  n_opt = len(jax.tree.leaves(state.abstract_state(cfg, plan, tx).opt_state))
  text = step.trace(*_abstract_args(cfg, plan, tx)).lower(
      lowering_platforms=('cuda',)).as_text()
  main = text[text.index('func.func public @main'):]
  main = main[:main.index('\n  }')]
  signature, body = main.split('\n', 1)
  args = signature.split(') -> (')[0]
  host_args = re.findall(r'(%arg\d+): tensor<[^>]*> \{mhlo\.memory_kind = "pinned_host"', args)
  assert len(host_args) == n_opt
  assert signature.split(') -> (')[1].count('mhlo.memory_kind = "pinned_host"') == n_opt
  source = dict(re.findall(r'(%\w+) = sdy\.sharding_constraint (%arg\d+) ', body))
  placed = _placements(body)
  moved_in = {source.get(operand, operand) for _, operand, kind, _ in placed
              if kind == 'device'}
  assert set(host_args) <= moved_in
  assert sum(kind == offload.HOST for _, _, kind, _ in placed) == n_opt
  plan, tx, step = setup_step(offload_config(False))
  resident = step.trace(*_abstract_args(offload_config(False), plan, tx)).lower(
      lowering_platforms=('cuda',)).as_text()
  assert 'annotate_device_placement' not in resident


def test_checkpoint_restores_offloaded_state_into_host_memory(runs, tmp_path):
  cfg = offload_config()
  plan, tx, _ = setup_step(cfg)
  saved = runs['offload'][0][-1]
  # Host leaves are checksummed one by one on the device; the values are those of the
  # resident state, checksummed in one call.
  assert checkpoint.checksums(saved) == checkpoint.checksums(runs['mesh'][0][-1])
  ckpt = checkpoint.Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
  ckpt.save(3, saved, {'data': {}})
  ckpt.wait()
  # The same checkpoint restores into either placement (a run can turn offload on or off).
  for offload_optimizer, kind in ((True, offload.HOST), (False, 'device')):
    target = state.abstract_state(offload_config(offload_optimizer), plan, tx)
    restored, meta = ckpt.restore_latest(target)   # checksums verified on restore
    assert meta['step'] == 3 and memory_kinds(restored.opt_state) == {kind}
    assert memory_kinds(restored.params) == {'device'}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ckpt.close()


@pytest.fixture(scope='module')
def reference_grads():
  return sharded_loss_and_grads(tiny_config(), MeshConfig(data=1), 0, False, jax.devices()[:1])


def test_remat_offload_matches_no_remat(reference_grads):
  """remat='offload' on FSDP x TP with sequence parallelism equals one device, no remat."""
  loss, grads = sharded_loss_and_grads(offload_config(False, 'offload'),
                                       MeshConfig(data=1, fsdp=2, tensor=4), 3, True)
  ref_loss, ref_grads = reference_grads
  assert rel_err(loss, ref_loss) < 1e-5
  errs = jax.tree.map(rel_err, grads, ref_grads)
  assert max(jax.tree.leaves(errs)) < 1e-5, errs


def _loss_and_grads_fn(cfg):
  params = model.abstract_params(cfg.model)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in random_batch(cfg).items()}
  return jax.jit(lambda p, b: state.loss_and_grads(p, b, cfg, None)), (params, batch)


def test_gpu_lowering_offloads_named_activations_once_per_layer_loop():
  """Lowered for GPU: each named activation goes to host in the forward layer loop and
  comes back in the backward one. Two layers, one transfer each way per name: the
  transfers sit in the scanned body. No transfers under the other policies."""
  cfg = offload_config(False, 'offload')
  fn, args = _loss_and_grads_fn(cfg)
  placed = _placements(fn.trace(*args).lower(lowering_platforms=('cuda',)).as_text())
  m = cfg.model
  b, t, h, k, e = (cfg.data.batch_size, cfg.data.seq_len, m.num_heads, m.num_kv_heads,
                   m.resolved_head_dim)
  shapes = {'query': (b, t, h, e), 'key': (b, t, k, e), 'value': (b, t, k, e),
            'context': (b, t, h, e), 'mid_residual': (b, t, m.embed_dim),
            'mlp_gate': (b, t, m.resolved_mlp_dim), 'mlp_up': (b, t, m.resolved_mlp_dim)}
  assert set(shapes) == set(model.transformer.OFFLOADED)
  expected = sorted('x'.join(map(str, s)) + 'xf32' for s in shapes.values())
  for kind in (offload.HOST, 'device'):
    got = sorted(re.sub(r'\s', '', s) for s in _shapes_of(placed, kind))
    assert got == expected, (kind, got)
  for remat in ('none', 'full', 'save_matmuls'):
    fn, args = _loss_and_grads_fn(offload_config(False, remat))
    assert 'annotate_device_placement' not in fn.trace(*args).lower(
        lowering_platforms=('cuda',)).as_text()


def _shapes_of(placed, kind):
  return [shape for _, _, k, shape in placed if k == kind]


def test_cpu_program_offloads_activations():
  """Runs where this jax's CPU program itself moves activations to host memory."""
  fn, args = _loss_and_grads_fn(offload_config(False, 'offload'))
  compiled = fn.lower(*args).compile().as_text()
  if 'S(5)' not in compiled and 'annotate_device_placement' not in compiled:
    pytest.skip(f'jax {jax.__version__} lowers device_put inside jit to nothing on CPU '
                '(host and device memory are the same RAM), so the CPU program has no '
                'activation transfers; the GPU lowering is checked instead.')
  assert 'S(5)' in compiled


def test_validate_names_the_field_without_host_memory(monkeypatch):
  monkeypatch.setattr(offload, 'memory_kinds', lambda device: {'device'})
  cfg = offload_config(True)
  with pytest.raises(ValueError, match=r'parallel\.offload_optimizer=True needs '
                     r"'pinned_host'.*--config\.parallel\.offload_optimizer=False"):
    config_lib.validate(cfg, 8, platform='cpu')
  with pytest.raises(ValueError, match=r"model\.remat='offload' needs.*model\.remat=full"):
    config_lib.validate(offload_config(False, 'offload'), 8, platform='cpu')
  config_lib.validate(cfg, 8)   # no platform: nothing about devices is checked
  monkeypatch.undo()
  config_lib.validate(cfg, 8, platform='cpu')
  config_lib.validate(offload_config(False, 'offload'), 8, platform='cpu')


def test_train_with_offload_resumes_exactly(tmp_path):
  """train.py's loop: the offloaded state saved (async) at step 2 and resumed into host
  memory gives the same step 3 as a run that went on (equality with a resident run is
  test_offloaded_step_matches_one_device_and_resident_state's)."""
  cache_dir, tokens = str(tmp_path / 'corpus'), str(tmp_path / 'readme.bin')
  prepare.main(['--input', os.path.join(ROOT, 'README.md'), '--output', tokens])
  fixed = dict(data__train_files=tokens, sample__num_tokens=0, optim__decay_steps=3,
               mesh__data=2, mesh__fsdp=4, parallel__zero_stage=2,
               checkpoint__every_steps=2, parallel__offload_optimizer=True)
  cfg = tiny(tmp_path / 'resumed', cache_dir, steps=2, **fixed)
  assert 'optimizer state in host memory' in trainer.startup_line(trainer.setup(cfg), 0)
  first = trainer.train(cfg)
  resumed = trainer.train(tiny(tmp_path / 'resumed', cache_dir, steps=3, **fixed))
  straight = trainer.train(tiny(tmp_path / 'straight', cache_dir, steps=3, **fixed))
  assert [r['step'] for r in first + resumed] == [1, 2, 3]
  assert [r['loss'] for r in first + resumed] == [r['loss'] for r in straight]
