"""The newcomer path: degenerate mesh axes run, `--help` lists the config, `--check` sizes
a run without allocating, and bad input at start is one line with exit status 2."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from sharding.mesh import MeshConfig
from tests.test_train import ROOT, tiny
from training import config as config_lib, describe, family, optimizer, state, trainer
from training.cli import load_config_file
from sharding.mesh import make_mesh
from sharding.rules import make_plan


def cli(*args, devices=1, cwd=ROOT):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'JAX_NUM_CPU_DEVICES': str(devices)}
  return subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), *args], cwd=cwd,
                        capture_output=True, text=True, timeout=300, env=env)


def assert_one_line_error(result, *fragments):
  assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr[-2000:]
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('corpus'))


# --- Mesh axes of size 1 ------------------------------------------------------------------

@pytest.mark.parametrize('stage', [1, 3])
def test_zero_over_an_fsdp_axis_of_one_trains_like_dp(tmp_path, cache_dir, stage):
  """ZeRO-1/3 with mesh.fsdp=1 shards nothing: same losses as ZeRO-0, said at start."""
  fixed = dict(steps=3, sample__num_tokens=0, optim__decay_steps=3, mesh__data=8)
  dp = trainer.train(tiny(tmp_path / 'dp', cache_dir, **fixed))
  cfg = tiny(tmp_path / 'zero', cache_dir, parallel__zero_stage=stage, **fixed)
  assert 'fsdp=1: nothing to shard' in trainer.startup_line(trainer.setup(cfg), 0)
  zero = trainer.train(cfg)
  np.testing.assert_allclose([r['loss'] for r in zero], [r['loss'] for r in dp], rtol=1e-6)


# --- --help -------------------------------------------------------------------------------

def test_every_config_field_has_a_meaning():
  for name, section in describe.sections(config_lib.Config()):
    docs = describe.field_docs(type(section))
    for f in dataclasses.fields(section):
      if not dataclasses.is_dataclass(getattr(section, f.name)):
        assert len(docs.get(f.name, '')) > 5, f'{name}.{f.name} has no docstring under it'


def test_help_lists_the_chosen_configs_fields_and_variants():
  result = cli('--config=gpt_64k.py', '--help')
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "variants '', 'smoke'" in out
  rows = {line.split()[0]: line for line in out.splitlines() if line.startswith('  ')}
  full = load_config_file('gpt_64k.py')
  for name, section in describe.sections(full):
    for f in dataclasses.fields(section):
      value = getattr(section, f.name)
      if not dataclasses.is_dataclass(value):
        assert repr(value) in rows[f.name], rows[f.name]
  assert 'Embedding rows' in rows['vocab_size'] and '128256' in rows['vocab_size']


# --- --check ------------------------------------------------------------------------------

def test_check_sizes_gpt_64k_on_one_cpu_device():
  result = cli('--config=gpt_64k.py', '--check')
  assert result.returncode == 0, result.stderr
  assert '1,235,814,400 (1.24B)' in result.stdout
  assert 'needs 1 device(s)' in result.stdout and '524,288 tokens' in result.stdout
  result = cli('--config=gpt_64k.py', '--check', '--config.mesh.fsdp=4',
               '--config.mesh.tensor=8')   # a mesh bigger than this machine
  assert result.returncode == 0 and 'needs 32 device(s)' in result.stdout, result.stderr


@pytest.mark.parametrize('mesh, zero', [(dict(data=2, fsdp=4), 3), (dict(fsdp=4, tensor=2), 1),
                                        (dict(data=8), 0), (dict(data=2, fsdp=2, tensor=2), 2)])
def test_check_matches_the_bytes_a_real_state_holds(tmp_path, mesh, zero):
  """--check's per-device bytes equal the shards of a state really initialized on 8 devices."""
  cfg = tiny(tmp_path, str(tmp_path))
  cfg.mesh = MeshConfig(**{'data': 1, **mesh})
  cfg.parallel.zero_stage = zero
  size = describe.run_size(cfg, 8)
  plan = make_plan(make_mesh(cfg.mesh), zero)
  tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
  real = state.init_state(cfg, plan, tx)
  device = jax.devices()[0]
  on_device = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree)
                               for s in x.addressable_shards if s.device == device)
  assert size['param_bytes'] == on_device(real.params)
  assert size['opt_state_bytes'] == on_device(real.opt_state)
  grads = jax.tree.map(lambda p, sh: jax.device_put(np.zeros(p.shape, p.dtype), sh),
                       real.params, plan.tree(plan.grads, family.of(cfg).logical_axes()))
  assert size['grad_bytes'] == on_device(grads)


