"""Tokenizes text into a token file for training.

    python -m training.prepare --input a.txt b.py c.jsonl --output data/train.bin \
        [--tokenizer byte|path/to/tokenizer.json] [--jsonl_field text]

A `.jsonl` input holds one document per line (its `--jsonl_field`); any other input is
one document. The output is written atomically: on any error nothing is left behind.
"""

import argparse
import json
import os
import sys
from typing import Callable, Iterator, Sequence

import numpy as np
from rich import console as console_lib
from rich import progress

from training import data
from training import tokenizer as tokenizer_lib

_BATCH_LINES = 1024   # jsonl lines tokenized per encode_batch call


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog='python -m training.prepare', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--input', nargs='+', required=True, metavar='FILE',
                      help='text files (one document each) or .jsonl files (one per line)')
  parser.add_argument('--output', required=True, metavar='OUT.bin',
                      help='token file to write; OUT.bin.json is written beside it')
  parser.add_argument('--tokenizer', default='byte',
                      help="'byte' or a path to a Hugging Face tokenizer.json")
  parser.add_argument('--jsonl_field', default='text',
                      help='the field of each .jsonl line that holds the document text')
  args = parser.parse_args(argv)
  missing = [p for p in args.input if not os.path.isfile(p)]
  if missing:
    parser.error(f'input file(s) not found or not regular files: {", ".join(missing)}. '
                 'Nothing was written.')
  if args.tokenizer != 'byte' and not os.path.isfile(os.path.expanduser(args.tokenizer)):
    parser.error(f'--tokenizer {args.tokenizer}: no such file. Pass `byte` or the path of '
                 'a local Hugging Face tokenizer.json.')
  return args


def jsonl_texts(path: str, field: str) -> Iterator[str]:
  with open(path, encoding='utf-8') as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}:{line_no}: not valid JSON ({e.msg}).') from None
      if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise ValueError(f'{path}:{line_no}: no string field {field!r}; pass '
                         '--jsonl_field with the name of the field holding the text.')
      yield record[field]


def _batched(texts: Iterator[str], size: int) -> Iterator[list[str]]:
  batch = []
  for text in texts:
    batch.append(text)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def documents(path: str, tok, field: str,
              warn: Callable[[str], None] = print) -> Iterator[np.ndarray]:
  """The token ids of each document in one input file; warns of empty documents."""
  if path.endswith('.jsonl'):
    for batch in _batched(jsonl_texts(path, field), _BATCH_LINES):
      for ids in tok.encode_batch(batch):
        if not ids.size:
          warn(f'warning: {path}: an empty {field!r} adds only an end-of-document token.')
        yield ids
  else:
    with open(path, 'rb') as f:
      # A stray invalid byte should not stop a whole corpus; it becomes U+FFFD.
      ids = tok.encode(f.read().decode('utf-8', errors='replace'))
    if not ids.size:
      warn(f'warning: {path} is empty: it adds only an end-of-document token.')
    yield ids


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  console = console_lib.Console(stderr=True)
  try:
    tok = tokenizer_lib.load_tokenizer(args.tokenizer)
    with progress.Progress(*progress.Progress.get_default_columns(),
                           progress.MofNCompleteColumn(), console=console) as bar:
      task = bar.add_task('Tokenizing', total=len(args.input))

      def all_docs():
        for path in args.input:
          bar.update(task, description=f'Tokenizing {os.path.basename(path)}')
          yield from documents(path, tok, args.jsonl_field, warn=lambda m: console.print(
              m, style='yellow', markup=False, highlight=False, soft_wrap=True))
          bar.advance(task)

      meta = data.write_token_file(args.output, all_docs(), tok)
  except (OSError, ValueError) as e:
    console.print(f'error: {e} Nothing was written.', style='red', markup=False,
                  highlight=False, soft_wrap=True)
    sys.exit(2)
  summary = (f'{meta["num_documents"]:,} documents, {meta["num_tokens"]:,} tokens '
             f'({meta["tokenizer"]}, vocab {meta["vocab_size"]}) -> {args.output}')
  console_lib.Console().print(summary, markup=False, highlight=False)


if __name__ == '__main__':
  main()
