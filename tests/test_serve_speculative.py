"""Speculative decoding (--speculative-config, n-gram drafts).

The proposer against a plain-loop reference; the config's errors; the scheduler's draft
handling by hand; and the engine: with drafts that are often right (an oracle that knows
plain decoding's output and corrupts some of it) the output is plain decoding's exactly,
greedy or seeded, under penalties, min_tokens, bad words, stop strings and logprobs; with
the real n-gram proposer on a model that repeats itself, most drafts are accepted.
"""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

import model
from serve.config import ServeConfig
from serve.engine import loop as engine_loop
from serve.engine.core import Engine
from serve.engine.kv_cache_manager import KVCacheManager
from serve.engine.request import Request, RequestStatus
from serve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from serve.engine.tracked import TrackedRequest
from serve.sampling_params import SamplingParams
from serve.spec.config import SpeculativeConfig, parse_speculative_config
from serve.spec.ngram import propose_ngram
from sharding import compile_cache
from tests.test_paged_forward import LOGITS_TOL, Chunk, Out, err, tiny_cfg, tiny_runner
from tests.test_serve_engine import make_prompts
from tests.test_serve_runner import dense_greedy

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
SMALL = dict(num_blocks=200, max_num_seqs=32, max_num_batched_tokens=256)
MAX_TOKENS = 30


# ------------------------------------------------------------------------ proposer

def ngram_reference(tokens, k, lo, hi):
  """Plain loops: the longest suffix (hi..lo) seen before; the tokens after its latest
  earlier start, continued by the draft itself where the sequence runs out."""
  size = len(tokens)
  for n in range(min(hi, size - 1), lo - 1, -1):
    for start in range(size - n - 1, -1, -1):
      if tokens[start:start + n] == tokens[size - n:]:
        seq = list(tokens)
        for i in range(k):
          seq.append(seq[start + n + i])
        return seq[size:]
  return []


def test_ngram_proposals_equal_a_plain_loop_reference():
  rng = np.random.default_rng(0)
  found = 0
  for _ in range(400):
    tokens = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(1, 30))).tolist()
    k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    hi = lo + int(rng.integers(0, 3))
    want = ngram_reference(tokens, k, lo, hi)
    assert propose_ngram(tokens, k, lo, hi) == want, (tokens, k, lo, hi)
    found += bool(want)
  assert 100 < found < 400   # both outcomes were exercised


def test_ngram_prefers_the_longest_and_latest_match_and_repeats_a_period():
  # '7 8 9' recurs once; its 2-gram '8 9' also recurs later after a different token.
  tokens = [7, 8, 9, 1, 2, 0, 8, 9, 5, 3, 7, 8, 9]
  assert propose_ngram(tokens, 3, 2, 3) == [1, 2, 0]        # 3-gram at 0
  assert propose_ngram(tokens, 3, 2, 2) == [5, 3, 7]        # latest 2-gram, at 6
  assert propose_ngram([1, 2, 1, 2, 1], 5, 1, 2) == [2, 1, 2, 1, 2]
  assert propose_ngram([1, 2, 3], 4, 1, 3) == []
  assert propose_ngram([5], 4, 1, 3) == []


def test_speculative_config_parses_as_vllm_and_refuses_with_the_fix():
  assert parse_speculative_config('') is None
  cfg = parse_speculative_config(NGRAM)
  assert cfg == SpeculativeConfig('ngram', 4, 4, 2)
  assert parse_speculative_config({'method': 'ngram', 'prompt_lookup_max': 5}) == (
      SpeculativeConfig('ngram', 4, 5, 5))
  assert parse_speculative_config({'method': 'ngram', 'prompt_lookup_min': 3}) == (
      SpeculativeConfig('ngram', 4, 3, 3))
  bad = [('{"method": "ngram"', 'not JSON'), ('[1]', 'JSON object'),
         ('{"num_speculative_tokens": 2}', 'needs "method"'),
         ('{"method": "eagle"}', 'not supported'),
         ('{"method": "ngram", "num_speculative_tokens": 0}', 'at least 1'),
         ('{"method": "ngram", "num_speculative_tokens": 2.5}', 'integer'),
         ('{"method": "ngram", "num_speculative_tokens": 65}', 'more than 64'),
         ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', 'min <= max'),
         ('{"method": "ngram", "model": "x"}', 'unknown field')]
  for text, message in bad:
    with pytest.raises(ValueError, match=message):
      ServeConfig(speculative_config=text).validate()