# --- Bad input at start -------------------------------------------------------------------

def test_mesh_bigger_than_the_machine_says_how_to_simulate_it(tmp_path):
  result = cli('--config=default.py:tiny', f'--config.workdir={tmp_path}',
               '--config.mesh.tensor=2', '--config.mesh.fsdp=2')
  assert_one_line_error(result, 'JAX_NUM_CPU_DEVICES=4 python train.py')


def test_cudnn_attention_on_cpu_is_refused_at_start(tmp_path):
  result = cli('--config=gpt_64k.py', f'--config.workdir={tmp_path}',
               '--config.model.attention_impl=cudnn')
  assert_one_line_error(result, "model.attention_impl='cudnn' needs a GPU", '--check')


BROKEN_CONFIG = 'def get_config(variant=""):\n  raise RuntimeError("boom")\n'


@pytest.mark.parametrize('mode', [[], ['--check'], ['--help']])
@pytest.mark.parametrize('args, fragments', [
    (['--config=BROKEN'], ['get_config failed', 'boom']),
    (['--config=default.py:nosuch'], ["not 'nosuch'"]),
    (['--config.model.nonexistent=1'], ["unknown config field 'nonexistent'"]),
    (['--config.model.num_layers=two'], ['num_layers', 'two']),
    (['--config=no_such_config.py'], ['no such file']),
])
def test_bad_config_input_is_one_line(tmp_path, mode, args, fragments):
  (tmp_path / 'broken.py').write_text(BROKEN_CONFIG)
  args = [a.replace('BROKEN', str(tmp_path / 'broken.py')) for a in args]
  assert_one_line_error(cli(*args, *mode, f'--config.workdir={tmp_path}'), *fragments)


def test_truncated_token_file_stops_before_compiling(tmp_path):
  text = tmp_path / 'a.txt'
  text.write_text('hello world, ' * 200)
  subprocess.run([sys.executable, '-m', 'training.prepare', '--input', str(text), '--output',
                  str(tmp_path / 'a.bin')], check=True, capture_output=True, cwd=ROOT)
  raw = (tmp_path / 'a.bin').read_bytes()
  (tmp_path / 'a.bin').write_bytes(raw[:-10])
  result = cli('--config=default.py:tiny', f'--config.workdir={tmp_path / "run"}',
               f'--config.data.train_files={tmp_path / "a.bin"}')
  assert_one_line_error(result, 'a.bin', 'truncated', 'training.prepare')
  assert not (tmp_path / 'run' / 'checkpoints').exists()


def test_prepare_with_a_file_that_is_no_tokenizer(tmp_path):
  (tmp_path / 'a.txt').write_text('text')
  (tmp_path / 'tok.json').write_text('{"not": ')
  result = subprocess.run(
      [sys.executable, '-m', 'training.prepare', '--input', str(tmp_path / 'a.txt'),
       '--output', str(tmp_path / 'a.bin'), '--tokenizer', str(tmp_path / 'tok.json')],
      capture_output=True, text=True, cwd=ROOT)
  assert_one_line_error(result, 'tok.json', 'is not a Hugging Face tokenizer.json')
  assert not (tmp_path / 'a.bin').exists()


def test_prepare_warns_of_empty_documents(tmp_path):
  (tmp_path / 'empty.txt').write_text('')
  (tmp_path / 'd.jsonl').write_text(json.dumps({'text': 'x'}) + '\n' +
                                    json.dumps({'text': ''}) + '\n')
  result = subprocess.run(
      [sys.executable, '-m', 'training.prepare', '--input', str(tmp_path / 'empty.txt'),
       str(tmp_path / 'd.jsonl'), '--output', str(tmp_path / 'a.bin')],
      capture_output=True, text=True, cwd=ROOT)
  assert result.returncode == 0, result.stderr
  warnings = [l for l in result.stderr.splitlines() if l.startswith('warning:')]
  assert len(warnings) == 2 and 'empty.txt is empty' in warnings[0], result.stderr
