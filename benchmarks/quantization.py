"""Quantized serving's accuracy and CPU speed: perplexity, greedy agreement, tokens/s per
weight format (--quantization) and KV cache format (--kv-cache-dtype).

  python -m benchmarks.quantization                      # trains runs/quant_default, writes
                                                         # results/quantization_cpu.json
  python -m benchmarks.quantization --checkpoint DIR     # a workdir trained with evaluation on
  python -m benchmarks.quantization --smoke              # tiny model, prints, writes nothing

The model is configs/default.py after its 300 steps, trained here with evaluation on, so
the last eval.batches x data.batch_size windows of the default corpus (Python standard
library sources) are held out of training (training/data.py): the perplexity is the
served model's on those windows, each a prompt whose every token is scored by the engine
(prompt_logprobs), so the KV cache's format counts as much as the weights'. Greedy
agreement: the tokens each format generates for a fixed set of standard-library snippets,
against the unquantized model's, counted up to the first difference. Output tokens/s: the
same requests all at once, after a warm-up pass (compiles excluded), the median of
--repeats passes interleaved between formats.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time

import numpy as np

from benchmarks.common import write_result
from benchmarks.spec_decode import stdlib_snippets

WEIGHTS = ('none', 'int8', 'fp8')


def train(workdir: str, variant: str = '') -> str:
  """configs/default.py[:variant] trained with evaluation on (its held-out windows left out
  of training); returns the workdir."""
  # pylint: disable=import-outside-toplevel
  from training import trainer
  from training.cli import load_config_file
  cfg = load_config_file(f'default.py:{variant}' if variant else 'default.py')
  cfg.workdir, cfg.eval.every_steps = workdir, cfg.steps
  cfg.sample.num_tokens, cfg.metrics.progress_bar = 0, False
  trainer.train(cfg)
  return workdir


def held_out_windows(workdir: str) -> list[list[int]]:
  """The evaluation windows of a train.py run, each seq_len + 1 tokens; SystemExit if the
  run trained on them (evaluation off)."""
  # pylint: disable=import-outside-toplevel
  from training import data
  from training.cli import load_config_file
  with open(os.path.join(workdir, 'config.json')) as f:
    raw = json.load(f)
  if not raw.get('eval', {}).get('every_steps'):
    raise SystemExit(f'{workdir} was trained with evaluation off: it trained on every '
                     'window. Train with --config.eval.every_steps=N (or let this benchmark '
                     'train, without --checkpoint).')
  cfg = load_config_file('default.py')
  for section in ('data', 'eval'):
    for key, value in raw[section].items():
      setattr(getattr(cfg, section), key, value)
  windows = []
  for batch in data.make_eval_batches(cfg):
    for inputs, targets in zip(batch['inputs'], batch['targets']):
      windows.append([int(t) for t in inputs] + [int(targets[-1])])
  return windows


def perplexity(engine, windows) -> float:
  """exp(mean negative log-likelihood) of every token of each window after its first."""
  from serve.sampling_params import SamplingParams  # pylint: disable=import-outside-toplevel
  params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
  results = engine.generate(windows, [params] * len(windows))
  nll = [-lp.logprob for r in results for lp in r.prompt_logprobs if lp is not None]
  return math.exp(statistics.fmean(nll))


def agreement(tokens, reference) -> dict:
  """Tokens equal to the reference's before each request's first difference."""
  same = []
  for got, want in zip(tokens, reference):
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    same.append(n)
  total = sum(len(w) for w in reference)
  return {'tokens_before_first_difference': sum(same), 'of_tokens': total,
          'fraction': sum(same) / total,
          'identical_requests': sum(n == len(w) for n, w in zip(same, reference))}


def serve_config(args, weights: str, kv: str, num_blocks: int = 0):
  """The ServeConfig of one format; SystemExit where this checkout's engine has no
  --kv-cache-dtype."""
  from serve.config import ServeConfig  # pylint: disable=import-outside-toplevel
  fields = {f.name for f in dataclasses.fields(ServeConfig)}
  extra = {}
  if kv != 'auto':
    if 'kv_cache_dtype' not in fields:
      raise SystemExit(f'--kv-cache-dtypes {kv}: this checkout\'s engine has no '
                       '--kv-cache-dtype yet; run with auto.')
    extra['kv_cache_dtype'] = kv
  # Every format's engine is alive at once (their passes interleave): each gets
  # num_blocks, not a fraction of the memory the others left.
  return ServeConfig(max_num_seqs=args.batch, max_num_batched_tokens=args.batch_tokens,
                     quantization=weights, num_blocks=num_blocks,
                     warmup=not args.smoke and args.shapes != '1b', **extra)


def timed_pass(engine, prompts, params):
  start = time.perf_counter()
  results = engine.generate(prompts, [params] * len(prompts))
  wall = time.perf_counter() - start
  return sum(len(r.token_ids) for r in results) / wall, [r.token_ids for r in results]


def benchmark(served, args, windows, prompts) -> dict:
  """Every format's perplexity on `windows` (None: not measured), greedy tokens and
  output tokens/s on `prompts`."""
  # pylint: disable=import-outside-toplevel
  from serve.engine.core import Engine
  from serve.sampling_params import SamplingParams
  greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
  formats = [(w, kv) for w in args.weights.split(',') for kv in args.kv_cache_dtypes.split(',')]
  longest = max(len(p) for p in prompts + (windows or [])) + args.max_tokens
  blocks = args.batch * math.ceil(longest / 16) + 1
  engines = {f: Engine(served, serve_config(args, *f, blocks)) for f in formats}
  rows = {f'{w}/{kv}': {'weights': w, 'kv_cache': kv, 'passes_tokens_per_s': []}
          for w, kv in formats}
  try:
    for f, engine in engines.items():
      row = rows['/'.join(f)]
      row['perplexity'] = perplexity(engine, windows) if windows else None
      row['tokens'] = timed_pass(engine, prompts, greedy)[1]   # also the warm-up pass
    order = list(engines)
    for _ in range(args.repeats):
      for f in order:
        rows['/'.join(f)]['passes_tokens_per_s'].append(timed_pass(engines[f], prompts,
                                                                   greedy)[0])
      order.reverse()   # who goes first alternates
  finally:
    for engine in engines.values():
      engine.shutdown()
  base = rows['none/auto']
  for row in rows.values():
    row['tokens_per_s'] = statistics.median(row['passes_tokens_per_s'])
    row['speed_vs_unquantized'] = row['tokens_per_s'] / base['tokens_per_s']
    row['perplexity_vs_unquantized'] = (row['perplexity'] / base['perplexity'] - 1
                                        if windows else None)
    row['greedy_agreement'] = agreement(row['tokens'], base['tokens'])
  for row in rows.values():
    del row['tokens']
  held_out = {'held_out_windows': len(windows), 'window_tokens': len(windows[0]),
              'scored_tokens': len(windows) * (len(windows[0]) - 1)} if windows else {}
  return {**held_out, 'num_prompts': len(prompts), 'prompt_tokens': sum(map(len, prompts)),
          'max_tokens': args.max_tokens, 'batch': args.batch, 'repeats': args.repeats,
          'results': rows, 'load_average': os.getloadavg()}


def trained_model(args, tmp: str):
  """(the served model, held-out windows, snippet prompts) of configs/default.py."""
  from serve.load.checkpoint import load_checkpoint  # pylint: disable=import-outside-toplevel
  if args.smoke:
    args.checkpoint = args.checkpoint or train(os.path.join(tmp, 'run'), 'tiny')
    args.windows, args.num_prompts, args.prompt_chars, args.max_tokens = 4, 3, 16, 8
    args.batch, args.repeats = 4, 1
  elif args.checkpoint is None:
    args.checkpoint = 'runs/quant_default'
    if not os.path.isdir(args.checkpoint):
      train(args.checkpoint)
  served = load_checkpoint(args.checkpoint)
  windows = held_out_windows(args.checkpoint)[:args.windows or None]
  prompts = [served.tokenizer.encode(t).tolist()
             for t in stdlib_snippets(args.num_prompts, args.prompt_chars, args.seed)]
  return served, windows, prompts


def llama_1b(args, tmp: str):
  """(a random Llama-3.2-1B-shaped model in bfloat16, no windows, random prompts of
  --prompt-chars tokens): speed only, on a GPU."""
  # pylint: disable=import-outside-toplevel
  from benchmarks.serve_throughput import LLAMA_1B, build_hf_model
  from serve.load.hf_model import load_hf_model
  build_hf_model(LLAMA_1B, tmp)
  rng = np.random.default_rng(args.seed)
  prompts = [rng.integers(4, LLAMA_1B.vocab, args.prompt_chars).tolist()
             for _ in range(args.num_prompts)]
  return load_hf_model(tmp), None, prompts


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--checkpoint', default=None, metavar='DIR',
                      help='a train.py workdir trained with evaluation on (default: train '
                      'configs/default.py into runs/quant_default, or reuse it)')
  parser.add_argument('--weights', default=','.join(WEIGHTS),
                      help='comma-separated --quantization formats (none: the model dtype)')
  parser.add_argument('--kv-cache-dtypes', default='auto',
                      help='comma-separated --kv-cache-dtype formats (auto: the model dtype)')
  parser.add_argument('--shapes', choices=('default', '1b'), default='default',
                      help='default: configs/default.py trained (accuracy and CPU speed); '
                      '1b: a random Llama-3.2-1B-shaped model in bfloat16 (speed only, '
                      'for a GPU: results/quantization_1b_gpu.json)')
  parser.add_argument('--windows', type=int, default=0, help='held-out windows (0: all)')
  parser.add_argument('--num-prompts', type=int, default=16)
  parser.add_argument('--prompt-chars', type=int, default=64)
  parser.add_argument('--max-tokens', type=int, default=64)
  parser.add_argument('--batch', type=int, default=16, help='max_num_seqs')
  parser.add_argument('--batch-tokens', type=int, default=512, help='max_num_batched_tokens')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--name', default=None,
                      help='result file name (default quantization_cpu, or _1b_gpu)')
  parser.add_argument('--smoke', action='store_true',
                      help='the tiny model trained here, small sizes; prints, writes nothing')
  return parser.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    served, windows, prompts = (llama_1b if args.shapes == '1b' else trained_model)(args, tmp)
    cfg = served.model_cfg
    result = {'checkpoint': 'smoke' if args.smoke else args.checkpoint or args.shapes,
              'model': {'num_layers': cfg.num_layers, 'embed_dim': cfg.embed_dim,
                        'num_heads': cfg.num_heads, 'num_kv_heads': cfg.num_kv_heads,
                        'mlp_dim': cfg.resolved_mlp_dim, 'vocab_size': cfg.vocab_size,
                        'dtype': cfg.dtype},
              'note': 'tokens/s on a machine shared with other jobs (see load_average)',
              **benchmark(served, args, windows, prompts)}
  for name, row in result['results'].items():
    agree = row['greedy_agreement']
    ppl = (f'perplexity {row["perplexity"]:.4f} ({row["perplexity_vs_unquantized"]:+.2%})'
           if row['perplexity'] else '')
    print(f'{name:12s} {ppl}  greedy {agree["fraction"]:.1%} ({agree["identical_requests"]}/'
          f'{result["num_prompts"]} identical)  {row["tokens_per_s"]:7.1f} tokens/s '
          f'x{row["speed_vs_unquantized"]:.2f}')
  if not args.smoke:
    device = 'gpu' if args.shapes == '1b' else 'cpu'
    name = args.name or f'quantization_{args.shapes}_{device}'.replace('default_', '')
    print('wrote', write_result(name, result))
  return result


if __name__ == '__main__':
  main()
