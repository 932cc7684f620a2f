"""Speculative decoding by n-gram lookup: output tokens/s with and without drafts, greedy.

  python train.py --config=default.py                        # runs/default (minutes)
  python -m benchmarks.spec_decode --checkpoint runs/default  # results/spec_decode_cpu.json
  python -m benchmarks.spec_decode --smoke                    # tiny model, prints, writes nothing

The model continues snippets of Python standard-library sources (seeded picks, each
starting at a line), the default corpus it was trained on; n-gram drafts come only from
each request's own prompt and output. Every engine is warmed up (no compile is timed),
then each setting (plain decoding and the --speculative-config variants) is timed
`--repeats` times, interleaved, with the requests one at a time (latency: where drafts
help) and all at once (a batch of --batch requests). Greedy, so every setting must give
plain decoding's tokens: checked, and the run fails if not. Reported: median output
tokens/s, the drafts' acceptance and the model steps each setting took.
"""

import argparse
import json
import os
import statistics
import sysconfig
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import write_result

SETTINGS = {'plain': '',
            'ngram_k2': '{"method": "ngram", "num_speculative_tokens": 2}',
            'ngram_k4': '{"method": "ngram", "num_speculative_tokens": 4}'}


def stdlib_snippets(num: int, length: int, seed: int) -> list[str]:
  """num snippets of `length` characters of the standard library's .py files, each from
  a line start in a file picked at random (files of at least 4 * length characters)."""
  root = sysconfig.get_paths()['stdlib']
  paths = sorted(os.path.join(d, f) for d, dirs, files in os.walk(root)
                 if 'site-packages' not in d and '__pycache__' not in d
                 for f in files if f.endswith('.py'))
  rng, out = np.random.default_rng(seed), []
  while len(out) < num:
    with open(paths[int(rng.integers(len(paths)))], encoding='utf-8', errors='replace') as f:
      text = f.read()
    if len(text) < 4 * length or not text.isascii():
      continue
    starts = [i + 1 for i, c in enumerate(text[:len(text) - 2 * length]) if c == '\n']
    if starts:
      start = starts[int(rng.integers(len(starts)))]
      out.append(text[start:start + length])
  return out


def run_pass(engine, prompts, params, together: bool):
  """One timed pass: (numbers, each request's tokens)."""
  before = engine.stats()
  start = time.perf_counter()
  if together:
    results = engine.generate(prompts, params)
  else:
    results = [engine.generate([p], params)[0] for p in prompts]
  wall = time.perf_counter() - start
  after = engine.stats()
  tokens = sum(len(r.token_ids) for r in results)
  drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
  drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
  accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
  return {'wall_s': wall, 'output_tokens': tokens, 'tokens_per_s': tokens / wall,
          'drafts': drafts, 'draft_tokens': drafted, 'accepted_tokens': accepted,
          # one token per request per step, plus the accepted drafts
          'request_steps': tokens - accepted}, [r.token_ids for r in results]


