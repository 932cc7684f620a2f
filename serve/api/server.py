"""OpenAI-compatible HTTP server over the Engine (FastAPI; run by `python -m serve`).

/v1/completions and /v1/chat/completions, streamed as server-sent events when asked,
/v1/models, /tokenize, /detokenize, /health, /version and /metrics. The server owns the
HTTP side only: turning bodies into token ids and SamplingParams (`sampling_params.from_openai`),
errors in OpenAI's shape, aborting the requests of clients that went away, refusing work
while draining, and the metrics.

  client ──POST──> validate ──> engine.add_request ──> RequestStream ──> SSE chunks / JSON
                     │ 400/401/429/503                     │ disconnect, shutdown: abort
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import hmac
import importlib.metadata
import json
import time
import uuid

import fastapi
import pydantic
from fastapi import responses

from serve.api import metrics as metrics_lib
from serve import sampling_params as sp_lib
from serve.api import tools as tools_lib
from serve.engine.core import EngineClosed, EngineDeadError, QueueFull


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


# --- request bodies: the non-sampling fields; sampling_params.from_openai reads the rest ---

class _Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra='allow', strict=True)
  # null is allowed wherever OpenAI allows it (some clients send every field)
  model: str | None = None
  stream: bool | None = False
  stream_options: dict | None = None
  n: int | None = 1


class CompletionBody(_Body):
  prompt: str | list[str] | list[int] | list[list[int]]
  echo: bool | None = False
  best_of: int | None = None
  # vLLM's: a text prompt gets the tokenizer's special tokens (a Llama's BOS)
  add_special_tokens: bool | None = True


class _TextPart(pydantic.BaseModel):
  type: str
  text: str


class ChatMessage(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra='allow', strict=True)
  role: str
  content: str | list[_TextPart] | None = None
  tool_calls: list[dict] | None = None   # an assistant's earlier calls
  tool_call_id: str | None = None        # a tool message: the call it answers
  name: str | None = None


class ChatBody(_Body):
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


@dataclasses.dataclass
class _Req:
  """One choice's request in the engine, and what it has produced so far."""
  rid: str
  index: int                  # the choice's index: prompt number * n + sample number
  prompt_ids: list[int]
  stream: object
  counts_prompt: bool = True  # the first of its prompt's n choices (usage counts it once)
  echo: str | None = None     # completions' echo: the prompt text, sent before the output
  prompt_only: bool = False   # echo with max_tokens 0: the one token generated is dropped
  vllm_prompt_logprobs: bool = False   # vLLM's prompt_logprobs asked for: in the answer
  vllm_json: list | None = None        # the first choice's: that answer, once built
  prompt_logprobs: list | None = None
  first: '_Req | None' = None    # its prompt's first choice, which scores the prompt
  waits_for_scores: bool = False   # its outputs wait for first's prompt scores
  tools: tools_lib.ToolChoice | None = None   # chat's tools, and a parser of the output
  tool_parser: object = None
  text: str = ''
  token_ids: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  logprob_offset: int = 0     # completions' text_offset of the next streamed logprob
  finish_reason: str | None = None


class ServerState:
  """What the routes share: the engine, the model, admission and the live requests."""

  def __init__(self, engine, served, api_key, model_name, max_model_len, tool_parser=None):
    self.engine, self.served, self.api_key = engine, served, api_key
    self.tool_parser = tool_parser   # --tool-call-parser with --enable-auto-tool-choice
    self.model_name = model_name
    self.max_model_len = max_model_len
    self.vocab_size = served.tokenizer.vocab_size
    self.created = int(time.time())
    self.metrics = metrics_lib.ServerMetrics(engine)
    self.draining = False
    self.active: dict[str, _Req] = {}
    self.shutdown_aborted: set[str] = set()
    # Submissions wait on the engine's lock (a step's scheduling and emission): threads of
    # their own, so waiting ones never hold up the tokenizing and decoding of others.
    self.submitters = concurrent.futures.ThreadPoolExecutor(
        max_workers=4, thread_name_prefix='meshlm-submit')

  async def drain(self, grace_s: float) -> None:
    """Refuse new work; wait up to grace_s for running requests; abort the rest."""
    self.draining = True
    deadline = time.monotonic() + grace_s
    while self.active and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    # Let the aborted requests' handlers send their final chunk before the server stops;
    # one still being prepared in a worker thread when draining began is aborted as it
    # comes in.
    deadline = time.monotonic() + 5.0
    while True:
      for rid in [rid for rid in list(self.active) if rid not in self.shutdown_aborted]:
        self.shutdown_aborted.add(rid)
        self.engine.abort(rid)
      if not self.active or time.monotonic() >= deadline:
        break
      await asyncio.sleep(0.05)


# --- parsing ---

