"""Host time of a sampler step with a repetition penalty: histories counted afresh each step
(`history`) against counts kept on the device (`requests`, serve/worker/penalties.py).

  python -m benchmarks.sampler_penalties            # 64 x 2K, 64 x 8K, 256 x 8K tokens
  python -m benchmarks.sampler_penalties --smoke    # tiny; writes nothing

Every row decodes with Qwen2.5's sampling defaults (temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05: what --generation-config auto turns on) over a vocabulary of
151,936; each step appends one token to every request. Per step, `host` is the sampler's
own work: from the call until its program is dispatched (checks, per-row arrays, the
penalty arrays or the state's update) plus reading the result back once it is ready;
`device` is the wait between the two (the program and the update running). Building the
engine's per-row lists is not timed (either path needs one). The paths run interleaved,
step by step, on the same logits and RNG stream, and must draw the same tokens. The first
step of the kept state (counting every request's history once: its admission) is
reported apart.

Then a serving-like sequence (requests of varied lengths arriving and finishing, drafts)
counts the programs each path builds after its warm-up: jax's lowering events (a program
built, compiled or read from a persistent cache) and backend compiles. Target: at most
2 ms of host time at 256 x 8K and no program after warm-up. Writes
benchmarks/results/sampler_penalties_cpu.json.
"""

import argparse
import os
import platform
import statistics
import time

import jax
import numpy as np

from benchmarks.common import write_result
from serve.sampling_params import SamplingParams
from serve.worker import sampler
from serve.worker.penalties import CLEARS, PenaltyRow, PenaltyState, pair_bucket

QWEN = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
SHAPES = ((64, 2048), (64, 8192), (256, 8192))   # (rows, tokens of prompt and output)
VOCAB = 151_936


class Requests:
  """rows requests of `tokens` tokens each (all but `output` of them prompt) that each
  decode one token a step."""

  def __init__(self, rows: int, tokens: int, vocab: int, seed: int, output: int = 16):
    rng = np.random.default_rng(seed)
    self.prompts = [rng.integers(0, vocab, tokens - output).tolist() for _ in range(rows)]
    self.outputs = [rng.integers(0, vocab, output).tolist() for _ in range(rows)]
    self.ids = [f'req-{i}' for i in range(rows)]

  def history(self):
    return list(zip(self.prompts, self.outputs))

  def rows(self):
    return [PenaltyRow(i, p, o) for i, p, o in zip(self.ids, self.prompts, self.outputs)]

  def advance(self, tokens) -> None:
    for output, token in zip(self.outputs, tokens):
      output.append(int(token))


def timed_step(logits, params, vocab, rng, **penalty_args):
  """(host s, host CPU s, device s, result) of one sample call (module docstring); the
  CPU time is this thread's: what the host did, without the time other jobs took."""
  start, start_cpu = time.perf_counter(), time.thread_time()
  prepared = sampler.prepare(logits, params, [0] * len(params), vocab, rng, **penalty_args)
  out = prepared.dispatch()
  dispatched, dispatched_cpu = time.perf_counter(), time.thread_time()
  jax.block_until_ready(out)
  ready, ready_cpu = time.perf_counter(), time.thread_time()
  result = prepared.result(out)
  host = (dispatched - start) + (time.perf_counter() - ready)
  cpu = (dispatched_cpu - start_cpu) + (time.thread_time() - ready_cpu)
  return host, cpu, ready - dispatched, sent_bytes(prepared), result


def sent_bytes(prepared) -> int:
  """Bytes of the program's host arrays (copied to the device at dispatch); a kept
  state's tables are on the device already."""
  return sum(x.nbytes for x in jax.tree.leaves(prepared.args) if isinstance(x, np.ndarray))


