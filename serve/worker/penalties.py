"""The penalties' token history, kept on the device per request and updated by new tokens.

The repetition penalty reads every token a request has seen (prompt and output), the
frequency and presence penalties how often its output has each token. Rebuilt from the
token lists every step, that history costs host time growing with the context and a
sampling program per history width. Here each request holds a slot of a table instead:

  seen    [slots, vocab] bool    the prompt or the output has the token  (repetition)
  counts  [slots, vocab] int32   times the output has the token          (frequency, presence)

A step sends the tokens output since the request's last step only (one scatter per table,
its length bucketed), and the sampling program gathers its rows' slots. A row sampled
after a draft prefix (`ahead`, speculative decoding) adds the prefix inside the program;
nothing of it is stored, so rejected draft tokens never reach a table.

Memory: seen takes a byte a token (256 slots x 152K vocab: 37 MiB; bits would take an
eighth, but a scatter cannot OR bits into a word), counts four (a long output can repeat
a token past int16's range): 148 MiB at 256 slots, so only requests with a frequency or
presence penalty take a counts slot. A table starts at MIN_SLOTS and doubles when one step
needs more requests than it holds (a new shape, so a new program: the engine reserves
max_num_seqs at warm-up); before growing, a request absent from the step gives up its slot
(the least recently used), to be counted again from its lists if it comes back.

A request is its id and its two lists (the request's own, not copies): each step counts
output_ids[counted:]. Output only grows while a request runs; where it was cut short
(tokens never output) or the lists are others (an id reused), it is counted afresh.
"""

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MIN_SLOTS = 8
MIN_AHEAD = 8   # the narrowest draft-prefix width: plain decoding and drafts up to 8
CLEARS = 8      # slots an update zeroes (padded): a count of its own would be a shape
PAIR_BUCKETS = (64, 256, 1024, 4096, 16384)   # (slot, token) pairs an update scatters


class PenaltyRow(NamedTuple):   # a tuple: the engine makes one per row and step
  """One sampled row's request: its id, its prompt and output token lists, and the draft
  tokens the row is sampled after (as if output already)."""
  request_id: str
  prompt_ids: Sequence[int]
  output_ids: Sequence[int]
  ahead: Sequence[int] = ()


@dataclasses.dataclass
class _Slot:
  index: int
  prompt: Sequence[int]   # the lists it counted, by identity
  output: Sequence[int]
  counted: int            # output tokens in the table
  used: int               # the last step that read it


def pair_bucket(n: int) -> int:
  """The scatter length of n pairs: the smallest bucket holding them (n <= the last)."""
  return next(b for b in PAIR_BUCKETS if b >= n)


@functools.partial(jax.jit, donate_argnums=0)
def _update(table, clear, slots, tokens):
  """table with the rows `clear` zeroed, then each (slot, token) pair counted (a bool
  table: set). Padding is an index past the end (clear, slots) or vocab (tokens): dropped;
  a negative one would wrap onto the last row."""
  table = table.at[clear].set(jnp.zeros((), table.dtype), mode='drop')
  if table.dtype == jnp.bool_:
    return table.at[slots, tokens].set(True, mode='drop')
  return table.at[slots, tokens].add(1, mode='drop')


@functools.partial(jax.jit, static_argnames='capacity')
def _grown(table, capacity):
  return jnp.zeros((capacity, table.shape[1]), table.dtype).at[:table.shape[0]].set(table)


