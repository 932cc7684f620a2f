"""Tool calling (serve/api/tools.py, serve/api/tool_parsers.py): the request's tools and
tool_choice, the output parsers, and the server end to end on the shared tiny model.

The parsers are checked against the calls a text was built from, over random chunkings
(what a stream delivers) and cut short at every length (max_tokens). End to end, a named
function's arguments and "required"'s calls must be exactly what structured output
gives for the same schema on the same prompt, and "auto" must find the calls in an
output that a guided_regex makes write them.
"""

import json
import random

import httpx
import openai
import pytest

from serve.api import tool_parsers, tools
from serve.api.server import create_app
from serve.sampling_params import SamplingParamsError
from tests.test_serve_server import (  # pylint: disable=unused-import
    FakeEngine, FakeServed, ServerThread, _assert_at_rest, _client, real_engine)

WEATHER = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'Weather in a city',
    'parameters': {'type': 'object', 'properties': {'city': {'enum': ['Paris', 'Rome']}},
                   'required': ['city']}}}
TIME = {'type': 'function', 'function': {'name': 'get_time', 'parameters': {
    'type': 'object', 'properties': {'zone': {'type': 'integer'}}, 'required': ['zone']}}}


# ------------------------------------------------------------------ parsing the request

def test_tool_choice_modes_and_their_schemas():
  assert tools.parse({}, None) is None
  assert tools.parse({'tools': [WEATHER], 'tool_choice': 'none'}, None).schema() is None
  assert tools.parse({'tools': [], 'tool_choice': 'auto'}, None) is None   # nothing to call
  auto = tools.parse({'tools': [WEATHER]}, 'hermes')
  assert (auto.mode, auto.schema(), auto.ends_with_calls) == ('auto', None, True)
  named = tools.parse({'tools': [WEATHER, TIME], 'tool_choice': {
      'type': 'function', 'function': {'name': 'get_time'}}}, None)
  assert named.schema() == TIME['function']['parameters'] and not named.ends_with_calls
  required = tools.parse({'tools': [WEATHER, TIME], 'tool_choice': 'required',
                          'parallel_tool_calls': False}, None).schema()
  assert required['type'] == 'array' and (required['minItems'], required['maxItems']) == (1, 1)
  assert [c['properties']['name']['enum'] for c in required['items']['anyOf']] == [
      ['get_weather'], ['get_time']]
  assert required['items']['anyOf'][1]['properties']['parameters'] == \
      TIME['function']['parameters']
  # A function without parameters takes an empty object.
  bare = {'type': 'function', 'function': {'name': 'ping'}}
  assert tools.parse({'tools': [bare], 'tool_choice': 'required'}, None).schema()['items'] == {
      'type': 'object', 'required': ['name', 'parameters'], 'properties': {
          'name': {'type': 'string', 'enum': ['ping']},
          'parameters': {'type': 'object', 'properties': {}}}}


