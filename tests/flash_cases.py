"""A tiny model trained through the flash kernels (interpreted on CPU) and through XLA's
attention: the shared setup of the tests that hold the kernels to XLA's loss and
gradients for a model field (tests/test_gemma.py, tests/test_hf_families.py)."""

import dataclasses

import jax
import numpy as np

import model
from model.config import ModelConfig
from tests.test_paged_attention import rel_err


def tiny_config(num_layers: int = 2, **fields) -> ModelConfig:
  """4 query heads over 2 kv heads, 32 positions; init_std 0.3 spreads the scores enough
  that a mask or cap applied wrong moves the loss."""
  return ModelConfig(vocab_size=64, num_layers=num_layers, embed_dim=32, num_heads=4,
                     num_kv_heads=2, max_seq_len=32, init_std=0.3, **fields)


def loss_and_grads_of(cfg: ModelConfig, params):
  """(**fields) -> (loss, grads) of `params` under cfg with those fields replaced, on one
  fixed batch of 2 sequences of 31 tokens."""
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32)).astype(np.int32)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
           'weights': np.ones((2, 31), np.float32)}

  def loss_and_grads(**fields):
    model_cfg = dataclasses.replace(cfg, **fields)
    return jax.jit(jax.value_and_grad(lambda p: model.summed_nll(p, batch, model_cfg)))(params)
  return loss_and_grads


def assert_flash_equals_xla(loss_and_grads):
  """attention_impl='pallas' gives XLA attention's loss and gradients; returns that loss."""
  (want, want_grads), (got, got_grads) = (loss_and_grads(attention_impl=impl)
                                          for impl in ('xla', 'pallas'))
  assert rel_err(got, want) < 1e-5
  assert max(jax.tree.leaves(jax.tree.map(rel_err, got_grads, want_grads))) < 1e-5
  return want
