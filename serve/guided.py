"""Structured output: a regular expression the output must match, token by token.

JSON schemas (`response_format` json_schema / json_object, vLLM's `guided_json`), choices
(`guided_choice`) and regular expressions (`guided_regex`) all become one regular
expression (`to_regex`, when the request is parsed). The engine compiles it against the
tokenizer's vocabulary into an index (outlines-core: a DFA over token byte strings; cached
per expression, since a large vocabulary takes seconds) and gives each such request a
`Guide`. Before each of its steps the sampler sees only the tokens that keep the output a
prefix of a match; once the output matches in full and nothing can extend it, only eos is
allowed, so the request ends as a match ('stop'), or at max_tokens ('length') with a
prefix of one.

Token byte strings come from the tokenizer's decoder: ByteLevel (GPT-2, Llama-3) maps
each character back to its byte; Metaspace and byte fallback (SentencePiece, Llama-2)
read '▁' as a space and <0xNN> as that byte; the byte tokenizer's ids are bytes. Special
tokens are never allowed (eos only at the end).
"""

import functools
import json
import re

import numpy as np

from serve.sampling_params import SamplingParamsError

INDEX_CACHE = 32   # compiled expressions kept per engine


def json_schema_regex(schema, param: str) -> str:
  """The regular expression of the JSON texts `schema` (a dict or its JSON) accepts."""
  from outlines_core import json_schema  # pylint: disable=import-outside-toplevel
  text = schema if isinstance(schema, str) else json.dumps(schema)
  try:
    return json_schema.build_regex_from_schema(text)
  except (ValueError, TypeError) as e:
    raise SamplingParamsError(param, f'is not a JSON schema this server can follow ({e})') \
        from None


def choice_regex(choices, param: str = 'guided_choice') -> str:
  if (not isinstance(choices, list) or not choices
      or not all(isinstance(c, str) and c for c in choices)):
    raise SamplingParamsError(param, f'must be a non-empty list of non-empty strings, got '
                              f'{choices!r}')
  return '(' + '|'.join(re.escape(c) for c in choices) + ')'


def response_format_regex(value) -> str | None:
  """OpenAI's response_format: None for plain text, else the regular expression."""
  param = 'response_format'
  kind = value.get('type') if isinstance(value, dict) else None
  if kind == 'text':
    return None
  if kind == 'json_object':
    return json_schema_regex({'type': 'object'}, param)
  if kind == 'json_schema':
    spec = value.get('json_schema')
    if not isinstance(spec, dict) or not isinstance(spec.get('schema'), dict):
      raise SamplingParamsError(param, 'json_schema needs {"name": ..., "schema": {...}}, '
                                f'got {spec!r}')
    return json_schema_regex(spec['schema'], param)
  raise SamplingParamsError(param, 'must be {"type": "text"}, {"type": "json_object"} or '
                            f'{{"type": "json_schema", "json_schema": {{...}}}}, got {value!r}')


def token_bytes(tokenizer) -> dict[int, bytes]:
  """Each ordinary token's bytes in the decoded text (special tokens left out)."""
  if getattr(tokenizer, 'name', '') == 'byte':
    return {b: bytes([b]) for b in range(256)}
  tok = tokenizer._tok  # pylint: disable=protected-access
  special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
  decoder = json.loads(tok.to_str()).get('decoder') or {}
  kinds = {d.get('type') for d in decoder.get('decoders', [decoder])}
  unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
  out = {}
  for piece, i in tok.get_vocab(with_added_tokens=True).items():
    if i in special or i >= tokenizer.vocab_size:
      continue
    if 'ByteLevel' in kinds:
      out[i] = bytes(unicode_to_byte[c] for c in piece)
    elif 'ByteFallback' in kinds and re.fullmatch(r'<0x[0-9A-Fa-f]{2}>', piece):
      out[i] = bytes([int(piece[3:5], 16)])
    elif 'Metaspace' in kinds or 'Replace' in kinds:
      out[i] = piece.replace('\u2581', ' ').encode('utf-8')
    else:
      out[i] = tokenizer.decode([i]).encode('utf-8')
  return out


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte <-> printable character table (ByteLevel pre-tokenizer and decoder)."""
  printable = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
               + list(range(ord('®'), ord('ÿ') + 1)))
  table, extra = {b: chr(b) for b in printable}, 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table


class GuidedDecoding:
  """One engine's vocabulary for outlines-core and its cache of compiled expressions."""

  def __init__(self, tokenizer, eos_id: int):
    from outlines_core import Vocabulary  # pylint: disable=import-outside-toplevel
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in token_bytes(tokenizer).items():
      if i != eos_id and b:
        by_bytes.setdefault(b, []).append(i)
    self.vocab_size = tokenizer.vocab_size
    self._vocabulary = Vocabulary(eos_id, by_bytes)
    self._index = functools.lru_cache(maxsize=INDEX_CACHE)(self._compile)

  def _compile(self, regex: str):
    from outlines_core import Index  # pylint: disable=import-outside-toplevel
    try:
      return Index(regex, self._vocabulary)
    except ValueError as e:
      raise ValueError(f'the guided output\'s regular expression cannot be followed with '
                       f'this vocabulary ({e}): {regex[:80]!r}') from None

  def guide(self, regex: str) -> 'RequestGuide':
    return RequestGuide(self._index(regex), self.vocab_size)


class RequestGuide:
  """One request's place in its expression: the tokens allowed next, advanced per token."""

  def __init__(self, index, vocab_size: int):
    from outlines_core import Guide  # pylint: disable=import-outside-toplevel
    self._guide = Guide(index)
    self._vocab_size = vocab_size
    self._words = np.zeros(-(-vocab_size // 32), np.int32)

  def allowed(self) -> np.ndarray:
    """[vocab_size] bool: the tokens that keep the output a prefix of a match."""
    self._words[:] = 0
    self._guide.write_mask_into(self._words.ctypes.data, self._words.size, 4)
    bits = np.unpackbits(self._words.view(np.uint8), bitorder='little')
    return bits[:self._vocab_size].astype(bool)

  def advance(self, token: int) -> None:
    self._guide.advance(int(token), return_tokens=False)

  @property
  def is_finished(self) -> bool:
    return self._guide.is_finished()