async def _json_body(request: fastapi.Request) -> dict:
  raw = await request.body()
  try:
    body = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise ApiError(400, f'The request body is not valid JSON ({e}). Send a JSON object, '
                   'e.g. {"prompt": "Hello", "max_tokens": 16}.') from None
  if not isinstance(body, dict):
    raise ApiError(400, f'The request body must be a JSON object, got {type(body).__name__}.')
  return body


def _validate(model_cls, body: dict):
  try:
    return model_cls.model_validate(body)
  except pydantic.ValidationError as e:
    err = e.errors()[0]
    param = '.'.join(str(p) for p in err['loc'] if not _is_type_tag(p)) or None
    got = err.get('input')
    raise ApiError(400, f'{param}: {err["msg"]} (got {_short(got)}).', param=param) from None


def _is_type_tag(part) -> bool:
  # pydantic names union members in the location ("str", "list[int]"): not a field.
  return isinstance(part, str) and (part in ('str', 'int', 'bool', 'dict', 'none')
                                    or '[' in part or part.startswith('function'))


def _short(value) -> str:
  text = json.dumps(value) if not isinstance(value, pydantic.BaseModel) else repr(value)
  return text if len(text) <= 60 else text[:57] + '...'


def _check_model(state: ServerState, model: str | None) -> None:
  if model is not None and model != state.model_name:
    raise ApiError(400, f'model: this server serves {state.model_name!r}, not {model!r} '
                   '(GET /v1/models lists it).', param='model', code='model_not_found')


def _check_common(state: ServerState, body: _Body) -> None:
  _check_model(state, body.model)
  if body.n is not None and not 1 <= body.n <= MAX_N:
    raise ApiError(400, f'n: choices per prompt must be in [1, {MAX_N}], got {body.n}.',
                   param='n')
  if body.stream_options is not None and not body.stream:
    raise ApiError(400, 'stream_options: only allowed with "stream": true.',
                   param='stream_options')
  for key, value in (body.stream_options or {}).items():
    if key not in STREAM_OPTIONS:
      raise ApiError(400, f'stream_options: {key!r} is not supported; give '
                     f'{" or ".join(sorted(STREAM_OPTIONS))}.', param='stream_options')
    if not isinstance(value, bool) and value is not None:
      raise ApiError(400, f'stream_options.{key}: must be true or false, got '
                     f'{_short(value)}.', param='stream_options')


def _completion_prompts(state: ServerState,
                        body: CompletionBody) -> tuple[list[list[int]], list[str] | None]:
  if body.best_of not in (None, 1):
    raise ApiError(400, f'best_of: only 1 is supported, got {body.best_of}.', param='best_of')
  prompt = body.prompt
  if isinstance(prompt, str):
    prompts = [prompt]
  elif prompt and all(isinstance(p, int) for p in prompt):
    prompts = [prompt]
  else:
    prompts = list(prompt)
  if not prompts:
    raise ApiError(400, 'prompt: the list of prompts is empty.', param='prompt')
  ids = [_prompt_ids(state, p, add_special_tokens=body.add_special_tokens is not False)
         for p in prompts]
  specials = body.add_special_tokens is not False
  truncated = [_truncate(state, body.model_extra, i, p if isinstance(p, str) and specials
                         else None) for p, i in zip(prompts, ids)]
  if not body.echo:
    return truncated, None
  # echo repeats a text prompt as given, a token prompt (or a truncated one) decoded
  return truncated, [p if isinstance(p, str) and len(t) == len(i)
                     else state.served.tokenizer.decode(t)
                     for p, i, t in zip(prompts, ids, truncated)]


def _truncate(state: ServerState, body: dict, ids: list[int],
              text: str | None = None) -> list[int]:
  """truncate_prompt_tokens; text: the prompt the ids encode with special tokens."""
  try:
    return sp_lib.truncate_prompt(ids, body or {}, state.max_model_len,
                                  state.served.tokenizer, text)
  except sp_lib.SamplingParamsError as e:
    raise ApiError(400, str(e), param=e.param) from None


def _prompt_ids(state: ServerState, prompt, param: str = 'prompt',
                add_special_tokens: bool = False) -> list[int]:
  ids = (state.served.tokenizer.encode(prompt, add_special_tokens).tolist()
         if isinstance(prompt, str) else prompt)
  if not ids:
    raise ApiError(400, f'{param}: the prompt is empty; give at least one token.', param=param)
  return _in_vocabulary(state, ids, param)


def _in_vocabulary(state: ServerState, ids: list[int], param: str) -> list[int]:
  bad = [i for i in ids if not 0 <= i < state.vocab_size]
  if bad:
    raise ApiError(400, f'{param}: token ids must be in [0, {state.vocab_size - 1}] (the '
                   f'vocabulary), got {bad[:8]}.', param=param)
  return ids