@pytest.mark.parametrize('body, param, needle', [
    ({'tools': [WEATHER]}, 'tool_choice', '--enable-auto-tool-choice --tool-call-parser'),
    ({'tools': [WEATHER], 'tool_choice': 'auto'}, 'tool_choice', 'hermes'),
    ({'tool_choice': 'required'}, 'tool_choice', 'needs "tools"'),
    ({'tools': [WEATHER], 'tool_choice': {'type': 'function', 'function': {'name': 'nope'}}},
     'tool_choice', "'nope', which is not one of the tools (get_weather)"),
    ({'tools': [WEATHER], 'tool_choice': {'function': 'get_weather'}}, 'tool_choice',
     'a named choice is'),
    ({'tools': [WEATHER], 'tool_choice': 'any'}, 'tool_choice', 'must be "none"'),
    ({'tools': {'a': 1}}, 'tools', 'must be a list'),
    ({'tools': [{'type': 'function', 'function': {'name': ''}}]}, 'tools', 'non-empty'),
    ({'tools': [{'type': 'retrieval'}]}, 'tools', 'tools[0] must be'),
    ({'tools': [WEATHER, WEATHER]}, 'tools', 'given twice'),
    ({'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': 'x'}}]},
     'tools', 'parameters must be a JSON schema'),
    ({'tools': [WEATHER], 'tool_choice': 'required', 'parallel_tool_calls': 'no'},
     'parallel_tool_calls', 'true or false'),
    ({'tools': [WEATHER], 'tool_choice': 'required',
      'response_format': {'type': 'json_object'}}, 'response_format', 'cannot be combined'),
    ({'tools': [WEATHER], 'tool_choice': 'required', 'guided_regex': 'a'}, 'guided_regex',
     'cannot be combined'),
    ({'functions': [WEATHER['function']]}, 'functions', 'deprecated'),
    ({'function_call': 'required'}, 'function_call', 'deprecated'),
    ({'tool_choice': 'none', 'parallel_tool_calls': 1}, 'parallel_tool_calls', 'true or false'),
    ({'tools': [WEATHER], 'tool_choice': 'required', 'ignore_eos': True}, 'ignore_eos',
     "tool_choice 'required'"),
    ({'tools': [TIME], 'tool_choice': {'type': 'function', 'function': {'name': 'get_time'}},
      'min_tokens': 2}, 'min_tokens', 'cannot be combined'),
    ({'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {
        'type': 'object', 'properties': {'a': {'$ref': '#/$defs/missing'}}}}}],
      'tool_choice': 'required'}, 'tools', 'not a JSON schema this server can follow'),
    ({'tools': [{'type': 'function', 'function': {'name': n, 'parameters': {
        '$defs': {'X': {'type': t}}, 'properties': {'a': {'$ref': '#/$defs/X'}}}}}
                for n, t in (('f', 'string'), ('g', 'integer'))], 'tool_choice': 'required'},
     'tools', "define $defs 'X' differently"),
])
def test_bad_tool_requests_name_the_field(body, param, needle):
  with pytest.raises(SamplingParamsError) as e:
    tools.parse(body, None)
  assert e.value.param == param and needle in str(e.value), str(e.value)


def test_neutral_deprecated_fields_pass_and_defs_move_to_the_root():
  assert tools.parse({'functions': [], 'function_call': 'none'}, None) is None
  assert tools.parse({'function_call': 'auto', 'tools': [WEATHER], 'tool_choice': 'none'},
                     None).mode == 'none'
  # A pydantic-made tool: its references point at its own root's $defs.
  city = {'name': 'city', 'parameters': {
      '$defs': {'City': {'enum': ['Paris', 'Rome']}},
      'type': 'object', 'properties': {'c': {'$ref': '#/$defs/City'}}, 'required': ['c']}}
  choice = tools.parse({'tools': [WEATHER, {'type': 'function', 'function': city}],
                        'tool_choice': 'required'}, None)
  schema = choice.schema()
  assert schema['$defs'] == {'City': {'enum': ['Paris', 'Rome']}}
  assert '$defs' not in schema['items']['anyOf'][1]['properties']['parameters']
  assert city['parameters']['$defs']   # the request's own schema untouched
  import re  # pylint: disable=import-outside-toplevel
  from serve.structured import guided  # pylint: disable=import-outside-toplevel
  regex = guided.json_schema_regex(schema, 'tools')
  assert re.fullmatch(regex, '[{"name":"city","parameters":{"c":"Rome"}}]')
  assert not re.fullmatch(regex, '[{"name":"city","parameters":{"c":"Oslo"}}]')


def test_template_messages_give_arguments_as_objects():
  calls = [{'id': 'c1', 'type': 'function',
            'function': {'name': 'get_weather', 'arguments': '{"city": "Rome"}'}}]
  out = tools.template_messages([{'role': 'assistant', 'content': '', 'tool_calls': calls},
                                 {'role': 'tool', 'content': '21 C', 'tool_call_id': 'c1'}])
  assert out[0]['tool_calls'][0]['function']['arguments'] == {'city': 'Rome'}
  assert calls[0]['function']['arguments'] == '{"city": "Rome"}'   # the request's untouched
  assert out[1] == {'role': 'tool', 'content': '21 C', 'tool_call_id': 'c1'}
  with pytest.raises(ValueError, match=r'messages\[0\].tool_calls'):
    tools.template_messages([{'role': 'assistant', 'content': '', 'tool_calls': [{}]}])


# ------------------------------------------------------------------ output parsers

def _run(parser, text: str, rng: random.Random | None) -> tuple[str, list]:
  """(content, [(name, arguments)]) from the parser's deltas, fed in random pieces."""
  cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) \
      if rng and len(text) > 1 else []
  delta = tool_parsers.Delta()
  for a, b in zip([0] + cuts, cuts + [len(text)]):
    delta += parser.feed(text[a:b])
  delta += parser.finish()
  return delta.content, _calls_of(delta.tool_calls)


