"""The engine's loop: a background thread drives scheduler -> runner -> sampler -> scheduler.

Requests come in from any thread or asyncio task (`add_request`) and get a
`RequestStream` of `RequestOutput` deltas. Only the engine thread touches the scheduler's
batch between `schedule()` and `update_from_output()`; aborts wait in an inbox until
the step in flight is done, so a step never sees a request vanish under it.

  add_request ──lock──> scheduler.add_request ─┐
  abort ───────> inbox ─┐                      │
                        v                      v
  loop:  [aborts] -> [drafts] -> schedule() -> runner.step() -> sample()
                 -> update_from_output() -> detokenize, stop strings -> streams

With --speculative-config (serve.spec.ngram) each decoding request gets an n-gram draft
before schedule(); every draft row is sampled as if the draft before it were output, and
the engine accepts the draft up to the first row whose token differs, plus that token.
"""

import sys
import time
import traceback

from serve.engine import prompt_logprobs, step_sampling
from serve.engine.errors import EngineDeadError
from serve.engine.request import RequestStatus
from serve.engine.step_rows import StepRows
from serve.spec.ngram import TokenHistory, propose_ngram


STALL_TIMEOUT_S = 300.0   # no step done for this long with requests open: the engine is dead
MAX_FAILED_STEPS = 8      # this many failed steps in a row: the engine is dead


