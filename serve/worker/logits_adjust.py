"""The logits before sampling, adjusted as vLLM does: logit_bias, then the repetition,
frequency and presence penalties from each row's prompt and output tokens, then -inf for
the tokens a row may not draw (its bans; those outside its allowed set, as packed bits).

The arrays are built on the host (`adjust_arrays`) and applied inside the sampler's
program (`adjusted_logits`)."""

import jax.numpy as jnp
import numpy as np

from serve.worker.penalties import stored_rows


def row_bucket(n: int) -> int:
  """The rows a sample of n rows runs as (a power of two): its program's size."""
  return 1 << max(0, n - 1).bit_length()


def adjust_arrays(params, history, rows, vocab_size, banned=None, allowed=None,
                  requests=None, penalties=None) -> dict | None:
  """adjusted_logits' arguments for the rows (None: no row adjusts its logits). Token ids
  are padded with vocab_size, which the scatters drop, to a power-of-two width (>= 16):
  one program per width, not per length."""
  ban = banned is not None and any(len(b) for b in banned)
  guide = allowed is not None and any(a is not None for a in allowed)
  if not ban and not guide and not any(p.adjusts_logits for p in params):
    return None
  pad = rows - len(params)
  repeat = any(p.repetition_penalty != 1 for p in params)
  count = any(p.counts_output for p in params)
  stored = requests is not None and (repeat or count)
  if stored and len(requests) != len(params):
    raise ValueError(f'sample: requests has {len(requests)} PenaltyRows for {len(params)} '
                     'rows; give one per row (a draft\'s rows each name its request)')
  if stored and penalties is None:
    raise ValueError('sample: requests need the PenaltyState that keeps their counts: pass '
                     'penalties=, or call a Sampler (it passes its own)')
  if (repeat or count) and not stored and (history is None or len(history) != len(params)):
    raise ValueError('sample: penalties need each row\'s (prompt ids, output ids) history, '
                     'or its PenaltyRow (requests)')

  def column(values, fill):
    return np.asarray(list(values) + [fill] * pad, np.float32)

  def padded(lists, fill=vocab_size, dtype=np.int32):
    width = max(16, row_bucket(max(map(len, lists))))
    out = np.full((rows, width), fill, dtype)
    for i, values in enumerate(lists):
      out[i, :len(values)] = values
    return out

  adjust = penalties.arrays(params, requests, rows, vocab_size) if stored else {}
  if count:
    adjust['presence'] = column((p.presence_penalty for p in params), 0.0)
    adjust['frequency'] = column((p.frequency_penalty for p in params), 0.0)
  if repeat:
    adjust['repetition'] = column((p.repetition_penalty for p in params), 1.0)
  if count and not stored:
    adjust['output'] = padded([h[1] if p.counts_output else () for p, h in zip(params, history)])
  if repeat and not stored:
    adjust['seen'] = padded([list(h[0]) + list(h[1]) if p.repetition_penalty != 1 else ()
                             for p, h in zip(params, history)])
  if any(p.logit_bias for p in params):
    adjust['bias_ids'] = padded([list(p.logit_bias) for p in params])
    adjust['bias'] = padded([list(p.logit_bias.values()) for p in params], 0.0, np.float32)
  if ban:
    if len(banned) != len(params):
      raise ValueError(f'sample: banned must have one list per row ({len(params)}), got '
                       f'{len(banned)}')
    adjust['banned'] = padded([list(b) for b in banned])
  if guide:   # 32 tokens a word: 1/32 of a bool mask to send each step
    words = np.full((rows, -(-vocab_size // 32)), 0xFFFFFFFF, np.uint32)
    for i, a in enumerate(allowed):
      if a is not None:
        words[i] = a
    adjust['allowed'] = words
  return adjust or None


def adjusted_logits(logits, output=None, presence=None, frequency=None, seen=None,
                    repetition=None, bias_ids=None, bias=None, banned=None, allowed=None,
                    seen_table=None, seen_slot=None, count_table=None, count_slot=None,
                    ahead=None):
  """logits [N, V] after logit_bias (bias_ids, bias [N, B]), the repetition penalty over
  the tokens in `seen` [N, S], the frequency and presence penalties over the tokens of
  `output` [N, O] (penalties [N]), and -inf for the tokens in `banned` [N, K] and those
  whose bit is 0 in `allowed` [N, ceil(V / 32)] (unpack_bits); ids >= V are padding.
  Instead of seen and output, the penalties may read PenaltyState's tables: row i's
  seen_table[seen_slot[i]] and count_table[count_slot[i]] plus its draft prefix ahead[i]."""
  logits, rows = jnp.asarray(logits), jnp.arange(logits.shape[0])[:, None]
  if bias_ids is not None:
    logits = logits.at[rows, bias_ids].add(bias, mode='drop')
  if seen_table is not None:
    seen_mask = stored_rows(seen_table, seen_slot, ahead)
  elif seen is not None:
    seen_mask = jnp.zeros(logits.shape, bool).at[rows, seen].set(True, mode='drop')
  if seen is not None or seen_table is not None:
    r = repetition[:, None]
    logits = jnp.where(seen_mask, jnp.where(logits > 0, logits / r, logits * r), logits)
  if count_table is not None:
    counts = stored_rows(count_table, count_slot, ahead).astype(jnp.float32)
  elif output is not None:
    counts = jnp.zeros(logits.shape, jnp.float32).at[rows, output].add(1.0, mode='drop')
  if output is not None or count_table is not None:
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
  if banned is not None:
    logits = logits.at[rows, banned].set(-jnp.inf, mode='drop')
  if allowed is not None:
    logits = jnp.where(unpack_bits(allowed, logits.shape[1]), logits, -jnp.inf)
  return logits


def pack_bits(token_ids, vocab_size: int) -> np.ndarray:
  """unpack_bits' inverse: [ceil(vocab_size / 32)] uint32 words with the ids' bits set."""
  words = np.zeros(-(-vocab_size // 32), np.uint32)
  ids = np.asarray(sorted(set(token_ids)), np.int64)
  np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
  return words


def unpack_bits(words, vocab_size: int):
  """[..., W] uint32 words -> [..., vocab_size] bool: token i is bit i % 32 of word
  i // 32 (numpy or jax arrays)."""
  ids = np.arange(vocab_size)
  return (words[..., ids // 32] >> (ids % 32).astype(np.uint32)) & 1 == 1
