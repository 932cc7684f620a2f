"""The families' tokenizers and chat templates, as they ship them, through meshlm's
tokenizer, streaming detokenizer and chat-template renderer, with transformers'
PreTrainedTokenizerFast on the same tokenizer.json and template as the reference.

Two tokenizer styles, trained here on a few lines (nothing is downloaded):
- Qwen2's byte-level BPE: a regex split, the ByteLevel pre-tokenizer and decoder, and the
  ChatML specials <|endoftext|>, <|im_start|>, <|im_end|> added after the vocabulary;
- Mistral's (and Llama-2's, Gemma's) SentencePiece-style BPE: the Metaspace "▁", byte
  fallback to <0x00>..<0xFF> (ids 3..258, after <unk>, <s>, </s>), a post-processor that
  adds <s>, and the [INST] / tool control tokens as specials.
The chat templates are written here in each family's format (ChatML with Hermes-style
<tool_call> JSON and <tool_response> turns for Qwen2.5/Qwen3; [INST] turns with
[AVAILABLE_TOOLS], [TOOL_CALLS] and [TOOL_RESULTS] for Mistral).
"""

import json

import numpy as np
import openai
import pytest
import torch
import transformers
from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

from serve.api.chat_template import render_chat
from serve.api.server import create_app
from serve.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer
from serve.load.hf_model import load_hf_model
from training.tokenizer import HFTokenizer, bytes_to_unicode
from tests.test_serve_hf import save_hf
from tests.test_serve_server import ServerThread

CORPUS = [
    'The quick brown fox jumps over the lazy dog.',
    'What is the weather in Paris today? It is sunny and warm.',
    'Call the function get_weather with the city name.',
    'def add(a, b):\n    return a + b\n',
    'Numbers: 12345, 67.89 and 3 apples; the user asked twice.',
    'You are a helpful assistant. Answer the question briefly.',
] * 4
# Outside the training text: accents, CJK, emoji (4-byte UTF-8, one with a joiner).
UNSEEN = 'Ünïcödé: 東京の天気は? 🌤️ weather 👩‍💻 naïve café\t\ttabs  two spaces'

CHATML = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
MISTRAL = ['<unk>', '<s>', '</s>']
MISTRAL_CONTROL = ['[INST]', '[/INST]', '[TOOL_CALLS]', '[AVAILABLE_TOOLS]',
                   '[/AVAILABLE_TOOLS]', '[TOOL_RESULTS]', '[/TOOL_RESULTS]']
# Qwen2's split: contractions, letters with one leading non-letter, single digits,
# punctuation runs, newlines, whitespace.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def qwen_tokenizer() -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior='isolated'),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  tok.add_special_tokens(CHATML)   # after the vocabulary, as Qwen's are
  return tok


def mistral_tokenizer() -> Tokenizer:
  """Merges trained with Metaspace words, then the model rebuilt as Mistral's
  tokenizer.json lays it out: <unk> <s> </s>, the 256 byte tokens, the pieces."""
  metaspace = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first')
  trained = Tokenizer(models.BPE(unk_token='<unk>'))
  trained.pre_tokenizer = metaspace
  trained.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=200, special_tokens=MISTRAL, show_progress=False))
  learned = json.loads(trained.to_str())['model']
  pieces = sorted((i, t) for t, i in learned['vocab'].items() if t not in MISTRAL)
  vocab = MISTRAL + [f'<0x{b:02X}>' for b in range(256)] + [t for _, t in pieces]
  merges = [tuple(m.split(' ')) if isinstance(m, str) else tuple(m)
            for m in learned['merges']]
  tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges, unk_token='<unk>',
                             byte_fallback=True, fuse_unk=True))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first',
                                               split=False)
  tok.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(' ', 1, 0)])
  tok.post_processor = processors.TemplateProcessing(
      single='<s> $A', pair='<s> $A <s> $B', special_tokens=[('<s>', 1)])
  tok.add_special_tokens(MISTRAL + MISTRAL_CONTROL)
  return tok


STYLES = {
    'qwen': (qwen_tokenizer, dict(eos_token='<|im_end|>', pad_token='<|endoftext|>')),
    'mistral': (mistral_tokenizer, dict(bos_token='<s>', eos_token='</s>',
                                        unk_token='<unk>')),
}


