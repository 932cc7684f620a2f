"""What the Pallas kernels compile to on Hopper, found without a GPU.

  python -m benchmarks.kernel_resources     # writes results/kernel_resources_sm90.json

Each kernel is lowered for CUDA on this host (`jit(f).trace(...).lower(
lowering_platforms=('cuda',))`). Pallas turns it into Triton IR, carried in a
`__gpu$xla.gpu.triton` custom call (jax 0.10 to 0.12). That IR is compiled here with the
`triton` package (3.6, the version on the GPU machines) for sm_90a. Then ptxas and cuobjdump,
both shipped in its wheel, report per kernel:

- registers per thread, and stack or local memory (where registers spill);
- shared memory;
- the tensor-core instructions: HGMMA is Hopper's warpgroup MMA (wgmma), and HMMA the older
  mma.sync, which reaches about half the peak.

On a GPU, XLA compiles the same IR with its own bundled Triton. So these numbers are a close
proxy for the binary that runs, not that binary. They say nothing about speed: that is
`benchmarks.attention` and `benchmarks.paged_decode`, on a GPU.
"""

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.common import write_result
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.paged_attention import paged_attention

TRITON_CALL = '__gpu$xla.gpu.triton'
SHARED_LIMIT = 227 * 1024   # H100 / H200: dynamic shared memory per block
MMA_OPS = ('HGMMA', 'HMMA')


@dataclasses.dataclass(frozen=True)
class TritonCall:
  name: str
  ttir: str          # Triton IR, text
  num_warps: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class KernelResources:
  name: str
  num_warps: int
  num_stages: int
  registers: int     # per thread
  stack_bytes: int   # per thread, stack frame + local memory; > 0 means spilled registers
  shared_bytes: int
  mma: dict          # SASS tensor-core opcode -> count

  @property
  def uses_wgmma(self) -> bool:
    return self.mma.get('HGMMA', 0) > 0


def triton_calls(fn, *args) -> list[TritonCall]:
  """The Triton kernels of `fn(*args)` lowered for CUDA, in program order.

  `args` may be jax.ShapeDtypeStruct. The kernels must be called with interpret=False.
  """
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect

  # jax >= 0.11 reads the target GPU off a device; a host without one names it abstractly
  # (jax 0.10 ignores this and targets sm_90 by itself).
  gpu = jax.sharding.AbstractDevice(device_kind='NVIDIA H100', num_cores=None, platform='gpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=gpu)
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',))
  module = lowered.compiler_ir('stablehlo')
  ctx = mlir.make_ir_context()
  tt_dialect.register_dialect(ctx)
  calls = []

  def visit(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          child = child.operation
          if (child.name == 'stablehlo.custom_call' and
              ir.StringAttr(child.attributes['call_target_name']).value == TRITON_CALL):
            cfg = ir.DictAttr(child.attributes['mhlo.backend_config'])
            ttir = ir.Module.parse(ir.StringAttr(cfg['ir']).value_bytes, ctx)
            calls.append(TritonCall(
                name=ir.StringAttr(cfg['name']).value,
                ttir=ttir.operation.get_asm(enable_debug_info=False),
                num_warps=ir.IntegerAttr(cfg['num_warps']).value,
                num_stages=ir.IntegerAttr(cfg['num_stages']).value))
          visit(child)

  visit(module.operation)
  if not calls:
    raise RuntimeError(
        f'No {TRITON_CALL} custom call in the CUDA lowering. Either the kernels ran with '
        f'interpret=True, or this jax ({jax.__version__}) lowers Pallas differently: this '
        'tool reads the Triton IR that jax 0.10 to 0.12 embed in that custom call.')
  return calls


def _tool(name: str) -> str:
  import triton
  path = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', name)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} is missing: the triton wheel for Linux x86-64 ships it.')
  return path


def compile_sm90(call: TritonCall, capability: int = 90) -> KernelResources:
  """Compiles one kernel's Triton IR to a cubin with the triton package and reads it back."""
  from triton.backends.compiler import GPUTarget
  from triton.compiler import compile as triton_compile

  with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, f'{call.name}.ttir')
    with open(src, 'w') as f:
      f.write(call.ttir)
    try:
      kernel = triton_compile(src, target=GPUTarget('cuda', capability, 32),
                              options={'num_warps': call.num_warps,
                                       'num_stages': call.num_stages})
    except Exception as e:
      raise RuntimeError(f'Triton could not compile kernel {call.name} for sm_{capability}: '
                         f'{type(e).__name__}: {e}') from e
    cubin = os.path.join(tmp, f'{call.name}.cubin')
    with open(cubin, 'wb') as f:
      f.write(kernel.asm['cubin'])
    usage = _run(_tool('cuobjdump'), '--dump-resource-usage', cubin)
    sass = _run(_tool('cuobjdump'), '-sass', cubin)
  registers = int(re.search(r'\bREG:(\d+)', usage).group(1))
  stack = sum(int(re.search(rf'\b{key}:(\d+)', usage).group(1)) for key in ('STACK', 'LOCAL'))
  # cuobjdump's SHARED counts only static shared memory; Triton allocates it dynamically.
  shared = max(int(kernel.metadata.shared), int(re.search(r'\bSHARED:(\d+)', usage).group(1)))
  mma = collections.Counter(m for m in re.findall(r'\b([A-Z]+MMA)\b', sass) if m in MMA_OPS)
  return KernelResources(name=call.name, num_warps=call.num_warps,
                         num_stages=call.num_stages, registers=registers, stack_bytes=stack,
                         shared_bytes=shared, mma=dict(mma))


