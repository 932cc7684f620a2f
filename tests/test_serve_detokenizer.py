"""Streamed text equals the full decode (cut at the first stop string), whatever the tokens."""

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from serve.engine.detokenizer import IncrementalDetokenizer
from training.tokenizer import ByteTokenizer, HFTokenizer

CORPUS = ['the cat sat on the mat', 'héllo wörld, the café is open', '世界 hello 世界 🎉 party',
          'a stop here and a STOP there', 'numbers 123 and 456 and the end'] * 3


def make_tokenizer(tmp_path, kind):
  """A small BPE, no downloads: ByteLevel (GPT-2, Llama-3), Metaspace (SentencePiece) or
  byte fallback (Llama-2, Mistral)."""
  tok = byte_fallback_tokenizer() if kind == 'bytefallback' else train_tokenizer(kind)
  path = tmp_path / f'{kind}.json'
  tok.save(str(path))
  return HFTokenizer(str(path))


def byte_fallback_tokenizer():
  """Llama-2's layout: '▁' for spaces, <0xNN> tokens for characters not in the vocab, and a
  decoder that strips the first space."""
  vocab = {'<unk>': 0, '<s>': 1, '</s>': 2}
  vocab.update({f'<0x{b:02X}>': 3 + b for b in range(256)})
  for piece in sorted(set('abcdefghijklmnopqrstuvwxyz,.!0123456789▁')):
    vocab[piece] = len(vocab)
  merges = [('▁', 't'), ('h', 'e'), ('▁t', 'he'), ('a', 't'), ('▁', 'c')]
  vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
  tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token='<unk>', byte_fallback=True))
  tok.normalizer = normalizers.Sequence([normalizers.Prepend('▁'), normalizers.Replace(' ', '▁')])
  tok.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(' ', 1, 0)])
  tok.add_special_tokens(['<unk>', '<s>', '</s>'])
  return tok


def train_tokenizer(kind):
  tok = tokenizers.Tokenizer(models.BPE(unk_token=None if kind == 'bytelevel' else '<unk>'))
  if kind == 'bytelevel':
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
  else:
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first')
    tok.decoder = decoders.Metaspace(replacement='▁', prepend_scheme='first')
    alphabet = sorted(set(''.join(CORPUS)))
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=['<|endoftext|>', '<unk>'],
                                initial_alphabet=alphabet, show_progress=False)
  tok.train_from_iterator(CORPUS, trainer)
  return tok


def stream(tokenizer, prompt_ids, output_ids, stop=(), include_stop=False):
  """All pieces (flush included) and the stop matched."""
  detok = IncrementalDetokenizer(tokenizer, prompt_ids, list(stop), include_stop)
  pieces, matched = [], None
  for t in output_ids:
    piece, hit = detok.add(t)
    pieces.append(piece)
    if hit is not None:
      matched = hit
      break
  pieces.append(detok.flush())
  assert detok.text == ''.join(pieces)
  # flush can still meet a stop: one ending in the U+FFFD of an unfinished character
  assert matched is None or detok.stop_matched == matched
  return pieces, detok.stop_matched


def cut_at_first_stop(text, stops, include_stop=False):
  """Reference: grow the text a character at a time until some stop string ends it."""
  for end in range(1, len(text) + 1):
    ending = [s for s in stops if text[:end].endswith(s)]
    if ending:
      stop = max(ending, key=len)
      return text[:end] if include_stop else text[:end - len(stop)], stop
  return text, None


TEXT = 'héllo 世界 🎉 ok'


def test_byte_tokenizer_multibyte_characters():
  tok = ByteTokenizer()
  ids = tok.encode(TEXT).tolist()
  pieces, matched = stream(tok, tok.encode('prompt: ').tolist(), ids)
  assert ''.join(pieces) == TEXT and matched is None
  assert all('\ufffd' not in p for p in pieces)
  assert '' in pieces[:-1]            # some bytes were held until their character completed


def test_byte_tokenizer_incomplete_tail_flushed_as_replacement():
  tok = ByteTokenizer()
  ids = tok.encode('ab世').tolist()[:-1]      # the last character cut short
  pieces, _ = stream(tok, [], ids)
  assert pieces[:-1] == ['a', 'b', '', ''] and ''.join(pieces) == tok.decode(ids)