class EngineLoop:
  """Engine's thread: one scheduler step after another, its liveness, aborts and failures.

  Mixed into Engine (serve/engine/core.py), whose state it reads and whose lock it takes
  around the scheduler; the outputs go out through OutputProcessor."""

  def _run(self) -> None:
    try:
      while not self._stopping:
        self._wake.clear()
        try:
          busy = self._step()
        except Exception:  # pylint: disable=broad-except
          # A bug outside the model step: report it and keep serving the others.
          traceback.print_exc(file=sys.stderr)
          self._failed_steps += 1
          busy = False
        if not busy:
          self._wake.wait(0.05)
      self._flush_outputs()
    except BaseException as e:  # pylint: disable=broad-except
      traceback.print_exc(file=sys.stderr)
      self._die(f'the engine loop died: {type(e).__name__}: {e}')

  # ---------------------------------------------------------------- liveness

  def health(self) -> str | None:
    """None while the loop runs and makes progress; else why the engine is dead: its loop
    ended other than by shutdown(), MAX_FAILED_STEPS steps in a row failed, or no step
    completed for stall_timeout_s with requests open. Dead is final: every open request
    is failed with EngineDeadError and none is admitted again."""
    if self._dead is None:
      reason = self._liveness_problem()
      if reason is not None:
        self._die(reason)
    return self._dead

  def _liveness_problem(self) -> str | None:
    if self._stopping:
      return None
    if not self._thread.is_alive():
      return 'the engine loop is not running'
    if self._failed_steps >= MAX_FAILED_STEPS:
      return f'the last {self._failed_steps} engine steps all failed (see the server log)'
    stalled, open_requests = time.monotonic() - self._progress_at, len(self._tracked)
    if open_requests and stalled > self.stall_timeout_s:
      return (f'no engine step completed for {stalled:.0f} s with {open_requests} requests '
              f'open (the bound is {self.stall_timeout_s:g} s)')
    return None

  def _die(self, reason: str) -> None:
    """Fails every open request with EngineDeadError. Without the lock: a stalled loop
    may hold it forever."""
    with self._dead_lock:   # the loop thread and a health check may both find it dead
      if self._dead is not None:
        return
      self._dead, self._admitting, self._stopping = reason, False, True
    print(f'Engine dead: {reason}. Failing every open request.', file=sys.stderr, flush=True)
    for rid in list(self._tracked):
      self._fail_dead(rid)

  def _fail_dead(self, request_id: str) -> None:
    """Ends one request of a dead engine; exactly once, whoever else tries (the pop)."""
    t = self._tracked.pop(request_id, None)
    if t is not None:
      self._finish(t, 'error', error=f'{EngineDeadError.__name__}: the engine is dead '
                   f'({self._dead}).')

  def _step(self) -> bool:
    """One scheduler step; False when there was nothing to run.

    A step's outputs (detokenizing, streaming) go out while the device runs the next
    step, unless a request in it has stop strings: those are found while detokenizing
    and must end the request before the next schedule."""
    with self._lock:
      self._apply_aborts()
      if self.spec is not None:
        self._propose_drafts()
      out = self.scheduler.schedule()
      self._fail_admissions()
    if not out.chunks:
      self._flush_outputs()
      self._progress_at = time.monotonic()
      return False
    try:
      tokens, logprobs = self._execute(out)
      with self._lock:
        before = {rid: self._tracked[rid].request.num_output_tokens for rid in tokens}
        finished = self.scheduler.update_from_output(out, tokens)
        # What the scheduler appended: accepted tokens stop at the one that finished it.
        tokens = {rid: ts[:self._tracked[rid].request.num_output_tokens - before[rid]]
                  for rid, ts in tokens.items()}
        self._pending_outputs = (tokens, logprobs, finished)
        if self._has_stop_strings(out):
          self._flush_outputs()
      self._progress_at, self._failed_steps = time.monotonic(), 0
    except Exception as e:  # pylint: disable=broad-except
      self._failed_steps += 1
      self._flush_outputs()
      traceback.print_exc(file=sys.stderr)
      failed = [c.request_id for c in out.chunks]
      if self.runner.recover_cache():
        # The K/V of every running request went with the cache, and cached prefixes
        # now point at empty blocks: fail what ran, forget the prefix cache.
        failed += [r.request_id for r in self.scheduler.running]
        self._fail(failed, e)
        with self._lock:
          self.scheduler.kv = self._make_kv_manager()
      else:
        self._fail(failed, e)
    return True

  def _has_stop_strings(self, out) -> bool:
    return any(self._tracked[c.request_id].request.sampling_params.stop
               for c in out.chunks if c.sample and c.request_id in self._tracked)

  def _flush_outputs(self) -> None:
    """Emits the previous step's outputs (see _step)."""
    pending, self._pending_outputs = self._pending_outputs, None
    if pending is not None:
      with self._lock:
        self._emit(*pending)

  def _propose_drafts(self) -> None:
    """An n-gram draft for each running request in decode."""
    spec = self.spec
    for request in self.scheduler.running:
      t = self._tracked.get(request.request_id)
      if t is None or request.num_computed_tokens != request.num_tokens - 1:
        continue
      if t.history is None:
        t.history = TokenHistory(request.prompt_token_ids)
      request.spec_token_ids = propose_ngram(
          t.history.tokens(request.output_token_ids), spec.num_speculative_tokens,
          spec.prompt_lookup_min, spec.prompt_lookup_max)

  def _execute(self, out):
    """Runs the model and samples: ({id: [tokens]}, {id: [TokenLogprob]}) of the sampling
    chunks whose requests are still live; a chunk with a draft gets the draft's accepted
    prefix and the token after."""
    layout = StepRows(out.chunks)
    targets, top_n = prompt_logprobs.prompt_targets(out.chunks, self._tracked,
                                                    self.vocab_size)
    # dispatched; the device runs it while the previous step's outputs go out
    step = self.runner.step(out, targets, top_n) if targets else self.runner.step(out)
    if step.num_sampled != layout.num_rows:
      raise RuntimeError(f'the runner sampled {step.num_sampled} rows of a step laid out '
                         f'with {layout.num_rows}: its row order is not StepRows\'.')
    self._flush_outputs()
    layout.keep(self._tracked)   # a request failed while those outputs went out drops out
    if step.scores is not None:
      prompt_logprobs.gather(out.chunks, targets, step.scores, self._tracked)
    inputs = self._row_inputs(layout)
    if not layout:
      return {}, {}
    res = step_sampling.sample_rows(self.sampler, step, layout, inputs, self.vocab_size)
    tokens, logprobs = step_sampling.accept(layout, res, self._tracked)
    for r in layout:
      self._count_draft(r.draft, tokens[r.request_id])
    return tokens, logprobs

  def _row_inputs(self, layout: StepRows) -> dict:
    """Per live request, per row: (params, step, PenaltyRow, banned, allowed) as the sampler
    takes them. A request whose guide or bans fail here fails alone and drops out."""
    inputs = {}
    for r in layout:
      t = self._tracked[r.request_id]
      try:
        inputs[r.request_id] = step_sampling.request_rows(t, r, self.served.eos_token_ids)
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc(file=sys.stderr)
        layout.drop(r.request_id)
        self._fail([r.request_id], e)
    return inputs

  def _count_draft(self, draft, accepted) -> None:
    if draft:
      self._totals['drafts'] += 1
      self._totals['draft_tokens'] += len(draft)
      self._totals['accepted_tokens'] += len(accepted) - 1
      for pos in range(len(accepted) - 1):
        self._accepted_per_pos[pos] += 1

  def _apply_aborts(self) -> None:
    if self._aborts:   # a request that finished last step reports that, not the abort
      self._flush_outputs()
    while self._aborts:   # taken one by one: a failing abort is not retried forever
      rid, (t, why) = self._aborts.popitem()
      if self._tracked.get(rid) is t:
        self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        self._finish(t, 'abort', error=why)

  def _fail_admissions(self) -> None:
    """Requests the scheduler finished at admission (their adapter's slot write failed)
    end with finish_reason 'error' and the cause; the step goes on for the others."""
    for rid, error in self.scheduler.take_failed_admissions():
      print(f'request {rid}: its LoRA adapter could not be placed in a device slot: '
            f'{type(error).__name__}: {error}', file=sys.stderr, flush=True)
      t = self._tracked.get(rid)
      if t is not None:
        self._finish(t, 'error', error=f'{type(error).__name__}: {error}')

  def _fail(self, request_ids, error: Exception) -> None:
    """A failed step ends the requests it held with finish_reason 'error'."""
    message = f'{type(error).__name__}: {error}'
    with self._lock:
      for rid in request_ids:
        t = self._tracked.get(rid)
        if t is None:
          continue
        try:
          self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
        except Exception:  # pylint: disable=broad-except
          traceback.print_exc(file=sys.stderr)
        self._finish(t, 'error', error=message)
