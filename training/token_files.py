"""Writing token files: `NAME.bin` (raw little-endian ids, each document followed by one
eos) and its `NAME.bin.json` sidecar, written last (training/data.py reads them).

Below both training/data.py and training/corpus.py: the default corpus is written
with this writer, and the pipeline builds that corpus when no file is configured."""

import json
import os
import tempfile
from typing import Iterable

import numpy as np

FORMAT = 'meshlm-tokens-v1'
_FLUSH_TOKENS = 1 << 20   # buffer this many ids before each write


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype('<u2') if vocab_size <= 1 << 16 else np.dtype('<u4')


def sidecar(path: str) -> str:
  return path + '.json'


def write_token_file(path: str, docs: Iterable[np.ndarray], tokenizer) -> dict:
  """Writes token-id documents (eos appended to each) atomically; returns the metadata."""
  path = os.path.expanduser(path)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  tmp_bin = _temp_path(directory, path)
  tmp_json = _temp_path(directory, sidecar(path))
  try:
    with open(tmp_bin, 'wb') as f:
      num_tokens, num_docs = _write_docs(f, docs, tokenizer)
      f.flush()
      os.fsync(f.fileno())
    meta = dict(format=FORMAT, dtype=token_dtype(tokenizer.vocab_size).name,
                num_tokens=num_tokens, num_documents=num_docs,
                vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                tokenizer=tokenizer.name)
    with open(tmp_json, 'w', encoding='utf-8') as f:
      json.dump(meta, f, indent=2)
    # Drop an old sidecar first: for a moment the .bin then has none (and reads as
    # unfinished) rather than pairing the new tokens with stale metadata.
    if os.path.exists(sidecar(path)):
      os.remove(sidecar(path))
    os.replace(tmp_bin, path)
    os.replace(tmp_json, sidecar(path))
  finally:
    for tmp in (tmp_bin, tmp_json):
      if os.path.exists(tmp):
        os.remove(tmp)
  return meta


def _temp_path(directory: str, target: str) -> str:
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f'.{os.path.basename(target)}.',
                             suffix='.tmp')
  os.close(fd)
  os.chmod(tmp, 0o644)   # mkstemp makes 0600; token files are meant to be shared
  return tmp


def _write_docs(f, docs: Iterable[np.ndarray], tokenizer) -> tuple[int, int]:
  dtype = token_dtype(tokenizer.vocab_size)
  eos = np.array([tokenizer.eos_id], dtype)
  pending, pending_tokens, num_tokens, num_docs = [], 0, 0, 0
  for doc in docs:
    doc = _checked_doc(doc, num_docs, tokenizer.vocab_size)
    pending += [doc.astype(dtype), eos]
    pending_tokens += doc.size + 1
    num_docs += 1
    if pending_tokens >= _FLUSH_TOKENS:
      f.write(np.concatenate(pending).tobytes())
      num_tokens += pending_tokens
      pending, pending_tokens = [], 0
  if pending:
    f.write(np.concatenate(pending).tobytes())
    num_tokens += pending_tokens
  return num_tokens, num_docs


def _checked_doc(doc, index: int, vocab_size: int) -> np.ndarray:
  doc = np.asarray(doc)
  if doc.ndim != 1 or not (doc.size == 0 or np.issubdtype(doc.dtype, np.integer)):
    raise ValueError(f'document {index}: expected a 1-D array of integer token ids, got '
                     f'shape {doc.shape} dtype {doc.dtype}.')
  if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
    raise ValueError(f'document {index}: token ids span [{doc.min()}, {doc.max()}], outside '
                     f'the tokenizer vocabulary [0, {vocab_size}).')
  return doc