def measure_shape(rows: int, tokens: int, vocab: int, steps: int) -> dict:
  reqs = Requests(rows, tokens, vocab, seed=rows + tokens)
  logits = jax.random.normal(jax.random.key(0), (rows, vocab), np.float32)
  params = [QWEN] * rows
  scratch = PenaltyState()   # both paths' programs compiled off the clock
  scratch.reserve(rows, vocab)
  timed_step(logits, params, vocab, np.random.default_rng(0), requests=reqs.rows(),
             penalties=scratch)
  timed_step(logits, params, vocab, np.random.default_rng(0), history=reqs.history())
  del scratch
  state = PenaltyState()
  state.reserve(rows, vocab)
  admission = timed_step(logits, params, vocab, np.random.default_rng(0),
                         requests=reqs.rows(), penalties=state)[0]   # every history once
  rngs = {'history': np.random.default_rng(1), 'requests': np.random.default_rng(1)}
  times = {path: ([], [], [], []) for path in rngs}
  for step in range(steps):
    got = {}
    for path in (('history', 'requests') if step % 2 else ('requests', 'history')):
      args = ({'history': reqs.history()} if path == 'history'
              else {'requests': reqs.rows(), 'penalties': state})
      *measured, got[path] = timed_step(logits, params, vocab, rngs[path], **args)
      for column, value in zip(times[path], measured):
        column.append(value)
    assert (got['history'].token_ids == got['requests'].token_ids).all(), \
        f'{rows} x {tokens}: the two paths drew different tokens at step {step}'
    reqs.advance(got['requests'].token_ids)
  row = {'rows': rows, 'tokens': tokens, 'vocab': vocab, 'steps': steps,
         'admission_host_ms_requests': admission * 1e3}
  for path, columns in times.items():
    for name, values in zip(('host_ms', 'host_cpu_ms', 'device_ms'), columns):
      row[f'{name}_{path}'] = statistics.median(values) * 1e3
    row[f'host_ms_min_{path}'] = min(columns[0]) * 1e3
    # the kept state's update adds its (slot, token) pairs: one token a row this step
    row[f'sent_bytes_{path}'] = columns[3][-1] + (
        0 if path == 'history' else (pair_bucket(rows) * 2 + CLEARS) * 4)
  row['host_speedup'] = row['host_ms_history'] / row['host_ms_requests']
  return row


