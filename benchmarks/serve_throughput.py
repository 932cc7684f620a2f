"""Offline generation throughput: meshlm continuous batching vs one request at a time vs
`transformers` generate with static batches, on the same weights and prompts.

  python -m benchmarks.serve_throughput            # writes results/serve_throughput_cpu.json
  python -m benchmarks.serve_throughput --smoke    # tiny sizes, prints JSON, writes nothing
  python -m benchmarks.serve_throughput --shapes=1b    # on a GPU: serve_throughput_1b_gpu.json
  python -m benchmarks.serve_throughput --shapes=long \
      --llama-server=BUILD/bin/llama-server --llama-converter=SRC/convert_hf_to_gguf.py

A HF-shaped Llama with random weights is built with transformers, saved with
save_pretrained and loaded into meshlm with serve.load.hf_model.load_hf_model, so both run
identical weights, in the preset's dtype: the default preset is a small float32 model for
this CPU; `1b` is Llama-3.2-1B's shape (1.24B parameters, tied embeddings) in bfloat16,
with transformers on the GPU when torch sees one (on the CPU otherwise). Prompts are random token ids with random input and output lengths
(fixed seed); ignore_eos holds every output to its asked length. Output tokens/s counts
the asked tokens only: a static batch also computes tokens past a row's own length until
its longest row is done, which is the cost continuous batching removes.

Both sides are warmed up on the first static batch, then timed `--repeats` times (3),
interleaved, the side that goes first rotating; the reported rates are the medians and
every pass is in the JSON's `passes`: on the shared 2-core machine a neighbour's load
moves single runs by 10-20%.

`long` (prompts of 32-256 tokens, outputs of 32-128, 192 requests) also times each side
on its first 64 requests, for the marginal rate: (output tokens of all requests - those
of the first 64) / (seconds of all - seconds of the first 64), per pass, then the
median. Start-up of a run, the first batch's fill and the last one's drain are in both
runs and cancel; what is left is the steady state, which is what serving lives in.
With --llama-server and --llama-converter, llama.cpp's server is a third side
(benchmarks/llama_server.py): the same weights as GGUF, batch_size slots, a thread per
core, the requests sent concurrently as token ids, greedy, eos ignored.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import environment, write_result
from serve.config import ATTENTION_CHOICES
from sharding import compile_cache


@dataclasses.dataclass
class Shapes:
  hidden: int = 384
  layers: int = 6
  heads: int = 6
  kv_heads: int = 2
  intermediate: int = 1024
  vocab: int = 4096
  num_requests: int = 32
  input_len: tuple[int, int] = (16, 128)
  output_len: tuple[int, int] = (8, 96)
  batch_size: int = 16            # transformers' static batch = meshlm's max_num_seqs
  max_batched_tokens: int = 512   # meshlm's token budget per step
  max_model_len: int = 512
  seed: int = 0
  tie_embeddings: bool = False
  dtype: str = 'float32'          # weights and activations, on both sides
  one_at_a_time: int = 0          # requests timed one at a time; 0: all of them
  # > 0: also time the first `marginal_from` requests alone, for the marginal rate (the
  # extra output tokens of the whole workload over the extra seconds they take)
  marginal_from: int = 0


SMOKE = Shapes(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=300,
               num_requests=6, input_len=(4, 20), output_len=(2, 10), batch_size=4,
               max_batched_tokens=32, max_model_len=64, tie_embeddings=True,
               one_at_a_time=3, marginal_from=4)
# Llama-3.2-1B's shape (its config.json), random weights; a GPU's workload: 256 requests,
# static batches of 64, 16 of them also one at a time (all would take minutes).
LLAMA_1B = Shapes(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192,
                  vocab=128256, tie_embeddings=True, dtype='bfloat16', num_requests=256,
                  input_len=(32, 512), output_len=(32, 512), batch_size=64,
                  max_batched_tokens=2048, max_model_len=1024, one_at_a_time=16)
# Longer prompts (issue 36, point 8): a 4-layer 256-wide model, prompts of 32-256 tokens,
# 192 requests and their first 64, for the marginal rate.
LONG = Shapes(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, num_requests=192,
              input_len=(32, 256), output_len=(32, 128), one_at_a_time=16, marginal_from=64)
PRESETS = {'small': Shapes(), '1b': LLAMA_1B, 'smoke': SMOKE, 'long': LONG}


def num_params(shapes: Shapes) -> int:
  """Parameters of the preset's LlamaForCausalLM, counted from its shapes."""
  d, e = shapes.hidden, shapes.hidden // shapes.heads
  attention = 2 * d * d + 2 * d * shapes.kv_heads * e
  layer = attention + 3 * d * shapes.intermediate + 2 * d
  heads = 1 if shapes.tie_embeddings else 2
  return shapes.layers * layer + heads * shapes.vocab * d + d


