"""What the engine hands back, as plain data: per-step request outputs, whole results,
per-request latencies and the engine's counters."""

import dataclasses

import numpy as np


@dataclasses.dataclass
class RequestMetrics:
  """Wall-clock times (time.monotonic) of one request, for latency histograms."""
  arrival_time: float
  num_prompt_tokens: int
  # When each step's tokens came out: one entry a step (with speculative decoding a step
  # may give several tokens), so inter-token latencies are per step, as vLLM counts them.
  token_times: list[float] = dataclasses.field(default_factory=list)
  finish_time: float | None = None
  finish_reason: str | None = None

  @property
  def ttft(self) -> float | None:
    return self.token_times[0] - self.arrival_time if self.token_times else None

  @property
  def inter_token_latencies(self) -> list[float]:
    return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []

  @property
  def e2e(self) -> float | None:
    return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclasses.dataclass
class TokenLogprob:
  token_id: int
  logprob: float
  top: list[tuple[int, float]] | None   # the top N (token id, logprob) when asked
  rank: int | None = None   # the tokens at least as likely, it included (vLLM v1's rank)


@dataclasses.dataclass
class RequestOutput:
  """What one engine step added to one request."""
  request_id: str
  new_token_ids: list[int]
  new_text: str
  logprobs: list[TokenLogprob] | None
  finished: bool
  finish_reason: str | None      # 'stop' | 'length' | 'abort' | 'error' once finished
  num_prompt_tokens: int
  num_output_tokens: int
  error: str | None = None       # why, when finish_reason is 'error' or 'abort'
  metrics: RequestMetrics | None = None   # on the final output
  # On the first output of a request that asked for them: one per prompt token, the
  # first None (nothing precedes it).
  prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class CompletionResult:
  """A whole request, assembled from its stream."""
  request_id: str
  prompt_token_ids: list[int]
  token_ids: list[int]
  text: str
  finish_reason: str | None
  logprobs: list[TokenLogprob] | None
  error: str | None
  metrics: RequestMetrics | None
  prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class EngineStats:
  num_running: int
  num_waiting: int
  kv_cache_usage: float          # fraction of blocks in use
  prefix_cache_queries: int      # prompt tokens looked up in the prefix cache
  prefix_cache_hits: int         # of those, found
  prompt_tokens: int             # prefilled, summed over requests
  generation_tokens: int         # sampled, summed over requests
  finished: dict[str, int]       # finished requests by finish reason
  num_preemptions: int = 0       # requests preempted (blocks freed, recomputed later)
  # Speculative decoding: chunks that carried a draft, their draft tokens, those accepted.
  spec_decode_num_drafts: int = 0
  spec_decode_num_draft_tokens: int = 0
  spec_decode_num_accepted_tokens: int = 0
  # Per draft position (0 = the first draft token): drafts whose token there was accepted.
  spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


def collect(request_id: str, prompt_ids: list[int], outs: list[RequestOutput]):
  logprobs = [lp for o in outs for lp in (o.logprobs or [])]
  last = outs[-1]
  return CompletionResult(
      request_id, list(prompt_ids), [t for o in outs for t in o.new_token_ids],
      ''.join(o.new_text for o in outs), last.finish_reason,
      logprobs if any(o.logprobs is not None for o in outs) else None, last.error,
      last.metrics, outs[0].prompt_logprobs)
