"""Perplexity of a trained model with each --kv-cache-dtype, on held-out text.

    python -m benchmarks.kv_cache_perplexity [--config default.py:tiny] [--steps 300]

Trains the config (its evaluation batches held out of training) unless --workdir holds a
run, then scores the held-out windows two ways:
- served: through the serving ModelRunner with each KV cache format (every key and
  value the attention reads comes from the cache, quantized as serving stores it);
- simulated: the training forward with K and V quantized and dequantized right after
  their projection, at each scale granularity (per token and kv head: what the cache
  stores; per token over all kv heads; per kv head over a 16-token block; per kv head
  over the whole window), the evidence for the choice in docs/serving/kv-cache.md.
Writes results/kv_cache_perplexity_<variant>_cpu.json.
"""

import argparse
import dataclasses
import math
import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_result
from model import kv_quant, loss, transformer
from serve.load.checkpoint import load_checkpoint
from serve.worker.model_runner import ModelRunner, RunnerConfig
from training import data, trainer
from training.cli import load_config_file

FORMATS = ('auto', 'int8', 'fp8_e4m3', 'fp8_e5m2')
# Axes of K/V [b, t, kv heads, head_dim] one scale covers ('block_head': t in 16s).
GRANULARITIES = {'token_head': (-1,), 'token': (-2, -1), 'block_head': 'block',
                 'window_head': (1, 3)}
BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Chunk:
  token_ids: list
  start_position: int
  block_ids: list
  sample: bool = False
  spec_token_ids: tuple = ()


@dataclasses.dataclass(frozen=True)
class Out:
  chunks: list


def train(config: str, steps: int, workdir: str, eval_batches: int):
  cfg = load_config_file(config)
  cfg.workdir, cfg.steps, cfg.sample.num_tokens = workdir, steps, 0
  cfg.eval.every_steps, cfg.eval.batches = steps, eval_batches
  cfg.checkpoint.every_steps = steps
  cfg.metrics.progress_bar = False
  os.makedirs(workdir, exist_ok=True)
  if not os.listdir(workdir):   # an existing run is scored as it is
    trainer.train(cfg)
  return cfg


def windows(cfg) -> np.ndarray:
  """[n, seq_len + 1] held-out token windows (inputs then the last target)."""
  rows = []
  for b in data.make_eval_batches(cfg):
    rows.append(np.concatenate([b['inputs'], b['targets'][:, -1:]], axis=1))
  return np.concatenate(rows)


def served_perplexity(params, model_cfg, wins: np.ndarray, kv_cache_dtype: str) -> float:
  """exp(mean NLL) of each window's next tokens, each window a prefill through the cache."""
  n, length = wins.shape
  block = 16
  per_seq = -(-length // block)
  seqs = 4
  rc = RunnerConfig(block_size=block, num_blocks=seqs * per_seq + 1, max_num_seqs=seqs,
                    max_num_batched_tokens=seqs * length, max_model_len=length,
                    attention='xla', kv_cache_dtype=kv_cache_dtype)
  runner = ModelRunner(params, model_cfg, rc)
  nll, count = 0.0, 0
  for lo in range(0, n, seqs):
    group = wins[lo:lo + seqs]
    chunks = [Chunk([int(t) for t in w[:-1]], 0,
                    list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
              for i, w in enumerate(group)]
    res = runner.step(Out(chunks), targets=[[int(t) for t in w[1:]] for w in group])
    logp = np.asarray(res.scores[0])[:len(group) * (length - 1)]
    nll, count = nll - float(logp.sum()), count + logp.size
  return math.exp(nll / count)


def fake_quant(x, dtype, granularity):
  """x [b, t, k, e] quantized then dequantized, one scale per `granularity`."""
  b, t, k, e = x.shape
  if granularity == 'block_head':
    y = jnp.moveaxis(x.reshape(b, t // BLOCK, BLOCK, k, e), 3, 2).reshape(b, t // BLOCK, k, -1)
    y = fake_quant_last(y, dtype)
    return jnp.moveaxis(y.reshape(b, t // BLOCK, k, BLOCK, e), 2, 3).reshape(x.shape)
  axes = GRANULARITIES[granularity]
  if axes == (-1,):
    return fake_quant_last(x, dtype)
  moved = jnp.moveaxis(x, axes, range(-len(axes), 0))
  shape = moved.shape
  y = fake_quant_last(moved.reshape(*shape[:-len(axes)], -1), dtype).reshape(shape)
  return jnp.moveaxis(y, range(-len(axes), 0), axes)


def fake_quant_last(x, dtype):
  q, s = kv_quant.quantize(x, dtype)
  return kv_quant.dequantize(q, s, x.dtype)


def simulated_perplexity(params, model_cfg, wins: np.ndarray, dtype, granularity) -> float:
  project = transformer.project_qkv

  def quantized_qkv(*args, **kwargs):
    q, k, v = project(*args, **kwargs)
    if dtype is None:
      return q, k, v
    return q, fake_quant(k, dtype, granularity), fake_quant(v, dtype, granularity)

  batch = {'inputs': jnp.asarray(wins[:, :-1]), 'targets': jnp.asarray(wins[:, 1:]),
           'weights': jnp.ones(wins[:, 1:].shape, jnp.float32)}
  with mock.patch.object(transformer, 'project_qkv', quantized_qkv):
    nll = jax.jit(lambda p, b: loss.summed_nll(p, b, model_cfg))(params, batch)
  return math.exp(float(nll) / wins[:, 1:].size)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--config', default='default.py:tiny')
  p.add_argument('--steps', type=int, default=300)
  p.add_argument('--eval-batches', type=int, default=8)
  p.add_argument('--workdir', default='')
  args = p.parse_args(argv)
  workdir = args.workdir or tempfile.mkdtemp(prefix='kv_ppl_')
  cfg = train(args.config, args.steps, workdir, args.eval_batches)
  served = load_checkpoint(workdir)
  params, model_cfg = served.params, served.model_cfg
  wins = windows(cfg)
  result = {'config': args.config, 'steps': args.steps, 'windows': list(wins.shape),
            'model_dtype': str(model_cfg.dtype), 'served': {}, 'simulated': {}}
  for name in FORMATS:
    result['served'][name] = served_perplexity(params, model_cfg, wins, name)
    print('served', name, result['served'][name], flush=True)
  result['simulated']['none'] = simulated_perplexity(params, model_cfg, wins, None, None)
  for name in FORMATS[1:]:
    for g in GRANULARITIES:
      key = f'{name}/{g}'
      result['simulated'][key] = simulated_perplexity(params, model_cfg, wins,
                                                      kv_quant.STORAGE[name], g)
      print('simulated', key, result['simulated'][key], flush=True)
  variant = args.config.replace('.py', '').replace(':', '_')
  write_result(f'kv_cache_perplexity_{variant}_cpu', result)
  return result


if __name__ == '__main__':
  main()
