"""Serving a train.py workdir: parameters only, bitwise the trained ones, on any mesh,
the newest intact checkpoint, and the run's directory left untouched."""

import hashlib
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import AxisType, NamedSharding

import model
from serve.load.checkpoint import load_checkpoint
from sharding.mesh import MeshConfig, make_mesh
from sharding.rules import REPLICATED, make_plan
from training import checkpoint, optimizer, state, trainer
from training.cli import load_config_file
from training.tokenizer import ByteTokenizer


def _tiny(workdir, cache_dir):
  cfg = load_config_file('default.py:tiny')
  cfg.workdir, cfg.data.cache_dir = str(workdir), cache_dir
  cfg.metrics.progress_bar, cfg.sample.num_tokens = False, 0
  cfg.steps, cfg.checkpoint.every_steps = 2, 1
  return cfg


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """A trained workdir with checkpoints 1 and 2, and the full states saved in them."""
  root = tmp_path_factory.mktemp('loader')
  cfg = _tiny(root / 'run', str(root / 'cache'))
  trainer.train(cfg)
  plan = make_plan(make_mesh(MeshConfig(data=1), jax.devices()[:1]), 0)
  target = state.abstract_state(cfg, plan, optimizer.make_optimizer(cfg.optim, cfg.steps))
  # Reference: each step's whole train state through plain orbax, not our code. The item
  # holds the state's saved fields (a LoRA run's frozen base is never written).
  full = {step: state.TrainState(**ocp.StandardCheckpointer().restore(
      root / 'run' / 'checkpoints' / str(step) / 'state', _saved_fields(target)))
          for step in (1, 2)}
  return root / 'run', cfg, full


def _saved_fields(train_state) -> dict:
  """The fields a checkpoint's state item holds (a LoRA run's frozen base is never
  written), as plain orbax restores them."""
  return {'step': train_state.step, 'params': train_state.params,
          'opt_state': train_state.opt_state}


