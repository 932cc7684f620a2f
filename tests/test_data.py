"""Tokenizers, token files, the grain pipeline, the prepare CLI and the default corpus.

Every pipeline output is checked against a plain numpy or python-loop reference built
from the documents themselves, not from the code under test.
"""

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from training import config as config_lib
from training import corpus
from training import data
from training import prepare
from training import tokenizer as tokenizer_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BYTE_EOS = 256


@dataclasses.dataclass
class FakeTokenizer:
  """Only what write_token_file reads: a vocabulary too big for uint16."""
  name: str = 'fake'
  vocab_size: int = 70_000
  eos_id: int = 69_999


def random_docs(rng, count, max_len=40, vocab=256):
  return [rng.integers(0, vocab, size=rng.integers(0, max_len)) for _ in range(count)]


def reference_stream(docs, eos):
  """The concatenation with an eos after every document, built with python lists."""
  out = []
  for doc in docs:
    out += [int(t) for t in doc] + [eos]
  return np.array(out, np.int64)


@pytest.fixture(name='corpus_files')
def fixture_corpus_files(tmp_path):
  """Three byte-tokenizer token files; returns (glob pattern, reference stream)."""
  rng = np.random.default_rng(0)
  all_docs = []
  for i, count in enumerate((30, 5, 45)):
    docs = random_docs(rng, count)
    data.write_token_file(str(tmp_path / f'part{i}.bin'), docs, tokenizer_lib.ByteTokenizer())
    all_docs += docs
  return str(tmp_path / 'part*.bin'), reference_stream(all_docs, BYTE_EOS)


def make_cfg(pattern, **kw):
  return config_lib.DataConfig(train_files=pattern, **{'batch_size': 4, 'seq_len': 16, **kw})


@contextlib.contextmanager
def train_iterator(cfg, seed=0, **kw):
  it = data.make_train_iterator(cfg, seed=seed, **kw)
  try:
    yield it
  finally:
    it.close()   # grain workers hold shared memory until closed


def take(cfg, steps, **kw):
  with train_iterator(cfg, **kw) as it:
    return [next(it) for _ in range(steps)]


def rows(batches, key='inputs'):
  return np.concatenate([b[key] for b in batches])


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# --- Tokenizers -----------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
  tok = tokenizer_lib.ByteTokenizer()
  text = 'déf f(x):\n  return "✓" \x00'
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  np.testing.assert_array_equal(ids, list(text.encode('utf-8')))
  assert tok.decode(np.append(ids, BYTE_EOS)) == text
  assert tok.decode([0xff, ord('a')]) == '\ufffda'   # invalid UTF-8 is replaced
  assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, 'byte')


def train_hf_tokenizer(path, texts, eos='<|endoftext|>'):
  tok = tokenizers.Tokenizer(models.WordLevel(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=['<unk>', eos]))
  tok.save(str(path))
  return tok


def sample_texts(rng, count):
  words = ['alpha', 'beta', 'gamma', 'delta', 'eps', '(', ')', ':', 'return', 'x1']
  return [' '.join(rng.choice(words, size=rng.integers(1, 30))) for _ in range(count)]


def test_hf_tokenizer(tmp_path):
  texts = sample_texts(np.random.default_rng(1), 50)
  ref = train_hf_tokenizer(tmp_path / 'tokenizer.json', texts)
  tok = tokenizer_lib.load_tokenizer(str(tmp_path / 'tokenizer.json'))
  assert tok.eos_id == ref.token_to_id('<|endoftext|>')
  assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
  np.testing.assert_array_equal(tok.encode(texts[0]), ref.encode(texts[0]).ids)
  assert tok.decode(tok.encode(texts[0])) == ref.decode(ref.encode(texts[0]).ids)
  assert tok.name == tokenizer_lib.load_tokenizer(str(tmp_path / 'tokenizer.json')).name
  train_hf_tokenizer(tmp_path / 'other.json', texts[:10])
  assert tokenizer_lib.load_tokenizer(str(tmp_path / 'other.json')).name != tok.name


def test_hf_tokenizer_without_eos_is_rejected(tmp_path):
  train_hf_tokenizer(tmp_path / 't.json', ['a b c'], eos='<pad>')
  with pytest.raises(ValueError, match='end-of-document'):
    tokenizer_lib.load_tokenizer(str(tmp_path / 't.json'))


def test_missing_tokenizer_file_names_the_field(tmp_path):
  with pytest.raises(FileNotFoundError, match='data.tokenizer'):
    tokenizer_lib.load_tokenizer(str(tmp_path / 'nope.json'))