# ------------------------------------------------------------------------ scheduler

def make_request(rid, prompt, max_tokens=20, **kw):
  return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw),
                 None, 0.0)


def decoding(sched, request, outputs):
  """Admits the request and runs its prefill, sampling `outputs[0]`; then the others one
  by one, so the request is in decode with len(outputs) tokens out."""
  sched.add_request(request)
  for token in outputs:
    out = sched.schedule()
    sched.update_from_output(out, {request.request_id: token})
  return request


def test_scheduler_carries_drafts_within_budget_max_tokens_and_blocks():
  sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32, max_num_batched_tokens=6))
  req = decoding(sched, make_request('a', range(5), max_tokens=8), [9, 9])
  req.spec_token_ids = [1, 2, 3, 4, 5, 6]
  out = sched.schedule()
  [chunk] = out.chunks
  assert chunk.spec_token_ids == (1, 2, 3, 4, 5)      # the budget: 6 tokens a step
  assert chunk.token_ids == [9, 1, 2, 3, 4, 5] and chunk.start_position == 6
  assert len(chunk.block_ids) * 4 >= 12                 # the draft's K/V slots allocated
  # Two accepted, then a different token: computed up to the last accepted draft token.
  sched.update_from_output(out, {'a': [1, 2, 7]})
  assert req.output_token_ids == [9, 9, 1, 2, 7] and req.num_computed_tokens == 9
  assert req.spec_token_ids == []
  # 3 tokens left to max_tokens: at most 2 drafts (the token after them makes 3).
  req.spec_token_ids = [1, 2, 3, 4]
  out = sched.schedule()
  assert out.chunks[0].spec_token_ids == (1, 2)
  sched.update_from_output(out, {'a': [1, 2, 3]})      # all accepted, then one more
  assert req.is_finished and req.output_token_ids == [9, 9, 1, 2, 7, 1, 2, 3]
  assert len(req.output_token_ids) == 8


def test_drafts_stop_short_of_the_models_context():
  """max_tokens unset: the request may run to max_model_len (12); a draft and the token
  after it never pass it."""
  sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32, max_model_len=12))
  req = decoding(sched, make_request('a', range(5), max_tokens=None), [0])
  req.spec_token_ids = list(range(10, 20))
  out = sched.schedule()
  assert out.chunks[0].spec_token_ids == (10, 11, 12, 13, 14)   # 6 tokens + 5 + 1 = 12
  assert out.chunks[0].start_position + len(out.chunks[0].token_ids) == 11
  assert sched.update_from_output(out, {'a': [10, 11, 12, 13, 14, 15]}) == [req]
  assert req.num_tokens == 12 and req.status is RequestStatus.FINISHED_LENGTH


def test_scheduler_refuses_tokens_that_are_not_the_drafts_prefix():
  sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32))
  req = decoding(sched, make_request('a', range(5)), [9])
  req.spec_token_ids = [1, 2]
  out = sched.schedule()
  for wrong in ([2, 5], [1, 2, 3, 4], []):
    with pytest.raises(ValueError, match='not a prefix of its draft'):
      sched.update_from_output(out, {'a': wrong})


@pytest.mark.parametrize('num_blocks,a_prompt,a_max,b_prompt,free,kept', [
    (4, 6, 4, 2, 0, 1),   # 3 usable: a (7 tokens) holds 2, b (3) 1, none free
    (5, 5, 6, 4, 1, 2),   # 4 usable: a (6 tokens) holds 2, b (5) 1; b's decode needs the last
])
def test_a_draft_takes_no_block_another_request_needs(num_blocks, a_prompt, a_max, b_prompt,
                                                      free, kept):
  """a's draft would need a new block: it is cut to the slots a holds, b decodes,
  nobody is preempted; with b gone, the draft gets its block."""
  sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=num_blocks))
  a = make_request('a', range(a_prompt), max_tokens=a_max)
  sched.add_request(a)
  sched.add_request(make_request('b', range(b_prompt), max_tokens=4))
  sched.update_from_output(sched.schedule(), {'a': 7, 'b': 8})
  assert sched.kv.num_free_blocks == free
  a.spec_token_ids = [1, 2, 3]
  out = sched.schedule()
  assert [(c.token_ids, c.spec_token_ids) for c in out.chunks] == [
      ([7, 1, 2, 3][:1 + kept], (1, 2, 3)[:kept]), ([8], ())]
  assert not out.preempted_ids and len(sched.kv.get_block_ids('a')) == 2
  sched.finish_request('b', RequestStatus.FINISHED_ABORTED)
  sched.update_from_output(out, {'a': [1]})
  a.spec_token_ids = [2, 3, 4]
  assert sched.schedule().chunks[0].spec_token_ids == (2, 3, 4)[:a_max - 3]
  assert len(sched.kv.get_block_ids('a')) == 3


