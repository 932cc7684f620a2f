"""The families' tokenizers as they ship them (tests/hf_styles.py: Qwen's byte-level BPE,
Mistral's byte fallback) through meshlm's tokenizer and streaming detokenizer, with
transformers' PreTrainedTokenizerFast on the same tokenizer.json as the reference."""

import pytest

from serve.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer
from training.tokenizer import bytes_to_unicode
from tests.hf_styles import CHATML, CORPUS, UNSEEN, style  # noqa: F401  (style: a fixture)


def test_encode_and_decode_match_transformers_and_round_trip(style):
  name, ours, ref = style
  for text in CORPUS[:6] + [UNSEEN]:
    for specials in (False, True):
      ids = ours.encode(text, specials).tolist()
      assert ids == ref.encode(text, add_special_tokens=specials), (text, specials)
      assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
  assert ours.encode_batch([UNSEEN])[0].tolist() == ref.encode(UNSEEN, add_special_tokens=False)
  # A Mistral prompt starts with <s>; a Qwen one with nothing.
  assert ours.special_tokens_around(UNSEEN) == ((1, 0) if name == 'mistral' else (0, 0))


def test_characters_outside_the_vocabulary_become_byte_tokens(style):
  """Byte fallback spells an unseen character in its UTF-8 bytes, <0xNN> each, with no
  <unk>; byte-level BPE has every byte in its alphabet."""
  name, ours, ref = style
  ids = ours.encode('東🌤').tolist()
  pieces = ref.convert_ids_to_tokens(ids)
  if name == 'mistral':
    assert pieces == ['▁'] + [f'<0x{b:02X}>' for b in '東🌤'.encode()]
    assert ids[1:] == [3 + b for b in '東🌤'.encode()]
  else:
    assert ''.join(pieces) == _byte_level('東🌤')
  assert ours.token_text(ids[-1]) == pieces[-1]
  assert '<unk>' not in pieces
  assert ours.decode(ids) == '東🌤'


def _byte_level(text: str) -> str:
  table = bytes_to_unicode()
  return ''.join(table[b] for b in text.encode())


@pytest.mark.parametrize('skip', [True, False])
def test_special_tokens_are_single_ids_kept_or_skipped(style, skip):
  name, ours, ref = style
  if name == 'mistral':
    specials = ['<s>', '[INST]', '[/INST]', '</s>', '[TOOL_CALLS]']
    text = '<s>[INST] 東京? 🌤[/INST] sunny</s>[TOOL_CALLS] [{"name": "f"}]</s>'
  else:
    specials = CHATML[1:]
    text = '<|im_start|>user\n東京? 🌤<|im_end|>\n<|im_start|>assistant\nsunny<|im_end|>'
  ids = ours.encode(text).tolist()
  assert ids == ref.encode(text, add_special_tokens=False)
  for token in specials:
    assert ids.count(ref.convert_tokens_to_ids(token)) == text.count(token), token
  assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
  if not skip:
    assert ours.decode(ids, False) == text
  else:
    assert not any(token in ours.decode(ids) for token in specials)


def _stream(ours, prompt, output, skip=True) -> list[str]:
  detok = IncrementalDetokenizer(ours, prompt, stop=[], skip_special_tokens=skip)
  pieces = [detok.add(t)[0] for t in output]
  pieces.append(detok.flush())
  assert ''.join(pieces) == detok.text
  return pieces


@pytest.mark.parametrize('skip', [True, False])
def test_streamed_text_is_the_whole_decode_in_whole_characters(style, skip):
  """The detokenizer fed one id at a time (a multi-byte character spread over several
  byte tokens) emits no broken character, and its pieces join to transformers' decode of
  prompt + output less the prompt's, at every place the output can start."""
  _, ours, ref = style
  text = UNSEEN + ' ' + CORPUS[1] + '\n' + '东京 🌤️!'
  ids = ours.encode(text).tolist()
  for start in range(1, len(ids)):
    prompt, output = ids[:start], ids[start:]
    whole = ref.decode(ids, skip_special_tokens=skip)
    head = ref.decode(prompt, skip_special_tokens=skip)
    if not whole.startswith(head) or head.endswith(REPLACEMENT):
      continue    # the prompt ends inside a character: no text of its own to subtract
    pieces = _stream(ours, prompt, output, skip)
    assert ''.join(pieces) == whole[len(head):], start
    assert not any(REPLACEMENT in p for p in pieces), (start, pieces)


def test_streamed_chat_turn_with_special_tokens(style):
  """An assistant turn as the model writes it after its prompt, closing with its
  end-of-turn special: kept or skipped as asked, the first word's space as in context."""
  name, ours, ref = style
  if name == 'mistral':
    prompt, turn = '<s>[INST] weather?[/INST]', ' 晴れ 🌤️ and 23°C</s>'
  else:
    prompt = '<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n'
    turn = '晴れ 🌤️ and 23°C<|im_end|>'
  ids, prompt_ids = ours.encode(prompt + turn).tolist(), ours.encode(prompt).tolist()
  assert ids[:len(prompt_ids)] == prompt_ids
  for skip in (True, False):
    head = ref.decode(prompt_ids, skip_special_tokens=skip)
    want = ref.decode(ids, skip_special_tokens=skip)[len(head):]
    assert want == (turn.split('<')[0] if skip else turn)
    pieces = _stream(ours, prompt_ids, ids[len(prompt_ids):], skip)
    assert ''.join(pieces) == want
    assert not any(REPLACEMENT in p for p in pieces), pieces
