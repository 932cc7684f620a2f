"""The sampler against a float64 numpy implementation written here; the request validation."""

import numpy as np
import pytest

from serve.api.openai_sampling import from_openai
from serve.sampling_params import SamplingParams, SamplingParamsError
from serve.worker import logits_adjust, sampler
from serve.worker.penalties import PenaltyRow, PenaltyState
from serve.worker.sampler import Sampler, sample
from sharding import compile_cache

VOCAB, PADDED = 257, 320


def np_filtered_logprobs(logits, temperature, top_k, top_p, min_p):
  """Reference: HF's order (temperature, top-k, top-p on the survivors, min-p), float64,
  by sorting; tokens tied with the last one a filter needs are kept."""
  x = np.asarray(logits, np.float64) / temperature
  keep = np.ones(x.shape, bool)
  if top_k > 0:
    keep &= x >= np.sort(x)[::-1][min(top_k, len(x)) - 1]
  if top_p < 1.0:
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    desc = np.sort(probs)[::-1]
    needed = np.searchsorted(np.cumsum(desc), top_p)    # first prefix with mass >= top_p
    keep &= probs >= desc[min(needed, len(x) - 1)]
  full = np.exp(x - x.max())
  keep &= full >= min_p * full.max()
  kept = np.where(keep, x, -np.inf)
  return kept - np.log(np.exp(kept - kept.max()).sum()) - kept.max()


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  return x - x.max() - np.log(np.exp(x - x.max()).sum())


def random_settings(rng, n):
  return dict(temperature=rng.choice([0.3, 0.7, 1.0, 1.6], n),
              top_k=rng.choice([0, 1, 3, 10, 40, 500], n),
              top_p=rng.choice([1.0, 0.95, 0.6, 0.2], n),
              min_p=rng.choice([0.0, 0.02, 0.3], n))


def as_arrays(settings):
  return (np.asarray(settings['temperature'], np.float32), np.asarray(settings['top_k'], np.int32),
          np.asarray(settings['top_p'], np.float32), np.asarray(settings['min_p'], np.float32))


# (top_k_cap, use_top_p): the program variants, each with the rows it is chosen for
@pytest.mark.parametrize('top_k_cap,use_top_p', [(-1, True), (-1, False), (0, True), (0, False),
                                                 (32, True), (32, False)])
def test_filtered_logprobs_match_numpy(top_k_cap, use_top_p):
  rng = np.random.default_rng(0)
  n, v = 128, 64
  logits = (rng.normal(size=(n, v)) * 3).astype(np.float32)
  logits[::2] = np.round(logits[::2])      # every other row full of ties
  settings = random_settings(rng, n)
  if top_k_cap == 0:
    settings['top_k'] = np.zeros(n, int)
  elif top_k_cap > 0:
    settings['top_k'] = rng.choice([1, 2, 5, 17, 32], n)
  if not use_top_p:
    settings['top_p'] = np.ones(n)
  got = np.asarray(sampler.filtered_logprobs(logits, *as_arrays(settings), top_k_cap, use_top_p))
  for i in range(n):
    want = np_filtered_logprobs(logits[i], *(settings[k][i] for k in settings))
    np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want), err_msg=f'row {i}')
    np.testing.assert_allclose(got[i][np.isfinite(want)], want[np.isfinite(want)], atol=2e-5)
  kept = np.isfinite(got).sum(axis=1)
  assert kept.min() == 1 and len(set(kept.tolist())) > 5   # the filters bit


def test_filters_separate_neighbouring_floats():
  # 64 logits 16 float32 steps apart, plus a far outlier: thresholds must be exact
  close = np.float32(0.5) + np.arange(64, dtype=np.float32) * np.float32(16 * 2.0 ** -24)
  logits = np.concatenate([close, [-1e30]]).astype(np.float32)[None].repeat(3, 0)
  settings = dict(temperature=np.ones(3), top_k=np.array([10, 0, 40]),
                  top_p=np.array([1.0, 0.26, 0.3]), min_p=np.zeros(3))
  got = np.asarray(sampler.filtered_logprobs(logits, *as_arrays(settings)))
  for i in range(3):
    want = np_filtered_logprobs(logits[i], *(settings[k][i] for k in settings))
    np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want))
  assert np.isfinite(got).sum(axis=1).tolist() == [10, 17, 12]