@pytest.fixture(scope='module', params=STYLES)
def style(request, tmp_path_factory):
  """(name, meshlm's HFTokenizer, transformers' tokenizer) over one tokenizer.json."""
  path = tmp_path_factory.mktemp(request.param) / 'tokenizer.json'
  build, specials = STYLES[request.param]
  build().save(str(path))
  return (request.param, HFTokenizer(str(path)),
          transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), **specials))


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


# ------------------------------------------------------------------ chat templates

# Qwen2.5 / Qwen3 ChatML: tools described in the system turn, calls as <tool_call> JSON
# in the assistant turn, results as <tool_response> blocks in one user turn per run of
# tool messages; Qwen3's reasoning as a <think> block in the assistant turns after the
# last user turn, and enable_thinking=false writing an empty one.
QWEN_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.reasoning_content and loop.index0 > ns.last_user %}
            {{- '\n<think>\n' + message.reasoning_content + '\n</think>\n' }}
        {%- endif %}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Mistral's [INST] turns: the system message folded into the first user turn, </s> after
# each assistant turn; the tools listed before the last user turn, calls as a JSON list
# after [TOOL_CALLS], results as JSON between [TOOL_RESULTS] tags.
MISTRAL_TEMPLATE = r"""
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {%- if tools and loop.index0 == ns.last_user %}
            {{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST] ' }}
        {%- if system and loop.first %}
            {{- system + '\n\n' }}
        {%- endif %}
        {{- message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS] [' }}
        {%- for call in message.tool_calls %}
            {{- {'name': call.function.name, 'arguments': call.function.arguments,
                 'id': call.id} | tojson }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message.content + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS] ' + {'content': message.content,
                                 'call_id': message.tool_call_id} | tojson }}
        {{- '[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Mistral has no ' + message.role + ' turn here: a system '
                            'message comes first, then user, assistant and tool ones') }}
    {%- endif %}
{%- endfor %}
"""

TEMPLATES = {'qwen': QWEN_TEMPLATE, 'mistral': MISTRAL_TEMPLATE}

TOOLS = [{'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'The weather in a city, today.',
    'parameters': {'type': 'object', 'properties': {
        'city': {'type': 'string'}, 'unit': {'type': 'string', 'enum': ['C', 'F']}},
        'required': ['city']}}}]


def conversation(arguments=lambda a: a, reasoning=False) -> list[dict]:
  """system, user, assistant, user, assistant calling two tools, two tool results, user.
  arguments: how a call's arguments are given (an object, as transformers takes them;
  a JSON string, as OpenAI's API sends them); reasoning: the assistant turns' thinking,
  under two of its names."""
  calls = [{'id': f'call{i:05d}', 'type': 'function', 'function': {
      'name': 'get_weather', 'arguments': arguments({'city': city, 'unit': 'C'})}}
      for i, city in enumerate(['Paris', '東京'])]
  think = [{'reasoning_content': 'A greeting.'}, {'reasoning': 'Two cities: two calls.'}]
  think = think if reasoning else [{}, {}]
  return [
      {'role': 'system', 'content': 'You are a helpful assistant.'},
      {'role': 'user', 'content': 'Hi! 👋'},
      {'role': 'assistant', 'content': 'Hello. What is the question?', **think[0]},
      {'role': 'user', 'content': 'What is the weather in Paris and 東京 today?'},
      {'role': 'assistant', 'content': '', 'tool_calls': calls, **think[1]},
      {'role': 'tool', 'tool_call_id': 'call00000', 'name': 'get_weather',
       'content': '{"temperature": 21, "sky": "sunny"}'},
      {'role': 'tool', 'tool_call_id': 'call00001', 'name': 'get_weather',
       'content': '{"temperature": 9, "sky": "rain"}'},
      {'role': 'user', 'content': 'Thanks; which is warmer?'},
  ]


class _Served:
  """What render_chat reads of a ServedModel."""

  def __init__(self, name, ref):
    self.chat_template = TEMPLATES[name]
    self.special_tokens = {k: getattr(ref, k) for k in ('bos_token', 'eos_token',
                                                        'unk_token', 'pad_token')
                           if getattr(ref, k) is not None}


def _reference(name, ref, messages, **kw) -> str:
  ref.chat_template = TEMPLATES[name]
  return ref.apply_chat_template(messages, tokenize=False, **kw)


