"""How one request wants its tokens chosen, and the mapping from an OpenAI request body.

Ranges follow the OpenAI API where it defines one (temperature 0..2, top_p in (0, 1],
logprobs 0..20, presence and frequency penalties -2..2, logit_bias -100..100 per token) and
vLLM's extensions otherwise (top_k, -1 or 0 for off; min_p in [0, 1]; repetition_penalty
> 0; stop_token_ids; ignore_eos; min_tokens in [0, max_tokens];
include_stop_str_in_output). Logprobs are the model's own ("raw": before temperature and
filters, as vLLM reports by default). A seed is any integer (used modulo 2**64). Errors
are `SamplingParamsError`, a ValueError whose `param` is the OpenAI field name, so the
server can put it in the error body.
"""

import dataclasses
import json
import math

MAX_TEMPERATURE = 2.0      # OpenAI's range; hotter than 2 is noise for any model we serve
MAX_LOGPROBS = 20          # OpenAI's top_logprobs limit (completions' own is 5; we allow 20)
MAX_STOP = 16              # OpenAI allows 4; vLLM any. Bounded: each token scans them all
GREEDY_BELOW = 1e-5        # temperatures under this sample greedily (dividing by them overflows)
MAX_PENALTY = 2.0          # OpenAI's presence/frequency range [-2, 2]
MAX_LOGIT_BIAS = 100.0     # OpenAI's range [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 300   # bounded: the biased ids travel to the device every step


class SamplingParamsError(ValueError):
  """A sampling field out of range or of the wrong type; `param` names the field."""

  def __init__(self, param: str, message: str):
    super().__init__(f'{param}: {message}')
    self.param = param


@dataclasses.dataclass
class SamplingParams:
  """Per-request sampling settings; defaults are OpenAI's completions defaults."""
  max_tokens: int = 16
  temperature: float = 1.0      # 0 (or below GREEDY_BELOW): greedy
  top_k: int = 0                # 0 or -1: off
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int | None = None       # same seed -> same output whatever else is in the batch
  stop: list[str] = dataclasses.field(default_factory=list)
  stop_token_ids: list[int] = dataclasses.field(default_factory=list)
  ignore_eos: bool = False
  include_stop_str_in_output: bool = False   # a matched stop string ends the text, kept
  # eos and the stop token ids cannot be drawn before this many output tokens, and no stop
  # string may end in their text (vLLM's min_tokens).
  min_tokens: int = 0
  logprobs: int | None = None   # None: none; 0: the sampled token's; N: plus the top N
  # The same for each prompt token after the first (vLLM's prompt_logprobs): computed for
  # the whole prompt, so such a request never takes its prompt from the prefix cache.
  prompt_logprobs: int | None = None
  # Applied to the logits before temperature and the filters, in vLLM's order: logit_bias,
  # then repetition_penalty over the prompt and output tokens (a positive logit divided by
  # it, a negative one multiplied), then frequency_penalty times each token's count in the
  # output and presence_penalty once for each token the output has.
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
  # Structured output: the output must match this regular expression (serve/structured/guided.py;
  # from_openai turns JSON schemas and choices into one), or this context-free grammar
  # (Lark or GBNF text, read by llguidance). One of them; needs eos, and no min_tokens.
  guided_regex: str | None = None
  guided_grammar: str | None = None
  # vLLM's: only these tokens may be drawn (eos too only if listed); None: any.
  allowed_token_ids: list[int] | None = None
  # vLLM's: no word of these may be completed in the output (serve/engine/core.py bad_word_ids).
  bad_words: list[str] = dataclasses.field(default_factory=list)
  # False: special tokens (a template's tags, eos) are written into the text, as their
  # tokenizer.json content.
  skip_special_tokens: bool = True

  @property
  def guided(self) -> bool:
    """Whether the output must follow a regular expression or a grammar."""
    return self.guided_regex is not None or self.guided_grammar is not None

  @property
  def greedy(self) -> bool:
    return self.temperature < GREEDY_BELOW

  @property
  def counts_output(self) -> bool:
    """Whether the output's token counts change this request's logits."""
    return self.presence_penalty != 0 or self.frequency_penalty != 0

  @property
  def adjusts_logits(self) -> bool:
    """Whether the penalties or logit_bias change the logits (min_tokens' bans, which the
    engine passes per step, are not counted)."""
    return self.counts_output or self.repetition_penalty != 1 or bool(self.logit_bias)

  def validate(self, vocab_size: int) -> None:
    """Raises SamplingParamsError naming the first field out of range."""
    _check_int('max_tokens', self.max_tokens, 1, None)
    _check_float('temperature', self.temperature, 0.0, MAX_TEMPERATURE)
    _check_int('top_k', self.top_k, -1, None)
    _check_float('top_p', self.top_p, 0.0, 1.0, low_open=True)
    _check_float('min_p', self.min_p, 0.0, 1.0)
    if self.seed is not None:
      _check_int('seed', self.seed, None, None)
    _check_stop(self.stop)
    _check_token_ids('stop_token_ids', self.stop_token_ids, vocab_size)
    _check_bool('ignore_eos', self.ignore_eos)
    _check_bool('include_stop_str_in_output', self.include_stop_str_in_output)
    _check_bool('skip_special_tokens', self.skip_special_tokens)
    if (not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_STOP
        or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
      raise SamplingParamsError('bad_words', f'must be a list of at most {MAX_STOP} '
                                f'non-blank strings, got {self.bad_words!r}')
    if self.allowed_token_ids is not None:
      _check_token_ids('allowed_token_ids', self.allowed_token_ids, vocab_size)
      if not self.allowed_token_ids:
        raise SamplingParamsError('allowed_token_ids', 'must list at least one token id')
    _check_int('min_tokens', self.min_tokens, 0, self.max_tokens)
    if self.logprobs is not None:
      _check_int('logprobs', self.logprobs, 0, MAX_LOGPROBS)
    if self.prompt_logprobs is not None:
      _check_int('prompt_logprobs', self.prompt_logprobs, 0, MAX_LOGPROBS)
    _check_float('presence_penalty', self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _check_float('frequency_penalty', self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    _check_float('repetition_penalty', self.repetition_penalty, 0.0, math.inf, low_open=True)
    _check_logit_bias(self.logit_bias, vocab_size)
    for name in ('guided_regex', 'guided_grammar'):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, str) or not value):
        raise SamplingParamsError(name, f'must be a non-empty string, got {value!r}')
    if self.guided_regex is not None and self.guided_grammar is not None:
      raise SamplingParamsError('guided_grammar', 'give either it or guided_regex, not both')
    if self.guided:
      if self.ignore_eos or self.min_tokens:
        raise SamplingParamsError('ignore_eos' if self.ignore_eos else 'min_tokens',
                                  'cannot be combined with guided output, which ends with '
                                  'eos as soon as the output matches')
      if self.allowed_token_ids is not None:
        raise SamplingParamsError('allowed_token_ids', 'cannot be combined with guided '
                                  'output, which chooses the allowed tokens itself')


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name, value, low, high):
  if not _is_int(value):
    raise SamplingParamsError(name, f'must be an integer, got {value!r}')
  if (low is not None and value < low) or (high is not None and value > high):
    what = f'an integer in [{low}, {high}]' if high is not None else f'an integer >= {low}'
    raise SamplingParamsError(name, f'must be {what}, got {value}')


