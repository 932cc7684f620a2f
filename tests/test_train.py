"""End to end: training lowers the loss, resumes exactly, verifies checkpoints, and
rejects bad input with a message naming what to fix."""

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

import model
from training import checkpoint, trainer
from training import state as train_state
from training.cli import load_config_file
from training.config import CheckpointConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ('step', 'loss', 'grad_norm', 'lr', 'tokens_per_sec', 'step_time_s', 'mfu')


@pytest.fixture(scope='session')
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('corpus'))


def run_cli(*args):
  return subprocess.run([sys.executable, 'train.py', *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})


def tiny(workdir, cache_dir, **overrides):
  cfg = load_config_file('default.py:tiny')
  cfg.workdir, cfg.data.cache_dir = str(workdir), cache_dir
  cfg.metrics.progress_bar = False
  for key, value in overrides.items():
    section, _, field = key.rpartition('__')
    setattr(getattr(cfg, section) if section else cfg, field, value)
  return cfg


def read_scalars(tensorboard_dir) -> dict:
  """{(tag, step): value} from the TFRecord event files (length, crc, event, crc)."""
  scalars = {}
  for name in os.listdir(tensorboard_dir):
    raw, at = open(os.path.join(tensorboard_dir, name), 'rb').read(), 0
    while at < len(raw):
      (length,) = struct.unpack('<Q', raw[at:at + 8])
      event = event_pb2.Event.FromString(raw[at + 12:at + 12 + length])
      at += 16 + length
      for value in event.summary.value:
        scalars[value.tag, event.step] = value.simple_value
  return scalars


def test_training_lowers_loss_and_writes_run_files(tmp_path, cache_dir):
  # Saves at 6, 12, 18 and the last step 20 (not a multiple of 6); keep=2 prunes to 18, 20.
  cfg = tiny(tmp_path, cache_dir, metrics__peak_tflops_per_device=0.5,
             checkpoint__every_steps=6, checkpoint__keep=2)
  history = trainer.train(cfg)
  losses = [r['loss'] for r in history]
  assert len(losses) == 20
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.0, losses
  lines = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert [l['step'] for l in lines] == list(range(1, 21))
  assert all(set(REQUIRED) <= set(l) for l in lines)
  assert json.load(open(tmp_path / 'config.json'))['model']['num_layers'] == 2
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['18', '20']
  scalars = read_scalars(tmp_path / 'tensorboard')   # every logged number, read back
  for l in lines:
    for key in REQUIRED[1:]:
      assert scalars[f'train/{key}', l['step']] == pytest.approx(l[key], rel=1e-6), key
  # MFU: analytic model FLOPs per step over the configured peak of all devices.
  tokens = cfg.data.batch_size * cfg.data.seq_len
  step_flops = model.flops_per_token(cfg.model, cfg.data.seq_len) * tokens
  for r in lines:
    assert r['tokens_per_sec'] == pytest.approx(tokens / r['step_time_s'])
    assert r['mfu'] == pytest.approx(step_flops / r['step_time_s'] / (0.5e12 * jax.device_count()))


def test_metrics_are_fetched_while_the_next_step_runs(tmp_path, cache_dir, monkeypatch):
  """Step k's metrics come to the host after step k+1 is dispatched, except where the
  loop needs them at once (checkpoint steps: 3 and the last, 6); every step is recorded."""
  order, real_compile, real_get = [], trainer.compile_step, jax.device_get

  def compile_step(*args):
    compiled = real_compile(*args)

    def run(state, batch):
      order.append('dispatch')
      return compiled(state, batch)
    return run

  def device_get(x):
    if isinstance(x, dict) and 'loss' in x:
      order.append('fetch')
    return real_get(x)
  monkeypatch.setattr(trainer, 'compile_step', compile_step)
  monkeypatch.setattr(trainer.jax, 'device_get', device_get)
  history = trainer.train(tiny(tmp_path, cache_dir, steps=6, checkpoint__every_steps=3,
                               sample__num_tokens=0))
  assert [r['step'] for r in history] == [1, 2, 3, 4, 5, 6]
  #         step 1      2 (1 fetched)      3 (2, then 3: a checkpoint)
  assert order == ['dispatch', 'dispatch', 'fetch', 'dispatch', 'fetch', 'fetch',
                   'dispatch', 'dispatch', 'fetch', 'dispatch', 'fetch', 'fetch']


