"""Flash attention forward for Hopper in Pallas's Mosaic GPU backend.

The portable kernels in flash_attention.py go through Pallas's Triton lowering, which jax
0.11 deprecates and which issues no TMA and no warp specialization. This forward kernel
is written for the H100/H200 the way FlashAttention-3 is:

  one program = 2 * block_q query rows of one (batch, q head); three warpgroups:

  warpgroup 2 (producer, 40 registers)  TMA: K, V blocks -> `stages` SMEM slots
  warpgroups 0, 1 (compute, 232 regs)   rows [r0, r0+bq) and [r0+bq, r0+2bq):
                                        S = Q K^T (wgmma), online softmax in registers,
                                        O += P V (wgmma, P from registers)

  slot s:  k_ready[s] --(both compute wgs wait)--> k_done[s] (2 arrivals) --> producer
           reloads slot s with the block `stages` steps later; the same for V.

The compute warpgroups take turns on the tensor cores (a two-arrival `turn` barrier): one
runs its softmax while the other's matmuls run. Both compute warpgroups walk the same
kv blocks [lo, hi) of the program (the union of what their rows can see) so that every
barrier phase is waited on by both; the mask only trims what a row may not see. The walk is
split into masked [lo, lo_full), unmasked [lo_full, hi_full) and masked [hi_full, hi)
runs, so only blocks on the causal diagonal, the window edge or the padded keys pay for
the mask.

Same semantics as the portable forward (flash_attention._forward): q [B, T, Hq, D] padded
to a multiple of 2 * block_q rows, k, v [B, S, Hkv, D] padded to a multiple of block_k;
returns out [B, T, Hq, D] and lse [B, Hq, T] (natural log). Scores are kept in base 2
(scale * log2 e folded into one multiply) so each exponential is one exp2.

On CPU the kernel runs in Mosaic GPU's interpreter (jax >= 0.10): barriers, TMA copies,
the three warpgroups and their races are simulated. The interpreter has no wgmma with a
transposed or register operand, so there the two matmuls are plain dots on the same SMEM
tiles; everything else is the code that runs on the GPU. The wgmma path is checked by
lowering for CUDA on CPU (tests) and by running on a GPU (tests/test_gpu.py).
"""

import dataclasses
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite, as in the portable kernel: a fully masked block gives p = 0
COMPUTE_WGS = 2
SMEM_LIMIT = 227 * 1024  # H100 / H200: shared memory one block may have
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  """Tiles of the Mosaic GPU forward. block_q rows per compute warpgroup (wgmma M = 64)."""
  block_q: int = 64
  block_k: int = 128
  stages: int = 2

  @classmethod
  def default(cls, head_dim: int) -> 'MosaicTiles':
    # SMEM: 2*bq*D (Q, reused for O) + 2*stages*bk*D (K, V), bf16. D=128: 160 KiB of
    # 227; D=256 halves block_k to stay at 192 KiB; D=64 affords a third stage.
    if head_dim > 128:
      return cls(block_k=64)
    return cls(stages=3) if head_dim <= 64 else cls()

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    q = COMPUTE_WGS * self.block_q * head_dim * itemsize
    kv = 2 * self.stages * self.block_k * head_dim * itemsize
    return q + kv + COMPUTE_WGS * self.block_q * 4  # + lse staging


def unsupported_reason(q, segment_ids) -> str | None:
  """Why the Mosaic GPU forward cannot take these inputs, or None when it can."""
  if plgpu is None:
    return f'this jax ({jax.__version__}) has no Pallas Mosaic GPU backend'
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f'dtype {q.dtype} (it takes bfloat16 and float16)'
  if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
    return f'head_dim {q.shape[-1]} (it takes {SUPPORTED_HEAD_DIMS})'
  if segment_ids is not None:
    return 'segment_ids (packed documents)'
  return None


# ---------------------------------------------------------------------------- block ranges

def _kv_ranges(r0, rows, block_k, num_kv_blocks, cfg):
  """For query rows [r0, r0 + rows): kv blocks [lo, hi) any row sees, and the part
  [lo_full, hi_full) in which every row sees every key (no mask needed)."""
  lo, hi = 0, num_kv_blocks
  lo_full, hi_full = 0, num_kv_blocks - (1 if cfg.mask_kv_padding else 0)
  if cfg.causal:
    hi = jnp.minimum(lax.div(r0 + rows + block_k - 1, block_k), num_kv_blocks)
    hi_full = jnp.minimum(hi_full, lax.div(r0 + 1, block_k))  # last key <= first row
  if cfg.window is not None:
    lo = lax.div(jnp.maximum(r0 - cfg.window + 1, 0), block_k)
    # first key > last row - W, i.e. j * bk >= r0 + rows - W
    lo_full = lax.div(jnp.maximum(r0 + rows - cfg.window, 0) + block_k - 1, block_k)
  lo_full = jnp.clip(lo_full, lo, hi)
  hi_full = jnp.clip(hi_full, lo_full, hi)
  # Traced, not Python ints: a guarded load past the end must not be checked statically.
  return tuple(jnp.asarray(x, jnp.int32) for x in (lo, lo_full, hi_full, hi))


