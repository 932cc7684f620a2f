"""Flash attention forward and backward for Hopper in Pallas's Mosaic GPU backend.

The portable kernels in flash_attention.py go through Pallas's Triton lowering, which jax
0.11 deprecates and which issues no TMA and no warp specialization. These kernels are
written for the H100/H200 the way FlashAttention-3 is. The forward:

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
the mask. With segment ids (packed documents) the walk is narrowed to the blocks of the
program's own documents (documents.py), and only blocks inside one document skip the
segment mask: the producer streams each block's kv ids beside it (_Segments).

The backward (two kernels, dq and dk/dv, or the dk/dv one alone adding dQ by TMA
reduce-adds) is laid out the same way; see its section below.

Same semantics as the portable forward (flash_attention._forward): q [B, T, Hq, D] padded
to a multiple of 2 * block_q rows, k, v [B, S, Hkv, D] padded to a multiple of block_k;
returns out [B, T, Hq, D] and lse [B, Hq, T] (natural log). Scores are kept in base 2
(scale * log2 e folded into one multiply) so each exponential is one exp2.

On CPU the kernels run in Mosaic GPU's interpreter (jax >= 0.10): barriers, TMA copies,
the three warpgroups and their races are simulated. The interpreter has no wgmma with a
transposed or register operand, so there the matmuls are plain dots on the same SMEM
tiles; everything else is the code that runs on the GPU. The wgmma path is checked by
lowering for CUDA on CPU (tests) and by running on a GPU (tests/test_gpu.py).
"""

import dataclasses
import inspect
import math
import typing

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels.documents import document_block_ranges

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


def unsupported_reason(q) -> str | None:
  """Why the Mosaic GPU kernels cannot take q, or None when they can."""
  if plgpu is None:
    return f'this jax ({jax.__version__}) has no Pallas Mosaic GPU backend'
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f'dtype {q.dtype} (it takes bfloat16 and float16)'
  if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
    return f'head_dim {q.shape[-1]} (it takes {SUPPORTED_HEAD_DIMS})'
  return None


# ---------------------------------------------------------------------------- block ranges

def _kv_ranges(r0, rows, block_k, num_kv_blocks, cfg):
  """For query rows [r0, r0 + rows): kv blocks [lo, hi) any row sees, and the part
  [lo_full, hi_full) in which every row sees every key (no mask needed)."""
  lo, hi = 0, num_kv_blocks
  lo_full, hi_full = 0, num_kv_blocks
  if cfg.mask_kv_padding:
    # S is padded to a multiple of every kernel's tiles (the backward's 128 rows too), so
    # padded keys may fill several blocks: skip the all-padding ones, mask the straddler.
    hi = -(-cfg.kv_len // block_k)
    hi_full = cfg.kv_len // block_k
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

_NT = (((1,), (1,)), ((), ()))  # A B^T
_NN = (((1,), (0,)), ((), ()))  # A B


def _mma_nt(pairs, shape, interpret, between=None):
  """[A B^T for (A, B) in pairs], fp32 `shape`, A and B SMEM tiles: the wgmmas are issued
  together and waited on once; `between` runs while they are in flight."""
  if interpret:  # the interpreter has no wgmma with a transposed operand
    if between:
      between()
    return [lax.dot_general(a[...], b[...], _NT, preferred_element_type=jnp.float32)
            for a, b in pairs]

  def run(*accs):
    for acc, (a, b) in zip(accs, pairs):
      plgpu.wgmma(acc, a, b.transpose((1, 0)))
    if between:
      between()
    return [acc[...] for acc in accs]

  return pl.run_scoped(run, *[_acc_type()(shape, jnp.float32) for _ in pairs])


def _mma_acc(terms, interpret):
  """[acc + A B for (acc, A, B) in terms]: acc fp32 registers, A registers in the input
  dtype (P, dS), B a SMEM tile; issued together, waited on once."""
  if interpret:  # nor one whose left operand lives in registers
    return [acc + lax.dot_general(a, b[...], _NN, preferred_element_type=jnp.float32)
            for acc, a, b in terms]

  def run(refs):
    for ref, (_, a, b) in zip(refs, terms):
      plgpu.wgmma(ref, a, b)

  return list(pl.run_state(run)(tuple(_acc_type().init(acc) for acc, _, _ in terms)))


def _mma_tn(pairs, shape, interpret):
  """sum(A^T B for (A, B) in pairs), fp32 `shape`: A and B SMEM tiles, A transposed
  (the fused backward's dQ = dS^T K from dS^T stored key-major)."""
  if interpret:  # the interpreter has no wgmma with a transposed operand
    return sum(lax.dot_general(a[...], b[...], (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32) for a, b in pairs)

  def run(acc):
    for a, b in pairs:
      plgpu.wgmma(acc, a.transpose((1, 0)), b)
    return acc[...]

  return pl.run_scoped(run, _acc_type()(shape, jnp.float32))


def _acc_type():
  """The wgmma accumulator ref type: `ACC` is the short alias jax 0.10 exports; the
  full name is the fallback should a later jax drop the alias."""
  return getattr(plgpu, 'ACC', None) or plgpu.WGMMAAccumulatorRef


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

def _compute(refs, scratch, segs, wg, ranges, cfg, tiles, interpret):
  """One compute warpgroup: rows [r0, r0 + bq) of this program."""
  q_ref, _, _, out_ref, lse_ref = refs
  qo_smem, k_smem, v_smem, lse_smem, k_ready, v_ready, q_ready, k_done, v_done, turn = scratch
  bq, bk, stages = tiles.block_q, tiles.block_k, tiles.stages
  lo = ranges[0]
  b, h = lax.axis_index('batch'), lax.axis_index('heads')
  r0 = lax.axis_index('q_blocks') * (COMPUTE_WGS * bq) + wg * bq
  d = qo_smem.shape[-1]
  plgpu.set_max_registers(232, action='increase')
  q_smem, lse_smem = qo_smem.at[wg], lse_smem.at[wg]
  plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(r0, bq), h], q_smem, q_ready.at[wg])
  plgpu.barrier_wait(q_ready.at[wg])
  q_ids = segs.own_ids(b, r0, wg, interpret) if segs else None

  def take_turn():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  def step(j, carry, masked):
    acc, m, l = carry
    slot = lax.rem(j - lo, stages)
    plgpu.barrier_wait(k_ready.at[slot])
    [s] = _mma_nt([(q_smem, k_smem.at[slot])], (bq, bk), interpret, between=take_turn)
    plgpu.barrier_arrive(k_done.at[slot])
    s = s * (cfg.scale * _LOG2E)
    ids = (q_ids, segs.step_ids(slot, interpret)) if segs else None  # V's group
    if masked:
      s = jnp.where(_mask(r0, j * bk, bq, bk, cfg, interpret, ids=ids), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)  # rescales what was summed under the old max
    p = jnp.exp2(s - _bcast_rows(m_new, s.shape))
    l = l * alpha + p.sum(axis=1)
    acc = acc * _bcast_rows(alpha, acc.shape)
    plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may use the cores
    plgpu.barrier_wait(v_ready.at[slot])
    plgpu.barrier_wait(turn)
    [acc] = _mma_acc([(acc, p.astype(v_smem.dtype), v_smem.at[slot])], interpret)
    plgpu.barrier_arrive(v_done.at[slot])
    return acc, m_new, l

  carry = (_filled((bq, d), 0.0, interpret), _filled((bq,), _M_INIT, interpret),
           _filled((bq,), 0.0, interpret))
  pl.when(wg == 1)(take_turn)  # start half a step apart: ping-pong on the tensor cores
  carry = _walk(ranges, step, carry)
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


