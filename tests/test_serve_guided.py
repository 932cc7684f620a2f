"""Structured output's token side: each token's bytes as the tokenizer decodes them, and
guides that, followed anywhere they allow, only ever spell a match of their expression."""

import json
import re

import numpy as np
import pytest

from serve import guided
from serve.sampling_params import from_openai
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
  decoding = guided.GuidedDecoding(tok, eos)
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
      with pytest.raises(ValueError, match='cannot be followed with this vocabulary'):
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
  g = guided.GuidedDecoding(tok, tok.eos_id).guide('(ab|cd)e')
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