def test_resume_continues_exactly(tmp_path, cache_dir, capsys):
  """Stop after 6 steps, rerun with steps=12: steps 7..12 match an uninterrupted run.
  The reruns read the train step from the suite's compilation cache, and say so."""
  fixed = {'optim__decay_steps': 12, 'checkpoint__every_steps': 3, 'sample__num_tokens': 0}
  full = trainer.train(tiny(tmp_path / 'full', cache_dir, steps=12, **fixed))
  first = trainer.train(tiny(tmp_path / 'split', cache_dir, steps=6, **fixed))
  capsys.readouterr()
  rest = trainer.train(tiny(tmp_path / 'split', cache_dir, steps=12, **fixed))
  assert 'train step read from the compilation cache in' in capsys.readouterr().err
  assert [r['step'] for r in rest] == list(range(7, 13))
  np.testing.assert_allclose([r['loss'] for r in first + rest],
                             [r['loss'] for r in full], rtol=1e-6)


def float64_loss(params, model_cfg, batches) -> tuple[float, float]:
  """(weighted mean token nll, total weight) of batches, float64 numpy on the logits."""
  nll = weight = 0.0
  for b in batches:
    hidden = model.forward(params, jnp.asarray(b['inputs']), model_cfg,
                           positions=jnp.asarray(b['positions']),
                           segment_ids=jnp.asarray(b['segment_ids']))
    logits = np.asarray(model.logits(params, hidden, model_cfg), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, b['targets'][..., None].astype(np.int64), -1)[..., 0]
    nll -= float(np.sum(picked * b['weights']))
    weight += float(np.sum(b['weights']))
  return nll / weight, weight


def test_evaluation_reports_the_held_out_loss(tmp_path, cache_dir, capsys, monkeypatch):
  """eval.every_steps=3 over 7 steps, on a ZeRO-3 x tensor mesh with 2 microbatches:
  evaluations after steps 3, 6 and the last, in metrics.jsonl, TensorBoard and on the
  console; the last equals a float64 numpy loss of the saved step-7 weights over the same
  held-out windows (the end of the training data, which training never reads)."""
  from serve.load.checkpoint import load_checkpoint  # pylint: disable=import-outside-toplevel
  from training import data  # pylint: disable=import-outside-toplevel
  cfg = tiny(tmp_path, cache_dir, steps=7, eval__every_steps=3, eval__batches=2,
             mesh__data=2, mesh__fsdp=2, mesh__tensor=2, parallel__zero_stage=3,
             optim__grad_accum=2, sample__num_tokens=0)
  held_out, make_iterator = [], data.make_train_iterator

  def spy(*args, **kwargs):   # the trainer's training data leaves the eval windows out
    held_out.append(kwargs.get('held_out'))
    return make_iterator(*args, **kwargs)
  monkeypatch.setattr(data, 'make_train_iterator', spy)
  history = trainer.train(cfg)
  assert held_out == [2 * 8]   # eval.batches x data.batch_size
  assert [r['step'] for r in history if 'eval_loss' in r] == [3, 6, 7]
  assert 'eval at step 7: loss' in capsys.readouterr().err
  batches = data.make_eval_batches(cfg)
  assert len(batches) == 2 and batches[0]['inputs'].shape == (8, 32)
  served = load_checkpoint(str(tmp_path), dtype='float32')
  want, tokens = float64_loss(served.params, served.model_cfg, batches)
  last = history[-1]
  assert last['eval_loss'] == pytest.approx(want, rel=1e-5)
  assert last['eval_tokens'] == tokens and last['eval_perplexity'] == pytest.approx(
      np.exp(want), rel=1e-4)
  assert history[2]['eval_loss'] > last['eval_loss']   # it learned, held out too
  lines = {l['step']: l for l in map(json.loads, open(tmp_path / 'metrics.jsonl'))}
  scalars = read_scalars(tmp_path / 'tensorboard')
  for step in (3, 6, 7):
    assert lines[step]['eval_loss'] == history[step - 1]['eval_loss']
    assert scalars['eval/loss', step] == pytest.approx(lines[step]['eval_loss'], rel=1e-6)