def _mask(r0, k0, bq, bk, cfg, interpret, keys_by_rows=False, ids=None):
  """[bq, bk] bool of allowed (query, key) pairs for rows r0.. and keys k0..; with
  keys_by_rows the transpose, [bk, bq] (the dk/dv kernel's S^T). ids: segment ids of the
  rows and of the columns (_Segments), which must match."""
  shape, q_dim = ((bk, bq), 1) if keys_by_rows else ((bq, bk), 0)
  q_pos = r0 + _iota(shape, q_dim, interpret)
  k_pos = k0 + _iota(shape, 1 - q_dim, interpret)
  ok = jnp.ones(shape, jnp.bool_)
  if cfg.causal:
    ok = ok & (k_pos <= q_pos)
  if cfg.window is not None:
    ok = ok & (k_pos > q_pos - cfg.window)
  if cfg.mask_kv_padding and not keys_by_rows:
    ok = ok & (k_pos < cfg.kv_len)
  if ids is not None:
    ok = ok & (_bcast_rows(ids[0], shape) == _bcast_cols(ids[1], shape))
  return ok


def _walk(ranges, step, carry):
  """carry = step(j, carry, masked) over blocks [lo, hi): masked over [lo, lo_full) and
  [hi_full, hi), unmasked in between (ranges as _kv_ranges / _q_ranges give them)."""
  lo, lo_full, hi_full, hi = ranges
  for start, stop, masked in ((lo, lo_full, True), (lo_full, hi_full, False),
                              (hi_full, hi, True)):
    carry = lax.fori_loop(start, stop, lambda j, c, masked=masked: step(j, c, masked), carry)
  return carry


def _produce(groups, num_steps, stages):
  """The producer warpgroup: TMA the blocks of steps [0, num_steps) into `stages` SMEM
  slots (step t into slot t % stages), running up to `stages` steps ahead.

  groups: (done, loads) pairs; loads: (src, smem, ready) with src(t) step t's GMEM block.
  A group's slot is reloaded once both compute warpgroups arrived on its `done`, so
  operands released at different times (K before V) belong to different groups."""
  plgpu.set_max_registers(40, action='decrease')

  def load(t, wait_free):
    slot = lax.rem(t, stages)
    for done, loads in groups:
      if wait_free:  # both compute warpgroups are done with step t - stages
        plgpu.barrier_wait(done.at[slot])
        # Their reads through the generic proxy (ids, stats; every read in the
        # interpreter) before the TMA's async-proxy write: a proxy fence.
        plgpu.commit_smem()
      for src, smem, ready in loads:
        plgpu.copy_gmem_to_smem(src(t), smem.at[slot], ready.at[slot])

  for first in range(stages):
    t = jnp.int32(first)
    pl.when(t < num_steps)(lambda t=t: load(t, wait_free=False))
  pl.loop(jnp.int32(stages), num_steps)(lambda t: load(t, wait_free=True))

  # Observe the last steps' releases too, so each barrier ends on a completed phase.
  @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
  def _(t):
    for done, _ in groups:
      plgpu.barrier_wait(done.at[lax.rem(t, stages)])