def test_a_draft_leaves_the_blocks_a_later_prefill_chunk_needs():
  # 6 usable blocks of 4. a decodes (4 tokens, 1 block); b is half prefilled (8 of 16
  # tokens, 2 blocks; chunks of 8); 3 free, b's next chunk needs 2: a's draft may take 1.
  sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=7, long_prefill_token_threshold=8))
  a, b = make_request('a', range(3), max_tokens=12), make_request('b', range(16), max_tokens=2)
  sched.add_request(a)
  sched.add_request(b)
  sched.update_from_output(sched.schedule(), {'a': 9})
  assert sched.kv.num_free_blocks == 3 and b.num_computed_tokens == 8
  a.spec_token_ids = list(range(20, 28))
  out = sched.schedule()
  assert [c.spec_token_ids for c in out.chunks] == [tuple(range(20, 24)), ()]
  assert [len(c.token_ids) for c in out.chunks] == [5, 8] and not out.preempted_ids


@pytest.mark.parametrize('prompt_len,draft,outputs', [
    (2, [3, 5, 6, 7], [0, 3, 5]),
    # Counted as computed, the accepted tokens after the stop would reach a block past
    # the request's tokens (7 tokens, 10 computed), which has no hash to cache it by.
    (5, [5, 6, 7, 8], [0, 5]),
])
def test_a_stop_token_among_the_accepted_ends_the_request_there(prompt_len, draft, outputs):
  """Accepted tokens after the finishing one are neither output nor computed."""
  sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32))
  req = decoding(sched, make_request('c', range(prompt_len), stop_token_ids=[5]), [0])
  req.spec_token_ids = draft
  out = sched.schedule()
  assert sched.update_from_output(out, {'c': draft + [1]}) == [req]
  assert req.output_token_ids == outputs and req.stop_reason == 5 and req.is_finished


def test_rejected_draft_tokens_never_reach_the_prefix_cache():
  """A block filled by a rejected draft is not cached under the request's real tokens:
  a later request with the real tokens as its prompt finds only the blocks really
  computed."""
  kv = KVCacheManager(32, 4)
  sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32), kv)
  req = decoding(sched, make_request('a', [1, 2, 3]), [4])
  req.spec_token_ids = [5, 6, 7, 8, 9]   # would fill block 1 (tokens 4..7) and more
  out = sched.schedule()
  sched.update_from_output(out, {'a': [5, 0]})          # one accepted, then 0
  assert req.all_token_ids == [1, 2, 3, 4, 5, 0] and req.num_computed_tokens == 5
  later = make_request('b', [1, 2, 3, 4, 5, 6, 7, 8, 9])
  assert len(kv.get_computed_blocks(later)) == 1        # block 0 only


# ------------------------------------------------------------------------ guides

