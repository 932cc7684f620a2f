"""Tool calling for /v1/chat/completions: OpenAI's `tools` and `tool_choice`, as vLLM serves them.

The tools always go to the chat template (`tools=`, OpenAI's objects), so the model reads
them the way it was trained to. What the output becomes depends on `tool_choice`:

  "none"                    text, as without tools
  {"type": "function",      the output is held to JSON that the named function's
   "function": {"name": f}}  `parameters` schema accepts (structured output) and is returned
                            as one call of f with those arguments (finish_reason "stop")
  "required"                the output is held to a JSON array of one or more
                            {"name": ..., "parameters": {...}} objects of the given tools
                            (one with parallel_tool_calls false); each is a call
  "auto" (the default       the model chooses, and the server's --tool-call-parser reads
   when tools are given)     its calls: hermes, each `<tool_call>{"name": ..., "arguments":
                            {...}}</tool_call>` (Hermes' and Qwen's format), the text
                            around them the content; llama3_json, an output that starts
                            with <|python_tag|> or "{" as `{"name": ..., "parameters":
                            {...}}` objects separated by ";" (Llama 3.1-3.3's); pythonic,
                            an output that starts with "[" as a Python list of calls with
                            keyword arguments, `[f(city="Rome"), g()]` (Llama 3.2's and 4's)

A call made under "required" or "auto" ends the choice with finish_reason "tool_calls".
Each choice has its own parser (`ToolChoice.parser()`), fed the output text as it streams:
it returns content to show and tool-call deltas in OpenAI's streaming shape (a call is
sent whole once its JSON is complete; a named function's arguments stream as they come).
Concatenated, the deltas are what a non-streamed answer holds, whatever the chunking.
Under "required" and "auto", text that does not parse as a call (a truncated output) comes
back as content, never dropped; a named function's arguments are returned as written.
"""

import dataclasses
import json

from serve.api.openai_sampling import guided_field
from serve.api.tool_parsers import (HermesParser, Llama3JsonParser, MistralParser,
                                    MistralRequiredParser, NamedParser, PythonicParser,
                                    RequiredParser, mistral_call_id, openai_call_id)
from serve.sampling_params import SamplingParamsError


PARSERS = ('hermes', 'llama3_json', 'mistral', 'pythonic')   # --tool-call-parser
FIELDS = ('tools', 'tool_choice', 'parallel_tool_calls')   # the request's, read here


@dataclasses.dataclass(frozen=True)
class ToolChoice:
  """A request's tools and what tool_choice asks for."""
  tools: tuple              # OpenAI's tool objects, checked
  mode: str                 # 'none', 'auto', 'required' or 'named'
  name: str | None = None   # the named function
  parallel: bool = True     # parallel_tool_calls
  auto_parser: str = 'hermes'   # how "auto" reads calls (PARSERS)
  # 'named' and 'required': schema()'s regular expression, the output's guide (parse)
  regex: str | None = None

  @property
  def template_tools(self) -> list[dict] | None:
    return [dict(t) for t in self.tools] or None

  def schema(self) -> dict | None:
    """The JSON schema the output is held to ('named' and 'required'), else None."""
    if self.mode == 'named':
      return _parameters(self._functions()[self.name])
    if self.mode != 'required':
      return None
    calls, defs = [], {}
    for name, fn in self._functions().items():
      parameters = dict(_parameters(fn))
      # A tool's "#/$defs/X" references point at the root: its $defs move up there.
      for key in ('$defs', 'definitions'):
        for def_name, value in (parameters.pop(key, None) or {}).items():
          if defs.setdefault(key, {}).setdefault(def_name, value) != value:
            raise SamplingParamsError('tools', f'two tools define {key} {def_name!r} '
                                      'differently; under tool_choice "required" their '
                                      'schemas share one root: rename one')
      calls.append({'type': 'object', 'properties': {
          'name': {'type': 'string', 'enum': [name]}, 'parameters': parameters},
                    'required': ['name', 'parameters']})
    return {'type': 'array', 'minItems': 1, **({} if self.parallel else {'maxItems': 1}),
            'items': calls[0] if len(calls) == 1 else {'anyOf': calls}, **defs}

  def parser(self):
    """A fresh output parser for one choice; None for 'none' (plain text)."""
    mistral = self.auto_parser == 'mistral'   # its templates take 9-character ids only
    if self.mode == 'named':
      return NamedParser(self.name, mistral_call_id if mistral else openai_call_id)
    if self.mode == 'required':
      return MistralRequiredParser() if mistral else RequiredParser()
    if self.mode == 'auto':
      kind = {'hermes': HermesParser, 'llama3_json': Llama3JsonParser,
              'mistral': MistralParser, 'pythonic': PythonicParser}[self.auto_parser]
      return kind(self.parallel)
    return None

  @property
  def ends_with_calls(self) -> bool:
    """Whether a call ends the choice with finish_reason "tool_calls" (OpenAI: not for a
    named function, which was asked for)."""
    return self.mode in ('auto', 'required')

  def _functions(self) -> dict:
    return {t['function']['name']: t['function'] for t in self.tools}


def _parameters(function: dict) -> dict:
  return function.get('parameters') or {'type': 'object', 'properties': {}}


