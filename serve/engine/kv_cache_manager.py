"""Which KV blocks each request holds: allocation, prefix-cache hits, freeing.

The manager keeps each request's block table (the blocks holding its tokens' K/V, in
token order) and the chained hashes of its full blocks. It decides nothing about who
runs: the scheduler asks for room and acts on the answer.
"""

from serve.engine.block_pool import (BlockHash, BlockPool, KVBlock, adapter_root,
                                     hash_request_blocks)
from serve.engine.request import Request


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


class KVCacheManager:

  def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True):
    self.pool = BlockPool(num_blocks, block_size, enable_caching)
    self.block_size = block_size
    self.enable_caching = enable_caching
    self._tables: dict[str, list[KVBlock]] = {}
    self._block_ids: dict[str, list[int]] = {}    # the tables as ids, kept for the runner
    self._hashes: dict[str, list[BlockHash]] = {}
    self._num_cached: dict[str, int] = {}         # leading blocks already in the cache map
    self.prefix_cache_queries = 0                 # prompt tokens looked up (at admission)
    self.prefix_cache_hits = 0                    # of which found in the cache

  @property
  def usage(self) -> float:
    return self.pool.usage

  @property
  def num_free_blocks(self) -> int:
    return self.pool.num_free_blocks

  @property
  def num_usable_blocks(self) -> int:
    return self.pool.num_usable_blocks

  def get_block_ids(self, request_id: str) -> list[int]:
    """The request's block table (the manager's own list: copy it before keeping it)."""
    return self._block_ids.get(request_id, [])

  def get_computed_blocks(self, request: Request) -> list[KVBlock]:
    """The longest run of cached blocks that starts the request's tokens.

    Never the whole sequence: its last token must be computed to give logits, so a full
    hit stops one token short, which at a block boundary is one whole block short. None
    for a request that needs its prompt's logits (prompt logprobs): it computes them all.
    """
    if not self.enable_caching or request.needs_prompt_logits:
      return []
    hashes = self._request_hashes(request)
    hits = []
    for block_hash in hashes[:(request.num_tokens - 1) // self.block_size]:
      block = self.pool.get_cached_block(block_hash)
      if block is None:
        break
      hits.append(block)
    return hits

  def allocate_slots(self, request: Request, num_new_tokens: int,
                     computed_blocks: list[KVBlock] = ()) -> list[KVBlock] | None:
    """Room for num_new_tokens more tokens; the blocks added, or None (nothing changed).

    computed_blocks (prefix hits from get_computed_blocks) only for a request that holds
    no blocks yet. Block size 4, a one-block hit, 6 tokens computed, 7 new:

      tokens   |h h h h|c c . .|. . . .|. . . .|  h hit, c computed, . new this step
      table    [ hit 7 ][ own 3 ][ new 9 ][ new 2 ]
                 computed_blocks  held    returned
    The last held block may be partly filled: new tokens fill it before a new block.
    """
    table = self._tables.get(request.request_id)
    if table is not None:
      if computed_blocks:
        raise ValueError(f'request {request.request_id!r} already holds blocks: prefix '
                         'hits are only for a request being admitted')
      if request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
        return []   # decode inside a partly filled block: the common case, kept cheap
    num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
    num_held = len(computed_blocks) + (len(table) if table else 0)
    num_new_blocks = _cdiv(num_computed + num_new_tokens, self.block_size) - num_held
    num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
    if max(num_new_blocks, 0) + num_revived > self.pool.num_free_blocks:
      return None
    if table is None:
      table = self._admit(request, computed_blocks)
    new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
    table.extend(new_blocks)
    self._block_ids[request.request_id].extend(b.block_id for b in new_blocks)
    return new_blocks

  def cache_blocks(self, request: Request) -> None:
    """Puts the request's newly full and computed blocks into the prefix cache."""
    if not self.enable_caching:
      return
    request_id = request.request_id
    num_full = request.num_computed_tokens // self.block_size
    start = self._num_cached.get(request_id, 0)
    if num_full <= start:
      return
    hashes = self._request_hashes(request)
    table = self._tables[request_id]
    for i in range(start, num_full):
      self.pool.cache_block(table[i], hashes[i])
    self._num_cached[request_id] = num_full

  def free(self, request: Request) -> None:
    """Returns the request's blocks, its tail first (so the tail is evicted first)."""
    request_id = request.request_id
    table = self._tables.pop(request_id, None)
    if table:
      self.pool.free_blocks(reversed(table))
    self._block_ids.pop(request_id, None)
    self._hashes.pop(request_id, None)
    self._num_cached.pop(request_id, None)

  def _admit(self, request: Request, computed_blocks: list[KVBlock]) -> list[KVBlock]:
    self.pool.touch(computed_blocks)
    table = self._tables[request.request_id] = list(computed_blocks)
    self._block_ids[request.request_id] = [b.block_id for b in computed_blocks]
    self._num_cached[request.request_id] = len(computed_blocks)
    if self.enable_caching and not request.needs_prompt_logits:   # it looked the cache up
      self.prefix_cache_queries += request.num_tokens
      self.prefix_cache_hits += len(computed_blocks) * self.block_size
    return table

  def _request_hashes(self, request: Request) -> list[BlockHash]:
    """Chained hashes of the request's full blocks, extended as its tokens grow."""
    hashes = self._hashes.setdefault(request.request_id, [])
    num_full = request.num_tokens // self.block_size
    if len(hashes) < num_full:
      start = len(hashes) * self.block_size
      tokens = request.token_ids(start, num_full * self.block_size)
      parent = hashes[-1] if hashes else adapter_root(request.lora_id)
      hashes.extend(hash_request_blocks(tokens, self.block_size, parent))
    return hashes