def _chat_prompt(state: ServerState, body: ChatBody, tools) -> list[int]:
  text = _chat_text(state, body, tools.template_tools if tools else None)
  ids = _prompt_ids(state, text, 'messages', add_special_tokens=bool(body.add_special_tokens))
  return _truncate(state, body.model_extra, ids)


def _chat_text(state: ServerState, body: ChatBody | TokenizeBody, tools=None) -> str:
  """The chat template over body's messages, given tools and chat_template_kwargs."""
  if not body.messages:
    raise ApiError(400, 'messages: the list of messages is empty.', param='messages')
  from serve.api.chat_template import render_chat  # pylint: disable=import-outside-toplevel
  extra = body.chat_template_kwargs or {}
  reserved = sorted({'messages', 'tools', 'documents', 'add_generation_prompt'} & set(extra))
  if reserved:
    raise ApiError(400, f'chat_template_kwargs: {reserved} are set by the request itself '
                   '(messages, tools, add_generation_prompt); give them there.',
                   param='chat_template_kwargs')
  plain = [{'role': m.role, 'content': _message_text(m.content),
            **{k: getattr(m, k) for k in ('tool_calls', 'tool_call_id', 'name')
               if getattr(m, k) is not None}} for m in body.messages]
  try:
    messages = tools_lib.template_messages(plain)
  except ValueError as e:
    raise ApiError(400, str(e), param='messages') from None
  try:
    return render_chat(state.served, messages, body.add_generation_prompt is not False,
                       tools=tools, **extra)
  except Exception as e:  # pylint: disable=broad-except  (a template raising on bad roles)
    raise ApiError(400, f'messages: the chat template could not render them: {e}',
                   param='messages') from None


def _chat_tools(state: ServerState, raw: dict):
  """The request's tools and tool_choice (None without), and the body from_openai reads:
  a named function's or "required"'s expression as guided_regex, tool fields dropped."""
  try:
    tools = tools_lib.parse(raw, state.tool_parser)
  except sp_lib.SamplingParamsError as e:
    raise ApiError(400, str(e), param=e.param) from None
  # chat_template_kwargs is read by _chat_text
  fields = {k: v for k, v in raw.items()
            if k not in (*tools_lib.FIELDS, 'chat_template_kwargs')}
  if tools is not None and tools.regex is not None:   # built from the schema once, in parse
    fields['guided_regex'] = tools.regex
    fields.pop('guided_whitespace_pattern', None)      # in it already
  if tools is not None and tools.mode == 'auto':
    # The parser reads the call tags, which a tokenizer may hold as special tokens: kept
    # in the text whatever the request says (as vLLM's Hermes parser sets it).
    fields['skip_special_tokens'] = False
  return tools, fields


def _message_text(content) -> str:
  if content is None or isinstance(content, str):
    return content or ''
  return ''.join(part.text for part in content)


def _sampling_params(state: ServerState, body: dict, prompt_len: int, chat: bool):
  """OpenAI's sampling fields, then the context limit: prompt + max_tokens must fit."""
  try:
    # Chat's default: the room left in the context (OpenAI's); completions': 16.
    default = max(state.max_model_len - prompt_len, 1) if chat else 16
    # n is the server's (_submit); the prompt came truncated (_truncate)
    fields = {k: v for k, v in body.items() if k not in ('n', 'truncate_prompt_tokens')}
    if _prompt_only(body, chat):
      if body.get('min_tokens'):
        raise ApiError(400, 'min_tokens: echo with max_tokens 0 only scores the prompt and '
                       'generates nothing; leave min_tokens out.', param='min_tokens')
      fields['max_tokens'] = 1   # one token is generated and dropped (_Req.prompt_only)
    params = sp_lib.from_openai(fields, state.vocab_size, chat=chat,
                                default_max_tokens=default,
                                defaults=state.served.sampling_defaults)
    if params.prompt_logprobs is not None:   # vLLM's field
      if body.get('stream'):
        raise ApiError(400, 'prompt_logprobs: not available with "stream": true (as in '
                       'vLLM); ask without streaming.', param='prompt_logprobs')
      if body.get('echo') and params.logprobs is not None:
        raise ApiError(400, 'prompt_logprobs: give either it (vLLM\'s) or "echo" with '
                       '"logprobs" (OpenAI\'s), not both.', param='prompt_logprobs')
    if body.get('echo') and not chat and params.logprobs is not None:
      params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    if _prompt_only(body, chat):   # the dropped token: greedy, and nothing can stop it
      params = dataclasses.replace(params, temperature=0.0, ignore_eos=True, stop=[],
                                   stop_token_ids=[], guided_regex=None,
                                   guided_grammar=None)
  except sp_lib.SamplingParamsError as e:
    raise ApiError(400, str(e), param=e.param) from None
  param = 'messages' if chat else 'prompt'
  if prompt_len >= state.max_model_len:
    raise ApiError(400, f'{param}: {prompt_len} tokens, but the model\'s context is '
                   f'{state.max_model_len} tokens; shorten the prompt.', param=param)
  if prompt_len + params.max_tokens > state.max_model_len:
    raise ApiError(400, f'max_tokens: the prompt has {prompt_len} tokens and max_tokens is '
                   f'{params.max_tokens}, more than the model\'s context of '
                   f'{state.max_model_len} tokens together; lower max_tokens to at most '
                   f'{state.max_model_len - prompt_len}.', param='max_tokens')
  return params