def test_evaluation_under_pipeline_and_context_parallelism(tmp_path, cache_dir):
  """The eval step is the training loss's forward on the run's own mesh: with 2 pipeline
  stages, and with the context split in 2 (its load-balance reorder), the evaluation
  after the last step equals the float64 loss of the saved weights."""
  from serve.load.checkpoint import load_checkpoint  # pylint: disable=import-outside-toplevel
  from training import data  # pylint: disable=import-outside-toplevel
  for name, mesh in (('pipeline', {'mesh__stage': 2, 'mesh__data': 4}),
                     ('context', {'mesh__context': 2, 'mesh__data': 4})):
    cfg = tiny(tmp_path / name, cache_dir, steps=2, eval__every_steps=2, eval__batches=1,
               sample__num_tokens=0, **mesh)
    last = trainer.train(cfg)[-1]
    served = load_checkpoint(str(tmp_path / name), dtype='float32')
    want, _ = float64_loss(served.params, served.model_cfg, data.make_eval_batches(cfg))
    assert last['eval_loss'] == pytest.approx(want, rel=1e-5), name


def test_turning_evaluation_on_over_a_trained_checkpoint_says_the_windows_were_seen(
    tmp_path, cache_dir, capsys):
  """The held-out windows of a resumed run may have been trained on before they were
  held out: the run says so rather than report the loss as unseen data's."""
  fixed = {'sample__num_tokens': 0, 'optim__decay_steps': 4}
  trainer.train(tiny(tmp_path, cache_dir, steps=2, **fixed))
  capsys.readouterr()
  trainer.train(tiny(tmp_path, cache_dir, steps=3, eval__every_steps=1, eval__batches=1,
                     **fixed))
  assert 'its eval loss is not on unseen data' in capsys.readouterr().err


def test_fine_tuning_starts_from_hugging_face_weights(tmp_path, cache_dir, tiny_workdir,
                                                     capsys):
  """init_from_hf: the run takes the directory's architecture (over the config's
  num_layers) and tokenizer, starts from its weights bit for bit with a fresh optimizer,
  and its first loss is the float64 loss of those weights on its first batch; a rerun
  resumes from its own checkpoint without reading the directory again."""
  from serve import hf_export  # pylint: disable=import-outside-toplevel
  from serve.load.checkpoint import load_checkpoint  # pylint: disable=import-outside-toplevel
  from training import data  # pylint: disable=import-outside-toplevel
  released = str(tmp_path / 'released')
  hf_export.export(tiny_workdir, released)
  want = load_checkpoint(tiny_workdir, dtype='float32')
  cfg = tiny(tmp_path / 'run', cache_dir, init_from_hf=released, steps=2,
             model__num_layers=5, sample__num_tokens=0, optim__decay_steps=4)
  t = trainer.setup(cfg)
  assert t.cfg.model.num_layers == want.model_cfg.num_layers == 2
  assert t.cfg.data.tokenizer == os.path.join(released, 'tokenizer.json')
  assert 'init_from_hf sets model.num_layers=2' in capsys.readouterr().err
  start_state, start = trainer.restore_or_init(t)
  assert start == 0 and int(start_state.step) == 0
  assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(start_state.opt_state))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               start_state.params, want.params)
  first_batch = next(t.data_iter)
  t.data_iter.close()
  history = trainer.train(cfg)
  reference, _ = float64_loss(want.params, want.model_cfg, [first_batch])
  assert history[0]['loss'] == pytest.approx(reference, rel=1e-5)
  assert json.load(open(tmp_path / 'run' / 'config.json'))['model']['num_layers'] == 2
  capsys.readouterr()
  cfg.steps = 4
  rest = trainer.train(cfg)
  err = capsys.readouterr().err
  assert [r['step'] for r in rest] == [3, 4] and 'resumed from step 2' in err
  assert 'initialized from the Hugging Face model' not in err
  # The directory decides the experts too: a Llama's run has none, whatever the config.
  t = trainer.setup(tiny(tmp_path / 'dense', cache_dir, init_from_hf=released,
                         model__num_experts=4))
  t.data_iter.close()
  assert t.cfg.model.num_experts == 0
  other = tmp_path / 'other'
  shutil.copytree(released, other)
  config = json.loads((other / 'config.json').read_text())
  (other / 'config.json').write_text(json.dumps({**config,
                                                 'architectures': ['GPT2LMHeadModel']}))
  for overrides, message in (({'init_from_hf': str(tmp_path / 'none')}, 'does not exist'),
                             ({'init_from_hf': str(other)},
                              r"architectures=\['GPT2LMHeadModel'\] is not supported")):
    with pytest.raises(trainer.ConfigError, match=message):
      trainer.setup(tiny(tmp_path / 'bad', cache_dir, **overrides))


