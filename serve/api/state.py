"""What the routes share: the server's state, and one choice's request in the engine."""

import asyncio
import concurrent.futures
import dataclasses
import time

from serve.api import metrics as metrics_lib
from serve.api import tools as tools_lib


@dataclasses.dataclass
class Choice:
  """One choice's request in the engine, and what it has produced so far."""
  rid: str
  index: int                  # the choice's index: prompt number * n + sample number
  prompt_ids: list[int]
  stream: object
  counts_prompt: bool = True  # the first of its prompt's n choices (usage counts it once)
  echo: str | None = None     # completions' echo: the prompt text, sent before the output
  prompt_only: bool = False   # echo with max_tokens 0: the one token generated is dropped
  vllm_prompt_logprobs: bool = False   # vLLM's prompt_logprobs asked for: in the answer
  vllm_json: list | None = None        # the first choice's: that answer, once built
  prompt_logprobs: list | None = None
  first: 'Choice | None' = None    # its prompt's first choice, which scores the prompt
  waits_for_scores: bool = False   # its outputs wait for first's prompt scores
  tools: tools_lib.ToolChoice | None = None   # chat's tools, and a parser of the output
  tool_parser: object = None
  text: str = ''
  token_ids: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  logprob_offset: int = 0     # completions' text_offset of the next streamed logprob
  finish_reason: str | None = None
  adapter: str | None = None  # the LoRA adapter it runs on (None: the base)


class ServerState:
  """What the routes share: the engine, the model, admission and the live requests."""

  def __init__(self, engine, served, api_key, model_name, max_model_len, tool_parser=None):
    self.engine, self.served, self.api_key = engine, served, api_key
    self.tool_parser = tool_parser   # --tool-call-parser with --enable-auto-tool-choice
    self.model_name = model_name
    self.max_model_len = max_model_len
    self.vocab_size = served.tokenizer.vocab_size
    self.created = int(time.time())
    self.metrics = metrics_lib.ServerMetrics(engine)
    self.draining = False
    self.active: dict[str, Choice] = {}
    self.shutdown_aborted: set[str] = set()
    # Submissions wait on the engine's lock (a step's scheduling and emission): threads of
    # their own, so waiting ones never hold up the tokenizing and decoding of others.
    self.submitters = concurrent.futures.ThreadPoolExecutor(
        max_workers=4, thread_name_prefix='meshlm-submit')

  async def drain(self, grace_s: float) -> None:
    """Refuse new work; wait up to grace_s for running requests; abort the rest."""
    self.draining = True
    deadline = time.monotonic() + grace_s
    while self.active and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    # Let the aborted requests' handlers send their final chunk before the server stops;
    # one still being prepared in a worker thread when draining began is aborted as it
    # comes in.
    deadline = time.monotonic() + 5.0
    while True:
      for rid in [rid for rid in list(self.active) if rid not in self.shutdown_aborted]:
        self.shutdown_aborted.add(rid)
        self.engine.abort(rid)
      if not self.active or time.monotonic() >= deadline:
        break
      await asyncio.sleep(0.05)
