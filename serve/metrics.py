"""Prometheus metrics of one server, named as vLLM names them with our prefix.

Each app gets its own CollectorRegistry, so two servers in one process (tests) never share
counts. Engine-wide numbers (running, waiting, KV usage, prefix cache) are read from the
engine when scraped; per-request numbers (tokens, latencies, finish reasons) are recorded by
the server as a request's stream goes by.
"""

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
  """Reads the engine's scheduler numbers at scrape time (no polling thread)."""

  def __init__(self, stats_fn):
    self._stats_fn = stats_fn

  def collect(self):
    stats = self._stats_fn()
    gauges = (('num_requests_running', 'Requests running in the engine (in the batch).'),
              ('num_requests_waiting', 'Requests waiting to be scheduled.'),
              ('kv_cache_usage_perc', 'Fraction of KV cache blocks in use (1 = full).'))
    for name, doc in gauges:
      yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats[name]))
    counters = (('prefix_cache_queries', 'Prompt tokens looked up in the prefix cache.'),
                ('prefix_cache_hits', 'Prompt tokens found in the prefix cache.'))
    for name, doc in counters:
      yield CounterMetricFamily(PREFIX + name, doc, value=float(stats[name]))


class ServerMetrics:
  """The registry of one app, and what the server records per request."""

  def __init__(self, stats_fn):
    self.registry = prom.CollectorRegistry()
    self.registry.register(_EngineCollector(stats_fn))
    reg = self.registry
    self.prompt_tokens = prom.Counter(PREFIX + 'prompt_tokens', 'Prompt tokens processed.',
                                      registry=reg)
    self.generation_tokens = prom.Counter(PREFIX + 'generation_tokens',
                                          'Tokens generated.', registry=reg)
    self.request_success = prom.Counter(PREFIX + 'request_success',
                                        'Finished requests by finish reason.',
                                        ['finished_reason'], registry=reg)
    for reason in FINISH_REASONS:
      self.request_success.labels(reason)   # present at 0 before the first request
    self.ttft = prom.Histogram(PREFIX + 'time_to_first_token_seconds',
                               'Time from arrival to the first generated token.',
                               buckets=TTFT_BUCKETS, registry=reg)
    self.itl = prom.Histogram(PREFIX + 'inter_token_latency_seconds',
                              'Time between two generated tokens of a request.',
                              buckets=ITL_BUCKETS, registry=reg)
    self.e2e = prom.Histogram(PREFIX + 'e2e_request_latency_seconds',
                              'Time from arrival to the last token.',
                              buckets=E2E_BUCKETS, registry=reg)

  def render(self) -> bytes:
    return prom.generate_latest(self.registry)

  def tracker(self) -> 'RequestTracker':
    return RequestTracker(self)


class RequestTracker:
  """Timestamps of one request's stream, turned into the histograms above."""

  def __init__(self, metrics: ServerMetrics):
    self._m = metrics
    self.arrival = time.perf_counter()
    self._last = None
    self._done = False

  def on_output(self, num_new_tokens: int) -> None:
    if num_new_tokens <= 0:
      return
    now = time.perf_counter()
    if self._last is None:
      self._m.ttft.observe(now - self.arrival)
    else:
      # Several tokens in one delta share the gap: one observation per token.
      for _ in range(num_new_tokens):
        self._m.itl.observe((now - self._last) / num_new_tokens)
    self._last = now
    self._m.generation_tokens.inc(num_new_tokens)

  def on_finish(self, reason: str, num_prompt_tokens: int) -> None:
    if self._done:
      return
    self._done = True
    self._m.prompt_tokens.inc(num_prompt_tokens)
    self._m.request_success.labels(reason if reason in FINISH_REASONS else 'error').inc()
    self._m.e2e.observe(time.perf_counter() - self.arrival)