def _calls_of(items: list) -> list:
  """Folds OpenAI delta items as a client does: by index, arguments concatenated."""
  calls = {}
  for item in items:
    call = calls.setdefault(item['index'], {'name': None, 'arguments': '', 'id': None})
    call['id'] = item.get('id', call['id'])
    call['name'] = item.get('function', {}).get('name', call['name'])
    call['arguments'] += item['function'].get('arguments', '')
  # Mistral's parser: 9 letters and digits (what its templates take back); others call_...
  assert all(c['id'] and (c['id'].startswith('call_') or len(c['id']) == 9 and c['id'].isalnum())
             for c in calls.values())
  return [(c['name'], c['arguments']) for _, c in sorted(calls.items())]


def _hermes(name, arguments):
  return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


HERMES_CASES = [   # text, content, calls
    ('It is sunny.', 'It is sunny.', []),
    (_hermes('get_weather', {'city': 'Rome'}), '', [('get_weather', '{"city": "Rome"}')]),
    ('Let me look.\n\n' + _hermes('get_weather', {'city': 'Paris'}) + '\n'
     + _hermes('get_time', {'zone': 2}) + '\n',
     'Let me look.', [('get_weather', '{"city": "Paris"}'), ('get_time', '{"zone": 2}')]),
    ('a ' + _hermes('f', {}) + ' b', 'a b', [('f', '{}')]),
    ('  x < y and <tool z \n', '  x < y and <tool z \n', []),   # no call: as written
    # A closing tag inside a JSON string does not close the block.
    ('<tool_call>{"name": "f", "arguments": {"k": "</tool_call>"}}</tool_call>', '',
     [('f', '{"k": "</tool_call>"}')]),
    # Arguments given as a JSON string of an object; anything else is no call.
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', '',
     [('f', '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"k": "</tool"}}</tool_call>', '',
     [('f', '{"k": "</tool"}')]),
    # Cut short: a whole unclosed block is a call; a broken one is content, tag and all.
    ('<tool_call>{"name": "f", "arguments": {}}', '', [('f', '{}')]),
    ('ok <tool_call>{"name": "f", "argu', 'ok <tool_call>{"name": "f", "argu', []),
    ('ok ' + _hermes('f', {}) + ' <tool_call>{"name"', 'ok <tool_call>{"name"', [('f', '{}')]),
    ('<tool_call>not json</tool_call> then', '<tool_call>not json</tool_call> then', []),
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
]


@pytest.mark.parametrize('text, content, calls', HERMES_CASES)
def test_hermes_parser_in_any_chunking(text, content, calls):
  rng = random.Random(text)
  for trial in range(20):
    assert _run(tool_parsers.HermesParser(), text, rng if trial else None) == (content, calls)


def test_hermes_without_parallel_calls_keeps_the_first():
  text = 'x ' + _hermes('f', {'a': 1}) + _hermes('g', {}) + ' y'
  content, calls = _run(tool_parsers.HermesParser(parallel=False), text, None)
  assert calls == [('f', '{"a": 1}')] and content == 'x y'


LLAMA_CASES = [   # text, content, calls
    ('It is {sunny}.', 'It is {sunny}.', []),
    (' {"name": "f", "parameters": {}}', ' {"name": "f", "parameters": {}}', []),  # not first
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', '',
     [('get_weather', '{"city": "Rome"}')]),
    ('{"name": "f", "parameters": {"s": "}; {"}}; {"name": "g", "arguments": {"n": 2}}', '',
     [('f', '{"s": "}; {"}'), ('g', '{"n": 2}')]),
    ('{"answer": 42}', '{"answer": 42}', []),                  # JSON, but not a call
    ('{"name": "f", "parameters": {}}; {"name": "g", "param', '{"name": "g", "param',
     [('f', '{}')]),                                          # cut short
    ('<|python_', '<|python_', []),
    # Text around and between objects is content, as written (but separators).
    ('{"answer": 1}\nSo {x} is it.', '{"answer": 1}\nSo {x} is it.', []),
    ('<|python_tag|>Sure: {"name": "f", "parameters": {}} ; {"name": "g", "parameters": {}}',
     'Sure: ', [('f', '{}'), ('g', '{}')]),
    ('{"name": "f", "parameters": {}}} {"name": "g", "arguments": {}}', '} ',   # stray "}"
     [('f', '{}'), ('g', '{}')]),
]


