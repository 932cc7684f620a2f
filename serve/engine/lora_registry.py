"""The LoRA adapters a running engine serves (vLLM's residency): up to --max-cpu-loras
loaded in host memory, up to --max-loras of them in device slots at once; loaded and
unloaded while requests run.

A load reads the adapter into host arrays, and into an empty slot if there is one; else
the scheduler writes it into a slot when it admits a request for it
(serve.engine.lora_residency decides which slot, evicting the least recently used idle
one). Each load gets a fresh adapter id (never reused, unlike
slots): the prefix cache keys blocks by it, so two adapters, an adapter and the base, or
an adapter and its reloaded self never share KV blocks. An unload takes the name away at
once (new requests get 404); requests already queued or running on it finish first, and
its host arrays and slot go when the last of them ends.
"""

import dataclasses
import threading

from serve.engine.errors import UnknownAdapter
from serve.engine.lora_residency import SlotTable
from serve.load.lora_workdir import read_adapter


@dataclasses.dataclass
class _Loaded:
  name: str
  path: str
  adapter_id: int
  rank: int
  weights: dict          # host arrays {target: (a, b)}, model.lora's serving form
  held: int = 0          # requests queued or running on it
  unloading: bool = False


class LoraRegistry:
  """Loaded adapters and the runner's LoraSlots (serve.worker.lora_slots), thread-safe."""

  def __init__(self, model_cfg, slots, base_name: str, max_cpu_loras: int = 0, base=None):
    self.model_cfg, self.slots, self.base_name = model_cfg, slots, base_name
    self.max_cpu_loras = max_cpu_loras or slots.max_loras
    self.base = base   # the served weights' BaseIdentity, checked by LoRA workdirs
    self.table = SlotTable(slots.max_loras)
    self._by_name: dict[str, _Loaded] = {}
    self._by_id: dict[int, _Loaded] = {}   # the unloading ones too, until released
    self._next_id = 1
    self._loading: set[str] = set()
    self._lock = threading.Lock()

  def names(self) -> list[dict]:
    """[{name, path}] of the adapters requests may name, in load order."""
    with self._lock:
      return [{'name': r.name, 'path': r.path} for r in self._by_name.values()]

  def load(self, name: str, path: str) -> None:
    """Reads the adapter at `path` (PEFT, or a LoRA workdir) into host memory; ValueError
    saying why not (a taken name, --max-cpu-loras reached, or an adapter that does not fit
    the base)."""
    with self._lock:
      self._check_name(name)
      if len(self._by_id) + len(self._loading) >= self.max_cpu_loras:
        raise ValueError(f'cannot load LoRA adapter {name!r}: --max-cpu-loras='
                         f'{self.max_cpu_loras} adapters are loaded ({self._holders()}); '
                         'unload one first (POST /v1/unload_lora_adapter) or restart with '
                         'a larger --max-cpu-loras.')
      self._loading.add(name)
    try:
      adapter = read_adapter(name, path, self.model_cfg, self.slots.max_rank, self.base)
    finally:
      with self._lock:
        self._loading.discard(name)
    with self._lock:
      entry = _Loaded(name, path, self._next_id, adapter.rank, adapter.weights)
      self._next_id += 1
      slot = self.table.place_in_empty(entry.adapter_id)
      if slot is not None:   # an empty slot no row reads: written now, not in a step
        self._write(slot, entry.weights)   # before the name is served: a failure leaves none
      self._by_name[name] = entry
      self._by_id[entry.adapter_id] = entry

  def _write(self, slot: int, weights: dict) -> None:
    """Writes the slot the table gave (lock held); where the write fails the slot is
    emptied, so no request runs on the previous adapter's or a half-written one's weights."""
    try:
      self.slots.write(slot, weights)
    except BaseException:
      self.table.vacate(slot)
      raise

  def _check_name(self, name: str) -> None:
    if not name or name == self.base_name:
      raise ValueError(f'LoRA adapter name {name!r}: give a name other than the base '
                       f'model\'s ({self.base_name!r}).')
    if name in self._by_name or name in self._loading:
      raise ValueError(f'LoRA adapter {name!r} is already loaded; unload it first to '
                       'replace it.')

  def _holders(self) -> str:
    return ', '.join([r.name + (' (unloading)' if r.unloading else '')
                      for r in self._by_id.values()] + sorted(self._loading))

  def unload(self, name: str) -> int:
    """Takes `name` away; returns how many queued or running requests still use it
    (they finish first; it is dropped after the last). UnknownAdapter if none is loaded."""
    with self._lock:
      entry = self._by_name.pop(name, None)
      if entry is None:
        raise UnknownAdapter(f'no LoRA adapter {name!r} is loaded (GET /v1/models lists '
                             'them).')
      entry.unloading = True
      if entry.held == 0:
        self._drop(entry)
      return entry.held

  def acquire(self, name: str) -> int:
    """The adapter id for one request on adapter `name`; release() when it ends."""
    with self._lock:
      entry = self._by_name.get(name)
      if entry is None:
        raise UnknownAdapter(f'The model {name!r} does not exist: this server serves '
                             f'{self.base_name!r} and the LoRA adapters '
                             f'{sorted(self._by_name) or "(none loaded)"}.')
      entry.held += 1
      return entry.adapter_id

  def release(self, adapter_id: int) -> None:
    with self._lock:
      entry = self._by_id.get(adapter_id)
      if entry is None:
        return
      entry.held -= 1
      if entry.unloading and entry.held == 0:
        self._drop(entry)

  def _drop(self, entry: _Loaded) -> None:
    """Frees its host arrays and its slot (lock held). The slot's arrays keep the old
    weights until the next adapter is written over them: no request reads it meanwhile."""
    self._by_id.pop(entry.adapter_id, None)
    self.table.forget(entry.adapter_id)

  def slot_for(self, adapter_id: int, busy: set[int]) -> int | None:
    """The device slot a request of adapter_id is admitted with, its weights written
    there if they are not yet; None: it waits for one (lora_residency). Called by the
    scheduler; busy: the slots its running requests read."""
    with self._lock:
      placed = self.table.place(adapter_id, busy)
      if placed is None:
        return None
      slot, write = placed
      if write:   # fixed shapes: no step recompiles
        self._write(slot, self._by_id[adapter_id].weights)
      return slot

  def prune_claims(self, waiting_ids: set[int]) -> None:
    with self._lock:
      self.table.prune_claims(waiting_ids)

  def name_of(self, adapter_id: int) -> str | None:
    with self._lock:
      entry = self._by_id.get(adapter_id)
      return None if entry is None else entry.name

  def resident(self) -> list[str]:
    """Names of the adapters in device slots, by slot."""
    with self._lock:
      return [self._by_id[a].name for a in self.table.resident() if a in self._by_id]

  def rank(self, name: str) -> int:
    with self._lock:
      return self._by_name[name].rank

  def num_running(self) -> int:
    """Requests holding an adapter (0 when nothing leaked)."""
    with self._lock:
      return sum(r.held for r in self._by_id.values())
