"""Tokenizers: raw UTF-8 bytes, or a local Hugging Face `tokenizer.json`.

Both give `encode(text, add_special_tokens=False) -> int32 ids` (special tokens: what a
Hugging Face tokenizer.json's post-processor adds, a BOS for Llama; the byte tokenizer adds
none), `decode(ids) -> str`, `vocab_size`, `eos_id` and a
`name` that is stable across runs; token files record the name so that training refuses
tokens written by a different tokenizer.
"""

import functools
import hashlib
import os
from typing import Sequence

import numpy as np

# Tried in order: GPT-2/Qwen, Llama-3, Llama-2/Mistral, Gemma.
EOS_CANDIDATES = ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>')


class ByteTokenizer:
  """ids 0..255 are the UTF-8 bytes of the text; 256 ends a document."""

  name = 'byte'
  eos_id = 256
  vocab_size = 257

  def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
    del add_special_tokens   # none to add
    return np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def special_tokens_around(self, text: str) -> tuple[int, int]:
    del text
    return 0, 0   # none added

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    del skip_special_tokens   # eos has no text
    ids = np.asarray(ids).reshape(-1)
    data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
    return data.decode('utf-8', errors='replace')


class HFTokenizer:
  """A `tokenizers.Tokenizer` read from a local tokenizer.json (no downloads)."""

  def __init__(self, path: str, eos: str | int | None = None):
    """eos: the end-of-document token or id, when the model names it (a served Hugging
    Face model's tokenizer_config.json); None: the first of EOS_CANDIDATES present."""
    import tokenizers  # pylint: disable=import-outside-toplevel
    with open(path, 'rb') as f:
      digest = hashlib.sha256(f.read()).hexdigest()[:12]
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # pylint: disable=broad-except
      # The Rust side raises a bare Exception ('EOF while parsing a value', ...).
      raise ValueError(f'{path} is not a Hugging Face tokenizer.json ({e}): pass `byte` or '
                       'the tokenizer.json saved with the model.') from None
    self.path = path
    self.name = f'hf-{digest}'
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._find_eos(eos)

  def _find_eos(self, eos: str | int | None) -> int:
    if isinstance(eos, int) and 0 <= eos < self.vocab_size:
      return eos
    if isinstance(eos, str) and self._tok.token_to_id(eos) is not None:
      return self._tok.token_to_id(eos)
    if eos is not None:
      raise ValueError(f'{self.path} has no token {eos!r}, named as the end-of-sequence '
                       'token: fix eos_token in tokenizer_config.json or eos_token_id.')
    for token in EOS_CANDIDATES:
      token_id = self._tok.token_to_id(token)
      if token_id is not None:
        return token_id
    raise ValueError(
        f'{self.path} has none of the end-of-document tokens {EOS_CANDIDATES}: documents '
        'could not be separated. Add one of them to the tokenizer as a special token.')

  def token_text(self, token_id: int) -> str:
    """A token's own text in tokenizer.json (a special token's name, as eos_token wants)."""
    return self._tok.id_to_token(token_id)

  def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
    # Training wants none: documents are delimited by the eos the token file adds. A
    # served completion prompt wants them (a Llama's BOS), as transformers and vLLM add.
    ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
    return np.asarray(ids, np.int32)

  def special_tokens_around(self, text: str) -> tuple[int, int]:
    """How many special tokens encode(text, add_special_tokens=True) puts before and
    after the text's own (a Llama's BOS: (1, 0))."""
    bare = self.encode(text).tolist()
    full = self.encode(text, add_special_tokens=True).tolist()
    extra = len(full) - len(bare)
    for pre in range(max(extra, 0) + 1):
      if full[pre:pre + len(bare)] == bare:
        return pre, extra - pre
    return 0, 0

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, np.int32) for e in encodings]

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    ids = np.asarray(ids).reshape(-1)
    ids = ids[(ids >= 0) & (ids < self.vocab_size)]
    return self._tok.decode(ids.tolist(), skip_special_tokens=skip_special_tokens)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> Tokenizer:
  """'byte', or a path (`~` allowed) to a Hugging Face tokenizer.json."""
  if spec == 'byte':
    return ByteTokenizer()
  path = os.path.expanduser(spec)
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f'data.tokenizer={spec!r}: no such file. Set --config.data.tokenizer=byte, or to '
        'the path of a local Hugging Face tokenizer.json.')
  return HFTokenizer(path)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte <-> printable character table (ByteLevel pre-tokenizer and decoder)."""
  printable = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
               + list(range(ord('®'), ord('ÿ') + 1)))
  table, extra = {b: chr(b) for b in printable}, 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table