def forward(q, k, v, cfg, tiles: MosaicTiles | None = None, q_seg=None, kv_seg=None):
  """out [B, T, Hq, D], lse [B, Hq, T] of padded inputs; cfg: flash_attention._Config;
  q_seg [B, T], kv_seg [B, S]: int32 segment ids, or None."""
  b, t, hq, d = q.shape
  s = k.shape[1]
  tiles = tiles or MosaicTiles.default(d)
  rows = COMPUTE_WGS * tiles.block_q
  if t % rows or s % tiles.block_k:
    raise ValueError(f'padded lengths T={t}, S={s} must be multiples of {rows} and '
                     f'{tiles.block_k}')
  buffers = (_smem((COMPUTE_WGS, tiles.block_q, d), q.dtype),
             _smem((tiles.stages, tiles.block_k, d), q.dtype),
             _smem((tiles.stages, tiles.block_k, d), q.dtype),
             plgpu.SMEM((COMPUTE_WGS, tiles.block_q), jnp.float32))
  barriers = (plgpu.Barrier(num_barriers=tiles.stages),   # k_ready
              plgpu.Barrier(num_barriers=tiles.stages),   # v_ready
              plgpu.Barrier(num_barriers=COMPUTE_WGS),    # q_ready
              _released(tiles.stages),                    # k_done
              _released(tiles.stages),                    # v_done
              plgpu.Barrier(num_arrivals=COMPUTE_WGS))    # turn
  return _launch(
      lambda refs, scratch, segs: _program(refs, scratch, segs, cfg, tiles, cfg.interpret),
      buffers + barriers,
      (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, t), jnp.float32)),
      grid=(hq, t // rows, b), grid_names=('heads', 'q_blocks', 'batch'),
      interpret=cfg.interpret, inputs=(q, k, v),
      segments=_SegmentSpec.of(q_seg, kv_seg, True, tiles.block_q, tiles.block_k,
                               tiles.stages))


def _smem(shape, dtype):
  """A SMEM tile in the swizzled layout TMA writes and wgmma reads."""
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def _released(num_barriers):
  """Slot-release barriers: both compute warpgroups arrive."""
  return plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=num_barriers)


def _launch(program, scratch_types, out_type, grid, grid_names, interpret, inputs,
            segments=None, accumulators=()):
  """Runs a kernel of COMPUTE_WGS compute warpgroups and one producer (axis 'wg') on
  `inputs`: program(refs, scratch, segs) runs in each, segs the _Segments made from
  `segments` (a _SegmentSpec; their ids, buffers and barriers travel apart from refs and
  scratch), or None. refs: inputs, then `accumulators` (GMEM arrays the kernel adds into
  in place, starting from their values), then outputs. Returns the outputs, and with
  accumulators (outputs, their final values)."""
  seg_inputs, seg_types = (), ()
  if segments is not None:
    seg_inputs = (segments.q_seg, segments.kv_seg, segments.documents())
    seg_types = _Segments.scratch(segments.rows, segments.block, segments.stages)
  n, m = len(inputs), len(seg_inputs)

  def body(refs, scratch):
    segs = None
    if segments is not None:
      q_seg, kv_seg, docs = refs[n:n + m]
      own, step = (q_seg, kv_seg) if segments.own_is_q else (kv_seg, q_seg)
      segs = _Segments(own, step, docs, *scratch[-4:])
      scratch = scratch[:-4]
    program(refs[:n] + refs[n + m:], scratch, segs)

  def entry(*refs):
    pl.run_scoped(lambda *scratch: body(refs, scratch), *scratch_types, *seg_types,
                  collective_axes='wg')

  options = dict(compiler_params=plgpu.CompilerParams(approx_math=True),
                 interpret=_interpret_params() if interpret else None)
  if not accumulators:
    return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names,
                        num_threads=COMPUTE_WGS + 1, thread_name='wg',
                        **options)(*inputs, *seg_inputs)
  # A Ref argument is aliased in and out of the kernel (plgpu.kernel's vmap wrapper
  # takes no Refs, so the mesh goes to pl.kernel directly).
  refs = [jax.new_ref(x, memory_space=plgpu.GMEM) for x in accumulators]
  mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=COMPUTE_WGS + 1,
                    thread_name='wg')
  outs = pl.kernel(entry, out_type=out_type, mesh=mesh, **options)(
      *inputs, *seg_inputs, *refs)
  return outs, tuple(ref[...] for ref in refs)


class _SegmentSpec(typing.NamedTuple):
  """A kernel's segment ids and the tiles of their two sides (_Segments)."""
  q_seg: jax.Array      # [B, T] int32
  kv_seg: jax.Array     # [B, S] int32
  own_is_q: bool        # the compute warpgroups own query rows (forward, dq), or keys
  rows: int             # own ids per compute warpgroup
  block: int            # streamed ids per step
  stages: int

  @classmethod
  def of(cls, q_seg, kv_seg, *args):
    return None if q_seg is None else cls(q_seg, kv_seg, *args)

  def documents(self):
    """[B, programs, 4]: each program's steps [lo, hi) that hold its documents and
    [same_lo, same_hi) in which its rows and the step's all hold one id (documents.py)."""
    own, step = (self.q_seg, self.kv_seg) if self.own_is_q else (self.kv_seg, self.q_seg)
    return document_block_ranges(own, step, COMPUTE_WGS * self.rows, self.block)


class _Segments(typing.NamedTuple):
  """Segment ids (packed documents) in one kernel: each compute warpgroup loads its own
  rows' ids once (S's rows), and the producer streams the ids of each step's block (S's
  columns) beside that block. Keys match queries of their own segment only."""
  own_ref: typing.Any    # [B, L] int32 in GMEM: the rows' side
  step_ref: typing.Any   # [B, L'] int32: the streamed side
  docs_ref: typing.Any   # [B, programs, 4] int32: _SegmentSpec.documents
  own_smem: typing.Any   # [COMPUTE_WGS, rows]
  step_smem: typing.Any  # [stages, block]
  own_ready: typing.Any
  step_ready: typing.Any

  @staticmethod
  def scratch(rows, block, stages):
    return (plgpu.SMEM((COMPUTE_WGS, rows), jnp.int32), plgpu.SMEM((stages, block), jnp.int32),
            plgpu.Barrier(num_barriers=COMPUTE_WGS), plgpu.Barrier(num_barriers=stages))

  def own_ids(self, b, start, wg, interpret):
    smem = self.own_smem.at[wg]
    plgpu.copy_gmem_to_smem(self.own_ref.at[b, pl.ds(start, smem.shape[0])], smem,
                            self.own_ready.at[wg])
    plgpu.barrier_wait(self.own_ready.at[wg])
    return _vector(smem, 1, interpret)

  def step_ids(self, slot, interpret):
    plgpu.barrier_wait(self.step_ready.at[slot])
    return _vector(self.step_smem.at[slot], 0, interpret)

  def load(self, b, start):
    """The producer's (src, smem, ready) for step t's ids, from position start(t)."""
    block = self.step_smem.shape[1]
    return (lambda t: self.step_ref.at[b, pl.ds(start(t), block)], self.step_smem,
            self.step_ready)


