"""Choosing the next token of every running request in one jitted program.

Per-row settings travel as arrays, so one program serves any mix of greedy, temperature,
top-k, top-p and min-p rows; programs differ only by the row bucket (a power of two), by
`mode` (all greedy / no sort needed / sort) and by whether any row wants top logprobs.

Filters apply in the order Hugging Face applies them: temperature, top-k, top-p (on the
top-k survivors, renormalised), min-p (relative to the most likely token, so it commutes
with the others). Tokens tied with the last kept one are kept. Logprobs are the "raw"
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


@dataclasses.dataclass
class SampleResult:
  token_ids: np.ndarray                    # [N] int32
  logprobs: np.ndarray | None              # [N] float32 raw log p(token); None if no row asked
  top_logprobs: list[list[tuple[int, float]] | None]   # per row: top N (token, logprob) or None


class Sampler:
  """The engine's sampler: `sample` plus the RNG that seeds requests without a seed."""

  def __init__(self, seed: int | None = None):
    self._rng = np.random.default_rng(seed)

  def __call__(self, logits, params: list[SamplingParams], steps: list[int],
               vocab_size: int) -> SampleResult:
    return sample(logits, params, steps, vocab_size, rng=self._rng)


def sample(logits: jax.Array, params: list[SamplingParams], steps: list[int], vocab_size: int,
           rng: np.random.Generator | None = None) -> SampleResult:
  """One token per row of logits [N, V >= vocab_size]; ids >= vocab_size are never drawn."""
  n = len(params)
  if logits.ndim != 2 or logits.shape[0] != n or len(steps) != n:
    raise ValueError(f'sample: logits {logits.shape} must be [len(params)={n}, vocab] and '
                     f'steps must have {n} entries, got {len(steps)}')
  if logits.shape[1] < vocab_size:
    raise ValueError(f'sample: logits have {logits.shape[1]} columns, fewer than the '
                     f'vocabulary ({vocab_size}); pass the tokenizer vocab_size')
  rows = _bucket(n)
  rows_args = _row_arrays(params, steps, rng or np.random.default_rng(), rows)
  logits = jnp.asarray(logits)
  padded = jnp.pad(logits, ((0, rows - n), (0, 0))) if rows > n else logits
  want_top = any(p.logprobs for p in params)
  out = _sample_rows(padded, *rows_args, vocab_size=vocab_size, mode=_mode(params),
                     top_n=min(MAX_LOGPROBS, vocab_size) if want_top else 0)
  return _result(params, jax.device_get(out), n)


def _bucket(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def _mode(params: list[SamplingParams]) -> str:
  sampled = [p for p in params if not p.greedy]
  if not sampled:
    return 'greedy'
  return 'sort' if any(p.top_k > 0 or p.top_p < 1.0 for p in sampled) else 'plain'


def _key_data(seed: int) -> tuple[int, int]:
  """A threefry key's two 32-bit words from any Python int (taken modulo 2**64)."""
  seed %= 1 << 64
  return seed >> 32, seed & 0xFFFFFFFF


def _row_arrays(params, steps, rng, rows):
  """Per-row settings as arrays of `rows` entries; padding rows are greedy and unseeded."""
  pad = rows - len(params)
  column = lambda values, fill, dtype: np.asarray(list(values) + [fill] * pad, dtype)  # noqa
  seeds = [p.seed if p.seed is not None else int(rng.integers(1 << 63)) for p in params]
  keys = np.asarray([_key_data(s) for s in seeds] + [(0, 0)] * pad, np.uint32)
  return (column((p.temperature for p in params), 0.0, np.float32),
          column((p.top_k for p in params), 0, np.int32),
          column((p.top_p for p in params), 1.0, np.float32),
          column((p.min_p for p in params), 0.0, np.float32),
          keys, column(steps, 0, np.int32))


@functools.partial(jax.jit, static_argnames=('vocab_size', 'mode', 'top_n'))
def _sample_rows(logits, temperature, top_k, top_p, min_p, key_data, steps, *,
                 vocab_size, mode, top_n):
  logits = logits[:, :vocab_size].astype(jnp.float32)
  raw = jax.nn.log_softmax(logits, axis=-1)
  token = jnp.argmax(logits, axis=-1)
  if mode != 'greedy':
    filtered = filtered_logprobs(logits, temperature, top_k, top_p, min_p, sort=mode == 'sort')
    keys = jax.vmap(_row_key)(key_data, steps)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    token = jnp.where(temperature < GREEDY_BELOW, token, drawn)
  token_logprob = jnp.take_along_axis(raw, token[:, None], axis=1)[:, 0]
  top = jax.lax.top_k(raw, top_n) if top_n else None
  return token.astype(jnp.int32), token_logprob, top


def _row_key(key_data, step):
  return jax.random.fold_in(jax.random.wrap_key_data(key_data, impl='threefry2x32'), step)


def filtered_logprobs(logits, temperature, top_k, top_p, min_p, sort=True):
  """log p of the distribution rows are sampled from: -inf outside the kept tokens.

  logits [N, V]; the rest [N]. sort=False skips top-k and top-p (callers pass it only when
  every row has them off). Greedy rows (temperature ~0) come back at temperature 1.
  """
  temperature = jnp.where(temperature < GREEDY_BELOW, 1.0, temperature)
  scaled = logits / temperature[:, None]
  # min-p: p_i >= min_p * p_max, in a form that needs no normalisation.
  keep = jnp.exp(scaled - scaled.max(axis=-1, keepdims=True)) >= min_p[:, None]
  if sort:
    keep &= scaled >= _top_k_top_p_cutoff(scaled, top_k, top_p)[:, None]
  return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def _top_k_top_p_cutoff(scaled, top_k, top_p):
  """Per row, the smallest logit top-k and then top-p keep (kept sets are sorted prefixes)."""
  desc = -jnp.sort(-scaled, axis=-1)
  vocab = scaled.shape[-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_top_k = desc >= jnp.take_along_axis(desc, (k - 1)[:, None], axis=1)
  probs = jax.nn.softmax(jnp.where(in_top_k, desc, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  # top_p == 1 must keep everything even where float32 cumsums pass 1.0 early.
  in_top_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
  return jnp.min(jnp.where(in_top_k & in_top_p, desc, jnp.inf), axis=-1)


def _result(params, out, n) -> SampleResult:
  token, token_logprob, top = out
  asked = any(p.logprobs is not None for p in params)
  tops = [_top_pairs(top, i, p.logprobs) for i, p in enumerate(params)]
  return SampleResult(np.asarray(token[:n]), np.asarray(token_logprob[:n]) if asked else None,
                      tops)


def _top_pairs(top, row, count):
  if count is None:
    return None
  if not count:
    return []
  values, ids = top
  return [(int(t), float(lp)) for t, lp in zip(ids[row, :count], values[row, :count])]