# ---------------------------------------------------------------------------- matmuls

def _qk(q_smem, k_smem, block_q, block_k, between, interpret):
  """S = Q K^T in fp32; `between` runs while the wgmma is in flight."""
  if interpret:  # the interpreter has no wgmma with a transposed operand
    between()
    return lax.dot_general(q_smem[...], k_smem[...], (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)

  def run(acc):
    plgpu.wgmma(acc, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
    between()
    return acc[...]

  return pl.run_scoped(run, plgpu.ACC((block_q, block_k), jnp.float32))


def _pv(acc, p, v_smem, interpret):
  """acc + P V, P a register value in the input dtype."""
  if interpret:  # nor one whose left operand lives in registers
    return acc + jnp.dot(p, v_smem[...], preferred_element_type=jnp.float32)

  def run(acc_ref):
    plgpu.wgmma(acc_ref, p, v_smem)

  return pl.run_state(run)(plgpu.ACC.init(acc))


def _filled(shape, value, interpret):
  """fp32 `value` in wgmma's accumulator layout (rows: one value per accumulator row).
  The interpreter knows no layouts."""
  x = jnp.full(shape, value, jnp.float32)
  if interpret:
    return x
  layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
  return plgpu.layout_cast(x, layout)


def _iota(shape, dim, interpret):
  if interpret:
    return lax.broadcasted_iota(jnp.int32, shape, dim)
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _bcast_rows(x, shape):
  return lax.broadcast_in_dim(x, shape, [0])


# ---------------------------------------------------------------------------- the kernel

def _compute(refs, scratch, wg, ranges, cfg, tiles, interpret):
  """One compute warpgroup: rows [r0, r0 + bq) of this program."""
  q_ref, _, _, out_ref, lse_ref = refs
  qo_smem, k_smem, v_smem, lse_smem, k_ready, v_ready, q_ready, k_done, v_done, turn = scratch
  bq, bk, stages = tiles.block_q, tiles.block_k, tiles.stages
  lo, lo_full, hi_full, hi = ranges
  b, h = lax.axis_index('batch'), lax.axis_index('heads')
  r0 = lax.axis_index('q_blocks') * (COMPUTE_WGS * bq) + wg * bq
  d = qo_smem.shape[-1]
  plgpu.set_max_registers(232, action='increase')
  q_smem, lse_smem = qo_smem.at[wg], lse_smem.at[wg]
  plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(r0, bq), h], q_smem, q_ready.at[wg])
  plgpu.barrier_wait(q_ready.at[wg])

  def take_turn():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  def step(j, carry, masked):
    acc, m, l = carry
    slot = lax.rem(j - lo, stages)
    plgpu.barrier_wait(k_ready.at[slot])
    s = _qk(q_smem, k_smem.at[slot], bq, bk, take_turn, interpret)
    plgpu.barrier_arrive(k_done.at[slot])
    s = s * (cfg.scale * _LOG2E)
    if masked:
      s = jnp.where(_mask(r0, j * bk, bq, bk, cfg, interpret), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)  # rescales what was summed under the old max
    p = jnp.exp2(s - _bcast_rows(m_new, s.shape))
    l = l * alpha + p.sum(axis=1)
    acc = acc * _bcast_rows(alpha, acc.shape)
    plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may use the cores
    plgpu.barrier_wait(v_ready.at[slot])
    plgpu.barrier_wait(turn)
    acc = _pv(acc, p.astype(v_smem.dtype), v_smem.at[slot], interpret)
    plgpu.barrier_arrive(v_done.at[slot])
    return acc, m_new, l

  carry = (_filled((bq, d), 0.0, interpret), _filled((bq,), _M_INIT, interpret),
           _filled((bq,), 0.0, interpret))
  pl.when(wg == 1)(take_turn)  # start half a step apart: ping-pong on the tensor cores
  for start, stop, masked in ((lo, lo_full, True), (lo_full, hi_full, False),
                              (hi_full, hi, True)):
    carry = lax.fori_loop(start, stop,
                          lambda j, c, masked=masked: step(j, c, masked), carry)
  pl.when(wg == 0)(take_turn)
  acc, m, l = carry

  seen = l > 0  # a row that sees no key: output 0 and lse -inf, as the portable kernel
  l_safe = jnp.where(seen, l, 1.0)
  q_smem[...] = (acc / _bcast_rows(l_safe, acc.shape)).astype(q_smem.dtype)
  lse_smem[...] = jnp.where(seen, (m + jnp.log2(l_safe)) / _LOG2E, -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, pl.ds(r0, bq), h])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(r0, bq)])
  plgpu.wait_smem_to_gmem(0)


