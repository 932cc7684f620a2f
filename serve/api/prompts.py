"""Request bodies to what the engine runs: the common checks, prompts as token ids (text,
ids, or chat messages under the model's template), and SamplingParams within the
model's context."""

import dataclasses

from serve import sampling_params as sp_lib
from serve.api import lora, openai_sampling
from serve.api import tools as tools_lib
from serve.api.protocol import (MAX_N, STREAM_OPTIONS, ApiError, Body, ChatBody, CompletionBody,
                                TokenizeBody, short)
from serve.api.state import ServerState

# What of a chat message, beside role and content, the chat template sees (reasoning under
# transformers' names, vLLM's `reasoning` among them).
MESSAGE_FIELDS = ('tool_calls', 'tool_call_id', 'name', 'reasoning_content', 'reasoning',
                  'thinking')


def check_model(state: ServerState, model: str | None) -> str | None:
  """The LoRA adapter `model` names (None: the base); 404 for a model not served."""
  return lora.adapter_of(state, model)


def check_common(state: ServerState, body: Body) -> str | None:
  """Checks the fields every body has; returns the LoRA adapter it names (or None)."""
  adapter = check_model(state, body.model)
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
                     f'{short(value)}.', param='stream_options')
  return adapter


def completion_prompts(state: ServerState,
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
    return openai_sampling.truncate_prompt(ids, body or {}, state.max_model_len,
                                           state.served.tokenizer, text)
  except sp_lib.SamplingParamsError as e:
    raise ApiError(400, str(e), param=e.param) from None


def _prompt_ids(state: ServerState, prompt, param: str = 'prompt',
                add_special_tokens: bool = False) -> list[int]:
  ids = (state.served.tokenizer.encode(prompt, add_special_tokens).tolist()
         if isinstance(prompt, str) else prompt)
  if not ids:
    raise ApiError(400, f'{param}: the prompt is empty; give at least one token.', param=param)
  return in_vocabulary(state, ids, param)


def in_vocabulary(state: ServerState, ids: list[int], param: str) -> list[int]:
  bad = [i for i in ids if not 0 <= i < state.vocab_size]
  if bad:
    raise ApiError(400, f'{param}: token ids must be in [0, {state.vocab_size - 1}] (the '
                   f'vocabulary), got {bad[:8]}.', param=param)
  return ids


def chat_prompt(state: ServerState, body: ChatBody, tools) -> list[int]:
  text = chat_text(state, body, tools.template_tools if tools else None)
  ids = _prompt_ids(state, text, 'messages', add_special_tokens=bool(body.add_special_tokens))
  return _truncate(state, body.model_extra, ids)


def chat_text(state: ServerState, body: ChatBody | TokenizeBody, tools=None) -> str:
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
            **{k: getattr(m, k, None) for k in MESSAGE_FIELDS
               if getattr(m, k, None) is not None}} for m in body.messages]
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


def chat_tools(state: ServerState, raw: dict):
  """The request's tools and tool_choice (None without), and the body from_openai reads:
  a named function's or "required"'s expression as guided_regex, tool fields dropped."""
  try:
    tools = tools_lib.parse(raw, state.tool_parser)
  except sp_lib.SamplingParamsError as e:
    raise ApiError(400, str(e), param=e.param) from None
  # chat_template_kwargs is read by chat_text
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


def request_params(state: ServerState, body: dict, prompt_len: int, chat: bool):
  """OpenAI's sampling fields, then the context limit: prompt + max_tokens must fit."""
  try:
    # Chat's default: the room left in the context (OpenAI's); completions': 16.
    default = max(state.max_model_len - prompt_len, 1) if chat else 16
    # n is the server's (submit); the prompt came truncated (_truncate)
    fields = {k: v for k, v in body.items() if k not in ('n', 'truncate_prompt_tokens')}
    if prompt_only(body, chat):
      if body.get('min_tokens'):
        raise ApiError(400, 'min_tokens: echo with max_tokens 0 only scores the prompt and '
                       'generates nothing; leave min_tokens out.', param='min_tokens')
      fields['max_tokens'] = 1   # one token is generated and dropped (Choice.prompt_only)
    params = openai_sampling.from_openai(fields, state.vocab_size, chat=chat,
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
    if prompt_only(body, chat):   # the dropped token: greedy, and nothing can stop it
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


def prompt_only(body: dict, chat: bool) -> bool:
  """Completions with echo and max_tokens 0: score the prompt, generate nothing (what
  lm-evaluation-harness sends for log-likelihoods)."""
  tokens = body.get('max_tokens')
  return not chat and bool(body.get('echo')) and type(tokens) is int and tokens == 0