def test_fine_tuning_a_mixtral_takes_its_experts_and_says_what_capacity_drops(
    tmp_path, cache_dir, capsys):
  """init_from_hf on a Mixtral directory: the run gets its experts, and a run that keeps
  capacity dispatch (the default) is told that it drops tokens the released model never
  drops; dropless is not."""
  from model.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from model.hf import hf_config, hf_tensors  # pylint: disable=import-outside-toplevel
  from serve import hf_export  # pylint: disable=import-outside-toplevel
  moe = ModelConfig(vocab_size=300, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=64, num_experts=4, experts_per_token=2)
  released = str(tmp_path / 'mixtral')
  os.makedirs(released)
  hf_export._write(released, hf_config(moe, 'float32', 256),  # pylint: disable=protected-access
                   hf_tensors(model.init_params(moe, jax.random.key(0)), moe),
                   hf_export.byte_tokenizer_json(), '<|endoftext|>', moe.max_seq_len, 256)
  for dispatch, told in (('capacity', True), ('dropless', False)):
    capsys.readouterr()
    t = trainer.setup(tiny(tmp_path / dispatch, cache_dir, init_from_hf=released,
                           model__moe_dispatch=dispatch))
    t.data_iter.close()
    assert (t.cfg.model.num_experts, t.cfg.model.experts_per_token) == (4, 2)
    err = ' '.join(capsys.readouterr().err.split())   # the console wraps its lines
    assert 'init_from_hf sets' in err and 'model.num_experts=4' in err
    assert ('drops those over model.capacity_factor=1.25' in err) == told, err


def test_train_py_with_pallas_attention_matches_xla(tmp_path, cache_dir):
  """`python train.py --config.model.attention_impl=pallas` (interpret mode on CPU)."""
  losses = {}
  for impl in ('xla', 'pallas'):
    result = run_cli('--config=default.py:tiny', f'--config.workdir={tmp_path / impl}',
                     f'--config.data.cache_dir={cache_dir}', '--config.steps=4',
                     '--config.sample.num_tokens=0', f'--config.model.attention_impl={impl}')
    assert result.returncode == 0, result.stderr[-3000:]
    losses[impl] = [json.loads(l)['loss'] for l in open(tmp_path / impl / 'metrics.jsonl')]
  assert len(losses['xla']) == 4
  np.testing.assert_allclose(losses['pallas'], losses['xla'], rtol=1e-5)