def test_top_k_ties_beyond_the_candidates_count_for_top_p():
  # k = 4 = the candidates looked at, but six tokens tie at the 4th value: all are in the
  # top-k set, and top-p must renormalise over all eight
  logits = np.array([[5, 3, 1, 1, 1, 1, 1, 1, -5, -5]], np.float32)
  settings = dict(temperature=np.ones(1), top_k=np.array([4]), top_p=np.array([0.95]),
                  min_p=np.zeros(1))
  want = np_filtered_logprobs(logits[0], 1.0, 4, 0.95, 0.0)
  for cap in [4, -1]:
    got = np.asarray(sampler.filtered_logprobs(logits, *as_arrays(settings), cap, True))[0]
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[:8], want[:8], atol=1e-6)
  assert np.isfinite(want).sum() == 8


def chi_square(counts, probs):
  expected = probs * counts.sum()
  return float(((counts - expected) ** 2 / np.maximum(expected, 1e-12)).sum())


def draw_many(logits_row, params, num, padded=PADDED):
  """num draws of one distribution: one batch, one seed per row."""
  logits = np.full((num, padded), -1e9, np.float32)
  logits[:, :len(logits_row)] = logits_row
  rows = [SamplingParams(**{**params, 'seed': s}) for s in range(num)]
  return sample(logits, rows, [0] * num, len(logits_row)).token_ids


def test_temperature_scaling_frequencies():
  logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 2.0], np.float32)
  tokens = draw_many(logits, dict(temperature=0.6), 4000)
  counts = np.bincount(tokens, minlength=len(logits))
  # chi-square, 5 degrees of freedom: 20.5 is the 0.1% tail.
  assert chi_square(counts, np.exp(np_log_softmax(logits / 0.6))) < 20.5
  assert chi_square(counts, np.exp(np_log_softmax(logits))) > 100   # temperature 1 rejected


def test_filtered_frequencies_and_support():
  logits = np.random.default_rng(1).normal(size=12).astype(np.float32) * 1.5
  for params in [dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_p=0.7),
                 dict(temperature=1.0, min_p=0.15), dict(temperature=1.5, top_k=8, top_p=0.8)]:
    want = np.exp(np_filtered_logprobs(logits, params.get('temperature'), params.get('top_k', 0),
                                       params.get('top_p', 1.0), params.get('min_p', 0.0)))
    counts = np.bincount(draw_many(logits, params, 4000), minlength=len(logits))
    assert not counts[want == 0].any(), params            # never outside the support
    support = want > 0
    dof = support.sum() - 1
    assert chi_square(counts[support], want[support]) < 20.5 + 3 * dof, params


def test_greedy_is_argmax_over_the_real_vocab():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(12, PADDED)).astype(np.float32)
  logits[:, VOCAB:] += 10.0       # the padded columns would win an argmax over all of them
  params = [SamplingParams(temperature=0.0, top_k=3, seed=i) for i in range(12)]
  got = sample(logits, params, list(range(12)), VOCAB).token_ids
  np.testing.assert_array_equal(got, logits[:, :VOCAB].argmax(axis=1))


def test_padded_vocab_never_sampled():
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(64, PADDED)).astype(np.float32)
  logits[:, VOCAB:] = 30.0
  for extra in [{}, dict(top_k=50), dict(top_p=0.5), dict(min_p=0.5)]:
    params = [SamplingParams(temperature=2.0, seed=i, **extra) for i in range(64)]
    assert (sample(logits, params, [5] * 64, VOCAB).token_ids < VOCAB).all()


def stream(params, logits_seq, others, position, sampler_fn):
  """The target request's tokens over len(logits_seq) steps, sitting among `others` rows."""
  out = []
  for step, logits in enumerate(logits_seq):
    batch = others[step % (len(others) + 1):] if others else []
    rows = batch[:position] + [(params, logits)] + batch[position:]
    stacked = np.stack([l for _, l in rows])
    res = sampler_fn(stacked, [p for p, _ in rows], [step] * len(rows), VOCAB)
    out.append(int(res.token_ids[min(position, len(batch))]))
  return out


def test_seed_gives_the_same_stream_whatever_the_batch():
  rng = np.random.default_rng(4)
  logits_seq = [rng.normal(size=PADDED).astype(np.float32) for _ in range(20)]
  others = [(SamplingParams(**kw), rng.normal(size=PADDED).astype(np.float32)) for kw in [
      dict(temperature=0.0), dict(seed=1), dict(), dict(top_k=4, seed=9),
      dict(top_p=0.3), dict(min_p=0.1, temperature=1.5), dict(seed=7, temperature=0.5)]]
  target = SamplingParams(seed=7, temperature=1.2, top_p=0.95)
  engine = Sampler(seed=123)
  alone = stream(target, logits_seq, [], 0, sample)
  in_batch = stream(target, logits_seq, others, 5, engine)   # batch of 8, shrinking by step
  assert alone == in_batch
  other_seed = stream(SamplingParams(seed=8, temperature=1.2, top_p=0.95), logits_seq, [], 0,
                      sample)
  assert other_seed != alone