@pytest.mark.parametrize('kind', ['regex', 'grammar'])
def test_a_guide_follows_a_draft_as_far_as_it_allows_and_comes_back(tiny_served, kind):
  """draft_words: the allowed set before the draft and after each token the guide
  takes, stopping at the first it refuses or an end id; the guide is where it was."""
  from serve.structured import guided  # pylint: disable=import-outside-toplevel
  tok, eos = tiny_served.tokenizer, tiny_served.eos_token_ids
  guides = guided.GuidedDecoding(tok, eos)
  make = {'regex': lambda: guides.guide('(ab)+c'),
          'grammar': lambda: guides.guide(grammar='root ::= ("ab")+ "c"')}[kind]
  a, b, c, x = b'abcx'

  def allowed_after(prefix):   # an independent walk: a fresh guide advanced for real
    g = make()
    for t in prefix:
      g.advance(t)
    return g.words()

  g = make()
  g.advance(a)
  for draft, follows in (([b, a, b, c], 4), ([b, a, x, c], 2), ([b, c, eos[0], a], 2),
                         ([x], 0), ([], 0)):
    out = g.draft_words(draft, eos)
    assert len(out) == follows + 1, draft
    for j, words in enumerate(out):
      np.testing.assert_array_equal(words, allowed_after([a] + draft[:j]))
    np.testing.assert_array_equal(g.words(), allowed_after([a]))   # back where it was
  g.advance(b)
  g.advance(c)   # the real path goes on from there
  assert g.is_finished or bool(g.words()[eos[0] // 32] >> np.uint32(eos[0] % 32) & 1)


# ------------------------------------------------------------------------ runner

@pytest.mark.parametrize('impl', ['xla', 'pallas'])
def test_runner_returns_a_logits_row_per_draft_token_as_the_dense_forward(impl):
  """A decode chunk with 3 draft tokens (the true continuation, then a wrong one) beside
  a plain decode: 4 + 1 rows, each the dense forward's logits at its position (the
  Pallas kernel interpreted on CPU)."""
  cfg = tiny_cfg()
  params = model.init_params(cfg, jax.random.key(1))
  runner = tiny_runner(params, cfg, num_speculative_tokens=3, attention=impl)
  prompts = [[5, 9, 3, 7, 11, 2], [4, 4, 8]]
  want = [dense_greedy(params, cfg, p, 4) for p in prompts]
  blocks = [[1, 2, 3], [4, 5]]
  runner.execute(Out([Chunk(p, 0, b, True) for p, b in zip(prompts, blocks)]))
  (seq, rows), (other, other_rows) = want
  draft = (seq[1], seq[2], (seq[3] + 1) % cfg.vocab_size)
  chunks = [ScheduledChunk('a', [seq[0], *draft], len(prompts[0]), blocks[0], True, draft),
            ScheduledChunk('b', [other[0]], len(prompts[1]), blocks[1], True)]
  got = np.asarray(runner.execute(Out(chunks)))
  assert got.shape[0] == 5
  for i in range(3):   # rows after seq[0], seq[1], seq[2]: the dense forward's
    assert err(got[i], rows[i + 1]) < LOGITS_TOL
  assert err(got[4], other_rows[1]) < LOGITS_TOL


# ------------------------------------------------------------------------ engine

@pytest.fixture(scope='module')
def varied(tiny_served):
  """The tiny model with random weights of std 0.3 (as test_serve_engine's): varied
  continuations, so that a wrong draft is a different token."""
  cfg = dataclasses.replace(tiny_served.model_cfg, init_std=0.3)
  return dataclasses.replace(tiny_served, model_cfg=cfg,
                             params=model.init_params(cfg, jax.random.key(0)))


@pytest.fixture(scope='module')
def engines(varied):
  plain = Engine(varied, ServeConfig(**SMALL))
  spec = Engine(varied, ServeConfig(**SMALL, speculative_config=NGRAM))
  yield plain, spec
  plain.shutdown()
  spec.shutdown()


@pytest.fixture(scope='module')
def prompts():
  return [p[:20] for p in make_prompts(12, seed=3)]


class Oracle:
  """Drafts from known outputs: the next tokens of the request's plain-decoding output,
  each replaced by a wrong one with probability `wrong`, so drafts are accepted whole,
  in part and not at all."""

  def __init__(self, prompts, outputs, wrong=0.25, seed=0):
    self.known = {tuple(p): list(o) for p, o in zip(prompts, outputs)}
    self.wrong, self.rng = wrong, np.random.default_rng(seed)

  def __call__(self, tokens, k, lo, hi):
    del lo, hi
    prompt = max((p for p in self.known if tuple(tokens[:len(p)]) == p), key=len)
    out, done = self.known[prompt], len(tokens) - len(prompt)
    draft = list(out[done:done + k])
    for i in range(len(draft)):
      if self.rng.random() < self.wrong:
        draft[i] = (draft[i] + 1 + int(self.rng.integers(200))) % 256
    return draft


def spec_stats(eng):
  s = eng.stats()
  # Per position: accepted there means accepted at every position before it.
  per_pos = s.spec_decode_num_accepted_tokens_per_pos
  assert sum(per_pos) == s.spec_decode_num_accepted_tokens
  assert list(per_pos) == sorted(per_pos, reverse=True) and per_pos[0] <= s.spec_decode_num_drafts
  return np.array([s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
                   s.spec_decode_num_accepted_tokens])


def run_both(engines, prompts, params, monkeypatch, wrong=0.25):
  """Plain decoding's results, and the speculative engine's with oracle drafts; with the
  draft counters' change."""
  plain, spec = engines
  want = plain.generate(prompts, params)
  oracle = Oracle(prompts, [r.token_ids for r in want], wrong)
  monkeypatch.setattr(engine_loop, 'propose_ngram', oracle)
  before = spec_stats(spec)
  got = spec.generate(prompts, params)
  return want, got, spec_stats(spec) - before


def assert_same(want, got):
  for w, g in zip(want, got):
    assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert g.metrics.num_prompt_tokens == w.metrics.num_prompt_tokens


def test_greedy_with_drafts_equals_plain_decoding(engines, prompts, monkeypatch):
  spec = engines[1]
  params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
  want, got, (drafts, drafted, accepted) = run_both(engines, prompts, params, monkeypatch)
  assert_same(want, got)
  assert len({tuple(r.token_ids) for r in want}) == len(prompts)
  # Drafts were accepted in part: whole ones and wrong ones both happened.
  assert drafts > 0 and 0.3 * drafted < accepted < 0.9 * drafted, (drafts, drafted, accepted)
  # Latencies per step, as vLLM counts them: a step's accepted tokens share one time.
  assert [len(w.metrics.token_times) for w in want] == [MAX_TOKENS] * len(prompts)
  assert sum(len(g.metrics.token_times) for g in got) == MAX_TOKENS * len(prompts) - accepted
  # The blocks those steps filled (drafts accepted and rejected in them) are cached right:
  # prompts that continue the outputs find them and go on as plain decoding does.
  longer = [p + g.token_ids[:28] for p, g in zip(prompts, got) if len(p) == 20]
  short = dataclasses.replace(params, max_tokens=8)
  hits = spec.stats().prefix_cache_hits
  want, got, _ = run_both(engines, longer, short, monkeypatch)
  assert_same(want, got)
  assert spec.stats().prefix_cache_hits - hits >= 32 * len(longer) > 0


def test_seeded_sampling_with_penalties_and_bans_equals_plain_decoding(engines, prompts,
                                                                     monkeypatch):
  """Each draft row is sampled with the key, penalties, min_tokens and bad-word bans of
  its own position: a seeded request's tokens are plain decoding's."""
  kinds = [dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9),
           dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5,
                presence_penalty=0.5, logit_bias={32: 2.0}),
           dict(temperature=0.0, frequency_penalty=1.0, min_tokens=10),
           dict(temperature=1.0, bad_words=['e', 'th'], min_p=0.05)]
  params = [SamplingParams(max_tokens=MAX_TOKENS, seed=i, **kind)
            for i, kind in zip(range(len(prompts)), itertools.cycle(kinds))]
  want, got, (drafts, drafted, accepted) = run_both(engines, prompts, params, monkeypatch)
  assert_same(want, got)
  assert drafts > 0 and 0 < accepted < drafted