def parse(body: dict, auto_parser: str | None) -> ToolChoice | None:
  """The tools and tool_choice of a chat body (None without either); SamplingParamsError
  naming the field. auto_parser: the server's --tool-call-parser with
  --enable-auto-tool-choice, else None."""
  tools, choice = body.get('tools'), body.get('tool_choice')
  for name, neutral in (('functions', ([],)), ('function_call', ('none', 'auto'))):
    if body.get(name) is not None and not any(
        type(body[name]) is type(v) and body[name] == v for v in neutral):
      raise SamplingParamsError(name, 'is OpenAI\'s deprecated form; send "tools" and '
                                '"tool_choice" instead')
  parallel = body.get('parallel_tool_calls')
  if parallel is not None and not isinstance(parallel, bool):
    raise SamplingParamsError('parallel_tool_calls', f'must be true or false, got {parallel!r}')
  if tools is None and choice is None:
    return None
  tools = check_tools([] if tools is None else tools)
  names = [t['function']['name'] for t in tools]
  if choice is None:
    choice = 'auto' if tools else 'none'
  if isinstance(choice, dict):
    name = _named_choice(choice)
    if name not in names:
      raise SamplingParamsError('tool_choice', f'names function {name!r}, which is not one '
                                f'of the tools ({", ".join(names) or "none given"})')
    mode = 'named'
  elif choice in ('none', 'auto', 'required'):
    name, mode = None, choice
  else:
    raise SamplingParamsError('tool_choice', 'must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}, got '
                              f'{choice!r}')
  if mode in ('required', 'auto') and not tools:
    if mode == 'auto':
      return None
    raise SamplingParamsError('tool_choice', '"required" needs "tools" to choose from')
  if mode == 'auto' and auto_parser is None:
    raise SamplingParamsError('tool_choice', '"auto" (the default with tools) needs the '
                              'server started with --enable-auto-tool-choice '
                              '--tool-call-parser hermes; or send "tool_choice": '
                              '"required", "none" or a named function')
  if mode in ('named', 'required'):
    field = guided_field(body) or next(
        (f for f in ('ignore_eos', 'min_tokens', 'allowed_token_ids') if body.get(f)), None)
    if field is not None:
      raise SamplingParamsError(field, f'cannot be combined with tool_choice {choice!r}, '
                                'which holds the output to the tools\' JSON schemas')
  out = ToolChoice(tuple(tools), mode, name, parallel is not False, auto_parser or 'hermes')
  schema = out.schema()
  if schema is None:
    return out
  space = body.get('guided_whitespace_pattern')
  if space is not None and not isinstance(space, str):
    raise SamplingParamsError('guided_whitespace_pattern', f'must be a regular expression, '
                              f'got {space!r}')
  from serve.structured import guided  # pylint: disable=import-outside-toplevel
  return dataclasses.replace(out, regex=guided.json_schema_regex(schema, 'tools', space))


def _named_choice(choice: dict) -> str:
  fn = choice.get('function')
  if choice.get('type') != 'function' or not isinstance(fn, dict) \
      or not isinstance(fn.get('name'), str):
    raise SamplingParamsError('tool_choice', 'a named choice is {"type": "function", '
                              f'"function": {{"name": ...}}}}, got {choice!r}')
  return fn['name']


def check_tools(tools) -> list[dict]:
  """tools as OpenAI defines them; SamplingParamsError naming the first bad one."""
  if not isinstance(tools, list):
    raise SamplingParamsError('tools', f'must be a list of tools, got {tools!r}')
  seen = set()
  for i, tool in enumerate(tools):
    fn = tool.get('function') if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get('type') != 'function' or not isinstance(fn, dict):
      raise SamplingParamsError('tools', f'tools[{i}] must be {{"type": "function", '
                                f'"function": {{"name": ..., "parameters": {{...}}}}}}, got '
                                f'{json.dumps(tool)[:80]}')
    name = fn.get('name')
    if not isinstance(name, str) or not name:
      raise SamplingParamsError('tools', f'tools[{i}].function.name must be a non-empty '
                                f'string, got {name!r}')
    if name in seen:
      raise SamplingParamsError('tools', f'function {name!r} is given twice')
    seen.add(name)
    if fn.get('parameters') is not None and not isinstance(fn['parameters'], dict):
      raise SamplingParamsError('tools', f'tools[{i}].function.parameters must be a JSON '
                                f'schema (an object), got {fn["parameters"]!r}')
  return tools


def template_messages(messages: list[dict]) -> list[dict]:
  """Messages for the chat template: an assistant's tool_calls with their arguments as
  objects (vLLM's: templates such as Llama 3.1's write them with tojson), a tool
  message's tool_call_id and name kept."""
  out = []
  for i, m in enumerate(messages):
    m = dict(m)
    calls = m.get('tool_calls')
    if calls is not None:
      if not isinstance(calls, list) or not all(
          isinstance(c, dict) and isinstance(c.get('function'), dict)
          and isinstance(c['function'].get('name'), str) for c in calls):
        raise ValueError(f'messages[{i}].tool_calls must be a list of {{"id": ..., "type": '
                         '"function", "function": {"name": ..., "arguments": "..."}}')
      m['tool_calls'] = [{**c, 'function': {**c['function'], 'arguments': _arguments_object(
          c['function'].get('arguments'))}} for c in calls]
    out.append(m)
  return out


def _arguments_object(arguments):
  if arguments is None or arguments == '':
    return {}
  if isinstance(arguments, str):
    try:
      return json.loads(arguments)
    except ValueError:
      return arguments
  return arguments