def _assert_params_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _snapshot(directory):
  """Every path under `directory` with its bytes' hash (dirs: None)."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for d in dirs:
      out[os.path.relpath(os.path.join(root, d), directory)] = None
    for f in files:
      path = os.path.join(root, f)
      with open(path, 'rb') as fh:
        out[os.path.relpath(path, directory)] = hashlib.sha256(fh.read()).hexdigest()
  return out


def _bytes_read():
  found = ts.experimental_collect_matching_metrics('/tensorstore/kvstore/file/bytes_read')
  assert found, 'tensorstore no longer reports bytes read; find another way to count'
  return found[0]['values'][0]['value']


def test_restores_the_newest_params_bitwise_with_the_run_config(run):
  workdir, cfg, full = run
  before = _snapshot(workdir)
  served = load_checkpoint(str(workdir))
  _assert_params_equal(served.params, full[2].params)
  assert not np.array_equal(np.asarray(full[1].params['embed']),
                            np.asarray(full[2].params['embed']))   # the steps differ
  assert served.model_cfg == cfg.model
  assert isinstance(served.tokenizer, ByteTokenizer)
  assert served.eos_token_ids == [256] and served.chat_template is None
  assert served.name == 'run'
  assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(served.params))
  assert _snapshot(workdir) == before


def test_a_workdir_relative_to_the_current_directory_loads(run, monkeypatch):
  """`--checkpoint runs/default`, as the README writes it (orbax wants absolute paths)."""
  workdir, _, full = run
  monkeypatch.chdir(workdir.parent)
  _assert_params_equal(load_checkpoint(workdir.name).params, full[2].params)


@pytest.mark.parametrize('shape, names', [((2,), ('tensor',)), ((4, 2), ('data', 'tensor'))])
def test_params_land_on_a_tensor_parallel_mesh(run, shape, names):
  workdir, cfg, full = run
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                       devices=jax.devices()[:int(np.prod(shape))])
  served = load_checkpoint(str(workdir), mesh)
  _assert_params_equal(served.params, full[2].params)
  axes = model.logical_axes(cfg.model)
  for x, a in zip(jax.tree.leaves(served.params),
                  jax.tree.leaves(axes, is_leaf=lambda t: isinstance(t, tuple))):
    assert x.sharding == NamedSharding(mesh, REPLICATED.spec(a)), a
  wq = served.params['layers']['wq']   # [L, D, H, E]: heads split in two
  assert wq.addressable_shards[0].data.shape[2] == cfg.model.num_heads // 2


def test_dtype_casts_the_checked_params_and_auto_is_the_runs_compute_dtype(run, tmp_path):
  """The float32 master weights are read and checksum-checked as saved, then cast: to
  --dtype, or under 'auto' to the run's model.dtype (a bfloat16-compute run is served in
  bfloat16), with the sharding kept."""
  workdir, cfg, full = run
  mesh = jax.make_mesh((2,), ('tensor',), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:2])
  b16 = load_checkpoint(str(workdir), mesh, dtype='bfloat16')
  assert (b16.model_cfg.dtype, b16.model_cfg.param_dtype) == ('bfloat16', 'bfloat16')
  want = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), full[2].params)
  _assert_params_equal(b16.params, want)
  assert b16.params['layers']['wq'].addressable_shards[0].data.shape[2] == (
      cfg.model.num_heads // 2)
  bf16_run = tmp_path / 'bf16_run'
  shutil.copytree(workdir, bf16_run)
  raw = json.loads((bf16_run / 'config.json').read_text())
  assert raw['model']['dtype'] == 'float32'
  raw['model']['dtype'] = 'bfloat16'   # compute dtype only: the saved tree is unchanged
  (bf16_run / 'config.json').write_text(json.dumps(raw))
  _assert_params_equal(load_checkpoint(str(bf16_run)).params, want)
  _assert_params_equal(load_checkpoint(str(bf16_run), dtype='float32').params,
                       full[2].params)
  with pytest.raises(ValueError, match=r"--dtype='int8' cannot be served"):
    load_checkpoint(str(workdir), dtype='int8')


def test_optimizer_state_is_not_read(run):
  workdir, _, full = run
  start = _bytes_read()
  served = load_checkpoint(str(workdir))
  params_only = _bytes_read() - start
  start = _bytes_read()
  ocp.StandardCheckpointer().restore(workdir / 'checkpoints' / '2' / 'state',
                                     _saved_fields(full[2]))
  whole = _bytes_read() - start
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(served.params))
  # AdamW keeps two moments per parameter: reading them would at least double the bytes.
  assert params_only < 1.1 * param_bytes, (params_only, param_bytes)
  assert whole > params_only + param_bytes, (whole, params_only)


def _flip_bits(step_dir, stride=997):
  """One bit every `stride` bytes of each array data file: wherever orbax put the
  parameters among the optimizer state, some of their bytes change."""
  flipped = 0
  for path in step_dir.rglob('*'):
    if path.is_file() and path.parent.parent.name.startswith('ocdbt.process_'):
      raw = bytearray(path.read_bytes())
      for i in range(len(raw) // 2 % stride, len(raw), stride):
        raw[i] ^= 1 << (i % 8)
        flipped += 1
      path.write_bytes(bytes(raw))
  assert flipped > 100


def test_damaged_newest_falls_back_and_changes_nothing(run, tmp_path, caplog):
  workdir, _, full = run
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy)
  _flip_bits(copy / 'checkpoints' / '2' / 'state')
  before = _snapshot(copy)
  with caplog.at_level(logging.WARNING, logger='training.checkpoint'):
    served = load_checkpoint(str(copy))
  _assert_params_equal(served.params, full[1].params)
  assert 'checkpoint 2 cannot be served' in caplog.text
  assert _snapshot(copy) == before
  _flip_bits(copy / 'checkpoints' / '1' / 'state')
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoint in .* intact'):
    load_checkpoint(str(copy))


@pytest.mark.parametrize('leaf, served_step', [(1, 1), (-1, 2)])
def test_checksums_guard_the_params_and_only_them(run, tmp_path, caplog, leaf, served_step):
  """A recorded checksum of a parameter (leaf 1: the first after `step`) that disagrees
  with the data makes the step unusable; one of the optimizer state (last leaf), which
  serving never reads, does not."""
  workdir, _, full = run
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy)
  meta_file = copy / 'checkpoints' / '2' / 'meta' / 'metadata'
  meta = json.loads(meta_file.read_text())
  meta['checksums'][leaf] ^= 1
  meta_file.write_text(json.dumps(meta))
  with caplog.at_level(logging.WARNING, logger='training.checkpoint'):
    served = load_checkpoint(str(copy))
  _assert_params_equal(served.params, full[served_step].params)
  assert ('parameter checksum mismatch' in caplog.text) == (served_step == 1)


def test_missing_workdir_or_checkpoints_are_clear_errors(run, tmp_path):
  workdir, _, _ = run
  with pytest.raises(FileNotFoundError, match='does not exist: --checkpoint takes'):
    load_checkpoint(str(tmp_path / 'nowhere'))
  with pytest.raises(FileNotFoundError, match='has no config.json'):
    load_checkpoint(str(tmp_path))
  shutil.copy(workdir / 'config.json', tmp_path / 'config.json')
  with pytest.raises(FileNotFoundError, match='checkpoints does not exist'):
    load_checkpoint(str(tmp_path))
  os.makedirs(tmp_path / 'checkpoints')
  with pytest.raises(FileNotFoundError, match='holds no checkpoint yet'):
    load_checkpoint(str(tmp_path))
  raw = json.loads((tmp_path / 'config.json').read_text())
  raw['model']['mixture_of_experts'] = 4
  (tmp_path / 'config.json').write_text(json.dumps(raw))
  with pytest.raises(ValueError, match=r"model fields \['mixture_of_experts'\]"):
    load_checkpoint(str(tmp_path))
