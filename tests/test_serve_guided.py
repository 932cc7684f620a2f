"""Structured output's token side: each token's bytes as the tokenizer decodes them, and
guides that, followed anywhere they allow, only ever spell a match of their expression."""

import json
import re

import numpy as np
import pytest

from serve.api.openai_sampling import from_openai, guided_field
from serve.sampling_params import SamplingParamsError
from serve.structured import guided
from serve.worker.logits_adjust import unpack_bits
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


# Grammars no regular expression has: a^n c b^n, and lists of digits nested to any depth.
NEST = {'gbnf': 'root ::= "a" root "b" | "c"', 'lark': 'start: "a" start "b" | "c"'}
LISTS = {'gbnf': 'root ::= "[" (item ("," item)*)? "]"\nitem ::= [0-9] | root',
         'lark': 'start: list\nlist: "[" (item ("," item)*)? "]"\nitem: /[0-9]/ | list'}


def _walk(decoding, grammar, rng, eos, limit=200):
  """Tokens drawn at random among those a new guide allows, until eos (None past limit)."""
  g, out = decoding.guide(grammar=grammar), []
  while len(out) < limit:
    allowed = np.flatnonzero(g.allowed())
    assert len(allowed)
    token = int(rng.choice(allowed))
    if token == eos:
      return out
    g.advance(token)
    out.append(token)
  return None


def _depth(value) -> int:
  return 1 + max((_depth(v) for v in value if isinstance(v, list)), default=0)


@pytest.mark.parametrize('syntax', ['gbnf', 'lark'])
@pytest.mark.parametrize('kind', ['byte', 'bytelevel', 'bytefallback'])
def test_any_walk_a_grammar_guide_allows_spells_a_sentence_of_it(tmp_path, kind, syntax):
  """Random walks through what a grammar's guide allows end in sentences of the grammar,
  checked by a recognizer of our own: a^n c b^n, and lists of digits nested to any
  depth, read back with json.loads."""
  tok = ByteTokenizer() if kind == 'byte' else make_tokenizer(tmp_path, kind)
  eos = tok.eos_id
  decoding = guided.GuidedDecoding(tok, [eos])
  rng = np.random.default_rng(4)
  nest = from_openai({'guided_grammar': NEST[syntax]}, tok.vocab_size).guided_grammar
  sizes = []
  for _ in range(12):
    text = tok.decode(_walk(decoding, nest, rng, eos))
    m = re.fullmatch('(a*)c(b*)', text)
    assert m and len(m[1]) == len(m[2]), (kind, text)
    sizes.append(len(m[1]))
  assert max(sizes) >= 2   # the recursion was taken, more than once
  lists = from_openai({'guided_grammar': LISTS[syntax]}, tok.vocab_size).guided_grammar
  depths = []
  for _ in range(12):
    out = _walk(decoding, lists, rng, eos)
    if out is None:   # a walk may nest deeper than the limit allows it to close
      continue
    value = json.loads(tok.decode(out))
    assert isinstance(value, list) and _flat_digits(value), (kind, tok.decode(out))
    depths.append(_depth(value))
  assert len(depths) >= 6 and max(depths) >= 2, depths   # nested, at least once


def test_grammars_need_a_token_for_every_byte(tmp_path):
  """llguidance spells the text a grammar forces with the vocabulary's byte tokens: a
  tokenizer without them (the metaspace one here, no byte fallback) is refused, with
  what to use instead, before any request is guided astray."""
  tok = make_tokenizer(tmp_path, 'metaspace')
  decoding = guided.GuidedDecoding(tok, [tok.eos_id])
  for _ in range(2):   # the second time from the refusal kept, not a rescan
    with pytest.raises(ValueError, match='a token for each of the 256 bytes.*use guided_regex'):
      decoding.compile(grammar=NEST['gbnf'])
  assert decoding.guide('(a|b)c') is not None   # regular expressions are still followed


def _flat_digits(value) -> bool:
  return all(_flat_digits(v) if isinstance(v, list) else v in range(10) and
             not isinstance(v, bool) for v in value)


def test_grammar_guides_allow_every_eos_at_the_end_and_refuse_the_rest(tmp_path):
  """Where the grammar may end, each of the model's end tokens may come; a token the
  grammar does not allow, advanced anyway, is a ValueError naming it."""
  tok = make_tokenizer(tmp_path, 'bytelevel')
  tok._tok.add_special_tokens(['<|eot|>'])
  tok.vocab_size = tok._tok.get_vocab_size(with_added_tokens=True)
  eot = tok._tok.token_to_id('<|eot|>')
  decoding = guided.GuidedDecoding(tok, [tok.eos_id, eot])
  g = decoding.guide(grammar='root ::= "c" | "a" root "b"')
  first = set(np.flatnonzero(g.allowed()))
  assert first == {tok._tok.token_to_id('a'), tok._tok.token_to_id('c')}, first
  g.advance(tok._tok.token_to_id('c'))
  assert g.is_finished and sorted(np.flatnonzero(g.allowed())) == sorted([tok.eos_id, eot])
  g = decoding.guide(grammar='root ::= "c" | "a" root "b"')
  with pytest.raises(ValueError, match=f'token {tok._tok.token_to_id("b")} does not follow'):
    g.advance(tok._tok.token_to_id('b'))


