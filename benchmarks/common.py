"""What every benchmark result records: device, jax version, date, shapes, numbers."""

import datetime
import json
import os
import platform
import statistics
import time

import jax
import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')


def environment() -> dict:
  device = jax.devices()[0]
  return {
      'device_kind': device.device_kind, 'platform': device.platform,
      'device_count': jax.device_count(), 'jax_version': jax.__version__,
      'python': platform.python_version(), 'host_cpus': os.cpu_count(),
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
  }


def write_result(name: str, payload: dict) -> str:
  """Writes results/NAME.json (or $MESHLM_RESULTS_DIR/NAME.json: tests) with the
  environment folded in; returns the path."""
  directory = os.environ.get('MESHLM_RESULTS_DIR', RESULTS_DIR)
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f'{name}.json')
  with open(path, 'w') as f:
    json.dump({'environment': environment(), **payload}, f, indent=2)
  return path


def median_time(fn, *args, iters: int = 20, warmup: int = 3, inner: int = 1) -> float:
  """Median seconds per call of fn(*args); compile and first runs excluded.

  Each of `iters` samples dispatches `inner` calls back to back and waits once. jax
  dispatch is asynchronous, so the device queue stays full. For kernels of tens of
  microseconds, a wait per call would add the host round trip to every sample.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)   # one device runs its work in order: the last is enough
    times.append((time.perf_counter() - start) / inner)
  return statistics.median(times)


def random_train_batch(cfg, specs: dict, seed: int = 0) -> dict:
  """A train batch of random tokens (one document per row), placed as `specs` (name ->
  ShapeDtypeStruct with a sharding, e.g. training.plan.Built.batch) says."""
  b, t = cfg.data.batch_size, cfg.data.seq_len
  rng = np.random.default_rng(seed)
  host = {'inputs': rng.integers(0, cfg.model.vocab_size, (b, t), dtype=np.int32),
          'targets': rng.integers(0, cfg.model.vocab_size, (b, t), dtype=np.int32),
          'positions': np.tile(np.arange(t, dtype=np.int32), (b, 1)),
          'weights': np.ones((b, t), np.float32), 'segment_ids': np.ones((b, t), np.int32)}
  return {k: jax.device_put(host[k], spec.sharding) for k, spec in specs.items()}


def train_step_runner(cfg, layout):
  """(compiled train step, run) for `layout` of cfg (a sharding.planner.Layout) on this
  machine's devices: run() takes one step from fresh random weights on one random batch
  and returns (state, metrics)."""
  from training import plan, state   # pylint: disable=import-outside-toplevel
  built = plan.build_layout(cfg, layout)
  compiled = built.compile()
  box = [state.init_state(built.cfg, built.plan, built.tx)]
  batch = random_train_batch(built.cfg, built.batch)

  def run():
    box[0], metrics = compiled(box[0], batch)
    return box[0], metrics

  return compiled, run


def peak_memory_bytes() -> float | None:
  """The first device's peak memory in this process (None where it keeps no statistics)."""
  return (jax.devices()[0].memory_stats() or {}).get('peak_bytes_in_use')
