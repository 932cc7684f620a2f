"""LoRA residency as vLLM has it: more adapters loaded (--max-cpu-loras) than device slots
(--max-loras); a request waits for its adapter to get a slot without holding up the
requests behind it, and never starves. Adapter names in responses and in the batch CLI.
"""

import json
import time

import pytest

from serve.engine.lora_residency import SlotTable
from serve.engine.request import Request
from serve.engine.scheduler import Scheduler, SchedulerConfig
from serve.sampling_params import SamplingParams

pytest.importorskip('peft')

# pylint: disable=wrong-import-position
from tests.test_serve_lora import (ADAPTERS, PROMPTS, VOCAB, check_equal, greedy,  # noqa: E402
                                   leak_free, lora_dirs, make_engine, reference)

__all__ = ['lora_dirs']   # the fixture, shared with tests/test_serve_lora.py


# ------------------------------------------------------------- the scheduler alone

class FakeRegistry:
  """The scheduler's side of LoraRegistry over a real SlotTable; records the writes."""

  def __init__(self, num_slots):
    self.table, self.writes = SlotTable(num_slots), []

  def slot_for(self, adapter_id, busy):
    placed = self.table.place(adapter_id, busy)
    if placed is None:
      return None
    if placed[1]:
      self.writes.append((placed[0], adapter_id))
    return placed[0]

  def prune_claims(self, waiting_ids):
    self.table.prune_claims(waiting_ids)


def request(rid, lora_id, max_tokens):
  return Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                 0.0, lora_id=lora_id)


def step(sched):
  """One schedule and a token for every sampling chunk; the ids scheduled."""
  out = sched.schedule()
  sched.update_from_output(out, {c.request_id: 7 for c in out.chunks if c.sample})
  return [c.request_id for c in out.chunks]


def test_a_request_waiting_for_a_slot_holds_up_no_one_and_does_not_starve():
  """One slot, held by adapter 1's running request. A request of adapter 2 waits for it,
  while the base's request behind it runs at once (no head-of-line blocking); adapter
  1's newcomers, arriving every step, wait behind adapter 2's claim (so it does not
  starve), which takes the slot when adapter 1's running request ends."""
  registry = FakeRegistry(1)
  sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=64, max_num_seqs=8,
                                    max_num_batched_tokens=64), lora=registry)
  sched.add_request(request('a0', 1, 3))
  assert step(sched) == ['a0'] and registry.writes == [(1, 1)]
  sched.add_request(request('b', 2, 2))
  sched.add_request(request('base', 0, 2))
  admitted_b = None
  for i in range(1, 8):
    sched.add_request(request(f'a{i}', 1, 3))
    ids = step(sched)
    if i == 1:
      assert 'base' in ids and 'b' not in ids, ids
    assert not any(r.startswith('a') and r != 'a0' for r in ids if admitted_b is None), ids
    if 'b' in ids and admitted_b is None:
      admitted_b = i
      assert registry.writes[-1] == (1, 2)
  assert admitted_b == 3, admitted_b   # a0 samples its 3rd and last token in step 2
  while sched.has_unfinished_requests():
    step(sched)
  assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_an_idle_slot_goes_to_the_least_recently_used_adapter_and_claims_lapse():
  table = SlotTable(2)
  assert table.place(1, set()) == (1, True) and table.place(2, set()) == (2, True)
  assert table.place(1, set()) == (1, False)              # slot 1 used last
  assert table.place(3, set()) == (2, True)               # 2 is the LRU: evicted
  assert table.place(4, {1, 2}) is None                   # claims slot 1 (LRU)
  assert table.place(1, {1, 2}) is None                   # 1's newcomers wait
  table.prune_claims(set())                               # 4's requests went away
  assert table.place(1, {1, 2}) == (1, False)
  table.forget(3)
  assert table.owner == [0, 1, 0] and table.place_in_empty(5) == 2
  assert table.place_in_empty(6) is None and table.place(6, set()) == (1, True)