def _program_walk(axis, rows, ranges_of, block, num_blocks, cfg, segs):
  """(p0, walk) of this program: its first own row p0 (grid axis `axis` numbers programs
  of `rows` rows) and the blocks it walks, ranges_of (_kv_ranges or _q_ranges) narrowed
  to its documents."""
  program = lax.axis_index(axis)
  p0 = program * rows
  walk = ranges_of(p0, rows, block, num_blocks, cfg)
  return p0, _in_documents(segs, walk, lax.axis_index('batch'), program)


def _in_documents(segs, ranges, b, program):
  """With segment ids: the walk (lo, lo_full, hi_full, hi) narrowed to the blocks that
  hold this program's documents, and its unmasked run to the blocks that need neither
  the causal/window mask nor the segment one (all rows and keys of one document). The
  program reads both ranges from segs.docs_ref."""
  if segs is None:
    return ranges
  lo_mask, lo_full, hi_full, hi_mask = ranges
  doc_lo, doc_hi, same_lo, same_hi = (segs.docs_ref[b, program, i] for i in range(4))
  lo = jnp.maximum(lo_mask, doc_lo)
  hi = jnp.maximum(lo, jnp.minimum(hi_mask, doc_hi))
  lo_full = jnp.clip(jnp.maximum(lo_full, same_lo), lo, hi)
  hi_full = jnp.clip(jnp.minimum(hi_full, same_hi), lo_full, hi)
  return lo, lo_full, hi_full, hi


