"""Choosing the next token of every running request in one jitted program.

Per-row settings travel as arrays, so one program serves any mix of greedy, temperature,
top-k, top-p and min-p rows; programs differ only by the row bucket (a power of two), by
which filters some row uses and by whether any row wants top logprobs.

Before them the logits are adjusted as vLLM does (serve/worker/logits_adjust.py):
logit_bias, then the repetition, frequency and presence penalties, from each row's prompt
and output tokens, then the tokens a row may not draw (eos and stop ids before its
min_tokens; those outside its guided output's allowed set) go to -inf; greedy rows take
the argmax of the adjusted logits. Filters apply in the order Hugging Face applies them: temperature, top-k, top-p (on the top-k survivors, renormalised), min-p
(relative to the most likely token, so it commutes with the others). Tokens tied with the last kept one are kept. Logprobs are the "raw"
ones (vLLM's default): log_softmax of the unmodified logits over the real vocabulary, so
they describe the model, not the sampling settings.

Row i's random key depends only on (its seed, steps[i]): a seeded request gives the same
tokens whatever else is in the batch. Unseeded rows draw a fresh seed per step from the
caller's numpy Generator (`Sampler` holds one per engine).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from serve.sampling_params import GREEDY_BELOW, MAX_LOGPROBS, SamplingParams
from serve.worker.logits_adjust import adjust_arrays, adjusted_logits, row_bucket
from serve.worker.penalties import PenaltyRow, PenaltyState

FEW_TOP_K = 256     # top-k up to this many works on lax.top_k's candidates, not a bisection


@dataclasses.dataclass
class SampleResult:
  token_ids: np.ndarray                    # [N] int32
  logprobs: np.ndarray | None              # [N] float32 raw log p(token); None if no row asked
  top_logprobs: list[list[tuple[int, float]] | None]   # per row: top N (token, logprob) or None
  # [N] int32 with logprobs: the tokens at least as likely as the drawn one, it included
  # (vLLM v1's rank, by the raw logprobs).
  ranks: np.ndarray | None = None


class Sampler:
  """The engine's sampler: `sample`, the RNG that seeds requests without a seed, and the
  penalties' per-request state (serve/worker/penalties.py)."""

  def __init__(self, seed: int | None = None):
    self._rng = np.random.default_rng(seed)
    self.penalties = PenaltyState()

  def __call__(self, logits, params: list[SamplingParams], steps: list[int],
               vocab_size: int, history=None, banned=None, allowed=None,
               requests: list[PenaltyRow] | None = None) -> SampleResult:
    return sample(logits, params, steps, vocab_size, rng=self._rng, history=history,
                  banned=banned, allowed=allowed, requests=requests,
                  penalties=self.penalties)

  def release(self, request_id: str) -> None:
    """The request ended: its penalty state is freed (call it for every request)."""
    self.penalties.release(request_id)


def sample(logits: jax.Array, params: list[SamplingParams], steps: list[int], vocab_size: int,
           rng: np.random.Generator | None = None, history=None, banned=None,
           allowed=None, requests: list[PenaltyRow] | None = None,
           penalties: PenaltyState | None = None) -> SampleResult:
  """One token per row of logits [N, V >= vocab_size]; ids >= vocab_size are never drawn.

  logits may have more rows than params (a runner's padded output): the first N are
  sampled. Pass them uncut: the program cuts or pads them to N's power-of-two bucket, so
  it is compiled per (rows given, bucket), not per N.

  The penalties read each row's tokens, from `requests` (each row's PenaltyRow: the
  counts live in `penalties` from step to step, only new tokens are sent) or else from
  `history` (each row's (prompt token ids, output token ids so far), counted afresh every
  step); needed only when some row has a penalty. banned: each row's token ids that must
  not be drawn this step (the engine's eos and stop ids before min_tokens), or None.
  allowed: each row's tokens it may draw (guided output) as unpack_bits words, or None."""
  return prepare(logits, params, steps, vocab_size, rng, history, banned, allowed, requests,
                 penalties).run()


@dataclasses.dataclass
class Prepared:
  """A sample's program and its inputs, made on the host: dispatch() starts the program
  (asynchronously), result() waits for it and reads the tokens back."""
  params: list[SamplingParams]
  args: tuple
  static: dict

  def dispatch(self):
    return _sample_rows(*self.args, **self.static)

  def result(self, out) -> SampleResult:
    return _result(self.params, jax.device_get(out), len(self.params))

  def run(self) -> SampleResult:
    return self.result(self.dispatch())


