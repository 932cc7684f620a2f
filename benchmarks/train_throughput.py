"""Train-step throughput of a config: tokens/s, step time and MFU over a short run.

  python -m benchmarks.train_throughput --config=default.py --steps=300 [--set model.remat=full]

Runs `steps` steps in a fresh temporary workdir, drops the first `warmup` steps, and
writes benchmarks/results/train_<config>_<device>.json with the median numbers.
"""

import argparse
import statistics
import sys
import tempfile
import time

import jax

from benchmarks.common import write_result
from sharding.mesh import mesh_shape
from training import trainer
from training.cli import load_config_file


def apply_overrides(cfg, assignments):
  """--set a.b=value, typed by the field's current value."""
  for item in assignments:
    path, value = item.split('=', 1)
    *parents, field = path.split('.')
    holder = cfg
    for name in parents:
      holder = getattr(holder, name)
    current = getattr(holder, field)
    if isinstance(current, bool):
      value = value.lower() in ('1', 'true', 'yes')
    setattr(holder, field, type(current)(value))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='default.py')
  parser.add_argument('--steps', type=int, default=40)
  parser.add_argument('--warmup', type=int, default=5)
  parser.add_argument('--set', action='append', default=[], metavar='FIELD=VALUE')
  args = parser.parse_args(argv)
  cfg = load_config_file(args.config)
  apply_overrides(cfg, args.set)
  with tempfile.TemporaryDirectory() as workdir:
    cfg.workdir, cfg.steps, cfg.sample.num_tokens = workdir, args.steps, 0
    cfg.checkpoint.every_steps = args.steps
    cfg.metrics.progress_bar = False
    start = time.perf_counter()
    history = trainer.train(cfg)
    wall = time.perf_counter() - start
  timed = history[args.warmup:]
  step_time = statistics.median(r['step_time_s'] for r in timed)
  mfus = [r['mfu'] for r in timed if r['mfu'] is not None]
  result = {
      'config': args.config, 'overrides': args.set, 'steps': args.steps,
      'batch_size': cfg.data.batch_size, 'seq_len': cfg.data.seq_len,
      'mesh': mesh_shape(cfg.mesh, jax.device_count()), 'zero_stage': cfg.parallel.zero_stage,
      'median_step_time_s': step_time,
      'tokens_per_sec': cfg.data.batch_size * cfg.data.seq_len / step_time,
      'median_mfu': statistics.median(mfus) if mfus else None,
      'first_loss': history[0]['loss'], 'last_loss': history[-1]['loss'],
      'wall_time_s': wall,
  }
  config_name = args.config.replace('.py', '').replace(':', '_')
  name = f'train_{config_name}_{jax.devices()[0].platform}'
  print(write_result(name, result), file=sys.stderr)
  print(result)


if __name__ == '__main__':
  main()
