"""Token files and the grain pipeline that turns them into training batches.

A token file is `NAME.bin`, raw little-endian ids (uint16 when the vocabulary fits, else
uint32), each document followed by one eos, plus `NAME.bin.json` describing it. The
sidecar is written last, so a file without one is unfinished and never read.

The files are read as one concatenated stream of windows of `seq_len + 1` tokens with
stride `seq_len`, so every token is a target exactly once per epoch:

    stream   |a a a E b b b b E c c c c c E d d ...      (E = eos)
    window 0 [a a a E b]
    window 1         [b b b E c]
    window 2                 [c c c c E]

The global sequence of windows is a seeded shuffle (new each epoch, forever); global
step s takes the next `batch_size` windows, and each process reads only the rows
[lo, hi) of them that its devices hold (`ShardingPlan.process_rows`: several processes
read the same rows when a model axis spans them).
"""

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any, Sequence

import grain
import numpy as np

from training import config as config_lib
from training import corpus
from training import tokenizer as tokenizer_lib
# The writing side lives below this module and corpus.py (which builds the default corpus
# with it); write_token_file is re-exported for prepare and the tests.
from training.token_files import sidecar, write_token_file  # pylint: disable=unused-import

# Grain's defaults (16 threads, 500 elements) are tuned for remote storage and small
# records; one element here is a whole batch read from a local memmap.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


# --- Reading ----------------------------------------------------------------------------


def open_token_file(path: str) -> tuple[np.ndarray, dict]:
  """Memory-maps a token file; returns (ids, metadata). Nothing is read into memory."""
  meta = checked_metadata(path)
  dtype = np.dtype(meta['dtype']).newbyteorder('<')
  if meta['num_tokens'] == 0:
    return np.zeros(0, dtype), meta   # np.memmap refuses empty files
  return np.memmap(path, dtype=dtype, mode='r'), meta


def checked_metadata(path: str) -> dict:
  """The sidecar, after checking that the token file has exactly the bytes it promises."""
  meta = read_metadata(path)
  dtype = np.dtype(meta['dtype'])
  size = os.path.getsize(path)
  if size != meta['num_tokens'] * dtype.itemsize:
    raise ValueError(
        f'{path} holds {size} bytes but {sidecar(path)} promises {meta["num_tokens"]} '
        f'{dtype.name} tokens ({meta["num_tokens"] * dtype.itemsize} bytes): the file is '
        'truncated or does not belong to this sidecar. Re-create it with '
        '`python -m training.prepare`.')
  return meta


def read_metadata(path: str) -> dict:
  """The sidecar of a token file, checked for the keys the pipeline relies on."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'token file {path} does not exist. Create it with '
                            '`python -m training.prepare --input TEXT_FILES --output OUT.bin`.')
  if not os.path.isfile(sidecar(path)):
    raise FileNotFoundError(
        f'{path} has no metadata file {sidecar(path)}: it was not written by '
        '`python -m training.prepare` or its writer did not finish. Re-create it.')
  with open(sidecar(path), encoding='utf-8') as f:
    meta = json.load(f)
  missing = {'dtype', 'num_tokens', 'num_documents', 'vocab_size', 'eos_id',
             'tokenizer'} - set(meta)
  if missing:
    raise ValueError(f'{sidecar(path)} lacks {sorted(missing)}: re-create the token file.')
  if meta['dtype'] not in ('uint16', 'uint32'):
    raise ValueError(f'{sidecar(path)}: dtype {meta["dtype"]!r} is not uint16 or uint32.')
  return meta


class TokenWindows:
  """Random access to windows of `seq_len + 1` tokens, stride `seq_len`, over files.

  Holds paths, not arrays: memmaps are opened lazily in whichever process reads, so
  pickling this to grain workers never copies the token data.
  """

  def __init__(self, paths: Sequence[str], seq_len: int):
    self.paths = list(paths)
    self.seq_len = seq_len
    sizes = [read_metadata(p)['num_tokens'] for p in self.paths]
    self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    self.num_tokens = int(self._starts[-1])
    self._arrays = None

  def __len__(self) -> int:
    return max(self.num_tokens - 1, 0) // self.seq_len

  def __getitem__(self, index: int) -> np.ndarray:
    if not 0 <= index < len(self):
      raise IndexError(f'window {index} out of range [0, {len(self)}).')
    return self.read(index * self.seq_len, index * self.seq_len + self.seq_len + 1)

  def read(self, begin: int, end: int) -> np.ndarray:
    """Tokens [begin, end) of the concatenated files, as int32."""
    if self._arrays is None:
      self._arrays = [open_token_file(p)[0] for p in self.paths]
    pieces = []
    f = int(np.searchsorted(self._starts, begin, side='right')) - 1
    while begin < end:
      local = begin - self._starts[f]
      take = min(end, self._starts[f + 1]) - begin
      pieces.append(self._arrays[f][local:local + take])
      begin += take
      f += 1
    return np.concatenate(pieces).astype(np.int32)

  def __getstate__(self) -> dict:
    return {**self.__dict__, '_arrays': None}

  def __repr__(self) -> str:
    return f'TokenWindows({len(self.paths)} files, {self.num_tokens} tokens, T={self.seq_len})'


def window_features(window: np.ndarray, *, eos_id: int, pack: bool) -> dict[str, np.ndarray]:
  """Model inputs for one window; with packing, each document is its own segment."""
  inputs, targets = window[:-1], window[1:]
  t = np.arange(inputs.size, dtype=np.int32)
  if not pack:
    # No segment_ids: attention is plain causal (no [t, s] segment mask is built).
    return dict(inputs=inputs, targets=targets, positions=t,
                weights=np.ones(inputs.size, np.float32))
  is_eos = inputs == eos_id
  # The eos ends its document; the token after it starts the next segment.
  starts = np.concatenate([[True], is_eos[:-1]])
  segment_ids = np.cumsum(starts, dtype=np.int32)
  positions = t - np.maximum.accumulate(np.where(starts, t, 0)).astype(np.int32)
  # Predicting a new document's first token from the previous document is noise.
  weights = np.where(is_eos, 0.0, 1.0).astype(np.float32)
  return dict(inputs=inputs, targets=targets, segment_ids=segment_ids, positions=positions,
              weights=weights)


# --- The pipeline -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataInfo:
  tokenizer: Any
  vocab_size: int
  eos_id: int


def data_info(cfg: config_lib.DataConfig) -> DataInfo:
  """Tokenizer facts the trainer needs (model.vocab_size >= vocab_size), checked against
  the configured token files' metadata; builds nothing."""
  tok = tokenizer_lib.load_tokenizer(cfg.tokenizer)
  for path in _dedupe_sidecars(config_lib.data_files(cfg)):
    # Checked here, before compiling: a truncated file would otherwise stop the run
    # mid-way, in a grain worker.
    _check_matches_tokenizer(path, checked_metadata(path), tok)
  return DataInfo(tokenizer=tok, vocab_size=tok.vocab_size, eos_id=tok.eos_id)