class InterruptAfter:
  """A data iterator that raises KeyboardInterrupt (Ctrl-C) when asked for batch n+1."""

  def __init__(self, it, n):
    self.it, self.left = it, n

  def __next__(self):
    if self.left == 0:
      raise KeyboardInterrupt
    self.left -= 1
    return next(self.it)

  def __getattr__(self, name):
    return getattr(self.it, name)


FIXED_6 = {'optim__decay_steps': 6, 'sample__num_tokens': 0}


@pytest.fixture(scope='module')
def reference_6(tmp_path_factory, cache_dir):
  """An uninterrupted 6-step run that interrupted and damaged runs must reproduce."""
  return trainer.train(tiny(tmp_path_factory.mktemp('full6'), cache_dir, steps=6, **FIXED_6))


def test_ctrl_c_saves_the_last_step_and_resume_continues(tmp_path, cache_dir, monkeypatch,
                                                         reference_6):
  fixed = {**FIXED_6, 'checkpoint__every_steps': 100}
  real = trainer.data.make_train_iterator
  with monkeypatch.context() as m:
    m.setattr(trainer.data, 'make_train_iterator',
              lambda *a, **k: InterruptAfter(real(*a, **k), 3))
    with pytest.raises(KeyboardInterrupt):
      trainer.train(tiny(tmp_path / 'run', cache_dir, steps=6, **fixed))
  assert os.listdir(tmp_path / 'run' / 'checkpoints') == ['3']
  # every step that ran is logged, the last one too (fetched one step late, it was
  # still pending when the interrupt came)
  logged = [json.loads(l)['step'] for l in open(tmp_path / 'run' / 'metrics.jsonl')]
  assert logged == [1, 2, 3]
  rest = trainer.train(tiny(tmp_path / 'run', cache_dir, steps=6, **fixed))
  np.testing.assert_allclose([r['loss'] for r in rest], [r['loss'] for r in reference_6[3:]],
                             rtol=1e-6)


def largest_state_file(step_dir):
  return max((p for p in (step_dir / 'state').rglob('*') if p.is_file()),
             key=lambda p: p.stat().st_size)