@pytest.mark.parametrize('kind', ['bytelevel', 'metaspace', 'bytefallback'])
def test_hf_tokenizer_keeps_word_spacing(tmp_path, kind):
  tok = make_tokenizer(tmp_path, kind)
  prompt = tok.encode('the cat').tolist()
  # Llama-2's normaliser puts the space before the first word itself
  output = tok.encode(('' if kind == 'bytefallback' else ' ') + 'sat on the mat, ' + TEXT)
  output = output.tolist()
  if kind == 'bytelevel':
    want = tok.decode(output)
  else:   # spacing depends on context: compare with the decode of it all
    want = tok.decode(prompt + output)[len(tok.decode(prompt)):]
    naive = ''.join(tok.decode([t]) for t in output)
    assert naive != want        # one-token decodes lose the spaces: the test has teeth
  if kind != 'metaspace':
    assert any('\ufffd' in tok.decode([t]) for t in output)   # characters split over tokens
  assert want.startswith(' sat on')
  pieces, _ = stream(tok, prompt, output)
  assert ''.join(pieces) == want
  assert all('\ufffd' not in p for p in pieces)


def byte_stream(text, stop, include_stop=False):
  tok = ByteTokenizer()
  return stream(tok, [], tok.encode(text).tolist(), stop, include_stop)


def test_stop_single_token():
  pieces, matched = byte_stream('ab!cd', ['!'])
  assert pieces == ['a', 'b', '', ''] and matched == '!'


def test_stop_split_across_tokens():
  pieces, matched = byte_stream('xyEND tail', ['END'])
  assert pieces == ['x', 'y', '', '', '', ''] and matched == 'END'
  pieces, matched = byte_stream('a世b', ['世'])         # a stop inside one character's bytes
  assert ''.join(pieces) == 'a' and matched == '世'


def test_stop_false_start_is_released():
  pieces, matched = byte_stream('zabxy', ['abc'])
  assert pieces == ['z', '', '', 'abx', 'y', ''] and matched is None


def test_stop_at_the_first_token():
  pieces, matched = byte_stream('Hello', ['H'])
  assert pieces == ['', ''] and matched == 'H'
  pieces, matched = byte_stream('STOPnow', ['STOP'])
  assert ''.join(pieces) == '' and matched == 'STOP'


def test_stop_strings_prefix_of_each_other():
  assert byte_stream('xabcd', ['abc', 'ab'])[1] == 'ab'
  assert ''.join(byte_stream('xabcd', ['abc', 'ab'])[0]) == 'x'
  assert ''.join(byte_stream('xabcd', ['ab', 'abc'], include_stop=True)[0]) == 'xab'
  # the stop completed first wins, though another began earlier
  pieces, matched = byte_stream('xyzw', ['xyzw', 'z'])
  assert ''.join(pieces) == 'xy' and matched == 'z'
  pieces, matched = byte_stream('xabc', ['bc', 'abc'])    # both end at 'c': the longer wins
  assert ''.join(pieces) == 'x' and matched == 'abc'


def test_include_stop():
  pieces, matched = byte_stream('one. two', ['. '], include_stop=True)
  assert ''.join(pieces) == 'one. ' and matched == '. '


def test_adds_after_a_stop_are_ignored():
  detok = IncrementalDetokenizer(ByteTokenizer(), [], ['b'])
  assert [detok.add(t) for t in b'abc'] == [('a', None), ('', 'b'), ('', None)]
  assert detok.flush() == '' and detok.text == 'a' and detok.stop_matched == 'b'


