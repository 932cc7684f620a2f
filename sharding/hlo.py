"""Per-device cost of a compiled step, read from its optimized HLO.

`inspect_compiled(jax.jit(f).lower(...).compile())` takes memory from `memory_analysis()` and,
from `as_text()` (the partitioned program one device runs), dot FLOPs and collectives, each
weighted by how often its computation runs: a `lax.scan` body counts trip-count times.
`cost_analysis()` counts a loop body once, so it undercounts scanned layers.

Convolutions are not costed (their FLOPs depend on window, feature grouping and dilation);
the report counts them so a caller can tell its FLOPs are incomplete.

Memory traffic (`dot_bytes`, `other_bytes`): the bytes each kernel-level instruction (a
fusion, an unfused op, a library call; not the ops inside a fusion, not collectives, which
are communication) reads and writes in device memory, loops weighted by trip count, split
into kernels that do matmuls and the rest (memory-bound). Reads that only feed a slice
count the slice: a scanned layer's `dynamic-slice` of the stacked weights reads one
layer's weights, not the stack. Writes by `dynamic-update-slice` into a buffer (in place)
count the update; a scatter counts its whole buffer, as XLA's own cost analysis does (on
a GPU it is updated in place: an overcount, small next to a step). What the compiler
fuses differs between backends, so bytes read from a CPU compile are an estimate of a
GPU's. A Pallas kernel run by the interpreter (on CPU)
becomes a loop over its grid that copies blocks around; on a GPU it is one kernel, so its
traffic is taken as its inputs read and outputs written once (the loop's carried buffers;
a lower bound: flash attention re-reads K and V blocks, mostly from L2), while the dots
in its blocks are set apart (`kernel_dot_flops`: the interpreter's inner loops have no
known trip count, so they undercount) with the kernel's executions (`kernel_calls`), for
a caller that knows the kernel's FLOPs analytically. The kernels are found by their
pallas_call names (`PALLAS_KERNELS`, the name scope of the interpreter's grid loop); the
interpreter's copies and fills that only seed that loop are left out. A kernel whose
grid is one program has no loop left after XLA's simplification: it is costed as plain
ops, its dots in `dot_flops`, and not counted in `kernel_calls`.

Kernel launches (`launches`): the kernel-level instructions that are kernels of their
own (not control flow, views, tuples or parameters; an asynchronous pair once; an
interpreted Pallas kernel's grid loop once; not collectives, whose latency the planner
costs per collective), loops weighted by trip count. Every branch of a conditional
counts, as for FLOPs: an upper bound. A step of
small kernels is bound by this count, not by its FLOPs or bytes (sharding/planner.py's
LAUNCH_SECONDS). Read from a CPU compile, it too is an estimate of a GPU's.
"""

import collections
import dataclasses
import math
import re

COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'collective-permute', 'all-to-all')

