"""Load test of a running server, like `vllm bench serve`: latency percentiles under load.

  python -m benchmarks.serve_load --url http://127.0.0.1:8000 --num-prompts 64 \\
      --input-len 32 --output-len 32 --request-rate 4 --max-concurrency 8
  python -m benchmarks.serve_load --launch [--checkpoint DIR | --hf-model DIR] ...
  python -m benchmarks.serve_load --launch --smoke     # a few requests; writes nothing

Prompts are random token ids below 256 (valid for the byte tokenizer and any HF one), sent
to /v1/completions with `ignore_eos`, so every request has exactly the input and output
lengths asked. Meanwhile a probe asks GET /v1/models every --probe-interval-ms and
records how long the server takes to answer (a server whose HTTP loop waits on its
engine answers late). Arrivals are Poisson at --request-rate per second (`inf`: all at once, a
burst), at most --max-concurrency in flight. Each request streams; per request it records
time to first token (TTFT), time per output token after the first (TPOT), the gaps between
streamed chunks (ITL) and end-to-end latency. --launch starts `python -m serve` on a free
127.0.0.1 port (the tiny config trained for a few seconds if no model is given) and stops it
after. Results: benchmarks/results/serve_load_<platform>.json.

The probe runs in its own process (--probe-from process, the default), so the load
generator's own event loop, busy parsing 64 streams, does not delay the probe's answers;
--probe-from loop probes from the load generator's loop as earlier results did. --control
also starts a trivial FastAPI server in a process of its own, answering GET /v1/models
with the same kind of body, and probes it beside the real one: its answer times are what an
HTTP process that does not share a GIL with the engine gets on the same loaded machine (the
lower bound of moving the engine core into its own process, as vLLM v1 does).
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import http.client
import multiprocessing
import urllib.parse

import httpx
import numpy as np

from benchmarks.common import write_result

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class Result:
  ok: bool
  ttft: float = 0.0
  e2e: float = 0.0
  itls: list = dataclasses.field(default_factory=list)
  output_tokens: int = 0
  error: str = ''

  @property
  def tpot(self) -> float | None:
    return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def make_prompts(num: int, input_len: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, size=(num, input_len)).tolist()


def arrival_delays(num: int, rate: float, seed: int) -> np.ndarray:
  """Seconds from the start to each request's arrival (Poisson process; inf: burst)."""
  if rate == float('inf'):
    return np.zeros(num)
  gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=num)
  return np.cumsum(gaps) - gaps[0]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
  start = time.perf_counter()
  stamps, usage = [], None
  try:
    async with client.stream('POST', url + '/v1/completions', json=body) as resp:
      if resp.status_code != 200:
        return Result(False, error=f'{resp.status_code}: {(await resp.aread())[:200]!r}')
      async for line in resp.aiter_lines():
        if not line.startswith('data: ') or line == 'data: [DONE]':
          continue
        chunk = json.loads(line[len('data: '):])
        if 'error' in chunk:
          return Result(False, error=chunk['error']['message'])
        if chunk.get('usage'):
          usage = chunk['usage']
        if any(c.get('text') for c in chunk.get('choices', ())):
          stamps.append(time.perf_counter())
  except httpx.HTTPError as e:
    return Result(False, error=f'{type(e).__name__}: {e}')
  end = time.perf_counter()
  if not stamps:
    return Result(False, error='no tokens streamed')
  return Result(True, stamps[0] - start, end - start, list(np.diff(stamps)),
                usage['completion_tokens'] if usage else len(stamps))


async def probe(client: httpx.AsyncClient, url: str, interval_s: float, done: asyncio.Event,
                latencies: list) -> None:
  """GET /v1/models every interval_s until `done`; appends each answer's seconds."""
  while not done.is_set():
    start = time.perf_counter()
    resp = await client.get(url + '/v1/models')
    if resp.status_code == 200:
      latencies.append(time.perf_counter() - start)
    await asyncio.sleep(interval_s)


def _probe_process(url: str, interval_s: float, ready, stop, out) -> None:
  """Blocking GET /v1/models every interval_s on one kept-alive connection until `stop`
  is set, setting `ready` at its first answer; puts the list of answer seconds on `out`.
  Runs in a spawned process."""
  parts = urllib.parse.urlsplit(url)
  conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
  latencies = []
  while not stop.is_set():
    start = time.perf_counter()
    conn.request('GET', '/v1/models')
    resp = conn.getresponse()
    resp.read()
    if resp.status == 200:
      latencies.append(time.perf_counter() - start)
    ready.set()
    time.sleep(interval_s)
  conn.close()
  out.put(latencies)


