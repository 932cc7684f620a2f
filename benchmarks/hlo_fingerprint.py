"""Fingerprints of compiled training steps: did a refactor change what XLA runs?

  python -m benchmarks.hlo_fingerprint --output=/tmp/after.json
  python -m benchmarks.hlo_fingerprint --compare=/tmp/before.json,/tmp/after.json

For each layout of LAYOUTS (tests/layout_matrix.py's tiny model on 8 simulated CPU
devices: one device, pipeline, context parallelism with both strategies, and mixes), the
loss-and-gradients step is lowered and compiled and its optimized HLO reduced to what
runs: metadata (source lines, op names) and instruction ids dropped, then hashed, with its
instruction count by opcode. Run at two commits, equal hashes mean the same compiled
program; where they differ, the opcode counts show what moved.
"""

import argparse
import collections
import hashlib
import json
import math
import os
import re
import sys

LAYOUTS = {   # name: (mesh sizes in tests.layout_matrix.AXES order, Combo overrides)
    'one': ((1, 1, 1, 1, 1, 1), {}),
    'stage2': ((4, 2, 1, 1, 1, 1), {}),
    'stage2_repeats2': ((4, 2, 1, 1, 1, 1), {'repeats': 2}),
    'context2_all_gather': ((4, 1, 1, 1, 2, 1), {}),
    'context2_ring': ((4, 1, 1, 1, 2, 1), {'context_strategy': 'ring'}),
    'context2_tensor2': ((2, 1, 1, 1, 2, 2), {}),
    'stage2_context2': ((2, 2, 1, 1, 2, 1), {}),
    'context2_moe_capacity': ((2, 1, 1, 2, 2, 1), {'moe': 'capacity'}),
}
_METADATA = re.compile(r',?\s*metadata=\{[^}]*\}')
_IDS = re.compile(r'%[\w.-]+')
_STACK_FRAME = re.compile(r',?\s*stack_frame_id=\d+')
_PARAM_NAMES = re.compile(r'(?<=[(,]\s)[\w.-]+: |(?<=\()[\w.-]+: ')


def canonical(hlo: str) -> str:
  """The HLO text's computations without metadata (nor the module's tables of source
  files, functions and stack frames before them) or parameter names in their headers,
  value names numbered by first appearance."""
  names: dict[str, str] = {}
  rename = lambda m: names.setdefault(m.group(0), f'%v{len(names)}')
  lines, started = [], False
  for line in hlo.splitlines():
    started = started or line.startswith(('%', 'ENTRY'))
    if started:
      line = _STACK_FRAME.sub('', _METADATA.sub('', line))
      if line.rstrip().endswith('{'):   # a computation's header: its parameters' names
        line = _PARAM_NAMES.sub('', line)
      lines.append(_IDS.sub(rename, line))
  return '\n'.join(lines)


def opcodes(hlo: str) -> dict[str, int]:
  counts = collections.Counter(re.findall(r'=\s*\S+\s+([\w-]+)\(', hlo))
  return dict(sorted(counts.items()))


def fingerprint(name: str) -> dict:
  # pylint: disable=import-outside-toplevel
  import jax
  from tests import layout_matrix
  from training import state, trainer
  import model
  sizes, overrides = LAYOUTS[name]
  cfg = layout_matrix.config(layout_matrix.Combo(sizes, **overrides))
  plan = trainer.build_plan(cfg, jax.devices()[:math.prod(sizes)])
  axes = model.logical_axes(cfg.model)
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        model.abstract_params(cfg.model), plan.tree(plan.params, axes))
  from tests.test_parallel import random_batch
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.batch_sharding())
           for k, v in random_batch(cfg, 0).items()}
  compiled = jax.jit(lambda p, b: state.loss_and_grads(p, b, cfg, plan)).lower(
      params, batch).compile()
  text = canonical(compiled.as_text())
  return {'sha256': hashlib.sha256(text.encode()).hexdigest(),
          'instructions': sum(opcodes(text).values()), 'opcodes': opcodes(text)}


def compare(before: dict, after: dict) -> int:
  changed = 0
  for name in sorted(set(before['layouts']) & set(after['layouts'])):
    b, a = before['layouts'][name], after['layouts'][name]
    same = b['sha256'] == a['sha256']
    changed += not same
    diff = {k: (b['opcodes'].get(k, 0), a['opcodes'].get(k, 0))
            for k in set(b['opcodes']) | set(a['opcodes'])
            if b['opcodes'].get(k, 0) != a['opcodes'].get(k, 0)}
    print(f"{name:24} {'identical' if same else 'DIFFERENT'}  instructions "
          f"{b['instructions']} -> {a['instructions']}  {diff or ''}")
  return changed


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  p.add_argument('--output', help='write the fingerprints here (JSON)')
  p.add_argument('--layouts', default=','.join(LAYOUTS))
  p.add_argument('--compare', metavar='BEFORE,AFTER', help='compare two outputs')
  args = p.parse_args(argv)
  if args.compare:
    before, after = (json.load(open(f)) for f in args.compare.split(','))
    return 1 if compare(before, after) else 0
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  import jax  # pylint: disable=import-outside-toplevel
  from benchmarks.common import environment
  out = {'environment': environment(), 'layouts': {}}
  for name in args.layouts.split(','):
    out['layouts'][name] = fingerprint(name)
    print(name, out['layouts'][name]['sha256'][:16], out['layouts'][name]['instructions'],
          flush=True)
  if args.output:
    with open(args.output, 'w') as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