class CompileCounter:
  """Programs jax builds (lowered: compiled or read from a persistent cache) and
  compiles, from its monitoring events."""

  def __init__(self):
    self.built = self.compiled = 0
    jax.monitoring.register_event_duration_secs_listener(self._event)

  def _event(self, event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == '/jax/core/compile/jaxpr_to_mlir_module_duration':
      self.built += 1
    elif event == '/jax/core/compile/backend_compile_duration':
      self.compiled += 1

  def snapshot(self) -> tuple[int, int]:
    return self.built, self.compiled


def serving_sequence(counter: CompileCounter, vocab: int, steps: int, max_rows: int,
                     max_tokens: int, max_ahead: int, seed: int = 0) -> dict:
  """Programs built by each path over a sequence of steps after its warm-up: one call per
  row bucket with short histories (the engine's warm-up), then requests of 16 to
  max_tokens tokens arriving, decoding (some rows after drafts) and finishing."""
  out = {}
  for path in ('history', 'requests'):   # the same sequence for both
    rng = np.random.default_rng(seed)
    smp = sampler.Sampler(0)
    if path == 'requests':
      smp.penalties.reserve(max_rows, vocab, max_ahead=max_ahead)
    warm_logits = {}
    for n in sorted({sampler.row_bucket(m) for m in range(1, max_rows + 1)}):
      warm_logits[n] = jax.random.normal(jax.random.key(n), (n, vocab), np.float32)
      warm = [PenaltyRow(f'warm-{i}', [0], []) for i in range(n)]
      smp(warm_logits[n], [QWEN] * n, [0] * n, vocab,
          **({'history': [([0], [])] * n} if path == 'history' else {'requests': warm}))
      for row in warm:
        smp.release(row.request_id)
    before = counter.snapshot()
    live, made = {}, 0
    for _ in range(steps):
      while len(live) < max_rows and rng.random() < 0.7:
        length = int(rng.integers(16, max_tokens))
        live[f'r{made}'] = (rng.integers(0, vocab, length).tolist(), [])
        made += 1
      rows, first = [], {}
      for rid, (prompt, output) in live.items():
        draft = rng.integers(0, vocab, int(rng.integers(0, max_ahead + 1))).tolist()
        if len(rows) + len(draft) + 1 > max_rows:
          break   # the rest sit this step out (as the token budget makes them)
        first[rid] = len(rows)
        rows += [PenaltyRow(rid, prompt, output, draft[:j]) for j in range(len(draft) + 1)]
      n = len(rows)
      if not n:
        continue   # the engine samples no step without rows
      args = ({'history': [(r.prompt_ids, list(r.output_ids) + list(r.ahead)) for r in rows]}
              if path == 'history' else {'requests': rows})
      res = smp(warm_logits[sampler.row_bucket(n)], [QWEN] * n, [0] * n, vocab, **args)
      for rid, row in first.items():
        prompt, output = live[rid]
        output.append(int(res.token_ids[row]))
        if rng.random() < 0.2 or len(prompt) + len(output) >= max_tokens:
          del live[rid]
          smp.release(rid)
    built, compiled = (a - b for a, b in zip(counter.snapshot(), before))
    out[path] = {'programs_built': built, 'compiled': compiled}
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--smoke', action='store_true', help='tiny run; writes nothing')
  parser.add_argument('--steps', type=int, default=9, help='measured steps per shape')
  parser.add_argument('--vocab', type=int, default=VOCAB)
  args = parser.parse_args(argv)
  shapes = ((4, 64),) if args.smoke else SHAPES
  vocab = 512 if args.smoke else args.vocab
  steps = 3 if args.smoke else args.steps
  counter, load_before = CompileCounter(), os.getloadavg()[0]
  result = {
      'machine': platform.platform(), 'processor': platform.processor(),
      'params': 'temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05 (unseeded)',
      'shapes': [measure_shape(rows, tokens, vocab, steps) for rows, tokens in shapes],
      'serving_sequence': serving_sequence(
          counter, vocab, steps=6 if args.smoke else 40, max_rows=4 if args.smoke else 8,
          max_tokens=200 if args.smoke else 8192, max_ahead=4),
      'target_host_ms': 2.0,
      'load_average_1m': [load_before, os.getloadavg()[0]],
      'note': ('2 cores shared with other jobs: medians of interleaved steps. Wall times '
               'stretch by about host_ms / host_cpu_ms where other jobs hold the cores; '
               'host_cpu_ms (this thread\'s CPU time) and host_ms_min are the measures of '
               'the host\'s own work.'),
  }
  for row in result['shapes']:
    print(f"{row['rows']:4d} x {row['tokens']:5d}: host {row['host_ms_history']:8.2f} ms "
          f"counted afresh, {row['host_ms_requests']:6.2f} ms kept (CPU "
          f"{row['host_cpu_ms_history']:.2f} / {row['host_cpu_ms_requests']:.2f} ms; admission "
          f"{row['admission_host_ms_requests']:.0f} ms); device {row['device_ms_history']:.1f} "
          f"/ {row['device_ms_requests']:.1f} ms; sent {row['sent_bytes_history'] / 2**20:.2f} / "
          f"{row['sent_bytes_requests'] / 2**20:.3f} MiB")
  for path, counts in result['serving_sequence'].items():
    print(f'serving after warm-up, {path}: {counts["programs_built"]} programs built, '
          f'{counts["compiled"]} compiled')
  if not args.smoke:
    print(write_result('sampler_penalties_cpu', result))
  return result


if __name__ == '__main__':
  main()
