"""Prometheus metrics of one server, named as vLLM names them with our prefix.

Each app gets its own CollectorRegistry, so two servers in one process (tests) never share
a registry. Counts and gauges (running, waiting, KV usage, prefix cache, tokens, finish
reasons) are the engine's own, read when scraped; the latency histograms are fed by the
engine's observer hook with each finished request's timestamps (engine time, HTTP excluded).
"""

import threading
import time

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = 'meshlm:'
CONTENT_TYPE = prom.CONTENT_TYPE_LATEST
FINISH_REASONS = ('stop', 'length', 'abort', 'error')

# Seconds; fine steps at the low end where CPU decode steps of tiny models land.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineCollector:
  """Reads the engine's counters at scrape time (no polling thread, nothing to drift)."""

  def __init__(self, engine):
    self._engine = engine

  def collect(self):
    stats = self._engine.stats()
    gauges = (('num_requests_running', 'Requests in the running batch.', stats.num_running),
              ('num_requests_waiting', 'Requests waiting to be scheduled.', stats.num_waiting),
              ('kv_cache_usage_perc', 'Fraction of KV cache blocks in use (1 = full).',
               stats.kv_cache_usage))
    for name, doc, value in gauges:
      yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
    counters = (('prefix_cache_queries', 'Prompt tokens looked up in the prefix cache.',
                 stats.prefix_cache_queries),
                ('prefix_cache_hits', 'Prompt tokens found in the prefix cache.',
                 stats.prefix_cache_hits),
                ('prompt_tokens', 'Prompt tokens prefilled.', stats.prompt_tokens),
                ('generation_tokens', 'Tokens generated.', stats.generation_tokens),
                ('num_preemptions', 'Requests preempted: their KV blocks freed, their '
                 'tokens recomputed when they run again.', stats.num_preemptions),
                ('spec_decode_num_drafts', 'Speculative decoding: drafts verified.',
                 stats.spec_decode_num_drafts),
                ('spec_decode_num_draft_tokens', 'Speculative decoding: draft tokens '
                 'verified.', stats.spec_decode_num_draft_tokens),
                ('spec_decode_num_accepted_tokens', 'Speculative decoding: draft tokens '
                 'accepted.', stats.spec_decode_num_accepted_tokens))
    for name, doc, value in counters:
      yield CounterMetricFamily(PREFIX + name, doc, value=float(value))
    if stats.spec_decode_num_accepted_tokens_per_pos:
      per_pos = CounterMetricFamily(
          PREFIX + 'spec_decode_num_accepted_tokens_per_pos', 'Speculative decoding: draft '
          'tokens accepted at each draft position (0: the first).', labels=['position'])
      for pos, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        per_pos.add_metric([str(pos)], float(value))
      yield per_pos
    yield from _lora_metrics(self._engine)
    success = CounterMetricFamily(PREFIX + 'request_success', 'Finished requests by reason.',
                                  labels=['finished_reason'])
    for reason in FINISH_REASONS:
      success.add_metric([reason], float(stats.finished.get(reason, 0)))
    yield success


def _lora_metrics(engine):
  """vLLM's lora_requests_info (its labels name the adapters of running and waiting
  requests, comma-separated, and the slots; its value the scrape time), and the adapters
  loaded in host memory and resident in device slots."""
  info = getattr(engine, 'lora_requests', lambda: None)()
  if info is None:
    return
  family = GaugeMetricFamily(PREFIX + 'lora_requests_info', 'LoRA adapters of the running '
                             'and the waiting requests, and max_lora (device slots).',
                             labels=['running_lora_adapters', 'waiting_lora_adapters',
                                     'max_lora'])
  family.add_metric([','.join(info['running']), ','.join(info['waiting']),
                     str(info['max_lora'])], time.time())
  yield family
  yield GaugeMetricFamily(PREFIX + 'lora_adapters_loaded', 'LoRA adapters loaded in host '
                          'memory (at most --max-cpu-loras).', value=float(info['loaded']))
  yield GaugeMetricFamily(PREFIX + 'lora_adapters_resident', 'LoRA adapters in device '
                          'slots (at most --max-loras).', value=float(len(info['resident'])))