def prepare(logits: jax.Array, params: list[SamplingParams], steps: list[int],
            vocab_size: int, rng: np.random.Generator | None = None, history=None,
            banned=None, allowed=None, requests: list[PenaltyRow] | None = None,
            penalties: PenaltyState | None = None) -> Prepared:
  """sample's host half: the checks, the per-row arrays, the penalty state's update."""
  n = len(params)
  if logits.ndim != 2 or logits.shape[0] < n or len(steps) != n:
    raise ValueError(f'sample: logits {logits.shape} must be [at least len(params)={n}, '
                     f'vocab] and steps must have {n} entries, got {len(steps)}')
  if logits.shape[1] < vocab_size:
    raise ValueError(f'sample: logits have {logits.shape[1]} columns, fewer than the '
                     f'vocabulary ({vocab_size}); pass the tokenizer vocab_size')
  rows = row_bucket(n)
  row_args = _row_arrays(params, steps, rng or np.random.default_rng(), rows, vocab_size)
  logits = jnp.asarray(logits)
  given = logits.shape[0]
  if given != rows:   # (a slice of all rows would still be a dispatch)
    logits = logits[:rows] if given > rows else jnp.pad(logits, ((0, rows - given), (0, 0)))
  want_top = any(p.logprobs for p in params)
  adjust = adjust_arrays(params, history, rows, vocab_size, banned, allowed, requests,
                         penalties)
  return Prepared(params, (logits, *row_args, adjust),
                  dict(vocab_size=vocab_size, filters=_filters(params, vocab_size),
                       logprobs=any(p.logprobs is not None for p in params),
                       top_n=min(MAX_LOGPROBS, vocab_size) if want_top else 0))


def _filters(params: list[SamplingParams], vocab_size: int) -> tuple[int, bool] | None:
  """The static part of the program: None if all rows are greedy, else (top_k_cap, top_p)
  as filtered_logprobs takes them, from the rows that sample."""
  sampled = [p for p in params if not p.greedy]
  if not sampled:
    return None
  ks = [p.top_k for p in sampled]
  if not any(k > 0 for k in ks):
    cap = 0
  elif all(0 < k <= FEW_TOP_K for k in ks):
    cap = min(row_bucket(max(ks)), vocab_size)
  else:
    cap = -1
  return cap, any(p.top_p < 1.0 for p in sampled)


def _key_data(params, rng, rows) -> np.ndarray:
  """[rows, 2] uint32: each row's threefry key words from its seed (any Python int, taken
  modulo 2**64), or from a draw of rng for an unseeded row; padding rows (0, 0)."""
  seeds = [p.seed for p in params]
  n, drawn = len(seeds), [i for i, s in enumerate(seeds) if s is None]
  words = np.zeros(rows, np.uint64)
  if len(drawn) < n:
    words[:n] = [0 if s is None else s % (1 << 64) for s in seeds]
  if drawn:   # one draw for all: the same stream as one draw per row, in row order
    words[drawn if len(drawn) < n else slice(0, n)] = rng.integers(1 << 63, size=len(drawn))
  keys = np.empty((rows, 2), np.uint32)
  keys[:, 0], keys[:, 1] = words >> np.uint64(32), words & np.uint64(0xFFFFFFFF)
  return keys


def _row_arrays(params, steps, rng, rows, vocab_size):
  """Per-row settings as arrays of `rows` entries; padding rows are greedy and unseeded."""
  pad = rows - len(params)

  def column(values, fill, dtype):
    return np.array(values + [fill] * pad, dtype)

  return (column([p.temperature for p in params], 0.0, np.float32),
          column([min(max(p.top_k, 0), vocab_size) for p in params], 0, np.int32),
          column([p.top_p for p in params], 1.0, np.float32),
          column([p.min_p for p in params], 0.0, np.float32),
          _key_data(params, rng, rows), column(list(steps), 0, np.int32))


@functools.partial(jax.jit, static_argnames=('vocab_size', 'filters', 'logprobs', 'top_n'))
def _sample_rows(logits, temperature, top_k, top_p, min_p, key_data, steps, adjust, *,
                 vocab_size, filters, logprobs, top_n):
  raw = logits[:, :vocab_size].astype(jnp.float32)
  logits = raw if adjust is None else adjusted_logits(raw, **adjust)
  token = jnp.argmax(logits, axis=-1)
  if filters is not None:
    filtered = filtered_logprobs(logits, temperature, top_k, top_p, min_p, *filters)
    drawn = _draw(jax.vmap(_row_key)(key_data, steps), filtered)
    token = jnp.where(temperature < GREEDY_BELOW, token, drawn)
  token = token.astype(jnp.int32)
  if not logprobs:
    return token, None, None
  logits = raw   # the model's own logprobs, whatever the adjustments
  log_total = jax.nn.logsumexp(logits, axis=-1)
  token_logit = jnp.take_along_axis(logits, token[:, None], axis=1)[:, 0]
  scored = (token_logit - log_total,   # the drawn token's logprob and rank
            jnp.sum(logits >= token_logit[:, None], axis=-1, dtype=jnp.int32))
  if not top_n:
    return token, scored, None
  values, ids = jax.lax.top_k(logits, top_n)
  return token, scored, (values - log_total[:, None], ids)