def _prompt_only(body: dict, chat: bool) -> bool:
  """Completions with echo and max_tokens 0: score the prompt, generate nothing (what
  lm-evaluation-harness sends for log-likelihoods)."""
  tokens = body.get('max_tokens')
  return not chat and bool(body.get('echo')) and type(tokens) is int and tokens == 0


# --- the engine side of a request ---

def _submit(state: ServerState, prompts: list[list[int]], params: list,
            n: int | None = 1) -> list[_Req]:
  """Adds n requests per prompt to the engine, or none at all (429 when the queue is full).

  A prompt's n choices are independent requests; with a seed, choice j samples with
  seed + j, as vLLM's parallel sampling does, so the n differ and each can be reproduced
  alone. Only the first choice computes the prompt's logprobs: the others read them from
  it (`_prompt_scores`), and `_outputs` holds their outputs until it has them."""
  base, n = uuid.uuid4().hex, n or 1
  limit = state.engine.max_waiting_requests
  if len(prompts) * n > limit:
    raise ApiError(400, f'n: {len(prompts)} prompts x n={n} are {len(prompts) * n} requests, '
                   f'more than the server ever queues ({limit}, --max-waiting-requests); '
                   'send fewer per call.', param='n')
  reqs = []
  try:
    for i, (ids, p) in enumerate(zip(prompts, params)):
      for j in range(n):
        child = p if p.seed is None else dataclasses.replace(p, seed=p.seed + j)
        waits = bool(j) and p.prompt_logprobs is not None
        if waits:
          child = dataclasses.replace(child, prompt_logprobs=None)
        rid = f'{base}-{i * n + j}'
        stream = state.engine.add_request(ids, child, request_id=rid)
        reqs.append(_Req(rid, i * n + j, ids, stream, counts_prompt=j == 0,
                         waits_for_scores=waits))
        reqs[-1].first = reqs[-1] if j == 0 else reqs[-1 - j]
        state.active[rid] = reqs[-1]
  except QueueFull as e:
    _abort(state, reqs)
    raise ApiError(429, f'The server is busy: its waiting queue is full ({e}).',
                   type_='rate_limit_error', code='queue_full') from None
  except EngineDeadError:
    _abort(state, reqs)
    raise _engine_dead(state.engine.health()) from None
  except EngineClosed as e:
    _abort(state, reqs)
    raise ApiError(503, str(e), type_='server_error', code='shutting_down') from None
  except ValueError as e:   # the engine refusing a request that can never fit
    _abort(state, reqs)
    raise ApiError(400, str(e), param=getattr(e, 'param', None)) from None
  return reqs


def _abort(state: ServerState, reqs: list[_Req]) -> None:
  for r in reqs:
    if r.finish_reason is None:
      state.engine.abort(r.rid)
      _finish(state, r, 'abort')


def _finish(state: ServerState, r: _Req, reason: str) -> None:
  r.finish_reason = reason
  state.active.pop(r.rid, None)


def _apply(state: ServerState, r: _Req, out):
  """Folds one RequestOutput delta into its request; the delta as the client sees it."""
  if out.prompt_logprobs is not None:
    r.prompt_logprobs = out.prompt_logprobs
  if r.prompt_only:
    out = dataclasses.replace(out, new_token_ids=[], new_text='', logprobs=None,
                              finish_reason='length' if out.finish_reason in ('stop', 'length')
                              else out.finish_reason)
  r.text += out.new_text
  r.token_ids.extend(out.new_token_ids)
  if out.logprobs:
    r.logprobs.extend(_logprob_entries(out))
  if out.finished:
    _finish(state, r, out.finish_reason)
  return out