def test_seeded_stream_moves_with_the_step():
  logits = np.zeros((1, PADDED), np.float32)      # the same uniform distribution every step
  params = [SamplingParams(seed=11)]
  tokens = [int(sample(logits, params, [step], VOCAB).token_ids[0]) for step in range(10)]
  assert len(set(tokens)) > 5
  again = [int(sample(logits, params, [step], VOCAB).token_ids[0]) for step in range(10)]
  assert tokens == again


def test_unseeded_requests_follow_the_engine_rng():
  logits = np.zeros((8, PADDED), np.float32)
  params = [SamplingParams()] * 8
  first, second = Sampler(seed=5), Sampler(seed=5)
  a = [first(logits, params, [0] * 8, VOCAB).token_ids for _ in range(3)]
  b = [second(logits, params, [0] * 8, VOCAB).token_ids for _ in range(3)]
  np.testing.assert_array_equal(a, b)
  assert len({tuple(t) for t in a}) == 3     # fresh randomness each step


def test_logprobs_are_raw_log_softmax_over_the_real_vocab():
  rng = np.random.default_rng(6)
  logits = rng.normal(size=(5, PADDED)).astype(np.float32) * 2
  logits[:, VOCAB:] = 5.0        # would change the normalisation if counted
  params = [SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=3),
            SamplingParams(temperature=0.0, logprobs=0),
            SamplingParams(temperature=1.0, logprobs=None),
            SamplingParams(temperature=1.0, min_p=0.2, seed=2, logprobs=20),
            SamplingParams(temperature=0.0, logprobs=1)]
  res = sample(logits, params, [0] * 5, VOCAB)
  for i, p in enumerate(params):
    want = np_log_softmax(logits[i, :VOCAB])
    np.testing.assert_allclose(res.logprobs[i], want[res.token_ids[i]], atol=1e-5)
    # The drawn token's rank: the real-vocab tokens at least as likely, it included.
    assert res.ranks[i] == np.sum(want >= want[res.token_ids[i]]), i
    if p.logprobs is None:
      assert res.top_logprobs[i] is None
      continue
    top = np.argsort(-want, kind='stable')[:p.logprobs]
    assert [t for t, _ in res.top_logprobs[i]] == top.tolist()
    np.testing.assert_allclose([lp for _, lp in res.top_logprobs[i]], want[top], atol=1e-5)


def test_no_logprobs_asked_none_returned():
  res = sample(np.zeros((2, PADDED), np.float32), [SamplingParams()] * 2, [0, 0], VOCAB)
  assert res.logprobs is None and res.ranks is None and res.top_logprobs == [None, None]


def test_one_program_per_bucket_and_mode():
  rng = np.random.default_rng(7)
  kinds = [dict(temperature=0.0), dict(top_k=3), dict(top_p=0.5, min_p=0.1), dict(seed=3)]
  before = sampler._sample_rows._cache_size()   # pylint: disable=protected-access
  for n in [5, 6, 7, 8, 5, 8]:      # one bucket (8); every mix with top-k and top-p
    params = [SamplingParams(**kinds[i % 4]) for i in range(n)]
    # a vocab size no other test uses, so no earlier test compiled this program
    sample(rng.normal(size=(n, PADDED)).astype(np.float32), params, [0] * n, VOCAB - 1)
  assert sampler._sample_rows._cache_size() - before == 1   # pylint: disable=protected-access


def test_logits_with_more_rows_than_params_sample_their_first_rows():
  """The engine passes the runner's padded logits whole: the first len(params) rows are
  sampled as if cut, in one program per (rows given, row bucket)."""
  rng = np.random.default_rng(11)
  logits = rng.normal(size=(24, PADDED)).astype(np.float32)
  for n in (3, 5, 8):
    params = [SamplingParams(temperature=1.0, seed=i, logprobs=2) for i in range(n)]
    want, got = (sample(x, params, list(range(n)), VOCAB) for x in (logits[:n], logits))
    assert (got.token_ids == want.token_ids).all() and got.top_logprobs == want.top_logprobs
  with pytest.raises(ValueError, match='at least len'):
    sample(logits[:3], [SamplingParams()] * 4, [0] * 4, VOCAB)