def train_files(cfg: config_lib.DataConfig) -> list[str]:
  """The configured token files, or the default corpus (built on first use)."""
  files = _dedupe_sidecars(config_lib.data_files(cfg))
  if files:
    return files
  return [corpus.default_corpus(cfg)]


def _dedupe_sidecars(files: list[str]) -> list[str]:
  # A glob such as `data/*` also matches each NAME.bin.json next to NAME.bin.
  names = set(files)
  return [f for f in files if not (f.endswith('.json') and f[:-len('.json')] in names)]


def _check_matches_tokenizer(path: str, meta: dict, tok) -> None:
  # The name too: two tokenizers can share vocab size and eos yet mean different text.
  if (meta['tokenizer'], meta['vocab_size'], meta['eos_id']) != (
      tok.name, tok.vocab_size, tok.eos_id):
    raise ValueError(
        f'{path} was written with tokenizer {meta["tokenizer"]} (vocab_size '
        f'{meta["vocab_size"]}, eos_id {meta["eos_id"]}) but data.tokenizer gives '
        f'{tok.name} (vocab_size {tok.vocab_size}, eos_id {tok.eos_id}). Re-run '
        '`python -m training.prepare` with --tokenizer matching data.tokenizer, or set '
        'data.tokenizer to the one the files were written with.')


def _check_cfg(cfg: config_lib.DataConfig, rows: tuple[int, int] | None) -> tuple[int, int]:
  """The rows [lo, hi) to read (all when None), checked to be whole aligned chunks."""
  if cfg.batch_size < 1 or cfg.seq_len < 1:
    raise ValueError(f'data.batch_size={cfg.batch_size} and data.seq_len={cfg.seq_len} '
                     'must both be >= 1.')
  lo, hi = rows or (0, cfg.batch_size)
  if not 0 <= lo < hi <= cfg.batch_size or cfg.batch_size % (hi - lo) or lo % (hi - lo):
    raise ValueError(f'rows [{lo}, {hi}) are not one of the equal chunks that split '
                     f'data.batch_size={cfg.batch_size}.')
  if cfg.worker_count < 0:
    raise ValueError(f'data.worker_count={cfg.worker_count} must be >= 0.')
  return lo, hi


def _shuffle_seed(seed: int) -> int:
  # Grain seeds epoch e with seed + e, so seed s's second epoch would replay seed s+1's
  # first; hashing the run seed keeps different runs' orders unrelated.
  digest = hashlib.sha256(f'meshlm-data-shuffle-{seed}'.encode()).digest()
  return int.from_bytes(digest[:4], 'little')


