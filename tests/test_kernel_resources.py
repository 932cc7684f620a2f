"""The Pallas kernels lower through Triton and compile to Hopper code, checked on a CPU host.

Each kernel is lowered for CUDA, Pallas's Triton IR is compiled with the `triton` package
for sm_90a, and the cubin is read back (benchmarks.kernel_resources). These tests catch a
kernel that no longer lowers or compiles, spills registers, overflows shared memory, or
loses Hopper's wgmma. None of that shows in interpret mode. They say nothing about speed.
"""

import dataclasses
import importlib.util
import platform
import sys

import jax
import jax.numpy as jnp
import pytest

# triton is a dev dependency on linux x86_64: missing there, the install is broken and
# these tests fail; elsewhere (no wheel) they skip.
if importlib.util.find_spec('triton') is None:
  if sys.platform == 'linux' and platform.machine() == 'x86_64':
    raise ImportError('triton is missing: it is a dev dependency on linux x86_64; '
                      'pip install -e ".[dev]"')
  pytest.skip('no triton wheel for this platform', allow_module_level=True)

from benchmarks import kernel_resources as kr  # noqa: E402


def _compile(fn, args):
  return [kr.compile_sm90(call) for call in kr.triton_calls(fn, *args)]


def _assert_fits(res):
  assert res.stack_bytes == 0, f'{res.name} spills registers: {res}'
  assert res.registers <= 255, res
  assert 0 < res.shared_bytes <= kr.SHARED_LIMIT, res


@pytest.mark.parametrize('kv_heads', [8, 32])
def test_flash_attention_bf16_d128_compiles_to_wgmma_without_spills(kv_heads):
  fn, args = kr.flash_case(2048, 32, kv_heads, 128, causal=True)
  kernels = _compile(fn, args)
  assert [k.name for k in kernels] == ['flash_attention_fwd', 'flash_attention_dkv',
                                       'flash_attention_dq']
  for res in kernels:
    _assert_fits(res)
    assert res.uses_wgmma and 'HMMA' not in res.mma, res


def test_every_tile_choice_the_benchmark_sweeps_fits_shared_memory():
  from benchmarks import attention
  from pallas_kernels import flash_attention as fa
  q = jax.ShapeDtypeStruct((1, 8192, 32, 128), jnp.bfloat16)
  cfg = fa._make_config(q, q, True, None, 1.0, {}, False, False)
  assert attention.TILES[0] == tuple(getattr(cfg, n) for n in attention.TILE_NAMES), (
      'TILES[0] must be the default tiles, which the tests above check')
  for tile in attention.TILES[1:]:
    fn, args = kr.flash_case(1024, 8, 2, 128, causal=True,
                             **dict(zip(attention.TILE_NAMES, tile)))
    for res in _compile(fn, args):
      assert res.shared_bytes <= kr.SHARED_LIMIT and res.uses_wgmma, (tile, res)
      assert res.stack_bytes <= 512, (tile, res)


def test_packed_documents_compile_with_only_a_small_spill():
  # The document block ranges are two more loads per program. In dk/dv (255 registers
  # already) they cost a 40-byte spill, stored before and reloaded outside the q-block
  # loop (read in its SASS), so nothing extra runs per block.
  fn, args = kr.flash_case(2048, 32, 8, 128, causal=True, packed=True)
  for res in _compile(fn, args):
    assert res.uses_wgmma and res.registers <= 255, res
    assert res.stack_bytes <= 64, res


@pytest.mark.parametrize('head_dim', [64, 256])
def test_flash_attention_other_head_dims_compile_without_spills(head_dim):
  fn, args = kr.flash_case(1024, 8, 2, head_dim, causal=True, sliding_window=300)
  for res in _compile(fn, args):
    _assert_fits(res)
    assert res.mma, f'{res.name}: bf16 dots must run on tensor cores: {res}'


def test_flash_attention_fp32_picks_tiles_that_do_not_spill():
  # fp32 dots run on FMA units; 128x64 tiles spilled ~10 KB per thread before.
  fn, args = kr.flash_case(1024, 4, 4, 128, jnp.float32, causal=False)
  fwd, dkv, dq = _compile(fn, args)
  assert not fwd.mma and not dq.mma
  for res in (fwd, dq):
    _assert_fits(res)
  assert dkv.stack_bytes < 1024, dkv


@pytest.mark.parametrize('batch, context, q_tokens, q_heads, kv_heads', [
    (8, 4096, None, 32, 8), (64, 8192, None, 32, 8), (16, 1024, 200, 32, 8),
    (16, 1024, 40, 28, 4)])   # 7 q heads per kv head: padded to 8
def test_paged_attention_compiles_without_spills(batch, context, q_tokens, q_heads, kv_heads):
  fn, args = kr.paged_case(batch, context, q_tokens=q_tokens, q_heads=q_heads,
                           kv_heads=kv_heads)
  [res] = _compile(fn, args)
  assert res.name == 'ragged_paged_attention'
  _assert_fits(res)
  assert res.mma, res


@pytest.mark.parametrize('q_tokens', [None, 200])
def test_paged_attention_with_a_runtime_window_compiles_without_spills(q_tokens):
  """The sliding window as a traced operand (Gemma's layer scan), with a soft cap: still
  wgmma, no spills."""
  fn, args = kr.paged_case(16, 1024, q_tokens=q_tokens)
  windowed = lambda *a: fn(*a[:-1], sliding_window=a[-1], softcap=50.0)
  [res] = _compile(windowed, args + (jax.ShapeDtypeStruct((1,), jnp.int32),))
  _assert_fits(res)
  assert res.mma, res


def test_every_paged_tile_choice_the_benchmark_sweeps_fits():
  from benchmarks import paged_decode
  from pallas_kernels import paged_attention as pa
  assert paged_decode.TILES[0] == (pa._choose_pages_per_block(16, 8192 // 16), 4, 2), (
      'the first entry must be the defaults')
  for tile in paged_decode.TILES:
    fn, args = kr.paged_case(64, 8192)
    kwargs = dict(zip(paged_decode.TILE_NAMES, tile))
    [res] = _compile(lambda *a, kw=kwargs: fn(*a, **kw), args)
    assert res.num_warps == kwargs['num_warps'] and res.num_stages == kwargs['num_stages']
    assert res.shared_bytes <= kr.SHARED_LIMIT and res.stack_bytes <= 512, (tile, res)


def test_a_broken_kernel_fails_with_its_name():
  fn, args = kr.flash_case(256, 2, 2, 64)
  call = kr.triton_calls(fn, *args)[0]
  broken = dataclasses.replace(call, ttir=call.ttir.replace('tt.dot', 'tt.not_an_op', 1))
  with pytest.raises(RuntimeError, match='flash_attention_fwd'):
    kr.compile_sm90(broken)


def test_interpret_mode_kernels_are_not_mistaken_for_gpu_ones():
  from pallas_kernels.flash_attention import flash_attention
  q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.float32)
  with pytest.raises(RuntimeError, match='interpret=True'):
    kr.triton_calls(lambda q: flash_attention(q, q, q, interpret=True), q)
