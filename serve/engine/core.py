"""The engine: a continuous-batching engine over one ServedModel, driven by a background
thread (serve/engine/loop.py) that runs scheduler -> runner -> sampler -> scheduler.

Requests come in from any thread or asyncio task (`add_request`) and get a
`RequestStream` of `RequestOutput` deltas; `abort` ends one after the step in flight;
`health` says whether the loop is alive and making progress.
"""

import dataclasses
import threading
import time
import uuid

from model import kv_quant, quant
from serve.config import ServeConfig, resolve_attention
from serve.engine import warmup
from serve.engine.constraints import bad_word_ids
from serve.engine.detokenizer import IncrementalDetokenizer
from serve.engine.errors import EngineClosed, EngineDeadError, QueueFull, UnknownAdapter
from serve.engine.kv_cache_manager import KVCacheManager
from serve.engine.loop import STALL_TIMEOUT_S, EngineLoop
from serve.engine.lora_registry import LoraRegistry
from serve.engine.output_processor import OutputProcessor
from serve.engine.outputs import CompletionResult, EngineStats, RequestMetrics
from serve.engine.request import Request
from serve.engine.scheduler import Scheduler, SchedulerConfig
from serve.engine.sizing import build_mesh, describe_cache, describe_model, size_cache
from serve.engine.stream import RequestStream
from serve.engine.tracked import TrackedRequest
from serve.load.hf_model import with_dtype, with_quantization
from serve.load.lora_workdir import BaseIdentity, LazyBaseIdentity
from serve.sampling_params import SamplingParams
from serve.worker import sampler
from serve.worker.logits_adjust import pack_bits
from serve.worker.model_runner import ModelRunner, RunnerConfig


