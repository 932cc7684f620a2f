"""The engine's side of a live request: its stream, detokenizer, metrics, guide and bans,
and the constraints its next rows are sampled under."""

import dataclasses

import numpy as np

from serve.engine.constraints import any_left, banned_by_words, not_yet
from serve.engine.detokenizer import IncrementalDetokenizer
from serve.engine.outputs import RequestMetrics
from serve.engine.request import Request
from serve.engine.stream import RequestStream
from serve.spec.ngram import TokenHistory


@dataclasses.dataclass
class TrackedRequest:
  """The engine's side of a live request."""
  request: Request
  stream: RequestStream
  detok: IncrementalDetokenizer
  metrics: RequestMetrics
  # Asked-for prompt logprobs gathered so far, [None] + one per prompt token scored.
  prompt_logprobs: list | None = None
  guide: object = None   # guided.RequestGuide or GrammarGuide of a structured-output request
  allowed: np.ndarray | None = None   # allowed_token_ids as the sampler's bits
  bad_words: list = dataclasses.field(default_factory=list)   # bad_word_ids of the request
  history: TokenHistory | None = None   # its tokens as an array, for n-gram drafts
  emitted_step: int = -1   # the engine's _emit_count when its last token went out

  def constraints(self, draft=(), guided=None) -> tuple[list[int], np.ndarray | None]:
    """(banned ids, allowed bits or None) for this step, or for the row after `draft`
    (whose guide words are `guided`, from the guide's draft_words): min_tokens' and
    bad_words' bans; the guide's or allowed_token_ids' set. Bans that would leave nothing
    allowed give way, bad words first (a guide only a barred word can continue, or a
    list of end ids before min_tokens): the request goes on rather than draw outside its
    set."""
    if self.guide is not None:
      allowed = self.guide.words() if guided is None else guided
    else:
      allowed = self.allowed
    early = not_yet(self.request, len(draft))
    words = (banned_by_words(self.bad_words, self.request.output_token_ids + list(draft))
             if self.bad_words else [])
    if allowed is None:
      return early + words, None
    for banned in (early + words, early):
      if any_left(allowed, banned):
        return banned, allowed
    return [], allowed