PYTHONIC_CASES = [   # text, content, calls
    ('It is sunny [today].', 'It is sunny [today].', []),
    ('[get_weather(city="Rome", days=2), get_time()]', '',
     [('get_weather', '{"city": "Rome", "days": 2}'), ('get_time', '{}')]),
    # Llama 4's tags; strings, lists and dicts holding the list's own punctuation.
    ('<|python_start|>[f(a=[1, "],)"], b={"k": None, "t": (True, -1.5)}, c=\'x"]\')]'
     '<|python_end|>', '',
     [('f', '{"a": [1, "],)"], "b": {"k": null, "t": [true, -1.5]}, "c": "x\\"]"}')]),
    (r'[f(s="a\"b)")]', '', [('f', r'{"s": "a\"b)"}')]),   # an escaped quote
    ('  [f(a=1)]', '', [('f', '{"a": 1}')]),
    # Not calls: as written. Positional arguments, a name that is not a literal, a set.
    ('[1, 2, 3] is a list', '[1, 2, 3] is a list', []),
    ('[f(1)]', '[f(1)]', []),
    ('[f(a=b)]', '[f(a=b)]', []),
    ('[f(a={1, 2})]', '[f(a={1, 2})]', []),
    ('[f(a=1), 2, g()] ok', ', 2,  ok', [('f', '{"a": 1}'), ('g', '{}')]),
    ('[]', '[]', []),
    ('[ ] x', '[ ] x', []),
    ('[f(a=1e999)]', '[f(a=1e999)]', []),                 # inf is not JSON
    ('[f(a=' + '-' * 3000 + '1)]', '[f(a=' + '-' * 3000 + '1)]', []),   # past the parser
    # Nothing after the list is a call: text after it is content, less the tags.
    ('[1, 2] are numbers; call it like [f(a=1)] later',
     '[1, 2] are numbers; call it like [f(a=1)] later', []),
    ('[f()] and [g()]', ' and [g()]', [('f', '{}')]),
    ('<|python_start|>[f()]<|python_end|> done', ' done', [('f', '{}')]),
    # Cut short: the open item is content; a prefix of the tag is content.
    ('[f(a=1), g(b="x', 'g(b="x', [('f', '{"a": 1}')]),
    ('[f(a=1)', '[f(a=1)', []),
    ('<|python_st', '<|python_st', []),
    (' \n', ' \n', []),
    ('<|python_start|>Hi', '<|python_start|>Hi', []),
]


@pytest.mark.parametrize('parser, text, content, calls',
                         [(tool_parsers.Llama3JsonParser, *c) for c in LLAMA_CASES]
                         + [(tool_parsers.PythonicParser, *c) for c in PYTHONIC_CASES])
def test_json_and_pythonic_parsers_in_any_chunking(parser, text, content, calls):
  rng = random.Random(text)
  for trial in range(20):
    assert _run(parser(), text, rng if trial else None) == (content, calls)
  if len(calls) > 1:
    assert _run(parser(parallel=False), text, rng)[1] == calls[:1]


def _mistral(*calls):
  return '[TOOL_CALLS] ' + json.dumps([{'name': n, 'arguments': a} for n, a in calls])


MISTRAL_CASES = [   # text, content, calls
    ('It is sunny [today].', 'It is sunny [today].', []),
    (_mistral(('get_weather', {'city': 'Rome'})), '', [('get_weather', '{"city": "Rome"}')]),
    ('Let me look. ' + _mistral(('f', {'s': '}], [{'}), ('g', {'n': 2})), 'Let me look. ',
     [('f', '{"s": "}], [{"}'), ('g', '{"n": 2}')]),
    ('[TOOL_CALLS]{"name": "f", "arguments": {}}', '', [('f', '{}')]),   # one object
    # Arguments as a JSON string of an object; an object of another shape is content.
    ('[TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 1}"}]', '', [('f', '{"a": 1}')]),
    ('[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"answer": 1}]', '{"answer": 1}',
     [('f', '{}')]),
    # No call after the tag (malformed JSON, cut short, not a call): as written.
    ('[TOOL_CALLS] [{"name": "f", "arguments": {]}]', '[TOOL_CALLS] [{"name": "f", '
     '"arguments": {]}]', []),
    ('ok [TOOL_CALLS] [{"name": "f", "argu', 'ok [TOOL_CALLS] [{"name": "f", "argu', []),
    ('[TOOL_CALLS] [1, 2]', '[TOOL_CALLS] [1, 2]', []),
    ('[TOOL_CALLS]', '[TOOL_CALLS]', []),
    ('a [TOOL_CA', 'a [TOOL_CA', []),
    # Cut short after a call: the open object is content.
    ('[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arg',
     '{"name": "g", "arg', [('f', '{}')]),
]