def test_a_claimant_takes_a_slot_that_goes_idle_before_its_busy_claimed_one():
  """Adapter 3 claims slot 1 (both slots busy); when slot 2 goes idle first, 3 takes
  it (its claim dropped) rather than wait for slot 1, which later adapters pass by to
  take slot 2."""
  registry = FakeRegistry(2)
  sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=64, max_num_seqs=8,
                                    max_num_batched_tokens=64), lora=registry)
  sched.add_request(request('long', 1, 30))
  step(sched)
  sched.add_request(request('short', 2, 2))
  step(sched)
  sched.add_request(request('x', 3, 2))
  step(sched)
  assert registry.table._claims == {1: 3}   # pylint: disable=protected-access
  assert 'x' in step(sched) and registry.table.owner == [0, 1, 3]
  assert registry.table._claims == {}   # pylint: disable=protected-access


class FailingSlots:
  """LoraSlots' write over a dict {slot: the adapter whose weights it holds}; the next
  write raises when told to, after writing part of the slot."""
  max_loras, max_rank = 1, 8

  def __init__(self):
    self.content, self.fail = {1: None}, False

  def write(self, slot, weights):
    if self.fail:
      self.fail = False
      self.content[slot] = 'half of ' + weights['tag']
      raise RuntimeError('device out of memory')
    self.content[slot] = weights['tag']


@pytest.fixture
def failing_registry(monkeypatch):
  from serve.engine import lora_registry  # pylint: disable=import-outside-toplevel
  from serve.load.peft_adapter import LoraAdapter  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(lora_registry, 'read_adapter', lambda name, path, *_: LoraAdapter(
      name, path, 4, {'tag': name}, None))
  slots = FailingSlots()
  return lora_registry.LoraRegistry(None, slots, 'base', max_cpu_loras=2), slots


def test_a_failed_slot_write_at_admission_leaves_no_adapter_in_the_slot(failing_registry):
  """The write raises: the next admission writes the adapter again, not run on the
  previous adapter's weights (or half of its own)."""
  registry, slots = failing_registry
  registry.load('a', '/a')
  registry.load('b', '/b')   # no empty slot: written when a request is admitted
  b = registry.acquire('b')
  slots.fail = True
  with pytest.raises(RuntimeError):
    registry.slot_for(b, busy=set())
  assert registry.table.owner == [0, 0]
  assert slots.content[registry.slot_for(b, busy=set())] == 'b'
  a = registry.acquire('a')
  assert slots.content[registry.slot_for(a, busy=set())] == 'a'


def test_a_load_whose_slot_write_fails_serves_no_name(failing_registry):
  registry, slots = failing_registry
  registry.load('a', '/a')
  registry.unload('a')
  slots.fail = True
  with pytest.raises(RuntimeError):
    registry.load('c', '/c')
  assert registry.names() == [] and registry.table.owner == [0, 0]
  registry.load('c', '/c')   # the name and the host memory are free
  c = registry.acquire('c')
  assert slots.content[registry.slot_for(c, busy=set())] == 'c'


# ------------------------------------------------------------------- the engine

def test_more_adapters_than_slots_give_each_request_what_it_gets_alone(lora_dirs):
  """3 adapters loaded, 1 slot (the strictest: every change of adapter waits for the
  slot to drain; the LRU choice among slots is tested above): requests of all three and
  the base, interleaved and admitted at once, each equal transformers on its merged
  weights; every step's rows read at most max_loras adapters, each row's slot holding
  its own request's adapter; nothing leaks."""
  base, dirs, merged = lora_dirs
  max_loras = 1
  engine = make_engine(base, dirs, max_loras=max_loras, max_cpu_loras=3)
  seen, wrong = [], []   # recorded, not raised: an exception would stall the engine thread
  schedule = engine.scheduler.schedule

  def checked_schedule():
    out = schedule()
    pairs = {(c.lora_slot, engine.scheduler.get_request(c.request_id).lora_id)
             for c in out.chunks if c.lora_slot}
    owners = list(engine.lora.table.owner)
    if not len({s for s, _ in pairs}) == len(pairs) <= max_loras or any(
        owners[s] != a for s, a in pairs):
      wrong.append((pairs, owners))
    seen.append(pairs)
    return out

  engine.scheduler.schedule = checked_schedule
  try:
    jobs = [(p, a) for a in [*ADAPTERS, 'base'] for p in PROMPTS]
    jobs = jobs[::2] + jobs[1::2]   # adapters interleaved
    with engine._lock:   # pylint: disable=protected-access  # all queued before a step
      streams = [engine.add_request(p, greedy(), lora=None if a == 'base' else a)
                 for p, a in jobs]
    for (p, a), s in zip(jobs, streams):
      res = s.result()
      check_equal((res.token_ids, [lp.logprob for lp in res.logprobs]), reference(merged[a], p))
    assert not wrong, wrong   # a step's rows read at most max_loras slots, each its own
    assert len({a for pairs in seen for _, a in pairs}) == 3   # every adapter had a slot
    leak_free(engine)
    assert engine.lora_requests()['running'] == [] and engine.lora_requests()['waiting'] == []
  finally:
    engine.shutdown()