class Engine(EngineLoop, OutputProcessor):
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
    # A LoRA workdir's adapters are checked against the weights as loaded, unquantized:
    # now where --quantization replaces them, else at the first such load (_load_adapters).
    self._lora_base = BaseIdentity.of(served) if cfg.enable_lora and (
        cfg.quantization != 'none' or served.params is None or
        quant.describe(served.params)) else None
    served = with_quantization(served, cfg.quantization)
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
    kv_quant.check_backend(cfg.kv_cache_dtype, self.mesh.devices.flat[0],
                           resolve_attention(cfg, served.model_cfg))
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
    self.lora = self._load_adapters()
    # The runner holds the weights now (per layer, model.paged.unstack_layers); keep the
    # rest only, so the caller can drop the stacked arrays it loaded (see serve.__main__).
    self.served = dataclasses.replace(served, params=None)
    self.sampler = sampler.Sampler(cfg.seed)   # cfg.seed draws for unseeded requests
    self._tracked: dict[str, TrackedRequest] = {}
    self._aborts: dict[str, tuple] = {}   # request id -> (its TrackedRequest, why)
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
      warmup.warm_up(self)
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
                         RunnerConfig(**shared,
                                      attention=resolve_attention(cfg, self.served.model_cfg),
                                      kv_cache_dtype=cfg.kv_cache_dtype,
                                      num_speculative_tokens=(
                                          self.spec.num_speculative_tokens if self.spec
                                          else 0),
                                      max_loras=cfg.max_loras if cfg.enable_lora else 0,
                                      max_lora_rank=cfg.max_lora_rank),
                         mesh=self.mesh, vocab_size=self.vocab_size)
    return scheduler, runner

  def _load_adapters(self) -> LoraRegistry | None:
    """The registry of LoRA adapters (--enable-lora), --lora-modules loaded into it."""
    if self.runner.lora is None:
      return None
    registry = LoraRegistry(self.served.model_cfg, self.runner.lora, self.served.name,
                            self.cfg.max_cpu_loras, base=self._lora_base or LazyBaseIdentity(
                                self.runner.params, self.served.model_cfg.dtype))
    self.scheduler.lora = registry   # admits a request once its adapter is in a slot
    for name, path in self.cfg.lora_module_paths().items():
      registry.load(name, path)
    loaded = ', '.join(f'{name} (rank {registry.rank(name)})' for name in
                       self.cfg.lora_module_paths()) or 'none yet'
    print(f'LoRA: up to {registry.max_cpu_loras} adapters of rank <= '
          f'{self.cfg.max_lora_rank} loaded, {self.cfg.max_loras} of them in a batch; '
          f'loaded: {loaded}.', flush=True)
    return registry

  def _make_kv_manager(self):
    return KVCacheManager(self.num_blocks, self.cfg.block_size,
                          enable_caching=self.cfg.enable_prefix_caching)

  # ---------------------------------------------------------------- public API

  def add_request(self, prompt_ids, params: SamplingParams | None = None,
                  request_id: str | None = None, *, bounded: bool = True,
                  lora: str | None = None) -> RequestStream:
    """Queues a request; raises ValueError (bad input), QueueFull or EngineClosed, or
    UnknownAdapter when `lora` (a LoRA adapter's name; None: the base) is not loaded."""
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
      self._attach_adapter(request, lora)
      try:
        self.scheduler.add_request(request)
      except Exception:
        if request.lora_id:
          self.lora.release(request.lora_id)
        raise
      self._tracked[request_id] = TrackedRequest(
          request, stream,
          IncrementalDetokenizer(self.served.tokenizer, prompt_ids, list(params.stop),
                                 params.include_stop_str_in_output, params.min_tokens,
                                 params.skip_special_tokens),
          RequestMetrics(request.arrival_time, len(prompt_ids)),
          None if params.prompt_logprobs is None else [None], guide,
          None if params.allowed_token_ids is None else pack_bits(
              params.allowed_token_ids, self.vocab_size),
          bad_words)
    if self._dead is not None:   # died while this was admitted: _die may not have seen it
      self._fail_dead(request_id)
    self._wake.set()
    return stream

  def _attach_adapter(self, request: Request, lora: str | None) -> None:
    """Gives the request its adapter (held until _finish releases it); the scheduler
    puts it in a slot when it admits the request."""
    if lora is None:
      return
    if self.lora is None:
      raise UnknownAdapter(f'The model {lora!r} does not exist: this server serves '
                           f'{self.served.name!r} and no LoRA adapters (--enable-lora).')
    request.lora_id = self.lora.acquire(lora)

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

  def generate(self, prompts, params=None, on_finish=None,
               loras=None) -> list[CompletionResult]:
    """Runs all prompts (token id lists) together; results in prompt order.

    params: one SamplingParams for all, or one per prompt. on_finish(result) is called
    as each request completes (for a progress bar), from the calling thread. loras: per
    prompt its LoRA adapter's name (None: the base); None: all on the base.
    """
    if params is None or isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f'{len(params)} SamplingParams for {len(prompts)} prompts; give '
                       'one for all or one per prompt.')
    loras = [None] * len(prompts) if loras is None else loras
    if len(loras) != len(prompts):
      raise ValueError(f'{len(loras)} LoRA names for {len(prompts)} prompts; give one per '
                       'prompt (None: the base).')
    streams = []
    try:
      for p, sp, lora in zip(prompts, params, loras):
        streams.append(self.add_request(p, sp, bounded=False, lora=lora))
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

  def lora_requests(self) -> dict | None:
    """vLLM's lora_requests_info: the adapters of running and of waiting requests, the
    slots (max_lora) and the adapters loaded and in slots; None without --enable-lora."""
    if self.lora is None:
      return None
    with self._lock:
      s = self.scheduler
      running = {r.lora_id for r in s.running if r.lora_id}
      waiting = {r.lora_id for r in s.waiting if r.lora_id}
    names = lambda ids: sorted(filter(None, map(self.lora.name_of, ids)))  # noqa: E731
    return {'running': names(running), 'waiting': names(waiting),
            'max_lora': self.cfg.max_loras, 'loaded': len(self.lora.names()),
            'resident': self.lora.resident()}

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
