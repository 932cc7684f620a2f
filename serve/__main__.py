"""`python -m serve --checkpoint DIR` (or `--hf-model DIR`): the OpenAI-compatible server.

Binds 127.0.0.1:8000 unless told otherwise. The first SIGTERM or Ctrl-C drains: new
requests get 503, running ones get up to --shutdown-grace seconds to finish, the rest end
with a final chunk saying why, and the process exits 0. A second signal exits at once.
If the engine dies (its loop ends, or makes no progress for --engine-stall-timeout
seconds with requests open), /health answers 503, every open request ends with an
EngineDeadError, and the process exits 1, for a supervisor to restart it.
"""

import argparse
import asyncio
import os
import sys
import threading

import uvicorn

from serve import config as config_lib
from serve.api import metrics
from serve.api import tools
from serve.api.server import create_app
from serve.engine.core import Engine
from serve.engine.loop import STALL_TIMEOUT_S
from sharding import compile_cache

API_KEY_ENV = 'MESHLM_API_KEY'


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog='python -m serve', description=__doc__.split('\n')[0])
  config_lib.add_engine_args(parser)
  http = parser.add_argument_group('http')
  http.add_argument('--host', default='127.0.0.1',
                    help='address to bind (0.0.0.0 exposes the server to the network)')
  http.add_argument('--port', type=int, default=8000)
  http.add_argument('--api-key', default=os.environ.get(API_KEY_ENV),
                    help='require "Authorization: Bearer KEY" on every route but /health '
                    f'and /metrics (or set {API_KEY_ENV})')
  http.add_argument('--served-model-name', default=None,
                    help='the model id clients send (default: the model\'s own name)')
  http.add_argument('--shutdown-grace', type=float, default=30.0, metavar='SECONDS',
                    help='on SIGTERM, how long running requests may take to finish')
  http.add_argument('--engine-stall-timeout', type=float, default=STALL_TIMEOUT_S,
                    metavar='SECONDS', help='the engine is dead (exit 1) if no step completes '
                    'for this long with requests open; longer than the slowest step, a '
                    'compile included')
  http.add_argument('--log-level', default='info',
                    choices=('critical', 'error', 'warning', 'info', 'debug'))
  http.add_argument('--log-stats-interval', type=float, default=10.0, metavar='SECONDS',
                    help='print throughput, batch and cache use this often while busy '
                    '(0: never)')
  calls = parser.add_argument_group('tool calling')
  calls.add_argument('--enable-auto-tool-choice', action='store_true',
                     help='let the model decide when to call tools (tool_choice "auto", the '
                     'default when a request gives tools); needs --tool-call-parser')
  calls.add_argument('--tool-call-parser', choices=tools.PARSERS, default=None,
                     help='how the model writes tool calls: hermes, <tool_call>{"name": ..., '
                     '"arguments": {...}}</tool_call> (Hermes 2 Pro and 3, Qwen 2.5 and 3); '
                     'llama3_json, {"name": ..., "parameters": {...}} objects (Llama 3.1-3.3); '
                     'pythonic, [f(key=value), ...] (Llama 3.2 and 4)')
  args = parser.parse_args(argv)
  if args.enable_auto_tool_choice and args.tool_call_parser is None:
    parser.error('--enable-auto-tool-choice needs --tool-call-parser (one of '
                 f'{", ".join(tools.PARSERS)}): the format the model writes its calls in')
  return args


class GracefulServer(uvicorn.Server):
  """uvicorn, with its exit signal turned into a drain of the app's requests first."""

  def __init__(self, config: uvicorn.Config, grace_s: float):
    super().__init__(config)
    self.grace_s = grace_s
    self._loop = None
    self._draining = False

  async def serve(self, sockets=None):
    self._loop = asyncio.get_running_loop()
    await super().serve(sockets)

  def handle_exit(self, sig, frame):
    # uvicorn's own handler records the signal and raises it again after shutdown, which
    # would end the process by SIGTERM instead of exit status 0: not recorded here.
    del sig, frame
    if self._draining or self._loop is None:
      self.should_exit = self.force_exit = True
      return
    self._draining = True
    self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

  async def _drain(self):
    state = self.config.app.state.meshlm
    print(f'Draining: up to {self.grace_s:g} s for {len(state.active)} running requests.',
          flush=True)
    await state.drain(self.grace_s)
    self.should_exit = True


def run(app, engine, *, host: str, port: int, grace_s: float, log_level: str = 'info',
        sockets=None, stats_interval_s: float = 0.0, health_interval_s: float = 1.0) -> int:
  """Serves app until a signal (or should_exit); then stops the engine. Every
  stats_interval_s seconds (0: never) while busy, prints the engine's stats line. Every
  health_interval_s, checks the engine's health: a dead engine stops the server. The
  exit status: 0 after a signal, 1 when the engine died."""
  config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan='off',
                          timeout_graceful_shutdown=5)
  server = GracefulServer(config, grace_s)
  stats = metrics.StatsLogger(engine).start(stats_interval_s) if stats_interval_s > 0 else None
  stop, dead = threading.Event(), []
  watchdog = threading.Thread(target=_watch, args=(engine, server, health_interval_s, stop,
                                                   dead), name='meshlm-health', daemon=True)
  watchdog.start()
  try:
    server.run(sockets=sockets)
  finally:
    stop.set()
    if stats is not None:
      stats.set()
    engine.shutdown()
  return 1 if dead else 0


def _watch(engine, server, interval_s: float, stop: threading.Event, dead: list) -> None:
  """Stops the server once the engine is dead (its health() has failed every open
  request by then, so their handlers send the error before the server closes)."""
  while not stop.wait(interval_s):
    reason = engine.health()
    if reason is not None:
      print(f'error: the engine is dead ({reason}); exiting.', file=sys.stderr, flush=True)
      dead.append(reason)
      server.should_exit = True
      return


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    compile_cache.enable(args.compilation_cache_dir)   # before the engine compiles
    cfg = config_lib.config_from_args(args)
    served = config_lib.load_served_model(args)
    engine = Engine(served, cfg, stall_timeout_s=args.engine_stall_timeout)
    served = engine.served   # without the loaded weights: the engine's copy is the one kept
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  app = create_app(engine, served, api_key=args.api_key, model_name=args.served_model_name,
                   tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)
  print(f'Serving {app.state.meshlm.model_name!r} on http://{args.host}:{args.port}/v1',
        flush=True)
  return run(app, engine, host=args.host, port=args.port, grace_s=args.shutdown_grace,
             log_level=args.log_level, stats_interval_s=args.log_stats_interval)


if __name__ == '__main__':
  sys.exit(main())