def test_bad_shapes_are_refused():
  with pytest.raises(ValueError, match='vocab'):
    sample(np.zeros((1, 100), np.float32), [SamplingParams()], [0], VOCAB)
  with pytest.raises(ValueError, match='steps'):
    sample(np.zeros((2, PADDED), np.float32), [SamplingParams()] * 2, [0], VOCAB)


@pytest.mark.parametrize('field,value', [
    ('max_tokens', 0), ('max_tokens', 2.5), ('temperature', -0.1), ('temperature', 2.5),
    ('temperature', float('nan')), ('top_k', -2), ('top_p', 0.0), ('top_p', 1.5),
    ('min_p', -0.1), ('min_p', 1.01), ('seed', 1.0), ('stop', ['']), ('stop', 'x'),
    ('stop', ['a'] * 17), ('stop_token_ids', [VOCAB]), ('stop_token_ids', [-1]),
    ('ignore_eos', 1), ('logprobs', 21), ('logprobs', -1), ('logprobs', True),
    ('presence_penalty', 2.5), ('frequency_penalty', -2.1), ('repetition_penalty', 0.0),
    ('repetition_penalty', float('inf')), ('logit_bias', {VOCAB: 1.0}), ('logit_bias', {1: 101}),
    ('logit_bias', {1: 'x'}), ('logit_bias', [1]), ('logit_bias', {i: 1 for i in range(301)})])
def test_validate_names_the_field(field, value):
  with pytest.raises(SamplingParamsError) as err:
    SamplingParams(**{field: value}).validate(VOCAB)
  assert err.value.param == field and str(err.value).startswith(field)


def test_valid_params_pass():
  SamplingParams(max_tokens=1, temperature=2.0, top_k=-1, top_p=1e-3, min_p=1.0, seed=-5,
                 stop=['a'] * 16, stop_token_ids=[0, VOCAB - 1], logprobs=20).validate(VOCAB)


def test_extreme_but_valid_values_sample():
  params = [SamplingParams(top_k=10**12, seed=-3), SamplingParams(top_k=-1, seed=2**70),
            SamplingParams(top_k=VOCAB + 5, top_p=0.5, seed=0), SamplingParams(temperature=1e-6)]
  for p in params:
    p.validate(VOCAB)
  logits = np.random.default_rng(8).normal(size=(4, PADDED)).astype(np.float32)
  got = sample(logits, params, [0] * 4, VOCAB).token_ids
  assert (got < VOCAB).all() and got[3] == logits[3, :VOCAB].argmax()


def np_adjusted(logits, p: SamplingParams, prompt, output):
  """Reference, float64, by the definitions (vLLM's order): bias, then repetition over
  every token seen, then frequency x count and presence over the output."""
  x = np.asarray(logits, np.float64).copy()
  for token, bias in p.logit_bias.items():
    x[token] += bias
  for token in set(prompt) | set(output):
    x[token] = x[token] / p.repetition_penalty if x[token] > 0 else (
        x[token] * p.repetition_penalty)
  for token in set(output):
    x[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
  return x


PENALIZED = [
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.7, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, repetition_penalty=0.5, logit_bias={3: 100.0, 9: -5.5}),
    SamplingParams(temperature=0.0),          # untouched beside the others
    SamplingParams(temperature=0.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   repetition_penalty=1.3, logit_bias={0: 0.25}, logprobs=0),
]