def _program(refs, scratch, segs, cfg, tiles, interpret):
  q_ref, k_ref, v_ref, _, _ = refs
  _, k_smem, v_smem, _, k_ready, v_ready, _, k_done, v_done, _ = scratch
  bk = tiles.block_k
  _, ranges = _program_walk('q_blocks', COMPUTE_WGS * tiles.block_q, _kv_ranges, bk,
                            k_ref.shape[1] // bk, cfg, segs)
  wg = lax.axis_index('wg')
  pl.when(wg < COMPUTE_WGS)(
      lambda: _compute(refs, scratch, segs, wg, ranges, cfg, tiles, interpret))

  @pl.when(wg == COMPUTE_WGS)
  def _():
    lo, hi = ranges[0], ranges[3]
    b, kv_head = lax.axis_index('batch'), lax.div(lax.axis_index('heads'), cfg.groups)
    block = lambda ref: lambda t: ref.at[b, pl.ds((lo + t) * bk, bk), kv_head]
    ids = [segs.load(b, lambda t: (lo + t) * bk)] if segs else []
    # K first: the compute warpgroups need it first, and release its slot first.
    _produce(((k_done, [(block(k_ref), k_smem, k_ready)]),
              (v_done, [(block(v_ref), v_smem, v_ready)] + ids)), hi - lo, tiles.stages)


# ---------------------------------------------------------------------------- backward
#
# Two kernels, as the portable backward: each recomputes P from the forward's lse.
#
#   dq      grid (Hq, T / 2r, B)   a compute warpgroup owns r = 64 query rows; the producer
#                                  streams the K, V blocks they see (the forward's walk):
#                                  S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K
#   dk, dv  grid (Hkv, S / 2r, B)  a compute warpgroup owns r key rows; the producer streams
#                                  (Q, dO, lse, delta) blocks of every q head of the group
#                                  and every q block that sees those keys:
#                                  S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q
#
# so a kv head's dK, dV are summed over its query heads in fp32 registers and stored
# once, with no atomics and no [B, S, Hq, D] buffer. Each step issues its two
# independent products together (one wgmma wait) and then its two accumulations.
#
# Fused (MosaicBwdTiles.fused, FlashAttention-3's way): the dk/dv kernel alone, which
# also adds each step's dQ = dS K into an fp32 [B, Hq, T, D] buffer with TMA reduce-adds.
# That drops the dq kernel's recomputation of S and dP: 5 matmuls a block instead of 7.
# Each step the compute warpgroups store dS^T (bf16) in SMEM; at head_dim >= 128 they
# then wait for each other and each takes half of D over both warpgroups' keys
# (dQ[:, half] = dS^T K[:, half], one [block_q, D/2] reduce-add each), below it each
# adds its own keys' [block_q, D]. The adds land in any order, so dQ's low bits vary
# from run to run; the two-kernel backward is the deterministic one.


@dataclasses.dataclass(frozen=True)
class MosaicBwdTiles:
  """Tiles of the Mosaic GPU backward: each compute warpgroup owns `rows` (wgmma M)
  query rows (dq) or key rows (dk/dv); block_q is the q block the dk/dv kernel steps
  over, block_k the kv block the dq kernel steps over. Registers bound them: at head_dim
  128, dk/dv holds dK, dV (64 fp32 a thread each) and S^T, dP^T (block_q / 2 each), so
  block_q=128 passes the 232 allowed and is expected to spill (benchmarks.attention
  --tiles times it)."""
  block_q: int = 64
  block_k: int = 64
  stages: int = 2
  rows: int = 64
  # One kernel, dQ by TMA reduce-add (see above). block_k then only pads S, and its
  # dQ staging and two dS buffers fit 227 KiB at block_q 64 only. Registers: a [block_q,
  # D/2] (D 128) or [block_q, D] (D 64) fp32 dQ accumulator beside dK, dV, briefly.
  fused: bool = False

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    """The larger of the two kernels' shared memory (the fused kernel's alone)."""
    own = 2 * COMPUTE_WGS * self.rows * head_dim * itemsize  # Q, dO or K, V
    dq = own + 2 * self.stages * self.block_k * head_dim * itemsize
    dkv = own + self.stages * self.block_q * (2 * head_dim * itemsize + 2 * 4)
    stats = COMPUTE_WGS * 2 * self.rows * 4
    stats += (COMPUTE_WGS * self.rows + self.stages * max(self.block_q, self.block_k)) * 4  # ids
    if self.fused:
      ds = 2 * COMPUTE_WGS * self.rows * self.block_q * itemsize  # two steps' dS^T
      staged = COMPUTE_WGS * self.block_q * _dq_columns(head_dim) * 4  # fp32 dQ
      return dkv + ds + staged + stats
    return max(dq, dkv) + stats


def _dq_columns(head_dim):
  """The fused backward's dQ columns per compute warpgroup: half of D (over both
  warpgroups' keys) where a half is whole 128-byte swizzle tiles of K, else all of D
  (over its own keys)."""
  return head_dim // COMPUTE_WGS if head_dim >= 128 else head_dim


BWD_HEAD_DIMS = (64, 128)  # d 256 holds dK, dV at 256 fp32 registers a thread: too many


def backward(q, k, v, do, lse, delta, cfg, tiles: MosaicBwdTiles | None = None, q_seg=None,
             kv_seg=None):
  """dq, dk, dv of padded inputs. lse [B, Hq, T] natural log with -inf replaced by 0;
  delta [B, Hq, T] = rowsum(dO * O) - dlse (flash_attention._flash_bwd); q_seg [B, T],
  kv_seg [B, S]: int32 segment ids, or None."""
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  tiles = tiles or MosaicBwdTiles()
  rows = COMPUTE_WGS * tiles.rows
  if t % math.lcm(rows, tiles.block_q) or s % math.lcm(rows, tiles.block_k):
    raise ValueError(f'padded lengths T={t}, S={s} must be multiples of {rows} and of '
                     f'block_q={tiles.block_q} (T), block_k={tiles.block_k} (S)')
  # lse in base 2 beside delta: one [2, rows] TMA copy per block.
  stats = jnp.stack([lse * _LOG2E, delta], axis=2).astype(jnp.float32)  # [B, Hq, 2, T]
  r, interpret = tiles.rows, cfg.interpret
  inputs = (q, k, v, do, stats)
  if tiles.fused:
    # Its in-place dQ buffer (a jax Ref in pl.kernel) has no vmap rule past a mapped
    # axis of 1 (custom_vmap cannot hold Refs in jax 0.10): fold such an axis into B.
    return _dkv(inputs, cfg, tiles, q_seg, kv_seg)

  dq_scratch = (_smem((COMPUTE_WGS, r, d), q.dtype),                 # Q, then dQ
                _smem((COMPUTE_WGS, r, d), q.dtype),                 # dO
                plgpu.SMEM((COMPUTE_WGS, 2, r), jnp.float32),        # lse2, delta
                _smem((tiles.stages, tiles.block_k, d), q.dtype),    # K slots
                _smem((tiles.stages, tiles.block_k, d), q.dtype),    # V slots
                plgpu.Barrier(num_barriers=3 * COMPUTE_WGS),         # own Q, dO, stats
                plgpu.Barrier(num_barriers=tiles.stages),            # k_ready
                plgpu.Barrier(num_barriers=tiles.stages),            # v_ready
                _released(tiles.stages), _released(tiles.stages))    # k_done, v_done
  dq = _launch(
      lambda refs, scratch, segs: _dq_program(refs, scratch, segs, cfg, tiles, interpret),
      dq_scratch, jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(hq, t // rows, b), grid_names=('heads', 'q_blocks', 'batch'),
      interpret=interpret, inputs=inputs,
      segments=_SegmentSpec.of(q_seg, kv_seg, True, r, tiles.block_k, tiles.stages))

  return (dq, *_dkv(inputs, cfg, tiles, q_seg, kv_seg))


def _dkv(inputs, cfg, tiles, q_seg, kv_seg):
  """dk, dv (and fused, dq) from the dk/dv kernel."""
  q, k, v = inputs[:3]
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  r, bq = tiles.rows, tiles.block_q
  kv_programs = s // (COMPUTE_WGS * r)
  scratch = (_smem((COMPUTE_WGS, r, d), k.dtype),                # K, then dK
             _smem((COMPUTE_WGS, r, d), k.dtype),                # V, then dV
             _smem((tiles.stages, bq, d), q.dtype),              # Q slots
             _smem((tiles.stages, bq, d), q.dtype),              # dO slots
             plgpu.SMEM((tiles.stages, 2, bq), jnp.float32),     # stats slots
             plgpu.Barrier(num_barriers=2 * COMPUTE_WGS),        # own K, V
             plgpu.Barrier(num_barriers=tiles.stages),           # q_ready
             plgpu.Barrier(num_barriers=tiles.stages),           # do_ready
             plgpu.Barrier(num_barriers=tiles.stages),           # stats_ready
             _released(tiles.stages))                            # done (all of a slot)
  accumulators = ()
  if tiles.fused:
    cols = _dq_columns(d)
    scratch += (_smem((2, COMPUTE_WGS, r, bq), q.dtype),        # dS^T of two steps
                plgpu.SMEM((COMPUTE_WGS, bq, cols), jnp.float32,  # dQ, staged for TMA
                           transforms=(plgpu.TilingTransform((8, 32)),
                                       plgpu.SwizzleTransform(128))),
                _released(2))                                    # ds_ready (two steps)
    # One fp32 dQ; in the interpreter, which has no TMA reduction, one per kv block of
    # the grid (and per compute warpgroup where both write the same columns), summed
    # below (_DqAdder). Their size grows as S * T: fine at the interpreter's sizes.
    copies = 1
    if cfg.interpret:
      copies = kv_programs * (COMPUTE_WGS if cols == d else 1)
    accumulators = (jnp.zeros((copies, b, hq, t, d), jnp.float32),)
  out = _launch(
      lambda refs, scratch, segs: _dkv_program(refs, scratch, segs, cfg, tiles,
                                               cfg.interpret),
      scratch, (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(hkv, kv_programs, b), grid_names=('heads', 'kv_blocks', 'batch'),
      interpret=cfg.interpret, inputs=inputs,
      segments=_SegmentSpec.of(q_seg, kv_seg, False, r, bq, tiles.stages),
      accumulators=accumulators)
  if not tiles.fused:
    return out
  (dk, dv), (dq,) = out
  return (dq.sum(axis=0) * cfg.scale).astype(q.dtype).transpose(0, 2, 1, 3), dk, dv


def _vector(smem, reduced_dim, interpret):
  """A [n] SMEM vector as registers laid out along S's rows (reduced_dim 1: one value per
  row) or its columns (reduced_dim 0: one per column)."""
  if interpret:
    return smem[...]
  return _load(smem, layout=plgpu.Layout.WGMMA.reduce(reduced_dim))


def _load(ref, **kwargs):
  """plgpu.load of the whole ref: jax 0.10 requires the index as an argument, 0.11
  deprecates it and 0.12 has none (the ref carries its own, ref.at[...])."""
  idx = inspect.signature(plgpu.load).parameters.get('idx')
  if idx is not None and idx.default is inspect.Parameter.empty:
    return plgpu.load(ref, (), **kwargs)
  return plgpu.load(ref, **kwargs)


def _stats(stats_smem, reduced_dim, interpret):
  """lse2 and delta of a [2, n] SMEM block (_vector's layouts)."""
  return tuple(_vector(stats_smem.at[i], reduced_dim, interpret) for i in range(2))


def _dq_program(refs, scratch, segs, cfg, tiles, interpret):
  q_ref, k_ref, v_ref, do_ref, stats_ref, dq_ref = refs
  (q_smem, do_smem, stats_smem, k_smem, v_smem, own_ready, k_ready, v_ready, k_done,
   v_done) = scratch
  r, bk, stages = tiles.rows, tiles.block_k, tiles.stages
  b, h = lax.axis_index('batch'), lax.axis_index('heads')
  p0, ranges = _program_walk('q_blocks', COMPUTE_WGS * r, _kv_ranges, bk,
                             k_ref.shape[1] // bk, cfg, segs)
  lo, hi = ranges[0], ranges[3]
  wg = lax.axis_index('wg')

  @pl.when(wg < COMPUTE_WGS)
  def _():
    plgpu.set_max_registers(232, action='increase')
    r0 = p0 + wg * r
    own = (b, pl.ds(r0, r), h)
    q_mine, do_mine, stats_mine = q_smem.at[wg], do_smem.at[wg], stats_smem.at[wg]
    _load_own(((q_ref.at[own], q_mine), (do_ref.at[own], do_mine),
               (stats_ref.at[b, h, :, pl.ds(r0, r)], stats_mine)), own_ready, wg)
    lse2, delta = _stats(stats_mine, 1, interpret)
    q_ids = segs.own_ids(b, r0, wg, interpret) if segs else None

    def step(j, dq, masked):
      slot = lax.rem(j - lo, stages)
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      s, dp = _mma_nt([(q_mine, k_smem.at[slot]), (do_mine, v_smem.at[slot])], (r, bk),
                      interpret)
      plgpu.barrier_arrive(v_done.at[slot])
      s = s * (cfg.scale * _LOG2E)
      ids = (q_ids, segs.step_ids(slot, interpret)) if segs else None  # K's group
      if masked:
        s = jnp.where(_mask(r0, j * bk, r, bk, cfg, interpret, ids=ids), s, -jnp.inf)
      p = jnp.exp2(s - _bcast_rows(lse2, s.shape))
      ds = p * (dp - _bcast_rows(delta, dp.shape))
      [dq] = _mma_acc([(dq, ds.astype(k_smem.dtype), k_smem.at[slot])], interpret)
      plgpu.barrier_arrive(k_done.at[slot])
      return dq

    dq = _walk(ranges, step, _filled((r, q_smem.shape[-1]), 0.0, interpret))
    q_mine[...] = (dq * cfg.scale).astype(q_mine.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_mine, dq_ref.at[own])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == COMPUTE_WGS)
  def _():
    kv_head = lax.div(h, cfg.groups)
    block = lambda ref: lambda t: ref.at[b, pl.ds((lo + t) * bk, bk), kv_head]
    ids = [segs.load(b, lambda t: (lo + t) * bk)] if segs else []
    _produce(((k_done, [(block(k_ref), k_smem, k_ready)] + ids),
              (v_done, [(block(v_ref), v_smem, v_ready)])), hi - lo, stages)


def _q_ranges(c0, rows, block_q, num_q_blocks, cfg):
  """For key rows [c0, c0 + rows): q blocks [lo, hi) that see any of them, and the part
  [lo_full, hi_full) in which every query sees every key (no mask). Padded keys need no
  mask here: their dK, dV rows are sliced off (the fused dQ zeroes their dS itself)."""
  lo, hi = 0, num_q_blocks
  lo_full, hi_full = 0, num_q_blocks
  if cfg.causal:
    lo = lax.div(c0, block_q)
    lo_full = lax.div(c0 + rows - 1 + block_q - 1, block_q)  # first row >= last key
  if cfg.window is not None:
    hi = jnp.minimum(lax.div(c0 + rows - 2 + cfg.window, block_q) + 1, num_q_blocks)
    hi_full = lax.div(c0 + cfg.window, block_q)  # last row < first key + W
  lo_full = jnp.clip(lo_full, lo, hi)
  hi_full = jnp.clip(hi_full, lo_full, hi)
  return tuple(jnp.asarray(x, jnp.int32) for x in (lo, lo_full, hi_full, hi))


def _dkv_program(refs, scratch, segs, cfg, tiles, interpret):
  q_ref, k_ref, v_ref = refs[:3]
  dk_ref, dv_ref = refs[-2:]
  (k_smem, v_smem, q_smem, do_smem, stats_smem, own_ready, q_ready, do_ready, stats_ready,
   done) = scratch[:10]
  r, bq, stages, groups = tiles.rows, tiles.block_q, tiles.stages, cfg.groups
  b, kv_head = lax.axis_index('batch'), lax.axis_index('heads')
  p0, ranges = _program_walk('kv_blocks', COMPUTE_WGS * r, _q_ranges, bq,
                             q_ref.shape[1] // bq, cfg, segs)
  lo, hi = ranges[0], ranges[3]
  n = hi - lo  # q blocks per head; step t = g * n + (i - lo) for head g, q block i
  wg = lax.axis_index('wg')

  @pl.when(wg < COMPUTE_WGS)
  def _():
    plgpu.set_max_registers(232, action='increase')
    c0 = p0 + wg * r
    own = (b, pl.ds(c0, r), kv_head)
    k_mine, v_mine = k_smem.at[wg], v_smem.at[wg]
    _load_own(((k_ref.at[own], k_mine), (v_ref.at[own], v_mine)), own_ready, wg)
    k_ids = segs.own_ids(b, c0, wg, interpret) if segs else None
    add_dq = None
    if tiles.fused:
      add_dq = _DqAdder(refs[5], k_smem, *scratch[10:], wg, c0, cfg, interpret)

    def step(i, carry, g, masked):
      dk, dv = carry
      t = g * n + i - lo
      slot = lax.rem(t, stages)
      q_slot, do_slot = q_smem.at[slot], do_smem.at[slot]
      plgpu.barrier_wait(q_ready.at[slot])
      plgpu.barrier_wait(do_ready.at[slot])
      st, dpt = _mma_nt([(k_mine, q_slot), (v_mine, do_slot)], (r, bq), interpret)
      plgpu.barrier_wait(stats_ready.at[slot])
      lse2 = _vector(stats_smem.at[slot, 0], 0, interpret)
      st = st * (cfg.scale * _LOG2E)
      ids = (k_ids, segs.step_ids(slot, interpret)) if segs else None
      if masked:
        st = jnp.where(_mask(i * bq, c0, bq, r, cfg, interpret, keys_by_rows=True, ids=ids),
                       st, -jnp.inf)
      pt = jnp.exp2(st - _bcast_cols(lse2, st.shape))
      delta = _vector(stats_smem.at[slot, 1], 0, interpret)  # loaded late: fewer live regs
      dst = pt * (dpt - _bcast_cols(delta, dpt.shape))
      dtype = q_slot.dtype
      dst = add_dq.stage(dst, t) if add_dq else dst.astype(dtype)
      dv, dk = _mma_acc([(dv, pt.astype(dtype), do_slot), (dk, dst, q_slot)], interpret)
      plgpu.barrier_arrive(done.at[slot])
      if add_dq:
        add_dq.add(t, kv_head * groups + g, i * bq)
      return dk, dv

    def head(g, carry):
      return _walk(ranges, lambda i, c, masked: step(i, c, g, masked), carry)

    zeros = _filled((r, k_smem.shape[-1]), 0.0, interpret)
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
    if add_dq:
      add_dq.finish(groups * n)
    k_mine[...] = (dk * cfg.scale).astype(k_mine.dtype)
    v_mine[...] = dv.astype(v_mine.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_mine, dk_ref.at[own])
    plgpu.copy_smem_to_gmem(v_mine, dv_ref.at[own])
    plgpu.wait_smem_to_gmem(0)

  pl.when(wg == COMPUTE_WGS)(lambda: _dkv_produce(refs, scratch, segs, lo, n, tiles, groups))


def _dkv_produce(refs, scratch, segs, lo, n, tiles, groups):
  """The dk/dv kernel's producer: step t streams q head kv_head * groups + t // n's
  Q, stats, (ids) and dO rows of q block lo + t % n."""
  q_ref, _, _, do_ref, stats_ref = refs[:5]
  _, _, q_smem, do_smem, stats_smem, _, q_ready, do_ready, stats_ready, done = scratch[:10]
  bq = tiles.block_q
  b, kv_head = lax.axis_index('batch'), lax.axis_index('heads')

  def head_and_row(t):
    return kv_head * groups + lax.div(t, n), (lo + lax.rem(t, n)) * bq

  def rows_of(ref):
    def src(t):
      h, row = head_and_row(t)
      return ref.at[b, pl.ds(row, bq), h]
    return src

  def stats_of(t):
    h, row = head_and_row(t)
    return stats_ref.at[b, h, :, pl.ds(row, bq)]

  ids = [segs.load(b, lambda t: head_and_row(t)[1])] if segs else []
  _produce(((done, [(rows_of(q_ref), q_smem, q_ready), (stats_of, stats_smem, stats_ready),
                    *ids, (rows_of(do_ref), do_smem, do_ready)]),), groups * n, tiles.stages)


class _DqAdder:
  """The fused backward's dQ in one compute warpgroup: each step, `stage` stores its dS^T
  [r, block_q] in SMEM (before the dK, dV matmuls, so only the bf16 copy stays live) and
  `add` then adds dS K of that q block into dq_acc [copies, B, Hq, T, D] fp32 (TMA
  reduce-add; module comment above).

  Mosaic GPU's interpreter has no TMA reduction, and its race detector treats programs
  as concurrent, as they are on a GPU. There dq_acc holds one zeroed copy per kv block
  of the grid (programs of other batches and kv heads write other slices of it), and
  per warpgroup where both write the same columns (below D 128). Each warpgroup visits
  each (head, q block) once, so each block of a copy is stored once, never re-read."""

  def __init__(self, dq_acc, k_smem, ds_smem, dq_smem, ds_ready, wg, c0, cfg, interpret):
    self.dq_acc, self.k_smem, self.ds_smem = dq_acc, k_smem, ds_smem
    self.dq_smem, self.ds_ready = dq_smem.at[wg], ds_ready
    self.wg, self.interpret = wg, interpret
    d = k_smem.shape[-1]
    self.cols = _dq_columns(d)
    self.shared = self.cols < d  # both warpgroups' keys, half of D each
    self.copy = 0
    if interpret:
      self.copy = lax.axis_index('kv_blocks')
      if not self.shared:
        self.copy = self.copy * COMPUTE_WGS + wg
    self.key_ok = None
    if cfg.mask_kv_padding:
      # Padded keys (zero rows of K) may meet real queries unmasked here: zero their dS,
      # so an overflowing exp cannot turn 0 * inf into NaN in dQ (their dK, dV are cut).
      # One value per dS^T row (few registers across the loop), broadcast each step.
      r = ds_smem.shape[2]
      rows = (lax.iota(jnp.int32, r) if interpret else plgpu.broadcasted_iota(
          jnp.int32, (r,), 0, layout=plgpu.Layout.WGMMA.reduce(1)))
      self.key_ok = c0 + rows < cfg.kv_len

  def stage(self, dst, t):
    """dS^T (fp32) of step t -> its bf16 copy, also stored for both warpgroups' dQ."""
    if self.key_ok is not None:
      dst = jnp.where(_bcast_rows(self.key_ok, dst.shape), dst, 0.0)
    ds = dst.astype(self.ds_smem.dtype)
    # Two steps' buffers: a warpgroup rewrites step t's only at step t + 2, after both
    # passed step t + 1's ds_ready, so after both finished step t's dQ matmul.
    parity = lax.rem(t, 2)
    self.ds_smem.at[parity, self.wg][...] = ds
    plgpu.commit_smem()  # visible to wgmma (the async proxy)
    if self.shared:
      plgpu.barrier_arrive(self.ds_ready.at[parity])
    return ds

  def add(self, t, head, row):
    wg, interpret = self.wg, self.interpret
    parity = lax.rem(t, 2)
    if self.shared:
      plgpu.barrier_wait(self.ds_ready.at[parity])  # the other warpgroup's dS is stored
      col0 = wg * self.cols
      pairs = [(self.ds_smem.at[parity, w], self.k_smem.at[w, :, pl.ds(col0, self.cols)])
               for w in range(COMPUTE_WGS)]
    else:
      col0 = 0
      pairs = [(self.ds_smem.at[parity, wg], self.k_smem.at[wg])]
    bq = self.dq_smem.shape[0]
    dq = _mma_tn(pairs, (bq, self.cols), interpret)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add has read dq_smem
    self.dq_smem[...] = dq
    plgpu.commit_smem()
    dst_ref = self.dq_acc.at[self.copy, lax.axis_index('batch'), head, pl.ds(row, bq),
                             pl.ds(col0, self.cols)]
    add = {} if interpret else dict(reduction_op='add')  # the interpreter: a plain store
    plgpu.copy_smem_to_gmem(self.dq_smem, dst_ref, **add)

  def finish(self, num_steps):
    """After the last step: in shared mode the other warpgroup's last dQ matmul may
    still read this one's K, which dK is about to overwrite: wait for each other (on
    the buffer the next step would have used, so every phase is waited on by both)."""
    if self.shared:
      parity = lax.rem(num_steps, 2)
      plgpu.barrier_arrive(self.ds_ready.at[parity])
      plgpu.barrier_wait(self.ds_ready.at[parity])


def _bcast_cols(x, shape):
  return lax.broadcast_in_dim(x, shape, [1])


def _load_own(copies, ready, wg):
  """TMA a compute warpgroup's own (src, dst) blocks, on barriers ready[wg * n + i]; wait."""
  n = len(copies)
  for i, (src, dst) in enumerate(copies):
    plgpu.copy_gmem_to_smem(src, dst, ready.at[wg * n + i])
  for i in range(n):
    plgpu.barrier_wait(ready.at[wg * n + i])


def _interpret_params():
  """Mosaic GPU's CPU interpreter (jax >= 0.10; not yet a public name)."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError as e:  # pragma: no cover
    raise NotImplementedError(
        f'jax {jax.__version__} has no Mosaic GPU interpreter, so the mosaic_gpu flash '
        "backend cannot run on CPU; use backend='triton' there.") from e
  return InterpretGPUParams(detect_races=True)