class _Table:
  """One [slots, vocab] table: a slot per request id; the host side knows what each slot
  counted, the device side holds the counts."""

  def __init__(self, dtype, with_prompt: bool):
    self.dtype, self.with_prompt = dtype, with_prompt
    self.array = None   # [capacity, vocab] once a request needs it
    self.capacity = 0
    self.slots: dict[str, _Slot] = {}
    self._free: list[int] = []
    self._clear: list[int] = []
    self._pair_slots: list[int] = []
    self._pair_tokens: list[int] = []

  def reserve(self, capacity: int) -> None:
    """Room for `capacity` requests (a power of two >= MIN_SLOTS) from now on."""
    new = max(MIN_SLOTS, 1 << max(0, capacity - 1).bit_length())
    if new > self.capacity:
      self._free = list(range(new - 1, self.capacity - 1, -1)) + self._free
      self.capacity = new

  def release(self, request_id: str) -> None:
    slot = self.slots.pop(request_id, None)
    if slot is not None:
      self._free.append(slot.index)

  def slot(self, row: PenaltyRow, step: int) -> int:
    """row's request's slot, its tokens since its last step queued for the update."""
    slot = self.slots.get(row.request_id)
    if slot is None or slot.used != step:   # else a later row of the request: counted
      output = row.output_ids
      if (slot is None or slot.prompt is not row.prompt_ids or slot.output is not output
          or len(output) < slot.counted):
        slot = self._assign(row, step)
      if len(output) > slot.counted:
        self._queue(slot.index, output[slot.counted:])
      slot.counted, slot.used = len(output), step
    return slot.index

  def _assign(self, row: PenaltyRow, step: int) -> _Slot:
    """A zeroed slot for row's request, holding its prompt where this table counts it."""
    old = self.slots.pop(row.request_id, None)
    index = old.index if old is not None else self._take(step)
    self._clear.append(index)
    slot = self.slots[row.request_id] = _Slot(index, row.prompt_ids, row.output_ids, 0, step)
    if self.with_prompt:
      self._queue(index, row.prompt_ids)
    return slot

  def _take(self, step: int) -> int:
    if not self._free:
      idle = [s for s in self.slots.items() if s[1].used < step]
      if idle:
        request_id, _ = min(idle, key=lambda s: s[1].used)
        self.release(request_id)
      else:
        self.reserve(2 * self.capacity)
    return self._free.pop()

  def _queue(self, index: int, tokens: Sequence[int]) -> None:
    self._pair_slots.extend([index] * len(tokens))
    self._pair_tokens.extend(tokens)

  def flush(self, vocab_size: int) -> jax.Array:
    """Applies the queued clears and pairs; the table as the sampling program reads it."""
    self._allocate(vocab_size)
    clears, slots, tokens = self._clear, self._pair_slots, self._pair_tokens
    self._clear, self._pair_slots, self._pair_tokens = [], [], []
    if not clears and not slots:
      return self.array
    step = PAIR_BUCKETS[-1]
    clear_chunks = [clears[i:i + CLEARS] for i in range(0, len(clears), CLEARS)] or [[]]
    pair_chunks = [(slots[i:i + step], tokens[i:i + step])
                   for i in range(0, len(slots), step)] or [([], [])]
    # Every clear before any pair: the last clears ride with the first pairs.
    for clear in clear_chunks[:-1]:
      self._apply(clear, [], [], vocab_size)
    self._apply(clear_chunks[-1], *pair_chunks[0], vocab_size)
    for chunk in pair_chunks[1:]:
      self._apply([], *chunk, vocab_size)
    return self.array

  def _allocate(self, vocab_size: int) -> None:
    if self.array is None:
      self.reserve(MIN_SLOTS)
      self.array = jnp.zeros((self.capacity, vocab_size), self.dtype)
    elif self.array.shape[1] != vocab_size:
      raise ValueError(f'penalties: vocab_size {vocab_size} differs from the '
                       f'{self.array.shape[1]} this state was built for; use one state '
                       'per vocabulary.')
    if self.array.shape[0] < self.capacity:
      self.array = _grown(self.array, capacity=self.capacity)

  def _apply(self, clear, slots, tokens, vocab_size: int) -> None:
    width = pair_bucket(len(slots))
    clear_ids = np.full(CLEARS, self.capacity, np.int32)
    clear_ids[:len(clear)] = clear
    pair_slots = np.full(width, self.capacity, np.int32)
    pair_slots[:len(slots)] = slots
    pair_tokens = np.full(width, vocab_size, np.int32)
    pair_tokens[:len(tokens)] = tokens
    self.array = _update(self.array, clear_ids, pair_slots, pair_tokens)

  def warm(self, vocab_size: int) -> None:
    """Compiles the update for every pair bucket (writing nothing)."""
    self._allocate(vocab_size)
    for width in PAIR_BUCKETS:
      self._apply([], [self.capacity] * width, [vocab_size] * width, vocab_size)


