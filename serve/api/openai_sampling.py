"""OpenAI and vLLM request bodies to SamplingParams: the fields /v1/completions,
/v1/chat/completions and the batch CLI's lines share, the structured-output fields as
guided_regex or guided_grammar, and the fields refused because they are not implemented.
"""

import json

from serve.sampling_params import (MAX_LOGPROBS, SamplingParams, SamplingParamsError,
                                   check_bool, check_int, is_int)
from serve.structured import guided


# Fields OpenAI and vLLM define that would change what is generated but are not
# implemented here: refused unless absent, null or one of the values that ask for nothing
# (the tuple), so a client never silently gets something other than it asked for. The
# server takes n itself, a request per choice; the batch CLI wants one completion a line.
_UNSUPPORTED = {
    'n': (1,), 'best_of': (1,), 'use_beam_search': (False,),
    'logits_processors': (),
}
_UNSUPPORTED_CHAT = {   # with no tools, tool_choice 'none' and 'auto' both mean plain text
    'tools': ([],), 'functions': ([],),
    'tool_choice': ('none', 'auto'), 'function_call': ('none', 'auto'),
    'echo': (False,), 'continue_final_message': (False,), 'chat_template': (),
    'chat_template_kwargs': ({},),
}
_UNSUPPORTED_COMPLETION = {'suffix': ('',)}
_HINTS = {
    'tools': 'the HTTP server (python -m serve) calls tools; the batch CLI does not',
    'functions': 'send "tools" to the HTTP server (python -m serve)',
    'chat_template_kwargs': 'the HTTP server (python -m serve) takes them',
    'chat_template': 'the server renders with its model\'s template (or --chat-template)',
}


def from_openai(body: dict, vocab_size: int, *, chat: bool = False,
                default_max_tokens: int = 16, defaults: dict | None = None) -> SamplingParams:
  """SamplingParams from a /v1/completions (chat=False) or /v1/chat/completions body.

  Missing or null fields take `defaults` (the model's generation_config.json sampling
  fields, by their SamplingParams names) where it has them, else OpenAI's;
  `default_max_tokens` is the server's choice when the body names none (OpenAI: 16 for
  completions; the room left in the context for chat). Raises SamplingParamsError naming
  the field, validated against vocab_size.
  """
  if not isinstance(body, dict):
    raise SamplingParamsError('body', f'must be a JSON object, got {type(body).__name__}')
  _refuse_unsupported(body, chat)

  defaults = defaults or {}

  def get(name, default):      # JSON null means "the default", as OpenAI reads it
    return defaults.get(name, default) if body.get(name) is None else body[name]

  top_k = get('top_k', 0)
  params = SamplingParams(
      max_tokens=_max_tokens(body, chat, default_max_tokens),
      temperature=get('temperature', 1.0), top_k=0 if top_k == -1 else top_k,
      top_p=get('top_p', 1.0), min_p=get('min_p', 0.0), seed=body.get('seed'),
      stop=_stop_list(get('stop', [])), stop_token_ids=get('stop_token_ids', []),
      ignore_eos=get('ignore_eos', False),
      include_stop_str_in_output=get('include_stop_str_in_output', False),
      min_tokens=get('min_tokens', 0),
      logprobs=_chat_logprobs(body) if chat else body.get('logprobs'),
      presence_penalty=get('presence_penalty', 0.0),
      frequency_penalty=get('frequency_penalty', 0.0),
      repetition_penalty=get('repetition_penalty', 1.0),
      logit_bias=_logit_bias(get('logit_bias', {})),
      **_guided(body),
      skip_special_tokens=get('skip_special_tokens', True),
      allowed_token_ids=body.get('allowed_token_ids'), bad_words=get('bad_words', []),
      prompt_logprobs=body.get('prompt_logprobs'))
  params.validate(vocab_size)
  return params


GUIDED_FIELDS = ('response_format', 'guided_json', 'guided_regex', 'guided_choice',
                 'guided_grammar', 'structured_outputs')
# vLLM's structured_outputs object: each key and the older field that asks the same.
STRUCTURED_OUTPUTS = {'json': 'guided_json', 'regex': 'guided_regex',
                      'choice': 'guided_choice', 'grammar': 'guided_grammar',
                      'whitespace_pattern': 'guided_whitespace_pattern'}


def _guided_fields(body: dict) -> list[str]:
  """The fields of `body` that ask for structured output (response_format text does not,
  nor a structured_outputs object whose keys are all null or false)."""
  return [k for k in GUIDED_FIELDS if body.get(k) is not None and body[k] != {'type': 'text'}
          and not (k == 'structured_outputs' and isinstance(body[k], dict)
                   and not any(_asks(v) for v in body[k].values()))]


def _asks(value) -> bool:
  """structured_outputs' null and false ask for nothing."""
  return value is not None and value is not False


def guided_field(body: dict) -> str | None:
  """The field of `body` that asks for structured output, if any."""
  return next(iter(_guided_fields(body)), None)