class ProbeProcesses:
  """One probe process per url, started on enter; `.results()` after exit: seconds per url."""

  def __init__(self, urls: list[str], interval_s: float):
    ctx = multiprocessing.get_context('spawn')   # no fork of a process that may hold jax
    self._stop, self._queues = ctx.Event(), [ctx.Queue() for _ in urls]
    self._ready = [ctx.Event() for _ in urls]
    self._procs = [ctx.Process(target=_probe_process, args=(u, interval_s, r, self._stop, q),
                               daemon=True)
                   for u, r, q in zip(urls, self._ready, self._queues)]
    self._results = None

  def __enter__(self):
    for proc in self._procs:
      proc.start()
    # The load starts only once every probe has had an answer: a spawned process imports
    # for a second or more on a busy machine, longer than a short load runs.
    for proc, ready in zip(self._procs, self._ready):
      while not ready.wait(0.1):
        if not proc.is_alive():
          self._stop.set()
          raise RuntimeError(f'the probe process exited with code {proc.exitcode} before '
                             'its first answer; is the server up?')
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._results = [q.get(timeout=600) for q in self._queues]
    for proc in self._procs:
      proc.join(60)

  def results(self) -> list[list[float]]:
    return self._results


def _control_server(port: int) -> None:
  """A FastAPI app with only GET /v1/models, served by uvicorn (spawned process)."""
  # pylint: disable=import-outside-toplevel
  import fastapi
  import uvicorn
  app = fastapi.FastAPI()

  @app.get('/v1/models')
  def models():
    return {'object': 'list', 'data': [{'id': 'control', 'object': 'model', 'created': 0,
                                        'owned_by': 'meshlm'}]}

  @app.get('/health')
  def health():
    return {}

  uvicorn.run(app, host='127.0.0.1', port=port, log_level='warning')


class ControlServer:
  """_control_server on a free 127.0.0.1 port, terminated on exit."""

  def __init__(self):
    self.url = f'http://127.0.0.1:{_free_port()}'
    ctx = multiprocessing.get_context('spawn')
    self.proc = ctx.Process(target=_control_server, args=(int(self.url.rsplit(':', 1)[1]),),
                            daemon=True)

  def __enter__(self):
    self.proc.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      try:
        if httpx.get(self.url + '/health', timeout=2).status_code == 200:
          return self
      except httpx.TransportError:
        time.sleep(0.1)
    self.__exit__()
    raise RuntimeError('the control server did not come up')

  def __exit__(self, *exc):
    self.proc.terminate()
    self.proc.join(30)


async def run_load(url: str, prompts, output_len: int, rate: float, max_concurrency: int,
                   model: str | None = None, api_key: str | None = None, seed: int = 0,
                   probe_interval_s: float = 0.0):
  """Sends every prompt on its arrival schedule; (results, wall seconds, probe answer
  seconds). The probe here runs on this loop (--probe-from loop)."""
  headers = {'Authorization': f'Bearer {api_key}'} if api_key else {}
  limit = asyncio.Semaphore(max_concurrency)
  delays = arrival_delays(len(prompts), rate, seed)
  limits = httpx.Limits(max_connections=max_concurrency + 4)

  async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as client:
    async def send(prompt, delay):
      await asyncio.sleep(delay)
      async with limit:
        body = {'prompt': prompt, 'max_tokens': output_len, 'ignore_eos': True,
                'temperature': 0.0, 'stream': True, 'stream_options': {'include_usage': True}}
        if model:
          body['model'] = model
        return await one_request(client, url, body)

    start, done, latencies = time.perf_counter(), asyncio.Event(), []
    probing = (asyncio.create_task(probe(client, url, probe_interval_s, done, latencies))
               if probe_interval_s else None)
    results = await asyncio.gather(*(send(p, d) for p, d in zip(prompts, delays)))
    wall = time.perf_counter() - start
    done.set()
    if probing is not None:
      await probing
    return results, wall, latencies


