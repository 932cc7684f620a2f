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

import ast
import dataclasses
import json
import uuid

from serve.sampling_params import SamplingParamsError, guided_field

PARSERS = ('hermes', 'llama3_json', 'pythonic')   # --tool-call-parser
FIELDS = ('tools', 'tool_choice', 'parallel_tool_calls')   # the request's, read here
HERMES_OPEN, HERMES_CLOSE = '<tool_call>', '</tool_call>'
SEPARATORS = ' \n\t,;[]'   # between JSON calls: dropped


def _call_id() -> str:
  return f'call_{uuid.uuid4().hex[:24]}'


@dataclasses.dataclass
class ToolCall:
  name: str
  arguments: str            # JSON text
  id: str = dataclasses.field(default_factory=_call_id)

  def openai(self) -> dict:
    return {'id': self.id, 'type': 'function',
            'function': {'name': self.name, 'arguments': self.arguments}}


@dataclasses.dataclass
class Delta:
  """What one piece of output text becomes: content to show and tool-call deltas."""
  content: str = ''
  tool_calls: list = dataclasses.field(default_factory=list)   # OpenAI's delta items

  def __add__(self, other: 'Delta') -> 'Delta':
    return Delta(self.content + other.content, self.tool_calls + other.tool_calls)


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
    if self.mode == 'named':
      return NamedParser(self.name)
    if self.mode == 'required':
      return RequiredParser()
    if self.mode == 'auto':
      kind = {'hermes': HermesParser, 'llama3_json': Llama3JsonParser,
              'pythonic': PythonicParser}[self.auto_parser]
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


# --- output parsers: text deltas in, content and tool-call deltas out ---

class NamedParser:
  """The whole output is the named function's arguments, streamed as they come."""

  def __init__(self, name: str):
    self.call = ToolCall(name, '')
    self._started = False

  def feed(self, text: str) -> Delta:
    if not text:
      return Delta()
    self.call.arguments += text
    return Delta(tool_calls=[self._item(text)])

  def finish(self) -> Delta:
    return Delta() if self._started else Delta(tool_calls=[self._item('')])

  def _item(self, text: str) -> dict:
    if self._started:
      return {'index': 0, 'function': {'arguments': text}}
    self._started = True
    return {'index': 0, 'id': self.call.id, 'type': 'function',
            'function': {'name': self.call.name, 'arguments': text}}

  @property
  def calls(self) -> list[ToolCall]:
    return [self.call]


