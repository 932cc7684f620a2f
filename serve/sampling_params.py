"""How one request wants its tokens chosen (serve/api/openai_sampling.py maps an OpenAI
request body onto it).

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
  # vLLM's: no word of these may be completed in the output (serve/engine/constraints.py).
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
    check_int('max_tokens', self.max_tokens, 1, None)
    _check_float('temperature', self.temperature, 0.0, MAX_TEMPERATURE)
    check_int('top_k', self.top_k, -1, None)
    _check_float('top_p', self.top_p, 0.0, 1.0, low_open=True)
    _check_float('min_p', self.min_p, 0.0, 1.0)
    if self.seed is not None:
      check_int('seed', self.seed, None, None)
    _check_stop(self.stop)
    _check_token_ids('stop_token_ids', self.stop_token_ids, vocab_size)
    check_bool('ignore_eos', self.ignore_eos)
    check_bool('include_stop_str_in_output', self.include_stop_str_in_output)
    check_bool('skip_special_tokens', self.skip_special_tokens)
    if (not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_STOP
        or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
      raise SamplingParamsError('bad_words', f'must be a list of at most {MAX_STOP} '
                                f'non-blank strings, got {self.bad_words!r}')
    if self.allowed_token_ids is not None:
      _check_token_ids('allowed_token_ids', self.allowed_token_ids, vocab_size)
      if not self.allowed_token_ids:
        raise SamplingParamsError('allowed_token_ids', 'must list at least one token id')
    check_int('min_tokens', self.min_tokens, 0, self.max_tokens)
    if self.logprobs is not None:
      check_int('logprobs', self.logprobs, 0, MAX_LOGPROBS)
    if self.prompt_logprobs is not None:
      check_int('prompt_logprobs', self.prompt_logprobs, 0, MAX_LOGPROBS)
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


def is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def check_int(name, value, low, high):
  if not is_int(value):
    raise SamplingParamsError(name, f'must be an integer, got {value!r}')
  if (low is not None and value < low) or (high is not None and value > high):
    what = f'an integer in [{low}, {high}]' if high is not None else f'an integer >= {low}'
    raise SamplingParamsError(name, f'must be {what}, got {value}')


def _check_float(name, value, low, high, low_open=False):
  if not (is_int(value) or isinstance(value, float)):
    raise SamplingParamsError(name, f'must be a number, got {value!r}')
  above_low = value > low if low_open else value >= low
  if not (math.isfinite(value) and above_low and value <= high):
    interval = f'{"(" if low_open else "["}{low}, {high}]'
    raise SamplingParamsError(name, f'must be a number in {interval}, got {value}')


def check_bool(name, value):
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
  if not isinstance(ids, list) or not all(is_int(i) for i in ids):
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
