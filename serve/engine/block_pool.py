"""A pool of fixed-size KV cache blocks: free queue (LRU), reference counts, prefix cache.

A block holds the K/V of `block_size` consecutive tokens of one sequence. A full block
whose tokens have been computed is cached under a hash chained over the whole prefix
(its parent block's hash and its own token ids), so two prompts that share their first
k full blocks share those k blocks, and a block with the same tokens after a different
prefix is a different entry.

Free blocks wait in one queue, taken from the front. A freed block that is cached keeps
its hash and stays findable until the queue hands it out again (eviction); freed blocks
go to the back, so the least recently used is evicted first. A freed block with no hash
holds nothing reusable and goes to the front.

    front (taken first)                                   back (taken last)
    [no-hash blocks ...][cached, least recently used ... most recently used]

Block 0 is never handed out: the runner points padded token writes at it
(`null_block_id`), so a padding row cannot overwrite a live block.
"""

import array
import collections
import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
  """The chained prefix hash of a full block: the same in every process and run.

  sha256 rather than Python's hash(): a collision would silently serve another
  prompt's K/V, and 256 bits make that impossible in practice.
  """
  digest = hashlib.sha256(parent or b'')
  digest.update(array.array('q', token_ids).tobytes())
  return digest.digest()


def adapter_root(lora_id: int) -> BlockHash | None:
  """The parent of a request's first block: None for the base model, a hash of the
  LoRA adapter's load id otherwise, so no two adapters (nor an adapter and the base)
  ever share a block."""
  return None if not lora_id else hashlib.sha256(b'lora-adapter:%d' % lora_id).digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int,
                        parent: BlockHash | None = None) -> list[BlockHash]:
  """Chained hashes of the full blocks of token_ids, continuing from `parent`."""
  hashes = []
  for begin in range(0, len(token_ids) - block_size + 1, block_size):
    parent = hash_block_tokens(parent, token_ids[begin:begin + block_size])
    hashes.append(parent)
  return hashes


@dataclasses.dataclass(eq=False, slots=True)
class KVBlock:
  block_id: int
  ref_cnt: int = 0
  block_hash: BlockHash | None = None   # set while the block is in the prefix cache


class BlockPool:
  """Blocks 1..num_blocks-1 for requests; block 0 is the null block (padding writes)."""

  null_block_id = 0

  def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True):
    if num_blocks < 2:
      raise ValueError(f'num_blocks={num_blocks}: the pool needs at least 2 blocks '
                       '(block 0 is reserved for padding writes)')
    if block_size < 1:
      raise ValueError(f'block_size={block_size}: must be a positive number of tokens')
    self.num_blocks = num_blocks
    self.block_size = block_size
    self.enable_caching = enable_caching
    self.blocks = [KVBlock(i) for i in range(num_blocks)]
    self.blocks[0].ref_cnt = 1   # the null block is never free
    # An OrderedDict is a linked list with O(1) pop-front, append, remove by id and move.
    self._free: collections.OrderedDict[int, KVBlock] = collections.OrderedDict(
        (b.block_id, b) for b in self.blocks[1:])
    self._cached: dict[BlockHash, KVBlock] = {}

  @property
  def num_usable_blocks(self) -> int:
    return self.num_blocks - 1

  @property
  def num_free_blocks(self) -> int:
    return len(self._free)

  @property
  def usage(self) -> float:
    """Fraction of the usable blocks held by requests (cached free blocks count as free)."""
    return 1.0 - len(self._free) / self.num_usable_blocks

  def free_block_ids(self) -> list[int]:
    """The free queue, front (next taken) first."""
    return list(self._free)

  def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
    return self._cached.get(block_hash)

  def get_new_blocks(self, n: int) -> list[KVBlock]:
    """Takes n blocks from the front of the free queue, evicting their cached contents."""
    if n > len(self._free):
      raise ValueError(f'asked for {n} blocks but only {len(self._free)} are free')
    blocks = []
    for _ in range(n):
      _, block = self._free.popitem(last=False)
      self._evict(block)
      block.ref_cnt = 1
      blocks.append(block)
    return blocks

  def touch(self, blocks: Iterable[KVBlock]) -> None:
    """Takes a reference on prefix-cache hits, pulling free ones out of the free queue."""
    for block in blocks:
      if block.ref_cnt == 0:
        del self._free[block.block_id]
      block.ref_cnt += 1

  def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
    """Drops one reference each; blocks reaching zero join the free queue in this order.

    Pass a request's blocks tail first: its tail is then evicted before its head, which
    other prompts are likelier to share.
    """
    for block in blocks:
      block.ref_cnt -= 1
      if block.ref_cnt == 0:
        self._free[block.block_id] = block
        if block.block_hash is None:
          self._free.move_to_end(block.block_id, last=False)

  def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
    """Registers a full, computed block; False if another block already holds that hash."""
    if not self.enable_caching or block.block_hash is not None:
      return False
    if block_hash in self._cached:
      return False   # computed twice at once: keep the first, this one stays private
    block.block_hash = block_hash
    self._cached[block_hash] = block
    return True

  def num_cached_blocks(self) -> int:
    return len(self._cached)

  def reset_prefix_cache(self) -> None:
    """Forgets every cached block (e.g. after loading new weights)."""
    for block in self._cached.values():
      block.block_hash = None
    self._cached.clear()

  def _evict(self, block: KVBlock) -> None:
    if block.block_hash is not None:
      del self._cached[block.block_hash]
      block.block_hash = None