class _WholeCalls:
  """Calls sent whole, each as one delta item, in order."""

  def __init__(self):
    self.calls: list[ToolCall] = []

  def _add(self, name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    self.calls.append(ToolCall(name, text))
    return {'index': len(self.calls) - 1, **self.calls[-1].openai()}


class _StringState:
  """Whether a scan of text is inside a string, a character at a time: JSON's "..." by
  default, quotes='\'"' for Python's '...' and "..." too."""

  def __init__(self, quotes: str = '"'):
    self._quotes, self._quote, self._escape = quotes, None, False

  def step(self, c: str) -> bool:
    """Advances over c; whether c belongs to a string (its quotes included)."""
    if self._quote:
      if self._escape:
        self._escape = False
      elif c == '\\':
        self._escape = True
      elif c == self._quote:
        self._quote = None
      return True
    if c in self._quotes:
      self._quote = c
    return self._quote is not None


class _ObjectsParser(_WholeCalls):
  """Calls written as JSON objects at one nesting level (0: side by side, 1: in an
  array): each object a call once it closes, if it has the call's shape, else content;
  text between them content unless only brackets and separators, and what did not close
  by the end content."""
  LEVEL = 0

  def __init__(self, parallel: bool = True):
    super().__init__()
    self._parallel = parallel   # False: the first call only, later ones dropped
    self._text = ''
    self._done = 0            # text consumed: whole objects and what came before them
    self._depth, self._string, self._start = 0, _StringState(), None

  def feed(self, text: str) -> Delta:
    delta, begin = Delta(), len(self._text)
    self._text += text
    for i in range(begin, len(self._text)):
      c = self._text[i]
      if self._string.step(c):
        continue
      if c in '[{':
        if c == '{' and self._depth == self.LEVEL:
          self._start = i
          delta += self._between(self._text[self._done:i])
        self._depth += 1
      elif c in ']}' and self._depth > 0:   # a stray closer at the top is text
        self._depth -= 1
        if c == '}' and self._depth == self.LEVEL and self._start is not None:
          delta += self._object(self._text[self._start:i + 1])
          self._start, self._done = None, i + 1
    return delta

  @staticmethod
  def _between(text: str) -> Delta:
    """Text between objects: content, unless only brackets and separators."""
    return Delta(content=text if text.strip(SEPARATORS) else '')

  def _object(self, text: str) -> Delta:
    call = _json_object(text)
    arguments = None if call is None else call.get(self._arguments_key(call))
    if call is None or not isinstance(call.get('name'), str) or not isinstance(arguments,
                                                                                dict):
      return Delta(content=text)
    if self.calls and not self._parallel:
      return Delta()
    return Delta(tool_calls=[self._add(call['name'], arguments)])

  def _arguments_key(self, call: dict) -> str:
    del call
    return 'parameters'

  def finish(self) -> Delta:
    """Output cut short (max_tokens): an object that did not close is content (from its
    "{"), and so is other text after the last call."""
    if self._start is not None:
      return Delta(content=self._text[self._start:])
    return self._between(self._text[self._done:])


class RequiredParser(_ObjectsParser):
  """tool_choice "required": a JSON array of {"name", "parameters"} objects."""
  LEVEL = 1


class Llama3JsonParser(_ObjectsParser):
  """Llama 3.1-3.3's JSON calls (vLLM's llama3_json): an output that starts with
  <|python_tag|> or "{" is {"name": ..., "parameters": {...}} objects ("arguments" taken
  too), separated by ";"; any other output is content, as written."""
  TAG = '<|python_tag|>'

  def __init__(self, parallel: bool = True):
    super().__init__(parallel)
    self._head = ''           # the output's start, until it shows which kind it is
    self._calls_mode = None   # None: not yet known

  def feed(self, text: str) -> Delta:
    if self._calls_mode is None:
      self._head += text
      if self._head.startswith(self.TAG) or self._head.startswith('{'):
        self._calls_mode, text = True, self._head.removeprefix(self.TAG)
      elif self._head and not self.TAG.startswith(self._head):
        self._calls_mode, text = False, self._head
      else:
        return Delta()        # empty, or a proper prefix of the tag: wait
    return super().feed(text) if self._calls_mode else Delta(content=text)

  def finish(self) -> Delta:
    if self._calls_mode is None:   # the whole output is a prefix of the tag
      return Delta(content=self._head)
    return super().finish() if self._calls_mode else Delta()

  def _arguments_key(self, call: dict) -> str:
    return 'arguments' if 'arguments' in call else 'parameters'


class HermesParser(_WholeCalls):
  """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks are calls (a closing
  tag inside a JSON string does not close one); the text outside them is content, less
  the whitespace before a call, after one that no content came before and at the end, so
  an answer without calls is the text unchanged. A block that is not such a call
  (arguments not an object, JSON cut short) stays content, tags and all. parallel False
  keeps the first call and drops later ones."""

  def __init__(self, parallel: bool = True):
    super().__init__()
    self._parallel = parallel
    self._buffer = ''         # text not yet sent: a possible tag start, or a call's body
    self._in_call = False
    self._scan = 0            # in a call: how far the body has been scanned, and
    self._string = _StringState()   # whether that point is in a JSON string
    self._space = ''          # whitespace held: dropped if a call comes next
    self._after_block = False   # a call has been met
    self._shown = False         # content has been sent

  def feed(self, text: str) -> Delta:
    self._buffer += text
    delta = Delta()
    while True:
      at = self._close_at() if self._in_call else self._buffer.find(HERMES_OPEN)
      if at < 0:
        break
      tag = HERMES_CLOSE if self._in_call else HERMES_OPEN
      before, self._buffer = self._buffer[:at], self._buffer[at + len(tag):]
      delta += self._block(before, closed=True) if self._in_call else self._content(before)
      self._in_call = not self._in_call
      self._scan, self._string = 0, _StringState()
    if not self._in_call:   # all but a tail that may begin the tag
      keep = _prefix_tail(self._buffer, HERMES_OPEN)
      delta += self._content(self._buffer[:len(self._buffer) - keep])
      self._buffer = self._buffer[len(self._buffer) - keep:]
    return delta

  def finish(self) -> Delta:
    """The end: an unclosed block is a call if its JSON is whole, else content."""
    rest, self._buffer = self._buffer, ''
    delta = self._block(rest, closed=False) if self._in_call else self._content(rest)
    if not self._after_block:   # no call: the text as written, to its last space
      delta += Delta(content=self._space)
    return delta

  def _close_at(self) -> int:
    """Where the closing tag starts in the buffer (outside JSON strings), or -1."""
    b, i = self._buffer, self._scan
    while i < len(b):
      c = b[i]
      if self._string.step(c):
        pass
      elif c == '<':
        if b.startswith(HERMES_CLOSE, i):
          return i
        if HERMES_CLOSE.startswith(b[i:]):
          break             # the tag may still be arriving
      i += 1
    self._scan = i
    return -1

  def _content(self, text: str) -> Delta:
    """Content; its trailing whitespace held (dropped if a call comes next), and the
    whitespace after a call that nothing was shown before dropped."""
    text = self._space + text
    if self._after_block and not self._shown:
      text = text.lstrip()
    body = text.rstrip()
    self._space = text[len(body):]
    self._shown = self._shown or bool(body)
    return Delta(content=body)

  def _block(self, body: str, closed: bool) -> Delta:
    call = _json_object(body)
    arguments = call.get('arguments') if call is not None else None
    if isinstance(arguments, str):
      arguments = _json_object(arguments)
    if call is None or not isinstance(call.get('name'), str) or not isinstance(arguments,
                                                                                dict):
      return self._content(HERMES_OPEN + body + (HERMES_CLOSE if closed else ''))
    self._space, self._after_block = '', True
    if self.calls and not self._parallel:
      return Delta()            # parallel_tool_calls false: the first call only
    return Delta(tool_calls=[self._add(call['name'], arguments)])


class PythonicParser(_WholeCalls):
  """Pythonic calls (vLLM's pythonic; Llama 3.2's and 4's): an output that starts with
  "[" (after <|python_start|> and blanks) is read as a Python list of calls with keyword
  arguments of literal values, `[get_weather(city="Rome"), get_time()]`, up to the "]"
  that closes it; any other output is content, as written. Each item of the list that
  parses as such a call is a call, sent when the "," or "]" after it arrives. An output
  in which no item is a call is content as written. Otherwise the text between calls is
  content unless only brackets and separators, so is what follows the list (less the
  <|python_start|> and <|python_end|> tags), and so is an item cut short by the end."""
  START, END = '<|python_start|>', '<|python_end|>'

  def __init__(self, parallel: bool = True):
    super().__init__()
    self._parallel = parallel
    self._head = ''             # the output's start, until it shows which kind it is
    self._calls_mode = None     # None: not yet known
    self._text = ''             # in calls mode: the output
    self._done = 0              # text consumed: sent, or calls and what came before them
    self._depth, self._string, self._item = 0, _StringState(quotes='\'"'), None
    self._closed = False        # the list's "]" has come: nothing after it is a call

  def feed(self, text: str) -> Delta:
    if self._calls_mode is None:
      self._head += text
      head = self._head.lstrip()
      tagged = head.startswith(self.START)
      body = head.removeprefix(self.START).lstrip()
      if body.startswith('['):
        self._calls_mode, text = True, self._head
      elif body and (tagged or not self.START.startswith(head)):
        self._calls_mode, text = False, self._head
      else:
        return Delta()          # blanks, or a proper prefix of the tag: wait
    return self._scan(text) if self._calls_mode else Delta(content=text)

  def _scan(self, text: str) -> Delta:
    delta, begin = Delta(), len(self._text)
    self._text += text
    for i in range(begin, len(self._text)):
      if self._closed:
        break
      c = self._text[i]
      if self._string.step(c):
        if self._depth == 1 and self._item is None:
          self._item = i
        continue
      if self._depth == 1 and c in ',]':   # an item of the list ends
        if self._item is not None:
          delta += self._end_item(self._item, i)
        self._item = None
      elif self._depth == 1 and self._item is None and not c.isspace():
        self._item = i
      if c in '([{':
        self._depth += 1
      elif c in ')]}' and self._depth > 0:
        self._depth -= 1
        if self._depth == 0:
          self._closed = True
          if self.calls:        # what the list held after its last call
            delta += self._between(self._text[self._done:i + 1])
            self._done = i + 1
    if self._closed and not self.calls:   # no call: the output as written, as it comes
      delta += Delta(content=self._text[self._done:])
      self._done = len(self._text)
    return delta

  def _end_item(self, start: int, end: int) -> Delta:
    call = _pythonic_call(self._text[start:end])
    if call is None:
      return Delta()            # stays text: content with what comes around it
    delta = self._between(self._text[self._done:start])
    self._done = end
    if self.calls and not self._parallel:
      return delta
    return delta + Delta(tool_calls=[self._add(*call)])

  def _between(self, text: str) -> Delta:
    """Text beside calls: content, less the tags, unless only brackets and separators."""
    text = text.replace(self.START, '').replace(self.END, '')
    return Delta(content=text if text.strip(SEPARATORS) else '')

  def finish(self) -> Delta:
    """The end: without calls, what was not sent (all, if the list never closed); after
    calls, the text after the list, or an item cut short."""
    if self._calls_mode is None:   # blanks, or a prefix of the tag
      return Delta(content=self._head)
    if not self._calls_mode:
      return Delta()
    rest = self._text[self._done:]
    if not self.calls:
      return Delta(content=rest)
    if not self._closed and self._item is not None and not self._between(self._text[self._done:self._item]).content:
      rest = self._text[self._item:]   # the open item alone
    return self._between(rest)


def _pythonic_call(text: str) -> tuple[str, dict] | None:
  """(name, arguments) of `name(key=literal, ...)` with JSON values, or None."""
  try:
    node = ast.parse(text.strip(), mode='eval').body
    if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
        or any(k.arg is None for k in node.keywords)):
      return None
    arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    json.dumps(arguments, allow_nan=False)   # sets, bytes, complex, inf and nan are not
  except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
    return None               # (a model repeating "-" or "(" can nest past the parser)
  return node.func.id, arguments


def _json_object(text: str) -> dict | None:
  try:
    value = json.loads(text)
  except (ValueError, RecursionError):   # RecursionError: arrays nested past the parser
    return None
  return value if isinstance(value, dict) else None


def _prefix_tail(text: str, tag: str) -> int:
  """Length of the longest tail of text that is a proper prefix of tag."""
  for k in range(min(len(tag) - 1, len(text)), 0, -1):
    if tag.startswith(text[-k:]):
      return k
  return 0
