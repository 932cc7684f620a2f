"""One step's sampled rows, keyed by request id: the one layout the runner's logits, the
sampler, the guides, speculative acceptance and emission all read.

The runner returns a logits row for the last known token of every sampling chunk, and
one more per draft token after it, in chunk order (model_runner.ModelRunner.build_batch):

  chunks    a           b, draft (d1, d2)      c
  rows      0           1    2    3            4
                        row 1 + j is sampled as if d1..dj were output already

Built once, right after schedule(). A request that fails later in the step (while the
previous step's outputs go out, which overlaps this step's device work; or while its own
rows are prepared) is dropped: its rows stay where they are and are sampled as padding,
so no other request's row moves.
"""

import dataclasses

from serve.sampling_params import SamplingParams

# What a dropped request's rows are sampled with: greedy, seeded (draws nothing from the
# sampler's generator) and adjusting nothing, so they change no other row's program.
PADDING = SamplingParams(temperature=0.0, seed=0)


@dataclasses.dataclass(slots=True)
class RequestRows:
  """One request's rows in the step's logits."""
  request_id: str
  first: int                    # its first row: the one after its last known token
  draft: tuple[int, ...]        # the draft tokens its later rows verify
  # The guide's allowed words after each draft prefix (guide.draft_words), or None: a
  # guide follows the draft only as far as it allows, and only those rows are taken.
  guided: list | None = None

  @property
  def usable(self) -> int:
    """Draft tokens that may be accepted: the whole draft, or as far as the guide goes."""
    return len(self.draft) if self.guided is None else len(self.guided) - 1

  def row(self, j: int) -> int:
    return self.first + j

  def __len__(self) -> int:
    return 1 + len(self.draft)


class StepRows:
  """The sampled rows of one scheduler output, by request id, in row order."""

  def __init__(self, chunks):
    self._by_id: dict[str, RequestRows] = {}
    row = 0
    for c in chunks:
      if c.sample:
        self._by_id[c.request_id] = RequestRows(c.request_id, row, tuple(c.spec_token_ids))
        row += 1 + len(c.spec_token_ids)
    self.num_rows = row

  def __iter__(self):
    return iter(list(self._by_id.values()))

  def __len__(self) -> int:
    return len(self._by_id)

  def __contains__(self, request_id: str) -> bool:
    return request_id in self._by_id

  def drop(self, request_id: str) -> None:
    """The request left the step: its rows become padding, nobody else's move."""
    self._by_id.pop(request_id, None)

  def keep(self, live) -> None:
    """Drops every request not in `live` (a container of request ids)."""
    for rid in [rid for rid in self._by_id if rid not in live]:
      self.drop(rid)

  def per_row(self, value, padding) -> list:
    """[num_rows] of value(request rows, j) for each request's row j, padding elsewhere."""
    out = [padding] * self.num_rows
    for r in self._by_id.values():
      for j in range(len(r)):
        out[r.row(j)] = value(r, j)
    return out
