"""Host cost of structured output: preparing a guide, and each token of a guided request.

  python -m benchmarks.guided_decoding             # vocabularies of 32K and 128K tokens
  python -m benchmarks.guided_decoding --smoke     # 2K tokens, few steps, no json_object;
                                                   # writes nothing

The engine advances each guided request's guide, and so computes its next allowed tokens,
on its own thread while the device runs the next step (serve/engine/loop.py). Per token that
must stay small beside a decode step (milliseconds); preparing a guide (outlines-core's
compile of an expression over the vocabulary, llguidance's reading of a grammar) is paid
once per new expression, before the request's first token.

Vocabulary: a byte-level BPE, the kind of GPT-2 and Llama-3, trained here on the Python
sources of the installed packages (no download), at Llama-2's size (32,000) and
Llama-3's (128,256). Guides, as the server builds them (serve/structured/guided.py):
- regex: `guided_regex` of a few words, outlines-core;
- tool_schema: a tool's parameters as `guided_json` (strings, an enum, an integer, an
  array), outlines-core;
- json_object: `response_format` json_object, outlines-core;
- grammar: `guided_grammar`, lists of digits nested to any depth, llguidance.
And for comparison, not what the server does for JSON: the two JSON schemas followed by
llguidance itself, as grammars (`start: %json {...}`; tool_schema_llguidance,
json_object_llguidance).
Each guide is walked several times from its start, drawing tokens at random among those
allowed, until eos or `--steps` tokens; a step is `advance(token)` then `words()`, what the
engine does per token. Writes benchmarks/results/guided_decoding_cpu.json.
"""

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from benchmarks.common import write_result
from training.tokenizer import HFTokenizer

SCHEMA = {'type': 'object', 'properties': {
    'city': {'type': 'string'}, 'unit': {'enum': ['celsius', 'fahrenheit']},
    'days': {'type': 'integer'}, 'tags': {'type': 'array', 'items': {'type': 'string'}}},
    'required': ['city', 'unit']}
GUIDES = {   # name -> the request fields that ask for it
    'regex': {'guided_regex': '[a-z]{3,8}( [a-z]{3,8}){2,5}\\.'},
    'tool_schema': {'guided_json': SCHEMA},
    'json_object': {'response_format': {'type': 'json_object'}},
    'grammar': {'guided_grammar': 'root ::= "[" (item ("," item)*)? "]"\n'
                                  'item ::= [0-9] | root'},
    # The comparison: llguidance following the JSON schemas itself (Lark's %json).
    'tool_schema_llguidance': {'guided_grammar': 'start: %json ' + json.dumps(SCHEMA)},
    'json_object_llguidance': {'guided_grammar': 'start: %json {"type": "object"}'},
}


def corpus(max_chars: int) -> list[str]:
  """Python sources of the installed packages, up to max_chars characters, in a fixed
  order."""
  roots = sorted({os.path.dirname(os.path.dirname(np.__file__)), *sys.path[1:]})
  texts, total = [], 0
  for root in roots:
    for path in sorted(glob.glob(os.path.join(root, '*', '**', '*.py'), recursive=True)):
      try:
        with open(path, encoding='utf-8') as f:
          text = f.read()
      except (OSError, UnicodeDecodeError):
        continue
      texts.append(text)
      total += len(text)
      if total >= max_chars:
        return texts
  return texts