def build_hf_model(shapes: Shapes, path: str) -> None:
  """A random LlamaForCausalLM and a WordLevel tokenizer.json saved under path."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(shapes.seed)
  config = transformers.LlamaConfig(
      vocab_size=shapes.vocab, hidden_size=shapes.hidden, intermediate_size=shapes.intermediate,
      num_hidden_layers=shapes.layers, num_attention_heads=shapes.heads,
      num_key_value_heads=shapes.kv_heads, max_position_embeddings=shapes.max_model_len,
      bos_token_id=1, eos_token_id=2, pad_token_id=0,
      tie_word_embeddings=shapes.tie_embeddings,
      initializer_range=0.2)   # sharp logits: greedy ties cannot blur the agreement check
  hf = transformers.LlamaForCausalLM(config)
  assert hf.num_parameters() == num_params(shapes), (hf.num_parameters(), num_params(shapes))
  hf.to(getattr(torch, shapes.dtype)).save_pretrained(path)
  vocab = {'<pad>': 0, '<s>': 1, '</s>': 2, '<unk>': 3}
  vocab.update({f'w{i}': i for i in range(4, shapes.vocab)})
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece()   # joins words with spaces
  tok.save(os.path.join(path, 'tokenizer.json'))
  with open(os.path.join(path, 'tokenizer_config.json'), 'w') as f:
    json.dump({'eos_token': '</s>', 'bos_token': '<s>', 'pad_token': '<pad>'}, f)


def workload(shapes: Shapes) -> tuple[list[list[int]], list[int]]:
  rng = np.random.default_rng(shapes.seed)
  ins = rng.integers(shapes.input_len[0], shapes.input_len[1] + 1, shapes.num_requests)
  outs = rng.integers(shapes.output_len[0], shapes.output_len[1] + 1, shapes.num_requests)
  prompts = [rng.integers(4, shapes.vocab, n).tolist() for n in ins]
  return prompts, [int(n) for n in outs]


def _params(out_lens):
  from serve.sampling_params import SamplingParams  # pylint: disable=import-outside-toplevel
  return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]


@contextlib.contextmanager
def meshlm_engine(path: str, shapes: Shapes, attention: str = 'auto'):
  """The engine on the HF directory's weights, compiled and warmed up."""
  # pylint: disable=import-outside-toplevel
  from serve.config import ServeConfig
  from serve.engine.core import Engine
  from serve.load.hf_model import load_hf_model
  served = load_hf_model(path)   # in the dtype the directory was saved in
  assert served.model_cfg.dtype == shapes.dtype
  # No prefix caching: the one-at-a-time pass reruns the prompts and must not find them.
  cfg = ServeConfig(num_blocks=shapes.num_requests * 20, max_num_seqs=shapes.batch_size,
                    max_num_batched_tokens=shapes.max_batched_tokens,
                    max_model_len=shapes.max_model_len, attention=attention,
                    enable_prefix_caching=False, warmup=True)
  with Engine(served, cfg) as engine:
    yield engine


def time_meshlm(engine, prompts, out_lens) -> tuple[float, list]:
  """Continuous batching: every request submitted at once."""
  start = time.perf_counter()
  results = engine.generate(prompts, _params(out_lens))
  seconds = time.perf_counter() - start
  assert [len(r.token_ids) for r in results] == out_lens
  return seconds, [r.token_ids for r in results]


def time_one_at_a_time(engine, prompts, out_lens) -> tuple[float, list]:
  start = time.perf_counter()
  results = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, _params(out_lens))]
  return time.perf_counter() - start, [r.token_ids for r in results]