def _guided(body: dict) -> dict:
  """SamplingParams' guided_regex or guided_grammar for the structured output asked for,
  if any (one way only)."""
  given = _guided_fields(body)
  if len(given) > 1:
    raise SamplingParamsError(given[1], f'give one of {", ".join(GUIDED_FIELDS)}, not '
                              f'{given}')
  param = given[0] if given else None      # the field errors name
  space_param = 'guided_whitespace_pattern'
  if given == ['structured_outputs']:
    asked = _structured_outputs(body['structured_outputs'])
    space_param = param if 'guided_whitespace_pattern' in asked else space_param
    body = {**body, **asked}
    given = [k for k in _guided_fields(body) if k != 'structured_outputs']
  space = body.get('guided_whitespace_pattern')
  if space is not None and (not isinstance(space, str) or
                            given[:1] not in (['guided_json'], ['response_format'])):
    raise SamplingParamsError(space_param, 'a whitespace pattern must be a regular '
                              'expression, and goes only with a JSON schema or a JSON '
                              'response_format')
  if not given:
    return {}
  name, value = given[0], body[given[0]]
  if name == 'response_format':
    return {'guided_regex': guided.response_format_regex(value, space)}
  if name == 'guided_json':
    if not isinstance(value, (dict, str)):
      raise SamplingParamsError(param, f'must be a JSON schema (an object), got {value!r}')
    return {'guided_regex': guided.json_schema_regex(value, param, space)}
  if name == 'guided_choice':
    return {'guided_regex': guided.choice_regex(value, param)}
  if name == 'guided_grammar':
    guided.grammar(value, param)   # a grammar that does not read is refused here
    return {'guided_grammar': value}
  if not isinstance(value, str) or not value:
    raise SamplingParamsError(param, f'must be a non-empty regular expression, got {value!r}')
  return {'guided_regex': value}


def _structured_outputs(value) -> dict:
  """vLLM's structured_outputs object as the fields it stands for: json, regex, choice,
  grammar or json_object (one), and whitespace_pattern; errors name this field."""
  param = 'structured_outputs'
  if not isinstance(value, dict):
    raise SamplingParamsError(param, f'must be an object such as {{"json": {{...}}}}, '
                              f'{{"regex": "..."}}, {{"choice": [...]}} or '
                              f'{{"grammar": "..."}}, got {value!r}')
  known = {*STRUCTURED_OUTPUTS, 'json_object'}
  unknown = sorted(k for k, v in value.items() if k not in known and _asks(v))
  if unknown:
    raise SamplingParamsError(param, f'{unknown} not supported here; give one of '
                              f'{sorted(known)}')
  asked = [k for k in (*STRUCTURED_OUTPUTS, 'json_object')
           if k != 'whitespace_pattern' and _asks(value.get(k))]
  if len(asked) > 1:
    raise SamplingParamsError(param, f'give one of json, regex, choice, grammar and '
                              f'json_object, not {asked}')
  out = {STRUCTURED_OUTPUTS[k]: value[k] for k in STRUCTURED_OUTPUTS if _asks(value.get(k))}
  if _asks(value.get('json_object')):
    if value['json_object'] is not True:
      raise SamplingParamsError(param, f'json_object must be true, got '
                                f'{value["json_object"]!r}')
    out['response_format'] = {'type': 'json_object'}
  return out


def truncate_prompt(ids: list[int], body: dict, max_model_len: int,
                    tokenizer=None, text: str | None = None) -> list[int]:
  """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the model's context);
  absent or null: the prompt whole. For a text prompt encoded with special tokens (give
  tokenizer and text), those stay (a Llama's BOS) and the text's tokens are cut, as
  vLLM's left-side truncation does."""
  k = body.get('truncate_prompt_tokens')
  if k is None:
    return ids
  if not is_int(k) or not (k == -1 or 1 <= k <= max_model_len):
    raise SamplingParamsError('truncate_prompt_tokens', f'must be an integer in [1, '
                              f'{max_model_len}] (the model\'s context), or -1 for the '
                              f'context, got {k!r}')
  k = max_model_len if k == -1 else k
  if len(ids) <= k:
    return ids
  pre, post = tokenizer.special_tokens_around(text) if text is not None else (0, 0)
  inner = ids[pre:len(ids) - post]
  return ids[:pre] + inner[len(inner) - max(k - pre - post, 0):] + ids[len(ids) - post:]


def _max_tokens(body: dict, chat: bool, default: int):
  """Chat's max_completion_tokens replaces its deprecated max_tokens when both are given."""
  if chat and body.get('max_completion_tokens') is not None:
    check_int('max_completion_tokens', body['max_completion_tokens'], 1, None)
    return body['max_completion_tokens']
  return default if body.get('max_tokens') is None else body['max_tokens']


def _refuse_unsupported(body: dict, chat: bool):
  fields = {**_UNSUPPORTED, **(_UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION)}
  for name, neutral in fields.items():
    value = body.get(name)
    if value is None or any(type(value) is type(v) and value == v for v in neutral):
      continue
    hint = f' ({_HINTS[name]})' if name in _HINTS else ''
    allowed = ' or '.join(json.dumps(v) for v in neutral)
    raise SamplingParamsError(name, f'is not supported here{hint}; leave it out'
                              + (f' or set it to {allowed}' if neutral else ''))


def _stop_list(stop):
  return [stop] if isinstance(stop, str) else stop


def _chat_logprobs(body: dict) -> int | None:
  """Chat asks with `logprobs: true` plus `top_logprobs: N`; completions with one int."""
  want, top = body.get('logprobs'), body.get('top_logprobs')
  if want is not None:
    check_bool('logprobs', want)
  if top is not None:
    check_int('top_logprobs', top, 0, MAX_LOGPROBS)
    if not want:
      raise SamplingParamsError('top_logprobs', 'needs "logprobs": true')
  return (top or 0) if want else None


def _logit_bias(bias) -> dict:
  """OpenAI's logit_bias: a JSON object, so its token ids arrive as strings."""
  if not isinstance(bias, dict):
    raise SamplingParamsError('logit_bias', f'must be an object mapping token ids to '
                              f'biases, got {bias!r}')
  out = {}
  for key, value in bias.items():
    try:
      token = int(key)
    except ValueError:
      raise SamplingParamsError('logit_bias', f'keys must be token ids, got {key!r}') from None
    if token in out:
      raise SamplingParamsError('logit_bias', f'token {token} is given twice')
    out[token] = value
  return out
