"""Train-step throughput of a config: tokens/s, step time and MFU over a short run.

  python -m benchmarks.train_throughput --config=default.py [--config.steps=300] [--warmup=5]
      [--profile_steps=3]

Takes the same `--config` and `--config.a.b=value` as train.py, runs `steps` steps in a
fresh temporary workdir (no sample), drops the first `warmup` steps, and writes
benchmarks/results/train_<config>_<platform>.json (or `--result_name`.json) with the
median numbers and the device's peak memory (where it reports one). `--profile_steps=N`
then traces N more steps of the same step and adds where their time goes
(benchmarks/profile.py: seconds per model scope, the top ops, the three largest costs).
"""

import statistics
import sys
import tempfile
import time

import jax
from absl import flags

import model
from benchmarks import profile
from benchmarks.common import peak_memory_bytes, write_result
from pallas_kernels.flash_attention import default_backend
from sharding.mesh import mesh_shape
from training import cli, trainer

_WARMUP = flags.DEFINE_integer('warmup', 5, 'steps left out of the medians')
_NAME = flags.DEFINE_string('result_name', '', 'results/<this>.json (default: '
                            'train_<config>_<platform>)')


def attention_kernels(m) -> str:
  """attention_impl, and for pallas the flash kernels that ran ('auto' resolved)."""
  if m.attention_impl != 'pallas':
    return m.attention_impl
  backend = m.pallas_backend
  if backend == 'auto':
    q = jax.ShapeDtypeStruct((1, 1, m.num_heads, m.resolved_head_dim), m.dtype)
    backend = default_backend(q)
  return f'pallas/{backend}'


def benchmark(cfg) -> dict:
  config_arg = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--config='))
  with tempfile.TemporaryDirectory() as workdir:
    cfg.workdir, cfg.sample.num_tokens = workdir, 0
    cfg.checkpoint.every_steps = cfg.steps
    cfg.metrics.progress_bar = False
    start = time.perf_counter()
    history = trainer.train(cfg)
    wall = time.perf_counter() - start
  timed = history[_WARMUP.value:]
  step_time = statistics.median(r['step_time_s'] for r in timed)
  mfus = [r['mfu'] for r in timed if r['mfu'] is not None]
  name = config_arg.rsplit('/', 1)[-1].replace('.py', '').replace(':', '_')
  result = {
      'config': name, 'overrides': [a for a in sys.argv if a.startswith('--config.')],
      'steps': cfg.steps, 'batch_size': cfg.data.batch_size, 'seq_len': cfg.data.seq_len,
      'params': model.count_params(cfg.model),
      'mesh': mesh_shape(cfg.mesh, jax.device_count()), 'zero_stage': cfg.parallel.zero_stage,
      'attention': attention_kernels(cfg.model),
      'median_step_time_s': step_time,
      'tokens_per_sec': cfg.data.batch_size * cfg.data.seq_len / step_time,
      'median_mfu': statistics.median(mfus) if mfus else None,
      'first_loss': history[0]['loss'], 'last_loss': history[-1]['loss'],
      'wall_time_s': wall,
      'peak_memory_bytes': peak_memory_bytes(),
  }
  if profile.STEPS.value:
    result['profile'] = profile.profile_config(cfg, profile.STEPS.value)
    print(profile.report(result['profile']))
  print(write_result(_NAME.value or f'train_{name}_{jax.devices()[0].platform}', result))
  print(result)
  return result


if __name__ == '__main__':
  cli.run(benchmark)