def profile_steps(engine, prompts, out_lens) -> dict:
  """Where continuous batching's time goes: the workload once more (after the timed
  runs, so the timing is not disturbed), each model step waited for and filed by its
  token bucket and kind (decode only, or with prefill chunks)."""
  # pylint: disable=import-outside-toplevel
  import jax
  from serve.worker.model_runner import token_buckets
  buckets, real, steps = token_buckets(engine.runner.cfg), engine.runner.step, {}

  def timed(out):
    start = time.perf_counter()
    res = real(out)
    jax.block_until_ready(res.logits)
    tokens = sum(len(c.token_ids) for c in out.chunks)
    key = f'{next(b for b in buckets if b >= tokens)}_' + (
        'decode' if tokens == len(out.chunks) else 'mixed')
    entry = steps.setdefault(key, {'steps': 0, 'seconds': 0.0, 'tokens': 0})
    entry['steps'] += 1
    entry['seconds'] += time.perf_counter() - start
    entry['tokens'] += tokens
    return res

  engine.runner.step = timed
  try:
    start = time.perf_counter()
    engine.generate(prompts, _params(out_lens))
    wall = time.perf_counter() - start
  finally:
    del engine.runner.step   # the instance attribute; the method is back
  in_steps = sum(e['seconds'] for e in steps.values())
  for e in steps.values():
    e['ms_per_step'] = 1e3 * e['seconds'] / e['steps']
    e['share_of_wall'] = e['seconds'] / wall
  return {'wall_s': wall, 'in_model_steps_s': in_steps, 'outside_steps_s': wall - in_steps,
          'by_bucket': dict(sorted(steps.items(), key=lambda kv: -kv[1]['seconds']))}


def load_transformers(path: str, prompts, shapes: Shapes):
  """LlamaForCausalLM on the same weights, on the GPU if torch sees one, else on the CPU
  with torch's thread count chosen; warmed up."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  hf = transformers.LlamaForCausalLM.from_pretrained(
      path, dtype=getattr(torch, shapes.dtype)).eval()
  # ignore_eos as vLLM means it: eos may be drawn and does not stop (min_new_tokens would
  # forbid drawing it).
  hf.generation_config.eos_token_id = None
  if torch.cuda.is_available():
    hf, threads = hf.to('cuda'), None
  else:
    threads = _fastest_threads(hf, prompts[:shapes.batch_size])
  _hf_batch(hf, prompts[:shapes.batch_size], 8)   # warm-up
  return hf, threads


def static_batches(shapes: Shapes, num: int) -> list[range]:
  """Batches of batch_size requests in arrival order."""
  return [range(i, min(i + shapes.batch_size, num)) for i in range(0, num, shapes.batch_size)]


def time_transformers(hf, shapes: Shapes, prompts, out_lens) -> tuple[float, list]:
  """Static batches, left-padded, each run to its longest output."""
  start = time.perf_counter()
  outputs = [_hf_batch(hf, [prompts[i] for i in b], max(out_lens[i] for i in b))
             for b in static_batches(shapes, len(prompts))]
  seconds = time.perf_counter() - start
  rows = [row for out in outputs for row in out]
  return seconds, [row[:n] for row, n in zip(rows, out_lens)]


def _fastest_threads(hf, prompts) -> int:
  """Sets torch to the thread count (1 or all cores) that decodes a probe batch fastest:
  on a loaded machine, torch's spinning worker threads can cost more than they give."""
  import torch  # pylint: disable=import-outside-toplevel
  times = {}
  for threads in sorted({1, os.cpu_count() or 1}):
    torch.set_num_threads(threads)
    _hf_batch(hf, prompts, 4)
    start = time.perf_counter()
    _hf_batch(hf, prompts, 16)
    times[threads] = time.perf_counter() - start
  best = min(times, key=times.get)
  torch.set_num_threads(best)
  return best