def _check_float(name, value, low, high, low_open=False):
  if not (_is_int(value) or isinstance(value, float)):
    raise SamplingParamsError(name, f'must be a number, got {value!r}')
  above_low = value > low if low_open else value >= low
  if not (math.isfinite(value) and above_low and value <= high):
    interval = f'{"(" if low_open else "["}{low}, {high}]'
    raise SamplingParamsError(name, f'must be a number in {interval}, got {value}')


def _check_bool(name, value):
  if not isinstance(value, bool):
    raise SamplingParamsError(name, f'must be true or false, got {value!r}')


def _check_stop(stop):
  if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
    raise SamplingParamsError('stop', f'must be a string or a list of strings, got {stop!r}')
  if len(stop) > MAX_STOP:
    raise SamplingParamsError('stop', f'at most {MAX_STOP} stop strings, got {len(stop)}')
  if any(not s for s in stop):
    raise SamplingParamsError('stop', 'stop strings must not be empty')


def _check_token_ids(name, ids, vocab_size):
  if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
    raise SamplingParamsError(name, f'must be a list of integers, got {ids!r}')
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise SamplingParamsError(
        name, f'token ids must be in [0, {vocab_size - 1}] (the vocabulary), got {bad}')


def _check_logit_bias(bias, vocab_size):
  if not isinstance(bias, dict):
    raise SamplingParamsError('logit_bias', f'must map token ids to biases, got {bias!r}')
  if len(bias) > MAX_LOGIT_BIAS_TOKENS:
    raise SamplingParamsError('logit_bias', f'at most {MAX_LOGIT_BIAS_TOKENS} tokens, got '
                              f'{len(bias)}')
  _check_token_ids('logit_bias', list(bias), vocab_size)
  for value in bias.values():
    _check_float('logit_bias', value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)


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
  from serve.structured import guided  # pylint: disable=import-outside-toplevel
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
  if not _is_int(k) or not (k == -1 or 1 <= k <= max_model_len):
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
    _check_int('max_completion_tokens', body['max_completion_tokens'], 1, None)
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
    _check_bool('logprobs', want)
  if top is not None:
    _check_int('top_logprobs', top, 0, MAX_LOGPROBS)
    if not want:
      raise SamplingParamsError('top_logprobs', 'needs "logprobs": true')
  return (top or 0) if want else None
