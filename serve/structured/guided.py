"""Structured output: a regular expression or a grammar the output must match, token by token.

JSON schemas (`response_format` json_schema / json_object, vLLM's `guided_json`), choices
(`guided_choice`) and regular expressions (`guided_regex`) all become one regular
expression when the request is parsed. The engine compiles it against the tokenizer's
vocabulary into an index (outlines-core: a DFA over token byte strings; cached per
expression, since a large vocabulary takes seconds) and gives each such request a guide.

Context-free grammars (vLLM's `guided_grammar`, in Lark or llama.cpp's GBNF syntax) go to
llguidance instead, which no regular expression could express (nesting, recursion): the
grammar is checked when the request is parsed (`grammar`), and each request's guide is an
Earley parser over the vocabulary's token trie that computes the allowed tokens at each
step (the first when the request is added, the others on the engine's thread), so nothing
is compiled per vocabulary.

Before each of its steps the sampler sees only the tokens that keep the output a prefix
of a match; once the output matches in full and nothing can extend it, only eos is
allowed, so the request ends as a match ('stop'), or at max_tokens ('length') with a
prefix of one. With speculative decoding a guide also gives the allowed tokens after each
token of a draft (draft_words) without moving.

Token byte strings come from the tokenizer's decoder: ByteLevel (GPT-2, Llama-3) maps
each character back to its byte; Metaspace and byte fallback (SentencePiece, Llama-2)
read '▁' as a space and <0xNN> as that byte; the byte tokenizer's ids are bytes. Special
tokens are never allowed (eos only at the end), unless a grammar names one by its id
(llguidance's `<[id]>`).
"""

import contextlib
import functools
import json
import re
import threading

import numpy as np

from serve.sampling_params import SamplingParamsError
from serve.spec.config import MAX_SPECULATIVE_TOKENS
from serve.worker.logits_adjust import pack_bits, unpack_bits
from training.tokenizer import bytes_to_unicode

# Compiled expressions kept per engine: json_object's takes ~170 MB at a 128K vocabulary.
INDEX_CACHE = 16
# A grammar's text is parsed on the request path: bounded like the other request fields.
MAX_GRAMMAR_CHARS = 64 * 1024
# Longer tokens are left out of llguidance's vocabulary (grammars spell their text with
# shorter ones): its token trie panics on a token of ~1.5 KB (llguidance 1.9.1), which a
# BPE trained on code can have.
MAX_GRAMMAR_TOKEN_BYTES = 512
# Draft tokens a guide follows ahead (speculative decoding): outlines-core keeps this many
# earlier states to go back to.
MAX_DRAFT = MAX_SPECULATIVE_TOKENS


def json_schema_regex(schema, param: str, whitespace: str | None = None) -> str:
  """The regular expression of the JSON texts `schema` (a dict or its JSON) accepts;
  between tokens `whitespace` (a regular expression; default one optional space)."""
  from outlines_core import json_schema  # pylint: disable=import-outside-toplevel
  text = schema if isinstance(schema, str) else json.dumps(schema)
  try:
    return json_schema.build_regex_from_schema(text, whitespace)
  except (ValueError, TypeError) as e:
    raise SamplingParamsError(param, f'is not a JSON schema this server can follow ({e})') \
        from None


def choice_regex(choices, param: str = 'guided_choice') -> str:
  if (not isinstance(choices, list) or not choices
      or not all(isinstance(c, str) and c for c in choices)):
    raise SamplingParamsError(param, f'must be a non-empty list of non-empty strings, got '
                              f'{choices!r}')
  return '(' + '|'.join(re.escape(c) for c in choices) + ')'


def grammar(text, param: str = 'guided_grammar') -> str:
  """llguidance's form of a context-free grammar in Lark or GBNF syntax (its syntax
  checked); a SamplingParamsError naming `param` if it is not one."""
  import llguidance  # pylint: disable=import-outside-toplevel
  if not isinstance(text, str) or not text.strip():
    raise SamplingParamsError(param, f'must be a grammar in Lark or GBNF syntax, got '
                              f'{text!r}')
  if len(text) > MAX_GRAMMAR_CHARS:
    raise SamplingParamsError(param, f'at most {MAX_GRAMMAR_CHARS} characters, got '
                              f'{len(text)}')
  try:
    with _llguidance_panics():
      out = llguidance.grammar_from('grammar', text)
      error = llguidance.LLMatcher.validate_grammar(out)
  except ValueError as e:
    raise SamplingParamsError(param, f'is not a Lark or GBNF grammar: {e}') from None
  if error:
    raise SamplingParamsError(param, f'is not a grammar this server can follow: '
                              f'{error.strip()}')
  return out