class ServerMetrics:
  """One app's registry: engine counters read on scrape, latency histograms per request."""

  def __init__(self, engine):
    self.registry = prom.CollectorRegistry()
    self.registry.register(_EngineCollector(engine))
    reg = self.registry
    self.ttft = prom.Histogram(PREFIX + 'time_to_first_token_seconds',
                               'Time from arrival to the first generated token.',
                               buckets=TTFT_BUCKETS, registry=reg)
    self.itl = prom.Histogram(PREFIX + 'inter_token_latency_seconds',
                              'Time between two generated tokens of a request.',
                              buckets=ITL_BUCKETS, registry=reg)
    self.e2e = prom.Histogram(PREFIX + 'e2e_request_latency_seconds',
                              'Time from arrival to the last token.',
                              buckets=E2E_BUCKETS, registry=reg)
    engine.add_observer(self.observe)

  def observe(self, m) -> None:
    """Called by the engine thread with a finished request's RequestMetrics."""
    if m.ttft is not None:
      self.ttft.observe(m.ttft)
    for gap in m.inter_token_latencies:
      self.itl.observe(gap)
    if m.e2e is not None:
      self.e2e.observe(m.e2e)

  def render(self) -> bytes:
    return prom.generate_latest(self.registry)


class StatsLogger:
  """vLLM's periodic engine line, for whoever watches the server's output: prompt and
  generation throughput since the last line, the batch, KV cache use and the prefix
  cache's hit rate over the prompt tokens looked up since then, and speculative decoding's
  acceptance. Quiet while idle."""

  def __init__(self, engine, clock=time.monotonic):
    self._engine, self._clock = engine, clock
    self._last = engine.stats()
    self._last_time = clock()

  def line(self) -> str | None:
    """The line for the time since the last call; None when nothing ran in it."""
    now, stats = self._clock(), self._engine.stats()
    last, seconds = self._last, max(now - self._last_time, 1e-9)
    self._last, self._last_time = stats, now
    prompt = stats.prompt_tokens - last.prompt_tokens
    generated = stats.generation_tokens - last.generation_tokens
    busy = stats.num_running or stats.num_waiting or last.num_running or last.num_waiting
    if not (prompt or generated or busy):
      return None
    text = (f'Engine: prompt {prompt / seconds:.1f} tokens/s, generation '
            f'{generated / seconds:.1f} tokens/s; {stats.num_running} running, '
            f'{stats.num_waiting} waiting; KV cache {stats.kv_cache_usage:.1%} used')
    queries = stats.prefix_cache_queries - last.prefix_cache_queries
    if queries:
      hits = stats.prefix_cache_hits - last.prefix_cache_hits
      text += f'; prefix cache hits {hits / queries:.1%} of {queries} prompt tokens'
    preempted = stats.num_preemptions - last.num_preemptions
    if preempted:
      text += f'; {preempted} preempted (KV cache full)'
    drafts = stats.spec_decode_num_drafts - last.spec_decode_num_drafts
    if drafts:
      drafted = stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens
      accepted = stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens
      text += (f'; drafts accepted {accepted / drafted:.1%} of {drafted} tokens, '
               f'{1 + accepted / drafts:.2f} tokens a draft step')
    return text + '.'

  def start(self, interval_s: float, out=print) -> threading.Event:
    """Prints line() every interval_s seconds on a daemon thread until the event is set."""
    stop = threading.Event()

    def loop():
      while not stop.wait(interval_s):
        text = self.line()
        if text:
          out(text, flush=True)

    threading.Thread(target=loop, daemon=True, name='meshlm-stats').start()
    return stop