def test_a_grammar_parser_in_error_fails_its_request_alone():
  """llguidance does not raise: a parser in error allows eos alone, which would end the
  request as a 'stop' that does not match. Here the tokenizer's encode, which llguidance
  calls to spell forced text, fails: the guide refuses with a ValueError (one request
  fails) instead."""

  class Broken(ByteTokenizer):
    def encode(self, text, add_special_tokens=False):
      raise RuntimeError('encode broke')

  decoding = guided.GuidedDecoding(Broken(), [256])
  with pytest.raises(ValueError, match="grammar's parser failed: .*encode broke"):
    decoding.guide(grammar='root ::= "[" "1" "]"')


def test_tokens_too_long_for_llguidance_are_left_out_of_grammars(tmp_path):
  """A 2,000-byte token (a BPE trained on code has such) made llguidance's token trie
  panic: it is left out of the vocabulary grammars use, and the rest works."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  tok = make_tokenizer(tmp_path, 'bytelevel')
  tok._tok.add_tokens([tokenizers.AddedToken('x' * 2000, special=False)])
  tok.vocab_size = tok._tok.get_vocab_size(with_added_tokens=True)
  long = tok._tok.token_to_id('x' * 2000)
  decoding = guided.GuidedDecoding(tok, [tok.eos_id])
  g = decoding.guide(grammar='root ::= "x"+')
  first = np.flatnonzero(g.allowed())
  assert tok._tok.token_to_id('x') in first and long not in first


def test_llguidance_panics_become_value_errors():
  """pyo3's PanicException is a BaseException, past the engine's `except ValueError`:
  each llguidance call the guides make goes through _llguidance_panics, which turns one
  (here a real one: its token trie on a 2,000-byte token) into a ValueError."""
  import llguidance  # pylint: disable=import-outside-toplevel

  class Vocabulary:   # what llguidance.TokenizerWrapper reads
    eos_token_id, bos_token_id, special_token_ids = 257, None, [257]
    tokens = [bytes([b]) for b in range(256)] + [b'x' * 2000, b'<eos>']

    def __call__(self, text):
      raise TypeError('unused')

  with pytest.raises(ValueError, match='llguidance failed: .*num_parents'):
    with guided._llguidance_panics():   # pylint: disable=protected-access
      llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=258,
                             eos_token=[257])


@pytest.mark.parametrize('text,why', [
    ('root ::= ( "a"', 'is not a Lark or GBNF grammar'),
    ('start: foo\nfoo: "a" bar', 'unknown name: "bar"'),
    ('', 'must be a grammar in Lark or GBNF syntax'),
    (['root ::= "a"'], 'must be a grammar in Lark or GBNF syntax'),
    ('root ::= "' + 'a' * guided.MAX_GRAMMAR_CHARS + '"', 'at most'),
])
def test_grammars_that_cannot_be_read_are_refused_with_the_field(text, why):
  with pytest.raises(SamplingParamsError, match=why) as err:
    from_openai({'guided_grammar': text}, 257)
  assert err.value.param == 'guided_grammar'


def test_structured_outputs_asks_what_the_older_fields_ask():
  """vLLM's structured_outputs: each key gives the request its older field would, and
  what it cannot mean is refused naming the field."""
  schema = {'type': 'object', 'properties': {'k': {'type': 'boolean'}}, 'required': ['k']}
  same = [({'json': schema}, {'guided_json': schema}),
          ({'json': schema, 'whitespace_pattern': '[ ]*'},
           {'guided_json': schema, 'guided_whitespace_pattern': '[ ]*'}),
          ({'regex': '[a-z]+'}, {'guided_regex': '[a-z]+'}),
          ({'choice': ['x', 'y']}, {'guided_choice': ['x', 'y']}),
          ({'grammar': NEST['gbnf']}, {'guided_grammar': NEST['gbnf']}),
          ({'json_object': True}, {'response_format': {'type': 'json_object'}}),
          ({'json': None, 'structural_tag': None}, {}),
          ({'json': False, 'regex': False, 'json_object': False}, {})]
  for new, old in same:
    a, b = from_openai({'structured_outputs': new}, 257), from_openai(old, 257)
    assert (a.guided_regex, a.guided_grammar) == (b.guided_regex, b.guided_grammar), new
  assert from_openai({'structured_outputs': {'grammar': NEST['gbnf']}}, 257).guided
  for bad, why in [({'json': schema, 'regex': 'a'}, 'give one of'),
                   ({'structural_tag': '{"x": 1}'}, 'not supported here'),
                   ({'json_object': 'yes'}, 'json_object must be true'),
                   ({'json_object': 0}, 'json_object must be true'),
                   ({'json': 0}, 'must be a JSON schema'),
                   ({'regex': 'a', 'whitespace_pattern': ' '}, 'whitespace pattern'),
                   ({'choice': []}, 'non-empty list'),
                   ({'grammar': 'root ::= ('}, 'not a Lark or GBNF grammar'),
                   (['json'], 'must be an object')]:
    with pytest.raises(SamplingParamsError, match=why) as err:
      from_openai({'structured_outputs': bad}, 257)
    assert err.value.param == 'structured_outputs', bad
  assert guided_field({'structured_outputs': {'json': None}}) is None   # asks nothing
  with pytest.raises(SamplingParamsError, match='whitespace pattern') as err:
    from_openai({'structured_outputs': {'regex': 'a'}, 'guided_whitespace_pattern': ' '}, 257)
  assert err.value.param == 'guided_whitespace_pattern'   # where the pattern came from
  with pytest.raises(SamplingParamsError, match='give one of') as err:
    from_openai({'structured_outputs': {'regex': 'a'}, 'guided_regex': 'b'}, 257)
  with pytest.raises(SamplingParamsError, match='give one of'):
    from_openai({'guided_grammar': NEST['gbnf'], 'guided_regex': 'b'}, 257)
