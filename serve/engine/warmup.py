"""Warm-up: every step shape the runner can meet and every sampler program a plain
request needs, compiled before the engine's loop starts, so no request waits on a
compile."""

import dataclasses
import math
import time

from serve.engine.scheduler import ScheduledChunk, SchedulerOutput
from serve.sampling_params import SamplingParams
from serve.worker import sampler
from serve.worker.logits_adjust import pack_bits
from serve.worker.model_runner import sample_bucket, seq_bucket, token_buckets
from sharding import compile_cache


def warmup_step(num_seqs: int, num_tokens: int, block_size: int,
                max_len: int) -> SchedulerOutput:
  """num_seqs chunks of num_tokens in all (fewer if chunks of max_len cannot hold them),
  every block the null block 0 (whose K/V nobody reads), each chunk sampled."""
  total = min(num_tokens, num_seqs * max_len)
  sizes = [total // num_seqs + (i < total % num_seqs) for i in range(num_seqs)]
  chunks = [ScheduledChunk(f'warmup{i}', [0] * n, 0, [0] * math.ceil(n / block_size), True)
            for i, n in enumerate(sizes)]
  return SchedulerOutput(chunks, [], [], total)


def warm_up(engine) -> None:
  """Compiles the runner for every token bucket and the sampler for every row count and
  mode, before the loop starts, so no request waits on a compile."""
  start, cfg = time.perf_counter(), engine.runner.cfg
  hits, programs = compile_cache.hits(), compile_cache.programs()
  logits = {}   # per sample bucket: the runner's logits [bucket, V], uncut
  smaller = 0
  for t in token_buckets(cfg):
    step = warmup_step(seq_bucket(cfg, t), t, cfg.block_size, cfg.max_model_len)
    if step.num_batched_tokens > smaller:   # else no real step lands in bucket t
      logits[sample_bucket(cfg, t)] = engine.runner.step(step).logits
    smaller = t
  _warm_up_sampler(engine, logits)
  cached, built = compile_cache.hits() - hits, compile_cache.programs() - programs
  print(f'Warm-up: {engine.runner.num_compiles} step programs '
        f'{"ready" if cached else "compiled"} in {time.perf_counter() - start:.1f}s' + (
            f' ({cached} of {built} programs, the sampler\'s included, read from the '
            'compilation cache).' if cached else '.'), flush=True)


def _warm_up_sampler(engine, logits: dict) -> None:
  # The sampler takes the runner's logits [bucket, V] whole and cuts or pads them to
  # its row bucket (n's power of two): programs per (bucket, row bucket). Each mode
  # plain and with structured output's allowed-token bits; the model's own sampling
  # defaults (generation_config.json) are a mode too. Their penalties read the
  # sampler's per-request tables, sized here for max_num_seqs requests and the longest
  # draft (serve/worker/penalties.py): no history length is a shape.
  modes = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_p=0.9)]
  if engine.served.sampling_defaults:
    modes.append(SamplingParams(**engine.served.sampling_defaults))
  _reserve_penalties(engine, modes)
  warm = [sampler.PenaltyRow(f'warm-up {i}', [0], []) for i in range(engine.cfg.max_num_seqs)]
  # Each mode with logprobs too: the sampled token's alone (chat's logprobs: true) and
  # with the top N (any N: one program), without structured output.
  scored = [dataclasses.replace(m, logprobs=k) for m in modes for k in (0, 1)]
  every = pack_bits(range(engine.vocab_size), engine.vocab_size)
  for rows, full in logits.items():
    # one row count per row bucket (the largest may be cut to the rows there are)
    for n in sorted({min(sampler.row_bucket(m), rows) for m in range(1, rows + 1)}):
      requests = [warm[i % len(warm)] for i in range(n)]   # draft rows share a request
      for params, allowed in ([(p, a) for p in modes for a in (None, [every] * n)]
                              + [(p, None) for p in scored]):
        engine.sampler(full, [params] * n, [0] * n, engine.vocab_size, allowed=allowed,
                       requests=requests)
  for row in warm:
    engine.sampler.release(row.request_id)


def _reserve_penalties(engine, modes) -> None:
  repetition = any(m.repetition_penalty != 1 for m in modes)
  counts = any(m.counts_output for m in modes)
  if repetition or counts:
    engine.sampler.penalties.reserve(
        engine.cfg.max_num_seqs, engine.vocab_size,
        engine.spec.num_speculative_tokens if engine.spec else 0, repetition, counts)
