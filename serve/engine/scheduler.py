"""Continuous batching: which requests compute which tokens in the next model step.

No prefill and decode phases: every request has a number of computed tokens (K/V in the
cache) and a number of known tokens (prompt + outputs); a step gives each scheduled
request a chunk of its uncomputed tokens. A fresh prompt, a prompt split over several
steps (chunked prefill), the one token sampled last step (decode) and a preempted
request's recompute are all the same thing, so they mix freely in one batch.

A running request in decode may carry draft tokens (speculative decoding: the engine
sets request.spec_token_ids): they ride behind its last token in the same chunk, as far
as the budget and its max_tokens allow, in the blocks it holds and free ones that no
running request after it may need this step (a draft never preempts anyone), and
update_from_output takes the tokens the engine accepted, computed ones and all.

Each step spends a token budget (max_num_batched_tokens): running requests first, oldest
first, then waiting ones, first come first served, up to max_num_seqs running. When a
running request needs a block and none is free, the most recently admitted running
request is preempted by recompute: its blocks are freed, its computed count goes back to
zero and it returns to the head of the waiting queue; resumed, it recomputes prompt and
outputs (or finds them in the prefix cache) before sampling again.

With LoRA adapters (`lora`, serve.engine.lora_registry) a waiting request of an adapter
runs only once its adapter is in a device slot: one that must wait for a slot is passed
over (the requests behind it, the base's and other adapters', are admitted meanwhile)
and keeps its place at the head of the queue.
"""

import collections
import dataclasses

from serve.engine.kv_cache_manager import KVCacheManager
from serve.engine.request import Request, RequestStatus


@dataclasses.dataclass
class SchedulerConfig:
  block_size: int = 16
  num_blocks: int = 1024                 # block 0 is the null block: num_blocks - 1 usable
  max_num_seqs: int = 256                # running requests at most
  max_num_batched_tokens: int = 2048     # tokens computed per step at most
  max_model_len: int = 2048              # prompt + max_tokens at most
  enable_prefix_caching: bool = True
  long_prefill_token_threshold: int = 0  # > 0: at most this many tokens per chunk

  def validate(self) -> None:
    for name in ('block_size', 'max_num_seqs', 'max_num_batched_tokens', 'max_model_len'):
      if getattr(self, name) < 1:
        raise ValueError(f'{name}={getattr(self, name)}: must be at least 1')
    if self.num_blocks < 2:
      raise ValueError(f'num_blocks={self.num_blocks}: must be at least 2 '
                       '(block 0 is reserved for padding writes)')
    if self.long_prefill_token_threshold < 0:
      raise ValueError(f'long_prefill_token_threshold={self.long_prefill_token_threshold}: '
                       'must be 0 (off) or positive')


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledChunk:
  request_id: str
  token_ids: list[int]     # tokens whose K/V this step computes
  start_position: int      # position of token_ids[0] (num_computed_tokens before the step)
  block_ids: list[int]     # the whole block table, covering start_position + len(token_ids)
  sample: bool             # ends at the request's last known token: sample the next one
  # Draft tokens at the end of token_ids (sample is then True): every one of them and
  # the last known token is sampled, and the engine accepts a prefix of the draft.
  spec_token_ids: tuple[int, ...] = ()
  lora_slot: int = 0       # its request's LoRA slot (0: the base model)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
  chunks: list[ScheduledChunk]
  preempted_ids: list[str]     # sent back to waiting this step (blocks freed)
  finished_ids: list[str]      # finished since the last step (aborts, stops; blocks freed)
  num_batched_tokens: int