def truncate_array_data(step_dir, ckpt=None, target=None):
  """Undecodable damage: the largest array data file loses its second half."""
  del ckpt, target
  path = largest_state_file(step_dir)
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def flip_one_array_bit(step_dir, ckpt, target):
  """Damage that still decodes: the low bit of one byte of the largest array data file,
  the first of 64 bytes from its middle on after whose flip the step still decodes. The
  arrays' zstd chunks are packed into that file in an order that varies from run to run;
  a flip inside an entropy-coded block does not decode (on 2026-11-26 the middle byte,
  the only one tried then, once did not). Which flip decodes is asked of the
  checkpointer's own restore, so with its checksum comparison gone none is found and
  the test fails."""
  step = int(step_dir.name)
  path = largest_state_file(step_dir)
  raw = bytearray(path.read_bytes())
  for at in range(len(raw) // 2, len(raw), max(1, len(raw) // 128))[:64]:
    raw[at] ^= 1
    path.write_bytes(bytes(raw))
    if ckpt._try_restore(step, target)[0] == 'checksum-mismatch':  # pylint: disable=protected-access
      return
    raw[at] ^= 1
  path.write_bytes(bytes(raw))
  raise AssertionError(f'no flipped bit of {path} decodes into a checksum mismatch')


def small_checkpointer(directory, keep=3):
  cfg = CheckpointConfig(every_steps=2, keep=keep, async_save=False)
  return checkpoint.Checkpointer(str(directory), cfg)


def small_state(seed):
  rng = np.random.default_rng(seed)
  return {'w': jnp.asarray(rng.normal(size=(64, 64)), jnp.float32),
          'b': jnp.asarray(rng.integers(0, 100, size=7), jnp.int32)}


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('damage, reason', [(flip_one_array_bit, 'checksum-mismatch'),
                                            (truncate_array_data, None)])
def test_damaged_step_is_rejected_and_moved_aside(tmp_path, caplog, damage, reason):
  """The newest step is damaged: the restore says why, falls back, and moves the damaged
  step to checkpoints/damaged/ where orbax neither lists nor prunes it."""
  ckpt, states = small_checkpointer(tmp_path), {2: small_state(2), 4: small_state(4)}
  for step, tree in states.items():
    ckpt.save(step, tree, {'data': step})
  ckpt.wait()
  target = jax.tree.map(jnp.zeros_like, states[2])
  damage(tmp_path / '4', ckpt, target)
  state, meta = ckpt.restore_latest(target)
  assert meta['step'] == 2
  assert_trees_equal(state, states[2])
  [rejected] = ckpt.rejected
  assert rejected['step'] == 4
  if reason:   # the array decoded, only the checksum comparison could see the flipped bit
    assert rejected['reason'] == reason
    assert 'checkpoint 4 cannot be used (checksum mismatch)' in caplog.text
  else:        # undecodable: the restore itself raised
    assert rejected['reason'] != 'checksum-mismatch'
    assert rejected['reason'] in rejected['error']
  moved = tmp_path / 'damaged' / f'4-{rejected["reason"]}'
  assert rejected['moved_to'] == str(moved) and str(moved) in caplog.text
  assert (moved / 'state').is_dir() and not (tmp_path / '4').exists()
  logged = [json.loads(l) for l in open(tmp_path / 'damaged' / 'rejected.jsonl')]
  assert logged == [rejected]
  # The run saves step 4 again; keep=3 prunes step 2 but never the quarantined copy.
  for step in (4, 6, 8):
    ckpt.save(step, small_state(step), {'data': step})
  ckpt.wait()
  assert ckpt.steps() == [4, 6, 8]
  ckpt.close()
  reopened = small_checkpointer(tmp_path)   # a new run lists the same steps
  assert reopened.steps() == [4, 6, 8]
  reopened.close()
  assert sorted(os.listdir(tmp_path)) == ['4', '6', '8', 'damaged']
  assert (moved / 'state').is_dir()


def test_damaged_checkpoint_falls_back_to_previous(tmp_path, cache_dir, reference_6):
  """End to end: a bit flipped in step 4's arrays; the resumed run falls back to step 2,
  retrains 3..6 exactly like an uninterrupted run and saves step 4 again."""
  cfg = tiny(tmp_path, cache_dir, steps=4, checkpoint__every_steps=2, **FIXED_6)
  trainer.train(cfg)
  t = trainer.setup(cfg)
  t.data_iter.close()
  flip_one_array_bit(tmp_path / 'checkpoints' / '4', t.ckpt,
                     train_state.abstract_state(t.cfg, t.plan, t.tx))
  t.ckpt.close()
  cfg.steps = 6
  rest = trainer.train(cfg)
  assert [r['step'] for r in rest] == [3, 4, 5, 6]
  np.testing.assert_allclose([r['loss'] for r in rest], [r['loss'] for r in reference_6[2:]],
                             rtol=1e-6)
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4', '6', 'damaged']
  assert os.path.isdir(tmp_path / 'checkpoints' / 'damaged' / '4-checksum-mismatch')


def test_unrestorable_checkpoints_stop_the_run(tmp_path, cache_dir):
  cfg = tiny(tmp_path, cache_dir, steps=2, checkpoint__every_steps=2, sample__num_tokens=0)
  trainer.train(cfg)
  cfg.model.embed_dim, cfg.steps = 32, 4   # a different model in the same workdir
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoint .* can be restored'):
    trainer.train(cfg)
  assert os.listdir(tmp_path / 'checkpoints') == ['2']   # nothing moved or deleted


def test_resume_onto_another_mesh(tmp_path, cache_dir):
  """Checkpoint under DP over 8, continue under FSDP 4 x TP 2 (ZeRO-3): same losses."""
  fixed = {'optim__decay_steps': 8, 'checkpoint__every_steps': 4, 'sample__num_tokens': 0}
  full = trainer.train(tiny(tmp_path / 'full', cache_dir, steps=8, **fixed))
  trainer.train(tiny(tmp_path / 'run', cache_dir, steps=4, **fixed))
  rest = trainer.train(tiny(tmp_path / 'run', cache_dir, steps=8, mesh__data=1, mesh__fsdp=4,
                            mesh__tensor=2, parallel__zero_stage=3, **fixed))
  np.testing.assert_allclose([r['loss'] for r in rest], [r['loss'] for r in full[4:]],
                             rtol=1e-5)


def test_checksum_sees_one_flipped_bit_and_ignores_the_mesh():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
  tree = {'w': x, 'b': jnp.arange(5, dtype=jnp.int32)}
  flipped = np.asarray(x).copy()
  flipped.view(np.uint32)[3, 7] ^= 1
  assert checkpoint.checksums(tree) != checkpoint.checksums({**tree, 'w': jnp.asarray(flipped)})
  mesh = jax.make_mesh((8,), ('d',), axis_types=(jax.sharding.AxisType.Auto,))
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('d')))
  assert checkpoint.checksums(tree) == checkpoint.checksums({**tree, 'w': sharded})


