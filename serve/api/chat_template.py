"""Chat messages -> prompt text, with the model's jinja2 chat template.

Rendered the way transformers' `apply_chat_template(..., tokenize=False)` does: a
sandboxed environment (templates come from downloaded models), trim_blocks and
lstrip_blocks, the `raise_exception` and `strftime_now` globals, a `tojson` filter that
keeps non-ASCII text, and the tokenizer's special tokens (bos_token, eos_token, ...) as
variables; an assistant's reasoning, under any of transformers' names for it, is given
under all of them (Qwen3's template reads reasoning_content). A model without a template
gets a plain "role: content" one.
"""

import datetime
import functools
import json

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# For models without a template (e.g. ones trained here): one line per message, then
# the turn the model is to continue.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")

ROLES = ('system', 'user', 'assistant', 'tool', 'developer')
# What a template is given beside the special tokens (the names transformers gives).
PROVIDED = ('messages', 'tools', 'documents', 'add_generation_prompt', 'raise_exception',
            'strftime_now', 'tojson', 'namespace')
# A message's reasoning (thinking) text, under the names transformers accepts; templates
# read the first (Qwen3) or `thinking` (gpt-oss).
REASONING_FIELDS = ('reasoning_content', 'thinking', 'reasoning')


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""
  tags = {'generation'}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


@functools.lru_cache(maxsize=16)
def compile_template(source: str,
                     where: str = 'chat_template in tokenizer_config.json') -> jinja2.Template:
  """The template, compiled; ValueError naming the line and `where` it came from."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise_exception
  env.globals['strftime_now'] = _strftime_now
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f'the chat template does not parse (line {e.lineno}: {e.message}); '
                     f'fix {where}.') from e


def validate_messages(messages) -> list[dict]:
  """Plain copies of the messages; ValueError naming the bad one."""
  if not isinstance(messages, list) or not messages:
    raise ValueError('messages must be a non-empty list of {"role": ..., "content": ...} '
                     'objects.')
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise ValueError(f'messages[{i}] must be an object with "role" and "content", got '
                       f'{type(m).__name__}.')
    if m.get('role') not in ROLES:
      raise ValueError(f'messages[{i}].role={m.get("role")!r}: choose one of {ROLES}.')
    if not isinstance(m.get('content'), str):
      raise ValueError(f'messages[{i}].content must be a string (content parts are not '
                       f'supported), got {type(m.get("content")).__name__}.')
    out.append(_with_reasoning(i, m))
  return out


def _with_reasoning(i: int, message: dict) -> dict:
  """A copy of message with its reasoning under every name, as transformers gives it."""
  given = [k for k in REASONING_FIELDS if message.get(k) is not None]
  for k in given:
    if not isinstance(message[k], str):
      raise ValueError(f'messages[{i}].{k} must be a string (the reasoning text), got '
                       f'{type(message[k]).__name__}.')
  if not given:
    return dict(message)
  return {'thinking': message[given[0]], **message, 'reasoning_content': message[given[0]]}


def render_chat(model, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, **variables) -> str:
  """The prompt text for `messages` under `model`'s (a ServedModel's) chat template.

  tools: OpenAI's tool objects, as transformers passes them; variables: more for the
  template (a request's chat_template_kwargs), over the special tokens."""
  template = compile_template(model.chat_template or DEFAULT_TEMPLATE)
  try:
    return template.render(messages=validate_messages(messages), tools=tools, documents=None,
                           add_generation_prompt=add_generation_prompt,
                           **{**model.special_tokens, **variables})
  except jinja2.exceptions.SecurityError as e:
    raise ValueError(f'the chat template does what its sandbox forbids ({e}), as '
                     'transformers\' does too: fix the template.') from e
  except jinja2.exceptions.UndefinedError as e:
    # A field the messages lack, a helper some other renderer gives, or a variable of
    # the template's own.
    raise ValueError(f'the chat template reads something undefined here ({e}): a field '
                     'these messages lack, or a name it is not given (it is given '
                     f'{", ".join(PROVIDED)} and the special tokens; give a variable of '
                     'its own in chat_template_kwargs).') from e
  except jinja2.TemplateError as e:
    # raise_exception in a template: the template refused these messages.
    raise ValueError(f'the chat template rejected the messages: {e}') from e
  except (TypeError, AttributeError) as e:
    raise ValueError(f'the chat template failed on these messages ({type(e).__name__}: '
                     f'{e}): check the fields it reads (content, tool_calls, ...).') from e
