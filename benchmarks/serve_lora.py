"""The cost of serving LoRA adapters: a batch mixing 4 adapters against the same batch on
the base alone (CPU).

  python -m benchmarks.serve_lora            # results/serve_lora_cpu.json (1-2 minutes)
  python -m benchmarks.serve_lora --smoke    # tiny shapes, prints, writes nothing

A random Llama-shaped model (byte vocabulary) and 4 random rank-R adapters on all seven
projections, written as PEFT directories (model.lora_peft) and loaded with
--lora-modules. Three settings, each an engine of its own, each run once untimed (its step shapes
compile), then --repeats timed passes of the same --batch requests interleaved across the
three (greedy, ignore_eos, no prefix cache):
  base:          the engine without --enable-lora (the plain step)
  lora_on_base:  --enable-lora, every request on the base (the slot arrays' rows all 0)
  lora_mixed:    --enable-lora, request i on adapter i % 4
Reported: median output tokens/s of each and their ratios to `base`. base and
lora_on_base must give the same tokens (checked).
"""

import argparse
import contextlib
import dataclasses
import statistics
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import write_result

SHAPES = {'full': dict(embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=4,
                       mlp_dim=768, max_seq_len=128),
          'smoke': dict(embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128,
                        max_seq_len=64)}
NUM_ADAPTERS = 4


def served_model(shape: str):
  # pylint: disable=import-outside-toplevel
  from model.config import ModelConfig
  from model.transformer import init_params
  from serve.load.hf_model import ServedModel
  from training.tokenizer import ByteTokenizer
  cfg = ModelConfig(vocab_size=ByteTokenizer.vocab_size + 7, tie_embeddings=False,
                    **SHAPES[shape])
  params = init_params(cfg, jax.random.key(0))
  return ServedModel(cfg, params, ByteTokenizer(), [ByteTokenizer.eos_id], None, 'bench')


def write_adapters(cfg, rank: int, root: str) -> dict[str, str]:
  # pylint: disable=import-outside-toplevel
  from model import lora
  from model.lora_peft import write_peft_adapter
  lcfg = lora.LoraConfig(rank=rank, alpha=2.0 * rank, targets=tuple(lora.TARGETS))
  out = {}
  for i in range(NUM_ADAPTERS):
    adapter = lora.init_adapter(cfg, lcfg, jax.random.key(i + 1))
    rng = np.random.default_rng(i)   # B random too: a zero B would add nothing
    adapter = jax.tree.map(lambda x, rng=rng: np.asarray(x) + rng.normal(
        0, 0.02, x.shape).astype(np.float32), adapter)
    out[f'adapter{i}'] = f'{root}/adapter{i}'
    write_peft_adapter(out[f'adapter{i}'], adapter, lcfg, cfg)
  return out


def engine_for(served, args, adapters=None):
  # pylint: disable=import-outside-toplevel
  from serve.config import ServeConfig
  from serve.engine.core import Engine
  lora = {} if adapters is None else dict(
      enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank,
      lora_modules=tuple(f'{n}={d}' for n, d in adapters.items()))
  cfg = ServeConfig(num_blocks=args.batch * 8 + 8, block_size=16, max_num_seqs=args.batch,
                    max_num_batched_tokens=args.batch * 8, enable_prefix_caching=False,
                    **lora)
  return Engine(dataclasses.replace(served), cfg)


def one_pass(engine, prompts, params, loras):
  """(output tokens/s, each request's tokens) of one pass over the batch."""
  start = time.perf_counter()
  streams = [engine.add_request(list(p), params, lora=lo, bounded=False)
             for p, lo in zip(prompts, loras)]
  results = [s.result() for s in streams]
  wall = time.perf_counter() - start
  return sum(len(r.token_ids) for r in results) / wall, [r.token_ids for r in results]


def benchmark(args) -> dict:
  """The three settings' engines side by side, their timed passes interleaved (base,
  lora_on_base, lora_mixed; then again), so a change in the machine's load falls on all
  of them alike; each engine's first pass compiles its step shapes, untimed."""
  from serve.sampling_params import SamplingParams  # pylint: disable=import-outside-toplevel
  served = served_model(args.shape)
  rng = np.random.default_rng(0)
  params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
    adapters = write_adapters(served.model_cfg, args.rank, root)
    names = list(adapters)
    settings = {'base': (None, [None] * args.batch),
                'lora_on_base': (adapters, [None] * args.batch),
                'lora_mixed': (adapters, [names[i % NUM_ADAPTERS] for i in range(args.batch)])}
    prompts = rng.integers(0, 256, (args.batch, args.prompt_len))   # the same for all
    engines, tokens, rates = {}, {}, {name: [] for name in settings}
    for name, (ads, loras) in settings.items():
      engines[name] = engine_for(served, args, ads)
      stack.callback(engines[name].shutdown)
      _, tokens[name] = one_pass(engines[name], prompts, params, loras)   # compiles
    for _ in range(args.repeats):
      for name, (_, loras) in settings.items():
        rate, tokens[name] = one_pass(engines[name], prompts, params, loras)
        rates[name].append(rate)
  if tokens['base'] != tokens['lora_on_base']:
    raise RuntimeError('--enable-lora changed the base model\'s greedy tokens.')
  rows = {name: {'output_tokens_per_s': statistics.median(r), 'passes': r}
          for name, r in rates.items()}
  for name, row in rows.items():
    row['vs_base'] = row['output_tokens_per_s'] / rows['base']['output_tokens_per_s']
    print(f"{name}: {row['output_tokens_per_s']:.1f} output tokens/s "
          f"({row['vs_base']:.2f}x base)", flush=True)
  return {'settings': rows, 'checked': 'base and lora_on_base gave the same greedy tokens',
          'order': 'passes interleaved across the three engines, median of --repeats'}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--smoke', action='store_true')
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--prompt-len', type=int, default=32)
  parser.add_argument('--max-tokens', type=int, default=32)
  parser.add_argument('--rank', type=int, default=16)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--note', default='', help='recorded in the JSON (e.g. the machine\'s load)')
  args = parser.parse_args(argv)
  args.shape = 'smoke' if args.smoke else 'full'
  if args.smoke:
    args.batch, args.prompt_len, args.max_tokens, args.rank, args.repeats = 4, 8, 4, 4, 1
  result = benchmark(args)
  result['shape'] = {**SHAPES[args.shape], 'batch': args.batch, 'prompt_len': args.prompt_len,
                     'max_tokens': args.max_tokens, 'rank': args.rank,
                     'adapters': NUM_ADAPTERS, 'targets': 'q k v o gate up down'}
  result['note'] = args.note
  if not args.smoke:
    print(write_result('serve_lora_cpu', result))
  return result


if __name__ == '__main__':
  main()
