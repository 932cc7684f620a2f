"""Prompt logprobs: which prompt token each row of a step's chunks predicts, and the
scores the runner returns for them appended to each request, in prompt order. Keyed by
request id (`tracked`: id -> TrackedRequest), so a request gone meanwhile is skipped."""

import jax
import numpy as np

from serve.engine.outputs import TokenLogprob
from serve.sampling_params import MAX_LOGPROBS


def prompt_targets(chunks, tracked: dict, vocab_size: int):
  """Per chunk, the prompt token each of its rows predicts (-1: none), or None for
  chunks whose request wants no prompt logprobs (no list at all when no chunk does);
  and the top-N width (0 or the most)."""
  targets, top = [], 0
  for c in chunks:
    t = tracked.get(c.request_id)
    want = t is not None and t.prompt_logprobs is not None
    prompt = t.request.prompt_token_ids if want else ()
    # (a preempted request recomputes its prompt: positions it has are not scored again)
    first = max(c.start_position + 1, len(t.prompt_logprobs) if want else 0)
    if not want or first >= min(len(prompt), c.start_position + 1 + len(c.token_ids)):
      targets.append(None)
      continue
    nxt = np.arange(c.start_position + 1, c.start_position + 1 + len(c.token_ids))
    scored = (nxt >= first) & (nxt < len(prompt))
    targets.append(np.where(scored, np.asarray(prompt)[np.minimum(nxt, len(prompt) - 1)],
                            -1))
    top = max(top, t.request.sampling_params.prompt_logprobs)
  if all(t is None for t in targets):
    return None, 0
  return targets, min(MAX_LOGPROBS, vocab_size) if top else 0


def gather(chunks, targets, scores, tracked: dict) -> None:
  """Appends each scored chunk's entries to its request, in prompt order (its scored
  rows are consecutive positions from the first it lacks: prompt_targets)."""
  target, rank, top = jax.device_get(scores)
  row = 0
  for c, want in zip(chunks, targets):
    t = tracked.get(c.request_id)
    if want is not None and t is not None:
      count = t.request.sampling_params.prompt_logprobs
      for k in np.flatnonzero(want >= 0) + row:
        pairs = ([(int(i), float(v)) for i, v in zip(top[1][k, :count], top[0][k, :count])]
                 if count else [])
        t.prompt_logprobs.append(TokenLogprob(int(want[k - row]), float(target[k]), pairs,
                                              int(rank[k])))
    row += len(c.token_ids)