@contextlib.contextmanager
def _llguidance_panics():
  """llguidance's Rust panics (pyo3's PanicException, a BaseException) as ValueError, so
  one fails its request, never the engine's loop."""
  try:
    yield
  except BaseException as e:  # pylint: disable=broad-except
    if type(e).__name__ != 'PanicException':
      raise
    raise ValueError(f'llguidance failed: {_first_line(str(e))}') from None


def response_format_regex(value, whitespace: str | None = None) -> str | None:
  """OpenAI's response_format: None for plain text, else the regular expression."""
  param = 'response_format'
  kind = value.get('type') if isinstance(value, dict) else None
  if kind == 'text':
    return None
  if kind == 'json_object':
    return json_schema_regex({'type': 'object'}, param, whitespace)
  if kind == 'json_schema':
    spec = value.get('json_schema')
    if not isinstance(spec, dict) or not isinstance(spec.get('schema'), dict):
      raise SamplingParamsError(param, 'json_schema needs {"name": ..., "schema": {...}}, '
                                f'got {spec!r}')
    return json_schema_regex(spec['schema'], param, whitespace)
  raise SamplingParamsError(param, 'must be {"type": "text"}, {"type": "json_object"} or '
                            f'{{"type": "json_schema", "json_schema": {{...}}}}, got {value!r}')


def token_bytes(tokenizer) -> dict[int, bytes]:
  """Each ordinary token's bytes in the decoded text (special tokens left out)."""
  if getattr(tokenizer, 'name', '') == 'byte':
    return {b: bytes([b]) for b in range(256)}
  tok = tokenizer._tok  # pylint: disable=protected-access
  added = tok.get_added_tokens_decoder()
  decoder = json.loads(tok.to_str()).get('decoder') or {}
  kinds = {d.get('type') for d in decoder.get('decoders', [decoder])}
  unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
  out = {}
  for piece, i in tok.get_vocab(with_added_tokens=True).items():
    if i >= tokenizer.vocab_size or (i in added and added[i].special):
      continue
    if i in added:   # an added token holds its text as it is, whatever the decoder
      out[i] = added[i].content.encode('utf-8')
    elif 'ByteLevel' in kinds:
      out[i] = bytes(unicode_to_byte[c] for c in piece)
    elif 'ByteFallback' in kinds and re.fullmatch(r'<0x[0-9A-Fa-f]{2}>', piece):
      out[i] = bytes([int(piece[3:5], 16)])
    elif 'Metaspace' in kinds or 'Replace' in kinds:
      out[i] = piece.replace('\u2581', ' ').encode('utf-8')
    else:
      out[i] = tokenizer.decode([i]).encode('utf-8')
  return out


