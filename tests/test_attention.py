"""Attention implementations agree; the cuDNN call is checked on CPU through the same
`jax.nn.dot_product_attention` entry point with its portable implementation."""


import jax
import numpy as np
import pytest

from model import transformer


def qkv(seed, b=2, t=12, h=8, k=2, e=16):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, t, h, e)).astype(np.float32)
  kk = rng.normal(size=(b, t, k, e)).astype(np.float32)
  v = rng.normal(size=(b, t, k, e)).astype(np.float32)
  seg = np.cumsum(rng.random((b, t)) < 0.2, axis=1).astype(np.int32) + 1
  return q, kk, v, seg


@pytest.mark.parametrize('packed', [False, True])
def test_cudnn_wiring_matches_xla(monkeypatch, packed):
  real = jax.nn.dot_product_attention

  def portable(*args, implementation=None, **kwargs):
    assert implementation == 'cudnn'
    return real(*args, implementation='xla', **kwargs)

  monkeypatch.setattr(jax.nn, 'dot_product_attention', portable)
  q, k, v, seg = qkv(0)
  seg = seg if packed else None
  out = transformer.attention_cudnn(q, k, v, seg)
  ref = transformer.attention_xla(q, k, v, seg)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_pallas_is_refused_until_built():
  from model.config import ModelConfig  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="attention_impl='pallas'"):
    ModelConfig(attention_impl='pallas').validate()