def penalized_case(seed):
  """Logits whose largest tokens are the ones the histories repeat, so penalties move the
  argmax; histories with repeats and with tokens only in the prompt."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(len(PENALIZED), PADDED)).astype(np.float32)
  histories = []
  for row in logits:
    top = [int(t) for t in np.argsort(row[:VOCAB])[::-1][:6]]
    histories.append((top[:2] + rng.integers(0, VOCAB, 40).tolist(),
                      [top[2]] * 3 + top[3:5] + rng.integers(0, VOCAB, 20).tolist()))
  return logits, histories


def test_adjusted_logits_match_numpy_and_greedy_takes_their_argmax():
  logits, histories = penalized_case(0)
  want = np.stack([np_adjusted(row[:VOCAB], p, *h)
                   for row, p, h in zip(logits, PENALIZED, histories)])
  adjust = logits_adjust.adjust_arrays(PENALIZED, histories, 8, VOCAB)
  padded = np.pad(logits[:, :VOCAB], ((0, 3), (0, 0)))
  got = np.asarray(logits_adjust.adjusted_logits(padded, **adjust))[:len(PENALIZED)]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
  assert np.array_equal(got[3], logits[3, :VOCAB])
  res = sample(logits, PENALIZED, [0] * len(PENALIZED), VOCAB, history=histories)
  assert res.token_ids.tolist() == want.argmax(-1).tolist()
  assert (want.argmax(-1) != logits[:, :VOCAB].argmax(-1)).sum() >= 3   # they moved it
  assert res.logprobs[4] == pytest.approx(np_log_softmax(logits[4, :VOCAB])[res.token_ids[4]],
                                          abs=1e-5)   # raw: the model's, not adjusted
  with pytest.raises(ValueError, match='history'):
    sample(logits, PENALIZED, [0] * len(PENALIZED), VOCAB)


def test_sampling_draws_from_the_adjusted_logits():
  """A sampled row's support is its adjusted logits' top-k: the penalised favourites are
  out of it, and a token biased to tie with the best is in it."""
  logits, histories = penalized_case(1)
  prompt, output = histories[0]
  penalties = SamplingParams(repetition_penalty=2.0, presence_penalty=2.0,
                             frequency_penalty=2.0)
  plain = np_adjusted(logits[0, :VOCAB], penalties, prompt, output)
  token = next(t for t in np.argsort(plain) if t not in prompt + output)   # unseen, unlikely
  bias = float(plain.max() - logits[0, token])
  params = [SamplingParams(temperature=1.0, top_k=2, repetition_penalty=2.0,
                           presence_penalty=2.0, frequency_penalty=2.0,
                           logit_bias={int(token): bias}, seed=s) for s in range(64)]
  rows = np.repeat(logits[:1], 64, axis=0)
  got = set(sample(rows, params, [0] * 64, VOCAB, history=[histories[0]] * 64).token_ids)
  assert got == {int(token), int(plain.argmax())}
  assert not got & set(np.argsort(logits[0, :VOCAB])[::-1][:5].tolist())


def test_from_openai_defaults_and_mapping():
  assert from_openai({'model': 'm', 'prompt': 'x'}, VOCAB) == SamplingParams()
  got = from_openai({'max_tokens': 5, 'temperature': 0, 'top_k': -1, 'top_p': 0.5, 'min_p': 0.1,
                     'seed': 3, 'stop': 'END', 'stop_token_ids': [1], 'ignore_eos': True,
                     'logprobs': 2, 'presence_penalty': 0.5, 'frequency_penalty': -1,
                     'repetition_penalty': 1.2, 'logit_bias': {'17': -100, '4': 2.5},
                     'n': 1, 'min_tokens': 2, 'include_stop_str_in_output': True}, VOCAB)
  assert got == SamplingParams(max_tokens=5, temperature=0, top_k=0, top_p=0.5, min_p=0.1,
                               seed=3, stop=['END'], stop_token_ids=[1], ignore_eos=True,
                               logprobs=2, presence_penalty=0.5, frequency_penalty=-1,
                               repetition_penalty=1.2, logit_bias={17: -100, 4: 2.5},
                               min_tokens=2, include_stop_str_in_output=True)
  assert from_openai({'stop': None, 'temperature': None}, VOCAB) == SamplingParams()


def test_from_openai_chat():
  chat = lambda body: from_openai(body, VOCAB, chat=True, default_max_tokens=100)  # noqa
  assert chat({}).max_tokens == 100 and chat({}).logprobs is None
  assert chat({'max_tokens': 7, 'max_completion_tokens': 9}).max_tokens == 9
  assert chat({'logprobs': True}).logprobs == 0
  assert chat({'logprobs': True, 'top_logprobs': 4}).logprobs == 4
  assert chat({'logprobs': False}).logprobs is None
  assert chat({'skip_special_tokens': False}).skip_special_tokens is False
  assert chat({'allowed_token_ids': [3, 5]}).allowed_token_ids == [3, 5]
  with pytest.raises(SamplingParamsError, match='cannot be combined') as err:
    chat({'allowed_token_ids': [3], 'guided_regex': 'a'})
  assert err.value.param == 'allowed_token_ids'


def test_packed_bits_unpack_to_the_same_tokens():
  from serve.worker.logits_adjust import pack_bits, unpack_bits  # pylint: disable=import-outside-toplevel
  for vocab, ids in ((257, [0, 31, 32, 256]), (100, []), (64, list(range(64))),
                     (1000, np.random.default_rng(0).choice(1000, 50).tolist())):
    assert np.flatnonzero(unpack_bits(pack_bits(ids, vocab), vocab)).tolist() == sorted(set(ids))


@pytest.mark.parametrize('chat,field,value', [
    (True, 'tools', [{'type': 'function', 'function': {'name': 'f'}}]),
    (True, 'tool_choice', 'required'), (True, 'functions', [{'name': 'f'}]),
    (True, 'chat_template', '{{ messages }}'), (True, 'echo', True),
    (True, 'chat_template_kwargs', {'enable_thinking': True}),
    (False, 'n', True), (False, 'use_beam_search', 0),   # true is not 1, 0 not false
    (False, 'suffix', 'end'), (False, 'logits_processors', ['my.Processor']),
    (False, 'use_beam_search', True)])
def test_fields_that_change_the_output_but_are_not_implemented_are_refused(chat, field, value):
  """Never silently ignored: a 400 naming the field, unless the value asks for nothing."""
  with pytest.raises(SamplingParamsError, match='not supported here') as err:
    from_openai({field: value}, VOCAB, chat=chat)
  assert err.value.param == field


def test_neutral_values_of_unsupported_fields_are_accepted():
  """Clients that send every field with its default (or null) are served."""
  chat = {'response_format': {'type': 'text'}, 'tools': [], 'tool_choice': 'auto',
          'functions': None, 'function_call': 'none', 'echo': False,
          'chat_template_kwargs': {}, 'continue_final_message': False,
          'skip_special_tokens': True,
          'guided_json': None, 'bad_words': [], 'use_beam_search': False}
  assert from_openai(chat, VOCAB, chat=True, default_max_tokens=16) == SamplingParams()
  completion = {'suffix': '', 'response_format': None, 'best_of': 1, 'n': 1,
                'prompt_logprobs': None, 'echo': True}   # completions' echo is the server's
  assert from_openai(completion, VOCAB) == SamplingParams()


@pytest.mark.parametrize('chat,body,field', [
    (False, {'max_tokens': '16'}, 'max_tokens'), (False, {'temperature': 'hot'}, 'temperature'),
    (False, {'stop': 5}, 'stop'), (False, {'stop': ['a', 3]}, 'stop'),
    (False, {'logprobs': True}, 'logprobs'), (False, {'seed': 'x'}, 'seed'),
    (False, {'skip_special_tokens': 0}, 'skip_special_tokens'),
    (False, {'bad_words': 'x'}, 'bad_words'), (False, {'bad_words': [' ']}, 'bad_words'),
    (False, {'stop_token_ids': [999]}, 'stop_token_ids'), (False, {'n': 2}, 'n'),
    (False, {'frequency_penalty': 2.5}, 'frequency_penalty'),
    (False, {'repetition_penalty': 0}, 'repetition_penalty'),
    (False, {'logit_bias': {'one': 5}}, 'logit_bias'), (False, {'logit_bias': [5]}, 'logit_bias'),
    (False, {'logit_bias': {'999': 5}}, 'logit_bias'), (True, {'best_of': 2}, 'best_of'),
    (False, {'logit_bias': {'1': 5, '01': 2}}, 'logit_bias'),
    (True, {'max_completion_tokens': 0}, 'max_completion_tokens'),
    (True, {'logprobs': 1}, 'logprobs'), (True, {'top_logprobs': 3}, 'top_logprobs'),
    (True, {'logprobs': True, 'top_logprobs': 21}, 'top_logprobs'),
    (False, {'top_p': 2}, 'top_p'), (False, {'min_tokens': 17}, 'min_tokens'),
    (False, {'max_tokens': 4, 'min_tokens': -1}, 'min_tokens'),
    (True, {'include_stop_str_in_output': 1}, 'include_stop_str_in_output')])
def test_from_openai_errors_name_the_field(chat, body, field):
  with pytest.raises(SamplingParamsError) as err:
    from_openai(body, VOCAB, chat=chat)
  assert err.value.param == field
  assert isinstance(err.value, ValueError)
  with pytest.raises(SamplingParamsError):
    from_openai([body], VOCAB)


def test_banned_tokens_are_never_drawn_and_logprobs_stay_raw():
  """min_tokens' bans (the engine passes eos and stop ids): greedy takes the best allowed
  token, sampling never draws a banned one, the reported logprobs are the model's."""
  rng = np.random.default_rng(11)
  logits = rng.normal(size=(3, PADDED)).astype(np.float32)
  order = np.argsort(-logits[:, :VOCAB], axis=-1)
  banned = [order[0, :2].tolist(), [], order[2, :1].tolist()]
  logits[1, order[1, 0]] += 50.0     # a dominant token in the row with no ban
  params = [SamplingParams(temperature=0.0, logprobs=0, min_tokens=1),
            SamplingParams(temperature=0.0, logprobs=0),
            SamplingParams(temperature=0.0, logprobs=0, min_tokens=1)]
  got = sample(logits, params, [0] * 3, VOCAB, banned=banned)
  assert got.token_ids.tolist() == [order[0, 2], order[1, 0], order[2, 1]]
  x = logits[:, :VOCAB].astype(np.float64)
  raw = x - x.max(-1, keepdims=True)
  raw -= np.log(np.exp(raw).sum(-1, keepdims=True))
  np.testing.assert_allclose(got.logprobs, raw[np.arange(3), got.token_ids], atol=1e-5)
  # Sampled rows, where the banned tokens hold nearly all the mass.
  hot = np.zeros((1, PADDED), np.float32)
  hot[0, :3] = 20.0
  draws = [int(sample(hot, [SamplingParams(seed=s, top_p=0.9, min_tokens=1)], [0], VOCAB,
                      banned=[[0, 1, 2]]).token_ids[0]) for s in range(40)]
  assert not {0, 1, 2} & set(draws) and len(set(draws)) > 10
  assert sample(hot, [SamplingParams(seed=0)], [0], VOCAB).token_ids[0] < 3   # unbanned