class GuidedDecoding:
  """One engine's vocabulary for outlines-core (regular expressions) and llguidance
  (grammars), and its caches of compiled expressions and checked grammars.

  eos_ids: the model's end tokens, the first the one outlines-core allows at a match's
  end; wherever it is allowed, so are the others (Llama-3.1 chat ends with <|eot_id|>)."""

  def __init__(self, tokenizer, eos_ids: list[int]):
    from outlines_core import Vocabulary  # pylint: disable=import-outside-toplevel
    self._tokenizer = tokenizer
    self._bytes = token_bytes(tokenizer)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in self._bytes.items():
      if i not in eos_ids and b:
        by_bytes.setdefault(b, []).append(i)
    self.vocab_size = tokenizer.vocab_size
    self.eos_ids = [int(e) for e in eos_ids]
    self._vocabulary = Vocabulary(self.eos_ids[0], by_bytes)
    self._index = functools.lru_cache(maxsize=INDEX_CACHE)(self._compile)
    self._matcher = functools.lru_cache(maxsize=INDEX_CACHE)(self._compile_grammar)
    self._lock = threading.Lock()
    self._ll_tokenizer = None

  def _compile(self, regex: str):
    from outlines_core import Index  # pylint: disable=import-outside-toplevel
    try:
      return Index(regex, self._vocabulary)
    except ValueError as e:
      raise ValueError(f'this regular expression cannot be compiled for the model\'s '
                       f'vocabulary ({e}). Anchors (^, $), lookarounds and backreferences '
                       'are not supported, and every character must be one the tokenizer '
                       'can spell.') from None

  def compile(self, regex: str | None = None, *, grammar: str | None = None):
    """The expression's index, or the parser at the start of a grammar (Lark or GBNF
    text) (cached; ValueError if it cannot be followed). Seconds for a large vocabulary:
    callers on an event loop run it in a thread."""
    if (regex is None) == (grammar is None):
      raise ValueError('give a regular expression or a grammar (one of them)')
    return self._matcher(grammar) if grammar is not None else self._index(regex)

  def guide(self, regex: str | None = None, *, grammar: str | None = None):
    """A new request's guide through `regex` or `grammar` (one of them)."""
    if grammar is not None:
      prototype = self._matcher(grammar)
      with _llguidance_panics():
        return GrammarGuide(prototype.deep_copy(), self.vocab_size)
    return RequestGuide(self._index(regex), self.vocab_size, self.eos_ids)

  def _compile_grammar(self, text: str):
    import llguidance  # pylint: disable=import-outside-toplevel
    with _llguidance_panics():
      matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar(text), log_level=0)
      if matcher.is_error():
        raise ValueError(f'this grammar cannot be followed with the model\'s vocabulary: '
                         f'{_first_line(matcher.get_error())}')
      GrammarGuide(matcher.deep_copy(), self.vocab_size)   # its first token can be spelled
    return matcher

  def _llguidance_tokenizer(self):
    """The vocabulary as llguidance reads it (built once: about a second at 128K tokens).
    Tokens without bytes of their own (special ones, eos) are special to it: no text of
    the grammar can spell them."""
    import llguidance  # pylint: disable=import-outside-toplevel
    with self._lock:
      if isinstance(self._ll_tokenizer, str):   # once refused, always (no rescan)
        raise ValueError(self._ll_tokenizer)
      if self._ll_tokenizer is None:
        spelled = {b[0] for i, b in self._bytes.items() if len(b) == 1 and i not in self.eos_ids}
        missing = sorted(set(range(256)) - spelled)
        if missing:   # llguidance spells forced text with them; without, it goes astray
          self._ll_tokenizer = (
              'guided_grammar needs a vocabulary with a token for each of the 256 bytes '
              '(byte-level BPE, or SentencePiece with byte fallback: GPT-2, Llama, '
              f'Mistral, Qwen); this tokenizer has none for {len(missing)} of them, '
              f'{bytes(missing[:8])!r}...; use guided_regex, guided_json or guided_choice')
          raise ValueError(self._ll_tokenizer)
        with _llguidance_panics():
          self._ll_tokenizer = llguidance.LLTokenizer(
              llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer, self._bytes,
                                                      self.vocab_size, self.eos_ids)),
              n_vocab=self.vocab_size, eos_token=self.eos_ids)
      return self._ll_tokenizer


class _Vocabulary:
  """What llguidance.TokenizerWrapper reads: each token's bytes, the special ids, and
  text -> ids. It asks for str (bytes are refused, which it reads as 'str only') and
  trusts the ids to spell the text: the tokenizer's own ids where they do, else the
  longest tokens first (SentencePiece's encode adds a '▁' in front)."""

  def __init__(self, tokenizer, table: dict[int, bytes], vocab_size: int, eos_ids):
    self._tokenizer = tokenizer
    self.eos_token_id = eos_ids[0]
    self.bos_token_id = None
    plain = {i: b for i, b in table.items()
             if 0 < len(b) <= MAX_GRAMMAR_TOKEN_BYTES and i not in eos_ids}
    self.special_token_ids = [i for i in range(vocab_size) if i not in plain]
    self.tokens = [plain.get(i, f'<special {i}>'.encode()) for i in range(vocab_size)]
    self._by_bytes = {}
    for i, b in sorted(plain.items(), reverse=True):   # the lowest id of equal bytes
      self._by_bytes[b] = i
    self._longest = max(map(len, self._by_bytes), default=1)

  def __call__(self, text):
    if not isinstance(text, str):
      raise TypeError('text only')
    ids = [int(i) for i in self._tokenizer.encode(text)]
    data = text.encode('utf-8')
    if b''.join(self.tokens[i] for i in ids if i < len(self.tokens)) == data:
      return ids
    out, at = [], 0
    while at < len(data):   # every byte is a token (GuidedDecoding checks): size 1 hits
      size = next(n for n in range(min(self._longest, len(data) - at), 0, -1)
                  if data[at:at + n] in self._by_bytes)
      out.append(self._by_bytes[data[at:at + size]])
      at += size
    return out


def _first_line(message: str, limit: int = 300) -> str:
  """A library's error for a one-line message: its first line, at most `limit` chars."""
  line = message.strip().splitlines()[0] if message.strip() else 'unknown error'
  return line if len(line) <= limit else line[:limit] + '...'