def _hf_batch(hf, prompts, num_tokens: int) -> list[list[int]]:
  import torch  # pylint: disable=import-outside-toplevel
  width = max(len(p) for p in prompts)
  ids = torch.zeros((len(prompts), width), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
  with torch.no_grad():
    out = hf.generate(input_ids=ids.to(hf.device), attention_mask=mask.to(hf.device),
                      max_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
  assert out.shape[1] == width + num_tokens, 'transformers stopped early'
  return out[:, width:].tolist()


def float32_first_tokens(path: str, prompts, device) -> list[int]:
  """Each prompt's greedy next token from the same weights in float32 (transformers, one
  prompt at a time, no padding): the reference that tells a bfloat16 run's rounding
  (near-ties flipped) from a bug."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
  ref = ref.eval().to(device)
  with torch.no_grad():
    tokens = [int(ref(torch.tensor([p], device=device)).logits[0, -1].argmax())
              for p in prompts]
  del ref
  return tokens


def prefix_agreement(outputs, others) -> dict:
  """Pairs of greedy outputs: the share whose first token agrees, and the mean share of
  each output before the first token that differs."""
  def common(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
  pairs = list(zip(outputs, others))
  return {'first_token': sum(a[:1] == b[:1] for a, b in pairs) / len(pairs),
          'mean_common_prefix': statistics.mean(common(a, b) / max(len(a), 1)
                                                 for a, b in pairs)}


def agreement(batched, single, peer, reference) -> dict:
  """How the greedy outputs agree: continuous batching's (`batched`), one at a time's
  (`single`, the first requests only), transformers' (`peer`), and the float32
  reference's first tokens (`reference`, one-token lists)."""
  return {
      'greedy_agrees': {'batched_vs_one_at_a_time': batched[:len(single)] == single,
                        'requests_equal_to_transformers': sum(
                            a == b for a, b in zip(batched, peer))},
      # How far outputs agree where they are not equal: in bfloat16 a batch's shape and
      # the two libraries' kernels round differently, and one flipped near-tie changes
      # the rest of a greedy output, so a wrong first token (the prefill's logits alone)
      # points to a bug and a late split to rounding.
      'greedy_prefix': {'batched_vs_one_at_a_time': prefix_agreement(batched, single),
                        'batched_vs_transformers': prefix_agreement(batched, peer)},
      # Each side's first tokens against the float32 reference's: in bfloat16 both miss
      # some near-ties; a bug falls far behind the other side.
      'first_token_vs_float32': {
          'meshlm': prefix_agreement(batched, reference)['first_token'],
          'transformers': prefix_agreement(peer, reference)['first_token']},
  }


def start_again(path: str, shapes: Shapes, attention: str) -> dict:
  """A second engine, as a restart would build it: its step programs come from the
  persistent compilation cache the first one filled (the sampler's, in one process,
  from jax's own in-memory cache)."""
  start, hits = time.perf_counter(), compile_cache.hits()
  with meshlm_engine(path, shapes, attention):
    return {'again_s': time.perf_counter() - start,
            'again_programs_from_cache': compile_cache.hits() - hits,
            'cache_dir': jax.config.jax_compilation_cache_dir}


def timed_sides(shapes: Shapes, engine, hf, prompts, out_lens, peer_url=None) -> dict:
  """name -> a callable timing that side once: (seconds, outputs). With marginal_from,
  each side also on the first marginal_from requests alone (`<name>_first`)."""
  from benchmarks import llama_server  # pylint: disable=import-outside-toplevel
  runs = {'continuous': lambda p, o: time_meshlm(engine, p, o),
          'static': lambda p, o: time_transformers(hf, shapes, p, o)}
  if peer_url is not None:
    runs['llama_cpp'] = lambda p, o: llama_server.time_requests(peer_url, p, o,
                                                                shapes.batch_size)
  sides = {name: (lambda run=run: run(prompts, out_lens)) for name, run in runs.items()}
  m = shapes.marginal_from
  if m:
    sides.update({f'{name}_first': (lambda run=run: run(prompts[:m], out_lens[:m]))
                  for name, run in runs.items()})
  return sides


def interleaved(sides: dict, repeats: int) -> tuple[list[dict], dict]:
  """`repeats` passes over every side, the order rotating each pass (a neighbour's load
  on the shared machine hits every side alike); each pass's seconds, and each side's
  outputs of the last pass."""
  names, passes, outputs = list(sides), [], {}
  for i in range(repeats):
    order = names[i % len(names):] + names[:i % len(names)]
    seconds = {}
    for name in order:
      seconds[f'{name}_s'], outputs[name] = sides[name]()
    passes.append(seconds)
  return passes, outputs


def rates(passes: list[dict], names, prompts_tokens: int, first_tokens: int) -> tuple:
  """Median seconds per side, its output tokens/s, and (with `_first` sides) the marginal
  rate: the tokens the whole workload adds over its first requests, over the seconds it
  adds (per pass, then the median), which leaves out what both share: start-up of a run,
  the first batch's fill and the last one's drain."""
  median = lambda key: statistics.median(p[key] for p in passes)  # noqa: E731
  seconds = {f'{n}_s': median(f'{n}_s') for n in names}
  per_s = {n: prompts_tokens / seconds[f'{n}_s'] for n in names}
  marginal = {}
  if first_tokens:
    for n in names:
      extra_s = statistics.median(p[f'{n}_s'] - p[f'{n}_first_s'] for p in passes)
      # None: the whole workload took no longer than its first requests (noise swamps a
      # tiny run's difference), so there is no rate to report
      marginal[n] = (prompts_tokens - first_tokens) / extra_s if extra_s > 0 else None
  return seconds, per_s, marginal


def benchmark(shapes: Shapes, repeats: int = 3, attention: str = 'auto',
              llama: tuple[str | None, str | None] = (None, None)) -> dict:
  """`repeats` timed passes of continuous batching, of transformers' static batches and
  (given llama = (server, converter)) of llama.cpp's server, interleaved; the rates are
  the medians, every pass is kept. One request at a time runs once, over the first
  `shapes.one_at_a_time` requests (0: all)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from benchmarks import llama_server  # pylint: disable=import-outside-toplevel
  prompts, out_lens = workload(shapes)
  peer_note = llama_server.missing(*llama)
  with tempfile.TemporaryDirectory() as path, contextlib.ExitStack() as stack:
    build_hf_model(shapes, path)
    peer_url = None
    if peer_note is None:
      gguf = os.path.join(path, 'model.gguf')
      llama_server.convert(llama[1], path, gguf, shapes.dtype)
      peer_url = stack.enter_context(llama_server.serve(
          llama[0], gguf, slots=shapes.batch_size, threads=os.cpu_count() or 1,
          slot_len=shapes.max_model_len))
      llama_server.time_requests(peer_url, prompts[:shapes.batch_size],
                                 [8] * shapes.batch_size, shapes.batch_size)   # warm-up
    hf, threads = load_transformers(path, prompts, shapes)
    start = time.perf_counter()
    with meshlm_engine(path, shapes, attention) as engine:
      first_start_s = time.perf_counter() - start
      warm = engine.runner.num_compiles
      # One static batch's worth, untimed, as transformers warms up: the first pass over
      # real data runs slower than later ones (measured ~15%).
      n = shapes.batch_size
      engine.generate(prompts[:n], _params(out_lens[:n]))
      sides = timed_sides(shapes, engine, hf, prompts, out_lens, peer_url)
      passes, outputs = interleaved(sides, repeats)
      batched, peer = outputs['continuous'], outputs['static']
      alone = shapes.one_at_a_time or len(prompts)
      one_s, single = time_one_at_a_time(engine, prompts[:alone], out_lens[:alone])
      compiles = engine.runner.num_compiles
      assert compiles == warm, f'{compiles - warm} programs compiled after the warm-up'
      profile = profile_steps(engine, prompts, out_lens)
    stack.close()   # llama-server stops before the reference and the restart run
    reference = [[t] for t in float32_first_tokens(path, prompts, hf.device)]
    startup = {'first_s': first_start_s, **start_again(path, shapes, attention)}
  tokens = sum(out_lens)
  names = [n for n in ('continuous', 'static', 'llama_cpp') if f'{n}_s' in passes[0]]
  seconds, per_s, marginal = rates(passes, names, tokens,
                                   sum(out_lens[:shapes.marginal_from]))
  seconds['one_at_a_time_s'] = one_s
  out_rates = {'continuous_batching': per_s['continuous'],
               'one_at_a_time': sum(out_lens[:alone]) / one_s,
               'transformers_static': per_s['static']}
  ratios = {'continuous_vs_transformers': per_s['continuous'] / per_s['static'],
            'continuous_vs_one_at_a_time': per_s['continuous'] / out_rates['one_at_a_time']}
  if peer_url is not None:
    out_rates['llama_cpp_server'] = per_s['llama_cpp']
    ratios['continuous_vs_llama_cpp'] = per_s['continuous'] / per_s['llama_cpp']
  result = {
      'shapes': dataclasses.asdict(shapes), 'parameters': num_params(shapes),
      'one_at_a_time_requests': alone, 'output_tokens': tokens,
      'prompt_tokens': sum(map(len, prompts)), 'output_tokens_per_s': out_rates,
      'ratios': ratios, 'seconds': seconds,
      'passes': [{**p, 'ratio': p['static_s'] / p['continuous_s']} for p in passes],
      'transformers_computed_tokens': sum(len(b) * max(out_lens[i] for i in b)
                                          for b in static_batches(shapes, len(prompts))),
      'meshlm_compiles': compiles,
      **agreement(batched, single, peer, reference),
      'load_average_1min': os.getloadavg()[0],   # the 2 cores are shared: context
      'versions': {'transformers': transformers.__version__, 'torch': torch.__version__},
      'torch_device': str(hf.device), 'torch_threads': threads,
      'meshlm_attention': engine.runner.impl,
      'meshlm_step_profile': profile,
      # Engine start (weights loaded, warm-up): the first, and a second from the cache.
      'meshlm_startup': startup,
  }
  if marginal:
    result.update(marginal_output_tokens_per_s(marginal, shapes, tokens, out_lens))
  result['llama_cpp'] = peer_note or llama_peer_info(
      llama, shapes, batched, outputs['llama_cpp'])
  return result


def marginal_output_tokens_per_s(marginal: dict, shapes: Shapes, tokens: int,
                                 out_lens) -> dict:
  """The marginal rates, named as the other rates, with their definition."""
  names = {'continuous': 'continuous_batching', 'static': 'transformers_static',
           'llama_cpp': 'llama_cpp_server'}
  m = shapes.marginal_from
  out = {'marginal_output_tokens_per_s': {names[n]: r for n, r in marginal.items()},
         'marginal_definition': (
             f'(output tokens of all {shapes.num_requests} requests - those of the first '
             f'{m}) / median over passes of (seconds for all {shapes.num_requests} - '
             f'seconds for the first {m}): {tokens} - {sum(out_lens[:m])} tokens; each '
             'run starts from an idle engine or server, so start-up, fill and drain '
             'cancel out')}
  ratio = lambda a, b: a / b if a and b else None  # noqa: E731  (None: no rate)
  ratios = {'continuous_vs_transformers': ratio(marginal['continuous'], marginal['static'])}
  if 'llama_cpp' in marginal:
    ratios['continuous_vs_llama_cpp'] = ratio(marginal['continuous'], marginal['llama_cpp'])
  out['marginal_ratios'] = ratios
  return out


def llama_peer_info(llama, shapes: Shapes, batched, peer) -> dict:
  return {'server': llama[0], 'slots': shapes.batch_size, 'threads': os.cpu_count(),
          'weights': f'GGUF {shapes.dtype}, converted by {llama[1]}',
          'requests_equal_to_meshlm': sum(a == b for a, b in zip(batched, peer))}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--shapes', choices=sorted(PRESETS), default='small',
                      help='small: float32, for this CPU (default); long: prompts of 32-256 '
                      'tokens and a marginal rate, for this CPU; 1b: Llama-3.2-1B-shaped '
                      'in bfloat16, for a GPU; smoke: tiny')
  parser.add_argument('--smoke', action='store_true',
                      help='--shapes=smoke; print the JSON, write results/ nothing')
  parser.add_argument('--output', metavar='PATH', help='also write the JSON here')
  parser.add_argument('--repeats', type=int, default=None,
                      help='timed passes of each side, interleaved (default 3; smoke 1)')
  parser.add_argument('--attention', choices=ATTENTION_CHOICES, default='auto',
                      help="meshlm's paged attention (auto: pallas on GPU, xla on CPU)")
  parser.add_argument('--llama-server', metavar='PATH',
                      help="llama.cpp's llama-server binary: adds llama.cpp as a peer "
                      '(skipped with a note in the JSON when absent)')
  parser.add_argument('--llama-converter', metavar='PATH',
                      help="llama.cpp's convert_hf_to_gguf.py, beside its gguf-py/")
  parser.add_argument('--note', default='',
                      help="the run's conditions, kept in the JSON (e.g. who else shared "
                      'the machine)')
  args = parser.parse_args(argv)
  preset = 'smoke' if args.smoke else args.shapes
  repeats = args.repeats or (1 if preset == 'smoke' else 3)
  if repeats < 1:
    parser.error(f'--repeats={repeats}: give at least 1.')
  # A fresh compilation cache (unless the process has one), so the first engine's start
  # is a cold one and the second's reads what it wrote.
  with compile_cache.fresh():
    result = {'environment': environment(), **({'note': args.note} if args.note else {}),
              **benchmark(PRESETS[preset], repeats, args.attention,
                          (args.llama_server, args.llama_converter))}
  if args.output:
    with open(args.output, 'w') as f:
      json.dump(result, f, indent=2)
  if preset == 'smoke':
    print(json.dumps(result, indent=2))
    return result
  name = '_'.join(['serve_throughput'] + ([preset] if preset != 'small' else []) +
                  [result['environment']['platform']])
  path = write_result(name, result)
  print(json.dumps(result['output_tokens_per_s'], indent=2), json.dumps(result['ratios']),
        json.dumps(result.get('marginal_ratios', {})))
  print(f'written to {path}')
  return result


if __name__ == '__main__':
  main()