async def _outputs(state: ServerState, reqs: list[_Req]):
  """(request, delta) from all of reqs as they come; a stream that ends early is an abort."""
  queue = asyncio.Queue()

  async def pump(r):
    try:
      async for out in r.stream:
        queue.put_nowait((r, out))
    except Exception as e:  # pylint: disable=broad-except  (fails this request only)
      queue.put_nowait((r, e))
    finally:
      queue.put_nowait((r, None))

  def scored(first):   # its prompt's scores are there, or will never come
    return first.prompt_logprobs is not None or first.finish_reason is not None

  tasks = [asyncio.ensure_future(pump(r)) for r in reqs]
  held = {}   # a first choice's rid -> its siblings' items, in order, until scored(first)
  try:
    remaining = len(reqs)
    while remaining:
      item = await queue.get()
      r = item[0]
      if r.waits_for_scores and (r.first.rid in held or not scored(r.first)):
        held.setdefault(r.first.rid, []).append(item)
        continue
      pending = collections.deque([item])
      while pending:
        r, out = pending.popleft()
        if out is None or isinstance(out, Exception):
          remaining -= out is None
          if r.finish_reason is None:
            if out is not None:   # a broken stream: make sure the engine lets it go too
              state.engine.abort(r.rid)
            _finish(state, r, 'abort' if out is None else 'error')
            yield r, None         # readers learn of the early end (_ended_early says why)
        else:
          yield r, _apply(state, r, out)
        if r.rid in held and scored(r):
          pending.extend(held.pop(r.rid))
  finally:
    for t in tasks:
      t.cancel()


async def _collect(state: ServerState, request: fastapi.Request, reqs: list[_Req]) -> None:
  """Runs reqs to the end, aborting them if the client goes away first."""
  async def consume():
    async for _ in _outputs(state, reqs):
      pass

  async def watch():
    # The body is read: the next message uvicorn gives is the disconnect.
    while (await request.receive())['type'] != 'http.disconnect':
      pass

  consumer, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(watch())
  try:
    await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    consumer.cancel()
    watcher.cancel()
    _abort(state, reqs)
  if consumer.done() and not consumer.cancelled() and consumer.exception() is not None:
    raise consumer.exception()   # our failure, not an abort: a 500 (`unexpected`)


def _engine_dead(reason: str) -> ApiError:
  return ApiError(503, f'The engine is dead ({reason}): this server cannot generate and is '
                  'exiting; retry on another replica.', type_='server_error', code='engine_dead')


def _ended_early(state: ServerState, reqs: list[_Req]) -> ApiError | None:
  """The error for a request the server or the engine cut short, if any."""
  dead = state.engine.health() if any(r.finish_reason == 'error' for r in reqs) else None
  if dead is not None:
    return _engine_dead(dead)
  for r in reqs:
    if r.finish_reason == 'error':
      return ApiError(500, 'The engine failed while generating this request; see the server '
                      'log. Other requests are unaffected.', type_='server_error',
                      code='engine_error')
    if r.finish_reason == 'abort':
      why = ('the server is shutting down and the request did not finish within the grace '
             'period' if r.rid in state.shutdown_aborted else 'the request was aborted')
      return ApiError(503, f'Generation stopped early: {why}.', type_='server_error',
                      code='aborted')
  return None


class _AbortOnClose(responses.StreamingResponse):
  """An SSE response that aborts its unfinished requests however it ends.

  A generator's `finally` never runs if the response is cancelled before its first
  chunk (client gone while the prompt was still being prefilled); this wrapper always does.
  """

  def __init__(self, content, state: ServerState, reqs: list[_Req]):
    super().__init__(content, media_type='text/event-stream',
                     headers={'Cache-Control': 'no-cache'})
    self._state, self._reqs = state, reqs

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      _abort(self._state, self._reqs)


# --- responses in OpenAI's shapes ---

def _sse(payload) -> str:
  return f'data: {json.dumps(payload, ensure_ascii=False)}\n\n'


def _usage(reqs: list[_Req]) -> dict:
  prompt = sum(len(r.prompt_ids) for r in reqs if r.counts_prompt)
  completion = sum(len(r.token_ids) for r in reqs)
  return {'prompt_tokens': prompt, 'completion_tokens': completion,
          'total_tokens': prompt + completion}


def _token_text(tokenizer, token_id: int) -> str:
  return tokenizer.decode([token_id])


def _token_bytes(tokenizer, token_id: int) -> list[int]:
  if getattr(tokenizer, 'name', '') == 'byte':
    return [token_id] if token_id < 256 else []
  return list(_token_text(tokenizer, token_id).encode('utf-8'))


def _completion_logprobs(tokenizer, entries, offset: int) -> dict:
  """OpenAI's completions shape; offset: the text length before the first entry."""
  out = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
  for token_id, logprob, top in entries:   # logprob None: an echoed prompt's first token
    text = _token_text(tokenizer, token_id)
    out['tokens'].append(text)
    out['token_logprobs'].append(logprob)
    out['top_logprobs'].append(
        {_token_text(tokenizer, t): lp for t, lp in top} if top else None)
    out['text_offset'].append(offset)
    offset += len(text)
  return out


def _chat_logprobs(tokenizer, entries) -> dict:
  def item(token_id, logprob):
    return {'token': _token_text(tokenizer, token_id), 'logprob': logprob,
            'bytes': _token_bytes(tokenizer, token_id)}
  return {'content': [{**item(t, lp), 'top_logprobs': [item(i, l) for i, l in top or ()]}
                      for t, lp, top in entries]}


