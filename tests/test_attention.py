"""Attention implementations agree; the cuDNN call is checked on CPU through the same
`jax.nn.dot_product_attention` entry point with its portable implementation."""

import dataclasses

import jax
import numpy as np
import pytest

from model import transformer
from sharding.mesh import MeshConfig
from tests.test_parallel import rel_err, sharded_loss_and_grads, tiny_config


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


MESH = MeshConfig(data=1, fsdp=2, tensor=4)


@pytest.fixture(scope='module')
def xla_loss_and_grads():
  return sharded_loss_and_grads(tiny_config(), MESH, 3, True)


@pytest.mark.parametrize('pallas_backend, kernels', [
    ('auto', (None, None)),   # flash_attention.default_backend picks
    ('triton', ('triton', None)),
    ('mosaic_gpu', ('mosaic_gpu', None)),
    ('mosaic_gpu_fused', ('mosaic_gpu', 'mosaic_gpu_fused'))])
def test_model_with_pallas_matches_xla_sharded(monkeypatch, xla_loss_and_grads,
                                               pallas_backend, kernels):
  """attention_impl='pallas' (shard_map over batch and heads) equals 'xla': loss and grads;
  model.pallas_backend picks flash_attention's forward and backward kernels. The Mosaic
  kernels themselves are checked in test_flash_attention_mgpu; here each call is recorded
  and served by the portable kernels."""
  real, seen = transformer.flash_attention, []

  def recording(*args, backend=None, backend_bwd=None, **kwargs):
    seen.append((backend, backend_bwd))
    return real(*args, **kwargs)

  monkeypatch.setattr(transformer, 'flash_attention', recording)
  cfg = tiny_config()
  cfg.model = dataclasses.replace(cfg.model, attention_impl='pallas',
                                  pallas_backend=pallas_backend)
  p_loss, p_grads = sharded_loss_and_grads(cfg, MESH, 3, True)
  assert seen and set(seen) == {kernels}
  loss, grads = xla_loss_and_grads
  assert rel_err(p_loss, loss) < 1e-5
  assert max(jax.tree.leaves(jax.tree.map(rel_err, p_grads, grads))) < 1e-5


def test_save_attention_sharded_matches_xla(xla_loss_and_grads):
  """remat='save_attention' with the kernel's shard_map between the block's checkpointed
  parts, under FSDP x tensor with sequence parallelism: loss and grads as without remat."""
  cfg = tiny_config()
  cfg.model = dataclasses.replace(cfg.model, attention_impl='pallas', remat='save_attention')
  loss, grads = sharded_loss_and_grads(cfg, MESH, 3, True)
  ref_loss, ref_grads = xla_loss_and_grads
  assert rel_err(loss, ref_loss) < 1e-5
  assert max(jax.tree.leaves(jax.tree.map(rel_err, grads, ref_grads))) < 1e-5


def test_pallas_under_per_shard_grad_accumulation():
  """The kernel's shard_map also runs inside the vmapped ZeRO-1 microbatch loop."""
  cfg = tiny_config()
  cfg.data.batch_size = 32
  ref_loss, ref_grads = sharded_loss_and_grads(cfg, MeshConfig(data=1), 0, False,
                                               jax.devices()[:1])
  cfg.optim.grad_accum = 4
  cfg.model = dataclasses.replace(cfg.model, attention_impl='pallas')
  loss, grads = sharded_loss_and_grads(cfg, MeshConfig(data=2, fsdp=2, tensor=2), 1, True)
  assert rel_err(loss, ref_loss) < 1e-5
  assert max(jax.tree.leaves(jax.tree.map(rel_err, grads, ref_grads))) < 1e-5


@pytest.mark.parametrize('overrides, message', [
    (dict(pallas_backend='cuda'), "pallas_backend='cuda': choose one of"),
    (dict(pallas_backend='mosaic_gpu', dtype='float32'), "set model.dtype='bfloat16'"),
    (dict(pallas_backend='mosaic_gpu_fused', dtype='float32'), "set model.dtype='bfloat16'"),
    (dict(pallas_backend='mosaic_gpu_fused', dtype='bfloat16', head_dim=32),
     "'mosaic_gpu_fused' takes head_dim 64 or 128"),
])
def test_pallas_backend_is_validated(overrides, message):
  cfg = dataclasses.replace(tiny_config().model, **overrides)
  with pytest.raises(ValueError, match=message):
    cfg.validate()
  dataclasses.replace(cfg, pallas_backend='mosaic_gpu', dtype='bfloat16').validate()
