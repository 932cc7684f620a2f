"""Which XLA pass changes how often a train step runs each kernel: a diagnosis tool.

  python -m benchmarks.hlo_pass_trace --config=gpt_64k.py [--seq_len=65536]
      [--remat=save_attention] [--attention_impl=pallas] [--output=FILE.json]
      [--culprit_out=FILE] [--all_passes]

Compiles one train step of the config on this machine's first device (one device, no
sharding) with XLA's per-pass dump on, then reads the dumps in pass order and prints each
one whose custom calls (compiled Pallas kernels, cuDNN attention) differ from the one
before: their count in the program text and their runs per step (loops weighed by trip
count, sharding/hlo.py), keyed by target and result shape. Last it names the first pass
that adds calls (`--culprit_out` writes the name alone, for --xla_disable_hlo_passes).
The step is compiled as training compiles it, without the passes training/state.py's
PASSES_OFF names for its remat policy; `--all_passes` runs XLA's whole pipeline. The
persistent compilation cache is off here: a program read from it runs no pass.

Found with it on an H200 (2026-11-26, jax 0.11.2,
results/hlo_pass_trace_gpt_64k_save_attention_all_passes_gpu.json): under remat='save_attention'
XLA's dynamic-slice-fusion-rewriter-v2 turns gpt_64k's one attention forward call a layer
into two. training/state.py now compiles that policy's step without the pass. The same
pass did the same under remat='none' (..._none_all_passes_gpu.json, run before 'none'
joined PASSES_OFF; ..._none_gpu.json after: no pass adds a call).
"""

import argparse
import json
import os
import re
import shutil
import sys
import tempfile

# The custom calls followed: compiled Pallas kernels (Mosaic GPU, Triton) and cuDNN's
# attention (__cudnn$fmha...); not cuBLAS or cuDNN matmuls nor the partitioner's markers.
KERNEL = re.compile(r'mosaic|triton|fmha', re.I)


def kernel_calls(text: str) -> tuple[dict[str, int], dict[str, float]]:
  """'target result-shape' -> (calls in the program text, runs per step: hlo.py's loop
  weights) of each followed custom call."""
  from sharding import hlo   # pylint: disable=import-outside-toplevel
  return hlo.custom_calls(text, KERNEL)


def pass_dumps(dump_dir: str) -> list[str]:
  """The module's dumps in compilation order: before optimizations, each pass's (NNNN in
  the name counts them), after optimizations."""
  names = os.listdir(dump_dir)
  numbered = sorted((n for n in names if re.search(r'\.\d{4}\.', n)),
                    key=lambda n: int(re.search(r'\.(\d{4})\.', n).group(1)))
  first = [n for n in names if n.endswith('before_optimizations.txt')]
  last = [n for n in names if n.endswith('after_optimizations.txt')]
  return [os.path.join(dump_dir, n) for n in first + numbered + last]


def trace(dump_dir: str) -> list[dict]:
  """Each dump whose custom calls differ from the one before, in order: its file name and
  the calls (in the text, and runs per step)."""
  changes, last = [], None
  for path in pass_dumps(dump_dir):
    with open(path) as f:
      text = f.read()
    if 'ENTRY' not in text:
      continue
    static, runs = kernel_calls(text)
    now = {'static': static, 'runs': runs}
    if now != last:
      changes.append({'file': os.path.basename(path), **now})
      print(json.dumps(changes[-1], indent=1), flush=True)
      last = now
  return changes


def culprit(changes: list[dict]) -> str:
  """The pass (its name in the dump file: after_NAME) of the first change that adds calls
  to the kernels in the program text. Not runs per step: those jump wherever a pass first
  annotates a loop's trip count."""
  for before, after in zip(changes, changes[1:]):
    if sum(after['static'].values()) > sum(before['static'].values()):
      m = re.search(r'\.after_(.+?)\.before_', after['file'])
      return m.group(1) if m else ''
  return ''


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--config', default='gpt_64k.py')
  ap.add_argument('--seq_len', type=int, default=0, help="default: the config's")
  ap.add_argument('--remat', default='save_attention')
  ap.add_argument('--attention_impl', default='pallas')
  ap.add_argument('--output', default='', help='the changes as JSON')
  ap.add_argument('--culprit_out', default='',
                  help='write the name of the first pass that adds kernel calls here')
  ap.add_argument('--all_passes', action='store_true',
                  help="also the passes training/state.py turns off (PASSES_OFF)")
  args = ap.parse_args()
  dump = tempfile.mkdtemp(prefix='hlo_passes_')   # removed at the end
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + f' --xla_dump_to={dump}'
                             ' --xla_dump_hlo_pass_re=.* --xla_dump_hlo_as_text'
                             ' --xla_dump_hlo_module_re=jit_step')
  os.environ['JAX_ENABLE_COMPILATION_CACHE'] = 'false'
  sys.argv = sys.argv[:1]
  from sharding import planner   # pylint: disable=import-outside-toplevel
  from training import plan, state   # pylint: disable=import-outside-toplevel
  if args.all_passes:
    state.PASSES_OFF.clear()
  from training.cli import load_config_file   # pylint: disable=import-outside-toplevel
  cfg = load_config_file(args.config)
  cfg.data.seq_len, cfg.data.batch_size = args.seq_len or cfg.data.seq_len, 1
  cfg.model.attention_impl = args.attention_impl
  one = {'data': 1, 'stage': 1, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1}
  try:
    built = plan.build_layout(cfg, planner.Layout(one, 0, args.remat, 1, 0))
    built.compile()
    print(f'{len(os.listdir(dump))} dumps of the compilation', flush=True)
    changes = trace(dump)
  finally:
    shutil.rmtree(dump, ignore_errors=True)
  found = culprit(changes)
  print(f'first pass that adds kernel calls: {found or "none"}', flush=True)
  if args.culprit_out:
    with open(args.culprit_out, 'w') as f:
      f.write(found)
  if args.output:
    from benchmarks.common import environment   # pylint: disable=import-outside-toplevel
    with open(args.output, 'w') as f:
      json.dump({'environment': environment(), 'config': args.config,
                 'seq_len': cfg.data.seq_len, 'remat': args.remat,
                 'attention_impl': args.attention_impl, 'all_passes': args.all_passes,
                 'culprit': found,
                 'changes': changes}, f, indent=1)


if __name__ == '__main__':
  main()