_DTYPE_BYTES = {
    'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'bf16': 2, 'f16': 2, 's32': 4, 'u32': 4,
    'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16, 'token': 0,
}
_ARRAY = re.compile(r'([a-z][a-z0-9]*)\[([^\]]*)\]')
_HEADER = re.compile(r'(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$')
_INSTR = re.compile(r'\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*')
_OPCODE = re.compile(r'\s*([a-z][\w\-]*)\(')
# Metadata holds free-form source text (op names, file names) that could mimic attributes.
_METADATA = re.compile(r'metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
# The pallas_call names of pallas_kernels/ (tests/test_hlo.py checks them against it).
PALLAS_KERNELS = ('flash_attention_fwd', 'flash_attention_dq', 'flash_attention_dkv',
                  'ragged_paged_attention')


@dataclasses.dataclass
class CollectiveStats:
  count: float  # executions per step, weighted by enclosing loops' trip counts
  bytes: float  # bytes of the result per device per step, same weighting


@dataclasses.dataclass
class HloStats:
  """What the HLO text alone tells: dot FLOPs, collectives, and what was not costed."""
  dot_flops: float
  collectives: dict[str, CollectiveStats]
  unknown_trip_count_loops: list[str]  # `while` ops counted once for lack of a trip count
  convolutions: float  # executions of `convolution`, whose FLOPs are not in dot_flops
  # With a mesh: (kind, the mesh axes its device groups span) -> stats.
  by_axes: dict[tuple[str, tuple[str, ...]], CollectiveStats] = dataclasses.field(
      default_factory=dict)
  dot_bytes: float = 0.0    # memory traffic of kernels that do matmuls
  other_bytes: float = 0.0  # memory traffic of every other kernel
  kernel_calls: dict[str, float] = dataclasses.field(default_factory=dict)  # Pallas, by name
  kernel_dot_flops: float = 0.0   # dots inside interpreted Pallas kernels (not in dot_flops)
  launches: float = 0.0     # kernels launched per step (module docstring)


@dataclasses.dataclass
class StepReport:
  """Per-device memory, dot FLOPs and collectives of one compiled step."""
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  dot_flops: float
  collectives: dict[str, CollectiveStats]
  unknown_trip_count_loops: list[str] = dataclasses.field(default_factory=list)
  convolutions: float = 0.0
  by_axes: dict[tuple[str, tuple[str, ...]], CollectiveStats] = dataclasses.field(
      default_factory=dict)   # with a mesh: (kind, mesh axes spanned) -> stats
  dot_bytes: float = 0.0      # memory traffic of matmul kernels (module docstring)
  other_bytes: float = 0.0    # memory traffic of every other kernel
  kernel_calls: dict[str, float] = dataclasses.field(default_factory=dict)
  kernel_dot_flops: float = 0.0   # in interpreted Pallas kernels, not in dot_flops
  launches: float = 0.0           # kernels launched per step

  def bytes_of(self, *kinds: str) -> float:
    """Collective bytes summed over `kinds` (all kinds if none given).

    XLA:CPU turns a reduce-scatter into all-reduce + slice, so compare sums like
    bytes_of('all-reduce', 'reduce-scatter') rather than single op names.
    """
    kinds = kinds or tuple(self.collectives)
    return sum(self.collectives[k].bytes for k in kinds if k in self.collectives)

  def summary(self) -> str:
    lines = [
        f'memory per device: arguments {_human(self.argument_bytes)}, outputs '
        f'{_human(self.output_bytes)}, temps {_human(self.temp_bytes)}, '
        f'aliased {_human(self.alias_bytes)}',
        f'dot FLOPs per device per step: {self.dot_flops:.4g}',
        f'memory traffic per device per step: matmul kernels {_human(self.dot_bytes)}, '
        f'other kernels {_human(self.other_bytes)}',
    ]
    if self.collectives:
      lines.append(f'{"collective":<20}{"count":>10}{"bytes":>14}')
      for kind, s in sorted(self.collectives.items()):
        lines.append(f'{kind:<20}{s.count:>10g}{_human(s.bytes):>14}')
    else:
      lines.append('no collectives')
    if self.unknown_trip_count_loops:
      lines.append('counted once (unknown trip count): ' + ', '.join(self.unknown_trip_count_loops))
    if self.convolutions:
      lines.append(f'{self.convolutions:g} convolution executions not in dot FLOPs')
    if self.kernel_calls:
      lines.append('Pallas kernels (their FLOPs not in dot FLOPs): ' + ', '.join(
          f'{k} x{n:g}' for k, n in sorted(self.kernel_calls.items())))
    return '\n'.join(lines)


def _human(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if abs(n) < 1024 or unit == 'GiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.2f} {unit}'
    n /= 1024
  raise AssertionError('unreachable')


def inspect_compiled(compiled, mesh_shape=None, kernels=PALLAS_KERNELS) -> StepReport:
  """Report for `jax.jit(f).lower(...).compile()`; all numbers are per device.
  mesh_shape ({axis: size}, in the mesh's order, e.g. dict(mesh.shape)): also file each
  collective under the mesh axes its device groups span (`by_axes`)."""
  mem = compiled.memory_analysis()
  stats = hlo_stats(compiled.as_text(), mesh_shape, kernels)
  return StepReport(
      argument_bytes=int(getattr(mem, 'argument_size_in_bytes', 0)),
      output_bytes=int(getattr(mem, 'output_size_in_bytes', 0)),
      temp_bytes=int(getattr(mem, 'temp_size_in_bytes', 0)),
      alias_bytes=int(getattr(mem, 'alias_size_in_bytes', 0)),
      dot_flops=stats.dot_flops,
      collectives=stats.collectives,
      unknown_trip_count_loops=stats.unknown_trip_count_loops,
      convolutions=stats.convolutions,
      by_axes=stats.by_axes,
      dot_bytes=stats.dot_bytes,
      other_bytes=stats.other_bytes,
      kernel_calls=stats.kernel_calls,
      kernel_dot_flops=stats.kernel_dot_flops,
      launches=stats.launches,
  )


def analyze_hlo(hlo_text: str) -> tuple[float, dict[str, CollectiveStats]]:
  """(dot FLOPs, collectives) of an HLO module's text, weighted by loop trip counts."""
  stats = hlo_stats(hlo_text)
  return stats.dot_flops, stats.collectives


def hlo_stats(hlo_text: str, mesh_shape=None, kernels=PALLAS_KERNELS) -> HloStats:
  comps, entry = _parse_module(hlo_text)
  mult, unknown = _multiplicities(comps, entry)
  stats = HloStats(0.0, {}, unknown, 0.0)
  fused = {c for comp in comps.values() for ins in comp.instrs if ins.opcode == 'fusion'
           for c in _refs(ins.attrs, 'calls')}
  grid_loops = {ins.name: kernel for comp in comps.values() for ins in comp.instrs
                for kernel in [_kernel_of(ins, kernels)] if kernel}
  in_kernels = _reachable(comps, [c for comp in comps.values() for ins in comp.instrs
                                  if ins.name in grid_loops for c, _ in _callees(ins)[0]])
  artifacts = _interpreter_copies(comps, grid_loops)
  kernel_instrs = {i.name for c in in_kernels for i in comps[c].instrs}
  # The kernels' own loops are not reported: their dots are set apart.
  stats.unknown_trip_count_loops = [n for n in unknown if n not in kernel_instrs]
  for name, m in mult.items():
    for ins in comps[name].instrs:
      if name in in_kernels:
        stats.kernel_dot_flops += m * _dot_flops(ins, comps[name])
      else:
        _account(ins, comps[name], m, stats, mesh_shape)
      if ins.name in grid_loops:
        kernel = grid_loops[ins.name]
        stats.kernel_calls[kernel] = stats.kernel_calls.get(kernel, 0.0) + m
      if name not in fused and name not in in_kernels and ins.name not in artifacts:
        # An interpreted kernel's grid loop: the buffers it carries, read or written once.
        nbytes = (_shape_bytes(ins.shape) if ins.name in grid_loops
                  else _traffic(ins, comps[name], comps))
        if ins.name in grid_loops or _does_matmul(ins, comps):
          stats.dot_bytes += m * nbytes
        else:
          stats.other_bytes += m * nbytes
        if ins.name in grid_loops or _launches(ins.opcode):
          stats.launches += m
  return stats


def custom_calls(hlo_text: str, targets: re.Pattern) -> tuple[dict[str, int],
                                                             dict[str, float]]:
  """'target result-shape' (layouts dropped) -> (calls in the program text, runs per
  step, loops weighted by trip count) of each custom call whose target `targets` finds."""
  comps, entry = _parse_module(hlo_text)
  mult, _ = _multiplicities(comps, entry)
  static, runs = collections.Counter(), collections.Counter()
  for name, comp in comps.items():
    for ins in comp.instrs:
      target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
      if ins.opcode != 'custom-call' or not target or not targets.search(target.group(1)):
        continue
      key = f'{target.group(1)} {re.sub(r"{[^}]*}", "", ins.shape)}'
      static[key] += 1
      runs[key] += mult.get(name, 0)
  return dict(static), dict(runs)


def _account(ins, comp, m: float, stats: HloStats, mesh_shape=None):
  """Adds one instruction, run `m` times per step, to `stats`."""
  if ins.opcode == 'convolution':
    stats.convolutions += m
  stats.dot_flops += m * _dot_flops(ins, comp)
  found = _collective(ins, comp)
  if found:
    kind, nbytes = found
    keys = [stats.collectives.setdefault(kind, CollectiveStats(0.0, 0.0))]
    if mesh_shape:
      axes = group_axes(device_groups(ins.attrs), mesh_shape)
      keys.append(stats.by_axes.setdefault((kind, axes), CollectiveStats(0.0, 0.0)))
    for s in keys:
      s.count += m
      s.bytes += m * nbytes


# ---------------------------------------------------------------- device groups

_GROUPS = re.compile(r'(?:replica_groups|source_target_pairs)=(\{[{}\d,\s]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)')


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_DEVICE_IDS = re.compile(r'device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)')


def device_groups(attrs: str) -> list[list[int]]:
  """The device (partition) ids grouped by a collective's replica_groups (listed, in
  iota form [G,n]<=[dims]T(perm), or in mesh form mesh['a'=2,'b'=4] {'b'} with optional
  device_ids=([dims]T(perm))) or a permute's source_target_pairs; [] if absent (all
  devices)."""
  mesh = _MESH_GROUPS.search(attrs)
  if mesh:
    return _mesh_groups(mesh.group(1), mesh.group(2), _DEVICE_IDS.search(attrs))
  m = _GROUPS.search(attrs)
  if not m:
    return []
  text = m.group(1)
  if text.startswith('{'):
    return [[int(v) for v in g.split(',') if v.strip()]
            for g in re.findall(r'\{([\d,\s]*)\}', text[1:-1])]
  shape, dims, perm = re.fullmatch(r'\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?',
                                   text).groups()
  ids = _iota(_ints(dims), perm and _ints(perm))
  width = _ints(shape)[-1]
  return [ids[i:i + width] for i in range(0, len(ids), width)]


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(',')]


def _coords(flat: int, dims) -> list[int]:
  out = []
  for size in reversed(dims):
    out.append(flat % size)
    flat //= size
  return out[::-1]


def _iota(dims, perm=None) -> list[int]:
  """arange(prod(dims)).reshape(dims).transpose(perm), flattened."""
  if not perm:
    return list(range(math.prod(dims)))
  strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
  out_dims = [dims[i] for i in perm]
  return [sum(c * strides[perm[k]] for k, c in enumerate(_coords(flat, out_dims)))
          for flat in range(math.prod(out_dims))]


def _mesh_groups(dims_text: str, axes_text: str, device_ids) -> list[list[int]]:
  """One group per point of the mesh axes not named in braces, over the named ones."""
  names = re.findall(r"'([^']+)'=(\d+)", dims_text)
  dims = [int(n) for _, n in names]
  named = {a for a in re.findall(r"'([^']+)'", axes_text)}
  ids = (_iota(_ints(device_ids.group(1)), device_ids.group(2) and _ints(device_ids.group(2)))
         if device_ids else list(range(math.prod(dims))))
  groups = {}
  for flat, device in enumerate(ids):
    c = _coords(flat, dims)
    key = tuple(x for (a, _), x in zip(names, c) if a not in named)
    groups.setdefault(key, []).append(device)
  return list(groups.values())


def group_axes(groups: list[list[int]], mesh_shape) -> tuple[str, ...]:
  """The mesh axes (in mesh order) along which members of some group differ: the axes
  the collective communicates over. Device id i sits at the mesh coordinates of the
  i-th device in the mesh's order."""
  names, sizes = list(mesh_shape), list(mesh_shape.values())
  if not groups:
    return tuple(n for n, s in zip(names, sizes) if s > 1)
  def coords(i):
    out = []
    for size in reversed(sizes):
      out.append(i % size)
      i //= size
    return out[::-1]
  spans = set()
  for g in groups:
    cs = [coords(i) for i in g]
    spans |= {k for k in range(len(sizes)) if len({c[k] for c in cs}) > 1}
  return tuple(names[k] for k in sorted(spans))


# ---------------------------------------------------------------- parsing


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]  # as printed: '%name', or 'f32[4]{0} %name' in older dumps
  attrs: str  # everything after the operand list, metadata removed
  root: bool = False
  op_name: str = ''   # from the metadata: the jax name scope of the op