def summarize(results: list[Result], wall_s: float, probes=(), control=None) -> dict:
  ok = [r for r in results if r.ok]
  tokens = sum(r.output_tokens for r in ok)

  def pct(values, scale=1000.0):   # milliseconds
    values = [v for v in values if v is not None]
    if not values:
      return None
    return {f'p{p}': float(np.percentile(values, p)) * scale for p in PERCENTILES} | {
        'mean': float(np.mean(values)) * scale}

  return {
      'completed': len(ok), 'failed': len(results) - len(ok),
      'errors': sorted({r.error for r in results if not r.ok})[:5],
      'wall_s': wall_s, 'output_tokens': tokens,
      'output_tokens_per_s': tokens / wall_s if wall_s else None,
      'requests_per_s': len(ok) / wall_s if wall_s else None,
      'ttft_ms': pct([r.ttft for r in ok]), 'tpot_ms': pct([r.tpot for r in ok]),
      'itl_ms': pct([g for r in ok for g in r.itls]), 'e2e_ms': pct([r.e2e for r in ok]),
      'models_probe_ms': pct(list(probes)), 'models_probes': len(probes),
      **({'control_probe_ms': pct(list(control)), 'control_probes': len(control)}
         if control is not None else {}),
  }


def print_table(summary: dict) -> None:
  print(f"completed {summary['completed']}, failed {summary['failed']}, "
        f"{summary['wall_s']:.2f} s, {summary['output_tokens_per_s']:.1f} output tokens/s, "
        f"{summary['requests_per_s']:.2f} requests/s")
  for key in ('ttft_ms', 'tpot_ms', 'itl_ms', 'e2e_ms', 'models_probe_ms', 'control_probe_ms'):
    values = summary.get(key)
    if values:
      print(f"  {key:8s} " + '  '.join(f'{k} {v:9.2f}' for k, v in values.items()))
  for error in summary['errors']:
    print('  error:', error)


# ------------------------------------------------------------------ launching a server

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def train_tiny(root: str) -> str:
  """configs/default.py:tiny trained a few steps (seconds on CPU); returns the workdir."""
  # pylint: disable=import-outside-toplevel
  from training import trainer
  from training.cli import load_config_file
  cfg = load_config_file('default.py:tiny')
  cfg.workdir, cfg.data.cache_dir = os.path.join(root, 'run'), os.path.join(root, 'corpus')
  cfg.steps, cfg.sample.num_tokens, cfg.metrics.progress_bar = 30, 0, False
  trainer.train(cfg)
  return cfg.workdir


class Launched:
  """`python -m serve` on a free 127.0.0.1 port; stopped by SIGTERM (then killed) on exit."""

  def __init__(self, model_args: list[str], extra: list[str], api_key: str | None,
               checkout: str | None = None):
    self.url = f'http://127.0.0.1:{_free_port()}'
    cmd = [sys.executable, '-m', 'serve', *model_args, '--port', self.url.rsplit(':', 1)[1],
           '--log-level', 'warning', *extra]
    env = dict(os.environ, **({'MESHLM_API_KEY': api_key} if api_key else {}),
               **({'PYTHONPATH': os.path.abspath(checkout)} if checkout else {}))
    self.proc = subprocess.Popen(cmd, env=env, cwd=checkout)

  def __enter__(self):
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and self.proc.poll() is None:
      try:
        if httpx.get(self.url + '/health', timeout=2).status_code == 200:
          return self
      except httpx.TransportError:
        pass
      time.sleep(0.2)
    self.__exit__()
    raise RuntimeError('the launched server did not come up (see its output above)')

  def __exit__(self, *exc):
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()


# ------------------------------------------------------------------ main

