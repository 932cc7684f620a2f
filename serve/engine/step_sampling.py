"""A step's rows to tokens: each live request's rows with their constraints, one sampler
call over the step laid out by StepRows (or the step's own argmax when every row is
plain greedy), and each draft accepted up to its first row whose token differs."""

import numpy as np

from serve.engine.outputs import TokenLogprob
from serve.engine.step_rows import PADDING, RequestRows, StepRows
from serve.engine.tracked import TrackedRequest
from serve.worker.sampler import PenaltyRow, SampleResult, Sampler


def request_rows(t: TrackedRequest, r: RequestRows, eos_token_ids) -> list[tuple]:
  """One request's rows as the sampler takes them: (params, step, PenaltyRow, banned,
  allowed) each."""
  # Row j is sampled as if the draft's first j tokens were output already; a guide
  # follows the draft as far as it allows (later rows are not taken).
  if t.guide is not None and r.draft:
    try:
      r.guided = t.guide.draft_words(r.draft, eos_token_ids)
    except ValueError:   # the guide could not look ahead: no draft token is taken
      r.guided = [t.guide.words()]
  req, rows = t.request, []
  for j in range(len(r)):
    ahead = r.draft[:j]
    banned, allowed = t.constraints(ahead, r.guided and r.guided[min(j, r.usable)])
    penalty = PenaltyRow(req.request_id, req.prompt_token_ids, req.output_token_ids, ahead)
    rows.append((req.sampling_params, req.num_output_tokens + j, penalty, banned, allowed))
  return rows


def sample_rows(row_sampler: Sampler, step, layout: StepRows, inputs: dict,
                vocab_size: int) -> SampleResult:
  """Every row of the step, each live request's at its own place, the others padding."""
  padding = (PADDING, 0, PenaltyRow('', (), ()), [], None)   # PADDING: no penalty
  rows = layout.per_row(lambda r, j: inputs[r.request_id][j], padding)
  params, steps, requests, banned, allowed = map(list, zip(*rows))
  if (all(p.greedy and p.logprobs is None and not p.adjusts_logits for p in params)
      and not any(banned) and all(a is None for a in allowed)):
    # The step's own argmax: the token the sampler would pick, without its program.
    return SampleResult(np.asarray(step.greedy)[:len(rows)], None, [None] * len(rows))
  return row_sampler(step.logits, params, steps, vocab_size, banned=banned, allowed=allowed,
                     requests=requests)


def accept(layout: StepRows, res: SampleResult, tracked: dict):
  """Each request's draft up to its first row whose token differs, and that token."""
  tokens, logprobs = {}, {}
  for r in layout:
    rid = r.request_id
    want = tracked[rid].request.sampling_params.logprobs is not None
    accepted, scored = [], []
    for j in range(len(r)):
      row = r.row(j)
      token = int(res.token_ids[row])
      accepted.append(token)
      if want:
        top = res.top_logprobs[row] if res.top_logprobs is not None else None
        scored.append(TokenLogprob(token, float(res.logprobs[row]), top,
                                   int(res.ranks[row])))
      if j == r.usable or token != r.draft[j]:
        break
    tokens[rid] = accepted
    if want:
      logprobs[rid] = scored
  return tokens, logprobs