@dataclasses.dataclass
class _Comp:
  instrs: list[_Instr] = dataclasses.field(default_factory=list)
  shapes: dict[str, str] = dataclasses.field(default_factory=dict)
  done_shapes: dict[str, str] = dataclasses.field(default_factory=dict)  # start name -> done shape
  root: str = ''


def _parse_module(text: str) -> tuple[dict[str, _Comp], str]:
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      cur = comps.setdefault(header.group(2), _Comp())
      entry = header.group(2) if header.group(1) else entry
    elif line.startswith('}'):
      cur = None
    elif cur is not None:
      _add_instr(cur, line)
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text; pass compiled.as_text().')
  return comps, entry


def _add_instr(comp: _Comp, line: str):
  ins = _parse_instr(line)
  if ins is None:
    return
  comp.instrs.append(ins)
  comp.shapes[ins.name] = ins.shape
  if ins.root:
    comp.root = ins.name
  if ins.opcode.endswith('-done') and ins.operands:
    comp.done_shapes[_operand_name(ins.operands[0])] = ins.shape


def _parse_instr(line: str) -> _Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  rest = line[m.end():]
  end = _group_end(rest, 0) if rest.startswith('(') else rest.find(' ')
  shape, rest = rest[:end], rest[end:]
  op = _OPCODE.match(rest)
  if not op:
    return None
  close = _group_end(rest, op.end() - 1)
  operands = _split_top(re.sub(r'/\*.*?\*/', '', rest[op.end():close - 1]))
  meta = _METADATA.search(rest, close)
  name = _OP_NAME.search(meta.group(0)) if meta else None
  attrs = _METADATA.sub('', rest[close:])
  return _Instr(m.group(1), shape, op.group(1), operands, attrs,
                root=line.lstrip().startswith('ROOT '), op_name=name.group(1) if name else '')


