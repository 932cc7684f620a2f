"""The families' chat templates, written here in each family's format (ChatML with
Hermes-style <tool_call> JSON and <tool_response> turns for Qwen2.5/Qwen3; [INST] turns
with [AVAILABLE_TOOLS], [TOOL_CALLS] and [TOOL_RESULTS] for Mistral; Gemma's
<start_of_turn>user / model turns, the system message folded into the first user turn,
no tool turns), rendered by meshlm
as transformers' apply_chat_template renders them over the family's tokenizer
(tests/hf_styles.py), and served: a tiny random model of the family is given the
rendered text's ids."""

import json

import numpy as np
import openai
import pytest
import torch

from serve.api.chat_template import render_chat
from serve.api.server import create_app
from serve.engine.detokenizer import REPLACEMENT
from serve.load.hf_model import load_hf_model
from tests.hf_styles import GEMMA_SPECIALS, gemma_tokenizer, style  # noqa: F401  (a fixture)
from tests.test_serve_hf import save_hf
from tests.test_serve_server import ServerThread


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

# Gemma 2/3's: <bos>, then user and model turns alternating, each closed by <end_of_turn>;
# a system message's text starts the first user turn; contents trimmed.
GEMMA_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

TEMPLATES = {'qwen': QWEN_TEMPLATE, 'mistral': MISTRAL_TEMPLATE, 'gemma': GEMMA_TEMPLATE}

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
  assert reply.choices[0].message.content == ref.decode(out, skip_special_tokens=True), (
      out, reply.choices[0].logprobs)
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


# ------------------------------------------------------------------ Gemma


@pytest.fixture(scope='module')
def gemma(tmp_path_factory):
  """(meshlm's tokenizer, transformers' over the same tokenizer.json) in Gemma's style."""
  from training.tokenizer import HFTokenizer  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  path = tmp_path_factory.mktemp('gemma') / 'tokenizer.json'
  gemma_tokenizer().save(str(path))
  return HFTokenizer(str(path)), transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(path), **GEMMA_SPECIALS)


@pytest.mark.parametrize('generation_prompt', [True, False])
def test_the_gemma_template_renders_as_transformers_does(gemma, generation_prompt):
  """system, user, assistant, user: the system text opens the first user turn, the
  assistant's turn is `model`; the ids of the text are transformers' (one <bos>, the
  template's; turn tokens whole)."""
  ours, ref = gemma
  messages = conversation()[:4]
  want = _reference('gemma', ref, messages, add_generation_prompt=generation_prompt)
  assert render_chat(_Served('gemma', ref), messages,
                     add_generation_prompt=generation_prompt) == want
  assert want.startswith('<bos><start_of_turn>user\nYou are a helpful assistant.\n\nHi! '
                         '👋<end_of_turn>\n<start_of_turn>model\nHello. What is the '
                         'question?<end_of_turn>\n<start_of_turn>user\nWhat is the weather')
  assert want.endswith('<start_of_turn>model\n' if generation_prompt
                       else 'today?<end_of_turn>\n')
  ids = ours.encode(want).tolist()
  assert ids == ref.encode(want, add_special_tokens=False)
  assert ids[:2] == ref.convert_tokens_to_ids(['<bos>', '<start_of_turn>'])
  assert ours.decode(ids, False) == want


def test_the_gemma_template_refuses_turns_out_of_order_by_name(gemma):
  _, ref = gemma
  with pytest.raises(ValueError, match='the chat template rejected the messages: '
                                       'Conversation roles must alternate'):
    render_chat(_Served('gemma', ref), conversation())   # tool turns: Gemma has none


def test_a_served_gemma_answers_its_templates_prompt(gemma, tmp_path):
  """A tiny random Gemma 2 with the Gemma tokenizer and template: the engine is given
  transformers' ids of apply_chat_template's text, and the greedy answer is
  transformers' generate from them, decoded as transformers decodes it."""
  from serve.config import ServeConfig   # pylint: disable=import-outside-toplevel
  from serve.engine.core import Engine   # pylint: disable=import-outside-toplevel
  ours, ref = gemma
  hf = save_hf(tmp_path, 'gemma2', vocab_size=ours.vocab_size, head_dim=16,
               eos_token_id=ref.convert_tokens_to_ids('<end_of_turn>'),
               bos_token_id=ref.convert_tokens_to_ids('<bos>'), sliding_window=8,
               max_position_embeddings=256, tie_word_embeddings=True)
  ref.chat_template = GEMMA_TEMPLATE
  ref.save_pretrained(str(tmp_path))
  served = load_hf_model(str(tmp_path))
  engine = Engine(served, ServeConfig(max_num_seqs=2, max_num_batched_tokens=128,
                                      max_model_len=256, num_blocks=64))
  seen = []
  add_request = engine.add_request
  engine.add_request = lambda ids, *a, **kw: seen.append(list(ids)) or add_request(ids, *a,
                                                                                    **kw)
  server = ServerThread(create_app(engine, served))
  messages = conversation()[:4]
  try:
    client = openai.OpenAI(base_url=server.url + '/v1', api_key='none', max_retries=0,
                           timeout=120)
    reply = client.chat.completions.create(model=served.name, messages=messages,
                                           max_tokens=6, temperature=0, logprobs=True,
                                           extra_body={'ignore_eos': True})
  finally:
    server.stop()
    engine.shutdown()
  want = ref.encode(_reference('gemma', ref, messages, add_generation_prompt=True),
                    add_special_tokens=False)
  assert seen == [want]
  hf.generation_config.eos_token_id = None
  with torch.no_grad():
    out = hf.generate(torch.as_tensor([want]), max_new_tokens=6, do_sample=False,
                      pad_token_id=0)[0, len(want):].tolist()
  assert reply.choices[0].message.content == ref.decode(out, skip_special_tokens=True), (
      out, reply.choices[0].logprobs)