def train_tokenizer(vocab_size: int, texts: list[str], directory: str):
  """A byte-level BPE of vocab_size tokens (one special: <|endoftext|>), as HFTokenizer."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=['<|endoftext|>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  path = os.path.join(directory, f'bpe_{vocab_size}.json')
  tok.save(path)
  return HFTokenizer(path)


def walk(decoding, regex, grammar, eos: int, steps: int, rng) -> list[float]:
  """Seconds of each step (advance, then words) of one random walk from a new guide."""
  guide = decoding.guide(regex, grammar=grammar)
  times, words = [], guide.words()
  for _ in range(steps):
    allowed = np.flatnonzero(guide.allowed())
    token = int(rng.choice(allowed))
    if token == eos:
      break
    start = time.perf_counter()
    guide.advance(token)
    words = guide.words()
    times.append(time.perf_counter() - start)
  del words
  return times


def measure(tok, names: list[str], walks: int, steps: int, seed: int) -> dict:
  """Per guide: seconds to prepare it (a new GuidedDecoding, so nothing is cached) and
  its per-token step times."""
  from serve.api.openai_sampling import from_openai  # pylint: disable=import-outside-toplevel
  from serve.structured import guided  # pylint: disable=import-outside-toplevel
  eos = tok.eos_id
  out = {}
  for name in names:
    params = from_openai(GUIDES[name], tok.vocab_size)
    decoding = guided.GuidedDecoding(tok, [eos])
    llg = params.guided_grammar is not None
    if llg:   # llguidance reads the vocabulary once per engine
      start = time.perf_counter()
      decoding._llguidance_tokenizer()   # pylint: disable=protected-access
      vocabulary_s = time.perf_counter() - start
    else:
      vocabulary_s = None
    start = time.perf_counter()
    decoding.compile(params.guided_regex, grammar=params.guided_grammar)
    prepare_s = time.perf_counter() - start
    rng = np.random.default_rng(seed)
    times = [t for _ in range(walks)
             for t in walk(decoding, params.guided_regex, params.guided_grammar, eos, steps,
                           rng)]
    out[name] = {
        'library': 'llguidance' if llg else 'outlines-core',
        'vocabulary_s': vocabulary_s, 'prepare_s': prepare_s, 'tokens_timed': len(times),
        'step_ms_median': 1e3 * statistics.median(times),
        'step_ms_p99': 1e3 * float(np.percentile(times, 99)),
        'step_ms_max': 1e3 * max(times)}
    print(f'  {name:24s} {out[name]["library"]:13s} prepare {prepare_s:7.2f} s'
          + (f' (+ vocabulary {vocabulary_s:.2f} s)' if vocabulary_s is not None else '')
          + f'  step median {out[name]["step_ms_median"]:.3f} ms, p99 '
          f'{out[name]["step_ms_p99"]:.3f} ms over {len(times)} tokens', flush=True)
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--vocab', default='32000,128256',
                      help='comma-separated vocabulary sizes to train and measure')
  parser.add_argument('--corpus-mb', type=float, default=80.0,
                      help='millions of characters of Python sources to train the '
                      'tokenizers on')
  parser.add_argument('--walks', type=int, default=8)
  parser.add_argument('--steps', type=int, default=64, help='tokens per walk at most')
  parser.add_argument('--guides', default=','.join(GUIDES),
                      help=f'comma-separated, of {", ".join(GUIDES)}')
  parser.add_argument('--smoke', action='store_true', help='a 2K vocabulary, few steps, '
                      'json_object left out (its compile takes seconds even there); writes '
                      'nothing')
  args = parser.parse_args(argv)
  if args.smoke:
    args.vocab, args.corpus_mb, args.walks, args.steps = '2048', 1.0, 2, 16
    args.guides = 'regex,tool_schema,grammar,tool_schema_llguidance'
  names = args.guides.split(',')
  unknown = sorted(set(names) - set(GUIDES))
  if unknown:
    parser.error(f'--guides: unknown {unknown}; choose from {", ".join(GUIDES)}')
  sizes = [int(v) for v in args.vocab.split(',')]
  texts = corpus(int(args.corpus_mb * 1e6))
  results = {}
  with tempfile.TemporaryDirectory() as directory:
    for size in sizes:
      start = time.perf_counter()
      tok = train_tokenizer(size, texts, directory)
      print(f'vocabulary {tok.vocab_size} (trained in {time.perf_counter() - start:.0f} s)',
            flush=True)
      results[str(tok.vocab_size)] = measure(tok, names, args.walks, args.steps, seed=0)
  payload = {'corpus_chars': sum(map(len, texts)), 'walks': args.walks,
             'steps_per_walk': args.steps, 'guides': {k: GUIDES[k] for k in names},
             'by_vocabulary': results}
  if not args.smoke:
    print('wrote', write_result('guided_decoding_cpu', payload))
  return payload


if __name__ == '__main__':
  main()
