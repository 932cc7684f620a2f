"""Streaming text from streaming token ids: whole characters, word spacing kept, stop strings cut.

Decoding tokens one at a time loses what a token means in context (SentencePiece drops the
space of a word-initial token; a UTF-8 character may span several byte tokens). So each
step decodes a short window twice, as vLLM does:

    ids:    ... | prefix ........ read ........ end |
    emit  decode(ids[prefix:end]) minus decode(ids[prefix:read])

and waits while the window's text ends in U+FFFD (an incomplete character). The first
window starts a few prompt tokens back, so the first output token's spacing is right, and
at the first byte of a character: a byte-fallback decoder (Mistral, Llama-2, Gemma) turns
a whole run of byte tokens into U+FFFD when the run begins inside a character, and the
output's first characters would go with it.

Stop strings: text that could still become a stop string is held back; when one completes,
the text before it (with it, if include_stop) is the last piece. The stop that completes
first wins (the longest, if several end at the same character), so the result does not
depend on how the text was split into tokens. With min_tokens (vLLM's), no stop string
may end in the text decoded up to the min_tokens-th output token; one that begins there
and ends later counts, as in vLLM.

The pieces (and `text`, their concatenation) equal the full decode of the output cut at
the stop, with one exception: a byte-fallback decoder (Llama-2, Mistral) turns a run of
byte tokens that is not valid UTF-8 into one U+FFFD per byte, so a bad byte can rewrite
text already shown. Final texts should therefore be `text`, so a stream and a
non-streamed answer always agree.
"""

PROMPT_CONTEXT = 5      # prompt tokens decoded ahead of the output (vLLM uses 5 too)
UTF8_MAX_BYTES = 4      # so a character's first byte is at most 3 byte tokens back
REPLACEMENT = '\ufffd'  # what decoders put for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
  """Feed output token ids one at a time; get back text safe to show."""

  def __init__(self, tokenizer, prompt_ids, stop: list[str], include_stop: bool = False,
               min_tokens: int = 0, skip_special_tokens: bool = True):
    self._tokenizer = tokenizer
    self._skip_special = skip_special_tokens
    self._unchecked = min_tokens        # tokens still to come whose text no stop may end
    self._ids = _prompt_context(tokenizer, prompt_ids, skip_special_tokens)
    self._prefix, self._read = 0, len(self._ids)
    self._stop = list(stop)
    self._include_stop = include_stop
    self._held = ''                     # decoded text that may be the start of a stop string
    self.text = ''                      # everything emitted so far
    self.stop_matched: str | None = None
    self.finished = False

  def add(self, token_id: int) -> tuple[str, str | None]:
    """(new text to emit, the stop string matched or None). After a stop, adds are ignored."""
    if self.finished:
      return '', None
    self._ids.append(int(token_id))
    if self._unchecked > 0:
      self._unchecked -= 1
      return self._scan(self._decode_new(final=False), match=False)
    return self._scan(self._decode_new(final=False))

  def flush(self) -> str:
    """At the end without a stop: the held-back text, an incomplete character as U+FFFD.

    A stop string can still match here (one that ends in that U+FFFD): see stop_matched.
    """
    if self.finished:
      return ''
    piece, _ = self._scan(self._decode_new(final=True))
    if not self.finished:
      piece += self._emit(self._held)
      self._held, self.finished = '', True
    return piece

  def _decode_new(self, final: bool) -> str:
    before = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip_special)
    after = self._tokenizer.decode(self._ids[self._prefix:], self._skip_special)
    if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
      return ''        # nothing new yet, or a character still incomplete: wait for more
    self._prefix, self._read = self._read, len(self._ids)
    del self._ids[:self._prefix]        # what is left of the window; keeps adds O(window)
    self._prefix, self._read = 0, self._read - self._prefix
    return after[len(before):]

  def _scan(self, new: str, match: bool = True) -> tuple[str, str | None]:
    """Emits `new` after the held text, but for a tail that may begin a stop string; with
    match, a completed stop string ends the output."""
    text = self._held + new
    match = first_stop(text, self._stop) if match else None
    if match is not None:
      start, stop = match
      self._held, self.finished, self.stop_matched = '', True, stop
      return self._emit(text[:start + len(stop) if self._include_stop else start]), stop
    keep = _stop_prefix_len(text, self._stop)
    self._held = text[len(text) - keep:]
    return self._emit(text[:len(text) - keep]), None

  def _emit(self, piece: str) -> str:
    self.text += piece
    return piece


def _prompt_context(tokenizer, prompt_ids, skip_special_tokens: bool) -> list[int]:
  """The prompt's last PROMPT_CONTEXT ids, or up to 3 more where those begin inside a
  character (their text starts with U+FFFD)."""
  tail = [int(t) for t in list(prompt_ids)[-(PROMPT_CONTEXT + UTF8_MAX_BYTES - 1):]]
  first = max(len(tail) - PROMPT_CONTEXT, 0)
  for start in range(first, -1, -1):
    if not tokenizer.decode(tail[start:], skip_special_tokens).startswith(REPLACEMENT):
      return tail[start:]
  return tail[first:]    # no character starts there (ids that are not text): as given


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
  """(start, stop) of the stop string that completes first in text, or None."""
  found = [(i + len(s), -len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
  if not found:
    return None
  _, _, start, stop = min(found)
  return start, stop


def _stop_prefix_len(text: str, stops: list[str]) -> int:
  """Length of the longest tail of text that is a proper prefix of some stop string."""
  longest = max((len(s) - 1 for s in stops), default=0)
  for k in range(min(longest, len(text)), 0, -1):
    tail = text[-k:]
    if any(s.startswith(tail) for s in stops):
      return k
  return 0