def test_loads_past_max_cpu_loras_are_refused_and_unloads_wait_for_queued_requests(
    lora_dirs):
  """A load past --max-cpu-loras: one line naming the flag and the adapters loaded. An
  unload while a request waits for a slot for it: the request still runs on it, and the
  adapter goes after it, nothing leaked."""
  base, dirs, merged = lora_dirs
  engine = make_engine(base, {'all8': dirs['all8']}, max_loras=1, max_cpu_loras=2)
  try:
    engine.lora.load('attn4', str(dirs['attn4']))
    with pytest.raises(ValueError) as e:
      engine.lora.load('mlp2', str(dirs['mlp2']))
    assert '--max-cpu-loras=2 adapters are loaded (all8, attn4); unload one first' in str(
        e.value) and '\n' not in str(e.value)
    with engine._lock:   # pylint: disable=protected-access  # both queued before a step
      streams = [engine.add_request(PROMPTS[0], greedy(), lora=a) for a in ('all8', 'attn4')]
      assert engine.lora.unload('attn4') == 1
    for a, s in zip(('all8', 'attn4'), streams):
      res = s.result()
      check_equal((res.token_ids, [lp.logprob for lp in res.logprobs]),
                  reference(merged[a], PROMPTS[0]))
    assert [a['name'] for a in engine.lora.names()] == ['all8']
    leak_free(engine)
    engine.lora.load('mlp2', str(dirs['mlp2']))   # attn4's host memory is free again
  finally:
    engine.shutdown()


def test_a_load_whose_slot_write_fails_midway_is_not_served_and_a_reload_is(lora_dirs):
  """The write into the empty slot raises after one target: the load fails and the
  name is not served (no request runs on half an adapter); loaded again, its requests
  equal transformers on its merged weights."""
  base, dirs, merged = lora_dirs
  engine = make_engine(base, {'all8': dirs['all8']}, max_loras=2, max_cpu_loras=2)
  slots, write = engine.lora.slots, engine.lora.slots.write

  def half_write(slot, weights):
    first = sorted(weights)[:1]
    write(slot, {t: weights[t] for t in first})
    raise RuntimeError('device out of memory')

  try:
    slots.write = half_write
    with pytest.raises(RuntimeError):
      engine.lora.load('attn4', str(dirs['attn4']))
    del slots.write
    assert [a['name'] for a in engine.lora.names()] == ['all8']
    engine.lora.load('attn4', str(dirs['attn4']))
    res = engine.generate([PROMPTS[0]], greedy(), loras=['attn4'])[0]
    check_equal((res.token_ids, [lp.logprob for lp in res.logprobs]),
                reference(merged['attn4'], PROMPTS[0]))
    leak_free(engine)
  finally:
    engine.shutdown()