# ------------------------------------------------------------------ kept penalty state

KEPT_KINDS = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=-0.3),
              dict(), dict(repetition_penalty=0.8, presence_penalty=1.0, frequency_penalty=-1.5),
              dict(frequency_penalty=2.0), dict(repetition_penalty=1.05, logit_bias={5: 3.0})]


def both_paths(state, params, rows, logits):
  """adjusted_logits from the rows' histories counted afresh, and from the kept state."""
  bucket = sampler.row_bucket(len(rows))
  history = [(r.prompt_ids, list(r.output_ids) + list(r.ahead)) for r in rows]
  afresh = logits_adjust.adjust_arrays(params, history, bucket, VOCAB)
  kept = logits_adjust.adjust_arrays(params, None, bucket, VOCAB, requests=rows,
                                     penalties=state)
  return (np.asarray(logits_adjust.adjusted_logits(logits, **afresh)),
          np.asarray(logits_adjust.adjusted_logits(logits, **kept)))


def test_kept_penalties_equal_the_history_counted_afresh():
  """Over many steps the kept state adjusts the logits bit for bit as the histories
  counted afresh do: requests arriving and ending (slots reused, the table growing past
  its first 8), sitting steps out (some lose their slot and are counted again), rows
  after drafts, outputs cut short (a stop string), an id reused with new lists with and
  without a release; and as the float64 reference does."""
  rng = np.random.default_rng(3)
  state, live, made = PenaltyState(), {}, 0
  for step in range(70):
    for _ in range(int(rng.integers(0, 6))):
      params = SamplingParams(temperature=0.0, **KEPT_KINDS[made % len(KEPT_KINDS)])
      live[f'r{made}'] = (params, rng.integers(0, VOCAB, int(rng.integers(1, 40))).tolist(), [])
      made += 1
    if step % 23 == 22:   # a finished id comes back as a new request, unreleased, with
      rid = next(iter(live))   # more output than the old one had
      live[rid] = (live[rid][0], rng.integers(0, VOCAB, 9).tolist(),
                   rng.integers(0, 16, len(live[rid][2]) + 5).tolist())
    rows, params = [], []
    for rid, (p, prompt, output) in live.items():
      if rng.random() < 0.25:
        continue   # not scheduled this step
      draft = rng.integers(0, 16, int(rng.integers(0, 5))).tolist() if rng.random() < 0.4 else []
      rows += [PenaltyRow(rid, prompt, output, draft[:j]) for j in range(len(draft) + 1)]
      params += [p] * (len(draft) + 1)
    if not rows:
      continue
    logits = (rng.normal(size=(sampler.row_bucket(len(rows)), VOCAB)) * 3).astype(np.float32)
    afresh, kept = both_paths(state, params, rows, logits)
    np.testing.assert_array_equal(kept, afresh, err_msg=f'step {step}')
    for i in range(0, len(rows), 7):
      want = np_adjusted(logits[i], params[i], rows[i].prompt_ids,
                         list(rows[i].output_ids) + list(rows[i].ahead))
      np.testing.assert_allclose(kept[i], want, rtol=1e-6, atol=1e-5)
    for rid in dict.fromkeys(r.request_id for r in rows):   # in row order: reproducible
      output = live[rid][2]
      output += rng.integers(0, 16, int(rng.integers(1, 4))).tolist()   # accepted tokens
      if rng.random() < 0.05:
        del output[-2:]   # a stop string's trim
      if rng.random() < 0.08:
        del live[rid]
        state.release(rid)
  assert made > 60 and state.seen.capacity > 8 and state.counts.capacity > 8


