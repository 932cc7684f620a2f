"""A differential stress test of the engine: whatever the other requests do, each request
returns exactly what it returns alone.

Per seed, a random mix of requests (prompt lengths with shared prefixes, greedy and
seeded sampling, penalties, stop strings, logprobs, structured output) runs at once on
an engine with n-gram drafts (fed by an oracle that knows each request's output and
corrupts some of it, so drafts are accepted whole, in part and not at all) and a cache
small enough to preempt, while some requests are aborted by the engine or by their
reader (a client disconnect), and failures are injected: a guide that raises on a token,
a detokenizer that raises on a token, and a model step that raises once. The reference is
each request run alone on the idle engine. Then:

- a request nobody failed or aborted returns its solo tokens, text, finish reason and
  logprobs;
- a failed request ends with an error (its tokens a prefix of the solo ones), and one
  aborted before its end with 'abort';
- afterwards every block is free and neither the engine nor its scheduler tracks a request.

CI runs STRESS_SEEDS seeds; `pytest tests/test_serve_stress.py --stress-seeds 200` runs more.
"""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

import model
from serve.api.openai_sampling import from_openai
from serve.config import ServeConfig
from serve.engine import loop as engine_loop
from serve.engine.core import Engine
from serve.engine.outputs import collect
from serve.sampling_params import SamplingParams
from tests.test_serve_engine import GUIDED, make_prompts

STRESS_SEEDS = 3
CONFIG = ServeConfig(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=64,
                     speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
MAX_PROMPT, MAX_TOKENS = 28, 20      # within the tiny model's 64-token context
LOGPROB_TOL = 1e-5


def pytest_generate_tests(metafunc):
  if 'seed' in metafunc.fixturenames:
    count = metafunc.config.getoption('stress_seeds', None) or STRESS_SEEDS
    metafunc.parametrize('seed', range(count))


@pytest.fixture(scope='module')
def varied(tiny_served):
  """test_serve_engine's sharper random weights: a different continuation per prompt."""
  cfg = dataclasses.replace(tiny_served.model_cfg, init_std=0.3)
  return dataclasses.replace(tiny_served, model_cfg=cfg,
                             params=model.init_params(cfg, jax.random.key(0)))


@pytest.fixture(scope='module')
def engine(varied):
  eng = Engine(varied, CONFIG)
  yield eng
  eng.shutdown()


@pytest.fixture(scope='module')
def solo_cache():
  return {}


# ------------------------------------------------------------------------ the mix

@dataclasses.dataclass
class Plan:
  """One request of a mix and what happens to it."""
  prompt: list[int]
  params: SamplingParams
  abort_at: int | None = None        # engine.abort after this many outputs (0: at once)
  disconnect_at: int | None = None   # the reader aborts its stream after this many
  guide_fails_at: int | None = None  # the guide's advance raises on this call (0-based)
  detok_fails_at: int | None = None  # the detokenizer's add raises on this call
  late: bool = False                 # submitted once the first wave is running


def random_params(rng, vocab_size: int) -> SamplingParams:
  kind = rng.choice(['greedy', 'seeded', 'penalties', 'guided'], p=[0.35, 0.3, 0.15, 0.2])
  fields = dict(max_tokens=int(rng.integers(4, MAX_TOKENS + 1)),
                ignore_eos=bool(rng.random() < 0.7))
  if kind == 'guided':
    ask = from_openai({**list(GUIDED.values())[int(rng.integers(len(GUIDED)))],
                       'max_tokens': fields['max_tokens'], 'temperature': 0}, vocab_size)
    fields = {}
  else:
    ask = SamplingParams(temperature=0.0)
  if kind != 'greedy':
    fields.update(temperature=float(rng.choice([0.7, 1.0])), seed=int(rng.integers(1 << 20)))
    if rng.random() < 0.5:
      fields.update(top_k=int(rng.choice([5, 40])), top_p=float(rng.choice([0.8, 1.0])))
  if kind == 'penalties':
    fields.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)
  if rng.random() < 0.25:
    fields.update(stop=[str(rng.choice([' ', 'e', 't', 'a', '\n']))])
  if rng.random() < 0.3:
    fields.update(logprobs=int(rng.integers(0, 3)))
  return dataclasses.replace(ask, **fields)