def test_logprobs_stop_strings_and_stop_ids_with_drafts_equal_plain_decoding(
    engines, prompts, monkeypatch):
  plain, _ = engines
  base = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
  first = plain.generate(prompts, base)
  # Per prompt: a stop string or a stop id from its own output, at outputs 8..19 (so
  # prompt + output crosses a 16-token block boundary near the stop for some), so the
  # stop falls inside an accepted draft, with accepted tokens after it.
  params = []
  for i, r in enumerate(first):
    if i % 2:
      params.append(dataclasses.replace(base, stop_token_ids=[r.token_ids[8 + i]], logprobs=2))
    else:
      params.append(dataclasses.replace(base, stop=[r.text[8 + i:10 + i] or r.text[-2:]]))
  want, got, (_, drafted, accepted) = run_both(engines, prompts, params, monkeypatch,
                                               wrong=0.1)
  assert_same(want, got)
  assert sum(r.finish_reason == 'stop' for r in want) >= len(prompts) // 2
  for w, g in zip(want, got):
    if w.logprobs is not None:
      assert [(x.token_id, x.rank, [t for t, _ in x.top]) for x in g.logprobs] == [
          (x.token_id, x.rank, [t for t, _ in x.top]) for x in w.logprobs]
      np.testing.assert_allclose([x.logprob for x in g.logprobs],
                                 [x.logprob for x in w.logprobs], rtol=1e-5, atol=1e-5)
  assert accepted > drafted // 2
  # A stop string inside the accepted tokens: the request's count ends at it too.
  _, spec = engines
  for p, ask, w in zip(prompts, params, want):
    if ask.stop and w.finish_reason == 'stop':
      outs = list(spec.add_request(p, ask))
      assert outs[-1].num_output_tokens == len(w.token_ids)