def _logprob_entries(out) -> list:
  """(token_id, logprob, [(id, logprob)] | None) for each new token of a delta."""
  return [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or ()]


def _meta(kind: str, state: ServerState) -> dict:
  prefix = 'chatcmpl' if kind.startswith('chat') else 'cmpl'
  return {'id': f'{prefix}-{uuid.uuid4().hex}', 'object': kind, 'created': int(time.time()),
          'model': state.model_name}


def _include_usage(body: _Body) -> bool:
  """include_usage, or vLLM's continuous_usage_stats (which vLLM gives with usage on)."""
  options = body.stream_options or {}
  return bool(options.get('include_usage') or options.get('continuous_usage_stats'))


def _chunk_usage(body: _Body, r: _Req) -> dict:
  """The usage member of a streamed chunk of choice r: absent unless include_usage; null,
  or with vLLM's continuous_usage_stats the choice's own tokens so far (as vLLM counts)."""
  if not _include_usage(body):
    return {}
  if not body.stream_options.get('continuous_usage_stats'):
    return {'usage': None}
  prompt, completion = len(r.prompt_ids), len(r.token_ids)
  return {'usage': {'prompt_tokens': prompt, 'completion_tokens': completion,
                    'total_tokens': prompt + completion}}


def _error_event(err: ApiError) -> str:
  # The openai client raises on a chunk with an "error" member: the stream's last word.
  return _sse({**err.body(), 'status_code': err.status})


async def _events(state, reqs, body, meta, choice_fn, decodes: bool):
  """The SSE stream: a chunk per delta that choice_fn(r, out) turns into a choice (None:
  nothing to send; in a worker thread when it `decodes` token ids, as logprobs do); a
  request cut short ends the stream with an error event, otherwise the usage chunk if
  asked for; then [DONE]."""
  async for r, out in _outputs(state, reqs):
    err = _ended_early(state, [r])
    if err:
      yield _error_event(err)
      break
    choice = await asyncio.to_thread(choice_fn, r, out) if decodes else choice_fn(r, out)
    if choice is not None:
      yield _sse({**meta, 'choices': [choice], **_chunk_usage(body, r)})
  else:
    if _include_usage(body):
      yield _sse({**meta, 'choices': [], 'usage': _usage(reqs)})
  yield 'data: [DONE]\n\n'


def _prompt_scores(r: _Req) -> list:
  """The prompt's logprob entries ([None] + one per token after the first), from the
  choice that computed them."""
  return r.prompt_logprobs or r.first.prompt_logprobs or [None]


def _echo_entries(r: _Req) -> list:
  """The echoed prompt's logprob entries: its first token has none."""
  first = [(r.prompt_ids[0], None, None)]
  return first + [(e.token_id, e.logprob, e.top) for e in _prompt_scores(r)[1:]]


def _vllm_prompt_logprobs(tokenizer, r: _Req) -> list:
  """vLLM's prompt_logprobs: None for the first token, then per token {id: {logprob,
  rank, decoded_token}} for the prompt's own token and the top N. Built once per prompt
  (its choices share it), each token decoded once."""
  if r.first.vllm_json is not None:
    return r.first.vllm_json
  text = functools.lru_cache(maxsize=None)(lambda token: _token_text(tokenizer, token))
  out = [None]
  for e in _prompt_scores(r)[1:]:
    item = {str(e.token_id): {'logprob': e.logprob, 'rank': e.rank,
                              'decoded_token': text(e.token_id)}}
    for rank, (token, logprob) in enumerate(e.top or (), 1):
      item.setdefault(str(token), {'logprob': logprob, 'rank': rank,
                                   'decoded_token': text(token)})
    out.append(item)
  r.first.vllm_json = out
  return out


def _completion_events(state, reqs, body: CompletionBody, want_logprobs: bool):
  def choice(r, out):
    text, entries = out.new_text, _logprob_entries(out) if want_logprobs else []
    if r.echo is not None:   # the prompt goes first, with the first output
      text, r.echo = r.echo + text, None
      entries = (_echo_entries(r) if want_logprobs else []) + entries
    logprobs = None
    if want_logprobs:
      logprobs = _completion_logprobs(state.served.tokenizer, entries, r.logprob_offset)
      r.logprob_offset += sum(len(t) for t in logprobs['tokens'])
    if not (text or entries or r.finish_reason):
      return None
    return {'index': r.index, 'text': text, 'logprobs': logprobs,
            'finish_reason': r.finish_reason}

  return _events(state, reqs, body, _meta('text_completion', state), choice, want_logprobs)


