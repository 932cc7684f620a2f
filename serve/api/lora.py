"""LoRA adapters over HTTP, as vLLM serves them: which model a request names (the base
or an adapter), the adapters' cards in /v1/models, and POST /v1/load_lora_adapter
{lora_name, lora_path} and /v1/unload_lora_adapter {lora_name} while serving (behind the
API key, like every route but /health and /metrics)."""

import asyncio

import fastapi
from fastapi import responses

from serve.api.protocol import ApiError, json_body
from serve.engine.errors import UnknownAdapter


def adapter_of(state, model: str | None) -> str | None:
  """The LoRA adapter a request's `model` names, None for the base; 404 (OpenAI's
  shape, code model_not_found, as vLLM) for any other name."""
  if model is None or model == state.model_name:
    return None
  registry = getattr(state.engine, 'lora', None)
  names = [] if registry is None else [a['name'] for a in registry.names()]
  if model in names:
    return model
  adapters = f' and the LoRA adapters {names}' if names else ''
  raise ApiError(404, f'The model {model!r} does not exist: this server serves '
                 f'{state.model_name!r}{adapters} (GET /v1/models lists them).',
                 param='model', type_='NotFoundError', code='model_not_found')


def adapter_cards(state) -> list[dict]:
  """/v1/models entries of the loaded adapters, each naming the base as its parent."""
  registry = getattr(state.engine, 'lora', None)
  if registry is None:
    return []
  return [{'id': a['name'], 'object': 'model', 'created': state.created, 'owned_by': 'meshlm',
           'root': a['path'], 'parent': state.model_name, 'max_model_len': state.max_model_len}
          for a in registry.names()]


def _registry(state):
  registry = getattr(state.engine, 'lora', None)
  if registry is None:
    raise ApiError(400, 'LoRA adapters are off: start the server with --enable-lora '
                   '(and --max-loras, --max-lora-rank) to load them.', code='lora_disabled')
  return registry


def _name(body: dict, field: str) -> str:
  value = body.get(field)
  if not isinstance(value, str) or not value:
    raise ApiError(400, f'{field}: give a non-empty string.', param=field)
  return value


async def load_lora_adapter(state, request: fastapi.Request):
  body = await json_body(request)
  registry = _registry(state)
  name, path = _name(body, 'lora_name'), _name(body, 'lora_path')
  try:   # reads the adapter's files and writes its slot: off the event loop
    await asyncio.to_thread(registry.load, name, path)
  except ValueError as e:
    raise ApiError(400, str(e), param='lora_path', code='invalid_lora_adapter') from None
  return responses.PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(state, request: fastapi.Request):
  body = await json_body(request)
  registry = _registry(state)
  name = _name(body, 'lora_name')
  try:
    running = await asyncio.to_thread(registry.unload, name)
  except UnknownAdapter as e:
    raise ApiError(404, str(e), param='lora_name', type_='NotFoundError',
                   code='model_not_found') from None
  after = (f' {running} queued or running requests on it finish first; it is dropped '
           'after them.'
           if running else '')
  return responses.PlainTextResponse(
      f"Success: LoRA adapter '{name}' removed successfully.{after}")
