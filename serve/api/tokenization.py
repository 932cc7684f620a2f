"""vLLM's /tokenize and /detokenize: the token ids the completions or chat endpoint would
run, and text from ids."""

import asyncio

import fastapi

from serve import sampling_params as sp_lib
from serve.api import tools as tools_lib
from serve.api.prompts import chat_text, check_model, in_vocabulary
from serve.api.protocol import ApiError, DetokenizeBody, TokenizeBody, json_body, validate
from serve.api.responses import token_text
from serve.api.state import ServerState


async def tokenize(state: ServerState, request: fastapi.Request) -> dict:
  return await asyncio.to_thread(_tokenized, state, await json_body(request))


def _tokenized(state: ServerState, raw: dict) -> dict:
  """The token ids the completions (prompt) or chat (messages) endpoint would run."""
  body = validate(TokenizeBody, raw)
  check_model(state, body.model)
  if (body.prompt is None) == (body.messages is None):
    raise ApiError(400, 'Give exactly one of "prompt" (text, as /v1/completions takes it) '
                   'and "messages" (as /v1/chat/completions takes them).', param='prompt')
  chat = body.messages is not None
  if not chat and (body.tools is not None or body.chat_template_kwargs is not None):
    param = 'tools' if body.tools is not None else 'chat_template_kwargs'
    raise ApiError(400, f'{param}: goes with "messages", not "prompt".', param=param)
  try:
    tools = tools_lib.check_tools(body.tools) if body.tools else None
  except sp_lib.SamplingParamsError as e:
    raise ApiError(400, str(e), param=e.param) from None
  text = chat_text(state, body, tools) if chat else body.prompt
  specials = not chat if body.add_special_tokens is None else body.add_special_tokens
  tokenizer = state.served.tokenizer
  ids = tokenizer.encode(text, specials).tolist()
  out = {'count': len(ids), 'max_model_len': state.max_model_len, 'tokens': ids}
  if body.return_token_strs:
    out['token_strs'] = [token_text(tokenizer, t) for t in ids]
  return out


async def detokenize(state: ServerState, request: fastapi.Request) -> dict:
  return await asyncio.to_thread(_detokenized, state, await json_body(request))


def _detokenized(state: ServerState, raw: dict) -> dict:
  body = validate(DetokenizeBody, raw)
  check_model(state, body.model)
  tokens = in_vocabulary(state, body.tokens, 'tokens')
  return {'prompt': state.served.tokenizer.decode(tokens) if tokens else ''}
