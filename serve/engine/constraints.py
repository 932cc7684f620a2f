"""What a request may not draw this step: before min_tokens its end tokens, and the last
token of any bad word its output would complete (vLLM's bad_words)."""

import numpy as np

from serve.engine.request import Request
from serve.sampling_params import SamplingParamsError


def not_yet(req: Request, ahead: int = 0) -> list[int]:
  """The tokens the request may not draw `ahead` tokens from now: before min_tokens, its
  eos and stop ids."""
  if req.num_output_tokens + ahead >= req.sampling_params.min_tokens:
    return []
  return req.end_token_ids


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
  """vLLM's bad_words as token sequences: each word as written (leading spaces dropped)
  and, where the tokenizer spells it differently after a space (a new word), that way
  too."""
  out = []
  for word in words:
    alone = tokenizer.encode(word.lstrip()).tolist()
    spaced = tokenizer.encode(' ' + word.lstrip()).tolist()
    if not alone:
      raise SamplingParamsError('bad_words', f'{word!r} is no token of this tokenizer; leave '
                                'it out.')
    out.append(alone)
    if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
      out.append(spaced)
  return out


def banned_by_words(sequences: list[list[int]], output: list[int]) -> list[int]:
  """The tokens that would complete a bad word now: each sequence's last token where the
  output ends with the rest of it (a one-token word always)."""
  return [seq[-1] for seq in sequences
          if len(seq) <= len(output) + 1 and output[len(output) - len(seq) + 1:] == seq[:-1]]


def any_left(words: np.ndarray, banned: list[int]) -> bool:
  """Whether the tokens set in words (bits) are not all in banned."""
  if not banned:
    return bool(words.any())
  left = words.copy()
  ids = np.asarray(banned, np.int64)
  np.bitwise_and.at(left, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
  return bool(left.any())
