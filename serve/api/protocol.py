"""The HTTP protocol's request side: OpenAI's error shape, the request bodies' non-sampling
fields (openai_sampling.from_openai reads the rest) and their validation.

Bodies allow null wherever OpenAI allows it (some clients send every field)."""

import json

import fastapi
import pydantic
from fastapi import responses


class ApiError(Exception):
  """An error for the client: HTTP status plus OpenAI's error body."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               type_: str = 'invalid_request_error', code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = (
        status, message, param, type_, code)

  def body(self) -> dict:
    return {'error': {'message': self.message, 'type': self.type, 'param': self.param,
                      'code': self.code}}

  def response(self) -> responses.JSONResponse:
    return responses.JSONResponse(self.body(), status_code=self.status)


class Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra='allow', strict=True)
  # null is allowed wherever OpenAI allows it (some clients send every field)
  model: str | None = None
  stream: bool | None = False
  stream_options: dict | None = None
  n: int | None = 1


class CompletionBody(Body):
  prompt: str | list[str] | list[int] | list[list[int]]
  echo: bool | None = False
  best_of: int | None = None
  # vLLM's: a text prompt gets the tokenizer's special tokens (a Llama's BOS)
  add_special_tokens: bool | None = True


class TextPart(pydantic.BaseModel):
  type: str
  text: str


class ChatMessage(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra='allow', strict=True)
  role: str
  content: str | list[TextPart] | None = None
  tool_calls: list[dict] | None = None   # an assistant's earlier calls
  tool_call_id: str | None = None        # a tool message: the call it answers
  name: str | None = None


class ChatBody(Body):
  messages: list[ChatMessage]
  add_generation_prompt: bool | None = True   # vLLM's: false continues no assistant turn
  add_special_tokens: bool | None = False     # vLLM's: the template writes them itself
  chat_template_kwargs: dict | None = None    # more variables for the template


class TokenizeBody(pydantic.BaseModel):
  """vLLM's /tokenize: a prompt, or chat messages under the model's template."""
  model_config = pydantic.ConfigDict(extra='forbid', strict=True)
  model: str | None = None
  prompt: str | None = None
  messages: list[ChatMessage] | None = None
  add_generation_prompt: bool | None = True
  add_special_tokens: bool | None = None   # None: as the endpoint would (prompt yes, chat no)
  return_token_strs: bool | None = False
  tools: list | None = None                # what the template is given, as in chat
  chat_template_kwargs: dict | None = None


class DetokenizeBody(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra='forbid', strict=True)
  model: str | None = None
  tokens: list[int]


MAX_N = 128   # choices per prompt (OpenAI's limit)


# include_usage (OpenAI's), continuous_usage_stats (vLLM's: usage in every chunk) and
# OpenAI's include_obfuscation, which pads chunks against length attacks and changes no
# text: taken, not done (these are local connections).
STREAM_OPTIONS = {'include_usage', 'continuous_usage_stats', 'include_obfuscation'}


async def json_body(request: fastapi.Request) -> dict:
  raw = await request.body()
  try:
    body = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise ApiError(400, f'The request body is not valid JSON ({e}). Send a JSON object, '
                   'e.g. {"prompt": "Hello", "max_tokens": 16}.') from None
  if not isinstance(body, dict):
    raise ApiError(400, f'The request body must be a JSON object, got {type(body).__name__}.')
  return body


def validate(model_cls, body: dict):
  try:
    return model_cls.model_validate(body)
  except pydantic.ValidationError as e:
    err = e.errors()[0]
    param = '.'.join(str(p) for p in err['loc'] if not _is_type_tag(p)) or None
    got = err.get('input')
    raise ApiError(400, f'{param}: {err["msg"]} (got {short(got)}).', param=param) from None


def _is_type_tag(part) -> bool:
  # pydantic names union members in the location ("str", "list[int]"): not a field.
  return isinstance(part, str) and (part in ('str', 'int', 'bool', 'dict', 'none')
                                    or '[' in part or part.startswith('function'))


def short(value) -> str:
  text = json.dumps(value) if not isinstance(value, pydantic.BaseModel) else repr(value)
  return text if len(text) <= 60 else text[:57] + '...'


def engine_dead_error(reason: str) -> ApiError:
  return ApiError(503, f'The engine is dead ({reason}): this server cannot generate and is '
                  'exiting; retry on another replica.', type_='server_error', code='engine_dead')