def test_structured_output_with_drafts_equals_plain_decoding(engines, prompts, monkeypatch):
  """A guide follows each draft as far as it allows: row j may draw what the guide
  allows after the draft's first j tokens. Greedy and seeded outputs are plain
  decoding's, for a choice, a regular expression, a JSON schema and a grammar."""
  from serve.api.openai_sampling import from_openai  # pylint: disable=import-outside-toplevel
  from tests.test_serve_engine import GUIDED, LISTS_GRAMMAR  # pylint: disable=import-outside-toplevel
  _, spec = engines
  asks = []
  for fields in [*GUIDED.values(), {'guided_grammar': LISTS_GRAMMAR}]:
    ask = from_openai({**fields, 'max_tokens': 40, 'temperature': 0}, spec.vocab_size)
    asks += [ask, dataclasses.replace(ask, temperature=1.0, seed=len(asks))]
  assert len(asks) <= len(prompts) and max(map(len, prompts)) + 40 <= 64
  want, got, (drafts, drafted, accepted) = run_both(
      engines, prompts[:len(asks)], asks, monkeypatch, wrong=0.15)
  assert_same(want, got)
  assert sum(w.finish_reason == 'stop' for w in want) >= len(asks) // 2
  assert drafts > 0 and 0 < accepted < drafted


def test_a_guide_that_cannot_look_ahead_takes_no_draft_token(engines, prompts, monkeypatch):
  """draft_words failing (llguidance refusing to copy its parser, say) costs that step's
  draft only: the outputs are still plain decoding's."""
  from serve.api.openai_sampling import from_openai  # pylint: disable=import-outside-toplevel
  from serve.structured import guided  # pylint: disable=import-outside-toplevel

  def refuse(self, draft, end_ids=()):
    raise ValueError('cannot look ahead')
  monkeypatch.setattr(guided.RequestGuide, 'draft_words', refuse)
  ask = from_openai({'guided_regex': '([a-z]{3} ){6}', 'max_tokens': 30, 'temperature': 0},
                    engines[0].vocab_size)
  want, got, (drafts, _, accepted) = run_both(engines, prompts[:3], ask, monkeypatch,
                                              wrong=0.0)
  assert_same(want, got)
  assert drafts > 0 and accepted == 0


def test_a_guide_failing_mid_stream_fails_its_request_only(engines, prompts):
  """A token the guide cannot follow ends that request ('error') when its output goes
  out, which is while its next step runs: the other requests of that step go on, each
  with the tokens it gets alone (its own logits rows, not its neighbour's)."""
  from serve.api.openai_sampling import from_openai  # pylint: disable=import-outside-toplevel
  plain, _ = engines
  ask = from_openai({'guided_regex': '[a-z]{30}', 'max_tokens': 20, 'temperature': 0},
                    plain.vocab_size)
  base = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
  alone = [plain.generate([p], base)[0].token_ids for p in prompts[1:4]]
  with plain._lock:   # pylint: disable=protected-access
    stream = plain.add_request(prompts[0], ask)
    others = [plain.add_request(p, base) for p in prompts[1:4]]
    guide = plain._tracked[stream.request_id].guide   # pylint: disable=protected-access
    real, calls = guide.advance, []

    def breaks_at_the_third(token):
      calls.append(token)
      if len(calls) == 3:
        raise ValueError('the guide broke')
      real(token)
    guide.advance = breaks_at_the_third
  out = stream.result()
  assert out.finish_reason == 'error' and 'the guide broke' in out.error
  assert len(out.token_ids) == 2
  for other, want in zip(others, alone):
    result = other.result()
    assert (result.finish_reason, result.token_ids) == ('length', want), result.error


