"""What a run does when it is stopped or hurt: a history in events.jsonl, SIGTERM handled
like Ctrl-C, and the errors (with their exit statuses) that stop it cleanly.

Exit statuses of `python train.py`: 0 finished; 1 crashed (traceback); 2 bad input at
start; 3 too many consecutive non-finite steps; 4 a checkpoint save failed with
checkpoint.on_save_error='stop'; 130 Ctrl-C; 143 SIGTERM (preempted). After 3, 4, 130 and
143 the newest checkpoint is complete, and the same command resumes from it.
"""

import json
import os
import signal
import threading
import time

import jax
from jax.experimental import multihost_utils

EXIT_NON_FINITE = 3
EXIT_SAVE_FAILED = 4
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 143


class RunStopped(Exception):
  """A clean stop: the message says what happened and how to go on; `step`, when set,
  the step it happened at (the loop may have dispatched the next one already)."""
  exit_status = 1
  event = 'stopped'

  def __init__(self, message: str, step: int | None = None):
    super().__init__(message)
    self.step = step


class Preempted(RunStopped):
  """SIGTERM: the last finished step was saved."""
  exit_status = EXIT_PREEMPTED
  event = 'preempted'


class TooManySkippedSteps(RunStopped):
  """optim.max_skipped_steps non-finite steps in a row."""
  exit_status = EXIT_NON_FINITE
  event = 'stopped'


class SaveFailed(RunStopped):
  """A checkpoint save failed and checkpoint.on_save_error is 'stop'."""
  exit_status = EXIT_SAVE_FAILED
  event = 'stopped'


class Events:
  """Appends one JSON line per event to workdir/events.jsonl (process 0 only)."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.path = os.path.join(workdir, 'events.jsonl')
    self._enabled = enabled
    self._lock = threading.Lock()

  def __call__(self, event: str, **fields) -> None:
    if not self._enabled:
      return
    line = json.dumps({'time': round(time.time(), 3), 'event': event, **fields})
    with self._lock, open(self.path, 'a') as f:
      f.write(line + '\n')

  def stopped(self, error: BaseException, step: int | None) -> None:
    """The line for a run ending by an exception: its kind, step and message."""
    if isinstance(error, RunStopped):
      self(error.event, step=step if error.step is None else error.step, message=str(error))
    elif isinstance(error, KeyboardInterrupt):
      self('interrupted', step=step)
    else:
      self('crashed', step=step, error=f'{type(error).__name__}: {error}'[:2000])


def read_events(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, 'events.jsonl')) as f:
    return [json.loads(line) for line in f]


class StopSignal:
  """SIGTERM asks the run to stop after the step in flight.

  One process: a handler sets a flag the loop reads between steps. Several processes:
  JAX's preemption service (started by jax.distributed.initialize) catches SIGTERM on any
  of them and names one step, the next after the furthest one, at which every process
  stops, so all of them save the same step. Use as a context manager around the loop.
  """

  def __init__(self):
    self.received = False
    self._multi = jax.process_count() > 1
    self._previous = None

  def __enter__(self):
    if not self._multi and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.received = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
    return False

  def should_stop(self, step: int) -> bool:
    """Called after every finished step (every process, every step, in order)."""
    if self._multi:
      self.received = multihost_utils.reached_preemption_sync_point(step)
    return self.received