def _row_key(key_data, step):
  return jax.random.fold_in(jax.random.wrap_key_data(key_data, impl='threefry2x32'), step)


def _draw(keys, logprobs):
  """Inverse-CDF sampling with one uniform per row (a Gumbel per token costs 5x on CPU).

  u is in (0, 1], so a token of probability 0 (filtered out, or padding) is never chosen.
  """
  cdf = jnp.cumsum(jnp.exp(logprobs), axis=-1)
  u = 1.0 - jax.vmap(jax.random.uniform)(keys)
  return jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1)


def filtered_logprobs(logits, temperature, top_k, top_p, min_p, top_k_cap=-1, use_top_p=True):
  """log p of the distribution rows are sampled from: -inf outside the kept tokens.

  logits [N, V]; the rest [N]. Greedy rows (temperature ~0) come back at temperature 1.
  The static arguments only pick the cheapest exact program for the rows at hand:
  top_k_cap -1: any k; 0: no row uses top-k; K > 0: every row's k is in 1..K (top-k and
  top-p then look at the K largest logits only). use_top_p=False: no row uses top-p.
  """
  temperature = jnp.where(temperature < GREEDY_BELOW, 1.0, temperature)
  scaled = logits / temperature[:, None]
  # min-p: p_i >= min_p * p_max, in a form that needs no normalisation.
  keep = jnp.exp(scaled - scaled.max(axis=-1, keepdims=True)) >= min_p[:, None]
  if top_k_cap > 0:
    keep &= _in_few_top_k_top_p(scaled, top_k, top_p, top_k_cap, use_top_p)
  elif top_k_cap < 0 or use_top_p:
    in_top_k = _in_top_k(scaled, top_k) if top_k_cap < 0 else jnp.ones_like(keep)
    if use_top_p:
      in_top_k &= _in_top_p(jax.nn.softmax(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1),
                            top_p)
    keep &= in_top_k
  return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def _in_few_top_k_top_p(scaled, top_k, top_p, cap, use_top_p):
  """Top-k, then top-p, when every k is <= cap: both from the cap largest logits, sorted."""
  values = jax.lax.top_k(scaled, cap)[0]                              # [N, cap] descending
  k = jnp.clip(jnp.where(top_k > 0, top_k, cap), 1, cap)
  kth = jnp.take_along_axis(values, (k - 1)[:, None], axis=1)
  in_top_k = scaled >= kth
  if not use_top_p:
    return in_top_k
  # normalised over the whole top-k set: ties with the k-th may lie beyond the cap
  log_total = jax.nn.logsumexp(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1, keepdims=True)
  probs = jnp.where(values >= kth, jnp.exp(values - log_total), 0.0)
  needed = (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) & (values >= kth)
  cut = jnp.min(jnp.where(needed, values, jnp.inf), axis=-1, keepdims=True)
  return in_top_k & ((scaled >= cut) | (top_p[:, None] >= 1.0))


def _in_top_k(scaled, top_k):
  """Tokens whose logit is >= the k-th largest (ties at it kept); k <= 0 keeps all."""
  keys = _order_key(scaled)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, scaled.shape[-1]), scaled.shape[-1])
  kth = _largest_passing(keys.min(axis=-1), keys.max(axis=-1) + 1,
                         lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k)
  return keys >= kth[:, None]


def _in_top_p(probs, top_p):
  """The most likely tokens whose mass first reaches top_p (ties at the last one kept)."""
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)   # monotone for p >= 0

  def reaches_top_p(t):
    return jnp.sum(jnp.where(bits >= t[:, None], probs, 0.0), axis=-1) >= top_p

  cut = _largest_passing(jnp.zeros_like(top_p, jnp.int32), bits.max(axis=-1) + 1,
                         reaches_top_p)
  # top_p == 1 keeps everything, also where a float32 sum falls short of 1.0.
  return (bits >= cut[:, None]) | (top_p[:, None] >= 1.0)


def _order_key(x):
  """int32 keys ordered as the float32 values are (negative floats' bits reversed)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _largest_passing(lo, hi, passes):
  """Per row, the largest int32 t in [lo, hi) with passes(t); lo passes, hi does not,
  and passes is true below some point and false above it."""
  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)     # floor((lo + hi) / 2) without overflow
    ok = passes(mid)
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
  return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def _result(params, out, n) -> SampleResult:
  token, scored, top = out
  tops = [_top_pairs(top, i, p.logprobs) for i, p in enumerate(params)]
  if scored is None:
    return SampleResult(np.asarray(token[:n]), None, tops)
  return SampleResult(np.asarray(token[:n]), np.asarray(scored[0][:n]), tops,
                      np.asarray(scored[1][:n]))


def _top_pairs(top, row, count):
  if count is None:
    return None
  if not count:
    return []
  values, ids = top
  return [(int(t), float(lp)) for t, lp in zip(ids[row, :count], values[row, :count])]
