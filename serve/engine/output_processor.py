"""Output processing: a step's tokens, request by request, through the guide, the
detokenizer and stop strings into each request's stream, and the finish of a request.

Mixed into Engine (serve/engine/core.py) and run on its thread under its lock; reads the
engine's _tracked requests, counters, scheduler and sampler."""

import sys
import time
import traceback

from serve.engine.outputs import RequestOutput
from serve.engine.request import Request, RequestStatus
from serve.engine.tracked import TrackedRequest


class OutputProcessor:
  """Engine's emission of a step's outputs (see serve/engine/loop.py's _step)."""

  def _emit(self, tokens: dict, logprobs: dict, finished) -> None:
    """A step's outputs, request by request: one that fails to go out (its detokenizer
    raising, say) fails that request alone, and every request that finished is closed."""
    self._emit_count += 1
    done = {r.request_id for r in finished}
    for rid in [*tokens, *(done - tokens.keys())]:   # some finished without a token
      try:
        self._emit_request(rid, tokens.get(rid, ()), logprobs.get(rid), rid in done)
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc(file=sys.stderr)
        self._fail([rid], e)

  def _emit_request(self, rid: str, ids, scored, finished: bool) -> None:
    t = self._tracked.get(rid)
    if t is not None and not ids and finished:
      self._finish(t)
    for j, token in enumerate(ids):
      t = self._tracked.get(rid)
      if t is None:   # ended on an earlier token of this step (a stop string, an error)
        return
      later = len(ids) - 1 - j
      try:
        self._on_token(t, token, scored and scored[j], finished and not later, later)
      except Exception:
        if rid in self._tracked:   # this token and the step's later ones never went out
          del t.request.output_token_ids[len(t.request.output_token_ids) - later - 1:]
        raise

  def _on_token(self, t: TrackedRequest, token: int, logprob, finished_now: bool,
                later: int = 0) -> None:
    """One output token; `later`: the step's tokens after it (accepted draft tokens),
    already in the request's output_token_ids."""
    req, now = t.request, time.monotonic()
    if t.guide is not None and not finished_now:
      try:
        t.guide.advance(token)
      except ValueError as e:   # a token the guide cannot follow: this request only
        del req.output_token_ids[len(req.output_token_ids) - later - 1:]   # never output
        self._fail([req.request_id], e)
        return
    prompt_lps = None
    if not t.metrics.token_times:   # the first token: the prompt is all computed
      self._totals['prompt_tokens'] += len(req.prompt_token_ids)
      prompt_lps = t.prompt_logprobs
      t.metrics.token_times.append(now)
    elif t.emitted_step != self._emit_count:   # the first of this step's tokens
      t.metrics.token_times.append(now)
    t.emitted_step = self._emit_count
    self._totals['generation_tokens'] += 1
    text, stop = '', None
    if not (finished_now and self._is_stop_token(req, token)
            and not req.sampling_params.include_stop_str_in_output):
      text, stop = t.detok.add(token)
    lps = None if logprob is None else [logprob]
    if stop is not None:
      if not finished_now:
        if later:   # tokens accepted after this one in the same step are not output
          del req.output_token_ids[-later:]
        self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
      self._finish(t, 'stop', [token], text, lps, prompt_logprobs=prompt_lps)
    elif finished_now:
      self._finish(t, None, [token], text + t.detok.flush(), lps, prompt_logprobs=prompt_lps)
    else:
      t.stream.put(RequestOutput(req.request_id, [token], text, lps, False, None,
                                 len(req.prompt_token_ids), req.num_output_tokens - later,
                                 prompt_logprobs=prompt_lps))

  @staticmethod
  def _is_stop_token(req: Request, token: int) -> bool:
    """eos or a stop token id that ended the request: in token_ids, in the text only with
    include_stop_str_in_output (eos, a special token, decodes to nothing)."""
    return token in req.end_token_ids

  def _finish(self, t: TrackedRequest, reason=None, token_ids=(), text='', logprobs=None,
              error=None, prompt_logprobs=None) -> None:
    req = t.request
    reason = reason or req.status.finish_reason or 'stop'
    self.sampler.release(req.request_id)   # its penalty slots (safe from any thread)
    if req.lora_id and getattr(self, 'lora', None) is not None:
      self.lora.release(req.lora_id)
      req.lora_id = 0   # released once, whichever path finishes it
    self._tracked.pop(req.request_id, None)
    self._aborts.pop(req.request_id, None)
    self._finished_by_reason[reason] += 1
    t.metrics.finish_time, t.metrics.finish_reason = time.monotonic(), reason
    t.stream.put(RequestOutput(req.request_id, list(token_ids), text, logprobs, True, reason,
                               len(req.prompt_token_ids), req.num_output_tokens, error,
                               t.metrics, prompt_logprobs))
    for fn in self._observers:
      try:
        fn(t.metrics)
      except Exception:  # pylint: disable=broad-except
        traceback.print_exc(file=sys.stderr)