@pytest.mark.parametrize('text, content, calls', MISTRAL_CASES)
def test_mistral_parser_in_any_chunking(text, content, calls):
  rng = random.Random(text)
  for trial in range(20):
    parser = tool_parsers.MistralParser()
    delta = tool_parsers.Delta()
    for piece in _pieces(text, rng if trial else None):
      delta += parser.feed(piece)
    delta += parser.finish()
    assert delta.content == content
    assert [(c.name, c.arguments) for c in parser.calls] == calls
    # Mistral's templates take back only ids of 9 letters and digits.
    ids = [item['id'] for item in delta.tool_calls]
    assert ids == [c.id for c in parser.calls]
    assert all(len(i) == 9 and i.isalnum() for i in ids), ids
  if len(calls) > 1:
    parser = tool_parsers.MistralParser(parallel=False)
    parser.feed(text)
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.calls] == calls[:1]


def _pieces(text: str, rng: random.Random | None) -> list[str]:
  cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) \
      if rng and len(text) > 1 else []
  return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_mistral_parser_holds_nothing_before_the_tag():
  """Content before [TOOL_CALLS] streams as it comes, less a tail that may begin the tag."""
  parser = tool_parsers.MistralParser()
  assert parser.feed('Hello [TOOL').content == 'Hello '
  assert parser.feed('S] x').content == '[TOOLS] x'
  assert tools.ToolChoice((), 'auto', auto_parser='mistral').parser().__class__ is \
      tool_parsers.MistralParser


@pytest.mark.parametrize('auto_parser, mistral', [('mistral', True), ('hermes', False)])
def test_named_and_required_call_ids_follow_the_servers_parser(auto_parser, mistral):
  """Under --tool-call-parser mistral, calls forced by a named or "required" tool_choice
  get 9-character ids too: Mistral's templates refuse any other tool_call_id next turn."""
  named = tools.ToolChoice((), 'named', 'get_time', auto_parser=auto_parser).parser()
  required = tools.ToolChoice((), 'required', auto_parser=auto_parser).parser()
  required.feed('[{"name": "get_time", "parameters": {"zone": 1}}]')
  ids = [named.finish().tool_calls[0]['id'], required.calls[0].id]
  for call_id in ids:
    assert (len(call_id) == 9 and call_id.isalnum()) == mistral
    assert call_id.startswith('call_') != mistral


def test_required_parser_in_any_chunking_and_cut_anywhere():
  items = [{'name': 'get_weather', 'parameters': {'city': 'Paris'}},
           {'name': 'get_time', 'parameters': {'zone': -3}},
           {'name': 'echo', 'parameters': {'s': 'a "]}, [{" b\\\\'}}]
  text = '[' + ', '.join(json.dumps(i) for i in items) + ']'
  want = [(i['name'], json.dumps(i['parameters'])) for i in items]
  rng = random.Random(0)
  for trial in range(30):
    assert _run(tool_parsers.RequiredParser(), text, rng if trial else None) == ('', want)
  # Cut at every length: the elements closed so far are calls, an open one is content.
  starts = [text.index(json.dumps(i)) for i in items]
  ends = [s + len(json.dumps(i)) for s, i in zip(starts, items)]
  for cut in range(len(text)):
    content, calls = _run(tool_parsers.RequiredParser(), text[:cut], rng)
    done = sum(end <= cut for end in ends)
    assert calls == want[:done], cut
    opened = done < len(items) and starts[done] < cut
    assert content == (text[starts[done]:cut] if opened else ''), cut


