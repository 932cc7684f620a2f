"""Scheduler: chunked prefill, FCFS, caps, preemption by recompute, aborts, refusals.

A fake paged "model" writes each chunk's tokens into the slots its block table names and
samples a token from the history it reads back through the table, so a wrong block id,
a bad prefix hit or a lost token changes the output, which is compared with the request
run alone by a plain loop.
"""

import collections
import random

import pytest

from serve.engine.request import Request, RequestStatus
from serve.engine.scheduler import Scheduler, SchedulerConfig
from serve.sampling_params import SamplingParams

VOCAB = 40


def fake_next(history):
  """A deterministic 'model': the next token depends only on the whole history."""
  h = 17
  for t in history:
    h = (h * 1000003 + t + 1) % 2147483647
  return h % VOCAB


def reference_output(prompt, params, eos):
  out = []
  while True:
    token = fake_next(list(prompt) + out)
    out.append(token)
    if ((token == eos and not params.ignore_eos) or token in params.stop_token_ids
        or len(out) >= params.max_tokens):
      return out


class FakeRunner:
  """Paged K/V as plain token ids: slots[block][offset]."""

  def __init__(self, sched):
    self.sched = sched
    self.bs = sched.cfg.block_size
    self.slots = [[None] * self.bs for _ in range(sched.cfg.num_blocks)]

  def execute(self, out):
    pool = self.sched.kv.pool
    for c in out.chunks:
      end = c.start_position + len(c.token_ids)
      assert len(c.block_ids) == -(-end // self.bs), c
      request = self.sched.get_request(c.request_id)
      assert c.start_position == request.num_computed_tokens
      assert c.token_ids == request.all_token_ids[c.start_position:end]
      assert c.sample == (end == request.num_tokens)
      for pos, token in enumerate(c.token_ids, c.start_position):
        block = pool.blocks[c.block_ids[pos // self.bs]]
        # Only a block the request owns alone, and not yet in the prefix cache, is written.
        assert block.ref_cnt == 1 and block.block_hash is None, (c, block)
        self.slots[block.block_id][pos % self.bs] = token
    return {c.request_id: fake_next(self._history(c)) for c in out.chunks if c.sample}

  def _history(self, c):
    end = c.start_position + len(c.token_ids)
    return [self.slots[c.block_ids[p // self.bs]][p % self.bs] for p in range(end)]


def make(request_id, prompt, max_tokens=8, eos=None, **params):
  return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                 eos, 0.0)


def scheduler(**overrides):
  cfg = dict(block_size=4, num_blocks=12, max_num_seqs=8, max_num_batched_tokens=64,
             max_model_len=64, enable_prefix_caching=False)
  return Scheduler(SchedulerConfig(**{**cfg, **overrides}))


def step(sched, runner):
  out = sched.schedule()
  return out, sched.update_from_output(out, runner.execute(out))


def chunks_of(out):
  return [(c.request_id, c.start_position, len(c.token_ids), c.block_ids, c.sample)
          for c in out.chunks]


def test_chunked_prefill_splits_under_the_token_budget():
  sched = scheduler(max_num_batched_tokens=8)
  runner = FakeRunner(sched)
  a = make('a', range(20), max_tokens=3)
  sched.add_request(a)
  outs = [step(sched, runner)[0] for _ in range(4)]
  assert [chunks_of(o) for o in outs] == [
      [('a', 0, 8, [1, 2], False)], [('a', 8, 8, [1, 2, 3, 4], False)],
      [('a', 16, 4, [1, 2, 3, 4, 5], True)], [('a', 20, 1, [1, 2, 3, 4, 5, 6], True)]]
  assert [o.num_batched_tokens for o in outs] == [8, 8, 4, 1]
  assert a.output_token_ids == reference_output(range(20), a.sampling_params, None)[:2]


def test_running_first_then_waiting_share_the_budget():
  sched = scheduler(max_num_batched_tokens=8)
  runner = FakeRunner(sched)
  sched.add_request(make('a', range(6)))
  sched.add_request(make('b', range(100, 110)))
  outs = [step(sched, runner)[0] for _ in range(3)]
  assert [chunks_of(o) for o in outs] == [
      [('a', 0, 6, [1, 2], True), ('b', 0, 2, [3], False)],
      [('a', 6, 1, [1, 2], True), ('b', 2, 7, [3, 4, 5], False)],
      [('a', 7, 1, [1, 2], True), ('b', 9, 1, [3, 4, 5], True)]]


def test_long_prefill_threshold_caps_each_chunk():
  sched = scheduler(long_prefill_token_threshold=3)
  runner = FakeRunner(sched)
  sched.add_request(make('a', range(7)))
  sched.add_request(make('b', range(2)))
  out, _ = step(sched, runner)
  assert chunks_of(out) == [('a', 0, 3, [1], False), ('b', 0, 2, [2], True)]


def test_max_running_cap():
  sched = scheduler(max_num_seqs=2)
  runner = FakeRunner(sched)
  for name, n in (('a', 1), ('b', 3), ('c', 3)):
    sched.add_request(make(name, range(5), max_tokens=n))
  out, finished = step(sched, runner)
  assert [c.request_id for c in out.chunks] == ['a', 'b'] and sched.num_waiting == 1
  assert [r.request_id for r in finished] == ['a']
  out, _ = step(sched, runner)
  assert chunks_of(out) == [('b', 5, 1, [3, 4], True), ('c', 0, 5, [1, 2], True)]
  assert out.finished_ids == ['a'] and (sched.num_running, sched.num_waiting) == (2, 0)


def test_preemption_and_resumption_by_recompute():
  # 6 usable blocks of 4 tokens; three 4-token prompts each grow one block per 4 steps.
  sched = scheduler(num_blocks=7, long_prefill_token_threshold=4)
  runner = FakeRunner(sched)
  reqs = [make('a', [1, 2, 3, 4], 9), make('b', [5, 6, 7, 8], 9), make('c', [9, 10, 11, 12], 8)]
  for r in reqs:
    sched.add_request(r)
  outs = [step(sched, runner)[0] for _ in range(5)]
  assert chunks_of(outs[1]) == [('a', 4, 1, [1, 4], True), ('b', 4, 1, [2, 5], True),
                                ('c', 4, 1, [3, 6], True)]
  assert all(not o.preempted_ids for o in outs) and sched.kv.num_free_blocks == 0
  c = reqs[2]
  c_outputs = list(c.output_token_ids)
  assert len(c_outputs) == 5
  # Position 8 needs a seventh block of six: the newest request, c, gives its two back.
  out, _ = step(sched, runner)
  assert out.preempted_ids == ['c'] and sched.num_preemptions == 1
  assert chunks_of(out) == [('a', 8, 1, [1, 4, 3], True), ('b', 8, 1, [2, 5, 6], True)]
  assert (c.status, c.num_computed_tokens, c.output_token_ids) == (
      RequestStatus.PREEMPTED, 0, c_outputs)
  assert list(sched.waiting) == [c] and sched.kv.get_block_ids('c') == []
  for _ in range(3):
    out, finished = step(sched, runner)
    assert [ch.request_id for ch in out.chunks] == ['a', 'b']
  assert [r.request_id for r in finished] == ['a', 'b']
  assert sched.kv.pool.free_block_ids() == [2, 5, 6, 1, 4, 3]
  # Resumed: prompt and all five outputs recomputed in chunks of 4; no sample until the
  # chunk that reaches the last known token.
  outs = [step(sched, runner)[0] for _ in range(3)]
  assert outs[0].finished_ids == ['a', 'b']
  assert [chunks_of(o) for o in outs] == [
      [('c', 0, 4, [2], False)], [('c', 4, 4, [2, 5], False)],
      [('c', 8, 1, [2, 5, 6], True)]]
  assert outs[1].chunks[0].token_ids == c_outputs[:4]
  assert outs[2].chunks[0].token_ids == c_outputs[4:]
  while sched.has_unfinished_requests():
    step(sched, runner)
  for r in reqs:
    assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params, None)
  assert sched.kv.num_free_blocks == 6


def test_prefix_hit_skips_cached_blocks_and_keeps_the_last_token():
  sched = scheduler(enable_prefix_caching=True)
  runner = FakeRunner(sched)
  sched.add_request(make('a', range(10), max_tokens=1))
  out, _ = step(sched, runner)
  assert chunks_of(out) == [('a', 0, 10, [1, 2, 3], True)]
  assert sched.kv.pool.free_block_ids() == [3] + list(range(4, 12)) + [2, 1]
  b = make('b', list(range(8)) + [20, 21], max_tokens=2)
  sched.add_request(b)
  out, _ = step(sched, runner)
  assert chunks_of(out) == [('b', 8, 2, [1, 2, 3], True)]
  assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (20, 8)
  c = make('c', range(8), max_tokens=2)       # all 8 cached, but 7 is the most reused
  sched.add_request(c)
  out, _ = step(sched, runner)
  assert chunks_of(out) == [('b', 10, 1, [1, 2, 3], True), ('c', 4, 4, [1, 4], True)]
  while sched.has_unfinished_requests():
    step(sched, runner)
  for r in (b, c):
    assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params, None)


def test_prompt_logprobs_request_computes_its_whole_prompt_and_is_no_cache_query():
  """Its prompt's logits are needed: a cached prefix is not taken, nor counted as looked up."""
  sched = scheduler(enable_prefix_caching=True)
  runner = FakeRunner(sched)
  sched.add_request(make('a', range(10), max_tokens=1))
  step(sched, runner)
  queries, hits = sched.prefix_cache_queries, sched.prefix_cache_hits
  d = make('d', range(10), max_tokens=2, prompt_logprobs=1)
  sched.add_request(d)
  out, _ = step(sched, runner)
  assert [(c.request_id, c.start_position, len(c.token_ids)) for c in out.chunks] == [
      ('d', 0, 10)]
  assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (queries, hits)
  e = make('e', range(10), max_tokens=1)   # an ordinary request still hits
  sched.add_request(e)
  out, _ = step(sched, runner)
  assert ('e', 8, 2) in [(c.request_id, c.start_position, len(c.token_ids))
                         for c in out.chunks]
  assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (queries + 10, hits + 8)
  while sched.has_unfinished_requests():
    step(sched, runner)
  assert d.output_token_ids == reference_output(d.prompt_token_ids, d.sampling_params, None)


def test_abort_while_waiting_and_running_frees_everything():
  sched = scheduler(max_num_seqs=1)
  runner = FakeRunner(sched)
  a, b = make('a', range(9)), make('b', range(5))
  sched.add_request(a)
  sched.add_request(b)
  step(sched, runner)
  assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
  sched.finish_request('b', RequestStatus.FINISHED_ABORTED)
  assert b.status is RequestStatus.FINISHED_ABORTED and sched.kv.num_free_blocks == 8
  sched.finish_request('a', RequestStatus.FINISHED_ABORTED)
  assert sched.kv.num_free_blocks == 11 and sched.kv_cache_usage == 0.0
  sched.finish_request('a', RequestStatus.FINISHED_ABORTED)   # again: ignored
  sched.finish_request('nobody', RequestStatus.FINISHED_ERROR)
  out = sched.schedule()
  assert (out.chunks, out.finished_ids) == ([], ['b', 'a'])
  assert not sched.has_unfinished_requests() and sched.num_waiting == 0
  with pytest.raises(ValueError, match='FINISHED_'):
    sched.finish_request('a', RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_skipped():
  sched = scheduler()
  runner = FakeRunner(sched)
  a = make('a', range(6))
  sched.add_request(a)
  out = sched.schedule()
  sampled = runner.execute(out)
  sched.finish_request('a', RequestStatus.FINISHED_ABORTED)
  assert sched.update_from_output(out, sampled) == []
  assert a.output_token_ids == [] and sched.kv.num_free_blocks == 11


def test_finish_by_eos_ignore_eos_stop_token_and_stop_string():
  sched = scheduler()
  reqs = [make('eos', [1], 4, eos=5), make('ignore', [1], 2, eos=5, ignore_eos=True),
          make('stop_id', [1], 4, stop_token_ids=[9]), make('str', [1], 4)]
  for r in reqs:
    sched.add_request(r)
  finished = sched.update_from_output(sched.schedule(), dict(eos=5, ignore=5, stop_id=3,
                                                             str=3))
  assert [r.request_id for r in finished] == ['eos']
  finished = sched.update_from_output(sched.schedule(), dict(ignore=6, stop_id=9, str=4))
  assert [r.request_id for r in finished] == ['ignore', 'stop_id']
  sched.finish_request('str', RequestStatus.FINISHED_STOPPED, stop_reason='END')
  assert [(r.status, r.stop_reason, r.output_token_ids) for r in reqs] == [
      (RequestStatus.FINISHED_STOPPED, None, [5]),
      (RequestStatus.FINISHED_LENGTH, None, [5, 6]),
      (RequestStatus.FINISHED_STOPPED, 9, [3, 9]),
      (RequestStatus.FINISHED_STOPPED, 'END', [3, 4])]
  assert [r.status.finish_reason for r in reqs] == ['stop', 'length', 'stop', 'stop']
  assert sched.kv.num_free_blocks == 11


def test_missing_sampled_token_is_an_error():
  sched = scheduler()
  sched.add_request(make('a', [1, 2]))
  with pytest.raises(ValueError, match="no sampled token for request 'a'"):
    sched.update_from_output(sched.schedule(), {})


def test_requests_that_can_never_fit_are_refused():
  sched = scheduler(num_blocks=5)            # 4 usable blocks: 16 tokens
  with pytest.raises(ValueError, match='needs 5 KV blocks of 4 tokens but the whole cache '
                     'has 4; lower max_tokens'):
    sched.add_request(make('big', range(10), max_tokens=8))
  with pytest.raises(ValueError, match='60 tokens and max_tokens is 8: 68 > the model '
                     'context of 64'):
    sched.add_request(make('long', range(60), max_tokens=8))
  with pytest.raises(ValueError, match='prompt is empty'):
    sched.add_request(make('empty', []))
  fits = make('fits', range(10), max_tokens=7)   # 16 tokens, the last never fed back
  sched.add_request(fits)
  with pytest.raises(ValueError, match="'fits' is already queued"):
    sched.add_request(make('fits', [1]))
  assert sched.num_waiting == 1
  runner = FakeRunner(sched)
  for _ in range(8):
    step(sched, runner)
  assert fits.status is RequestStatus.FINISHED_LENGTH
  assert fits.output_token_ids == reference_output(range(10), fits.sampling_params, None)


def test_config_and_manager_must_agree():
  from serve.engine.kv_cache_manager import KVCacheManager  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match='max_num_seqs=0'):
    Scheduler(SchedulerConfig(max_num_seqs=0))
  with pytest.raises(ValueError, match='build both from the same numbers'):
    Scheduler(SchedulerConfig(num_blocks=12, block_size=4), KVCacheManager(12, 8))


def check_invariants(sched):
  kv, pool = sched.kv, sched.kv.pool
  holders, index = collections.Counter(), collections.defaultdict(set)
  for r in sched.running:
    assert r.status is RequestStatus.RUNNING
    ids = kv.get_block_ids(r.request_id)
    assert len(set(ids)) == len(ids) and len(ids) * kv.block_size >= r.num_computed_tokens
    for i, block_id in enumerate(ids):
      holders[block_id] += 1
      index[block_id].add(i)
  for r in sched.waiting:
    assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert kv.get_block_ids(r.request_id) == [] and r.num_computed_tokens == 0
  assert set(sched.requests) == {r.request_id for r in [*sched.running, *sched.waiting]}
  assert pool.blocks[0].ref_cnt == 1 and 0 not in holders
  for block in pool.blocks[1:]:
    assert block.ref_cnt == holders[block.block_id], block
  for block_id, n in holders.items():   # shared only as a cached prefix, at one position
    assert n == 1 or (pool.blocks[block_id].block_hash is not None
                      and len(index[block_id]) == 1)
  free = pool.free_block_ids()
  assert sorted(free) == [b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0]
  assert len(free) + len(holders) == pool.num_usable_blocks
  assert sched.num_running <= sched.cfg.max_num_seqs


def random_request(rng, name, prefixes):
  prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
  return make(name, prompt, rng.randint(1, 14), eos=rng.choice([None, 0]),
              ignore_eos=rng.random() < 0.2,
              stop_token_ids=rng.sample(range(VOCAB), rng.choice([0, 0, 1])))


def fits(sched, request):
  total = request.num_prompt_tokens + request.sampling_params.max_tokens
  return (total <= sched.cfg.max_model_len
          and -(-(total - 1) // sched.cfg.block_size) <= sched.kv.num_usable_blocks)


def random_abort(rng, sched, aborted):
  if sched.requests and rng.random() < 0.05:
    request = sched.requests[rng.choice(sorted(sched.requests))]
    sched.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
    aborted.append(request)


def run_random(seed, caching):
  rng = random.Random(seed)
  sched = scheduler(num_blocks=rng.randint(6, 16), max_num_seqs=rng.randint(1, 5),
                    max_num_batched_tokens=rng.randint(1, 16), max_model_len=32,
                    enable_prefix_caching=caching,
                    long_prefill_token_threshold=rng.choice([0, 0, 3]))
  runner = FakeRunner(sched)
  prefixes = [[], [rng.randrange(VOCAB) for _ in range(8)], list(range(4))]
  done, aborted = [], []
  for i in range(400):
    if i < 250 and rng.random() < 0.3:
      request = random_request(rng, f'r{i}', prefixes)
      if fits(sched, request):
        sched.add_request(request)
      else:
        with pytest.raises(ValueError):
          sched.add_request(request)
    random_abort(rng, sched, aborted)
    out = sched.schedule()
    check_invariants(sched)
    assert out.num_batched_tokens == sum(len(c.token_ids) for c in out.chunks)
    assert out.num_batched_tokens <= sched.cfg.max_num_batched_tokens
    sampled = runner.execute(out)
    random_abort(rng, sched, aborted)
    done += sched.update_from_output(out, sampled)
    check_invariants(sched)
  return sched, done, aborted


@pytest.mark.parametrize('caching', [False, True])
def test_random_traffic_keeps_invariants_and_outputs(caching):
  preemptions = hits = 0
  for seed in range(12):
    sched, done, aborted = run_random(seed, caching)
    assert not sched.has_unfinished_requests(), 'requests left after 150 idle steps'
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    assert len(done) > 10
    for r in done:
      assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params,
                                                    r.eos_token_id)
    for r in aborted:
      expected = reference_output(r.prompt_token_ids, r.sampling_params, r.eos_token_id)
      assert r.output_token_ids == expected[:r.num_output_tokens]
    preemptions += sched.num_preemptions
    hits += sched.prefix_cache_hits
  assert preemptions > 0                      # the scenario does exercise recompute
  assert (hits > 0) == caching


def test_scheduler_overhead_benchmark_smoke():
  from benchmarks import scheduler_overhead  # pylint: disable=import-outside-toplevel
  result = scheduler_overhead.main(['--smoke'])
  assert result['num_requests'] == 8 and 0 < result['median_step_ms'] < 1000