def benchmark(served, args) -> dict:
  # pylint: disable=import-outside-toplevel
  from serve.config import ServeConfig
  from serve.engine.core import Engine
  from serve.sampling_params import SamplingParams
  texts = stdlib_snippets(args.num_prompts, args.prompt_chars, args.seed)
  prompts = [served.tokenizer.encode(t).tolist() for t in texts]
  params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
  engines = {}
  for name, spec in SETTINGS.items():
    # Warm-up compiles every step shape, so no timed pass compiles (smoke: untimed).
    cfg = ServeConfig(max_num_seqs=args.batch, max_num_batched_tokens=args.batch * 8,
                      warmup=not args.smoke, speculative_config=spec)
    engines[name] = Engine(served, cfg)
  rows, outputs = {}, {}
  try:
    for mode, together in (('one_at_a_time', False), ('batch', True)):
      passes = {name: [] for name in SETTINGS}
      names = list(SETTINGS)
      for _ in range(args.repeats + 1):   # the first pass of each is a warm-up, not kept
        for name in names:
          numbers, tokens = run_pass(engines[name], prompts, params, together)
          passes[name].append(numbers)
          outputs.setdefault(mode, {}).setdefault(name, tokens)
          if tokens != outputs[mode]['plain']:
            raise AssertionError(f'{name} ({mode}) gave other tokens than plain decoding')
        names.reverse()   # who goes first alternates
      rows[mode] = {}
      for name, kept in passes.items():
        kept = kept[1:]
        last = kept[-1]
        rows[mode][name] = {
            'tokens_per_s': statistics.median(p['tokens_per_s'] for p in kept),
            'acceptance': last['accepted_tokens'] / last['draft_tokens']
            if last['draft_tokens'] else None,
            'tokens_per_draft_step': 1 + last['accepted_tokens'] / last['drafts']
            if last['drafts'] else None,
            'request_steps': last['request_steps'], 'passes': kept}
      plain = rows[mode]['plain']['tokens_per_s']
      for name in SETTINGS:
        rows[mode][name]['speedup'] = rows[mode][name]['tokens_per_s'] / plain
  finally:
    for engine in engines.values():
      engine.shutdown()
  return {'settings': SETTINGS, 'num_prompts': len(prompts),
          'prompt_tokens': [len(p) for p in prompts], 'max_tokens': args.max_tokens,
          'batch': args.batch, 'repeats': args.repeats, 'results': rows,
          'greedy_tokens_equal': True, 'load_average': os.getloadavg()}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--checkpoint', default=None, metavar='DIR',
                      help='a train.py workdir (default: runs/default; with --smoke the '
                      'tiny model, trained here)')
  parser.add_argument('--num-prompts', type=int, default=16)
  parser.add_argument('--prompt-chars', type=int, default=96)
  parser.add_argument('--max-tokens', type=int, default=128)
  parser.add_argument('--batch', type=int, default=16, help='max_num_seqs')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--smoke', action='store_true',
                      help='the tiny model trained here, small sizes; prints, writes nothing')
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  # pylint: disable=import-outside-toplevel
  from serve.load.checkpoint import load_checkpoint
  with tempfile.TemporaryDirectory() as tmp:
    if args.smoke:
      if args.checkpoint is None:
        from benchmarks.serve_load import train_tiny
        args.checkpoint = train_tiny(tmp)
      args.num_prompts, args.prompt_chars, args.max_tokens = 3, 16, 24
      args.batch, args.repeats = 4, 1
    args.checkpoint = args.checkpoint or 'runs/default'
    if not os.path.isdir(args.checkpoint):
      raise SystemExit(f'--checkpoint {args.checkpoint}: no such workdir; train one first '
                       '(python train.py --config=default.py writes runs/default).')
    served = load_checkpoint(args.checkpoint)
    if args.prompt_chars + args.max_tokens > served.model_cfg.max_seq_len:
      raise SystemExit(f'--prompt-chars + --max-tokens = {args.prompt_chars + args.max_tokens}'
                       f' exceeds the model\'s context of {served.model_cfg.max_seq_len}.')
    cfg = served.model_cfg
    result = {'checkpoint': 'smoke' if args.smoke else args.checkpoint,
              'model': {'num_layers': cfg.num_layers, 'embed_dim': cfg.embed_dim,
                        'num_heads': cfg.num_heads, 'num_kv_heads': cfg.num_kv_heads,
                        'vocab_size': cfg.vocab_size, 'dtype': str(cfg.dtype),
                        'num_params': int(sum(x.size for x in jax.tree.leaves(served.params)))},
              **benchmark(served, args)}
  for mode, settings in result['results'].items():
    for name, row in settings.items():
      acc = row['acceptance']
      print(f'{mode:14s} {name:9s} {row["tokens_per_s"]:8.1f} tokens/s  x{row["speedup"]:.2f}  '
            f'steps {row["request_steps"]:5d}' + (f'  accepted {acc:.1%}' if acc else ''))
  if args.smoke:
    print(json.dumps(result)[:2000])
  else:
    print('wrote', write_result('spec_decode_cpu', result))
  return result


if __name__ == '__main__':
  main()
