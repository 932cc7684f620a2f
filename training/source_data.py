"""Batches from a function (data.source): synthetic or in-memory data for a user model.

The function makes global batch `index` from (seed, index, batch_size) alone, so the
position is one integer: it resumes exactly onto any mesh and any number of processes,
each process keeping the rows its devices own.
"""

import numpy as np

from training import user_model


class SourceIterator:
  """Rows [lo, hi) of batch 0, 1, 2, ... of data.source; get_state/set_state as grain's."""

  def __init__(self, source: str, *, seed: int, batch_size: int, rows=None):
    self._fn = user_model.load(source, 'data.source')
    self._seed, self._batch_size = seed, batch_size
    self._rows = rows or (0, batch_size)
    self._index = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = self._fn(self._seed, self._index, self._batch_size)
    self._index += 1
    lo, hi = self._rows
    out = {k: np.asarray(v)[lo:hi] for k, v in batch.items()}
    if 'weights' not in out:
      raise ValueError("data.source's batches need a 'weights' array (one weight per "
                       'example, or per token): the loss is their weighted mean.')
    return out

  def get_state(self) -> dict:
    return {'index': self._index}

  def set_state(self, state: dict) -> None:
    self._index = int(state['index'])

  def close(self) -> None:
    pass
