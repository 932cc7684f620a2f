"""Tool-call output parsers: output text deltas in, content and tool-call deltas out, in
OpenAI's streaming shape (serve/api/tools.py says which parser a choice gets).

A call is sent whole once its JSON is complete; a named function's arguments stream as
they come. Concatenated, the deltas are what a non-streamed answer holds, whatever the
chunking; text that does not parse as a call comes back as content, never dropped.
"""

import ast
import dataclasses
import json
import random
import string
import uuid


HERMES_OPEN, HERMES_CLOSE = '<tool_call>', '</tool_call>'
SEPARATORS = ' \n\t,;[]'   # between JSON calls: dropped


def openai_call_id() -> str:
  return f'call_{uuid.uuid4().hex[:24]}'


@dataclasses.dataclass
class ToolCall:
  name: str
  arguments: str            # JSON text
  id: str = dataclasses.field(default_factory=openai_call_id)

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


class NamedParser:
  """The whole output is the named function's arguments, streamed as they come.
  new_id: the call id's maker (Mistral's templates take back 9-character ids only)."""

  def __init__(self, name: str, new_id=openai_call_id):
    self.call = ToolCall(name, '', new_id())
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
    self.calls.append(ToolCall(name, text, self._new_id()))
    return {'index': len(self.calls) - 1, **self.calls[-1].openai()}

  @staticmethod
  def _new_id() -> str:
    return openai_call_id()


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


class MistralRequiredParser(RequiredParser):
  """RequiredParser with Mistral's 9-character call ids (what its templates take back)."""

  @staticmethod
  def _new_id() -> str:
    return mistral_call_id()


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


class MistralParser:
  """Mistral's calls (vLLM's mistral): the text before `[TOOL_CALLS]` is content, as
  written; after it, a JSON list of {"name": ..., "arguments": {...}} objects (or one
  such object; "arguments" may be a JSON string of an object), each a call once it
  closes. An object of another shape is content, so is text beside the calls (but
  brackets and separators), and so is an object cut short. Until its first call the text
  after the tag is held: if none comes, the tag and that text are content as written.
  Call ids are 9 letters and digits, what Mistral's chat templates accept back as a
  tool_call_id."""
  TAG = '[TOOL_CALLS]'

  def __init__(self, parallel: bool = True):
    self._parallel = parallel
    self._buffer = ''          # before the tag: a tail that may begin it
    self._objects = None       # after the tag: the objects' parser
    self._held, self._raw = Delta(), ''   # after the tag, until its first call

  @property
  def calls(self) -> list[ToolCall]:
    return self._objects.calls if self._objects else []

  def feed(self, text: str) -> Delta:
    if self._objects is not None:
      return self._release(self._objects.feed(text), text)
    self._buffer += text
    at = self._buffer.find(self.TAG)
    if at < 0:
      cut = len(self._buffer) - _prefix_tail(self._buffer, self.TAG)
      out, self._buffer = self._buffer[:cut], self._buffer[cut:]
      return Delta(content=out)
    before, rest = self._buffer[:at], self._buffer[at + len(self.TAG):]
    self._objects, self._buffer = _MistralObjects(self._parallel), ''
    return Delta(content=before) + self._release(self._objects.feed(rest), rest)

  def finish(self) -> Delta:
    if self._objects is None:
      return Delta(content=self._buffer)
    delta = self._release(self._objects.finish(), '')
    if not self.calls:   # no call after the tag: the output as written
      return Delta(content=self.TAG + self._raw)
    return delta

  def _release(self, delta: Delta, text: str) -> Delta:
    """delta, once a call has come (with what was held before it); else nothing yet."""
    if self.calls:
      held, self._held = self._held, Delta()
      return held + delta
    self._held, self._raw = self._held + delta, self._raw + text
    return Delta()


class _MistralObjects(_ObjectsParser):
  """The JSON after [TOOL_CALLS]: objects in a list (LEVEL 1), or one at the top (LEVEL 0,
  chosen by the first character that is not a blank)."""
  LEVEL = None

  def __init__(self, parallel: bool):
    super().__init__(parallel)
    self._head = ''

  def feed(self, text: str) -> Delta:
    if self.LEVEL is None:
      self._head += text
      body = self._head.lstrip()
      if not body:
        return Delta()
      self.LEVEL, text = 0 if body.startswith('{') else 1, self._head
    return super().feed(text)

  def finish(self) -> Delta:
    return Delta() if self.LEVEL is None else super().finish()

  def _arguments_key(self, call: dict) -> str:
    return 'arguments'

  def _object(self, text: str) -> Delta:
    call = _json_object(text)
    if call is not None and isinstance(call.get('arguments'), str):
      call['arguments'] = _json_object(call['arguments'])
      text = json.dumps(call) if call['arguments'] is not None else text
    return super()._object(text)

  @staticmethod
  def _new_id() -> str:
    return mistral_call_id()


def mistral_call_id() -> str:
  return ''.join(random.SystemRandom().choices(string.ascii_letters + string.digits, k=9))


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
