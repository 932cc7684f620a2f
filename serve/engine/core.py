"""The engine: a background thread drives scheduler -> runner -> sampler -> scheduler.

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

import asyncio
import dataclasses
import math
import queue
import sys
import threading
import time
import traceback
import uuid

import jax
import numpy as np

from serve.worker import kv_cache, sampler
from serve.config import ServeConfig
from serve.engine.detokenizer import IncrementalDetokenizer
from serve.load.hf_model import with_dtype
from serve.engine.kv_cache_manager import KVCacheManager
from serve.worker.model_runner import (ModelRunner, RunnerConfig, sample_bucket, seq_bucket,
                                token_buckets)
from serve.engine.request import Request, RequestStatus
from serve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from serve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from serve.spec.ngram import TokenHistory, propose_ngram
from serve.engine.step_rows import PADDING, RequestRows, StepRows
from sharding import compile_cache
from sharding.mesh import MeshConfig, make_mesh

class QueueFull(RuntimeError):
  """More requests wait than ServeConfig.max_waiting_requests allows (HTTP 429)."""


class EngineClosed(RuntimeError):
  """The engine is shutting down and admits no new requests (HTTP 503)."""


class EngineDeadError(EngineClosed):
  """The engine loop died or stopped making progress (vLLM's EngineDeadError): every open
  request has failed with it, and no request is admitted again (HTTP 503)."""


STALL_TIMEOUT_S = 300.0   # no step done for this long with requests open: the engine is dead
MAX_FAILED_STEPS = 8      # this many failed steps in a row: the engine is dead


# ------------------------------------------------------------------------ plain outputs

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


# ------------------------------------------------------------------------ streams

class RequestStream:
  """Outputs of one request, read from a thread (`for`) or asyncio (`async for`).

  The engine thread puts; with an asyncio reader the put goes through the reader's loop
  (call_soon_threadsafe), since asyncio queues are not thread-safe.
  """

  def __init__(self, request_id: str, prompt_ids: list[int], engine: 'Engine'):
    self.request_id = request_id
    self.prompt_token_ids = prompt_ids
    self._engine = engine
    self._sync = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._loop = None
    self._async = None

  def put(self, out: RequestOutput) -> None:
    with self._lock:
      if self._async is None:
        self._sync.put(out)
        return
      try:
        self._loop.call_soon_threadsafe(self._async.put_nowait, out)
      except RuntimeError:   # the reader's loop is closed: nobody is listening
        pass

  def abort(self) -> None:
    self._engine.abort(self.request_id)

  def __iter__(self):
    while True:
      out = self._sync.get()
      yield out
      if out.finished:
        return

  async def __aiter__(self):
    with self._lock:
      self._loop, self._async = asyncio.get_running_loop(), asyncio.Queue()
      while not self._sync.empty():
        self._async.put_nowait(self._sync.get_nowait())
    while True:
      out = await self._async.get()
      yield out
      if out.finished:
        return

  def result(self) -> CompletionResult:
    """Blocks until the request finishes; the whole output."""
    return collect(self.request_id, self.prompt_token_ids, list(self))


def collect(request_id: str, prompt_ids: list[int], outs: list[RequestOutput]):
  logprobs = [lp for o in outs for lp in (o.logprobs or [])]
  last = outs[-1]
  return CompletionResult(
      request_id, list(prompt_ids), [t for o in outs for t in o.new_token_ids],
      ''.join(o.new_text for o in outs), last.finish_reason,
      logprobs if any(o.logprobs is not None for o in outs) else None, last.error,
      last.metrics, outs[0].prompt_logprobs)


def _not_yet(req: Request, ahead: int = 0) -> list[int]:
  """The tokens the request may not draw `ahead` tokens from now: before min_tokens, its
  eos and stop ids."""
  if req.num_output_tokens + ahead >= req.sampling_params.min_tokens:
    return []
  return req.end_token_ids


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
  """vLLM's bad_words as token sequences: each word as written (leading spaces dropped)
  and, where the tokenizer spells it differently after a space (a new word), that way
  too."""
  out = []
  for word in words:
    alone = tokenizer.encode(word.lstrip()).tolist()
    spaced = tokenizer.encode(' ' + word.lstrip()).tolist()
    if not alone:
      raise SamplingParamsError('bad_words', f'{word!r} is no token of this tokenizer; leave '
                                'it out.')
    out.append(alone)
    if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
      out.append(spaced)
  return out


def banned_by_words(sequences: list[list[int]], output: list[int]) -> list[int]:
  """The tokens that would complete a bad word now: each sequence's last token where the
  output ends with the rest of it (a one-token word always)."""
  return [seq[-1] for seq in sequences
          if len(seq) <= len(output) + 1 and output[len(output) - len(seq) + 1:] == seq[:-1]]


def _any_left(words: np.ndarray, banned: list[int]) -> bool:
  """Whether the tokens set in words (bits) are not all in banned."""
  if not banned:
    return bool(words.any())
  left = words.copy()
  ids = np.asarray(banned, np.int64)
  np.bitwise_and.at(left, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
  return bool(left.any())


@dataclasses.dataclass
class _Tracked:
  """The engine's side of a live request."""
  request: Request
  stream: RequestStream
  detok: IncrementalDetokenizer
  metrics: RequestMetrics
  # Asked-for prompt logprobs gathered so far, [None] + one per prompt token scored.
  prompt_logprobs: list | None = None
  guide: object = None   # guided.RequestGuide or GrammarGuide of a structured-output request
  allowed: np.ndarray | None = None   # allowed_token_ids as the sampler's bits
  bad_words: list = dataclasses.field(default_factory=list)   # bad_word_ids of the request
  history: TokenHistory | None = None   # its tokens as an array, for n-gram drafts
  emitted_step: int = -1   # the engine's _emit_count when its last token went out

  def constraints(self, draft=(), guided=None) -> tuple[list[int], np.ndarray | None]:
    """(banned ids, allowed bits or None) for this step, or for the row after `draft`
    (whose guide words are `guided`, from the guide's draft_words): min_tokens' and
    bad_words' bans; the guide's or allowed_token_ids' set. Bans that would leave nothing
    allowed give way, bad words first (a guide only a barred word can continue, or a
    list of end ids before min_tokens): the request goes on rather than draw outside its
    set."""
    if self.guide is not None:
      allowed = self.guide.words() if guided is None else guided
    else:
      allowed = self.allowed
    early = _not_yet(self.request, len(draft))
    words = (banned_by_words(self.bad_words, self.request.output_token_ids + list(draft))
             if self.bad_words else [])
    if allowed is None:
      return early + words, None
    for banned in (early + words, early):
      if _any_left(allowed, banned):
        return banned, allowed
    return [], allowed


# ------------------------------------------------------------------------ set-up

def build_mesh(cfg: ServeConfig):
  """A mesh of cfg.tensor devices over 'tensor' (every other axis 1)."""
  devices = jax.devices()
  if cfg.tensor > len(devices):
    raise ValueError(f'--tensor={cfg.tensor} but there are only {len(devices)} devices; '
                     f'choose at most {len(devices)}.')
  return make_mesh(MeshConfig(data=1, tensor=cfg.tensor), devices=devices[:cfg.tensor])


def resolve_attention(cfg: ServeConfig) -> str:
  if cfg.attention != 'auto':
    return cfg.attention
  return 'pallas' if jax.default_backend() == 'gpu' else 'xla'


def size_cache(served, cfg: ServeConfig, mesh, max_model_len: int) -> int:
  """Number of KV blocks; refuses a cache that cannot hold one full-length request."""
  per_request = math.ceil(max_model_len / cfg.block_size)
  num_blocks = cfg.num_blocks or _blocks_from_memory(served, cfg, mesh, per_request)
  # Block 0 is the scheduler's null block (padding writes land there).
  needed = per_request + 1
  if num_blocks < needed:
    raise ValueError(
        f'The KV cache has {num_blocks} blocks of {cfg.block_size} tokens '
        f'(one reserved), too few for one request of the full context '
        f'(--max-model-len={max_model_len} needs {needed} blocks). Give '
        f'--num-blocks={needed} or more, lower --max-model-len to '
        f'{max(num_blocks - 1, 0) * cfg.block_size} or less, or raise --memory-fraction.')
  return num_blocks


def _blocks_from_memory(served, cfg: ServeConfig, mesh, per_request: int) -> int:
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(served.params)) // cfg.tensor
  blocks = kv_cache.num_blocks_for_memory(
      served.model_cfg, cfg.block_size, fraction=cfg.memory_fraction,
      device=mesh.devices.flat[0], param_bytes=param_bytes, tensor_parallel=cfg.tensor)
  if mesh.devices.flat[0].platform == 'cpu':
    # CPU devices share the host's memory with everything else: no more than
    # max_num_seqs full-length requests can use at once.
    blocks = min(blocks, cfg.max_num_seqs * per_request + 1)
  return blocks


