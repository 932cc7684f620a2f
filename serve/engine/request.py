"""One generation request as the scheduler sees it: token ids, progress and status."""

import dataclasses
import enum

from serve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
  WAITING = enum.auto()
  RUNNING = enum.auto()
  PREEMPTED = enum.auto()            # back in the waiting queue; its KV blocks were freed
  FINISHED_STOPPED = enum.auto()     # eos, a stop token id or a stop string
  FINISHED_LENGTH = enum.auto()      # max_tokens or the model's context
  FINISHED_ABORTED = enum.auto()
  FINISHED_ERROR = enum.auto()

  @property
  def is_finished(self) -> bool:
    return self in _FINISH_REASONS

  @property
  def finish_reason(self) -> str | None:
    """The OpenAI finish_reason: 'stop', 'length', 'abort', 'error'; None while live."""
    return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: 'stop', RequestStatus.FINISHED_LENGTH: 'length',
    RequestStatus.FINISHED_ABORTED: 'abort', RequestStatus.FINISHED_ERROR: 'error',
}


@dataclasses.dataclass(eq=False)
class Request:
  request_id: str
  prompt_token_ids: list[int]
  sampling_params: SamplingParams
  eos_token_id: int | None
  arrival_time: float
  output_token_ids: list[int] = dataclasses.field(default_factory=list)
  num_computed_tokens: int = 0       # tokens whose K/V are in the cache
  status: RequestStatus = RequestStatus.WAITING
  stop_reason: str | int | None = None   # the stop token id or stop string that ended it
  # Draft tokens to verify after the last known one next step (speculative decoding):
  # set by the engine, read by the scheduler, never part of the request's tokens.
  spec_token_ids: list[int] = dataclasses.field(default_factory=list)
  # Its LoRA adapter: the device slot its rows read, and the adapter's load id (prefix
  # cache key, lora_registry). 0, 0: the base model.
  lora_slot: int = 0
  lora_id: int = 0

  @property
  def all_token_ids(self) -> list[int]:
    return self.prompt_token_ids + self.output_token_ids

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_token_ids)

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_token_ids) + len(self.output_token_ids)

  @property
  def num_output_tokens(self) -> int:
    return len(self.output_token_ids)

  @property
  def is_finished(self) -> bool:
    return self.status.is_finished

  @property
  def end_token_ids(self) -> list[int]:
    """The ids that end the request when drawn: its stop token ids, and eos unless
    ignore_eos."""
    params = self.sampling_params
    eos = [] if self.eos_token_id is None or params.ignore_eos else [self.eos_token_id]
    return list(params.stop_token_ids) + eos

  @property
  def needs_prompt_logits(self) -> bool:
    """Prompt logprobs need every prompt token's logits: no prefix is taken from the cache."""
    return self.sampling_params.prompt_logprobs is not None

  def token_ids(self, start: int, end: int) -> list[int]:
    """all_token_ids[start:end] without building the whole list (decode steps ask for one)."""
    num_prompt = len(self.prompt_token_ids)
    if start >= num_prompt:
      return self.output_token_ids[start - num_prompt:end - num_prompt]
    if end <= num_prompt:
      return self.prompt_token_ids[start:end]
    return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]
