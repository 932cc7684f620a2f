"""Serving a windowed model through the XLA paged path: the windowed layers never read
the pages before their window (NaN there changes nothing), the global layers of the same
scanned stack still read them, in every cache format and on a tensor-parallel mesh."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import paged
from model.config import ModelConfig
from serve.worker.model_runner import serving_plan
from sharding.mesh import MeshConfig, make_mesh
from tests.test_gemma import GEMMA2, random_norms, two_step_batches
from tests.test_paged_attention import rel_err

# two_step_batches' second step: a's chunk at 12..19 (window 5: keys from 8, page 2 on)
# and b's decode at 8 (keys from 4, page 1 on); a's pages are ids 0-4, b's 5-7.
BEFORE_WINDOWS = [0, 1, 5]


def _poison(cache, layers, pages):
  """NaN in those layers' pages: in K and V, or an 8-bit cache's scales."""
  return tuple(c.at[np.ix_(layers, pages)].set(jnp.nan) if c.dtype == jnp.float32 else c
               for c in cache)


@pytest.mark.parametrize('kv_cache_dtype,tensor', [('auto', 1), ('int8', 1), ('fp8', 1),
                                                   ('auto', 2), ('int8', 2)])
def test_windowed_layers_never_read_pages_before_the_window(kv_cache_dtype, tensor):
  """A tiny Gemma 2 (window 5, every other layer global, scanned) served in two steps,
  prefill chunks then a chunk continuing across the window's edge and a decode row: NaN
  in the windowed layers' pages before the second step's windows leaves its logits
  finite and bitwise the clean run's; the same NaN in every layer reaches them. Float32
  pages: the training forward's logits."""
  cfg = ModelConfig(vocab_size=64, num_layers=4, embed_dim=32, num_heads=4, num_kv_heads=2,
                    max_seq_len=64, init_std=0.3, **GEMMA2)
  params = random_norms(model.init_params(cfg, jax.random.key(0)))
  plan = None
  if tensor > 1:
    plan = serving_plan(make_mesh(MeshConfig(data=1, tensor=tensor),
                                  devices=jax.devices()[:tensor]))
  rng = np.random.default_rng(0)
  a, b = (rng.integers(0, 64, n).astype(np.int32) for n in (20, 9))
  first, second = (jax.jit(functools.partial(paged.sampled_logits, batch=s, cfg=cfg,
                                             plan=plan))
                   for s in two_step_batches(a, b))
  logits, cache = first(params, paged.init_kv_cache(cfg, 8, 4,
                                                    kv_cache_dtype=kv_cache_dtype))
  clean = np.asarray(second(params, cache)[0])
  local = np.flatnonzero(cfg.layer_is_local())
  assert list(local) == [0, 2]
  out = np.asarray(second(params, _poison(cache, local, BEFORE_WINDOWS))[0])
  assert np.isfinite(out).all(), 'a windowed layer read a page before its window'
  np.testing.assert_array_equal(out, clean)
  every = np.arange(cfg.num_layers)
  assert np.isnan(np.asarray(second(params, _poison(cache, every, BEFORE_WINDOWS))[0])).any()
  if kv_cache_dtype == 'auto':
    dense = lambda t: model.logits(params, model.forward(params, jnp.asarray(t[None]), cfg),
                                   cfg)[0]
    da, db = dense(a), dense(b)
    assert rel_err(np.concatenate([logits, clean]),
                   jnp.concatenate([da[:12], db[:8], da[12:], db[8:]])) < 1e-5