def random_mix(seed: int, vocab_size: int) -> list[Plan]:
  rng = np.random.default_rng(seed)
  bases = make_prompts(4, seed=seed)   # shared prefixes: prefix-cache hits
  plans = []
  for i in range(int(rng.integers(8, 13))):
    base = bases[int(rng.integers(len(bases)))]
    prompt = base[:int(rng.integers(3, min(len(base), MAX_PROMPT) + 1))]
    plan = Plan(prompt, random_params(rng, vocab_size), late=i >= 5 and rng.random() < 0.6)
    event = rng.choice(['none', 'abort', 'disconnect', 'guide', 'detokenizer'],
                       p=[0.55, 0.1, 0.1, 0.1, 0.15])
    if event == 'abort':
      plan.abort_at = int(rng.integers(0, 4))
    elif event == 'disconnect':
      plan.disconnect_at = int(rng.integers(1, 6))
    elif event == 'detokenizer':
      plan.detok_fails_at = int(rng.integers(0, 6))
    if plan.params.guided and (event == 'guide' or rng.random() < 0.3):
      plan.guide_fails_at = int(rng.integers(0, 4))
    plans.append(plan)
  return plans


# ------------------------------------------------------------------------ running it

class Oracle:
  """Drafts from the solo outputs: the next tokens of a request whose solo sequence
  continues `tokens`, each replaced by a wrong one with probability 0.3."""

  def __init__(self, sequences, seed):
    self.sequences, self.rng = sequences, np.random.default_rng(seed)

  def __call__(self, tokens, k, lo, hi):
    del lo, hi
    tokens = list(tokens)
    for seq in self.sequences:
      if len(seq) > len(tokens) and seq[:len(tokens)] == tokens:
        draft = seq[len(tokens):len(tokens) + k]
        return [(t + 1) % 256 if self.rng.random() < 0.3 else t for t in draft]
    return []


def fail_on_call(fn, call: int, what: str, fired: list):
  """fn, raising on its call-th call (0-based); fired records that it did."""
  calls = [0]

  def wrapped(*args):
    calls[0] += 1
    if calls[0] == call + 1:
      fired.append(what)
      raise ValueError(f'injected {what} failure')
    return fn(*args)
  return wrapped


class FailingGuide:
  """A guide whose call-th advance by the engine raises, as a guide does when its parser
  fails; draft walks (draft_words) go to the real guide and count nothing."""

  def __init__(self, guide, call: int, fired: list):
    self._guide = guide
    self.advance = fail_on_call(guide.advance, call, 'guide', fired)

  def __getattr__(self, name):
    return getattr(self._guide, name)


def submit(eng, plan: Plan, fired: list):
  """Adds the request, its failures wired in before the engine can step it."""
  with eng._lock:   # pylint: disable=protected-access
    stream = eng.add_request(plan.prompt, plan.params)
    t = eng._tracked[stream.request_id]   # pylint: disable=protected-access
    if plan.guide_fails_at is not None:
      t.guide = FailingGuide(t.guide, plan.guide_fails_at, fired)
    if plan.detok_fails_at is not None:
      t.detok.add = fail_on_call(t.detok.add, plan.detok_fails_at, 'detokenizer', fired)
  return stream


def read(eng, stream, plan: Plan, sink: list, started: threading.Event):
  outs = []
  if plan.abort_at == 0:
    eng.abort(stream.request_id)
  for out in stream:
    outs.append(out)
    started.set()
    if len(outs) == plan.abort_at:
      eng.abort(stream.request_id)
    if len(outs) == plan.disconnect_at:
      stream.abort()
  sink.append(collect(stream.request_id, plan.prompt, outs))


def run_mix(eng, plans: list[Plan], step_fails_at: int):
  """Runs the plans together: (results in plan order, per plan the failures that fired,
  the request ids of the step that raised)."""
  real_step, steps, failed_step = eng.runner.step, [0], []

  def step(out, *args):
    steps[0] += 1
    if steps[0] == step_fails_at:
      failed_step.extend(c.request_id for c in out.chunks)
      raise RuntimeError('injected step failure')
    return real_step(out, *args)

  fired = [[] for _ in plans]
  sinks = [[] for _ in plans]
  ids, threads, started = [None] * len(plans), [], threading.Event()
  eng.runner.step = step
  try:
    for late in (False, True):
      if late:
        started.wait(30)
      with eng._lock:   # pylint: disable=protected-access  (a wave meets one schedule)
        for i, plan in enumerate(plans):
          if plan.late == late:
            stream = submit(eng, plan, fired[i])
            ids[i] = stream.request_id
            threads.append(threading.Thread(target=read,
                                            args=(eng, stream, plan, sinks[i], started)))
            threads[-1].start()
    for t in threads:
      t.join(120)
      assert not t.is_alive(), 'a request never finished'
  finally:
    eng.runner.step = real_step
  return [s[0] for s in sinks], fired, {ids.index(rid) for rid in failed_step if rid in ids}