def _run(*cmd) -> str:
  return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


# ------------------------------------------------------------------------------ the cases

def flash_case(seq_len, q_heads, kv_heads, head_dim, dtype=jnp.bfloat16, packed=False,
               **kwargs):
  """(fn, args) whose lowering holds the forward, dk/dv and dq kernels; packed: with
  segment ids (one more argument), so the document block ranges are read too."""
  q = jax.ShapeDtypeStruct((1, seq_len, q_heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((1, seq_len, kv_heads, head_dim), dtype)

  def loss(q, k, v, segment_ids=None):
    out = flash_attention(q, k, v, segment_ids=segment_ids, interpret=False, **kwargs)
    return out.astype(jnp.float32).sum()

  seg = (jax.ShapeDtypeStruct((1, seq_len), jnp.int32),) if packed else ()
  return jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv, *seg)


def paged_case(batch, context, q_tokens=None, q_heads=32, kv_heads=8, head_dim=128,
               page_size=16, dtype=jnp.bfloat16):
  """(fn, args) for the ragged paged kernel: decode by default, or q_tokens in all."""
  shape = jax.ShapeDtypeStruct
  pages_per_seq = context // page_size
  pages = shape((batch * pages_per_seq, page_size, kv_heads, head_dim), dtype)
  args = (shape((q_tokens or batch, q_heads, head_dim), dtype), pages, pages,
          shape((batch,), jnp.int32), shape((batch, pages_per_seq), jnp.int32),
          shape((batch + 1,), jnp.int32), shape((1,), jnp.int32))
  return lambda *a, **kw: paged_attention(*a, interpret=False, **kw), args


def cases() -> dict:
  """The benchmarks' shapes (benchmarks.attention, benchmarks.paged_decode) plus the other
  head dims and modes. Sequence length only changes loop bounds, so 8K stands for all."""
  out = {}
  for hkv in (32, 8):
    out[f'flash causal bf16 d128 32/{hkv} heads'] = flash_case(8192, 32, hkv, 128, causal=True)
  for d in (64, 256):
    out[f'flash causal bf16 d{d} 32/8 heads'] = flash_case(8192, 32, 8, d, causal=True)
  out['flash causal packed bf16 d128 32/8 heads'] = flash_case(
      8192, 32, 8, 128, causal=True, packed=True)
  out['flash window 4096 bf16 d128 32/8 heads'] = flash_case(
      8192, 32, 8, 128, causal=True, sliding_window=4096)
  out['flash full fp32 d128 8/8 heads'] = flash_case(
      2048, 8, 8, 128, jnp.float32, causal=False)
  for batch, context in ((8, 4096), (64, 8192), (256, 8192)):
    out[f'paged decode {batch}x{context}'] = paged_case(batch, context)
  out['paged prefill 512 tokens over 32 seqs x 2048'] = paged_case(32, 2048, q_tokens=512)
  return out


def report(selected=None) -> list[dict]:
  rows = []
  for case, (fn, args) in cases().items():
    if selected and not any(s in case for s in selected):
      continue
    for call in triton_calls(fn, *args):
      res = compile_sm90(call)
      rows.append({'case': case, **dataclasses.asdict(res), 'uses_wgmma': res.uses_wgmma})
      print(f'{case:<44} {res.name:<24} warps {res.num_warps} stages {res.num_stages} '
            f'regs {res.registers:>3} stack {res.stack_bytes:>5} B '
            f'smem {res.shared_bytes // 1024:>3} KiB  {res.mma}', flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', nargs='*', help='cases whose name contains one of these')
  parser.add_argument('--no-write', action='store_true')
  args = parser.parse_args(argv)
  import triton
  rows = report(args.only)
  if not args.no_write and not args.only:
    print(write_result('kernel_resources_sm90', {
        'what': 'static resources of each Pallas kernel compiled for sm_90a (no GPU used)',
        'compiler': f'triton {triton.__version__} (pip), jaxlib {jax.lib.__version__} '
                    'Pallas lowering', 'shared_limit_bytes': SHARED_LIMIT, 'kernels': rows}))
  return rows


if __name__ == '__main__':
  main()