def _windows(cfg: config_lib.DataConfig, files: list[str]) -> tuple[TokenWindows, int]:
  """The files' windows, checked against data.tokenizer, and their eos id."""
  tok = tokenizer_lib.load_tokenizer(cfg.tokenizer)
  metas = [read_metadata(p) for p in files]
  for path, meta in zip(files, metas):
    _check_matches_tokenizer(path, meta, tok)
  return TokenWindows(files, cfg.seq_len), metas[0]['eos_id']


def _batched(ds: grain.MapDataset, cfg: config_lib.DataConfig, eos_id: int,
             rows: tuple[int, int]) -> grain.MapDataset:
  """Windows -> this process's batches of features, rows [lo, hi) of each global step.

  Cuts the window sequence into chunks of b = hi - lo rows: chunk k is rows
  [(k % n) * b, (k % n + 1) * b) of global step k // n (n = batch_size / b), so rows
  [lo, hi) are every n-th chunk from lo / b. Slicing before reading means each process
  reads only its rows.
  """
  (lo, hi), features = rows, functools.partial(window_features, eos_id=eos_id,
                                               pack=cfg.pack_documents)
  return (ds.map(features).batch(hi - lo, drop_remainder=True)
          .slice(slice(lo // (hi - lo), None, cfg.batch_size // (hi - lo))))


def make_dataset(cfg: config_lib.DataConfig, *, seed: int,
                 rows: tuple[int, int] | None = None, held_out: int = 0) -> grain.IterDataset:
  """Rows [lo, hi) (default: all) of every global batch as a grain IterDataset (see the
  module docstring), without the last `held_out` windows of the files (evaluation's:
  make_eval_batches)."""
  rows = _check_cfg(cfg, rows)
  files = train_files(cfg)
  windows, eos_id = _windows(cfg, files)
  if not len(windows):
    raise ValueError(f'{windows.num_tokens} tokens in {files} do not fill one window of '
                     f'data.seq_len + 1 = {cfg.seq_len + 1}: add data or lower data.seq_len.')
  if len(windows) <= held_out:
    raise ValueError(f'{files} make {len(windows)} windows of data.seq_len + 1 = '
                     f'{cfg.seq_len + 1} tokens and evaluation holds out the last '
                     f'{held_out} (eval.batches x data.batch_size): none is left to train '
                     'on. Add data, lower eval.batches or give eval.files.')
  ds = grain.MapDataset.source(windows)
  if held_out:
    ds = ds[:len(windows) - held_out]
  if cfg.shuffle:
    ds = ds.shuffle(seed=_shuffle_seed(seed))
  ds = _batched(ds.repeat(None), cfg, eos_id, rows)
  ds = ds.to_iter_dataset(_READ_OPTIONS)
  if cfg.worker_count > 0:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count,
                                                     per_worker_buffer_size=2))
  return ds


def make_eval_batches(cfg: config_lib.Config, *, rows: tuple[int, int] | None = None
                      ) -> list[dict[str, np.ndarray]]:
  """Rows [lo, hi) (default: all) of the eval.batches evaluation batches, in order, read
  once: from eval.files, else the last held_out_windows of the training data
  (unshuffled)."""
  data_cfg, batches = cfg.data, cfg.eval.batches
  rows = _check_cfg(data_cfg, rows)
  files = _dedupe_sidecars(config_lib.eval_files(cfg.eval)) or train_files(data_cfg)
  windows, eos_id = _windows(data_cfg, files)
  need = batches * data_cfg.batch_size
  if len(windows) < need:
    source = 'eval.files' if cfg.eval.files else 'the training data'
    raise ValueError(f'{source} ({files}) make {len(windows)} windows of data.seq_len + 1 '
                     f'= {data_cfg.seq_len + 1} tokens, fewer than eval.batches x '
                     f'data.batch_size = {need}: lower eval.batches or add data.')
  ds = grain.MapDataset.source(windows)
  ds = ds[len(windows) - need:] if not cfg.eval.files else ds[:need]
  return list(_batched(ds, data_cfg, eos_id, rows))


def make_train_iterator(cfg: config_lib.DataConfig, *, seed: int,
                        rows: tuple[int, int] | None = None,
                        held_out: int = 0) -> grain.DatasetIterator:
  """An endless iterator of rows [lo, hi) (default: all) of every global batch;
  `get_state()` is JSON-serializable.

  Each batch is a dict of numpy arrays of shape [hi - lo, seq_len]:
  inputs, targets, positions, segment_ids (int32; only with data.pack_documents) and
  weights (float32). Call `close()`
  when done: with workers, batches not yet taken hold shared memory. A saved state only
  restores onto the same files, cfg, seed, rows and worker_count.
  """
  ds = make_dataset(cfg, seed=seed, rows=rows, held_out=held_out)
  return iter(ds)
