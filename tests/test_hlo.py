"""sharding.hlo against analytic counts: loop-weighted dot FLOPs, collectives, memory."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import hlo
from sharding.mesh import MeshConfig, make_mesh

B, D, L = 4, 16, 3
F32 = 4


def _scan_layers(x, w):
  def body(h, wl):
    return jnp.tanh(h @ wl), None
  return jax.lax.scan(body, x, w)[0]


def _inputs(layers=L):
  return jnp.ones((B, D), jnp.float32), jnp.ones((layers, D, D), jnp.float32)


def _report(f, *args, **jit_kwargs):
  return hlo.inspect_compiled(jax.jit(f, **jit_kwargs).lower(*args).compile())


def test_scan_counts_body_trip_count_times():
  report = _report(_scan_layers, *_inputs())
  assert report.dot_flops == 2 * B * D * D * L
  assert not report.collectives and not report.unknown_trip_count_loops


def test_grad_of_scan_is_three_matmuls_per_layer():
  loss = lambda x, w: _scan_layers(x, w).sum()
  report = _report(jax.grad(loss, argnums=1), *_inputs())
  assert report.dot_flops == 3 * 2 * B * D * D * L


def test_nested_scans_multiply_trip_counts():
  outer, inner = 3, 5

  def f(x, w):
    def block(h, wb):
      return _scan_layers(h, wb), None
    return jax.lax.scan(block, x, w)[0]

  w = jnp.ones((outer, inner, D, D), jnp.float32)
  report = _report(f, jnp.ones((B, D), jnp.float32), w)
  assert report.dot_flops == 2 * B * D * D * outer * inner


def test_unknown_trip_count_counts_once_and_is_reported():
  def f(n, x, w):
    return jax.lax.fori_loop(0, n, lambda i, h: h @ w, x)

  x, w = jnp.ones((B, D)), jnp.ones((D, D))
  report = _report(f, 7, x, w)
  assert report.dot_flops == 2 * B * D * D
  assert len(report.unknown_trip_count_loops) == 1
  assert 'unknown trip count' in report.summary()


def test_conditional_counts_every_branch_once():
  def f(p, x, w):
    return jax.lax.cond(p, lambda: x @ w, lambda: (x @ w) @ w)

  report = _report(f, True, jnp.ones((B, D)), jnp.ones((D, D)))
  assert report.dot_flops == 3 * 2 * B * D * D


@pytest.fixture(name='mesh')
def _mesh():
  return make_mesh(MeshConfig(data=8))


def test_contracting_dim_sharding_all_reduces_the_result(mesh):
  k, n = 4, 6  # per-device contraction, output columns
  x, w = jnp.ones((B, 8 * k)), jnp.ones((8 * k, n))
  shard = lambda spec: NamedSharding(mesh, spec)
  report = _report(lambda a, b: a @ b, x, w,
                   in_shardings=(shard(P(None, 'data')), shard(P('data', None))),
                   out_shardings=shard(P()))
  assert report.collectives['all-reduce'].count == 1
  assert report.collectives['all-reduce'].bytes == B * n * F32
  assert report.dot_flops == 2 * B * n * k


def test_fsdp_scan_gathers_each_layer_weight(mesh):
  replicated = NamedSharding(mesh, P())

  def f(x, w):
    def body(h, wl):
      # FSDP: the stored shard is gathered just before the layer uses it.
      wl = jax.lax.with_sharding_constraint(wl, replicated)
      return jnp.tanh(h @ wl), None
    return jax.lax.scan(body, x, w)[0]

  x, w = jnp.ones((8 * B, D)), jnp.ones((L, D, D))
  report = _report(f, x, w, in_shardings=(NamedSharding(mesh, P('data')),
                                          NamedSharding(mesh, P(None, 'data', None))))
  gathers = report.collectives['all-gather']
  assert gathers.count == L
  assert gathers.bytes == L * D * D * F32
  assert report.dot_flops == 2 * B * D * D * L  # each device runs its own B rows


def test_data_parallel_grad_reduces_every_weight_once(mesh):
  loss = lambda w, x: _scan_layers(x, w).sum()
  x, w = jnp.ones((8 * B, D)), jnp.ones((L, D, D))
  report = _report(jax.grad(loss), w, x,
                   in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))),
                   out_shardings=NamedSharding(mesh, P()))
  # XLA:CPU may reduce per layer inside the loop or once after it: bytes agree either way.
  assert report.bytes_of('all-reduce', 'reduce-scatter') == w.size * F32


def test_argument_bytes_are_per_device_shards(mesh):
  big = jax.ShapeDtypeStruct((8 * 5, 3), jnp.float32, sharding=NamedSharding(mesh, P('data')))
  small = jax.ShapeDtypeStruct((7,), jnp.int32, sharding=NamedSharding(mesh, P()))
  report = _report(lambda a, b: a.sum() + b.sum(), big, small)
  expected = sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
                 for s in (big, small))
  assert report.argument_bytes == expected


def _all_collectives(x):
  axis, n = 'data', 8
  return (jax.lax.psum(x, axis),
          jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True),
          jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)]),
          jax.lax.all_to_all(x, axis, 0, 0, tiled=True),
          jax.lax.all_gather(x, axis, tiled=True))


def test_each_collective_kind_and_summary(mesh):
  rows, cols = 8, 16  # per-device block
  f = jax.shard_map(_all_collectives, mesh=mesh, in_specs=P('data'),
                    out_specs=(P('data'),) * 5, check_vma=False)
  report = _report(f, jnp.ones((8 * rows, cols)))
  block = rows * cols * F32
  expected = {'all-reduce': block, 'reduce-scatter': block / 8, 'collective-permute': block,
              'all-to-all': block, 'all-gather': 8 * block}
  assert {k: s.bytes for k, s in report.collectives.items()} == expected
  assert all(s.count == 1 for s in report.collectives.values())
  text = report.summary()
  assert all(kind in text for kind in hlo.COLLECTIVES)


# Hand-written in the form XLA:GPU prints async collectives, which XLA:CPU never emits.
_ASYNC_HLO = """\
HloModule async_example, entry_computation_layout={(f32[2,16]{1,0})->f32[16,16]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_rs (q: f32[16,16]) -> f32[2,16] {
  %q = f32[16,16]{1,0} parameter(0)
  ROOT %rs = f32[2,16]{1,0} reduce-scatter(%q), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

%layer (p: f32[2,16]) -> f32[2,16] {
  %p = f32[2,16]{1,0} parameter(0)
  %ags = (f32[2,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %agd = f32[16,16]{1,0} all-gather-done(%ags)
  %ars = f32[16,16]{1,0} all-reduce-start(%agd), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ard = f32[16,16]{1,0} all-reduce-done(%ars)
  %cps = (f32[16,16]{1,0}, f32[16,16]{1,0}, u32[], u32[]) collective-permute-start(%ard), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[16,16]{1,0} collective-permute-done(%cps)
  %d = f32[16,16]{1,0} dot(%cpd, %agd), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %rss = ((f32[16,16]{1,0}), f32[2,16]{1,0}) async-start(%d), calls=%wrapped_rs
  ROOT %rsd = f32[2,16]{1,0} async-done(%rss), calls=%wrapped_rs
}

%body (t: (s32[], f32[2,16])) -> (s32[], f32[2,16]) {
  %t = (s32[], f32[2,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %h = f32[2,16]{1,0} get-tuple-element(%t), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %out = f32[2,16]{1,0} call(%h), to_apply=%layer
  ROOT %r = (s32[], f32[2,16]{1,0}) tuple(%next, %out)
}

%cond (t.1: (s32[], f32[2,16])) -> pred[] {
  %t.1 = (s32[], f32[2,16]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  %n = s32[] constant(TRIP)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x: f32[2,16]) -> f32[2,16] {
  %x = f32[2,16]{1,0} parameter(0)
  %first = f32[2,16]{1,0} call(%x), to_apply=%layer
  %zero = s32[] constant(0), metadata={op_name="calls=%layer" source_file="a{b}.py"}
  %init = (s32[], f32[2,16]{1,0}) tuple(%zero, %first)
  %loop = (s32[], f32[2,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"TRIP"}}
  ROOT %y = f32[2,16]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_async_pairs_and_shared_computations_from_text():
  trip = 4
  flops, coll = hlo.analyze_hlo(_ASYNC_HLO.replace('TRIP', str(trip)))
  runs = trip + 1  # %layer is called once from ENTRY and once per loop iteration
  full, shard = 16 * 16 * F32, 2 * 16 * F32
  assert flops == runs * 2 * 16 * 16 * 16
  assert {k: (s.count, s.bytes) for k, s in coll.items()} == {
      'all-gather': (runs, runs * full), 'all-reduce': (runs, runs * full),
      'collective-permute': (runs, runs * full), 'reduce-scatter': (runs, runs * shard)}


def test_kernel_launches_by_hand_and_linear_in_scanned_layers():
  """A kernel-level op that is a kernel of its own counts once a run; control flow, views,
  tuples, parameters and the second half of an asynchronous pair do not."""
  trip = 4
  stats = hlo.hlo_stats(_ASYNC_HLO.replace('TRIP', str(trip)))
  # %layer (trip + 1 runs): the dot (its collectives, the async pair's reduce-scatter
  # included, are costed as collectives); %body (trip runs): the counter's add; %cond
  # (trip + 1 runs): the compare; ENTRY: none (its calls, constants, tuple, while and
  # get-tuple-element).
  assert stats.launches == (trip + 1) + trip + (trip + 1)
  # A fusion is one kernel whatever it holds (a fusion inside it too); a copy pair one.
  text = """\
%inner (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}

%outer (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  %e = f32[8]{0} exponential(%q)
  ROOT %f = f32[8]{0} fusion(%e), kind=kLoop, calls=%inner
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %cs = (f32[8]{0}, f32[8]{0}, u32[]) copy-start(%x)
  %cd = f32[8]{0} copy-done(%cs)
  %a = f32[8]{0} fusion(%cd), kind=kLoop, calls=%outer
  ROOT %b = f32[8]{0} add(%a, %x)
}
"""
  assert hlo.hlo_stats(text).launches == 3   # copy-start, the fusion, the add
  f = jax.grad(lambda x, w: _scan_layers(x, w).sum(), argnums=1)
  n = {layers: _report(f, *_inputs(layers=layers)).launches for layers in (4, 8, 16)}
  assert n[16] - n[8] == 2 * (n[8] - n[4]) > 0


def test_tuple_results_dtypes_and_inline_operand_shapes():
  text = """\
ENTRY %main (a: bf16[4,8], b: bf16[8,3], c: f32[5]) -> f32[4,3] {
  %a = bf16[4,8]{1,0} parameter(0)
  %b = bf16[8,3]{1,0} parameter(1)
  %c = f32[5]{0} parameter(2)
  %ar = (bf16[4,8]{1,0}, f32[5]{0}) all-reduce(bf16[4,8]{1,0} %a, f32[5]{0} %c), to_apply=%add
  ROOT %d = f32[4,3]{1,0} dot(bf16[4,8]{1,0} %a, bf16[8,3]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
  flops, coll = hlo.analyze_hlo(text)
  assert flops == 2 * 4 * 3 * 8
  assert coll['all-reduce'].bytes == 4 * 8 * np.dtype(jnp.bfloat16).itemsize + 5 * F32


def test_kernel_custom_calls_are_not_costed_as_flops():
  text = """\
ENTRY %main (a: f32[64,64], b: f32[64,32]) -> (f32[64,64], f32[64,32]) {
  %a = f32[64,64]{1,0} parameter(0)
  %b = f32[64,32]{1,0} parameter(1)
  %k = f32[64,64]{1,0} custom-call(f32[64,64]{1,0} %a), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"flash"}
  %g = (f32[64,32]{1,0}, s8[1024]{0}) custom-call(f32[64,64]{1,0} %a, f32[64,32]{1,0} %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %t = (f32[64,64]{1,0}, f32[64,32]{1,0}) tuple(%k, %g)
}
"""
  flops, _ = hlo.analyze_hlo(text)
  assert flops == 2 * 64 * 32 * 64   # the GEMM only; the Triton kernel is opaque


@pytest.mark.parametrize('attrs, groups', [
    ('replica_groups={{0,1},{2,3}}', [[0, 1], [2, 3]]),
    ('replica_groups=[2,4]<=[8]', [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ('replica_groups=[4,2]<=[2,4]T(1,0)', [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['a'=2,'b'=4] {'b'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['a'=2,'b'=4] {'a'}, device_ids=([4,2]T(1,0))",
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ('source_target_pairs={{0,1},{1,0}}', [[0, 1], [1, 0]]),
    ('channel_id=1', []),
])
def test_device_groups_in_every_printed_form(attrs, groups):
  assert hlo.device_groups(attrs) == groups


def test_group_axes_names_the_mesh_axes_a_group_spans():
  mesh = {'data': 2, 'fsdp': 2, 'tensor': 2}
  assert hlo.group_axes([[0, 1], [2, 3]], mesh) == ('tensor',)
  assert hlo.group_axes([[0, 2], [1, 3]], mesh) == ('fsdp',)
  assert hlo.group_axes([[0, 5]], mesh) == ('data', 'tensor')
  assert hlo.group_axes([], mesh) == ('data', 'fsdp', 'tensor')


# ------------------------------------------------------------------ memory traffic

_TRIP_COUNTS = re.compile(r'"known_trip_count":\{"n":"\d+"\}')


def xla_bytes_accessed(compiled) -> float:
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)['bytes accessed']


def traffic_with_loops_once(compiled) -> float:
  """hlo.py's memory traffic with the trip counts removed (each loop body once), as
  XLA's own cost analysis counts it. Collectives' operands and results added: XLA counts
  their bytes, hlo.py costs them as communication."""
  text = _TRIP_COUNTS.sub('', compiled.as_text())
  stats = hlo.hlo_stats(text)
  comps, entry = hlo._parse_module(text)
  runs, _ = hlo._multiplicities(comps, entry)
  collective = sum(
      m * (hlo._shape_bytes(ins.shape) + sum(hlo._shape_bytes(hlo._operand_shape(o, comps[c]))
                                             for o in ins.operands))
      for c, m in runs.items() for ins in comps[c].instrs
      if ins.opcode.removesuffix('-start') in hlo.COLLECTIVES)
  return stats.dot_bytes + stats.other_bytes + collective


def test_memory_traffic_of_unfused_ops_by_hand():
  x = jnp.ones((1024,), jnp.float32)
  report = _report(lambda a, b: a + b, x, x)
  assert (report.dot_bytes, report.other_bytes) == (0, 3 * 1024 * F32)
  a, b = jnp.ones((64, 128), jnp.float32), jnp.ones((128, 32), jnp.float32)
  report = _report(lambda a, b: a @ b, a, b)
  assert (report.dot_bytes, report.other_bytes) == ((64 * 128 + 128 * 32 + 64 * 32) * F32, 0)


@pytest.mark.parametrize('grad', [False, True], ids=['forward', 'grad'])
def test_memory_traffic_matches_xla_cost_analysis_with_loops_counted_once(grad):
  """XLA's cost analysis reads a fusion's sliced operands as the slices and in-place
  updates as the update (and counts a loop body once): an independent count of the
  same program. Scanned layers are where slice-blind counting reads the whole stack."""
  f = lambda x, w: _scan_layers(x, w).sum()
  f = jax.grad(f, argnums=1) if grad else f
  compiled = jax.jit(f).lower(*_inputs(layers=8)).compile()
  assert traffic_with_loops_once(compiled) == pytest.approx(xla_bytes_accessed(compiled),
                                                            rel=0.01)


def test_memory_traffic_of_scanned_layers_is_linear_in_the_layers():
  """Each layer's step reads its own slice of the stacked weights and updates its own
  slice of the stacked gradients: traffic a + b * layers. Counting the stack every
  iteration would make it quadratic."""
  f = jax.grad(lambda x, w: _scan_layers(x, w).sum(), argnums=1)
  t = {n: (lambda r: r.dot_bytes + r.other_bytes)(_report(f, *_inputs(layers=n)))
       for n in (4, 8, 16)}
  assert t[16] - t[8] == pytest.approx(2 * (t[8] - t[4]), rel=1e-9)


def test_an_interpreted_pallas_kernel_is_costed_as_one_kernel():
  """On CPU the flash kernel runs in the Pallas interpreter: a loop over its grid that
  copies blocks. Its traffic is what the GPU kernel moves at least: q, k, v read and the
  output written once; its calls are counted and its dots set apart."""
  from pallas_kernels.flash_attention import flash_attention  # pylint: disable=import-outside-toplevel
  q = jnp.ones((1, 256, 2, 32), jnp.float32)
  f = lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=64, block_k=64)
  text = jax.jit(f).lower(q, q, q).compile().as_text()
  report = hlo.hlo_stats(text)
  assert report.kernel_calls == {'flash_attention_fwd': 1}
  assert report.dot_bytes == pytest.approx(4 * q.nbytes, abs=64)   # + loop scalars
  assert report.other_bytes == 0   # the interpreter's copies of q, k, v and output fill
  assert report.dot_flops == 0 and report.kernel_dot_flops > 0
  assert report.launches == 1   # the grid loop, one kernel on a GPU
  blind = hlo.hlo_stats(text, kernels=())   # the interpreter's block copies
  assert blind.dot_bytes + blind.other_bytes > 10 * (report.dot_bytes + report.other_bytes)
  assert blind.launches > 10
  grad = jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))
  report = hlo.hlo_stats(jax.jit(grad).lower(q, q, q).compile().as_text())
  assert report.kernel_calls == {'flash_attention_fwd': 1, 'flash_attention_dq': 1,
                                 'flash_attention_dkv': 1}


def test_pallas_kernel_names_are_the_kernels_pallas_call_names():
  import pathlib   # pylint: disable=import-outside-toplevel
  sources = ''.join(p.read_text() for p in
                    (pathlib.Path(__file__).parent.parent / 'pallas_kernels').glob('*.py'))
  # Every pallas_call name: the `name=` argument, or the last argument of flash's _call.
  named = set(re.findall(r"\bname='(\w+)'", sources))
  named |= set(re.findall(r"cfg,\s*'(\w+)'\)", sources))
  assert named == set(hlo.PALLAS_KERNELS), named


_UPDATE_HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused (p0: f32[1024,1024], p1: f32[8,1024], p2: s32[]) -> OUT {
  %p0 = f32[1024,1024]{1,0} parameter(0)
  %p1 = f32[8,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %dus = f32[1024,1024]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
  ROOT
}

ENTRY %main (b: f32[1024,1024], u: f32[8,1024], i: s32[]) -> OUT {
  %b = f32[1024,1024]{1,0} parameter(0)
  %u = f32[8,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = OUT fusion(%b, %u, %i), kind=kLoop, calls=%fused
}
"""


def test_an_update_is_in_place_only_when_nothing_else_in_the_fusion_reads_it():
  buffer, update = 1024 * 1024 * F32, 8 * 1024 * F32
  alone = _UPDATE_HLO.replace('OUT', 'f32[1024,1024]{1,0}').replace(
      '  ROOT\n', '  ROOT %t = f32[1024,1024]{1,0} bitcast(%dus)\n')
  assert hlo.hlo_stats(alone).other_bytes == 2 * update + 4   # + the index
  # Also reduced in the fusion: the whole updated buffer is read, and written back.
  out = '(f32[1024,1024]{1,0}, f32[])'
  read_too = _UPDATE_HLO.replace('OUT', out).replace(
      '  ROOT\n', '  %c = f32[] constant(0)\n'
      '  %r = f32[] reduce(%dus, %c), dimensions={0,1}, to_apply=%add\n'
      f'  ROOT %t = {out} tuple(%dus, %r)\n')
  assert hlo.hlo_stats(read_too).other_bytes >= 2 * buffer


def test_a_converted_buffer_is_not_updated_in_place():
  """bf16 buffer -> f32 -> update: XLA:CPU reads all of it and writes an f32 copy."""
  b = jnp.ones((1024, 1024), jnp.bfloat16)
  u = jnp.ones((8, 1024), jnp.float32)
  f = lambda b, u, i: jax.lax.dynamic_update_slice(b.astype(jnp.float32), u, (i, 0))
  report = _report(f, b, u, jnp.int32(3))
  assert report.other_bytes >= b.nbytes + 2 * b.nbytes   # read bf16, write f32


def test_a_variadic_scatter_counts_its_indices_and_updates():
  text = """HloModule m

%add2 (a: f32[], b: f32[], c: f32[], d: f32[]) -> (f32[], f32[]) {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  %c = f32[] parameter(2)
  %d = f32[] parameter(3)
  %s = f32[] add(%a, %c)
  %t = f32[] add(%b, %d)
  ROOT %r = (f32[], f32[]) tuple(%s, %t)
}

ENTRY %main (x: f32[1048576], y: f32[1048576], i: s32[8,1], u: f32[8], v: f32[8]) -> (f32[1048576], f32[1048576]) {
  %x = f32[1048576]{0} parameter(0)
  %y = f32[1048576]{0} parameter(1)
  %i = s32[8,1]{1,0} parameter(2)
  %u = f32[8]{0} parameter(3)
  %v = f32[8]{0} parameter(4)
  ROOT %sc = (f32[1048576]{0}, f32[1048576]{0}) scatter(%x, %y, %i, %u, %v), update_window_dims={}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add2
}
"""
  # The indices once; each update read, and its element read and written in place.
  assert hlo.hlo_stats(text).other_bytes == 8 * 4 + 2 * (2 * 8 * F32)