class PenaltyState:
  """The seen and counts tables of the requests that sample with penalties."""

  def __init__(self):
    self.seen = _Table(jnp.bool_, with_prompt=True)
    self.counts = _Table(jnp.int32, with_prompt=False)
    self.ahead_width = MIN_AHEAD
    self._step = 0
    self._released: list[str] = []

  def reserve(self, max_requests: int, vocab_size: int, max_ahead: int = 0,
              repetition: bool = True, counts: bool = False) -> None:
    """Sizes the tables the given penalties use for max_requests requests a step and
    drafts up to max_ahead tokens, and compiles their updates: after it, steps within
    those bounds compile nothing here (the engine's warm-up)."""
    self.ahead_width = max(self.ahead_width, _ahead_bucket(max_ahead))
    for table, wanted in ((self.seen, repetition), (self.counts, counts)):
      if wanted:
        table.reserve(max_requests)
        table.warm(vocab_size)

  def release(self, request_id: str) -> None:
    """The request ended: its slots go back at the next step (safe from any thread)."""
    if request_id in self.seen.slots or request_id in self.counts.slots:
      self._released.append(request_id)

  def arrays(self, params, rows: Sequence[PenaltyRow], padded_rows: int,
             vocab_size: int) -> dict:
    """adjusted_logits' penalty arguments for this step's rows (params[i] is rows[i]'s),
    padded to padded_rows: the tables, each row's slot (the table's length: none), and
    each row's draft prefix [padded_rows, ahead_width] (vocab: padding)."""
    self._step += 1
    while self._released:
      request_id = self._released.pop()
      self.seen.release(request_id)
      self.counts.release(request_id)
    step, seen_slot, count_slot = self._step, self.seen.slot, self.counts.slot
    seen, counts = [-1] * padded_rows, [-1] * padded_rows
    for i, (p, row) in enumerate(zip(params, rows)):   # the host's work per row: keep lean
      if p.repetition_penalty != 1:
        seen[i] = seen_slot(row, step)
      if p.presence_penalty or p.frequency_penalty:   # p.counts_output
        counts[i] = count_slot(row, step)
    out = {}
    for name, table, slots in (('seen', self.seen, seen), ('count', self.counts, counts)):
      slots = np.asarray(slots, np.int32)
      if (slots >= 0).any():
        out[f'{name}_table'] = table.flush(vocab_size)
        out[f'{name}_slot'] = np.where(slots < 0, table.capacity, slots).astype(np.int32)
    if out:
      out['ahead'] = self._ahead(rows, padded_rows, vocab_size)
    return out

  def _ahead(self, rows, padded_rows: int, vocab_size: int) -> np.ndarray:
    longest = max(len(row.ahead) for row in rows)
    self.ahead_width = max(self.ahead_width, _ahead_bucket(longest))
    ahead = np.full((padded_rows, self.ahead_width), vocab_size, np.int32)
    if longest:
      for i, row in enumerate(rows):
        ahead[i, :len(row.ahead)] = row.ahead
    return ahead


def _ahead_bucket(n: int) -> int:
  return max(MIN_AHEAD, 1 << max(0, n - 1).bit_length())


def stored_rows(table, slot, ahead):
  """Each row's table row (slot == len(table): none, zeros) with its draft prefix `ahead`
  [N, A] added (bool tables: set; ids >= vocab: padding) where it has a slot."""
  has = (slot < table.shape[0])[:, None]
  base = jnp.take(table, slot, axis=0, mode='fill', fill_value=0)
  rows = jnp.arange(slot.shape[0])[:, None]
  if table.dtype == jnp.bool_:
    extra = jnp.zeros(base.shape, jnp.bool_).at[rows, ahead].set(True, mode='drop')
    return base | (extra & has)
  extra = jnp.zeros(base.shape, base.dtype).at[rows, ahead].add(1, mode='drop')
  return base + jnp.where(has, extra, 0)