class _Guide:

  _vocab_size: int

  def words(self) -> np.ndarray:
    raise NotImplementedError

  def advance(self, token: int) -> None:
    raise NotImplementedError

  def draft_words(self, draft, end_ids=()) -> list[np.ndarray]:
    """words() before a draft (speculative decoding) and after each of its tokens, up to
    the first the guide does not allow or an end id (the request would end there): one
    more entry than the draft tokens the guide follows. The guide itself does not move."""
    raise NotImplementedError

  def allowed(self) -> np.ndarray:
    """[vocab_size] bool: the tokens that keep the output a prefix of a match."""
    return unpack_bits(self.words(), self._vocab_size)


def _follow(guide: _Guide, draft, end_ids) -> list[np.ndarray]:
  """Advances `guide` through the draft (draft_words' walk); the words before and after
  each token taken."""
  out = [guide.words()]
  for token in list(draft)[:MAX_DRAFT]:
    if token in end_ids or not out[-1][token // 32] >> np.uint32(token % 32) & 1:
      break
    try:
      guide.advance(token)
    except ValueError:   # nothing can follow it: the request fails there, drafts or not
      break
    out.append(guide.words())
  return out


class RequestGuide(_Guide):
  """One request's place in its expression: the tokens allowed next, advanced per token."""

  def __init__(self, index, vocab_size: int, eos_ids: list[int]):
    from outlines_core import Guide  # pylint: disable=import-outside-toplevel
    self._guide = Guide(index, max_rollback=MAX_DRAFT)
    self._vocab_size = vocab_size
    self._eos, self._more_eos = eos_ids[0], eos_ids[1:]

  def words(self) -> np.ndarray:
    """The allowed tokens as bits: [ceil(vocab_size / 32)] uint32, token i is bit i % 32
    of word i // 32 (the sampler unpacks them on the device)."""
    words = pack_bits((), self._vocab_size)
    self._guide.write_mask_into(words.ctypes.data, words.size, 4)
    if self._more_eos and words[self._eos // 32] >> np.uint32(self._eos % 32) & 1:
      for e in self._more_eos:
        words[e // 32] |= np.uint32(1 << (e % 32))
    return words

  def advance(self, token: int) -> None:
    self._guide.advance(int(token), return_tokens=False)

  def draft_words(self, draft, end_ids=()) -> list[np.ndarray]:
    # outlines-core moves only on a token it allows (the walk takes no other), and keeps
    # MAX_DRAFT earlier states to go back to.
    out = _follow(self, draft, end_ids)
    if len(out) > 1:
      self._guide.rollback_state(len(out) - 1)
    return out

  @property
  def is_finished(self) -> bool:
    return self._guide.is_finished()


class GrammarGuide(_Guide):
  """One request's parse of its grammar (llguidance), with RequestGuide's interface. Every
  eos id is allowed wherever the grammar may end. llguidance does not raise: a parser in
  error (a grammar that needs text no token spells, a failure inside it) allows eos
  alone, which would end the request as a 'stop' that does not match. The guide raises
  ValueError instead, when made or advanced, so only its own request fails, never a step
  of the batch."""

  def __init__(self, matcher, vocab_size: int, words: np.ndarray | None = None):
    self._matcher = matcher
    self._vocab_size = vocab_size
    self._words = self._next_words() if words is None else words

  def _next_words(self) -> np.ndarray:
    words = pack_bits((), self._vocab_size)
    with _llguidance_panics():
      self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    if self._matcher.is_error():
      raise ValueError(f'the grammar\'s parser failed: '
                       f'{_first_line(self._matcher.get_error())}')
    if not words.any():
      raise ValueError('this grammar cannot be followed with the model\'s vocabulary: no '
                       'token spells what it needs next')
    return words

  def words(self) -> np.ndarray:
    return self._words

  def advance(self, token: int) -> None:
    with _llguidance_panics():
      consumed = self._matcher.consume_token(int(token))
    if not consumed:
      raise ValueError(f'token {int(token)} does not follow the grammar: '
                       f'{_first_line(self._matcher.get_error())}')
    self._words = self._next_words()

  def draft_words(self, draft, end_ids=()) -> list[np.ndarray]:
    # On a copy of the parser: a token it takes and then cannot go on from leaves
    # llguidance in an error state that rollback cannot undo.
    with _llguidance_panics():
      probe = GrammarGuide(self._matcher.deep_copy(), self._vocab_size, self._words)
    return _follow(probe, draft, end_ids)

  @property
  def is_finished(self) -> bool:
    return self._matcher.is_stopped()
