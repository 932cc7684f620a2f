"""--speculative-config: vLLM's JSON object, parsed and checked (method "ngram" only; the
drafts themselves: serve/spec/ngram.py)."""

import dataclasses
import json


METHODS = ('ngram',)
MAX_SPECULATIVE_TOKENS = 64   # a structured-output guide takes back as many (serve/structured/guided.py)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  method: str = 'ngram'
  num_speculative_tokens: int = 4   # draft tokens per request and step, at most
  prompt_lookup_max: int = 4        # longest suffix looked up
  prompt_lookup_min: int = 2        # shortest suffix looked up

  def validate(self) -> None:
    where = '--speculative-config'
    if self.method not in METHODS:
      raise ValueError(f'{where}: method={self.method!r} is not supported; choose one of '
                       f'{METHODS} (draft models are not).')
    for name in ('num_speculative_tokens', 'prompt_lookup_max', 'prompt_lookup_min'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'{where}: {name}={value!r} must be an integer of at least 1.')
    if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
      raise ValueError(f'{where}: num_speculative_tokens={self.num_speculative_tokens} is '
                       f'more than {MAX_SPECULATIVE_TOKENS}; a few (2-8) is usual.')
    if self.prompt_lookup_min > self.prompt_lookup_max:
      raise ValueError(f'{where}: prompt_lookup_min={self.prompt_lookup_min} exceeds '
                       f'prompt_lookup_max={self.prompt_lookup_max}; give min <= max.')


def parse_speculative_config(value) -> SpeculativeConfig | None:
  """A SpeculativeConfig from vLLM's JSON object (text or dict); None for ''/None.

  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} (min and max
  default to each other when one is given, else to 2 and 4). ValueError says what is
  wrong."""
  if value is None or value == '' or value == {}:
    return None
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError as e:
      raise ValueError(f'--speculative-config is not JSON ({e}); give e.g. '
                       '\'{"method": "ngram", "num_speculative_tokens": 4}\'.') from None
  if not isinstance(value, dict):
    raise ValueError(f'--speculative-config must be a JSON object, got {value!r}.')
  known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
  unknown = sorted(set(value) - known)
  if unknown:
    raise ValueError(f'--speculative-config: unknown field(s) {unknown}; known: '
                     f'{sorted(known)}.')
  if 'method' not in value:
    raise ValueError('--speculative-config needs "method" (only "ngram" is supported).')
  fields = dict(value)
  lo, hi = fields.get('prompt_lookup_min'), fields.get('prompt_lookup_max')
  if lo is None and hi is not None:
    fields['prompt_lookup_min'] = hi
  elif hi is None and lo is not None:
    fields['prompt_lookup_max'] = lo
  cfg = SpeculativeConfig(**fields)
  cfg.validate()
  return cfg