@pytest.mark.parametrize('case', ['plain', 'tools', 'no_generation_prompt', 'no_thinking',
                                  'thinking'])
def test_chat_templates_render_as_transformers_does(style, case):
  """thinking: the reasoning of the turn calling tools, after the last user turn (the
  conversation ends with the tool results), under vLLM's name `reasoning`."""
  name, ours, ref = style
  messages = conversation(reasoning=case == 'thinking')[:-1 if case == 'thinking' else None]
  kw = {'add_generation_prompt': case != 'no_generation_prompt'}
  if case == 'plain':
    messages = messages[:4]
  else:
    kw['tools'] = TOOLS if case in ('tools', 'thinking') else None
  if case == 'no_thinking':
    kw['enable_thinking'] = False
  want = _reference(name, ref, messages, **kw)
  assert render_chat(_Served(name, ref), messages, **kw) == want
  # A few of the format's landmarks, written out.
  if name == 'qwen':
    assert want.startswith('<|im_start|>system\nYou are a helpful assistant.')
    assert ('<|im_start|>assistant\nHello. What is the question?<|im_end|>\n') in want
    if case not in ('plain', 'thinking'):
      assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": '
              '"get_weather", "arguments": {"city": "東京", "unit": "C"}}\n</tool_call>'
              '<|im_end|>\n') in want
      assert ('<|im_start|>user\n<tool_response>\n{"temperature": 21, "sky": "sunny"}\n'
              '</tool_response>\n<tool_response>\n{"temperature": 9, "sky": "rain"}\n'
              '</tool_response><|im_end|>\n') in want
    if case == 'thinking':
      assert ('<|im_start|>assistant\n<think>\nTwo cities: two calls.\n</think>\n\n'
              '<tool_call>\n{"name": "get_weather"') in want
      assert 'A greeting.' not in want     # before the last user turn: not shown
    assert want.endswith('<think>\n\n</think>\n\n' if case == 'no_thinking' else
                         '<|im_end|>\n' if case == 'no_generation_prompt' else
                         '<|im_start|>assistant\n')
  else:
    assert want.startswith('<s>[INST] You are a helpful assistant.\n\nHi! 👋[/INST] Hello.')
    assert '[INST]' not in want.split('[/INST]')[0][len('<s>[INST]'):]
    if case != 'plain':
      assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
              '"unit": "C"}, "id": "call00000"}, ') in want
      assert '[TOOL_RESULTS] {"content": "{\\"temperature\\": 9' in want
    assert want.count('</s>') == (1 if case == 'plain' else 2)
    assert 'calls.' not in want
  ids = ours.encode(want).tolist()
  assert ids == ref.encode(want, add_special_tokens=False)
  assert ours.decode(ids, False) == want


def test_a_role_the_template_refuses_is_named(style):
  name, _, ref = style
  if name != 'mistral':
    pytest.skip('ChatML writes any role')
  with pytest.raises(ValueError, match='the chat template rejected the messages: Mistral '
                     'has no developer turn here'):
    render_chat(_Served(name, ref), [{'role': 'developer', 'content': 'x'}])


# ------------------------------------------------------------------ served


@pytest.fixture(scope='module')
def served_dir(style, tmp_path_factory):
  """A tiny random model of the family, with the style's tokenizer and template."""
  name, ours, ref = style
  path = tmp_path_factory.mktemp(f'{name}_model')
  # Qwen3 (q/k norms) for the Qwen tokenizer: Qwen2 and Qwen2.5 ship the same one.
  family = {'qwen': 'qwen3', 'mistral': 'mistral'}[name]
  eos = ref.convert_tokens_to_ids(ref.eos_token)
  hf = save_hf(path, family, vocab_size=ours.vocab_size, eos_token_id=eos,
               bos_token_id=ref.convert_tokens_to_ids(ref.bos_token or ref.eos_token),
               max_position_embeddings=1024,
               **({'sliding_window': None} if name == 'mistral' else {}))
  ref.chat_template = TEMPLATES[name]
  ref.save_pretrained(str(path))
  return path, hf


SPELLED = '東京: 🌤️ 23°C'