def test_named_parser_streams_the_arguments():
  parser = tool_parsers.NamedParser('get_weather')
  pieces = ['{"ci', 'ty": ', '', '"Rome"}']
  delta = tool_parsers.Delta()
  for p in pieces:
    delta += parser.feed(p)
  delta += parser.finish()
  assert delta.content == '' and _calls_of(delta.tool_calls) == [
      ('get_weather', '{"city": "Rome"}')]
  assert [bool(item.get('id')) for item in delta.tool_calls] == [True, False, False]
  # An empty output is still the call (finish_reason tells it was cut).
  assert _calls_of(tool_parsers.NamedParser('f').finish().tool_calls) == [('f', '')]


# ------------------------------------------------------------------ the server

@pytest.fixture(scope='module')
def tool_server(real_engine, tiny_served):
  server = ServerThread(create_app(real_engine, tiny_served, model_name='tiny',
                                   tool_parser='hermes'))
  yield server
  server.stop()


MESSAGES = [{'role': 'user', 'content': 'w?'}]
# The tiny model's context is 64 tokens (the prompt takes 20): tools with short JSON.
W = {'type': 'function', 'function': {'name': 'w', 'parameters': {
    'type': 'object', 'properties': {'c': {'enum': ['P', 'R']}}, 'required': ['c']}}}
T = {'type': 'function', 'function': {'name': 't', 'parameters': {
    'type': 'object', 'properties': {'z': {'enum': [1, 2]}}, 'required': ['z']}}}


def _streamed(client, **kw) -> list[dict]:
  """Each choice of a streamed chat: content, folded tool calls, finish_reason."""
  out = {}
  for chunk in client.chat.completions.create(stream=True, **kw):
    for c in chunk.choices:
      got = out.setdefault(c.index, {'content': '', 'items': [], 'finish_reason': None})
      got['content'] += c.delta.content or ''
      got['items'] += [t.model_dump(exclude_none=True) for t in c.delta.tool_calls or ()]
      got['finish_reason'] = c.finish_reason or got['finish_reason']
  return [{'content': o['content'] or None, 'calls': _calls_of(o['items']),
           'finish_reason': o['finish_reason']} for _, o in sorted(out.items())]


def _plain(completion) -> list[dict]:
  return [{'content': c.message.content,
           'calls': [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()],
           'finish_reason': c.finish_reason} for c in completion.choices]


def test_named_and_required_calls_are_what_structured_output_gives(tool_server, real_engine):
  """A named function's arguments, and "required"'s calls, equal the JSON that
  structured output writes for the same schema and prompt (the tiny model's template
  does not show tools, so the prompt is the same), streamed or not."""
  client = _client(tool_server)
  # No spaces or newlines (which JSON allows between tokens and the tiny model likes):
  # the calls fit its 64-token context.
  base = dict(model='tiny', messages=MESSAGES, max_tokens=44, temperature=1.0, seed=5, n=2,
              logit_bias={'32': -100, '10': -100})
  named = dict(base, tools=[W, T], tool_choice={'type': 'function', 'function': {'name': 'w'}})
  guided = client.chat.completions.create(**base, extra_body={
      'guided_json': W['function']['parameters']})
  want = [{'content': None, 'calls': [('w', c.message.content)],
           'finish_reason': 'stop'} for c in guided.choices]
  assert all(json.loads(w['calls'][0][1])['c'] in ('P', 'R') for w in want)
  assert _plain(client.chat.completions.create(**named)) == want
  assert _streamed(client, **named) == want

  # One call each (the context has room for one): maxItems 1.
  required = dict(base, tools=[W, T], tool_choice='required', parallel_tool_calls=False)
  schema = tools.parse({'tools': [W, T], 'tool_choice': 'required',
                        'parallel_tool_calls': False}, None).schema()
  guided = client.chat.completions.create(**base, extra_body={'guided_json': schema})
  want = []
  for c in guided.choices:
    items = json.loads(c.message.content)
    want.append({'content': None, 'finish_reason': 'tool_calls', 'calls': [
        (i['name'], json.dumps(i['parameters'], ensure_ascii=False)) for i in items]})
  assert _plain(client.chat.completions.create(**required)) == want
  assert _streamed(client, **required) == want
  _assert_at_rest(real_engine)


def test_auto_returns_text_as_content_on_the_real_engine(tool_server, real_engine):
  """tool_choice auto, and the tiny model writes no call: its text is the content, as
  without tools (the template shows it no tools, so the prompt is the same)."""
  client = _client(tool_server)
  free = dict(model='tiny', messages=[{'role': 'user', 'content': 'import os'}],
              max_tokens=24, temperature=1.0, seed=3)
  text = client.chat.completions.create(**free).choices[0].message.content
  assert text.strip()
  with_tools = _plain(client.chat.completions.create(**free, tools=[W]))[0]
  assert with_tools['calls'] == [] and with_tools['content'] == text
  assert with_tools['finish_reason'] == 'length'
  _assert_at_rest(real_engine)