# --- Token files ----------------------------------------------------------------------


@pytest.mark.parametrize('tok, dtype', [(tokenizer_lib.ByteTokenizer(), np.uint16),
                                        (FakeTokenizer(), np.uint32)])
def test_token_file_round_trip(tmp_path, tok, dtype):
  docs = random_docs(np.random.default_rng(2), 20, vocab=tok.vocab_size - 1)
  path = str(tmp_path / 'x.bin')
  data.write_token_file(path, iter(docs), tok)
  tokens, meta = data.open_token_file(path)
  assert isinstance(tokens, np.memmap) and tokens.dtype == dtype
  np.testing.assert_array_equal(tokens, reference_stream(docs, tok.eos_id))
  assert os.path.getsize(path) == tokens.size * np.dtype(dtype).itemsize
  assert meta['num_documents'] == 20 and meta['num_tokens'] == tokens.size
  assert (meta['vocab_size'], meta['eos_id'], meta['tokenizer']) == (
      tok.vocab_size, tok.eos_id, tok.name)
  assert sorted(os.listdir(tmp_path)) == ['x.bin', 'x.bin.json']   # no temporaries left


def test_failed_write_leaves_nothing(tmp_path):
  def docs():
    yield np.arange(5)
    yield np.array([300])   # outside the byte vocabulary
  with pytest.raises(ValueError, match='document 1'):
    data.write_token_file(str(tmp_path / 'x.bin'), docs(), tokenizer_lib.ByteTokenizer())
  assert not os.listdir(tmp_path)


def test_token_file_errors(tmp_path):
  path = str(tmp_path / 'x.bin')
  data.write_token_file(path, [np.arange(10)], tokenizer_lib.ByteTokenizer())
  with open(path, 'ab') as f:
    f.write(b'\0\0')
  with pytest.raises(ValueError, match='truncated or does not belong'):
    data.open_token_file(path)
  os.remove(path + '.json')
  with pytest.raises(FileNotFoundError, match='no metadata file'):
    data.open_token_file(path)
  with pytest.raises(FileNotFoundError, match='does not exist'):
    data.open_token_file(str(tmp_path / 'y.bin'))


# --- Pipeline -------------------------------------------------------------------------


def test_windows_match_numpy_slicing(corpus_files):
  pattern, stream = corpus_files
  seq_len = 16
  windows = data.TokenWindows(config_lib.data_files(make_cfg(pattern)), seq_len)
  assert len(windows) == (stream.size - 1) // seq_len
  for i in range(len(windows)):
    np.testing.assert_array_equal(windows[i], stream[i * seq_len:i * seq_len + seq_len + 1])


@pytest.mark.parametrize('num_tokens, num_windows', [(48, 2), (49, 3), (50, 3)])
def test_window_count_at_the_boundary(tmp_path, num_tokens, num_windows):
  # num_tokens - 1 ids plus the eos; the last window needs one token past its inputs.
  docs = [np.arange(num_tokens - 1) % 200]
  data.write_token_file(str(tmp_path / 'a.bin'), docs, tokenizer_lib.ByteTokenizer())
  windows = data.TokenWindows([str(tmp_path / 'a.bin')], 16)
  assert len(windows) == num_windows
  np.testing.assert_array_equal(windows[num_windows - 1],
                                reference_stream(docs, BYTE_EOS)[16 * num_windows - 16:][:17])
  with pytest.raises(IndexError):
    windows[num_windows]   # pylint: disable=pointless-statement