def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog='python -m benchmarks.serve_load',
                              description=__doc__.split('\n')[0])
  target = p.add_mutually_exclusive_group()
  target.add_argument('--url', default='http://127.0.0.1:8000', help='a running server')
  target.add_argument('--launch', action='store_true', help='start `python -m serve` here')
  p.add_argument('--checkpoint', help='with --launch: a train.py workdir')
  p.add_argument('--hf-model', help='with --launch: a Hugging Face Llama directory')
  p.add_argument('--server-args', default='', help='with --launch: more `python -m serve` '
                 'flags, e.g. "--max-num-seqs 16 --num-blocks 512"')
  p.add_argument('--api-key', default=os.environ.get('MESHLM_API_KEY'))
  p.add_argument('--model', default=None, help='model id to send (default: none sent)')
  p.add_argument('--num-prompts', type=int, default=64)
  p.add_argument('--input-len', type=int, default=32)
  p.add_argument('--output-len', type=int, default=16)
  p.add_argument('--request-rate', type=float, default=float('inf'),
                 help='requests per second, Poisson arrivals (inf: all at once)')
  p.add_argument('--max-concurrency', type=int, default=16)
  p.add_argument('--warmup', type=int, default=None,
                 help='untimed requests first, at the same rate: the engine compiles each '
                 'new step shape on first sight, and those seconds-long stalls are not what '
                 'a warm server does (default: 2 x --num-prompts; bursts mix prefill chunks '
                 'and decodes in many combinations)')
  p.add_argument('--probe-interval-ms', type=float, default=20.0,
                 help='GET /v1/models this often during the timed load (0: never)')
  p.add_argument('--probe-from', choices=('process', 'loop'), default='process',
                 help="probe from a process of its own (default) or from the load "
                 "generator's event loop (as results before 2026-11-28 did)")
  p.add_argument('--control', action='store_true',
                 help='also probe a trivial FastAPI server in its own process on the same '
                 'machine (what an HTTP process without the engine answers under this load)')
  p.add_argument('--server-checkout', default=None,
                 help='with --launch: start the server from this checkout of meshlm (to '
                 'measure another revision with the same benchmark)')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--name', default=None, help='result file name (default serve_load_<platform>)')
  p.add_argument('--smoke', action='store_true', help='a few tiny requests; writes nothing')
  args = p.parse_args(argv)
  if args.smoke:
    args.num_prompts, args.input_len, args.output_len = 8, 8, 4
    args.max_concurrency, args.warmup = 4, 2
  if args.warmup is None:
    args.warmup = 2 * args.num_prompts
  return args


def warm_up(url: str, args: argparse.Namespace, load: dict) -> None:
  """Bursts of 1, 2, 4 .. max_concurrency requests, then --warmup at the timed rate.

  The engine compiles a program per (token count, sequence count) bucket on first sight,
  seconds each on CPU; the bursts reach the pure prefill and decode buckets, the
  paced requests the mixed ones. Untimed.
  """
  prompts = make_prompts(args.max_concurrency, args.input_len, args.seed + 7)
  size = 1
  while size < 2 * args.max_concurrency:
    asyncio.run(run_load(url, prompts[:size], rate=float('inf'), **load))
    size *= 2
  if args.warmup:
    paced = make_prompts(args.warmup, args.input_len, args.seed + 8)
    asyncio.run(run_load(url, paced, rate=args.request_rate, **load))


def benchmark(url: str, args: argparse.Namespace) -> dict:
  load = dict(output_len=args.output_len, max_concurrency=args.max_concurrency,
              model=args.model, api_key=args.api_key, seed=args.seed)
  warm_up(url, args, load)
  prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
  interval = args.probe_interval_ms / 1000
  if args.probe_from == 'loop' or not interval:
    results, wall, probes = asyncio.run(run_load(
        url, prompts, rate=args.request_rate, probe_interval_s=interval, **load))
    return summarize(results, wall, probes)
  with contextlib.ExitStack() as stack:
    control = stack.enter_context(ControlServer()) if args.control else None
    probing = stack.enter_context(
        ProbeProcesses([url] + ([control.url] if control else []), interval))
    results, wall, _ = asyncio.run(run_load(url, prompts, rate=args.request_rate, **load))
  probes = probing.results()
  return summarize(results, wall, probes[0], probes[1] if control else None)


def main(argv=None) -> int:
  args = parse_args(argv)
  model_args = (['--checkpoint', args.checkpoint] if args.checkpoint else
                ['--hf-model', args.hf_model] if args.hf_model else [])
  with tempfile.TemporaryDirectory() as tmp:
    if args.launch:
      launch_args = model_args or ['--checkpoint', train_tiny(tmp)]
      model_args = model_args or ['default.py:tiny trained 30 steps']
      with Launched(launch_args, args.server_args.split(), args.api_key,
                    args.server_checkout) as server:
        summary = benchmark(server.url, args)
    else:
      summary = benchmark(args.url, args)
  print_table(summary)
  if not args.smoke:
    import jax  # pylint: disable=import-outside-toplevel
    shapes = {k: getattr(args, k) for k in ('num_prompts', 'input_len', 'output_len',
                                            'request_rate', 'max_concurrency', 'warmup',
                                            'probe_from', 'control')}
    payload = {'shapes': {**shapes, 'request_rate': str(args.request_rate)},
               'server': {'launched': args.launch, 'model_args': model_args,
                          'server_args': args.server_args,
                          'checkout': args.server_checkout or 'this one'},
               'host_load_avg_1m': os.getloadavg()[0], **summary}
    print(write_result(args.name or f'serve_load_{jax.devices()[0].platform}', payload))
  return 0 if summary['completed'] else 1


if __name__ == '__main__':
  sys.exit(main())