@pytest.fixture
def echo_server(request):
  """A server whose engine writes back the last message (the template's whole output),
  then stops: the model's output is what the test puts there."""
  fake = FakeEngine(max_model_len=1024, stop_after_prompt=True)
  server = ServerThread(create_app(
      fake, FakeServed(chat_template='{{ messages[-1].content }}'),
      tool_parser=getattr(request, 'param', 'hermes'), max_model_len=1024))
  yield server, fake
  server.stop()
  fake.shutdown()


CALLS = ('I will look. <tool_call>{"name": "w", "arguments": {"c": "P"}}</tool_call>\n'
         '<tool_call>\n{"name": "t", "arguments": {"z": 2}}\n</tool_call>')


@pytest.mark.parametrize('extra, want', [
    ({}, {'content': 'I will look.', 'finish_reason': 'tool_calls',
          'calls': [('w', '{"c": "P"}'), ('t', '{"z": 2}')]}),
    ({'parallel_tool_calls': False}, {  # the second call dropped
        'content': 'I will look.', 'finish_reason': 'tool_calls',
        'calls': [('w', '{"c": "P"}')]}),
    ({'max_tokens': len(CALLS) - 20}, {   # cut inside the second call: it is content
        'content': CALLS[:12] + CALLS[CALLS.index('\n'):-20], 'finish_reason': 'length',
        'calls': [('w', '{"c": "P"}')]}),
])
def test_auto_returns_the_calls_the_model_writes(echo_server, extra, want):
  server, fake = echo_server
  client = _client(server)
  kw = dict(model='fake', messages=[{'role': 'user', 'content': CALLS}], tools=[W, T],
            **{'max_tokens': 500, **extra})
  assert _plain(client.chat.completions.create(**kw)) == [want]
  assert _streamed(client, **kw) == [want]
  # The tags may be special tokens of the model's tokenizer: kept in the text.
  assert [p.skip_special_tokens for p in fake.params] == [False, False]


@pytest.mark.parametrize('echo_server, text, plain_text', [
    ('llama3_json',
     '<|python_tag|>{"name": "w", "parameters": {"c": "R"}}; {"name": "t", "parameters": {}}',
     'No call {here}.'),
    ('pythonic', '[w(c="R"), t()]', 'No call [here].'),
    ('mistral', '[TOOL_CALLS] [{"name": "w", "arguments": {"c": "R"}}, {"name": "t", '
     '"arguments": {}}]', 'No call [TOOL_CALLS] [here].'),
], indirect=['echo_server'])
def test_auto_reads_json_and_pythonic_calls(echo_server, text, plain_text):
  server, _ = echo_server
  client = _client(server)
  kw = dict(model='fake', messages=[{'role': 'user', 'content': text}], tools=[W, T],
            max_tokens=500)
  want = [{'content': None, 'finish_reason': 'tool_calls',
           'calls': [('w', '{"c": "R"}'), ('t', '{}')]}]
  assert _plain(client.chat.completions.create(**kw)) == want
  assert _streamed(client, **kw) == want
  plain = dict(kw, messages=[{'role': 'user', 'content': plain_text}])
  assert _plain(client.chat.completions.create(**plain))[0]['content'] == plain_text


