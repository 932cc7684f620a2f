"""Sampling parameters of one request.

Placeholder with the contract's fields only: helper D's branch owns the real file (with
validate()); the merge takes D's version.
"""

import dataclasses


@dataclasses.dataclass
class SamplingParams:
  max_tokens: int = 16
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int | None = None
  stop: list[str] = dataclasses.field(default_factory=list)
  stop_token_ids: list[int] = dataclasses.field(default_factory=list)
  ignore_eos: bool = False
  logprobs: int | None = None
