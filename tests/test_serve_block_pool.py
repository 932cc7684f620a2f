"""BlockPool and KVCacheManager: exact block ids, free-queue and eviction order, prefix hits."""

import os
import subprocess
import sys

import pytest

from serve.engine.block_pool import BlockPool, hash_block_tokens, hash_request_blocks
from serve.engine.kv_cache_manager import KVCacheManager
from serve.engine.request import Request
from serve.sampling_params import SamplingParams


def _request(request_id, prompt, max_tokens=4):
  return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens), None, 0.0)


def _ids(blocks):
  return [b.block_id for b in blocks]


def test_fresh_pool_hands_out_blocks_in_order_never_the_null_block():
  pool = BlockPool(12, block_size=4)
  assert pool.null_block_id == 0 and pool.num_usable_blocks == 11
  assert pool.free_block_ids() == list(range(1, 12))
  assert _ids(pool.get_new_blocks(3)) == [1, 2, 3]
  assert pool.free_block_ids() == list(range(4, 12))
  assert _ids(pool.get_new_blocks(8)) == list(range(4, 12))
  assert pool.num_free_blocks == 0 and pool.usage == 1.0
  with pytest.raises(ValueError, match='asked for 1 blocks but only 0 are free'):
    pool.get_new_blocks(1)


def test_free_order_and_lru_eviction():
  pool = BlockPool(12, block_size=4)
  a = pool.get_new_blocks(3)          # 1 2 3: a request's table, 3 only partly filled
  b = pool.get_new_blocks(2)          # 4 5
  h = hash_request_blocks(list(range(8)), 4)
  g = hash_request_blocks(list(range(100, 108)), 4)
  assert pool.cache_block(a[0], h[0]) and pool.cache_block(a[1], h[1])
  assert pool.cache_block(b[0], g[0]) and pool.cache_block(b[1], g[1])
  pool.free_blocks(reversed(a))
  # 3 holds no hash: first out. 2 (the tail) is evicted before 1.
  assert pool.free_block_ids() == [3, 6, 7, 8, 9, 10, 11, 2, 1]
  pool.free_blocks(reversed(b))
  assert pool.free_block_ids() == [3, 6, 7, 8, 9, 10, 11, 2, 1, 5, 4]
  assert pool.get_cached_block(h[1]).block_id == 2
  assert _ids(pool.get_new_blocks(8)) == [3, 6, 7, 8, 9, 10, 11, 2]
  assert pool.get_cached_block(h[1]) is None and pool.get_cached_block(h[0]).block_id == 1
  assert _ids(pool.get_new_blocks(1)) == [1]
  assert pool.get_cached_block(h[0]) is None and pool.num_cached_blocks() == 2
  assert pool.free_block_ids() == [5, 4]


def test_touch_revives_a_free_cached_block_and_refcounts():
  pool = BlockPool(6, block_size=2)
  blocks = pool.get_new_blocks(2)
  pool.cache_block(blocks[0], hash_block_tokens(None, [1, 2]))
  pool.free_blocks(reversed(blocks))
  assert pool.free_block_ids() == [2, 3, 4, 5, 1]
  pool.touch([blocks[0]])
  assert blocks[0].ref_cnt == 1 and pool.free_block_ids() == [2, 3, 4, 5]
  pool.touch([blocks[0]])
  assert blocks[0].ref_cnt == 2
  pool.free_blocks([blocks[0]])
  assert blocks[0].ref_cnt == 1 and 1 not in pool.free_block_ids()
  pool.free_blocks([blocks[0]])
  assert pool.free_block_ids() == [2, 3, 4, 5, 1] and pool.usage == 0.0


def test_duplicate_hash_keeps_the_first_block():
  pool = BlockPool(4, block_size=2)
  x, y = pool.get_new_blocks(2)
  key = hash_block_tokens(None, [7, 7])
  assert pool.cache_block(x, key) and not pool.cache_block(y, key)
  assert pool.get_cached_block(key) is x and y.block_hash is None


def test_hashes_chain_over_the_prefix_and_agree_across_processes():
  first = hash_request_blocks([1, 2, 3, 4, 5, 6], 3)
  other_prefix = hash_request_blocks([9, 9, 9, 4, 5, 6], 3)
  assert len(first) == 2 and first[0] != other_prefix[0]
  assert first[1] != other_prefix[1]   # same tokens, different parent: different block
  assert first[1] == hash_block_tokens(first[0], [4, 5, 6])
  code = ('from serve.engine.block_pool import hash_request_blocks as h; '
          'print(h([1, 2, 3, 4, 5, 6], 3)[1].hex())')
  env = dict(os.environ, PYTHONHASHSEED='12345')
  out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                       text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.stdout.strip() == first[1].hex()


