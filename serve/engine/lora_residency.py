"""Which loaded LoRA adapter each device slot holds (vLLM's --max-loras slots under
--max-cpu-loras adapters in host memory), decided as the scheduler admits requests.

A request may only run with its adapter in a slot. A slot changes adapter only when no
running request reads it (an in-flight step keeps the arrays it was given), so a step
never mixes more adapters than there are slots. A waiting request whose adapter is not
in a slot takes an idle one (an empty slot first, else the least recently used), or,
when every slot is busy, claims the least recently used unclaimed one: no new request of
that slot's adapter is admitted until the running ones finish and the claimant takes
it (or another slot, should one go idle first). So the claimant never starves, and
requests behind it (the base, adapters in other slots) run meanwhile: no head-of-line
blocking.

Plain bookkeeping, no arrays: serve.engine.lora_registry writes the adapter's weights
into the slot this returns, under its lock.
"""


class SlotTable:
  """Slots 1..num_slots (0 is the base's zeros): their adapter ids, last use, claims."""

  def __init__(self, num_slots: int):
    self.num_slots = num_slots
    self.owner = [0] * (num_slots + 1)     # slot -> adapter id in it (0: none)
    self._used = [0] * (num_slots + 1)     # slot -> tick of its last admission (LRU)
    self._claims: dict[int, int] = {}      # slot -> adapter id waiting to take it
    self._tick = 0

  def slot_of(self, adapter_id: int) -> int | None:
    try:
      return self.owner.index(adapter_id, 1)
    except ValueError:
      return None

  def place(self, adapter_id: int, busy: set[int]) -> tuple[int, bool] | None:
    """(slot, whether the adapter must be written into it) for a request of adapter_id
    being admitted now, or None: it waits. busy: the slots running requests read."""
    slot = self.slot_of(adapter_id)
    if slot is not None:
      if self._claims.get(slot, adapter_id) != adapter_id:
        return None   # draining for a waiting adapter: this one's newcomers wait
      return self._take(slot, adapter_id), False
    mine = [s for s, a in self._claims.items() if a == adapter_id]
    if mine and mine[0] not in busy:
      return self._take(mine[0], adapter_id), True
    unclaimed = [s for s in range(1, self.num_slots + 1) if s not in self._claims]
    idle = [s for s in unclaimed if s not in busy]
    if idle:   # taken ahead of a claimed slot still draining
      self._claims = {s: a for s, a in self._claims.items() if a != adapter_id}
      slot = min(idle, key=lambda s: (self.owner[s] != 0, self._used[s]))
      return self._take(slot, adapter_id), True
    if mine:
      return None
    if unclaimed:
      self._claims[min(unclaimed, key=lambda s: self._used[s])] = adapter_id
    return None

  def place_in_empty(self, adapter_id: int) -> int | None:
    """An empty, unclaimed slot for a newly loaded adapter (None if there is none): it
    is written at load, ahead of its first request."""
    empty = [s for s in range(1, self.num_slots + 1)
             if not self.owner[s] and s not in self._claims]
    return self._take(empty[0], adapter_id) if empty else None

  def _take(self, slot: int, adapter_id: int) -> int:
    self._claims.pop(slot, None)
    self.owner[slot] = adapter_id
    self._tick += 1
    self._used[slot] = self._tick
    return slot

  def vacate(self, slot: int) -> None:
    """The write into `slot` failed: its arrays hold no adapter whole, so it is empty."""
    self.owner[slot] = 0
    self._used[slot] = 0

  def prune_claims(self, waiting_ids: set[int]) -> None:
    """Drops the claims of adapters no waiting request wants any more (aborted,
    finished): their slots take newcomers of their own adapter again."""
    self._claims = {s: a for s, a in self._claims.items() if a in waiting_ids}

  def forget(self, adapter_id: int) -> None:
    """The adapter is gone from host memory (unloaded, no request left): its slot is
    empty, its claim void."""
    slot = self.slot_of(adapter_id)
    if slot is not None:
      self.owner[slot] = 0
      self._used[slot] = 0
    self._claims = {s: a for s, a in self._claims.items() if a != adapter_id}

  def resident(self) -> list[int]:
    return [a for a in self.owner[1:] if a]
