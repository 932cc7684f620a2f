"""What every benchmark result records: device, jax version, date, shapes, numbers."""

import datetime
import json
import os
import platform
import statistics
import time

import jax

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')


def environment() -> dict:
  device = jax.devices()[0]
  return {
      'device_kind': device.device_kind, 'platform': device.platform,
      'device_count': jax.device_count(), 'jax_version': jax.__version__,
      'python': platform.python_version(), 'host_cpus': os.cpu_count(),
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
  }


def write_result(name: str, payload: dict) -> str:
  """Writes results/NAME.json with the environment folded in; returns the path."""
  os.makedirs(RESULTS_DIR, exist_ok=True)
  path = os.path.join(RESULTS_DIR, f'{name}.json')
  with open(path, 'w') as f:
    json.dump({'environment': environment(), **payload}, f, indent=2)
  return path


def median_time(fn, *args, iters: int = 20, warmup: int = 3) -> float:
  """Median wall seconds of fn(*args), synchronized; compile and first runs excluded."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)
