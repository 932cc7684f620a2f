"""Structured output's token side: each token's bytes as the tokenizer decodes them, and
guides that, followed anywhere they allow, only ever spell a match of their expression."""

import json
import re

import numpy as np
import pytest

from serve import guided
from serve.sampler import unpack_bits
from serve.sampling_params import SamplingParamsError, from_openai
from tests.test_serve_detokenizer import make_tokenizer
from training.tokenizer import ByteTokenizer

KINDS = ['bytelevel', 'metaspace', 'bytefallback']


@pytest.mark.parametrize('kind', KINDS)
def test_token_bytes_concatenate_to_the_tokenizers_decode(tmp_path, kind):
  """Random runs of ordinary tokens: their bytes joined decode to the tokenizer's text
  (SentencePiece-style decoders drop one leading space, at the very start only)."""
  tok = make_tokenizer(tmp_path, kind)
  table = guided.token_bytes(tok)
  special = {tok._tok.token_to_id(t) for t in ('<|endoftext|>', '<unk>', '<s>', '</s>')}
  assert not special & set(table) and len(table) >= tok.vocab_size - len(special - {None})
  ids = np.array(sorted(table))
  rng, checked = np.random.default_rng(0), 0
  for _ in range(2000):   # runs whose bytes are whole UTF-8 (decoders differ on broken ones)
    seq = rng.choice(ids, size=int(rng.integers(1, 12))).tolist()
    try:
      text = b''.join(table[t] for t in seq).decode('utf-8')
    except UnicodeDecodeError:
      continue
    want = tok.decode(seq)
    assert want in (text, text[1:] if text.startswith(' ') and kind != 'bytelevel' else text)
    checked += 1
  assert checked >= 50
  if kind == 'bytefallback':
    assert table[tok._tok.token_to_id('<0x0A>')] == b'\n'


@pytest.mark.parametrize('kind', ['byte'] + KINDS)
def test_any_walk_a_guide_allows_spells_a_match(tmp_path, kind):
  """Tokens drawn at random among those allowed, until eos: the text matches the
  expression (choices, a regular expression, a JSON schema), whatever the tokenizer."""
  tok = ByteTokenizer() if kind == 'byte' else make_tokenizer(tmp_path, kind)
  eos = tok.eos_id
  decoding = guided.GuidedDecoding(tok, [eos])
  schema = {'type': 'object', 'properties': {'n': {'type': 'integer'},
                                             'w': {'enum': ['the cat', 'héllo']}},
            'required': ['n', 'w']}
  cases = {'guided_choice': ['the cat', 'sat', 'héllo wörld'],
           'guided_regex': '(the|a) [a-z]{1,6}( [0-9]{1,3})?',
           'guided_json': schema}
  rng = np.random.default_rng(1)
  for field, value in cases.items():
    regex = from_openai({field: value}, tok.vocab_size).guided_regex
    if kind == 'metaspace' and field == 'guided_json':   # trained without '{' and no bytes
      with pytest.raises(ValueError, match='cannot be compiled for the model.s vocabulary'):
        decoding.guide(regex)
      continue
    for _ in range(8):
      g, out = decoding.guide(regex), []
      while True:
        allowed = np.flatnonzero(g.allowed())
        assert len(allowed) and len(out) < 64
        token = int(rng.choice(allowed))
        if token == eos:
          break
        g.advance(token)
        out.append(token)
      text = tok.decode(out)
      assert g.is_finished and re.fullmatch(regex, text), (kind, text)
      if field == 'guided_json':
        assert set(json.loads(text)) == {'n', 'w'}


def test_the_allowed_mask_is_the_guides_token_set():
  tok = ByteTokenizer()
  g = guided.GuidedDecoding(tok, [tok.eos_id]).guide('(ab|cd)e')
  assert np.flatnonzero(g.allowed()).tolist() == [ord('a'), ord('c')]
  for t in b'cde':
    g.advance(t)
  assert np.flatnonzero(g.allowed()).tolist() == [tok.eos_id] and g.is_finished


def test_response_format_shapes():
  assert guided.response_format_regex({'type': 'text'}) is None
  whole = guided.response_format_regex({'type': 'json_object'})
  assert re.fullmatch(whole, '{"a": [1, {"b": null}], "c": "d"}'.replace(': ', ':'))
  assert not re.fullmatch(whole, '[1, 2]')
  named = guided.response_format_regex({'type': 'json_schema', 'json_schema': {
      'name': 'n', 'schema': {'type': 'object', 'properties': {'k': {'type': 'boolean'}},
                              'required': ['k']}}})
  assert re.fullmatch(named, '{"k":true}') and not re.fullmatch(named, '{"k":1}')
  for bad in ({'type': 'xml'}, {'type': 'json_schema', 'json_schema': {'name': 'n'}}, 'json'):
    with pytest.raises(ValueError, match='response_format'):
      guided.response_format_regex(bad)


def test_added_tokens_are_their_text_and_every_eos_ends_a_match(tmp_path):
  """An added (not special) token is its own text, even under a ByteLevel decoder; where
  eos may come, so may each of the model's other end tokens (Llama-3.1's <|eot_id|>)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  tok = make_tokenizer(tmp_path, 'bytelevel')
  tok._tok.add_tokens([tokenizers.AddedToken('\n\n', special=False),
                       tokenizers.AddedToken('héllo', special=False)])
  tok._tok.add_special_tokens(['<|eot|>'])
  tok.vocab_size = tok._tok.get_vocab_size(with_added_tokens=True)
  table = guided.token_bytes(tok)
  assert table[tok._tok.token_to_id('\n\n')] == b'\n\n'
  assert table[tok._tok.token_to_id('héllo')] == 'héllo'.encode()
  eot = tok._tok.token_to_id('<|eot|>')
  assert eot not in table
  g = guided.GuidedDecoding(tok, [tok.eos_id, eot]).guide('(héllo|x)')
  first = np.flatnonzero(g.allowed())
  assert tok._tok.token_to_id('héllo') in first and eot not in first
  g.advance(tok._tok.token_to_id('héllo'))
  assert sorted(np.flatnonzero(g.allowed())) == sorted([tok.eos_id, eot])


def test_words_unpack_to_the_allowed_tokens_on_numpy_and_jax():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(2)
  mask = rng.random((3, 77)) < 0.3
  words = np.zeros((3, 3), np.uint32)
  for r, c in zip(*np.nonzero(mask)):
    words[r, c // 32] |= np.uint32(1 << (c % 32))
  assert (unpack_bits(words, 77) == mask).all()
  assert (np.asarray(unpack_bits(jnp.asarray(words), 77)) == mask).all()


def test_whitespace_pattern_reaches_json_only():
  schema = {'type': 'object', 'properties': {'k': {'type': 'boolean'}}, 'required': ['k']}
  spaced = from_openai({'guided_json': schema, 'guided_whitespace_pattern': '[ \\n]*'},
                       257).guided_regex
  assert re.fullmatch(spaced, '{\n  "k" : true\n}')
  assert not re.fullmatch(from_openai({'guided_json': schema}, 257).guided_regex,
                          '{\n  "k" : true\n}')
  with pytest.raises(SamplingParamsError) as err:
    from_openai({'guided_regex': 'a', 'guided_whitespace_pattern': ' '}, 257)
  assert err.value.param == 'guided_whitespace_pattern'
  assert from_openai({'response_format': {'type': 'text'}, 'guided_regex': 'a'},
                     257).guided_regex == 'a'
