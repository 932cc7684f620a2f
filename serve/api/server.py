"""OpenAI-compatible HTTP server over the Engine (FastAPI; run by `python -m serve`): the
app, its routes, the API-key and draining gate, and errors in OpenAI's shape.

/v1/completions and /v1/chat/completions (completions.py, chat.py), streamed as
server-sent events when asked (streaming.py), /v1/models, /tokenize, /detokenize
(tokenization.py), /health, /version and /metrics. The server owns the HTTP side only:
turning bodies into token ids and SamplingParams (prompts.py, openai_sampling.py), the
n choices of a request (choices.py), aborting the requests of clients that went away,
refusing work while draining, and the metrics.

  client ──POST──> validate ──> engine.add_request ──> RequestStream ──> SSE chunks / JSON
                     │ 400/401/429/503                     │ disconnect, shutdown: abort

The event loop only moves bytes: tokenizing, rendering chat templates, decoding
logprobs and anything that takes the engine's lock (held across a step's scheduling and
emission) runs in worker threads, so one request's preparation never delays another's
stream or a health check.
"""

import asyncio
import hmac
import importlib.metadata

import fastapi
from fastapi import responses

from serve.api import lora
from serve.api import metrics as metrics_lib
from serve.api import tools as tools_lib
from serve.api.chat import chat
from serve.api.completions import completions
from serve.api.protocol import ApiError, engine_dead_error
from serve.api.state import ServerState
from serve.api.tokenization import detokenize, tokenize


def _models(state: ServerState) -> dict:
  card = {'id': state.model_name, 'object': 'model', 'created': state.created,
          'owned_by': 'meshlm', 'max_model_len': state.max_model_len}
  return {'object': 'list', 'data': [card, *lora.adapter_cards(state)]}


class _Gate:
  """ASGI middleware: 503 while draining, 401 without the API key (but on /health and
  /metrics)."""

  def __init__(self, app, state: ServerState):
    self.app, self.state = app, state

  async def __call__(self, scope, receive, send):
    err = _gate_error(self.state, scope) if scope['type'] == 'http' else None
    if err:
      await err.response()(scope, receive, send)
      return
    await self.app(scope, receive, send)


def _gate_error(state: ServerState, scope) -> ApiError | None:
  path = scope['path']
  if state.draining and path != '/metrics':
    return ApiError(503, 'The server is shutting down and admits no new requests.',
                    type_='server_error', code='shutting_down')
  if state.api_key and path not in ('/health', '/metrics'):
    header = dict(scope['headers']).get(b'authorization', b'').decode('latin-1')
    expected = f'Bearer {state.api_key}'
    if not hmac.compare_digest(header.encode(), expected.encode()):
      return ApiError(401, 'Missing or wrong API key: send "Authorization: Bearer <key>" '
                      'with the key the server was started with.',
                      type_='authentication_error', code='invalid_api_key')
  return None


def _add_error_handlers(app: fastapi.FastAPI) -> None:
  async def api_error(_, e: ApiError):
    return e.response()

  async def http_error(_, e):
    return ApiError(e.status_code, str(e.detail), code=str(e.status_code)).response()

  async def unexpected(_, e: Exception):
    return ApiError(500, f'Internal error: {type(e).__name__}: {e}',
                    type_='server_error').response()

  from starlette.exceptions import HTTPException  # pylint: disable=import-outside-toplevel
  app.add_exception_handler(ApiError, api_error)
  app.add_exception_handler(HTTPException, http_error)
  app.add_exception_handler(Exception, unexpected)


def _add_routes(app: fastapi.FastAPI, state: ServerState) -> None:
  def post(path, handler):   # handler(state, request), awaited
    async def endpoint(request: fastapi.Request):
      return await handler(state, request)
    app.add_api_route(path, endpoint, methods=['POST'], name=handler.__name__.strip('_'))

  post('/v1/completions', completions)
  post('/v1/chat/completions', chat)
  post('/tokenize', tokenize)      # vLLM's
  post('/detokenize', detokenize)
  post('/v1/load_lora_adapter', lora.load_lora_adapter)   # vLLM's
  post('/v1/unload_lora_adapter', lora.unload_lora_adapter)

  @app.get('/v1/models')
  async def models():
    return _models(state)

  @app.get('/health')
  async def health():
    dead = state.engine.health()
    if dead is not None:   # the process is about to exit (serve.__main__'s watchdog)
      return engine_dead_error(dead).response()
    return {}

  @app.get('/version')
  async def version():
    return {'version': importlib.metadata.version('meshlm')}

  @app.get('/metrics')
  async def metrics():   # the engine's stats are read under its lock: not on the loop
    text = await asyncio.to_thread(state.metrics.render)
    return responses.Response(text, media_type=metrics_lib.CONTENT_TYPE)


def create_app(engine, served, *, api_key: str | None = None, model_name: str | None = None,
               max_model_len: int | None = None,
               tool_parser: str | None = None) -> fastapi.FastAPI:
  """The app over a running engine; `app.state.meshlm` is its ServerState. tool_parser:
  how to read tool calls from the output under tool_choice "auto" (tools.PARSERS); None
  refuses "auto" with tools."""
  if tool_parser is not None and tool_parser not in tools_lib.PARSERS:
    raise ValueError(f'--tool-call-parser={tool_parser!r}: choose one of {tools_lib.PARSERS}')
  state = ServerState(engine, served, api_key, model_name or served.name,
                      max_model_len or engine.max_model_len, tool_parser)
  if getattr(engine, 'lora', None) is not None:   # no adapter may take the base's name
    engine.lora.base_name = state.model_name
  app = fastapi.FastAPI(title='meshlm', docs_url=None, redoc_url=None, openapi_url=None)
  app.state.meshlm = state
  app.add_middleware(_Gate, state=state)
  _add_error_handlers(app)
  _add_routes(app, state)
  return app