@pytest.mark.parametrize('args, expected', [
    (['--config.model.nonexistent=1'], "unknown config field 'nonexistent'"),
    (['--config.mesh.tensor=3'], 'mesh.tensor=3'),
    (['--config.model.num_heads=3'], 'model.num_heads'),
    (['--config.data.train_files=/no/such/dir/*.bin'], 'data.train_files'),
    (['--config.model.num_layers=two'], 'num_layers'),
])
def test_bad_input_fails_with_a_clear_message(args, expected, tmp_path):
  result = run_cli('--config=default.py:tiny', f'--config.workdir={tmp_path}', *args)
  assert result.returncode != 0
  assert expected in result.stderr, result.stderr[-2000:]
  assert 'Traceback' not in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize('overrides, message', [
    ({'mesh__data': 2, 'mesh__tensor': 4, 'data__seq_len': 30}, 'data.seq_len=30'),
    ({'mesh__stage': 2, 'mesh__data': 4, 'parallel__pipeline_repeats': 3},
     'mesh.stage x parallel.pipeline_repeats = 6'),
    ({'optim__grad_accum': 3}, 'optim.grad_accum=3'),
    ({'eval__every_steps': -1}, 'eval.every_steps=-1'),
    ({'eval__every_steps': 5, 'eval__files': '/no/such/dir/*.bin'},
     "eval.files: no token file matches '/no/such/dir/*.bin'"),
    ({'eval__every_steps': 5, 'eval__batches': 10 ** 6}, 'fewer than eval.batches x '
     'data.batch_size = 8000000: lower eval.batches or add data'),
])
def test_config_that_cannot_run_names_the_field(tmp_path, cache_dir, overrides, message):
  with pytest.raises(trainer.ConfigError, match=re.escape(message)):
    trainer.setup(tiny(tmp_path, cache_dir, **overrides))