def solo(eng, plan: Plan, cache: dict):
  key = (tuple(plan.prompt), repr(plan.params))
  if key not in cache:
    cache[key] = eng.generate([plan.prompt], plan.params)[0]
  return cache[key]


def wait_at_rest(eng, timeout=30.0):
  deadline = time.monotonic() + timeout
  while (eng.num_unfinished or eng._aborts   # pylint: disable=protected-access
         or eng.stats().num_running or eng.stats().num_waiting):
    assert time.monotonic() < deadline, f'engine still busy: {eng.stats()}'
    time.sleep(0.01)


# ------------------------------------------------------------------------ checks

def assert_same(got, want, where: str):
  assert (got.token_ids, got.text, got.finish_reason) == (
      want.token_ids, want.text, want.finish_reason), (where, got.error)
  assert (got.logprobs is None) == (want.logprobs is None), where
  if want.logprobs is not None:
    assert [(x.token_id, x.rank, [t for t, _ in x.top or []]) for x in got.logprobs] == [
        (x.token_id, x.rank, [t for t, _ in x.top or []]) for x in want.logprobs], where
    np.testing.assert_allclose([x.logprob for x in got.logprobs],
                               [x.logprob for x in want.logprobs], rtol=LOGPROB_TOL,
                               atol=LOGPROB_TOL, err_msg=where)


def assert_prefix(got, want, where: str):
  assert got.token_ids == want.token_ids[:len(got.token_ids)], (where, got.error)


def assert_nothing_held(eng):
  wait_at_rest(eng)
  sched = eng.scheduler
  assert not eng._tracked and not eng._aborts   # pylint: disable=protected-access
  assert not sched.requests and not sched.running and not sched.waiting
  assert sched.kv.num_free_blocks == eng.num_blocks - 1, 'a block leaked'
  assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks[1:])


def run_seed(eng, seed: int, cache: dict, monkeypatch) -> dict:
  """Runs seed's mix, checks every request against its solo run and the engine at rest
  after; what the mix exercised."""
  plans = random_mix(seed, eng.vocab_size)
  wait_at_rest(eng)
  want = [solo(eng, p, cache) for p in plans]
  monkeypatch.setattr(engine_loop, 'propose_ngram',
                      Oracle([p.prompt + w.token_ids for p, w in zip(plans, want)], seed))
  before = eng.stats()
  got, fired, step_failed = run_mix(eng, plans, int(np.random.default_rng(seed).integers(2, 8)))
  for i, (plan, g, w) in enumerate(zip(plans, got, want)):
    where = f'seed {seed}, request {i}: {plan}'
    if fired[i] or i in step_failed:
      assert g.finish_reason == 'error' and g.error, where
      assert_prefix(g, w, where)
    elif g.finish_reason == 'abort':
      assert plan.abort_at is not None or plan.disconnect_at is not None, (where, g.error)
      assert_prefix(g, w, where)
    else:
      assert_same(g, w, where)
  assert_nothing_held(eng)
  after = eng.stats()
  return dict(
      preempted=after.num_preemptions - before.num_preemptions,
      hits=after.prefix_cache_hits - before.prefix_cache_hits,
      drafted=after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
      accepted=after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
      guide=sum('guide' in f for f in fired), detokenizer=sum('detokenizer' in f for f in fired),
      step=int(bool(step_failed)), aborted=sum(g.finish_reason == 'abort' for g in got))


@pytest.fixture(scope='module')
def outcomes():
  return {}   # seed -> what its mix exercised


def test_every_request_gets_what_it_gets_alone(engine, solo_cache, outcomes, seed,
                                               monkeypatch):
  outcomes[seed] = run_seed(engine, seed, solo_cache, monkeypatch)


def test_the_mixes_cover_what_they_claim(engine, solo_cache, outcomes, monkeypatch):
  """Over the CI seeds: preemptions, prefix hits, drafts accepted and refused, each
  injected failure firing, aborts that cut a request short."""
  for seed in range(STRESS_SEEDS):
    if seed not in outcomes:
      outcomes[seed] = run_seed(engine, seed, solo_cache, monkeypatch)
  seen = {k: sum(outcomes[s][k] for s in range(STRESS_SEEDS)) for k in outcomes[0]}
  assert all(seen.values()) and seen['accepted'] < seen['drafted'], seen