def test_min_tokens_looks_for_stops_only_after_them():
  """No stop may end in the text of the first min_tokens tokens; one that begins there and
  ends later counts (vLLM's window)."""
  def run(text, stop, min_tokens):
    detok = IncrementalDetokenizer(ByteTokenizer(), [], stop, min_tokens=min_tokens)
    pieces = [detok.add(t) for t in text.encode()]
    return [p for p, _ in pieces], detok.stop_matched, detok.text + detok.flush()
  pieces, matched, text = run('a!b!c', ['!'], 2)
  assert pieces == ['a', '!', 'b', '', ''] and matched == '!' and text == 'a!b'
  assert run('a!b!c', ['!'], 0)[2] == 'a'
  assert run('xyEND tail', ['END'], 4)[1:] == ('END', 'xy')   # straddles: it counts
  assert run('xyEND tail', ['END'], 5)[1:] == (None, 'xyEND tail')   # ends inside: not
  assert run('xyEND tail', ['END'], 2)[1:] == ('END', 'xy')
  assert run('aENDbEND', ['END'], 4)[1:] == ('END', 'aENDb')   # the first one ended early
  assert run('xx', ['x'], 2)[1:] == (None, 'xx')   # min_tokens = every token: no stop


def test_hf_stop_string_inside_one_token(tmp_path):
  tok = make_tokenizer(tmp_path, 'bytelevel')
  output = tok.encode(' the cat sat on the mat').tolist()
  assert any(tok.decode([t]) == ' cat' for t in output)    # ' cat' is one token
  pieces, matched = stream(tok, [], output, ['at s'])
  assert ''.join(pieces) == ' the c' and matched == 'at s'


@pytest.mark.parametrize('kind', ['byte', 'bytelevel', 'metaspace', 'bytefallback'])
def test_random_streams_match_the_full_decode(tmp_path, kind):
  rng = np.random.default_rng(0)
  tok = ByteTokenizer() if kind == 'byte' else make_tokenizer(tmp_path, kind)
  pool = [[t] for t in tok.encode('the café 世界 🎉 sat ab abc\n').tolist()]
  if kind == 'bytefallback':
    # Whole characters only: its decoder turns an invalid run of byte tokens into one
    # U+FFFD per byte, so a later bad byte rewrites earlier text no stream can take back.
    pool = [tok.encode(w).tolist() for w in ['the', 'cat', 'é', '世', '界', '🎉', 'ab', 'c']]
  pool += [[t] for t in range(tok.vocab_size) if kind != 'bytefallback' or t >= 259]
  prompt = tok.encode('the cat').tolist()
  for trial in range(150):
    output = sum((pool[i] for i in rng.integers(0, len(pool), rng.integers(1, 30))), [])
    full = tok.decode(prompt + output)
    assert full.startswith(tok.decode(prompt))
    text = full[len(tok.decode(prompt)):]
    stops = random_stops(rng, text) if trial % 3 else []
    include = bool(trial % 2)
    pieces, matched = stream(tok, prompt, output, stops, include)
    want, want_stop = cut_at_first_stop(text, stops, include)
    assert (''.join(pieces), matched) == (want, want_stop), (trial, output, stops)
    if not include:
      assert not any(s in ''.join(pieces) for s in stops)


def random_stops(rng, text):
  """Substrings of the text (so they do occur), plus one that probably does not."""
  stops = []
  for _ in range(rng.integers(1, 4)):
    if len(text) >= 2:
      start = int(rng.integers(0, len(text) - 1))
      stops.append(text[start:start + int(rng.integers(1, 4))])
  return [s for s in stops if s] + ['zzq']


@pytest.mark.parametrize('kind', ['bytelevel', 'metaspace'])
def test_special_tokens_are_written_only_when_asked(tmp_path, kind):
  """skip_special_tokens=False (vLLM's): a special token's content is in the text, as the
  full decode with specials has it, streamed one token at a time."""
  tokenizer = make_tokenizer(tmp_path, kind)
  eot = tokenizer._tok.token_to_id('<|endoftext|>')  # pylint: disable=protected-access
  words = tokenizer.encode('the cat sat').tolist()
  output = words + [eot] + tokenizer.encode(' on the mat').tolist()
  kept = IncrementalDetokenizer(tokenizer, [], [], skip_special_tokens=False)
  skipped = IncrementalDetokenizer(tokenizer, [], [])
  for t in output:
    kept.add(t)
    skipped.add(t)
  kept.flush()
  skipped.flush()
  assert '<|endoftext|>' in kept.text
  assert kept.text == tokenizer.decode(output, skip_special_tokens=False)
  assert skipped.text == tokenizer.decode(output) and '<|endoftext|>' not in skipped.text
