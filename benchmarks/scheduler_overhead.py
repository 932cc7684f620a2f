"""Host time of one scheduler step (schedule + update_from_output) with a stub model.

  python -m benchmarks.scheduler_overhead            # 256 requests decoding, 1000 steps
  python -m benchmarks.scheduler_overhead --smoke    # tiny run; writes nothing

Every request has finished its prompt and decodes one token per step; the stub model
returns a deterministic token per sampling chunk (its cost is not timed). Prefix caching
is on, so each request also hashes and caches a block every block_size steps. Target: a
median at most 1 ms, small beside a model step. Writes
benchmarks/results/scheduler_overhead_cpu.json.
"""

import argparse
import os
import platform
import statistics
import time

from benchmarks.common import write_result
from serve.engine.request import Request
from serve.engine.scheduler import Scheduler, SchedulerConfig
from serve.sampling_params import SamplingParams


def build(num_requests: int, prompt_len: int, steps: int, block_size: int) -> Scheduler:
  max_len = prompt_len + steps + 16
  cfg = SchedulerConfig(block_size=block_size,
                        num_blocks=num_requests * -(-max_len // block_size) + 1,
                        max_num_seqs=num_requests, max_num_batched_tokens=8192,
                        max_model_len=max_len, enable_prefix_caching=True)
  sched = Scheduler(cfg)
  for i in range(num_requests):
    prompt = [(i * 131 + j * 7) % 32000 for j in range(prompt_len)]
    sched.add_request(Request(f'req-{i}', prompt, SamplingParams(max_tokens=steps + 16),
                              None, 0.0))
  return sched


def stub_model(out, step: int) -> dict[str, int]:
  return {c.request_id: (step * 31 + i) % 32000
          for i, c in enumerate(out.chunks) if c.sample}


def timed_steps(sched: Scheduler, steps: int) -> tuple[list[float], list[float]]:
  """Seconds of schedule() and of update_from_output() per step."""
  schedule_s, update_s = [], []
  for step in range(steps):
    start = time.perf_counter()
    out = sched.schedule()
    middle = time.perf_counter()
    sampled = stub_model(out, step)
    before_update = time.perf_counter()
    sched.update_from_output(out, sampled)
    end = time.perf_counter()
    schedule_s.append(middle - start)
    update_s.append(end - before_update)
  return schedule_s, update_s


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--smoke', action='store_true', help='tiny run; writes nothing')
  parser.add_argument('--num-requests', type=int, default=256)
  parser.add_argument('--prompt-len', type=int, default=128)
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--block-size', type=int, default=16)
  args = parser.parse_args(argv)
  if args.smoke:
    args.num_requests, args.prompt_len, args.steps = 8, 20, 20
  sched = build(args.num_requests, args.prompt_len, args.steps, args.block_size)
  while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
    sched.update_from_output((out := sched.schedule()), stub_model(out, -1))   # prefill
  schedule_s, update_s = timed_steps(sched, args.steps)
  assert sched.num_running == args.num_requests, 'every request must still be decoding'
  total = [a + b for a, b in zip(schedule_s, update_s)]
  result = {
      'machine': platform.platform(), 'processor': platform.processor(),
      'num_requests': args.num_requests, 'prompt_len': args.prompt_len,
      'steps': args.steps, 'block_size': args.block_size,
      'median_step_ms': statistics.median(total) * 1e3,
      'median_schedule_ms': statistics.median(schedule_s) * 1e3,
      'median_update_ms': statistics.median(update_s) * 1e3,
      'p90_step_ms': statistics.quantiles(total, n=10)[-1] * 1e3,
      'target_ms': 1.0,
      # 2 cores shared with other jobs: the OS preempts some steps for whole time slices
      # (p90), hence the median.
      'load_average_1m': os.getloadavg()[0],
  }
  print(f"{args.num_requests} requests decoding: step {result['median_step_ms']:.3f} ms "
        f"(schedule {result['median_schedule_ms']:.3f}, update "
        f"{result['median_update_ms']:.3f}; p90 {result['p90_step_ms']:.3f}), target 1 ms")
  if not args.smoke:
    print(write_result('scheduler_overhead_cpu', result))
  return result


if __name__ == '__main__':
  main()