class Scheduler:

  def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager | None = None, lora=None):
    cfg.validate()
    kv = kv or KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
    if (kv.block_size, kv.pool.num_blocks) != (cfg.block_size, cfg.num_blocks):
      raise ValueError(f'the KVCacheManager has {kv.pool.num_blocks} blocks of '
                       f'{kv.block_size} tokens but the SchedulerConfig says {cfg.num_blocks} '
                       f'of {cfg.block_size}: build both from the same numbers')
    self.cfg = cfg
    self.kv = kv
    self.requests: dict[str, Request] = {}   # waiting and running
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []          # in admission order: the last is the victim
    self._finished_ids: list[str] = []
    self.num_preemptions = 0
    self.lora = lora   # a LoraRegistry: the device slots of the adapters (None: no LoRA)
    self._failed_admissions: list[tuple[str, Exception]] = []

  # Counters for /metrics.
  @property
  def num_running(self) -> int:
    return len(self.running)

  @property
  def num_waiting(self) -> int:
    return len(self.waiting)

  @property
  def kv_cache_usage(self) -> float:
    return self.kv.usage

  @property
  def prefix_cache_queries(self) -> int:
    return self.kv.prefix_cache_queries

  @property
  def prefix_cache_hits(self) -> int:
    return self.kv.prefix_cache_hits

  def has_unfinished_requests(self) -> bool:
    return bool(self.requests)

  def get_request(self, request_id: str) -> Request | None:
    return self.requests.get(request_id)

  def add_request(self, request: Request) -> None:
    """Queues a request; ValueError if it could never run, even alone."""
    self._check_fits(request)
    request.status = RequestStatus.WAITING
    self.requests[request.request_id] = request
    self.waiting.append(request)

  def schedule(self) -> SchedulerOutput:
    budget = self.cfg.max_num_batched_tokens
    chunks, preempted = [], []
    budget = self._schedule_running(budget, chunks, preempted)
    if not preempted:   # blocks are short: a newcomer now would only be preempted later
      budget = self._schedule_waiting(budget, chunks)
    finished, self._finished_ids = self._finished_ids, []
    return SchedulerOutput(chunks, preempted, finished,
                           self.cfg.max_num_batched_tokens - budget)

  def update_from_output(self, out: SchedulerOutput,
                         sampled: dict[str, int | list[int]]) -> list[Request]:
    """Records a step: advances computed counts, appends sampled tokens, finishes.

    sampled: per sampling chunk its token, or with a draft the tokens accepted: the
    draft's first m and the token sampled after them (1 to len(draft) + 1). They are
    appended until one finishes the request; the rejected draft's K/V are not computed
    (their slots are overwritten later). Returns the requests that finished (their
    blocks already freed). A request finished by finish_request after schedule() is
    skipped.
    """
    finished = []
    try:
      for chunk in out.chunks:
        request = self.requests.get(chunk.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
          continue
        request.spec_token_ids = []
        computed = chunk.start_position + len(chunk.token_ids)
        if not chunk.sample:
          request.num_computed_tokens = computed
          self.kv.cache_blocks(request)
          continue
        tokens = _sampled_tokens(sampled, chunk)
        status, appended = None, 0
        for token in tokens:
          status = self._append_token(request, token)
          appended += 1
          if status is not None:
            break
        # Computed: the chunk up to the last appended token's predecessor (a rejected
        # draft's K/V, and any accepted past a finishing token, are not the request's).
        request.num_computed_tokens = computed - len(chunk.spec_token_ids) + appended - 1
        self.kv.cache_blocks(request)   # after the append: accepted drafts are tokens now
        if status is not None:
          self._finish(request, status)
          finished.append(request)
    finally:   # also when a later chunk raises: a finished request never runs again
      if finished:
        self.running = [r for r in self.running if not r.is_finished]
    return finished

  def finish_request(self, request_id: str, status: RequestStatus,
                     stop_reason: str | int | None = None) -> None:
    """Ends a waiting or running request (abort, stop string, error) and frees its blocks.

    Unknown or already finished ids are ignored: an abort may race with a finish.
    """
    if not status.is_finished:
      raise ValueError(f'finish_request needs a FINISHED_* status, got {status.name}')
    request = self.requests.get(request_id)
    if request is None:
      return
    if request.status is RequestStatus.RUNNING:
      self.running.remove(request)
    else:
      self.waiting.remove(request)
    request.stop_reason = stop_reason if stop_reason is not None else request.stop_reason
    self._finish(request, status)

  # Admission checks.
  def _max_tokens(self, request: Request) -> int:
    max_tokens = request.sampling_params.max_tokens
    return self.cfg.max_model_len - request.num_prompt_tokens if max_tokens is None \
        else max_tokens

  def _check_fits(self, request: Request) -> None:
    if request.request_id in self.requests:
      raise ValueError(f'request id {request.request_id!r} is already queued or running: '
                       'use a new id')
    if not request.prompt_token_ids:
      raise ValueError('the prompt is empty: give at least one token')
    num_prompt, max_tokens = request.num_prompt_tokens, self._max_tokens(request)
    if max_tokens < 1:
      raise ValueError(f'max_tokens={max_tokens}: must be at least 1')
    if num_prompt + max_tokens > self.cfg.max_model_len:
      raise ValueError(
          f'the prompt has {num_prompt} tokens and max_tokens is {max_tokens}: '
          f'{num_prompt + max_tokens} > the model context of {self.cfg.max_model_len} '
          'tokens; shorten the prompt or lower max_tokens')
    # The last sampled token is never fed back: its K/V needs no slot.
    num_blocks = -(-(num_prompt + max_tokens - 1) // self.cfg.block_size)
    if num_blocks > self.kv.num_usable_blocks:
      raise ValueError(
          f'the prompt ({num_prompt} tokens) with max_tokens={max_tokens} needs '
          f'{num_blocks} KV blocks of {self.cfg.block_size} tokens but the whole cache has '
          f'{self.kv.num_usable_blocks}; lower max_tokens, shorten the prompt or give the '
          'KV cache more memory (more blocks)')

  # Scheduling, phase by phase.
  def _schedule_running(self, budget: int, chunks: list, preempted: list) -> int:
    reserve = self._later_needs(budget) if any(r.spec_token_ids for r in self.running) else ()
    i = 0
    while i < len(self.running) and budget > 0:
      request = self.running[i]
      num_tokens = request.num_tokens
      num_new = self._num_new_tokens(num_tokens, request.num_computed_tokens, budget)
      draft = self._draft(request, num_new, budget)
      if draft:   # cut to the blocks the requests after it cannot need this step
        draft = draft[:self._draft_room(request, num_new, reserve[i])]
        if draft and self.kv.allocate_slots(request, num_new + len(draft)) is None:
          draft = ()
      if not draft and not self._allocate_or_preempt(request, num_new, preempted):
        break   # the request was itself the last one running: nothing left after it
      chunks.append(self._chunk(request, num_new, num_tokens, draft))
      budget -= num_new + len(draft)
      i += 1
    return budget

  def _later_needs(self, budget: int) -> list[int]:
    """Per running request, the new blocks the requests after it may need this step (at
    most their next chunk's under the whole budget): what no draft before them may take."""
    needs = [0]
    for request in reversed(self.running[1:]):
      num_new = self._num_new_tokens(request.num_tokens, request.num_computed_tokens, budget)
      held = len(self.kv.get_block_ids(request.request_id))
      needs.append(needs[-1] + max(0, self._blocks(request.num_computed_tokens + num_new)
                                   - held))
    return needs[::-1]

  def _draft_room(self, request: Request, num_new: int, reserved: int) -> int:
    """Draft tokens that fit the blocks the request holds and the free ones beyond
    `reserved`, after its num_new tokens."""
    blocks = len(self.kv.get_block_ids(request.request_id)) + max(
        0, self.kv.num_free_blocks - reserved)
    return max(0, blocks * self.cfg.block_size - request.num_computed_tokens - num_new)

  def _blocks(self, num_tokens: int) -> int:
    return -(-num_tokens // self.cfg.block_size)

  def _draft(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
    """The part of the request's draft this step verifies: none unless the chunk
    reaches its last known token; at most the budget left, and short enough that the
    draft and the token after it fit max_tokens and the model's context."""
    if not request.spec_token_ids or (request.num_computed_tokens + num_new
                                      != request.num_tokens):
      return ()
    room = min(self._max_tokens(request) - request.num_output_tokens,
               self.cfg.max_model_len - request.num_tokens) - 1
    return tuple(request.spec_token_ids[:max(0, min(room, budget - num_new))])

  def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list) -> bool:
    """Preempts the newest running requests until `request` fits; False if it went too."""
    while self.kv.allocate_slots(request, num_new) is None:
      victim = self.running.pop()
      self._preempt(victim)
      preempted.append(victim.request_id)
      if victim is request:
        return False
    return True

  def _schedule_waiting(self, budget: int, chunks: list) -> int:
    passed_over, busy = [], self._busy_slots()
    try:
      while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
        request = self.waiting[0]
        try:
          slot = self._lora_slot(request, busy)
        except Exception as e:  # pylint: disable=broad-except
          # Its adapter's slot write failed (a device out of memory, say): this request
          # ends with the error, the step goes on for everyone else.
          self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
          self._failed_admissions.append((request.request_id, e))
          continue
        if slot is None:   # its adapter waits for a slot: the requests behind it go on
          passed_over.append(self.waiting.popleft())
          continue
        hits = self.kv.get_computed_blocks(request)
        num_computed = len(hits) * self.cfg.block_size
        num_tokens = request.num_tokens
        num_new = self._num_new_tokens(num_tokens, num_computed, budget)
        if self.kv.allocate_slots(request, num_new, hits) is None:
          break   # first come, first served: nobody overtakes the head of the queue
        self.waiting.popleft()
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        request.lora_slot = slot
        busy.add(slot)
        self.running.append(request)
        chunks.append(self._chunk(request, num_new, num_tokens))
        budget -= num_new
    finally:   # also when a slot write raises: the passed-over keep their places
      self.waiting.extendleft(reversed(passed_over))
    return budget

  def take_failed_admissions(self) -> list[tuple[str, Exception]]:
    """(request id, error) of the requests finished since the last call because their
    adapter could not be written into a slot; the engine reports each error."""
    failed, self._failed_admissions = self._failed_admissions, []
    return failed

  def _busy_slots(self) -> set[int]:
    """The LoRA slots running requests read (none to change adapter under them); claims
    of adapters no waiting request wants are dropped first."""
    if self.lora is None:
      return set()
    self.lora.prune_claims({r.lora_id for r in self.waiting if r.lora_id})
    return {r.lora_slot for r in self.running if r.lora_slot}

  def _lora_slot(self, request: Request, busy: set[int]) -> int | None:
    """The device slot its adapter is in (written there now if need be; 0 for the
    base), or None while it waits for one."""
    if not request.lora_id:
      return 0
    return self.lora.slot_for(request.lora_id, busy)

  def _num_new_tokens(self, num_tokens: int, num_computed: int, budget: int) -> int:
    num_new = num_tokens - num_computed
    threshold = self.cfg.long_prefill_token_threshold
    if 0 < threshold < num_new:
      num_new = threshold
    return min(num_new, budget)

  def _chunk(self, request: Request, num_new: int, num_tokens: int,
             draft: tuple[int, ...] = ()) -> ScheduledChunk:
    start = request.num_computed_tokens
    end = start + num_new
    return ScheduledChunk(request.request_id, request.token_ids(start, end) + list(draft),
                          start, self.kv.get_block_ids(request.request_id).copy(),
                          end == num_tokens, draft, request.lora_slot)

  def _preempt(self, request: Request) -> None:
    self.kv.free(request)
    request.num_computed_tokens = 0
    request.spec_token_ids = []
    request.status = RequestStatus.PREEMPTED
    self.waiting.appendleft(request)
    self.num_preemptions += 1

  # Finishing.
  def _append_token(self, request: Request, token: int) -> RequestStatus | None:
    """Appends a sampled token; the finished status it causes, if any."""
    outputs = request.output_token_ids
    outputs.append(token)
    params = request.sampling_params
    if token == request.eos_token_id and not params.ignore_eos:
      return RequestStatus.FINISHED_STOPPED
    if params.stop_token_ids and token in params.stop_token_ids:
      request.stop_reason = token
      return RequestStatus.FINISHED_STOPPED
    num_outputs = len(outputs)
    if (num_outputs >= (params.max_tokens or self.cfg.max_model_len)
        or len(request.prompt_token_ids) + num_outputs >= self.cfg.max_model_len):
      return RequestStatus.FINISHED_LENGTH
    return None

  def _finish(self, request: Request, status: RequestStatus) -> None:
    self.kv.free(request)
    request.status = status
    del self.requests[request.request_id]
    self._finished_ids.append(request.request_id)


def _sampled_tokens(sampled: dict, chunk: ScheduledChunk) -> list[int]:
  """The chunk's accepted tokens, checked: a prefix of its draft, then one token."""
  rid, draft = chunk.request_id, chunk.spec_token_ids
  tokens = sampled.get(rid)
  if tokens is None:
    raise ValueError(f'no sampled token for request {rid!r}, whose chunk had '
                     'sample=True: pass one token per sampling chunk')
  tokens = [int(t) for t in tokens] if isinstance(tokens, (list, tuple)) else [int(tokens)]
  if not 1 <= len(tokens) <= len(draft) + 1 or tokens[:-1] != list(draft[:len(tokens) - 1]):
    raise ValueError(f'request {rid!r}: {tokens} is not a prefix of its draft {list(draft)} '
                     'followed by one sampled token')
  return tokens
