"""A short sample from a trained model: fixed-size buffer, full recompute per token.

Enough to eyeball a small model after training; the serving engine does this properly
with a paged KV cache.
"""

import jax
import jax.numpy as jnp
import numpy as np

import model
from model.config import ModelConfig


def generate(params, cfg: ModelConfig, prompt_ids, num_tokens: int, temperature: float,
             seed: int = 0) -> np.ndarray:
  """num_tokens ids sampled after the prompt (the context is cut to model.max_seq_len)."""
  prompt_ids = np.asarray(prompt_ids, np.int32)[-(cfg.max_seq_len - num_tokens):]
  start = len(prompt_ids)
  buf = np.zeros((1, start + num_tokens), np.int32)
  buf[0, :start] = prompt_ids

  def body(i, carry):
    buf, key = carry
    hidden = jax.lax.dynamic_slice_in_dim(model.forward(params, buf, cfg), i - 1, 1, axis=1)
    step_logits = model.logits(params, hidden, cfg)[:, 0]
    key, sub = jax.random.split(key)
    if temperature > 0:
      token = jax.random.categorical(sub, step_logits / temperature)
    else:
      token = jnp.argmax(step_logits, axis=-1)
    return buf.at[:, i].set(token.astype(buf.dtype)), key

  run = jax.jit(lambda buf, key: jax.lax.fori_loop(start, buf.shape[1], body, (buf, key))[0])
  return np.asarray(run(jnp.asarray(buf), jax.random.key(seed))[0, start:])
