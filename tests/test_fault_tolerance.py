"""Runs that survive damage done for real: SIGTERM (one process and one of two), kill -9
at random moments, non-finite steps, a checkpoint directory that cannot take a save; each
resumed run is compared with an uninterrupted one, loss by loss, bit for bit."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from training import checkpoint, resilience, state, trainer
from training.cli import load_config_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24
TWO_STEPS = 16   # two processes: slower steps, fewer of them


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('corpus'))


def env(devices=1, **extra):
  # os.environ has the test run's compilation cache and XLA flags (tests/conftest.py)
  return {**os.environ, 'JAX_PLATFORMS': 'cpu',
          'JAX_NUM_CPU_DEVICES': str(devices), **extra}


def train_args(workdir, cache_dir, *extra):
  return ['--config=default.py:tiny', f'--config.workdir={workdir}',
          f'--config.data.cache_dir={cache_dir}', f'--config.steps={STEPS}',
          f'--config.optim.decay_steps={STEPS}', '--config.sample.num_tokens=0',
          '--config.metrics.progress_bar=False', *extra]


def start(workdir, cache_dir, *extra, **popen):
  return subprocess.Popen([sys.executable, 'train.py', *train_args(workdir, cache_dir, *extra)],
                          cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, **popen)


def finish(proc, timeout=300):
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out, err


def losses_by_step(workdir) -> dict[int, float]:
  """The last loss logged for each step (steps redone after a kill are logged again)."""
  losses = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      record = json.loads(line)
      losses[record['step']] = record['loss']
  return losses


def metric_lines(workdir) -> int:
  try:
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      return sum(1 for _ in f)
  except FileNotFoundError:
    return 0


def wait_for_lines(workdir, n, procs):
  deadline = time.time() + 240
  while metric_lines(workdir) < n:
    for p in procs:
      assert p.poll() is None, f'run ended early ({p.returncode}): {p.communicate()}'
    assert time.time() < deadline, 'no progress'
    time.sleep(0.01)


@pytest.fixture(scope='module')
def reference(tmp_path_factory, cache_dir):
  """An uninterrupted STEPS-step run on one device: {step: loss}."""
  workdir = tmp_path_factory.mktemp('reference')
  rc, _, err = finish(start(workdir, cache_dir))
  assert rc == 0, err[-3000:]
  losses = losses_by_step(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  return losses


def stopped_line(err: str) -> str:
  lines = [l for l in err.splitlines() if l.startswith('stopped: ')]
  assert len(lines) == 1, err[-3000:]
  return lines[0]


def events(workdir):
  return resilience.read_events(str(workdir))


# --- SIGTERM --------------------------------------------------------------------------------

def test_sigterm_saves_the_finished_step_and_the_rerun_continues_bitwise(tmp_path, cache_dir,
                                                                          reference):
  proc = start(tmp_path, cache_dir, '--config.checkpoint.every_steps=1000')
  wait_for_lines(tmp_path, 3, [proc])
  proc.send_signal(signal.SIGTERM)
  rc, _, err = finish(proc)
  assert rc == resilience.EXIT_PREEMPTED, err[-3000:]
  line = stopped_line(err)
  step = int(re.search(r'after step (\d+)', line)[1])
  assert f'newest checkpoint: step {step}' in line and 'Run the same command again' in line
  assert 'Traceback' not in err
  # The step in flight finished and was saved; no step after it ran.
  assert metric_lines(tmp_path) == step and 3 <= step < STEPS
  assert os.listdir(tmp_path / 'checkpoints') == [str(step)]
  assert [(e['event'], e['step']) for e in events(tmp_path)[1:]] == [('saved', step),
                                                                     ('preempted', step)]
  rc, _, err = finish(start(tmp_path, cache_dir, '--config.checkpoint.every_steps=1000'))
  assert rc == 0, err[-3000:]
  assert losses_by_step(tmp_path) == reference   # exact floats
  log = events(tmp_path)
  assert log[3]['event'] == 'started' and (log[4]['event'], log[4]['step']) == ('resumed', step)
  assert (log[-1]['event'], log[-1]['step']) == ('finished', STEPS)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def start_two(workdir, cache_dir):
  args = train_args(workdir, cache_dir, '--config.checkpoint.every_steps=1000',
                    f'--config.steps={TWO_STEPS}',
                    f'--config.distributed.coordinator=127.0.0.1:{free_port()}',
                    '--config.distributed.num_processes=2')
  two = env(XLA_FLAGS=f'{os.environ.get("XLA_FLAGS", "")} '
                     '--xla_force_host_platform_device_count=4')
  del two['JAX_NUM_CPU_DEVICES']
  return [subprocess.Popen([sys.executable, 'train.py', *args,
                            f'--config.distributed.process_id={i}'], cwd=ROOT, env=two,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for i in range(2)]


def test_sigterm_to_one_of_two_processes_saves_the_same_step_on_both(tmp_path, cache_dir):
  """JAX's preemption sync point: process 1 gets SIGTERM, both stop after the same step,
  save it together, and the rerun of both resumes. (Two processes reduce in another order
  than one: compared with a one-process run at the tolerance of test_train's 2-process
  test; bitwise resume is shown above.)"""
  procs = start_two(tmp_path, cache_dir)
  wait_for_lines(tmp_path, 2, procs)
  procs[1].send_signal(signal.SIGTERM)
  results = [finish(p) for p in procs]
  assert [r[0] for r in results] == [resilience.EXIT_PREEMPTED] * 2, results[0][2][-3000:]
  steps = [int(re.search(r'after step (\d+)', stopped_line(r[2]))[1]) for r in results]
  assert steps[0] == steps[1] and 2 <= steps[0] < TWO_STEPS, steps
  assert os.listdir(tmp_path / 'checkpoints') == [str(steps[0])]
  assert metric_lines(tmp_path) == steps[0]
  results = [finish(p) for p in start_two(tmp_path, cache_dir)]
  assert [r[0] for r in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
  assert ('resumed', steps[0]) in [(e['event'], e.get('step')) for e in events(tmp_path)]
  one = trainer.train(tiny(tmp_path / 'one', cache_dir, steps=TWO_STEPS,
                           optim__decay_steps=STEPS))
  two = losses_by_step(tmp_path)
  assert sorted(two) == list(range(1, TWO_STEPS + 1))
  np.testing.assert_allclose([two[s] for s in sorted(two)], [r['loss'] for r in one],
                             rtol=1e-5)


# --- kill -9 --------------------------------------------------------------------------------

def unfinished_saves(workdir) -> list[str]:
  return [d for d in os.listdir(workdir / 'checkpoints') if 'tmp' in d]


def newest_complete(workdir):
  """The newest step orbax lists, after checking each listed step is committed."""
  ckpt = checkpoint.Checkpointer(str(workdir / 'checkpoints'),
                                 load_config_file('default.py:tiny').checkpoint)
  steps = ckpt.steps()
  ckpt.close()
  # No commit_success.txt check: a CI run saw a listed step killed before that marker was
  # written. What counts is that orbax lists only renamed (finished) steps and that the
  # rerun resumes from the newest one bitwise, which the test asserts.
  return max(steps, default=None)


def test_kill_9_at_random_moments_resumes_bitwise(tmp_path, cache_dir, reference):
  """Saves every step, in the background, so most kills land inside a save; a half-written
  step is never listed, and each rerun resumes from the newest complete one."""
  rng, newest, torn = random.Random(0), [], 0
  args = ('--config.checkpoint.every_steps=1', '--config.checkpoint.keep=2')
  while len(newest) < 3 or (not torn and len(newest) < 8):
    proc = start(tmp_path, cache_dir, *args)
    wait_for_lines(tmp_path, metric_lines(tmp_path) + rng.randint(2, 5), [proc])
    time.sleep(rng.uniform(0, 0.05))
    proc.kill()
    proc.communicate()
    torn += bool(unfinished_saves(tmp_path))
    newest.append(newest_complete(tmp_path))
  assert torn, 'no kill landed inside a save'
  rc, _, err = finish(start(tmp_path, cache_dir, *args))
  assert rc == 0, err[-3000:]
  resumed = [e['step'] for e in events(tmp_path) if e['event'] == 'resumed']
  assert resumed == [n for n in newest if n is not None]
  assert losses_by_step(tmp_path) == reference


# --- Non-finite steps -----------------------------------------------------------------------

class PoisonWeights:
  """A data iterator whose batches number `poisoned` (1-based) have NaN loss weights."""

  def __init__(self, it, poisoned):
    self.it, self.poisoned, self.n = it, poisoned, 0

  def __next__(self):
    batch, self.n = dict(next(self.it)), self.n + 1
    if self.n in self.poisoned:
      batch['weights'] = np.full_like(batch['weights'], np.nan)
    return batch

  def __getattr__(self, name):
    return getattr(self.it, name)


def tiny(workdir, cache_dir, **overrides):
  cfg = load_config_file('default.py:tiny')
  cfg.workdir, cfg.data.cache_dir = str(workdir), cache_dir
  cfg.metrics.progress_bar, cfg.sample.num_tokens = False, 0
  for key, value in overrides.items():
    section, _, field = key.rpartition('__')
    setattr(getattr(cfg, section) if section else cfg, field, value)
  return cfg


def poison(monkeypatch, batches):
  real = trainer.data.make_train_iterator
  monkeypatch.setattr(trainer.data, 'make_train_iterator',
                      lambda *a, **k: PoisonWeights(real(*a, **k), batches))


def record_states(monkeypatch) -> dict:
  """{step: the train state (on the host) the loop saved at that step}."""
  states, real = {}, trainer.save

  def save(t, step, train_state, data_state):
    states[step] = jax.device_get(train_state)
    real(t, step, train_state, data_state)
  monkeypatch.setattr(trainer, 'save', save)
  return states


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_nan_step_changes_nothing_and_the_run_learns_on(tmp_path, cache_dir, monkeypatch):
  poison(monkeypatch, {5})
  states = record_states(monkeypatch)
  history = trainer.train(tiny(tmp_path, cache_dir, checkpoint__every_steps=1,
                               checkpoint__keep=1))
  assert [r['step'] for r in history if r['skipped']] == [5]
  assert history[4]['skipped'] == 'non-finite loss' and np.isnan(history[4]['loss'])
  assert_trees_equal(states[5], states[4])   # params, optimizer state and update count
  with pytest.raises(AssertionError):
    assert_trees_equal(states[6].params, states[5].params)
  logged = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert [(l['step'], l['skipped']) for l in logged if l['skipped']] == [(5, 'non-finite loss')]
  losses = [r['loss'] for r in history if not r['skipped']]
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.0, losses
  assert ('skipped', 5) in [(e['event'], e.get('step')) for e in events(tmp_path)]


def test_non_finite_gradients_alone_also_skip():
  """A finite loss with a NaN gradient norm keeps the old state too."""
  old = state.TrainState(step=np.int32(3), params={'w': np.ones(4, np.float32)},
                         opt_state=(np.zeros(4, np.float32),))
  new = jax.tree.map(lambda x: x + 1, old)
  kept, ok = state.skip_if_not_finite(new, old, np.float32(2.0), np.float32(np.nan))
  assert not ok
  assert_trees_equal(kept, old)
  taken, ok = state.skip_if_not_finite(new, old, np.float32(2.0), np.float32(1.0))
  assert ok
  assert_trees_equal(taken, new)


def test_consecutive_nan_steps_stop_the_run_with_the_last_good_checkpoint(tmp_path, cache_dir,
                                                                          monkeypatch):
  poison(monkeypatch, set(range(5, 100)))
  states = record_states(monkeypatch)
  cfg = tiny(tmp_path, cache_dir, checkpoint__every_steps=2, optim__max_skipped_steps=3)
  with pytest.raises(resilience.TooManySkippedSteps, match=r'3 steps in a row \(to step 7\)'):
    trainer.train(cfg)
  assert metric_lines(tmp_path) == 7
  log = events(tmp_path)
  assert [e['step'] for e in log if e['event'] == 'skipped'] == [5, 6, 7]
  assert (log[-1]['event'], log[-1]['step']) == ('stopped', 7)
  t = trainer.setup(cfg)
  restored, meta = t.ckpt.restore_latest(state.abstract_state(cfg, t.plan, t.tx))
  assert meta['step'] == 6   # saved inside the streak: the state of step 4, unchanged
  assert_trees_equal(jax.device_get(restored), states[4])
  t.ckpt.close()
  t.data_iter.close()


POISONED_RUN = '''
import sys
from tests.test_fault_tolerance import PoisonWeights
from training import cli, data
real = data.make_train_iterator
data.make_train_iterator = lambda *a, **k: PoisonWeights(real(*a, **k), set(range(3, 99)))
sys.argv = ['train.py'] + sys.argv[1:]
cli.run()
'''


def test_too_many_skipped_steps_exit_with_status_3(tmp_path, cache_dir):
  result = subprocess.run(
      [sys.executable, '-c', POISONED_RUN,
       *train_args(tmp_path, cache_dir, '--config.optim.max_skipped_steps=2')],
      cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
  assert result.returncode == resilience.EXIT_NON_FINITE, result.stderr[-3000:]
  line = stopped_line(result.stderr)
  assert 'optim.max_skipped_steps=2' in line and 'to step 4' in line
  assert 'Traceback' not in result.stderr


# --- A checkpoint directory that cannot take a save -----------------------------------------

def with_file_size_limit(cmd: list[str]) -> list[str]:
  """Files cannot grow past 64 KiB: the write fails with EFBIG, as on a full disk. A
  checkpoint's arrays take ~1.3 MB, written in chunks of a few hundred KB whose split
  varies from run to run (at 512 KiB one save in a CI run fitted); everything else a run
  writes (metrics, events, TensorBoard, checkpoint metadata) stays under 20 KB."""
  return ['bash', '-c', 'trap "" XFSZ; ulimit -f 64; exec "$@"', 'limited', *cmd]


def test_a_failed_save_is_reported_and_older_checkpoints_stay_intact(tmp_path, cache_dir,
                                                                     reference):
  cmd = [sys.executable, 'train.py', *train_args(tmp_path, cache_dir,
                                                 '--config.checkpoint.every_steps=6')]
  run = lambda *c: subprocess.run(c, cwd=ROOT, env=env(), capture_output=True, text=True,
                                  timeout=300)
  result = run(*cmd, '--config.steps=6')
  assert result.returncode == 0, result.stderr[-3000:]
  # on_save_error=stop: the background save of step 12 fails; the run learns it when it
  # starts the next save (step 18) and stops there.
  result = run(*with_file_size_limit(cmd + ['--config.checkpoint.on_save_error=stop']))
  assert result.returncode == resilience.EXIT_SAVE_FAILED, result.stderr[-3000:]
  line = stopped_line(result.stderr)
  # EFBIG reaches us as 'File too large', or as tensorstore's OUT_OF_RANGE when a small
  # metadata write is the one that fails.
  assert 'checkpoint 12 could not be saved' in line, line
  assert 'File too large' in line or 'OUT_OF_RANGE' in line, line
  assert metric_lines(tmp_path) == 18
  # on_save_error=continue (the default): each failure is one warning, the run finishes.
  result = run(*with_file_size_limit(cmd))
  assert result.returncode == 0, result.stderr[-3000:]
  # A background thread's 'Exception ignored' traceback can land on the same stderr line
  # before a warning (seen in CI): read each warning from where it starts.
  failures = [l[l.find('warning: checkpoint'):] for l in result.stderr.splitlines()
              if 'could not be saved' in l]
  assert [re.search(r'checkpoint (\d+) could not', l)[1] for l in failures] == [
      '12', '18', '24'], failures
  assert all(l.startswith('warning: ') and l.endswith('the next save tries again.')
             for l in failures), '\n'.join(failures)
  log = events(tmp_path)
  assert [e['step'] for e in log if e['event'] == 'save_failed'] == [12, 12, 18, 24]
  assert (log[-1]['event'], log[-1]['newest_checkpoint']) == ('finished', 6)
  assert [s for s in os.listdir(tmp_path / 'checkpoints') if 'tmp' not in s] == ['6']
  # Without the limit, the same command resumes from step 6, intact, and retrains exactly.
  result = run(*cmd)
  assert result.returncode == 0, result.stderr[-3000:]
  assert ('resumed', 6) in [(e['event'], e.get('step')) for e in events(tmp_path)]
  assert losses_by_step(tmp_path) == reference


# --- events.jsonl ---------------------------------------------------------------------------

class RaiseAt:
  """A data iterator that raises `error` when asked for batch n+1."""

  def __init__(self, it, n, error):
    self.it, self.left, self.error = it, n, error

  def __next__(self):
    if self.left == 0:
      raise self.error
    self.left -= 1
    return next(self.it)

  def __getattr__(self, name):
    return getattr(self.it, name)


@pytest.mark.parametrize('error, last', [
    (RuntimeError('disk on fire'), ('crashed', 'RuntimeError: disk on fire')),
    (KeyboardInterrupt(), ('interrupted', None))])
def test_every_stop_leaves_a_line_in_events(tmp_path, cache_dir, monkeypatch, error, last):
  trainer.train(tiny(tmp_path, cache_dir, steps=2, checkpoint__every_steps=2))
  real = trainer.data.make_train_iterator
  monkeypatch.setattr(trainer.data, 'make_train_iterator',
                      lambda *a, **k: RaiseAt(real(*a, **k), 2, error))
  with pytest.raises(type(error)):
    trainer.train(tiny(tmp_path, cache_dir, steps=8, checkpoint__every_steps=100))
  log = [(e['event'], e.get('step'), e.get('error')) for e in events(tmp_path)]
  saved_on_ctrl_c = [('saved', 4, None)] if isinstance(error, KeyboardInterrupt) else []
  assert log == [('started', None, None), ('saved', 2, None), ('finished', 2, None),
                 ('started', None, None), ('resumed', 2, None), *saved_on_ctrl_c,
                 (last[0], 4, last[1])]


# --- Bad input at start (cases tests/test_cli.py does not cover) ----------------------------

def assert_one_line_error(result, *fragments):
  assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr[-2000:]
  assert 'Traceback' not in result.stderr
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


CONFIG_FILES = {'none.py': 'def get_config(variant=""):\n  return None\n',
                'syntax.py': 'def get_config(:\n',
                'noget.py': 'x = 1\n'}


@pytest.mark.parametrize('args, fragments', [
    (['--config.optim.learning_rate=fast'], ['learning_rate', 'fast']),
    (['--config.metrics.progress_bar=maybe'], ['progress_bar', 'maybe']),
    (['--config.model.num_layers.x=1'], ["'num_layers' is a int, not a section"]),
    (['stray'], ["unexpected arguments ['stray']"]),
    (['--config.checkpoint.on_save_error=maybe'], ['checkpoint.on_save_error', "'stop'"]),
    (['--config.optim.max_skipped_steps=0'], ['optim.max_skipped_steps=0']),
    (['--config=DIR/none.py'], ['none.py', 'returned a NoneType, not a training.config.Config']),
    (['--config=DIR/syntax.py'], ['syntax.py', 'SyntaxError']),
    (['--config=DIR/noget.py'], ['noget.py', "no attribute 'get_config'"]),
    (['--config=DIR/syntax.py', '--config=default.py:tiny'], ['syntax.py', 'SyntaxError']),
    (['--config.workdir=/proc/no/such'], ["workdir='/proc/no/such' cannot be written"]),
])
def test_bad_input_at_start_is_one_line_with_status_2(tmp_path, cache_dir, args, fragments):
  for name, text in CONFIG_FILES.items():
    (tmp_path / name).write_text(text)
  args = [a.replace('DIR', str(tmp_path)) for a in args]
  if not any(a.startswith('--config=') for a in args):
    args = ['--config=default.py:tiny', f'--config.workdir={tmp_path / "run"}', *args]
  result = subprocess.run([sys.executable, 'train.py', *args,
                           f'--config.data.cache_dir={cache_dir}'],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
  assert_one_line_error(result, *fragments)
