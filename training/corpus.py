"""The default corpus: the installed Python standard library, tokenized once and cached.

It needs no download, is the same on every machine with the same Python, and is code,
so a small model trained on it produces recognizable output within minutes.
"""

import contextlib
import fcntl
import os
import pathlib
import sys
import sysconfig

from rich import progress

from training import tokenizer as tokenizer_lib
from training import token_files

# Installed third-party packages live inside the stdlib folder on some systems.
_SKIP_DIRS = {'site-packages', 'dist-packages', '__pycache__'}


def default_corpus(cfg) -> str:
  """Path of the cached token file for `cfg.tokenizer` and `cfg.corpus_max_mb`."""
  if cfg.corpus_max_mb <= 0:
    raise ValueError(f'data.corpus_max_mb={cfg.corpus_max_mb} must be > 0.')
  tok = tokenizer_lib.load_tokenizer(cfg.tokenizer)
  cache_dir = pathlib.Path(os.path.expanduser(cfg.cache_dir))
  py = f'py{sys.version_info.major}.{sys.version_info.minor}'
  path = str(cache_dir / f'stdlib-{py}-{tok.name}-{cfg.corpus_max_mb}mb.bin')
  if _complete(path):
    return path
  cache_dir.mkdir(parents=True, exist_ok=True)
  # Racing processes queue on a lock; the loser finds the winner's finished file.
  with _locked(path + '.lock'):
    if not _complete(path):
      _build(path, tok, cfg.corpus_max_mb << 20)
  return path


def _complete(path: str) -> bool:
  # The sidecar is renamed into place last, so its presence means the .bin is whole.
  return os.path.isfile(path) and os.path.isfile(token_files.sidecar(path))


@contextlib.contextmanager
def _locked(lock_path: str):
  with open(lock_path, 'a', encoding='utf-8') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def stdlib_sources(max_bytes: int) -> list[pathlib.Path]:
  """Sorted stdlib .py files, stopping once their total size reaches `max_bytes`."""
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  chosen, total = [], 0
  for path in sorted(root.rglob('*.py')):
    if _SKIP_DIRS & set(path.relative_to(root).parts) or not path.is_file():
      continue
    chosen.append(path)
    total += path.stat().st_size
    if total >= max_bytes:
      break
  return chosen


def _build(path: str, tok, max_bytes: int) -> None:
  files = stdlib_sources(max_bytes)
  if not files:
    raise FileNotFoundError(
        f'no Python sources under {sysconfig.get_paths()["stdlib"]} to build the default '
        'corpus from: set data.train_files to token files made by '
        '`python -m training.prepare`.')
  columns = (*progress.Progress.get_default_columns(), progress.MofNCompleteColumn())
  with progress.Progress(*columns, transient=True) as bar:
    task = bar.add_task(f'Tokenizing the Python stdlib ({tok.name})', total=len(files))

    def docs():
      for source in files:
        # Some stdlib test files are deliberately not valid UTF-8.
        yield tok.encode(source.read_bytes().decode('utf-8', errors='replace'))
        bar.advance(task)

    meta = token_files.write_token_file(path, docs(), tok)
  print(f'Default corpus: {meta["num_documents"]} files, {meta["num_tokens"]:,} tokens '
        f'-> {path}')