def test_pool_rejects_bad_sizes():
  with pytest.raises(ValueError, match='num_blocks=1'):
    BlockPool(1)
  with pytest.raises(ValueError, match='block_size=0'):
    BlockPool(8, block_size=0)


def _compute(kv, request, num_new, hits=()):
  """Allocates and marks the tokens computed, as a scheduler step would."""
  new = kv.allocate_slots(request, num_new, list(hits))
  assert new is not None
  request.num_computed_tokens += num_new + len(hits) * kv.block_size
  kv.cache_blocks(request)
  return new


def test_prefix_hits_are_chained_and_exact():
  kv = KVCacheManager(12, block_size=4)
  a = _request('a', range(10))               # blocks 1 2 3; 1 and 2 full
  assert _ids(_compute(kv, a, 10)) == [1, 2, 3]
  same_head = _request('b', list(range(8)) + [50, 51])
  assert _ids(kv.get_computed_blocks(same_head)) == [1, 2]
  first_only = _request('c', [0, 1, 2, 3, 9, 9, 9, 9, 1])
  assert _ids(kv.get_computed_blocks(first_only)) == [1]
  # Block 2's tokens (4..7) after a different first block: not a hit.
  shifted = _request('d', [9, 9, 9, 9, 4, 5, 6, 7, 1])
  assert kv.get_computed_blocks(shifted) == []


def test_last_token_is_always_computed():
  kv = KVCacheManager(12, block_size=4)
  _compute(kv, _request('a', range(12)), 12)
  # The same 8 tokens: at most 7 can be reused, so only one block of the two.
  assert _ids(kv.get_computed_blocks(_request('b', range(8)))) == [1]
  assert _ids(kv.get_computed_blocks(_request('c', range(9)))) == [1, 2]
  assert _ids(kv.get_computed_blocks(_request('d', range(12)))) == [1, 2]
  assert _ids(kv.get_computed_blocks(_request('e', range(13)))) == [1, 2, 3]


def test_hit_then_allocate_shares_blocks_and_counts_tokens():
  kv = KVCacheManager(12, block_size=4)
  a = _request('a', range(10))
  _compute(kv, a, 10)
  b = _request('b', list(range(8)) + [60, 61, 62])
  hits = kv.get_computed_blocks(b)
  assert _ids(_compute(kv, b, 3, hits)) == [4]
  assert kv.get_block_ids('b') == [1, 2, 4]
  assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
  assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)
  kv.free(a)
  # a's private tail block 3 goes first; 1 and 2 are still held by b.
  assert kv.pool.free_block_ids() == [3] + list(range(5, 12))
  kv.free(b)
  # b's partial block 4 holds no hash: to the front; then its full blocks, tail first.
  assert kv.pool.free_block_ids() == [4, 3] + list(range(5, 12)) + [2, 1]
  assert kv.num_free_blocks == 11 and kv.usage == 0.0


def test_allocate_refuses_without_changing_anything():
  kv = KVCacheManager(5, block_size=4)          # 4 usable blocks
  a = _request('a', range(8))
  _compute(kv, a, 8)                            # blocks 1 2, both cached
  kv.free(a)
  assert kv.pool.free_block_ids() == [3, 4, 2, 1]
  b = _request('b', list(range(8)) + list(range(30, 42)))   # 20 tokens: 5 blocks
  hits = kv.get_computed_blocks(b)
  assert _ids(hits) == [1, 2]
  # 2 hits are revived from the free queue and 3 new blocks are needed: 5 > 4 free.
  assert kv.allocate_slots(b, 12, hits) is None
  assert kv.pool.free_block_ids() == [3, 4, 2, 1] and kv.get_block_ids('b') == []
  assert [kv.pool.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]
  assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (8, 0)
  assert _ids(kv.allocate_slots(b, 8, hits)) == [3, 4]
  assert kv.get_block_ids('b') == [1, 2, 3, 4] and kv.num_free_blocks == 0


def test_growing_request_takes_a_block_only_at_a_boundary():
  kv = KVCacheManager(12, block_size=4)
  a = _request('a', range(3))
  assert _ids(_compute(kv, a, 3)) == [1]
  assert kv.allocate_slots(a, 1) == []          # position 3: still block 1
  a.num_computed_tokens += 1
  assert _ids(kv.allocate_slots(a, 1)) == [2]   # position 4 starts block 2
  a.num_computed_tokens += 1
  assert _ids(kv.allocate_slots(a, 7)) == [3]      # positions 5..11: block 3 ends at 11
  assert _ids(kv.allocate_slots(a, 8)) == [4]      # asked again, one more: position 12
  assert kv.get_block_ids('a') == [1, 2, 3, 4]