def _group_end(text: str, start: int) -> int:
  """Index just past the bracket group that opens at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in '([{':
      depth += 1
    elif text[i] in ')]}':
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f'unbalanced brackets in HLO text: {text[start:start + 80]!r}')


def _split_top(text: str) -> list[str]:
  """Splits on commas outside brackets: tuple shapes and literals contain commas."""
  parts, depth, start = [], 0, 0
  for i, c in enumerate(text):
    depth += (c in '([{') - (c in ')]}')
    if c == ',' and depth == 0:
      parts.append(text[start:i].strip())
      start = i + 1
  tail = text[start:].strip()
  return parts + [tail] if tail else parts


def _operand_name(operand: str) -> str:
  return operand.split()[-1].lstrip('%')


def _operand_shape(operand: str, comp: _Comp) -> str:
  # Newer XLA prints bare operand names; older dumps print the shape before the name.
  pieces = operand.split()
  return ' '.join(pieces[:-1]) if len(pieces) > 1 else comp.shapes.get(_operand_name(operand), '')


# ---------------------------------------------------------------- shapes


def _arrays(shape: str) -> list[tuple[str, list[int]]]:
  """(dtype, dims) of every array in a shape, tuple elements in order."""
  return [(dt, [int(d.lstrip('<=')) for d in dims.split(',') if d.strip()])
          for dt, dims in _ARRAY.findall(shape)]


def _dtype_bytes(dtype: str) -> float:
  if dtype in _DTYPE_BYTES:
    return _DTYPE_BYTES[dtype]
  bits = re.match(r'[a-z]+(\d+)', dtype)  # f8e4m3fn, s4, ...: the width leads the name
  if not bits:
    raise ValueError(f'unknown HLO element type {dtype!r}')
  return int(bits.group(1)) / 8


def _shape_bytes(shape: str) -> float:
  return sum(_dtype_bytes(dt) * math.prod(dims) for dt, dims in _arrays(shape))


# ---------------------------------------------------------------- call graph


def _refs(attrs: str, key: str) -> list[str]:
  """Computation names after `key=`, as `%a` or `{%a, %b}`."""
  m = re.search(rf'\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)', attrs)
  if not m:
    return []
  return [r.strip().lstrip('%') for r in m.group(1).strip('{}').split(',') if r.strip()]


def _callees(ins: _Instr) -> tuple[list[tuple[str, float]], bool]:
  """(computation, runs per execution of `ins`) pairs; and whether a loop lacks a trip count."""
  if ins.opcode == 'while':
    trip = _TRIP.search(ins.attrs)
    n = int(trip.group(1)) if trip else 1
    # The condition runs once more than the body, to exit.
    cond = n + 1 if trip else 1
    return [(c, n) for c in _refs(ins.attrs, 'body')] + [
        (c, cond) for c in _refs(ins.attrs, 'condition')], trip is None
  if ins.opcode in ('async-update', 'async-done'):
    return [], False  # the async-start already ran the wrapped computation
  # Reducers and comparators (to_apply of reduce, all-reduce, sort...) hold no dots.
  keys = ['calls', 'branch_computations', 'true_computation', 'false_computation',
          'called_computations'] + (['to_apply'] if ins.opcode == 'call' else [])
  # Each conditional branch counts once: an upper bound on what one execution runs.
  return [(c, 1) for k in keys for c in _refs(ins.attrs, k)], False


def _kernel_of(ins: _Instr, kernels) -> str:
  """The Pallas kernel whose interpreted grid loop `ins` is ('' if none): a `while` named
  <scope>/KERNEL/while, KERNEL possibly wrapped by transformations (jvp(KERNEL))."""
  if ins.opcode != 'while':
    return ''
  parts = ins.op_name.split('/')
  if len(parts) < 2 or parts[-1] != 'while':
    return ''
  inner = unwrap_scope(parts[-2])
  return inner if inner in kernels else ''


def unwrap_scope(part: str) -> str:
  """A name scope without the transformations jax wraps it in: jvp(f) and
  transpose(jvp(f)) are f."""
  return re.sub(r'^(?:[\w.-]+\()*([^()]*)\)*$', r'\1', part)


def _interpreter_copies(comps: dict[str, _Comp], grid_loops) -> set[str]:
  """Copies and fills whose only use is to seed an interpreted kernel's grid loop (its
  carried inputs, its output buffers): the interpreter's, not a GPU kernel's, traffic."""
  def fill_or_copy(i):
    if i.opcode == 'copy':
      return True
    body = {j.opcode for c in _refs(i.attrs, 'calls') for j in comps.get(c, _Comp()).instrs}
    return i.opcode == 'fusion' and body <= {
        'parameter', 'constant', 'broadcast', 'bitcast', 'copy', 'convert'}

  found = set()
  for comp in comps.values():
    users = collections.defaultdict(set)
    for i in comp.instrs:
      for o in i.operands:
        users[_operand_name(o)].add(i.name)
    seeds = {_operand_name(o) for i in comp.instrs if i.name in grid_loops for o in i.operands}
    ends = set(grid_loops) | {i.name for i in comp.instrs
                              if i.name in seeds and i.opcode == 'tuple'}
    changed = True
    while changed:
      changed = False
      for i in comp.instrs:
        if (i.name not in found and users[i.name] and users[i.name] <= ends | found
            and fill_or_copy(i)):
          found.add(i.name)
          changed = True
  return found


def _reachable(comps: dict[str, _Comp], roots) -> set[str]:
  """The computations in `roots` and every one they call (fusions included)."""
  seen, stack = set(), [r for r in roots if r in comps]
  while stack:
    name = stack.pop()
    if name in seen:
      continue
    seen.add(name)
    for ins in comps[name].instrs:
      stack += [c for c, _ in _callees(ins)[0] if c in comps]
  return seen


def _multiplicities(comps: dict[str, _Comp], entry: str) -> tuple[dict[str, float], list[str]]:
  """Runs per step of each computation reachable from `entry`; and loops lacking trip counts."""
  callers = collections.defaultdict(list)
  seen, stack, unknown = {entry}, [entry], []
  while stack:
    name = stack.pop()
    for ins in comps[name].instrs:
      callees, no_trip = _callees(ins)
      if no_trip:
        unknown.append(ins.name)
      for callee, k in callees:
        callers[callee].append((name, k))
        if callee in comps and callee not in seen:
          seen.add(callee)
          stack.append(callee)
  mult = {entry: 1.0}

  def runs(name):
    # A computation called from several places runs the sum of its callers' counts.
    if name not in mult:
      mult[name] = sum(runs(c) * k for c, k in callers[name])
    return mult[name]

  for name in seen:
    runs(name)
  return mult, sorted(unknown)


# ---------------------------------------------------------------- costs


def _dot_flops(ins: _Instr, comp: _Comp) -> float:
  """2 * result elements * contracted elements, for `dot` and library GEMM custom-calls."""
  if ins.opcode == 'dot':
    contracting = re.search(r'lhs_contracting_dims=\{([^}]*)\}', ins.attrs)
  elif ins.opcode == 'custom-call':
    # GPU cuBLAS GEMMs carry their dimension numbers in backend_config.
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    if contracting is None:
      return 0.0   # a kernel (Triton, cuDNN attention): its FLOPs are not in the HLO
  else:
    return 0.0
  if not ins.operands or not _arrays(ins.shape):
    return 0.0
  dims = [int(d.strip(' "')) for d in contracting.group(1).split(',')
          if d.strip(' "')] if contracting else []
  lhs = _arrays(_operand_shape(ins.operands[0], comp))
  if not lhs:
    raise ValueError(f'no shape for the lhs of {ins.name}')
  out = _arrays(ins.shape)[0][1]  # a GEMM custom-call's result is (output, workspace)
  return 2.0 * math.prod(out) * math.prod(lhs[0][1][d] for d in dims)


def _collective(ins: _Instr, comp: _Comp) -> tuple[str, float] | None:
  """(kind, result bytes) if `ins` is a collective; async pairs count at their start."""
  if ins.opcode in COLLECTIVES:
    return ins.opcode, _shape_bytes(ins.shape)
  kind = ins.opcode.removesuffix('-start')
  if kind == ins.opcode or kind not in COLLECTIVES:
    return None
  # all-gather-start and collective-permute-start results also hold the operands (and
  # context scalars); the matching -done's result is the output alone.
  done = comp.done_shapes.get(ins.name)
  if done is None:
    raise ValueError(f'{ins.opcode} {ins.name} has no matching -done in its computation')
  return kind, _shape_bytes(done)


# ---------------------------------------------------------------- memory traffic

# No kernel of their own: bookkeeping, control flow (their bodies are counted), and
# collectives (communication, costed as such).
_NO_TRAFFIC = {
    'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast', 'while',
    'conditional', 'call', 'after-all', 'partition-id', 'replica-id', 'opt-barrier',
    'add-dependency', 'async-start', 'async-update', 'async-done', 'copy-done',
    'send', 'send-done', 'recv', 'recv-done', 'domain',
}
_SLICES = ('dynamic-slice', 'slice', 'gather')


def _launches(opcode: str) -> bool:
  """Whether a kernel-level instruction of `opcode` is a kernel of its own: not control
  flow, not a view, not the second half of an asynchronous pair, not a collective (the
  planner costs each collective's latency itself)."""
  return (opcode not in _NO_TRAFFIC and not opcode.endswith('-done')
          and not _is_collective(opcode))


def _is_collective(opcode: str) -> bool:
  return opcode.removesuffix('-start').removesuffix('-done') in COLLECTIVES


def _traffic(ins: _Instr, comp: _Comp, comps: dict[str, _Comp]) -> float:
  """Bytes one execution of kernel-level `ins` reads and writes (module docstring)."""
  if ins.opcode in _NO_TRAFFIC or _is_collective(ins.opcode):
    return 0.0
  operand = lambda i: _shape_bytes(_operand_shape(ins.operands[i], comp))
  if ins.opcode in _SLICES:          # reads what it writes (+ a gather's indices)
    return 2 * _shape_bytes(ins.shape) + sum(operand(i) for i in range(1, len(ins.operands))
                                             if ins.opcode == 'gather')
  if ins.opcode == 'dynamic-update-slice':   # in place: the update, read and written
    return 2 * operand(1)
  if ins.opcode == 'scatter':   # (operands..., indices, updates...): in place
    n = (len(ins.operands) - 1) // 2
    return operand(n) + 2 * sum(operand(i) for i in range(n + 1, len(ins.operands)))
  if ins.opcode == 'fusion':
    body = comps.get((_refs(ins.attrs, 'calls') or [''])[0])
    if body is not None:
      return _fusion_traffic(ins, comp, body)
  return sum(operand(i) for i in range(len(ins.operands))) + _shape_bytes(ins.shape)


# A slice of a converted (or copied) array reads only the slice: a fusion computes what
# each output element needs.
_READ_THROUGH = ('bitcast', 'convert', 'copy')


def _elements(shape: str) -> int:
  arrays = _arrays(shape)
  return math.prod(arrays[0][1]) if arrays else 0


def _fusion_traffic(ins: _Instr, comp: _Comp, body: _Comp) -> float:
  by_name = {i.name: i for i in body.instrs}
  users = collections.defaultdict(list)      # name -> [(user, operand position)]
  for i in body.instrs:
    for pos, o in enumerate(i.operands):
      users[_operand_name(o)].append((i, pos))

  def uses(name, through):
    out = []
    for user, pos in users[name]:
      out += uses(user.name, through) if user.opcode in through else [(user, pos)]
    return out

  def unbitcast(i):
    while i is not None and i.opcode == 'bitcast':
      i = by_name.get(_operand_name(i.operands[0]))
    return i

  root = by_name.get(body.root)
  outputs = ([by_name.get(_operand_name(o)) for o in root.operands]
             if root is not None and root.opcode == 'tuple' else [root])
  # In place: a dynamic-update-slice that is an output (through bitcasts) and feeds
  # nothing else, into a parameter (through bitcasts: a convert makes a new buffer), reads
  # and writes the update only; the buffer is not read.
  in_place = set()
  for out in outputs:
    dus = unbitcast(out)
    if dus is None or dus.opcode != 'dynamic-update-slice':
      continue
    buffer = unbitcast(by_name.get(_operand_name(dus.operands[0])))
    only_output = dus is root or all(u is root for u, _ in uses(dus.name, ('bitcast',)))
    if buffer is not None and buffer.opcode == 'parameter' and only_output:
      in_place.add(dus.name)
  params = {int(i.operands[0]): i.name for i in body.instrs if i.opcode == 'parameter'}
  total = 0.0
  for k, operand in enumerate(ins.operands):
    shape = _operand_shape(operand, comp)
    full = _shape_bytes(shape)
    reached = uses(params.get(k, ''), _READ_THROUGH)
    arrays = _arrays(shape)
    if (len(arrays) == 1 and reached
        and all(u.opcode in _SLICES and pos == 0 for u, pos in reached)):
      # Only the slices are read, in the operand's own element type (at most all of it).
      total += min(full, sum(_elements(u.shape) for u, _ in reached)
                   * _dtype_bytes(arrays[0][0]))
    elif (reached and all(u.name in in_place and pos == 0
                          for u, pos in uses(params.get(k, ''), ('bitcast',)))):
      pass                                  # a buffer updated in place: not read
    else:
      total += full
  for out in outputs:
    if out is None:
      continue
    dus = unbitcast(out)
    total += (_shape_bytes(_operand_shape(dus.operands[1], body)) if dus.name in in_place
              else _shape_bytes(out.shape))
  return total


def _does_matmul(ins: _Instr, comps: dict[str, _Comp]) -> bool:
  if ins.opcode in ('dot', 'convolution'):
    return True
  if ins.opcode == 'custom-call':
    return '"lhs_contracting_dimensions"' in ins.attrs    # a library GEMM
  if ins.opcode == 'fusion':
    return any(_does_matmul(i, comps) for c in _refs(ins.attrs, 'calls')
               for i in comps.get(c, _Comp()).instrs)
  return False