def test_tools_reach_the_template_and_earlier_calls_render():
  fake = FakeEngine(max_model_len=1024)
  template = ('{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}'
              '{% for m in messages %}{{ m.role }}:{{ m.content }}'
              '{% for c in m.tool_calls or [] %}({{ c.function.name }} '
              '{{ c.function.arguments.city }}){% endfor %}'
              '{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}'
              '{{ greeting }}')
  server = ServerThread(create_app(fake, FakeServed(chat_template=template),
                                   max_model_len=1024))
  try:
    messages = MESSAGES + [
        {'role': 'assistant', 'content': None, 'tool_calls': [{
            'id': 'call_1', 'type': 'function',
            'function': {'name': 'get_weather', 'arguments': '{"city": "Rome"}'}}]},
        {'role': 'tool', 'content': 'sunny', 'tool_call_id': 'call_1'}]
    want = ('[get_weather][get_time]user:w?|assistant:(get_weather Rome)|'
            'tool:sunny#call_1|hi')
    tokens = httpx.post(server.url + '/tokenize', json={
        'messages': messages, 'tools': [WEATHER, TIME],
        'chat_template_kwargs': {'greeting': 'hi'}}).json()['tokens']
    assert bytes(tokens).decode() == want
    # The chat endpoint runs the same prompt (the fake engine records it).
    httpx.post(server.url + '/v1/chat/completions', json={
        'messages': messages, 'tools': [WEATHER, TIME], 'tool_choice': 'none',
        'chat_template_kwargs': {'greeting': 'hi'}, 'max_tokens': 1}).raise_for_status()
    assert bytes(fake.prompts[-1]).decode() == want
    for body, param in (({'messages': MESSAGES, 'tools': [WEATHER]}, 'tool_choice'),
                        ({'messages': MESSAGES, 'chat_template_kwargs': {'tools': 1}},
                         'chat_template_kwargs'),
                        ({'messages': MESSAGES, 'tool_choice': 'required'}, 'tool_choice')):
      resp = httpx.post(server.url + '/v1/chat/completions', json=body)
      assert resp.status_code == 400 and resp.json()['error']['param'] == param, resp.text
  finally:
    server.stop()
    fake.shutdown()


@pytest.mark.parametrize('field', ['tools', 'tool_choice', 'chat_template_kwargs'])
def test_the_batch_cli_refuses_tools_and_says_where_they_are_served(tmp_path, field):
  from serve import generate  # pylint: disable=import-outside-toplevel
  path = tmp_path / 'in.jsonl'
  path.write_text(json.dumps({'messages': MESSAGES, field: {'x': 1}}) + '\n')
  with pytest.raises(generate.BadLine, match=f"line 1: field '{field}': .*python -m serve"):
    generate.read_jobs(str(path))


def test_the_batch_cli_gives_the_template_past_tool_calls_as_the_server_does():
  """A conversation with an assistant's earlier tool call: the batch CLI renders the
  arguments as an object (the template's tojson writes them once), as the server does."""
  import types  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from serve import generate  # pylint: disable=import-outside-toplevel
  template = ('{% for m in messages %}{{ m.role }}:{{ m.content }}'
              '{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}'
              '{% endfor %};{% endfor %}')
  seen = []
  encode = lambda text, **kw: seen.append(text) or np.zeros(1, np.int32)
  served = types.SimpleNamespace(chat_template=template, special_tokens={},
                                 tokenizer=types.SimpleNamespace(encode=encode))
  call = {'id': 'c1', 'type': 'function',
          'function': {'name': 'weather', 'arguments': '{"city": "Rome"}'}}
  generate._prompt_ids({'messages': [  # pylint: disable=protected-access
      {'role': 'user', 'content': 'Rome?'},
      {'role': 'assistant', 'content': '', 'tool_calls': [call]},
      {'role': 'tool', 'content': '21C', 'tool_call_id': 'c1'}]}, served)
  assert seen == ['user:Rome?;assistant:{"city": "Rome"};tool:21C;']


def test_serve_cli_needs_a_parser_for_auto():
  from serve.__main__ import parse_args  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    parse_args(['--checkpoint', 'x', '--enable-auto-tool-choice'])
  args = parse_args(['--checkpoint', 'x', '--enable-auto-tool-choice',
                     '--tool-call-parser', 'llama3_json'])
  assert args.tool_call_parser == 'llama3_json'
  fake = FakeEngine()
  try:
    with pytest.raises(ValueError, match='--tool-call-parser'):
      create_app(fake, FakeServed(), tool_parser='granite')
  finally:
    fake.shutdown()


def test_openai_client_types_parse_a_tool_answer(tool_server):
  """The official client reads the answer as its own types (ChatCompletionMessageToolCall)."""
  client = _client(tool_server)
  out = client.chat.completions.create(
      model='tiny', messages=MESSAGES, max_tokens=40, temperature=0.0, tools=[T],
      tool_choice={'type': 'function', 'function': {'name': 't'}})
  call = out.choices[0].message.tool_calls[0]
  assert isinstance(call, openai.types.chat.ChatCompletionMessageToolCall)
  assert call.type == 'function' and call.function.name == 't'
  assert json.loads(call.function.arguments)['z'] in (1, 2)