def _completion_json(state, reqs, want_logprobs: bool) -> dict:
  tokenizer = state.served.tokenizer

  def logprobs(r):
    echoed = _echo_entries(r) if r.echo is not None else []
    return _completion_logprobs(tokenizer, echoed + r.logprobs, 0)

  choices = [{'index': r.index, 'text': (r.echo or '') + r.text,
              'finish_reason': r.finish_reason,
              'logprobs': logprobs(r) if want_logprobs else None,
              **({'prompt_logprobs': _vllm_prompt_logprobs(tokenizer, r)}
                 if r.vllm_prompt_logprobs else {})} for r in reqs]
  return {**_meta('text_completion', state), 'choices': choices, 'usage': _usage(reqs)}


async def _chat_events(state, reqs, body: ChatBody, want_logprobs: bool):
  meta = _meta('chat.completion.chunk', state)
  for r in reqs:   # each choice opens with its role
    first = {'index': r.index, 'delta': {'role': 'assistant', 'content': ''},
             'logprobs': None, 'finish_reason': None}
    yield _sse({**meta, 'choices': [first], **_chunk_usage(body, r)})

  def choice(r, out):
    entries = _logprob_entries(out) if want_logprobs else []
    new = _tool_delta(r, out.new_text)
    if not (new.content or new.tool_calls or entries or r.finish_reason):
      return None
    delta = {'content': new.content} if new.content else {}
    if new.tool_calls:
      delta['tool_calls'] = new.tool_calls
    logprobs = _chat_logprobs(state.served.tokenizer, entries) if want_logprobs else None
    return {'index': r.index, 'delta': delta, 'logprobs': logprobs,
            'finish_reason': _chat_finish_reason(r)}

  async for event in _events(state, reqs, body, meta, choice, want_logprobs):
    yield event


def _tool_delta(r: _Req, text: str) -> tools_lib.Delta:
  """A chat delta's text as content and tool calls (all content without tools); the
  parser's last word when the request has finished."""
  if r.tool_parser is None:
    return tools_lib.Delta(text)
  new = r.tool_parser.feed(text)
  return new + r.tool_parser.finish() if r.finish_reason is not None else new


def _chat_finish_reason(r: _Req) -> str | None:
  """"tool_calls" for a choice that called tools under "auto" or "required" and ended
  itself (OpenAI's; a named function was asked for, and ends with "stop")."""
  if (r.finish_reason == 'stop' and r.tools is not None and r.tools.ends_with_calls
      and r.tool_parser.calls):
    return 'tool_calls'
  return r.finish_reason


def _chat_message(r: _Req) -> dict:
  if r.tool_parser is None:
    return {'role': 'assistant', 'content': r.text}
  whole = _tool_delta(r, r.text)   # the parser has seen nothing: non-streamed
  return {'role': 'assistant', 'content': whole.content or None,
          **({'tool_calls': [c.openai() for c in r.tool_parser.calls]}
             if r.tool_parser.calls else {})}


def _chat_json(state, reqs, want_logprobs: bool) -> dict:
  choices = [{'index': r.index, 'message': _chat_message(r),
              'finish_reason': _chat_finish_reason(r),
              'logprobs': (_chat_logprobs(state.served.tokenizer, r.logprobs)
                           if want_logprobs else None)} for r in reqs]
  return {**_meta('chat.completion', state), 'choices': choices, 'usage': _usage(reqs),
          **({'prompt_logprobs': _vllm_prompt_logprobs(state.served.tokenizer, reqs[0])}
             if reqs[0].vllm_prompt_logprobs else {})}   # vLLM's, at the top level


async def _compile_guided(state: ServerState, body: dict, params,
                          field: str | None = None) -> None:
  """Structured output's expression compiled off the event loop (seconds for a large
  vocabulary; cached), so other streams go on meanwhile; a 400 naming the field (by
  default the body's structured-output one) if the vocabulary cannot follow it."""
  if not params.guided:
    return
  try:
    await asyncio.to_thread(state.engine.compile_guided, params)
  except ValueError as e:
    field = field or sp_lib.guided_field(body)
    raise ApiError(400, f'{field}: {e}', param=field) from None


# --- off the event loop ---
# The event loop only moves bytes: tokenizing, rendering chat templates, decoding
# logprobs and anything that takes the engine's lock (held across a step's scheduling and
# emission) runs in worker threads, so one request's preparation never delays another's
# stream or a health check.

def _completion_request(state: ServerState, raw: dict):
  """(body, prompts' token ids, echoed texts, SamplingParams per prompt)."""
  body = _validate(CompletionBody, raw)
  _check_common(state, body)
  prompts, texts = _completion_prompts(state, body)
  return body, prompts, texts, [_sampling_params(state, raw, len(p), chat=False)
                                for p in prompts]