def test_unshuffled_batches_walk_the_stream_and_wrap(corpus_files):
  pattern, stream = corpus_files
  cfg = make_cfg(pattern, shuffle=False, batch_size=3)
  n = (stream.size - 1) // cfg.seq_len
  batches = take(cfg, n // 3 + 2)   # past the end of the first epoch
  got_inputs, got_targets = rows(batches), rows(batches, 'targets')
  for r in range(got_inputs.shape[0]):
    start = (r % n) * cfg.seq_len
    np.testing.assert_array_equal(got_inputs[r], stream[start:start + cfg.seq_len])
    np.testing.assert_array_equal(got_targets[r], stream[start + 1:start + cfg.seq_len + 1])
  for b in batches:
    assert {k: (v.shape, v.dtype) for k, v in b.items()} == {
        k: ((3, 16), np.float32 if k == 'weights' else np.int32)
        for k in ('inputs', 'targets', 'segment_ids', 'positions', 'weights')}


def loop_reference(inputs, eos):
  """segment_ids, positions, weights of one row, one element at a time."""
  seg, pos = 1, 0
  segment_ids, positions, weights = [], [], []
  for tok in inputs:
    segment_ids.append(seg)
    positions.append(pos)
    weights.append(0.0 if tok == eos else 1.0)
    if tok == eos:
      seg, pos = seg + 1, 0
    else:
      pos += 1
  return segment_ids, positions, weights


def test_packing_features_match_loop_reference(corpus_files):
  pattern, _ = corpus_files
  batches = take(make_cfg(pattern, seq_len=32), 6)
  checked_boundaries = 0
  for b in batches:
    for r in range(b['inputs'].shape[0]):
      seg, pos, w = loop_reference(b['inputs'][r].tolist(), BYTE_EOS)
      np.testing.assert_array_equal(b['segment_ids'][r], seg)
      np.testing.assert_array_equal(b['positions'][r], pos)
      np.testing.assert_array_equal(b['weights'][r], w)
      checked_boundaries += seg[-1] - 1
  assert checked_boundaries > 10   # the data really crossed documents


def test_no_packing_gives_plain_features(corpus_files):
  pattern, _ = corpus_files
  (b,) = take(make_cfg(pattern, pack_documents=False), 1)
  assert (b['inputs'] == BYTE_EOS).any()
  assert 'segment_ids' not in b   # the model then attends plain-causally
  np.testing.assert_array_equal(b['positions'], np.tile(np.arange(16), (4, 1)))
  np.testing.assert_array_equal(b['weights'], np.ones((4, 16)))


def window_ids(inputs, stream, seq_len):
  """Which window each row is, found by searching the reference stream."""
  lookup = {stream[i * seq_len:(i + 1) * seq_len].tobytes(): i
            for i in range((stream.size - 1) // seq_len)}
  return [lookup[row.astype(np.int64).tobytes()] for row in inputs]


def test_shuffle_is_seeded_and_changes_each_epoch(corpus_files):
  pattern, stream = corpus_files
  cfg = make_cfg(pattern)
  n = (stream.size - 1) // cfg.seq_len
  steps = 2 * n // cfg.batch_size + 1
  first = take(cfg, steps, seed=7)
  assert_batches_equal(first, take(cfg, steps, seed=7))
  assert not np.array_equal(rows(first), rows(take(cfg, steps, seed=8)))
  order = window_ids(rows(first), stream, cfg.seq_len)
  epoch0, epoch1 = order[:n], order[n:2 * n]
  assert sorted(epoch0) == sorted(epoch1) == list(range(n))   # each epoch a permutation
  assert epoch0 != epoch1 and epoch0 != list(range(n))


def test_evaluation_holds_out_the_end_of_the_training_data(corpus_files, tmp_path):
  """With evaluation on and no eval.files, its batches are the stream's last windows in
  order, and training, epoch after epoch, reads every other window and never those;
  with eval.files, training keeps all its windows and evaluation reads those files'."""
  pattern, stream = corpus_files
  data_cfg = make_cfg(pattern)
  n, held = (stream.size - 1) // data_cfg.seq_len, 2 * data_cfg.batch_size
  run = config_lib.Config(data=data_cfg, eval=config_lib.EvalConfig(every_steps=5, batches=2))
  assert config_lib.held_out_windows(run) == held
  evaluated = data.make_eval_batches(run)
  assert window_ids(rows(evaluated), stream, data_cfg.seq_len) == list(range(n - held, n))
  trained = take(data_cfg, 3 * n // data_cfg.batch_size, held_out=held)   # three epochs
  assert set(window_ids(rows(trained), stream, data_cfg.seq_len)) == set(range(n - held))
  other = np.arange(40, dtype=np.int64) % 200
  data.write_token_file(str(tmp_path / 'eval' / 'held.bin'), [other] * 8,
                        tokenizer_lib.ByteTokenizer())
  run.eval.files = str(tmp_path / 'eval' / '*.bin')
  assert config_lib.held_out_windows(run) == 0
  first = data.make_eval_batches(run)[0]['inputs'][0]
  np.testing.assert_array_equal(first, np.concatenate([other, [BYTE_EOS]])[:16])
  with pytest.raises(ValueError, match='none is left to train on'):
    take(data_cfg, 1, held_out=n)


@pytest.mark.parametrize('chunks', [1, 2, 4])
def test_row_chunks_are_the_global_batch_rows(corpus_files, chunks):
  """Each process reads rows [lo, hi) of every global step: the chunks concatenate to
  the global batch, and a process holding all rows reads the whole batch."""
  pattern, _ = corpus_files
  cfg = make_cfg(pattern, batch_size=8)
  global_batches = take(cfg, 5, seed=3)
  size = 8 // chunks
  shards = [take(cfg, 5, seed=3, rows=(c * size, (c + 1) * size)) for c in range(chunks)]
  for step, want in enumerate(global_batches):
    for k, v in want.items():
      got = np.concatenate([shards[c][step][k] for c in range(chunks)])
      np.testing.assert_array_equal(got, v, err_msg=f'step {step} {k}')


@pytest.mark.parametrize('rows', [(0, 3), (2, 6), (4, 9), (3, 3)])
def test_rows_that_are_not_an_aligned_chunk_are_refused(corpus_files, rows):
  with pytest.raises(ValueError, match=re.escape(f'rows [{rows[0]}, {rows[1]}) are not')):
    take(make_cfg(corpus_files[0], batch_size=8), 1, rows=rows)


@pytest.mark.parametrize('worker_count', [0, 1])
def test_state_round_trip_through_json(corpus_files, worker_count):
  pattern, _ = corpus_files
  cfg = make_cfg(pattern, worker_count=worker_count)
  with train_iterator(cfg, seed=5) as it:
    before = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(4)]
  with train_iterator(cfg, seed=5) as fresh:
    fresh.set_state(state)
    assert_batches_equal([next(fresh) for _ in range(4)], expected)
  # Worker processes must not change what is produced.
  assert_batches_equal(before + expected, take(make_cfg(pattern), 7, seed=5))


def test_glob_matching_nothing(tmp_path):
  with pytest.raises(FileNotFoundError, match='data.train_files'):
    data.make_train_iterator(make_cfg(str(tmp_path / 'none*.bin')), seed=0)


def test_bin_without_sidecar(corpus_files, tmp_path):
  pattern, _ = corpus_files
  os.remove(tmp_path / 'part1.bin.json')
  with pytest.raises(FileNotFoundError, match='part1.bin has no metadata'):
    data.make_train_iterator(make_cfg(pattern), seed=0)


def test_sidecars_matched_by_a_glob_are_skipped(corpus_files, tmp_path):
  _, stream = corpus_files
  windows = data.TokenWindows(data.train_files(make_cfg(str(tmp_path / 'part*'))), 16)
  assert len(windows) == (stream.size - 1) // 16


def test_files_must_match_the_tokenizer(corpus_files, tmp_path):
  pattern, _ = corpus_files
  data.write_token_file(str(tmp_path / 'part9.bin'), [np.arange(100)], FakeTokenizer())
  with pytest.raises(ValueError, match='part9.bin was written with tokenizer fake'):
    data.make_train_iterator(make_cfg(pattern), seed=0)
  with pytest.raises(ValueError, match='part9.bin'):
    data.data_info(make_cfg(pattern))


def test_data_info(corpus_files):
  info = data.data_info(make_cfg(corpus_files[0]))
  assert (info.vocab_size, info.eos_id) == (257, BYTE_EOS)
  assert data.data_info(make_cfg('')).eos_id == BYTE_EOS


def test_too_little_data(tmp_path):
  data.write_token_file(str(tmp_path / 'a.bin'), [np.arange(5)], tokenizer_lib.ByteTokenizer())
  with pytest.raises(ValueError, match='do not fill one window'):
    data.make_train_iterator(make_cfg(str(tmp_path / 'a.bin')), seed=0)


# --- prepare CLI ----------------------------------------------------------------------


def write_inputs(tmp_path, texts):
  (tmp_path / 'a.txt').write_text(texts[0], encoding='utf-8')
  (tmp_path / 'b.py').write_text(texts[1], encoding='utf-8')
  with open(tmp_path / 'c.jsonl', 'w', encoding='utf-8') as f:
    for text in texts[2:]:
      f.write(json.dumps({'id': 1, 'body': text}) + '\n')
  return [str(tmp_path / n) for n in ('a.txt', 'b.py', 'c.jsonl')]


def test_prepare_byte_round_trip(tmp_path, capsys):
  texts = ['héllo\nworld', 'def f():\n  return 1\n', 'line one', '', 'ünïcode ✓']
  out = str(tmp_path / 'out' / 'train.bin')
  prepare.main(['--input', *write_inputs(tmp_path, texts), '--output', out,
                '--jsonl_field', 'body'])
  tokens, meta = data.open_token_file(out)
  expected = [list(t.encode('utf-8')) for t in texts]
  np.testing.assert_array_equal(tokens, reference_stream(expected, BYTE_EOS))
  assert meta['num_documents'] == len(texts)
  assert f'{tokens.size} tokens' in capsys.readouterr().out


def test_prepare_runs_as_a_module_and_as_the_installed_command(tmp_path):
  """`python -m training.prepare` and the `meshlm-prepare` entry point, as processes."""
  texts = ['héllo\nworld', 'def f():\n  return 1\n', 'line one', 'ünïcode ✓']
  inputs = write_inputs(tmp_path, texts)
  command = shutil.which('meshlm-prepare')
  assert command, 'meshlm-prepare is not installed: pip install -e ".[dev]"'
  env = {**os.environ, 'PYTHONPATH': ROOT}   # this checkout's code, not another install's
  for name, argv in (('module', [sys.executable, '-m', 'training.prepare']),
                     ('script', [command])):
    out = tmp_path / name / 'train.bin'
    result = subprocess.run([*argv, '--input', *inputs, '--output', str(out),
                             '--jsonl_field', 'body'], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (name, result.stderr[-3000:])
    tokens, _ = data.open_token_file(str(out))
    expected = [list(t.encode('utf-8')) for t in texts]
    np.testing.assert_array_equal(tokens, reference_stream(expected, BYTE_EOS))
    assert f'{tokens.size} tokens' in result.stdout


def test_prepare_hf_round_trip(tmp_path):
  texts = sample_texts(np.random.default_rng(3), 12)
  ref = train_hf_tokenizer(tmp_path / 'tokenizer.json', texts)
  out = str(tmp_path / 'train.bin')
  prepare.main(['--input', *write_inputs(tmp_path, texts), '--output', out, '--tokenizer',
                str(tmp_path / 'tokenizer.json'), '--jsonl_field', 'body'])
  tokens, meta = data.open_token_file(out)
  eos = ref.token_to_id('<|endoftext|>')
  expected = [ref.encode(t).ids for t in texts]
  np.testing.assert_array_equal(tokens, reference_stream(expected, eos))
  assert meta['eos_id'] == eos and meta['num_documents'] == len(texts)


def test_prepare_missing_jsonl_field(tmp_path, capsys):
  (tmp_path / 'd.jsonl').write_text('{"text": "a"}\n{"txt": "b"}\n', encoding='utf-8')
  out = tmp_path / 'out.bin'
  with pytest.raises(SystemExit) as e:
    prepare.main(['--input', str(tmp_path / 'd.jsonl'), '--output', str(out)])
  assert e.value.code != 0
  assert 'd.jsonl:2' in capsys.readouterr().err
  assert sorted(os.listdir(tmp_path)) == ['d.jsonl']


def test_prepare_missing_input(tmp_path, capsys):
  (tmp_path / 'a.txt').write_text('x', encoding='utf-8')
  with pytest.raises(SystemExit) as e:
    prepare.main(['--input', str(tmp_path / 'a.txt'), str(tmp_path / 'gone.txt'),
                  '--output', str(tmp_path / 'out.bin')])
  assert e.value.code != 0
  assert 'gone.txt' in capsys.readouterr().err
  assert sorted(os.listdir(tmp_path)) == ['a.txt']


# --- Default corpus -------------------------------------------------------------------


def test_default_corpus_is_built_once(tmp_path, monkeypatch):
  cfg = make_cfg('', cache_dir=str(tmp_path / 'cache'), corpus_max_mb=1)
  path = corpus.default_corpus(cfg)
  assert path.startswith(str(tmp_path / 'cache')) and 'byte' in path and '1mb' in path
  tokens, meta = data.open_token_file(path)
  assert meta['num_tokens'] - meta['num_documents'] >= 1 << 20
  assert meta['num_tokens'] - meta['num_documents'] < 2 << 20
  # Independent check of the first document: the alphabetically first stdlib module.
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  first = sorted(p for p in root.glob('*.py'))[0].read_bytes()
  np.testing.assert_array_equal(tokens[:len(first) + 1], list(first) + [BYTE_EOS])

  mtime = os.stat(path).st_mtime_ns
  monkeypatch.setattr(corpus, '_build', lambda *a: pytest.fail('corpus rebuilt'))
  assert corpus.default_corpus(cfg) == path
  assert os.stat(path).st_mtime_ns == mtime
  (b,) = take(cfg, 1)   # empty train_files trains on it
  assert b['inputs'].shape == (4, 16)
