"""The kernels compiled on a GPU (not interpreted) against their references, and the cuDNN
attention path for real, at production-like shapes.

These run only where jax's default backend is a GPU:
`MESHLM_TEST_GPU=1 python -m pytest tests/test_gpu.py tests/test_flash_attention.py`
(benchmarks/gpu_session.sh does this). Without a GPU, everything here is skipped. The same
kernels are checked in interpret mode on CPU by test_flash_attention.py and
test_paged_attention.py, and compiled for sm_90 by test_kernel_resources.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import transformer
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from tests.test_flash_attention import (_check_against_reference,
                                        check_other_documents_are_never_read)
from tests.test_flash_attention_mgpu import check_mosaic_against_reference
from tests.test_paged_attention import MIXED, check, check_layer, layer_stack, make_case

pytestmark = pytest.mark.skipif(
    jax.default_backend() != 'gpu',
    reason='needs a GPU: run with MESHLM_TEST_GPU=1 on a machine that has one')


# b, t, s, hq, hkv, d, dtype, causal, segments, window, blocks (None: the defaults)
FLASH = {
    'bf16_d128_gqa_causal': (1, 1024, 1024, 32, 8, 128, jnp.bfloat16, True, None, None),
    'bf16_d128_mha_ragged': (2, 1000, 1000, 8, 8, 128, jnp.bfloat16, True, None, None),
    'bf16_d64_packed': (2, 512, 512, 8, 2, 64, jnp.bfloat16, True, 'packed', None),
    'bf16_d256_window': (1, 768, 768, 4, 2, 256, jnp.bfloat16, True, None, 200),
    'fp32_d128_full_cross': (1, 300, 520, 4, 2, 128, jnp.float32, False, 'pair', None),
    'fp32_d80_padded_dim': (1, 256, 256, 6, 2, 80, jnp.float32, True, 'packed', 64),
}


@pytest.mark.parametrize('case', FLASH, ids=list(FLASH))
def test_flash_attention_compiled(case):
  b, t, s, hq, hkv, d, dtype, causal, segments, window = FLASH[case]
  _check_against_reference(3, b, t, s, hq, hkv, d, dtype, causal, segments, window,
                           (None, None))


def test_default_backend_on_this_gpu():
  """flash_attention with no backend named: Mosaic GPU on a Hopper GPU for bf16 at
  head_dim 128 (the measured faster one), else the portable kernels; right either way."""
  from pallas_kernels import flash_attention as fa   # pylint: disable=import-outside-toplevel
  q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
  hopper = str(jax.devices()[0].compute_capability).startswith('9')
  assert fa.default_backend(q) == ('mosaic_gpu' if hopper else 'triton')
  _check_against_reference(3, 1, 1024, 1024, 8, 2, 128, jnp.bfloat16, True, 'packed', None,
                           (None, None), backend=None)


# b, t, s, hq, hkv, d, causal, window, options: the wgmma path, TMA and barriers for real;
# forward and (d <= 128) backward.
MOSAIC = {
    'd128_gqa_causal': (1, 2048, 2048, 32, 8, 128, True, None, {}),
    'd64_mha_ragged': (2, 1000, 1000, 8, 8, 64, True, None, {}),
    'd256_window': (1, 768, 768, 4, 2, 256, True, 200, {}),
    'd128_cross_padded': (1, 300, 520, 4, 2, 128, False, None, {}),
    'd128_one_stage_bk192': (1, 1024, 1024, 8, 2, 128, True, None,
                             dict(block_k=192, num_stages=1)),
    'd128_four_stages_bk64': (1, 1024, 1024, 8, 2, 128, True, None,
                              dict(block_k=64, num_stages=4)),
    'd128_bwd_steps_128': (1, 1024, 1024, 8, 2, 128, True, None,
                           dict(block_q_bwd=128, block_k_bwd=128)),
    'd64_window_gqa4_bwd_q128': (1, 1000, 1000, 16, 4, 64, True, 300,
                                 dict(block_q_bwd=128)),
    'd128_triton_bwd': (1, 1024, 1024, 8, 2, 128, True, None, dict(backend_bwd='triton')),
    'd128_packed_gqa': (2, 1024, 1024, 16, 4, 128, True, None, dict(segments='packed')),
    'd128_long_documents': (2, 2048, 2048, 16, 4, 128, True, None, dict(segments='long')),
    'd64_cross_pair_segments_bk64': (1, 300, 520, 4, 2, 64, False, None,
                                     dict(segments='pair', block_k=64)),
    # The fused backward: dQ by TMA reduce-add, shared dS (d 128) or own keys (d 64).
    'd128_fused_gqa_causal': (1, 2048, 2048, 32, 8, 128, True, None,
                              dict(backend_bwd='mosaic_gpu_fused')),
    'd64_fused_window_gqa4': (1, 1000, 1000, 16, 4, 64, True, 300,
                              dict(backend_bwd='mosaic_gpu_fused')),
    'd128_fused_cross_padded_packed': (1, 300, 520, 4, 2, 128, False, None,
                                       dict(segments='pair', backend_bwd='mosaic_gpu_fused')),
}


@pytest.mark.parametrize('case', MOSAIC, ids=list(MOSAIC))
def test_flash_attention_mosaic_compiled(case):
  *shape, tiles = MOSAIC[case]
  check_mosaic_against_reference(7, *shape, **tiles)


@pytest.mark.parametrize('backend, backend_bwd', [('triton', None), ('mosaic_gpu', None),
                                                  ('mosaic_gpu', 'mosaic_gpu_fused')])
def test_flash_attention_skips_other_documents_compiled(backend, backend_bwd):
  # Documents of 256 rows, aligned to every default tile of both kernel sets.
  check_other_documents_are_never_read(True, (512, 256, 256), 16, 4, 128, jnp.bfloat16,
                                       backend=backend, backend_bwd=backend_bwd)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('hq, hkv', [(32, 8), (28, 4), (8, 8)])
def test_paged_attention_compiled(hq, hkv, dtype):
  # GPU tiles need power-of-2 blocks of >= 16 keys: pages of 16, default tiling.
  seqs = MIXED + [(1, 700), (40, 1500)]
  case = make_case(seqs, hq=hq, hkv=hkv, d=128, page_size=16, max_seqs=9, dtype=dtype,
                   seed=hq + hkv)
  check(case, dtype)
  check(case, dtype, num_kv_splits=4)
  check(case, dtype, num_kv_splits=64)   # more splits than some sequences have blocks


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_paged_attention_stacked_cache_compiled(dtype):
  """The kernel given a 3-layer stack and a traced layer index reads that layer only:
  every layer against the reference on its own pages, the others never read (NaN)."""
  case = make_case(MIXED + [(1, 700)], hq=32, hkv=8, d=128, page_size=16, max_seqs=7,
                   dtype=dtype, seed=5)
  q, _, _, *meta = case.args
  ks, vs = layer_stack(case, 3, seed=6)
  fn = jax.jit(lambda k, v, layer: paged_attention(q, k, v, *meta, layer=layer))
  for layer in range(3):
    want = paged_attention_reference(q, ks[layer], vs[layer], *meta)
    check_layer(fn(ks, vs, jnp.asarray([layer], jnp.int32)), want, case.live_rows, dtype)
    nan = jnp.full_like(ks, jnp.nan)
    check_layer(fn(nan.at[layer].set(ks[layer]), nan.at[layer].set(vs[layer]),
                   jnp.asarray([layer], jnp.int32)), want, case.live_rows, dtype)


@pytest.mark.parametrize('packed', [False, True])
def test_cudnn_attention_matches_xla(packed):
  rng = np.random.default_rng(int(packed))
  b, t, hq, hkv, d = 2, 512, 8, 2, 128
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16)
             for h in (hq, hkv, hkv))
  seg = None
  if packed:
    seg = jnp.asarray(np.cumsum(rng.random((b, t)) < 0.01, axis=1) + 1, jnp.int32)
  out = jax.jit(transformer.attention_cudnn)(q, k, v, seg)
  ref = jax.jit(transformer.attention_xla)(q.astype(jnp.float32), k.astype(jnp.float32),
                                           v.astype(jnp.float32), seg)
  err = np.abs(np.asarray(out, np.float32) - np.asarray(ref)).max() / np.abs(ref).max()
  assert out.dtype == jnp.bfloat16 and err < 2e-2, err
