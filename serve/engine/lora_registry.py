"""The LoRA adapters a running engine serves: name -> device slot, at most --max-loras
resident, loaded and unloaded while requests run.

Each load gets a fresh adapter id (never reused, unlike slots): the prefix cache keys
blocks by it, so two adapters, an adapter and the base, or an adapter and its reloaded
self never share KV blocks. An unload takes the name away at once (new requests get
404); requests already running on it finish first, and its slot is cleared and freed when
the last of them ends.
"""

import dataclasses
import threading

from serve.engine.errors import UnknownAdapter
from serve.load.lora_workdir import read_adapter


@dataclasses.dataclass
class _Resident:
  name: str
  path: str
  slot: int
  adapter_id: int
  rank: int
  running: int = 0
  unloading: bool = False


class LoraRegistry:
  """Adapters in the runner's LoraSlots (serve.worker.lora_slots), thread-safe."""

  def __init__(self, model_cfg, slots, base_name: str, base=None):
    self.model_cfg, self.slots, self.base_name = model_cfg, slots, base_name
    self.base = base   # the served weights' BaseIdentity, checked by LoRA workdirs
    self._by_name: dict[str, _Resident] = {}
    self._by_id: dict[int, _Resident] = {}
    self._free = list(range(1, slots.max_loras + 1))
    self._next_id = 1
    self._loading: set[str] = set()
    self._lock = threading.Lock()

  def names(self) -> list[dict]:
    """[{name, path}] of the adapters requests may name, in load order."""
    with self._lock:
      return [{'name': r.name, 'path': r.path} for r in self._by_name.values()]

  def load(self, name: str, path: str) -> None:
    """Reads the adapter at `path` (PEFT, or a LoRA workdir) and puts it in a free slot;
    ValueError saying why not (a taken name, no free slot, or an adapter that does not fit
    the base)."""
    with self._lock:
      self._check_name(name)
      if not self._free:
        raise ValueError(f'cannot load LoRA adapter {name!r}: all --max-loras='
                         f'{self.slots.max_loras} slots hold adapters '
                         f'({", ".join(self._slot_owners())}); unload one first '
                         '(POST /v1/unload_lora_adapter) or restart with a larger --max-loras.')
      slot = self._free.pop(0)
      self._loading.add(name)
    try:
      adapter = read_adapter(name, path, self.model_cfg, self.slots.max_rank, self.base)
      self.slots.write(slot, adapter.weights)
    except Exception:
      with self._lock:
        self._free.insert(0, slot)
        self._loading.discard(name)
      raise
    with self._lock:
      self._loading.discard(name)
      entry = _Resident(name, path, slot, self._next_id, adapter.rank)
      self._next_id += 1
      self._by_name[name] = entry
      self._by_id[entry.adapter_id] = entry

  def _check_name(self, name: str) -> None:
    if not name or name == self.base_name:
      raise ValueError(f'LoRA adapter name {name!r}: give a name other than the base '
                       f'model\'s ({self.base_name!r}).')
    if name in self._by_name or name in self._loading:
      raise ValueError(f'LoRA adapter {name!r} is already loaded; unload it first to '
                       'replace it.')

  def _slot_owners(self) -> list[str]:
    return [r.name + (' (unloading)' if r.unloading else '') for r in self._by_id.values()]

  def unload(self, name: str) -> int:
    """Takes `name` away; returns how many running requests still use it (they finish
    first; its slot is freed after the last). UnknownAdapter if none is loaded."""
    with self._lock:
      entry = self._by_name.pop(name, None)
      if entry is None:
        raise UnknownAdapter(f'no LoRA adapter {name!r} is loaded (GET /v1/models lists '
                             'them).')
      entry.unloading = True
      running = entry.running
    if running == 0:
      self._free_slot(entry)
    return running

  def acquire(self, name: str) -> tuple[int, int]:
    """(slot, adapter id) for one request on adapter `name`; release() when it ends."""
    with self._lock:
      entry = self._by_name.get(name)
      if entry is None:
        raise UnknownAdapter(f'The model {name!r} does not exist: this server serves '
                             f'{self.base_name!r} and the LoRA adapters '
                             f'{sorted(self._by_name) or "(none loaded)"}.')
      entry.running += 1
      return entry.slot, entry.adapter_id

  def release(self, adapter_id: int) -> None:
    with self._lock:
      entry = self._by_id.get(adapter_id)
      if entry is None:
        return
      entry.running -= 1
      done = entry.unloading and entry.running == 0
    if done:
      self._free_slot(entry)

  def _free_slot(self, entry: _Resident) -> None:
    """Zeroes the slot (a later adapter with fewer targets must not inherit these) and
    frees it."""
    self.slots.clear(entry.slot)
    with self._lock:
      self._by_id.pop(entry.adapter_id, None)
      self._free.append(entry.slot)

  def rank(self, name: str) -> int:
    with self._lock:
      return self._by_name[name].rank

  def num_running(self) -> int:
    """Requests holding an adapter (0 when nothing leaked)."""
    with self._lock:
      return sum(r.running for r in self._by_id.values())