def test_chat_completions_run_the_templates_prompt(style, served_dir):
  """A served directory (tokenizer.json and the template as save_pretrained writes them):
  the ids the engine is given for a tool conversation, ending with the tool results, are
  transformers' encoding of apply_chat_template's text (the template's own <s>, none
  added), and the greedy answer is transformers' generate from them, decoded as
  transformers decodes it; streamed, the same text, and an answer of characters outside
  the vocabulary (held to them by guided_regex) in whole characters."""
  from serve.config import ServeConfig   # pylint: disable=import-outside-toplevel
  from serve.engine.core import Engine   # pylint: disable=import-outside-toplevel
  name, _, ref = style
  path, hf = served_dir
  served = load_hf_model(str(path))
  assert served.chat_template == TEMPLATES[name]
  engine = Engine(served, ServeConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                      max_model_len=1024, num_blocks=128))
  seen = []
  add_request = engine.add_request
  engine.add_request = lambda ids, *a, **kw: seen.append(list(ids)) or add_request(ids, *a,
                                                                                    **kw)
  server = ServerThread(create_app(engine, served, tool_parser='hermes'))
  try:
    client = openai.OpenAI(base_url=server.url + '/v1', api_key='none', max_retries=0,
                           timeout=120)
    reply = client.chat.completions.create(
        model=served.name, messages=conversation(json.dumps, reasoning=True)[:-1],
        tools=TOOLS, tool_choice='none', max_tokens=6, temperature=0,
        extra_body={'ignore_eos': True})
    deltas = [c.choices[0].delta.content or '' for c in client.chat.completions.create(
        model=served.name, messages=conversation(json.dumps, reasoning=True)[:-1],
        tools=TOOLS, tool_choice='none', max_tokens=6, temperature=0, stream=True,
        extra_body={'ignore_eos': True}) if c.choices]
    # An answer held to characters outside the vocabulary, byte tokens under byte fallback.
    spelled = [c.choices[0].delta.content or '' for c in client.chat.completions.create(
        model=served.name, messages=[{'role': 'user', 'content': 'Weather?'}], stream=True,
        temperature=0, extra_body={'guided_regex': SPELLED}) if c.choices]
  finally:
    server.stop()
    engine.shutdown()
  text = _reference(name, ref, conversation(reasoning=True)[:-1], tools=TOOLS,
                    add_generation_prompt=True)
  assert ('Two cities' in text) == (name == 'qwen')
  want = ref.encode(text, add_special_tokens=False)
  assert seen[0] == want and len(seen) == 3
  assert want.count(ref.bos_token_id) == (1 if name == 'mistral' else 0)
  hf.generation_config.eos_token_id = None
  with torch.no_grad():
    out = hf.generate(torch.as_tensor([want]), max_new_tokens=6, do_sample=False,
                      pad_token_id=0)[0, len(want):].tolist()
  assert reply.choices[0].message.content == ref.decode(out, skip_special_tokens=True)
  assert reply.usage.prompt_tokens == len(want)
  assert ''.join(deltas) == reply.choices[0].message.content   # streamed: the same text
  assert seen[1] == want
  assert ''.join(spelled) == SPELLED and not any(REPLACEMENT in d for d in spelled), spelled
  np.testing.assert_array_equal(served.tokenizer.encode(text), want)


@pytest.mark.parametrize('template, message', [
    ("{{ messages.append(messages[0]) }}",
     r"does what its sandbox forbids \(access to attribute 'append' of 'list' object is "
     r"unsafe.*fix the template"),
    ("{{ render_tools(tools) }}{{ messages[0].content }}",
     r"reads something undefined here \('render_tools' is undefined\): a field these "
     r"messages lack, or a name it is not given \(it is given messages, tools, .*"
     r"chat_template_kwargs"),
    ("{{ messages[0].content + messages[0].tool_calls }}",
     r"reads something undefined here \('dict object' has no attribute 'tool_calls'\)"),
    ("{{ messages[0].content + 1 }}",
     r'failed on these messages \(TypeError: can only concatenate str'),
])
def test_what_a_template_cannot_render_is_named(style, template, message):
  """Each fails in transformers too (the reference), so none is meshlm's gap alone."""
  name, _, ref = style
  served = _Served(name, ref)
  served.chat_template = template
  messages = [{'role': 'user', 'content': 'hi'}]
  with pytest.raises(ValueError, match=message):
    render_chat(served, messages)
  ref.chat_template = template
  with pytest.raises(Exception):
    ref.apply_chat_template(messages, tokenize=False)
  ref.chat_template = TEMPLATES[name]