def _mask(r0, k0, bq, bk, cfg, interpret):
  """[bq, bk] bool of allowed (query, key) pairs for rows r0.. and keys k0.."""
  q_pos = r0 + _iota((bq, bk), 0, interpret)
  k_pos = k0 + _iota((bq, bk), 1, interpret)
  ok = jnp.ones((bq, bk), jnp.bool_)
  if cfg.causal:
    ok = ok & (k_pos <= q_pos)
  if cfg.window is not None:
    ok = ok & (k_pos > q_pos - cfg.window)
  if cfg.mask_kv_padding:
    ok = ok & (k_pos < cfg.kv_len)
  return ok


def _produce(refs, scratch, lo, hi, cfg, tiles):
  """The producer warpgroup: TMA K and V blocks [lo, hi) into the slots, `stages` ahead."""
  _, k_ref, v_ref, _, _ = refs
  _, k_smem, v_smem, _, k_ready, v_ready, _, k_done, v_done, _ = scratch
  bk, stages = tiles.block_k, tiles.stages
  plgpu.set_max_registers(40, action='decrease')
  b = lax.axis_index('batch')
  kv_head = lax.div(lax.axis_index('heads'), cfg.groups)

  operands = ((k_ref, k_smem, k_ready, k_done), (v_ref, v_smem, v_ready, v_done))

  def load(j, wait_free):
    # K first: the compute warpgroups need it first, and release its slot first.
    slot, keys = lax.rem(j - lo, stages), (b, pl.ds(j * bk, bk), kv_head)
    for ref, smem, ready, done in operands:
      if wait_free:  # both compute warpgroups are done with block j - stages
        plgpu.barrier_wait(done.at[slot])
      plgpu.copy_gmem_to_smem(ref.at[keys], smem.at[slot], ready.at[slot])

  for first in range(stages):
    pl.when(lo + first < hi)(lambda first=first: load(lo + first, wait_free=False))
  pl.loop(lo + stages, hi)(lambda j: load(j, wait_free=True))

  # Observe the last blocks' releases too, so each barrier ends on a completed phase.
  @pl.loop(jnp.maximum(lo, hi - stages), hi)
  def _(j):
    for _, _, _, done in operands:
      plgpu.barrier_wait(done.at[lax.rem(j - lo, stages)])

def forward(q, k, v, cfg, tiles: MosaicTiles | None = None):
  """out [B, T, Hq, D], lse [B, Hq, T] of padded inputs; cfg: flash_attention._Config."""
  b, t, hq, d = q.shape
  s = k.shape[1]
  tiles = tiles or MosaicTiles.default(d)
  rows = COMPUTE_WGS * tiles.block_q
  if t % rows or s % tiles.block_k:
    raise ValueError(f'padded lengths T={t}, S={s} must be multiples of {rows} and '
                     f'{tiles.block_k}')
  interpret = cfg.interpret
  interpret_params = _interpret_params() if interpret else None

  def entry(*refs):
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda shape: plgpu.SMEM(shape, q.dtype, transforms=swizzled)
    buffers = (smem((COMPUTE_WGS, tiles.block_q, d)), smem((tiles.stages, tiles.block_k, d)),
               smem((tiles.stages, tiles.block_k, d)),
               plgpu.SMEM((COMPUTE_WGS, tiles.block_q), jnp.float32))
    barriers = (plgpu.Barrier(num_barriers=tiles.stages),   # k_ready
                plgpu.Barrier(num_barriers=tiles.stages),   # v_ready
                plgpu.Barrier(num_barriers=COMPUTE_WGS),    # q_ready
                plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=tiles.stages),  # k_done
                plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=tiles.stages),  # v_done
                plgpu.Barrier(num_arrivals=COMPUTE_WGS))    # turn
    pl.run_scoped(lambda *scratch: _program(refs, scratch, cfg, tiles, interpret),
                  *buffers, *barriers, collective_axes='wg')

  return plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, t), jnp.float32)),
      grid=(hq, t // rows, b), grid_names=('heads', 'q_blocks', 'batch'),
      num_threads=COMPUTE_WGS + 1, thread_name='wg',
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params)(q, k, v)


def _program(refs, scratch, cfg, tiles, interpret):
  rows = COMPUTE_WGS * tiles.block_q
  num_kv_blocks = refs[1].shape[1] // tiles.block_k
  r0 = lax.axis_index('q_blocks') * rows
  ranges = _kv_ranges(r0, rows, tiles.block_k, num_kv_blocks, cfg)
  wg = lax.axis_index('wg')
  pl.when(wg < COMPUTE_WGS)(
      lambda: _compute(refs, scratch, wg, ranges, cfg, tiles, interpret))
  pl.when(wg == COMPUTE_WGS)(lambda: _produce(refs, scratch, ranges[0], ranges[3], cfg, tiles))


def _interpret_params():
  """Mosaic GPU's CPU interpreter (jax >= 0.10; not yet a public name)."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError as e:  # pragma: no cover
    raise NotImplementedError(
        f'jax {jax.__version__} has no Mosaic GPU interpreter, so the mosaic_gpu flash '
        "backend cannot run on CPU; use backend='triton' there.") from e
  return InterpretGPUParams(detect_races=True)