def _chat_request(state: ServerState, raw: dict):
  """(body, tools, the sampling fields, the prompt's token ids, SamplingParams)."""
  body = _validate(ChatBody, raw)
  _check_common(state, body)
  tools, fields = _chat_tools(state, raw)
  prompt = _chat_prompt(state, body, tools)
  return body, tools, fields, prompt, _sampling_params(state, fields, len(prompt), chat=True)


async def _submit_off_loop(state: ServerState, prompts, params, n) -> list[_Req]:
  """_submit in a worker thread; if the client goes away meanwhile, what it submitted
  is aborted once it is in."""
  submitting = asyncio.get_running_loop().run_in_executor(
      state.submitters, _submit, state, prompts, params, n)
  try:
    return await asyncio.shield(submitting)
  except asyncio.CancelledError:
    submitting.add_done_callback(
        lambda f: f.cancelled() or f.exception() is not None or _abort(state, f.result()))
    raise


# --- routes ---

async def _run(state, request, reqs, body, want_logprobs, events_fn, json_fn):
  if body.stream:
    return _AbortOnClose(events_fn(state, reqs, body, want_logprobs), state, reqs)
  await _collect(state, request, reqs)
  err = _ended_early(state, reqs)
  if err:
    raise err
  return await asyncio.to_thread(json_fn, state, reqs, want_logprobs)   # decodes logprobs


async def _completions(state: ServerState, request: fastapi.Request):
  raw = await _json_body(request)
  body, prompts, texts, params = await asyncio.to_thread(_completion_request, state, raw)
  await _compile_guided(state, raw, params[0])
  reqs = await _submit_off_loop(state, prompts, params, body.n)
  for r in reqs:
    r.vllm_prompt_logprobs = raw.get('prompt_logprobs') is not None
    if body.echo:
      r.echo = texts[r.index // (body.n or 1)]
      r.prompt_only = _prompt_only(raw, chat=False)
  return await _run(state, request, reqs, body, params[0].logprobs is not None,
                    _completion_events, _completion_json)


async def _chat(state: ServerState, request: fastapi.Request):
  raw = await _json_body(request)
  body, tools, fields, prompt, params = await asyncio.to_thread(_chat_request, state, raw)
  await _compile_guided(state, fields, params,
                        'tools' if tools is not None and tools.regex else None)
  reqs = await _submit_off_loop(state, [prompt], [params], body.n)
  for r in reqs:
    r.vllm_prompt_logprobs = params.prompt_logprobs is not None
    r.tools = tools
    r.tool_parser = tools.parser() if tools else None
  return await _run(state, request, reqs, body, params.logprobs is not None,
                    _chat_events, _chat_json)


async def _tokenize(state: ServerState, request: fastapi.Request) -> dict:
  return await asyncio.to_thread(_tokenized, state, await _json_body(request))


def _tokenized(state: ServerState, raw: dict) -> dict:
  """The token ids the completions (prompt) or chat (messages) endpoint would run."""
  body = _validate(TokenizeBody, raw)
  _check_model(state, body.model)
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
  text = _chat_text(state, body, tools) if chat else body.prompt
  specials = not chat if body.add_special_tokens is None else body.add_special_tokens
  tokenizer = state.served.tokenizer
  ids = tokenizer.encode(text, specials).tolist()
  out = {'count': len(ids), 'max_model_len': state.max_model_len, 'tokens': ids}
  if body.return_token_strs:
    out['token_strs'] = [_token_text(tokenizer, t) for t in ids]
  return out


async def _detokenize(state: ServerState, request: fastapi.Request) -> dict:
  return await asyncio.to_thread(_detokenized, state, await _json_body(request))


def _detokenized(state: ServerState, raw: dict) -> dict:
  body = _validate(DetokenizeBody, raw)
  _check_model(state, body.model)
  tokens = _in_vocabulary(state, body.tokens, 'tokens')
  return {'prompt': state.served.tokenizer.decode(tokens) if tokens else ''}


def _models(state: ServerState) -> dict:
  card = {'id': state.model_name, 'object': 'model', 'created': state.created,
          'owned_by': 'meshlm', 'max_model_len': state.max_model_len}
  return {'object': 'list', 'data': [card]}


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

  post('/v1/completions', _completions)
  post('/v1/chat/completions', _chat)
  post('/tokenize', _tokenize)      # vLLM's
  post('/detokenize', _detokenize)

  @app.get('/v1/models')
  async def models():
    return _models(state)

  @app.get('/health')
  async def health():
    dead = state.engine.health()
    if dead is not None:   # the process is about to exit (serve.__main__'s watchdog)
      return _engine_dead(dead).response()
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
  app = fastapi.FastAPI(title='meshlm', docs_url=None, redoc_url=None, openapi_url=None)
  app.state.meshlm = state
  app.add_middleware(_Gate, state=state)
  _add_error_handlers(app)
  _add_routes(app, state)
  return app