def test_min_tokens_ends_a_draft_row_past_it_as_plain_decoding_does(engines, prompts,
                                                                    monkeypatch):
  """A stop id X first drawn at output position q, with min_tokens=q: X is banned before
  q and allowed at q, so plain decoding stops at q. A draft row at q is past min_tokens
  even when its step began before q: it stops there too."""
  plain, _ = engines
  base = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
  free = plain.generate(prompts, base)
  params = []
  for r in free:
    q = next(q for q in range(8, MAX_TOKENS) if r.token_ids[q] not in r.token_ids[:q])
    params.append(dataclasses.replace(base, stop_token_ids=[r.token_ids[q]], min_tokens=q))
  want, got, (drafts, _, _) = run_both(engines, prompts, params, monkeypatch)
  assert_same(want, got)
  assert all(w.finish_reason == 'stop' for w in want) and drafts > 0


def test_a_draft_rows_bans_see_the_draft_before_it():
  req = Request('r', [1, 2], SamplingParams(min_tokens=3), 9, 0.0, output_token_ids=[5])
  t = TrackedRequest(req, None, None, None, bad_words=[[116, 104], [7]])
  assert sorted(t.constraints()[0]) == [7, 9]               # eos before min_tokens
  assert sorted(t.constraints((116,))[0]) == [7, 9, 104]    # 'th' would complete
  assert sorted(t.constraints((116, 3))[0]) == [7]          # 3 outputs: eos allowed


def test_warmup_covers_draft_steps(varied, prompts, monkeypatch):
  """With drafts a step samples up to max_num_seqs x (1 + num_speculative_tokens) rows:
  after warm-up, greedy and sampled draft steps compile no step or sampler program."""
  from serve.worker import sampler  # pylint: disable=import-outside-toplevel
  sampler._sample_rows.clear_cache()   # pylint: disable=protected-access
  cfg = ServeConfig(num_blocks=60, max_num_seqs=4, max_num_batched_tokens=32, warmup=True,
                    speculative_config=NGRAM)
  with Engine(varied, cfg) as eng:
    steps, programs = eng.runner.num_compiles, sampler._sample_rows._cache_size()  # pylint: disable=protected-access
    built = compile_cache.programs()   # any program: the sampler's row cuts too
    outputs = [[(t + 1) % 256 for t in range(i, i + 40)] for i in range(4)]
    monkeypatch.setattr(engine_loop, 'propose_ngram', Oracle(prompts[:4], outputs, 0.0))
    for kind in (dict(temperature=0.0), dict(temperature=1.0, seed=1)):
      eng.generate(prompts[:4], SamplingParams(max_tokens=20, ignore_eos=True, **kind))
    assert eng.stats().spec_decode_num_draft_tokens >= 8 * 4 * 2
    assert eng.runner.num_compiles == steps
    assert sampler._sample_rows._cache_size() == programs  # pylint: disable=protected-access
    assert compile_cache.programs() == built


@pytest.fixture(scope='module')
def repeating(tiny_served):
  """The shared model after 30 training steps: it continues any prompt with a run of
  one token, which the n-gram proposer predicts."""
  return tiny_served


def test_ngram_drafts_on_a_repeating_model_are_mostly_accepted(repeating):
  prompts = [p[:16] for p in make_prompts(6, seed=5)]
  params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
  with Engine(repeating, ServeConfig(**SMALL)) as plain:
    want = plain.generate(prompts, params)
  with Engine(repeating, ServeConfig(**SMALL, speculative_config=NGRAM)) as spec:
    got = spec.generate(prompts, params)
    drafts, drafted, accepted = spec_stats(spec)
  assert_same(want, got)
  assert accepted > 0.8 * drafted and drafts < 40 * len(prompts) / 3