def test_dimension_that_does_not_split_names_the_field(tmp_path, cache_dir):
  cfg = tiny(tmp_path, cache_dir, model__embed_dim=36, model__head_dim=16,
             mesh__data=1, mesh__fsdp=8, parallel__zero_stage=3)
  with pytest.raises(trainer.ConfigError, match=r'model\.embed_dim divisible by 8'):
    trainer.setup(cfg)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def launch_two(args: list[str], per_process=((), ()), devices=(4, 4)):
  """train.py in 2 processes of `devices` CPU devices (gloo), each with its own extra
  arguments; returns (exit codes, outputs)."""
  args = [*args, f'--config.distributed.coordinator=127.0.0.1:{free_port()}',
          '--config.distributed.num_processes=2']
  procs = []
  for i in range(2):
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
           'XLA_FLAGS': f'{os.environ.get("XLA_FLAGS", "")} '
                        f'--xla_force_host_platform_device_count={devices[i]}'}
    procs.append(subprocess.Popen([sys.executable, 'train.py', *args, *per_process[i],
                                   f'--config.distributed.process_id={i}'],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  try:
    outputs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  return [p.returncode for p in procs], outputs


@pytest.mark.parametrize('mesh', [{'data': 8}, {'data': 1, 'context': 4, 'tensor': 2}])
def test_two_processes_train_like_one(tmp_path, cache_dir, mesh):
  """2 processes x 4 CPU devices (gloo) = 1 process x 8 devices: each process loads the
  rows its devices hold (all of them when context spans the processes, as in the second
  layout) and the global batch is assembled whole, so the losses agree."""
  overrides = {f'mesh__{k}': v for k, v in mesh.items()}
  one = trainer.train(tiny(tmp_path / 'one', cache_dir, steps=4, sample__num_tokens=0,
                           **overrides))
  codes, outputs = launch_two(
      ['--config=default.py:tiny', f'--config.workdir={tmp_path / "two"}',
       f'--config.data.cache_dir={cache_dir}', '--config.steps=4',
       '--config.sample.num_tokens=0', '--config.metrics.progress_bar=False',
       *(f'--config.mesh.{k}={v}' for k, v in mesh.items())])
  assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
  two = [json.loads(l) for l in open(tmp_path / 'two' / 'metrics.jsonl')]
  np.testing.assert_allclose([r['loss'] for r in two], [r['loss'] for r in one], rtol=1e-5)


def test_processes_may_differ_in_per_host_settings_and_paths(tmp_path, cache_dir):
  """Caches, the coordinator's address, the progress bar and paths that name the same
  files may differ per host; the files, the tokenizer and the model may not."""
  # pylint: disable-next=import-outside-toplevel
  from training import processes, tokenizer as tokenizer_lib
  (tmp_path / 'host0').mkdir()
  (tmp_path / 'host0' / 'part.bin').write_bytes(b'x' * 10)
  (tmp_path / 'host1').symlink_to(tmp_path / 'host0')
  byte = tokenizer_lib.load_tokenizer('byte')

  def host(i, **overrides):
    cfg = tiny(tmp_path / 'run', f'/cache/host{i}', compilation_cache_dir=f'/cc{i}',
               metrics__progress_bar=bool(i), **overrides)
    cfg.distributed.coordinator, cfg.distributed.process_id = f'host{i}:1234', i
    cfg.data.train_files = str(tmp_path / f'host{i}' / '*.bin')
    return processes.fingerprint(cfg, [str(tmp_path / f'host{i}' / 'part.bin')], [], byte)
  assert host(0) == host(1)
  assert host(0) != host(1, data__batch_size=16)
  (tmp_path / 'host2').mkdir()
  (tmp_path / 'host2' / 'part.bin').write_bytes(b'x' * 11)   # another file of that name
  other = processes.fingerprint(tiny(tmp_path / 'run', cache_dir),
                                [str(tmp_path / 'host2' / 'part.bin')], [], byte)
  assert other['data files'] != host(0)['data files']


@pytest.mark.parametrize('per_process, devices, message', [
    ((('--config.data.batch_size=16',), ()), (4, 4),
     'the processes disagree on data.batch_size: process 0 has 16, process 1 has 8'),
    (((), ()), (4, 2), 'the processes disagree on devices per process: process 0 has 4, '
     'process 1 has 2'),
])
def test_processes_that_disagree_stop_at_start(tmp_path, cache_dir, per_process, devices,
                                               message):
  """Every process stops with the same line instead of hanging at the first collective."""
  codes, outputs = launch_two(
      ['--config=default.py:tiny', f'--config.workdir={tmp_path}',
       f'--config.data.cache_dir={cache_dir}', '--config.steps=2'], per_process, devices)
  assert codes == [2, 2], outputs
  for out in outputs:
    assert message in out, out[-2000:]