def test_a_slot_write_failing_at_admission_fails_that_request_alone(lora_dirs):
  """Every write into the one slot raises (a device out of memory, say): the request whose
  adapter needs the slot ends with finish_reason 'error' and the cause; the base's and the
  resident adapter's requests beside it get what they get alone; the engine stays up and
  serves the adapter once writes work again."""
  base, dirs, merged = lora_dirs
  engine = make_engine(base, {n: dirs[n] for n in ('all8', 'attn4')}, max_loras=1,
                       max_cpu_loras=2)   # all8 written into the slot at load
  slots = engine.lora.slots

  def no_memory(slot, weights):
    raise RuntimeError('device out of memory')

  try:
    slots.write = no_memory
    # all8 runs in its slot first; attn4 waits for the slot, then its write fails.
    jobs = [(PROMPTS[0], 'base'), (PROMPTS[1], 'all8'), (PROMPTS[1], 'attn4')]
    with engine._lock:   # pylint: disable=protected-access  # all queued before a step
      streams = [engine.add_request(p, greedy(), lora=None if a == 'base' else a)
                 for p, a in jobs]
    deadline = time.monotonic() + 120   # a failure retried forever would hang here
    while engine.num_unfinished and time.monotonic() < deadline:
      time.sleep(0.05)
    assert engine.num_unfinished == 0, 'a request never finished'
    results = [s.result() for s in streams]
    assert results[2].finish_reason == 'error' and 'out of memory' in results[2].error
    for (p, a), res in zip(jobs[:2], results[:2]):
      check_equal((res.token_ids, [lp.logprob for lp in res.logprobs]),
                  reference(merged[a], p))
    assert engine.health() is None
    del slots.write
    res = engine.generate([PROMPTS[1]], greedy(), loras=['attn4'])[0]
    check_equal((res.token_ids, [lp.logprob for lp in res.logprobs]),
                reference(merged['attn4'], PROMPTS[1]))
    leak_free(engine)
  finally:
    engine.shutdown()


@pytest.mark.parametrize('kw, message', [
    ({'enable_lora': True, 'max_loras': 2, 'max_cpu_loras': 1},
     '--max-cpu-loras=1 is less than --max-loras=2'),
    ({'max_cpu_loras': 3}, 'need --enable-lora'),
    ({'enable_lora': True, 'max_loras': 1, 'max_cpu_loras': 2,
      'lora_modules': ('a=x', 'b=y', 'c=z')}, 'more than --max-cpu-loras=2'),
])
def test_bad_residency_flags_are_refused_at_start(kw, message):
  from serve.config import ServeConfig  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=message):
    ServeConfig(**kw).validate()


# ---------------------------------------------------------------- the batch CLI

def test_the_batch_cli_serves_adapters_by_each_lines_model(lora_dirs, tmp_path, capsys):
  """Lines naming two adapters and the base, one slot: each line's tokens are its
  reference's; an unknown name stops the run in one line naming the line."""
  from serve import generate  # pylint: disable=import-outside-toplevel
  base, dirs, merged = lora_dirs
  lines = [{'model': 'attn4', 'prompt_token_ids': PROMPTS[0]},
           {'prompt_token_ids': PROMPTS[1]},
           {'model': 'mlp2', 'prompt_token_ids': PROMPTS[1]},
           {'model': 'attn4', 'prompt_token_ids': PROMPTS[1]}]
  fields = {'max_tokens': 8, 'temperature': 0, 'ignore_eos': True,
            'allowed_token_ids': list(range(VOCAB))}
  path = tmp_path / 'in.jsonl'
  path.write_text(''.join(json.dumps({**line, **fields}) + '\n' for line in lines))
  flags = ['--hf-model', str(base), '--prompts', str(path), '--output',
           str(tmp_path / 'out.jsonl'), '--num-blocks', '64', '--block-size', '4',
           '--enable-lora', '--max-loras', '1', '--max-cpu-loras', '2', '--lora-modules',
           f'attn4={dirs["attn4"]}', f'mlp2={dirs["mlp2"]}']
  assert generate.main(flags) == 0
  out = [json.loads(x) for x in (tmp_path / 'out.jsonl').read_text().splitlines()]
  for line, got in zip(lines, out):
    assert got['token_ids'] == reference(merged[line.get('model', 'base')],
                                         line['prompt_token_ids'])[0]
    assert got.get('model') == line.get('model')
  with path.open('a') as f:
    f.write(json.dumps({'model': 'sql', 'prompt_token_ids': [5], **fields}) + '\n')
  assert generate.main(flags) == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith(f"error: {path} line 5: field 'model': 'sql' is not served"), err
  assert "the LoRA adapters ['attn4', 'mlp2']" in err, err