def describe_model(served) -> str:
  leaves = jax.tree.leaves(served.params)
  count, size = sum(x.size for x in leaves), sum(x.nbytes for x in leaves)
  count = f'{count / 1e9:.2f}B' if count >= 1e9 else f'{count / 1e6:.2f}M'
  size = f'{size / 2**30:.2f} GiB' if size >= 2**30 else f'{size / 2**20:.2f} MiB'
  cfg = served.model_cfg
  return (f'Model {served.name}: {count} parameters, {size} in {cfg.param_dtype}; '
          f'activations and KV cache in {cfg.dtype}.')


def describe_cache(num_blocks: int, cfg: ServeConfig, max_model_len: int) -> str:
  tokens = (num_blocks - 1) * cfg.block_size
  return (f'KV cache: {num_blocks} blocks of {cfg.block_size} tokens = {tokens} tokens; '
          f'{tokens / max_model_len:.1f} requests at the full context of {max_model_len} '
          'tokens at once.')


def _warmup_step(num_seqs: int, num_tokens: int, block_size: int,
                 max_len: int) -> SchedulerOutput:
  """num_seqs chunks of num_tokens in all (fewer if chunks of max_len cannot hold them),
  every block the null block 0 (whose K/V nobody reads), each chunk sampled."""
  total = min(num_tokens, num_seqs * max_len)
  sizes = [total // num_seqs + (i < total % num_seqs) for i in range(num_seqs)]
  chunks = [ScheduledChunk(f'warmup{i}', [0] * n, 0, [0] * math.ceil(n / block_size), True)
            for i, n in enumerate(sizes)]
  return SchedulerOutput(chunks, [], [], total)


# ------------------------------------------------------------------------ engine

class Engine:
  """A continuous-batching engine over one ServedModel; starts its thread at once."""

  def __init__(self, served, cfg: ServeConfig | None = None, *,
               stall_timeout_s: float = STALL_TIMEOUT_S):
    if not stall_timeout_s > 0:
      raise ValueError(f'stall_timeout_s={stall_timeout_s}: give a positive number of seconds '
                       '(longer than the slowest step, a compile included).')
    self.stall_timeout_s = stall_timeout_s
    self.cfg = cfg = cfg or ServeConfig()
    cfg.validate()
    if cfg.dtype != 'auto':   # the loaders take it too, and cast while loading
      served = with_dtype(served, cfg.dtype)
    if cfg.generation_config == 'none' and served.sampling_defaults:
      served = dataclasses.replace(served, sampling_defaults={})
    self.served = served
    self.spec = cfg.speculative()
    self.vocab_size = served.tokenizer.vocab_size
    self.max_model_len = cfg.max_model_len or served.model_cfg.max_seq_len
    if self.max_model_len > served.model_cfg.max_seq_len:
      raise ValueError(f'--max-model-len={self.max_model_len} exceeds the model\'s context '
                       f'of {served.model_cfg.max_seq_len} tokens; give at most that.')
    self.mesh = build_mesh(cfg)
    self.num_blocks = size_cache(served, cfg, self.mesh, self.max_model_len)
    print(describe_model(served), flush=True)
    if served.sampling_defaults:
      fields = ', '.join(f'{k}={v}' for k, v in served.sampling_defaults.items())
      print(f'Sampling defaults from generation_config.json: {fields} (for the fields a '
            'request leaves out; --generation-config none: OpenAI\'s).', flush=True)
    print(describe_cache(self.num_blocks, cfg, self.max_model_len), flush=True)
    if self.spec is not None:
      print(f'Speculative decoding: n-gram drafts of up to {self.spec.num_speculative_tokens} '
            f'tokens, from the last {self.spec.prompt_lookup_max} down to '
            f'{self.spec.prompt_lookup_min} tokens looked up in each request\'s own '
            'prompt and output.', flush=True)
    self.scheduler, self.runner = self._build_parts()
    # The runner holds the weights now (per layer, model.paged.unstack_layers); keep the
    # rest only, so the caller can drop the stacked arrays it loaded (see serve.__main__).
    self.served = dataclasses.replace(served, params=None)
    self.sampler = sampler.Sampler(cfg.seed)   # cfg.seed draws for unseeded requests
    self._tracked: dict[str, _Tracked] = {}
    self._aborts: dict[str, tuple] = {}   # request id -> (its _Tracked, why)
    self._observers = []
    self._totals = {'prompt_tokens': 0, 'generation_tokens': 0, 'drafts': 0,
                    'draft_tokens': 0, 'accepted_tokens': 0}
    self._accepted_per_pos = [0] * (self.spec.num_speculative_tokens if self.spec else 0)
    self._guided = None   # guided.GuidedDecoding, built at the first guided request
    self._guided_lock = threading.Lock()
    self._finished_by_reason = {r: 0 for r in ('stop', 'length', 'abort', 'error')}
    self._pending_outputs = None   # (tokens, logprobs, finished) of the last step
    self._emit_count = 0   # steps emitted (a step's tokens share one token_times entry)
    self._lock = threading.RLock()
    self._wake = threading.Event()
    self._admitting, self._stopping = True, False
    # Liveness (health): when a step last completed, the failed steps since, and why the
    # engine is dead once it is.
    self._progress_at, self._failed_steps, self._dead = time.monotonic(), 0, None
    self._dead_lock = threading.Lock()
    if cfg.warmup:
      self._warmup()
    self._thread = threading.Thread(target=self._run, name='meshlm-engine', daemon=True)
    self._thread.start()

  def _build_parts(self):
    cfg = self.cfg
    shared = dict(block_size=cfg.block_size, num_blocks=self.num_blocks,
                  max_num_seqs=cfg.max_num_seqs,
                  max_num_batched_tokens=cfg.max_num_batched_tokens,
                  max_model_len=self.max_model_len)
    scheduler = Scheduler(
        SchedulerConfig(**shared, enable_prefix_caching=cfg.enable_prefix_caching),
        self._make_kv_manager())
    runner = ModelRunner(self.served.params, self.served.model_cfg,
                         RunnerConfig(**shared, attention=resolve_attention(cfg),
                                      num_speculative_tokens=(
                                          self.spec.num_speculative_tokens if self.spec
                                          else 0)),
                         mesh=self.mesh, vocab_size=self.vocab_size)
    return scheduler, runner

  def _make_kv_manager(self):
    return KVCacheManager(self.num_blocks, self.cfg.block_size,
                          enable_caching=self.cfg.enable_prefix_caching)

  def _warmup(self) -> None:
    """Compiles the runner for every token bucket and the sampler for every row count and
    mode, before the loop starts, so no request waits on a compile."""
    start, cfg = time.perf_counter(), self.runner.cfg
    hits, programs = compile_cache.hits(), compile_cache.programs()
    logits = {}   # per sample bucket: the runner's logits [bucket, V], uncut
    smaller = 0
    for t in token_buckets(cfg):
      step = _warmup_step(seq_bucket(cfg, t), t, cfg.block_size, cfg.max_model_len)
      if step.num_batched_tokens > smaller:   # else no real step lands in bucket t
        logits[sample_bucket(cfg, t)] = self.runner.step(step).logits
      smaller = t
    self._warmup_sampler(logits)
    cached, built = compile_cache.hits() - hits, compile_cache.programs() - programs
    print(f'Warm-up: {self.runner.num_compiles} step programs '
          f'{"ready" if cached else "compiled"} in {time.perf_counter() - start:.1f}s' + (
              f' ({cached} of {built} programs, the sampler\'s included, read from the '
              'compilation cache).' if cached else '.'), flush=True)

  def _warmup_sampler(self, logits: dict) -> None:
    # The sampler takes the runner's logits [bucket, V] whole and cuts or pads them to
    # its row bucket (n's power of two): programs per (bucket, row bucket). Each mode
    # plain and with structured output's allowed-token bits; the model's own sampling
    # defaults (generation_config.json) are a mode too. Their penalties read the
    # sampler's per-request tables, sized here for max_num_seqs requests and the longest
    # draft (serve/worker/penalties.py): no history length is a shape.
    modes = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_p=0.9)]
    if self.served.sampling_defaults:
      modes.append(SamplingParams(**self.served.sampling_defaults))
    self._reserve_penalties(modes)
    warm = [sampler.PenaltyRow(f'warm-up {i}', [0], []) for i in range(self.cfg.max_num_seqs)]
    # Each mode with logprobs too: the sampled token's alone (chat's logprobs: true) and
    # with the top N (any N: one program), without structured output.
    scored = [dataclasses.replace(m, logprobs=k) for m in modes for k in (0, 1)]
    every = sampler.pack_bits(range(self.vocab_size), self.vocab_size)
    for rows, full in logits.items():
      # one row count per row bucket (the largest may be cut to the rows there are)
      for n in sorted({min(sampler.row_bucket(m), rows) for m in range(1, rows + 1)}):
        requests = [warm[i % len(warm)] for i in range(n)]   # draft rows share a request
        for params, allowed in ([(p, a) for p in modes for a in (None, [every] * n)]
                                + [(p, None) for p in scored]):
          self.sampler(full, [params] * n, [0] * n, self.vocab_size, allowed=allowed,
                       requests=requests)
    for row in warm:
      self.sampler.release(row.request_id)

  def _reserve_penalties(self, modes) -> None:
    repetition = any(m.repetition_penalty != 1 for m in modes)
    counts = any(m.counts_output for m in modes)
    if repetition or counts:
      self.sampler.penalties.reserve(
          self.cfg.max_num_seqs, self.vocab_size,
          self.spec.num_speculative_tokens if self.spec else 0, repetition, counts)

  # ---------------------------------------------------------------- public API

  def add_request(self, prompt_ids, params: SamplingParams | None = None,
                  request_id: str | None = None, *, bounded: bool = True) -> RequestStream:
    """Queues a request; raises ValueError (bad input), QueueFull or EngineClosed."""
    params = self._prepare_params(params or SamplingParams())
    prompt_ids = self.check_prompt(prompt_ids, params)
    request_id = request_id or uuid.uuid4().hex
    eos = None if params.ignore_eos or not self.served.eos_token_ids else (
        self.served.eos_token_ids[0])
    request = Request(request_id=request_id, prompt_token_ids=prompt_ids,
                      sampling_params=params, eos_token_id=eos, arrival_time=time.monotonic(),
                      output_token_ids=[])
    guide = self._guided_decoding().guide(
        params.guided_regex, grammar=params.guided_grammar) if params.guided else None
    bad_words = bad_word_ids(self.served.tokenizer, params.bad_words)
    stream = RequestStream(request_id, prompt_ids, self)
    with self._lock:
      self._admit(request_id, bounded)
      self.scheduler.add_request(request)
      self._tracked[request_id] = _Tracked(
          request, stream,
          IncrementalDetokenizer(self.served.tokenizer, prompt_ids, list(params.stop),
                                 params.include_stop_str_in_output, params.min_tokens,
                                 params.skip_special_tokens),
          RequestMetrics(request.arrival_time, len(prompt_ids)),
          None if params.prompt_logprobs is None else [None], guide,
          None if params.allowed_token_ids is None else sampler.pack_bits(
              params.allowed_token_ids, self.vocab_size),
          bad_words)
    if self._dead is not None:   # died while this was admitted: _die may not have seen it
      self._fail_dead(request_id)
    self._wake.set()
    return stream

  def compile_guided(self, params: SamplingParams) -> None:
    """Compiles (and caches) a guided output's expression, or checks its grammar against
    the vocabulary, ahead of add_request: seconds for a large vocabulary, so the server
    runs it in a thread. ValueError if it cannot be followed with this vocabulary."""
    if params.guided:
      self._guided_decoding().compile(params.guided_regex, grammar=params.guided_grammar)

  def _guided_decoding(self):
    with self._guided_lock:
      if self._guided is None:
        from serve.structured import guided  # pylint: disable=import-outside-toplevel
        self._guided = guided.GuidedDecoding(self.served.tokenizer, self.served.eos_token_ids)
      return self._guided

  def abort(self, request_id: str) -> None:
    """Ends the request (finish_reason 'abort') and frees its blocks after this step.

    Without the engine's lock (the server's event loop calls it on a disconnect): one
    dict operation each, atomic under the GIL. The abort names the tracked request it
    was for, so one that finishes meanwhile leaves an entry _apply_aborts drops, and a
    later request reusing the id is not aborted by it."""
    t = self._tracked.get(request_id)
    if t is not None:
      self._aborts.setdefault(request_id, (t, 'aborted'))
    self._wake.set()

  def generate(self, prompts, params=None, on_finish=None) -> list[CompletionResult]:
    """Runs all prompts (token id lists) together; results in prompt order.

    params: one SamplingParams for all, or one per prompt. on_finish(result) is called
    as each request completes (for a progress bar), from the calling thread.
    """
    if params is None or isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f'{len(params)} SamplingParams for {len(prompts)} prompts; give '
                       'one for all or one per prompt.')
    streams = []
    try:
      for p, sp in zip(prompts, params):
        streams.append(self.add_request(p, sp, bounded=False))
    except Exception:
      for stream in streams:   # a refused prompt: the ones already queued would run unread
        self.abort(stream.request_id)
      raise
    results = []
    for stream in streams:
      results.append(stream.result())
      if on_finish:
        on_finish(results[-1])
    return results

  def add_observer(self, fn) -> None:
    """fn(RequestMetrics) is called from the engine thread as each request finishes."""
    self._observers.append(fn)

  def stats(self) -> EngineStats:
    with self._lock:
      s = self.scheduler
      return EngineStats(
          num_running=s.num_running, num_waiting=s.num_waiting,
          kv_cache_usage=float(s.kv_cache_usage),
          prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
          prompt_tokens=self._totals['prompt_tokens'],
          generation_tokens=self._totals['generation_tokens'],
          finished=dict(self._finished_by_reason), num_preemptions=s.num_preemptions,
          spec_decode_num_drafts=self._totals['drafts'],
          spec_decode_num_draft_tokens=self._totals['draft_tokens'],
          spec_decode_num_accepted_tokens=self._totals['accepted_tokens'],
          spec_decode_num_accepted_tokens_per_pos=tuple(self._accepted_per_pos))

  @property
  def max_waiting_requests(self) -> int:
    return self.cfg.max_waiting_requests

  @property
  def num_unfinished(self) -> int:
    return len(self._tracked)   # no lock: one read (the server's drain polls it)

  def shutdown(self, grace_s: float = 0.0) -> None:
    """Stops admitting, lets requests finish for grace_s, aborts the rest, stops the loop.
    A dead engine has failed its requests already, and its loop may hold the lock
    forever: then it only asks the loop to stop."""
    if self._dead is not None:
      self._stopping = True
      self._wake.set()
      self._thread.join(timeout=1)
      return
    with self._lock:
      self._admitting = False
    deadline = time.monotonic() + grace_s
    while self.num_unfinished and time.monotonic() < deadline:
      time.sleep(0.01)
    with self._lock:
      for rid, t in list(self._tracked.items()):
        self._aborts.setdefault(rid, (t, 'the engine shut down before the request finished'))
    self._wake.set()
    while self.num_unfinished and self._thread.is_alive():
      time.sleep(0.01)
    self._stopping = True
    self._wake.set()
    self._thread.join(timeout=10)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.shutdown()

  # ---------------------------------------------------------------- admission

  def _prepare_params(self, params: SamplingParams) -> SamplingParams:
    params.validate(self.vocab_size)
    changes = {}
    extra_eos = [] if params.ignore_eos else self.served.eos_token_ids[1:]
    if extra_eos:
      changes['stop_token_ids'] = list(params.stop_token_ids) + list(extra_eos)
    return dataclasses.replace(params, **changes) if changes else params

  def check_prompt(self, prompt_ids, params: SamplingParams) -> list[int]:
    ids = [int(t) for t in prompt_ids]
    if not ids:
      raise ValueError('prompt is empty: give at least one token.')
    bad = [t for t in ids if not 0 <= t < self.vocab_size]
    if bad:
      raise ValueError(f'prompt: token id {bad[0]} is outside the vocabulary '
                       f'[0, {self.vocab_size}).')
    if len(ids) + params.max_tokens > self.max_model_len:
      raise ValueError(
          f'prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: together '
          f'more than the context of {self.max_model_len} tokens. Shorten the prompt or '
          f'lower max_tokens to {max(self.max_model_len - len(ids), 0)} or less.')
    return ids

  def _admit(self, request_id: str, bounded: bool) -> None:
    if self._dead is not None:
      raise EngineDeadError(f'The engine is dead ({self._dead}); no request can run.')
    if not self._admitting:
      raise EngineClosed('The engine is shutting down and takes no new requests.')
    if request_id in self._tracked:
      raise ValueError(f'request id {request_id!r} is already in use.')
    waiting = self.scheduler.num_waiting
    if bounded and waiting >= self.cfg.max_waiting_requests:
      raise QueueFull(f'{waiting} requests are already waiting (--max-waiting-requests='
                      f'{self.cfg.max_waiting_requests}); retry later.')

  # ---------------------------------------------------------------- the loop

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

    A step's outputs (detokenizing, streaming: ~0.3 ms for 16 tokens) go out while the
    device runs the next step, unless a request in it has stop strings: those are found
    while detokenizing and must end the request before the next schedule."""
    with self._lock:
      self._apply_aborts()
      if self.spec is not None:
        self._propose_drafts()
      out = self.scheduler.schedule()
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
    targets, top_n = self._prompt_targets(out)
    # dispatched; the device runs it while the previous step's outputs go out
    step = self.runner.step(out, targets, top_n) if targets else self.runner.step(out)
    if step.num_sampled != layout.num_rows:
      raise RuntimeError(f'the runner sampled {step.num_sampled} rows of a step laid out '
                         f'with {layout.num_rows}: its row order is not StepRows\'.')
    self._flush_outputs()
    layout.keep(self._tracked)   # a request failed while those outputs went out drops out
    if step.scores is not None:
      self._gather_prompt_logprobs(out, targets, step.scores)
    inputs = self._row_inputs(layout)
    if not layout:
      return {}, {}
    return self._accept(layout, self._sample(step, layout, inputs))

  def _row_inputs(self, layout: StepRows) -> dict:
    """Per live request, per row: (params, step, PenaltyRow, banned, allowed) as the sampler
    takes them. A request whose guide or bans fail here fails alone and drops out."""
    inputs = {}
    for r in layout:
      t = self._tracked[r.request_id]
      try:
        inputs[r.request_id] = self._request_inputs(t, r)
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc(file=sys.stderr)
        layout.drop(r.request_id)
        self._fail([r.request_id], e)
    return inputs

  def _request_inputs(self, t: _Tracked, r: RequestRows) -> list[tuple]:
    # Row j is sampled as if the draft's first j tokens were output already; a guide
    # follows the draft as far as it allows (later rows are not taken).
    if t.guide is not None and r.draft:
      try:
        r.guided = t.guide.draft_words(r.draft, self.served.eos_token_ids)
      except ValueError:   # the guide could not look ahead: no draft token is taken
        r.guided = [t.guide.words()]
    req, rows = t.request, []
    for j in range(len(r)):
      ahead = r.draft[:j]
      banned, allowed = t.constraints(ahead, r.guided and r.guided[min(j, r.usable)])
      penalty = sampler.PenaltyRow(req.request_id, req.prompt_token_ids,
                                   req.output_token_ids, ahead)
      rows.append((req.sampling_params, req.num_output_tokens + j, penalty, banned, allowed))
    return rows

  def _sample(self, step, layout: StepRows, inputs: dict) -> sampler.SampleResult:
    """Every row of the step, each live request's at its own place, the others padding."""
    padding = (PADDING, 0, sampler.PenaltyRow('', (), ()), [], None)   # PADDING: no penalty
    rows = layout.per_row(lambda r, j: inputs[r.request_id][j], padding)
    params, steps, requests, banned, allowed = map(list, zip(*rows))
    if (all(p.greedy and p.logprobs is None and not p.adjusts_logits for p in params)
        and not any(banned) and all(a is None for a in allowed)):
      # The step's own argmax: the token the sampler would pick, without its program.
      return sampler.SampleResult(np.asarray(step.greedy)[:len(rows)], None,
                                  [None] * len(rows))
    return self.sampler(step.logits, params, steps, self.vocab_size, banned=banned,
                        allowed=allowed, requests=requests)

  def _accept(self, layout: StepRows, res: sampler.SampleResult):
    """Each request's draft up to its first row whose token differs, and that token."""
    tokens, logprobs = {}, {}
    for r in layout:
      rid = r.request_id
      want = self._tracked[rid].request.sampling_params.logprobs is not None
      accepted, scored = [], []
      for j in range(len(r)):
        row = r.row(j)
        token = int(res.token_ids[row])
        accepted.append(token)
        if want:
          top = res.top_logprobs[row] if res.top_logprobs is not None else None
          scored.append(TokenLogprob(token, float(res.logprobs[row]), top,
                                     int(res.ranks[row])))
        if j == r.usable or token != r.draft[j]:
          break
      tokens[rid] = accepted
      if want:
        logprobs[rid] = scored
      self._count_draft(r.draft, accepted)
    return tokens, logprobs

  def _count_draft(self, draft, accepted) -> None:
    if draft:
      self._totals['drafts'] += 1
      self._totals['draft_tokens'] += len(draft)
      self._totals['accepted_tokens'] += len(accepted) - 1
      for pos in range(len(accepted) - 1):
        self._accepted_per_pos[pos] += 1

  def _prompt_targets(self, out):
    """Per chunk, the prompt token each of its rows predicts (-1: none), or None for
    chunks whose request wants no prompt logprobs (no list at all when no chunk does);
    and the top-N width (0 or the most)."""
    targets, top = [], 0
    for c in out.chunks:
      t = self._tracked.get(c.request_id)
      want = t is not None and t.prompt_logprobs is not None
      prompt = t.request.prompt_token_ids if want else ()
      # (a preempted request recomputes its prompt: positions it has are not scored again)
      first = max(c.start_position + 1, len(t.prompt_logprobs) if want else 0)
      if not want or first >= min(len(prompt), c.start_position + 1 + len(c.token_ids)):
        targets.append(None)
        continue
      nxt = np.arange(c.start_position + 1, c.start_position + 1 + len(c.token_ids))
      scored = (nxt >= first) & (nxt < len(prompt))
      targets.append(np.where(scored, np.asarray(prompt)[np.minimum(nxt, len(prompt) - 1)],
                              -1))
      top = max(top, t.request.sampling_params.prompt_logprobs)
    if all(t is None for t in targets):
      return None, 0
    return targets, min(MAX_LOGPROBS, self.vocab_size) if top else 0

  def _gather_prompt_logprobs(self, out, targets, scores) -> None:
    """Appends each scored chunk's entries to its request, in prompt order (its scored
    rows are consecutive positions from the first it lacks: _prompt_targets)."""
    target, rank, top = jax.device_get(scores)
    row = 0
    for c, want in zip(out.chunks, targets):
      t = self._tracked.get(c.request_id)
      if want is not None and t is not None:
        count = t.request.sampling_params.prompt_logprobs
        for k in np.flatnonzero(want >= 0) + row:
          pairs = ([(int(i), float(v)) for i, v in zip(top[1][k, :count], top[0][k, :count])]
                   if count else [])
          t.prompt_logprobs.append(TokenLogprob(int(want[k - row]), float(target[k]), pairs,
                                                int(rank[k])))
      row += len(c.token_ids)

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

  def _on_token(self, t: _Tracked, token: int, logprob, finished_now: bool,
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

  def _finish(self, t: _Tracked, reason=None, token_ids=(), text='', logprobs=None,
              error=None, prompt_logprobs=None) -> None:
    req = t.request
    reason = reason or req.status.finish_reason or 'stop'
    self.sampler.release(req.request_id)   # its penalty slots (safe from any thread)
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

  def _apply_aborts(self) -> None:
    if self._aborts:   # a request that finished last step reports that, not the abort
      self._flush_outputs()
    while self._aborts:   # taken one by one: a failing abort is not retried forever
      rid, (t, why) = self._aborts.popitem()
      if self._tracked.get(rid) is t:
        self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        self._finish(t, 'abort', error=why)

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
