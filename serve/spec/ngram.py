"""Speculative decoding by n-gram lookup (vLLM's `speculative_config` method "ngram").

A running request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
are looked up earlier in its own prompt and output; the tokens that followed their most
recent earlier occurrence are the draft, up to num_speculative_tokens of them. The engine
feeds the draft behind the request's last token in one step, samples every row, and keeps
the draft up to the first row whose sampled token differs from it, plus that row's token
(or, all accepted, the row after the last draft's).

The draft is one fixed token per row, so this is exact rejection sampling: with q the
draft's one-hot distribution, accepting with probability min(1, p(d) / q(d)) = p(d) and
resampling from p without d on rejection is the same as drawing x ~ p and accepting iff
x == d. Each row is sampled as if the draft before it were already output (penalties,
min_tokens, bad words, a structured-output guide (advanced through the draft, then taken
back) and a seeded request's per-position key all see that), so outputs are those of
plain decoding: a greedy or seeded request gives the same tokens either way.
"""

import numpy as np


def propose_ngram(tokens, num_tokens: int, lookup_min: int, lookup_max: int) -> list[int]:
  """Up to num_tokens draft tokens for a sequence ending in `tokens`' last token.

  The longest suffix of n tokens (lookup_max down to lookup_min) that occurs earlier in
  `tokens`: the tokens after its latest earlier occurrence. Where those run out (the
  occurrence overlaps the suffix: a repeating pattern) the draft continues with its own
  tokens, so the pattern keeps repeating. [] when no suffix recurs. One pass over the
  tokens finds where the last token occurred before; only those places are checked
  further back."""
  tokens = np.asarray(tokens)
  size = len(tokens)
  if num_tokens < 1 or size < 2:
    return []
  ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1])   # earlier occurrences' ends
  for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
    hits = ends[ends >= n - 1]
    for back in range(1, n):
      if not hits.size:
        break
      hits = hits[tokens[hits - back] == tokens[size - 1 - back]]
    if hits.size:
      start = int(hits[-1]) + 1
      draft = tokens[start:start + num_tokens].tolist()
      for i in range(len(draft), num_tokens):   # start + i >= size: the period again
        draft.append(draft[start + i - size])
      return draft
  return []


class TokenHistory:
  """A running request's tokens as one int32 array, extended by the outputs appended
  since the last call (so a step's lookup does not rebuild a list of the whole
  sequence)."""

  def __init__(self, prompt):
    self._buf = np.asarray(prompt, np.int32)
    self._len = len(self._buf)
    self._num_prompt = self._len

  def tokens(self, outputs: list[int]) -> np.ndarray:
    """The prompt and `outputs` (the request's output_token_ids, only ever grown)."""
    total = self._num_prompt + len(outputs)
    if total > len(self._buf):
      grown = np.empty(max(total, 2 * len(self._buf)), np.int32)
      grown[:self._len] = self._buf[:self._len]
      self._buf = grown
    if total > self._len:
      self._buf[self._len:total] = outputs[self._len - self._num_prompt:]
    self._len = total
    return self._buf[:total]