def test_kept_penalties_sample_the_tokens_the_histories_do():
  """Through Sampler: the same tokens and logprobs, greedy and sampled, step after step,
  as sample() with histories (the same seeds and unseeded RNG stream)."""
  rng = np.random.default_rng(5)
  kinds = [dict(temperature=0.0, repetition_penalty=1.8, logprobs=2),
           dict(temperature=1.0, top_k=5, repetition_penalty=1.05),
           dict(temperature=0.7, top_p=0.8, frequency_penalty=1.0, seed=7, logprobs=0),
           dict(temperature=0.0)]
  params = [SamplingParams(**kinds[i % 4]) for i in range(6)]
  prompts = [rng.integers(0, VOCAB, 30).tolist() for _ in params]
  outputs = [[] for _ in params]
  kept, old_rng = Sampler(11), np.random.default_rng(11)
  for step in range(12):
    logits = (rng.normal(size=(8, PADDED)) * 2).astype(np.float32)
    rows = [PenaltyRow(f'q{i}', p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]
    got = kept(logits, params, [step] * 6, VOCAB, requests=rows)
    want = sample(logits, params, [step] * 6, VOCAB, rng=old_rng,
                  history=list(zip(prompts, outputs)))
    assert got.token_ids.tolist() == want.token_ids.tolist(), step
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    assert got.top_logprobs == want.top_logprobs
    for output, token in zip(outputs, got.token_ids):
      output.append(int(token))
  assert len({tuple(o) for o in outputs}) > 3


def test_kept_penalties_compile_nothing_new_after_warm_up():
  """After reserve() and one call per row bucket, steps whose histories grow from tens to
  thousands of tokens, with requests replaced, drafts and slots reused, build no program
  (the rebuilt histories build one per width: the counter sees them)."""
  state = PenaltyState()
  state.reserve(8, VOCAB, max_ahead=4, repetition=True, counts=True)
  params = SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3)
  logits = {n: np.zeros((n, PADDED), np.float32) for n in (1, 2, 4, 8)}
  for n in logits:
    warm = [PenaltyRow(f'w{i}', [0], []) for i in range(n)]
    sample(logits[n], [params] * n, [0] * n, VOCAB, requests=warm, penalties=state)
    for row in warm:
      state.release(row.request_id)
  rng = np.random.default_rng(9)
  before = compile_cache.programs()
  for step in range(12):
    n = int(rng.choice([1, 2, 4, 8]))
    length = 20 * 3 ** (step // 2)   # up to ~5000 tokens
    rows = [PenaltyRow(f's{step}-{i // 2}', rng.integers(0, VOCAB, length).tolist(), [3] * step,
                       [1, 2, 3][:i % 2 * 3]) for i in range(n)]
    sample(logits[n], [params] * n, [0] * n, VOCAB, requests=rows, penalties=state)
  assert compile_cache.programs() == before
  for length in (100, 1000):
    sample(logits[2], [params] * 2, [0] * 2, VOCAB, history=[(list(range(length)), [])] * 2)
  assert compile_cache.programs() > before


def test_unseeded_draws_follow_the_rng_in_row_order():
  """The unseeded rows' seeds come from one vectorised draw: the same numbers, in row
  order, as one draw per row (the stream the engine's RNG gave before)."""
  params = [SamplingParams(seed=None if i % 3 else i - 2**70) for i in range(40)]
  keys = sampler._key_data(params, np.random.default_rng(4), 64)  # pylint: disable=protected-access
  one_by_one = np.random.default_rng(4)
  want = [(p.seed if p.seed is not None else int(one_by_one.integers(1 << 63))) % (1 << 64)
          for p in params] + [0] * 24
  assert [(int(hi) << 32) | int(lo) for hi, lo in keys] == want


def test_releasing_requests_that_took_no_slot_keeps_nothing():
  """The engine releases every request it ends; those without penalties leave no trace
  (the state sees no step until a penalised request comes)."""
  state = PenaltyState()
  for i in range(100):
    state.release(f'plain-{i}')
  assert not state._released   # pylint: disable=protected-access


def test_requests_without_their_state_or_rows_are_refused():
  params = [SamplingParams(repetition_penalty=1.2)] * 2
  rows = [PenaltyRow('a', [1], []), PenaltyRow('b', [2], [])]
  logits = np.zeros((2, PADDED), np.float32)
  with pytest.raises(ValueError, match='PenaltyState'):
    sample(logits, params, [0, 0], VOCAB, requests=rows)
  with pytest.raises(ValueError, match='1 PenaltyRows for 2 rows'):
    sample(logits, params, [0, 0], VOCAB, requests=rows[:1], penalties=PenaltyState())
