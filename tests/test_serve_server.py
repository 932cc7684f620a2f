"""The HTTP server: OpenAI protocol, errors, disconnects, queue limit, auth, metrics, drain.

Protocol and error tests run on a fake engine (echoes the prompt on a thread, at a pace
the test sets); end-to-end tests run the real Engine on the shared tiny trained model and
talk to it with the official `openai` client. Every server binds 127.0.0.1 on a free port
and is stopped by its fixture.
"""

import dataclasses
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn

from serve import sampling_params as sp_lib
from serve.api import openai_sampling
from serve.api.chat_template import render_chat
from serve.api.server import create_app
from serve.engine import core as engine_lib, errors, outputs
from serve.engine.stream import RequestStream
from training.tokenizer import ByteTokenizer, HFTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ fake engine

@dataclasses.dataclass
class FakeServed:
  tokenizer: object = dataclasses.field(default_factory=ByteTokenizer)
  name: str = 'fake'
  eos_token_ids: list = dataclasses.field(default_factory=lambda: [256])
  chat_template: str | None = None
  special_tokens: dict = dataclasses.field(default_factory=dict)
  sampling_defaults: dict = dataclasses.field(default_factory=dict)


class FakeEngine:
  """Echoes each prompt back, one token per step of step_s; `paused` stops all progress.

  `held` counts requests holding (pretend) blocks: a leak shows as held > 0 at rest.
  """

  def __init__(self, step_s: float = 0.002, max_waiting: int = 64, max_model_len: int = 64,
               stop_after_prompt: bool = False):
    self.step_s, self.max_waiting, self.max_model_len = step_s, max_waiting, max_model_len
    self.stop_after_prompt = stop_after_prompt   # the echo ends ('stop') with the prompt
    self.vocab_size = 257
    self.paused = False
    self.first_last = False   # a request whose id ends in -0 waits for the others to end
    self.aborted = []
    self.seeds = []            # of every request added, in order
    self.params = []           # the SamplingParams of every request added, in order
    self.prompts = []          # and their prompt ids
    self._live = {}            # request id -> [stream, prompt, params, num emitted]
    self._lock = threading.Lock()
    self._observers = []
    self._stop = False
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  @property
  def max_waiting_requests(self) -> int:
    return self.max_waiting

  @property
  def held(self) -> int:
    with self._lock:
      return len(self._live)

  def add_request(self, prompt_ids, params, request_id=None):
    params.validate(self.vocab_size)
    with self._lock:
      if len(self._live) >= self.max_waiting:
        raise errors.QueueFull(f'{len(self._live)} requests are already waiting')
      stream = RequestStream(request_id, list(prompt_ids), self)
      self.seeds.append(params.seed)
      self.params.append(params)
      self.prompts.append(list(prompt_ids))
      self._live[request_id] = [stream, list(prompt_ids), params, 0]
    return stream

  def abort(self, request_id):
    with self._lock:
      item = self._live.pop(request_id, None)
    if item:
      self.aborted.append(request_id)
      self._put(item, [], True, 'abort')

  def stats(self):
    return outputs.EngineStats(self.held, 0, self.held / 10, 0, 0, 0, 0, {})

  def health(self):
    return None   # the fake's loop never dies

  def add_observer(self, fn):
    self._observers.append(fn)

  def shutdown(self):
    self._stop = True
    self._thread.join(5)

  def _put(self, item, tokens, finished, reason):
    stream, prompt, params, _ = item
    logprobs = ([outputs.TokenLogprob(t, -0.5, [(t, -0.5)] * (params.logprobs or 0))
                 for t in tokens] if params.logprobs is not None else None)
    scores = None   # asked for: on the first output, prompt token i's logprob -i / 100
    if params.prompt_logprobs is not None and item[3] == 1:
      scores = [None] + [outputs.TokenLogprob(t, -i / 100, [(t, -i / 100)], 1)
                         for i, t in enumerate(prompt[1:], 1)]
    stream.put(outputs.RequestOutput(
        stream.request_id, tokens, ByteTokenizer().decode(tokens), logprobs, finished,
        reason, len(prompt), item[3], prompt_logprobs=scores))

  def _loop(self):
    while not self._stop:
      time.sleep(self.step_s)
      if self.paused:
        continue
      with self._lock:
        items = list(self._live.items())
      if self.first_last and len(items) > 1:
        items = [(rid, item) for rid, item in items if not rid.endswith('-0')]
      for rid, item in items:
        prompt, params = item[1], item[2]
        token = prompt[item[3] % len(prompt)]
        item[3] += 1
        stop = self.stop_after_prompt and item[3] == len(prompt)
        done = stop or item[3] >= params.max_tokens
        if done:
          with self._lock:
            self._live.pop(rid, None)
        self._put(item, [token], done, ('stop' if stop else 'length') if done else None)


# ------------------------------------------------------------------ server fixtures

class ServerThread:
  """uvicorn on 127.0.0.1 and a free port, in a thread."""

  def __init__(self, app):
    sock = socket.socket()
    sock.bind(('127.0.0.1', 0))
    self.url = f'http://127.0.0.1:{sock.getsockname()[1]}'
    self.app = app
    self.server = uvicorn.Server(uvicorn.Config(app, log_level='warning', lifespan='off'))
    self.thread = threading.Thread(target=self.server.run, kwargs={'sockets': [sock]},
                                   daemon=True)
    self.thread.start()
    deadline = time.monotonic() + 30
    while not self.server.started:
      assert time.monotonic() < deadline and self.thread.is_alive(), 'server did not start'
      time.sleep(0.01)

  def stop(self):
    self.server.should_exit = True
    self.thread.join(10)


@pytest.fixture
def fake():
  engine = FakeEngine()
  yield engine
  engine.shutdown()


@pytest.fixture
def fake_server(fake):
  server = ServerThread(create_app(fake, FakeServed()))
  yield server
  server.stop()


def _client(server, **kw) -> openai.OpenAI:
  return openai.OpenAI(base_url=server.url + '/v1', api_key=kw.pop('api_key', 'none'),
                       max_retries=0, timeout=30, **kw)


def _wait_for(predicate, timeout=10.0):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, 'timed out waiting'
    time.sleep(0.01)


# ------------------------------------------------------------------ protocol (fake engine)

def test_models_health_and_completion_stream(fake_server, fake):
  client = _client(fake_server)
  assert [m.id for m in client.models.list().data] == ['fake']
  assert httpx.get(fake_server.url + '/health').status_code == 200
  assert httpx.get(fake_server.url + '/version').json() == {
      'version': importlib.metadata.version('meshlm')}
  full = client.completions.create(model='fake', prompt='abc', max_tokens=7)
  assert full.choices[0].text == 'abcabca'
  assert full.choices[0].finish_reason == 'length'
  assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (3, 7)
  chunks = list(client.completions.create(model='fake', prompt='abc', max_tokens=7,
                                          stream=True,
                                          stream_options={'include_usage': True}))
  assert ''.join(c.choices[0].text for c in chunks if c.choices) == 'abcabca'
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == 'length'
  assert all(c.usage is None for c in chunks[:-1])
  # vLLM's continuous_usage_stats: every chunk counts the tokens so far.
  chunks = list(client.chat.completions.create(
      model='fake', messages=[{'role': 'user', 'content': 'abc'}], max_tokens=5, stream=True,
      stream_options={'include_usage': True, 'continuous_usage_stats': True}))
  seen = [c.usage.completion_tokens for c in chunks]
  assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 5 and len(set(seen)) == 6
  assert {c.usage.prompt_tokens for c in chunks} == {len('user: abc\nassistant: ')}
  # Per choice, as vLLM counts (n=2); continuous_usage_stats alone turns usage on.
  chunks = list(client.completions.create(
      model='fake', prompt='ab', max_tokens=3, n=2, stream=True,
      stream_options={'continuous_usage_stats': True}))
  per_choice = {}
  for c in chunks[:-1]:
    per_choice.setdefault(c.choices[0].index, []).append(c.usage.completion_tokens)
    assert c.usage.prompt_tokens == 2
  assert per_choice == {0: [1, 2, 3], 1: [1, 2, 3]}
  assert chunks[-1].usage.completion_tokens == 6
  for options, needle in (({'include_usages': True}, 'include_usages'),
                          ({'include_usage': 'false'}, 'true or false')):
    resp = httpx.post(fake_server.url + '/v1/completions', json={
        'prompt': 'a', 'stream': True, 'stream_options': options})
    assert resp.status_code == 400 and needle in resp.json()['error']['message']
  assert fake.held == 0


def test_several_prompts_and_token_ids(fake_server):
  client = _client(fake_server)
  out = client.completions.create(model='fake', prompt=['ab', 'xyz'], max_tokens=4)
  assert sorted((c.index, c.text) for c in out.choices) == [(0, 'abab'), (1, 'xyzx')]
  out = client.completions.create(model='fake', prompt=[[104, 105]], max_tokens=3)
  assert out.choices[0].text == 'hih'
  pieces = {0: '', 1: ''}
  for chunk in client.completions.create(model='fake', prompt=['ab', 'xyz'], max_tokens=4,
                                         stream=True):
    for c in chunk.choices:
      pieces[c.index] += c.text
  assert pieces == {0: 'abab', 1: 'xyzx'}


def test_n_choices_per_prompt_with_seeds_and_usage(fake_server, fake):
  """n=3 over two prompts: six choices, prompt i's at indices 3i..3i+2, seeds s, s+1, s+2
  for each prompt; usage counts each prompt once and every choice's tokens."""
  client = _client(fake_server)
  out = client.completions.create(model='fake', prompt=['ab', 'xyz'], max_tokens=4, n=3,
                                  seed=5)
  assert sorted((c.index, c.text) for c in out.choices) == (
      [(i, 'abab') for i in range(3)] + [(i, 'xyzx') for i in range(3, 6)])
  assert fake.seeds == [5, 6, 7, 5, 6, 7]
  assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2 + 3, 6 * 4)
  chat = client.chat.completions.create(model='fake', messages=[{'role': 'user',
                                        'content': 'hi'}], max_tokens=3, n=2)
  assert [c.index for c in chat.choices] == [0, 1] and fake.seeds[-2:] == [None, None]
  assert len({c.message.content for c in chat.choices}) == 1 and chat.usage.completion_tokens == 6
  roles, pieces = {}, {0: '', 1: ''}
  for chunk in client.chat.completions.create(
      model='fake', messages=[{'role': 'user', 'content': 'hi'}], max_tokens=3, n=2,
      stream=True, stream_options={'include_usage': True}):
    for c in chunk.choices:
      roles[c.index] = roles.get(c.index) or c.delta.role
      pieces[c.index] += c.delta.content or ''
    if chunk.usage:
      usage = chunk.usage
  assert roles == {0: 'assistant', 1: 'assistant'}
  assert pieces == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}
  assert usage.prompt_tokens == chat.usage.prompt_tokens and usage.completion_tokens == 6
  assert fake.held == 0


def test_a_prompts_n_choices_score_it_once_unless_streamed(fake_server, fake):
  """prompt_logprobs (or echo's logprobs) with n=3: only the first choice asks the engine
  for the prompt's logprobs, streamed echo too (the others wait for its scores)."""
  httpx.post(fake_server.url + '/v1/completions', json={
      'prompt': ['ab', 'cd'], 'max_tokens': 1, 'n': 3, 'prompt_logprobs': 1}).raise_for_status()
  assert [p.prompt_logprobs for p in fake.params] == [1, None, None] * 2
  httpx.post(fake_server.url + '/v1/chat/completions', json={
      'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 1, 'n': 2,
      'prompt_logprobs': 0}).raise_for_status()
  assert [p.prompt_logprobs for p in fake.params[-2:]] == [0, None]
  list(_client(fake_server).completions.create(model='fake', prompt='ab', max_tokens=1, n=2,
                                               echo=True, logprobs=1, stream=True))
  assert [p.prompt_logprobs for p in fake.params[-2:]] == [1, None]
  # The others end before the first starts: each echo still carries the first's scores.
  fake.first_last = True
  per = {}
  for chunk in _client(fake_server).completions.create(
      model='fake', prompt='abcd', max_tokens=2, n=3, echo=True, logprobs=0, stream=True):
    for c in chunk.choices:
      per.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
  assert per == {i: [None, -0.01, -0.02, -0.03, -0.5, -0.5] for i in range(3)}, per
  assert [p.prompt_logprobs for p in fake.params[-3:]] == [0, None, None]
  resp = httpx.post(fake_server.url + '/v1/chat/completions', json={
      'messages': [{'role': 'user', 'content': 'hi'}], 'stream': True, 'prompt_logprobs': 0})
  assert resp.status_code == 400 and resp.json()['error']['param'] == 'prompt_logprobs'


def test_truncate_prompt_tokens_keeps_the_prompts_end(fake_server, fake):
  """vLLM's truncate_prompt_tokens: the engine gets the last k tokens, usage counts them,
  echo repeats them; the batch CLI's helper does the same; bad values are a 400."""
  client = _client(fake_server)
  out = client.completions.create(model='fake', prompt='abcdefgh', max_tokens=2, echo=True,
                                  extra_body={'truncate_prompt_tokens': 3})
  assert fake.prompts[-1] == list(b'fgh') and out.usage.prompt_tokens == 3
  assert out.choices[0].text == 'fgh' + 'fg'
  client.completions.create(model='fake', prompt='abc', max_tokens=1,
                            extra_body={'truncate_prompt_tokens': 10})
  assert fake.prompts[-1] == list(b'abc')
  client.chat.completions.create(model='fake', messages=[{'role': 'user', 'content': 'hi'}],
                                 max_tokens=1, extra_body={'truncate_prompt_tokens': 4})
  assert fake.prompts[-1] == list(b'nt: ')   # "...assistant: "
  assert openai_sampling.truncate_prompt([1, 2, 3], {'truncate_prompt_tokens': -1}, 2) == [2, 3]
  # Truncated before the context check: a prompt longer than the context (64) runs.
  client.completions.create(model='fake', prompt='x' * 100 + 'end', max_tokens=1,
                            extra_body={'truncate_prompt_tokens': 3})
  assert fake.prompts[-1] == list(b'end')
  for bad in (0, -2, '3', True, 65):
    resp = httpx.post(fake_server.url + '/v1/completions',
                      json={'prompt': 'ab', 'truncate_prompt_tokens': bad})
    assert resp.status_code == 400, bad
    assert resp.json()['error']['param'] == 'truncate_prompt_tokens'


def test_n_choices_wait_together_in_the_queue_or_not_at_all(fake):
  """n requests of one call are admitted together: a queue that cannot take them all
  takes none (429); more than the queue ever holds is a 400."""
  small = FakeEngine(max_waiting=4)
  server = ServerThread(create_app(small, FakeServed()))
  try:
    small.paused = True
    waiting = [small.add_request([97], sp_lib.SamplingParams(max_tokens=2), f'w{i}')
               for i in range(2)]
    with pytest.raises(openai.RateLimitError):   # 2 + 3 > 4: the third is refused
      _client(server).completions.create(model='fake', prompt='ab', max_tokens=2, n=3)
    assert small.held == 2 and len(small.aborted) == 2
    small.paused = False
    assert [len(s.result().token_ids) for s in waiting] == [2, 2]
    assert len(_client(server).completions.create(model='fake', prompt='ab', max_tokens=2,
                                                   n=4).choices) == 4
    with pytest.raises(openai.BadRequestError, match='more than the server ever queues'):
      _client(server).completions.create(model='fake', prompt=['ab', 'cd'], max_tokens=2,
                                         n=3)   # 6 > 4: no retry would help
  finally:
    server.stop()
    small.shutdown()


def test_completion_logprobs_shape(fake_server):
  out = _client(fake_server).completions.create(model='fake', prompt='ab', max_tokens=3,
                                                logprobs=2)
  lp = out.choices[0].logprobs
  assert lp.tokens == ['a', 'b', 'a'] and lp.token_logprobs == [-0.5] * 3
  assert lp.text_offset == [0, 1, 2] and lp.top_logprobs[0] == {'a': -0.5}


BAD_INPUTS = [
    ('/v1/completions', b'{"prompt": "hi", ', 'JSON', None),
    ('/v1/completions', b'[1, 2]', 'JSON object', None),
    ('/v1/completions', {'max_tokens': 4}, 'prompt', 'prompt'),
    ('/v1/completions', {'prompt': 5}, 'prompt', 'prompt'),
    ('/v1/completions', {'prompt': 'hi', 'stream': 'yes'}, 'stream', 'stream'),
    ('/v1/completions', {'prompt': 'hi', 'model': 'gpt-9'}, 'gpt-9', 'model'),
    ('/v1/completions', {'prompt': ''}, 'empty', 'prompt'),
    ('/v1/completions', {'prompt': []}, 'empty', 'prompt'),
    ('/v1/completions', {'prompt': [1, 300]}, 'vocabulary', 'prompt'),
    ('/v1/completions', {'prompt': [[1], [-1]]}, 'vocabulary', 'prompt'),
    ('/v1/completions', {'prompt': 'x' * 64}, 'context', 'prompt'),
    ('/v1/completions', {'prompt': 'x' * 40, 'max_tokens': 30}, 'max_tokens', 'max_tokens'),
    ('/v1/completions', {'prompt': 'hi', 'max_tokens': 0}, 'max_tokens', 'max_tokens'),
    ('/v1/completions', {'prompt': 'hi', 'max_tokens': 'many'}, 'max_tokens', 'max_tokens'),
    ('/v1/completions', {'prompt': 'hi', 'temperature': -1}, 'temperature', 'temperature'),
    ('/v1/completions', {'prompt': 'hi', 'top_p': 0}, 'top_p', 'top_p'),
    ('/v1/completions', {'prompt': 'hi', 'logprobs': 99}, 'logprobs', 'logprobs'),
    ('/v1/completions', {'prompt': 'hi', 'stop': [3]}, 'stop', 'stop'),
    ('/v1/completions', {'prompt': 'hi', 'n': 0}, 'n', 'n'),
    ('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'hi'}], 'n': 129},
     'n', 'n'),
    ('/v1/completions', {'prompt': 'hi', 'n': '2'}, 'n', 'n'),
    ('/v1/completions', {'prompt': 'hi', 'best_of': 3}, 'best_of', 'best_of'),
    ('/v1/completions', {'prompt': 'hi', 'max_tokens': 0, 'echo': False}, 'max_tokens',
     'max_tokens'),
    ('/v1/completions', {'prompt': 'hi', 'prompt_logprobs': 1, 'stream': True},
     'not available with "stream": true', 'prompt_logprobs'),
    ('/v1/completions', {'prompt': 'hi', 'prompt_logprobs': 1, 'echo': True, 'logprobs': 1},
     'not both', 'prompt_logprobs'),
    ('/v1/completions', {'prompt': 'hi', 'prompt_logprobs': 21}, 'prompt_logprobs',
     'prompt_logprobs'),
    ('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'hi'}],
                              'response_format': {'type': 'xml'}},
     'json_schema', 'response_format'),
    ('/v1/completions', {'prompt': 'hi', 'echo': True, 'max_tokens': 0, 'min_tokens': 2},
     'generates nothing', 'min_tokens'),
    ('/v1/chat/completions', {'messages': 'hi'}, 'messages', 'messages'),
    ('/v1/chat/completions', {'messages': [{'content': 'hi'}]}, 'role', 'messages.0.role'),
    ('/v1/chat/completions', {'messages': []}, 'empty', 'messages'),
]


@pytest.mark.parametrize('path,body,needle,param', BAD_INPUTS)
def test_bad_input_is_a_400_naming_the_field(fake_server, fake, path, body, needle, param):
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  resp = httpx.post(fake_server.url + path, content=content,
                    headers={'Content-Type': 'application/json'})
  # A model not served is vLLM's 404 model_not_found; every other bad field is a 400.
  assert resp.status_code == (404 if param == 'model' else 400), resp.text
  error = resp.json()['error']
  assert set(error) == {'message', 'type', 'param', 'code'}
  assert needle.lower() in error['message'].lower() and error['param'] == param
  assert fake.held == 0
  # The server still answers.
  ok = _client(fake_server).completions.create(model='fake', prompt='ok', max_tokens=2)
  assert ok.choices[0].text == 'ok'


def test_unknown_route_is_an_openai_error(fake_server):
  resp = httpx.get(fake_server.url + '/v1/nothing')
  assert resp.status_code == 404 and 'message' in resp.json()['error']


def test_api_key(fake):
  server = ServerThread(create_app(fake, FakeServed(), api_key='sesame'))
  try:
    with pytest.raises(openai.AuthenticationError):
      _client(server, api_key='wrong').models.list()
    assert httpx.get(server.url + '/v1/models').status_code == 401
    assert _client(server, api_key='sesame').models.list().data[0].id == 'fake'
    assert httpx.get(server.url + '/health').status_code == 200
    assert httpx.get(server.url + '/metrics').status_code == 200
    assert httpx.post(server.url + '/tokenize', json={'prompt': 'a'}).status_code == 401
    assert httpx.post(server.url + '/tokenize', json={'prompt': 'a'},
                      headers={'Authorization': 'Bearer sesame'}).json()['tokens'] == [97]
  finally:
    server.stop()


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(fake):
  """generation_config.json's sampling fields (ServedModel.sampling_defaults) stand in
  for OpenAI's defaults; a request's own value, null aside, wins."""
  served = FakeServed(sampling_defaults={'temperature': 0.6, 'top_p': 0.9, 'top_k': 20})
  server = ServerThread(create_app(fake, served))
  try:
    client = _client(server)
    client.completions.create(model='fake', prompt='ab', max_tokens=2)
    client.chat.completions.create(model='fake', messages=[{'role': 'user', 'content': 'x'}],
                                   max_tokens=2, temperature=0.0, top_p=None)
    client.completions.create(model='fake', prompt='ab', max_tokens=2, top_p=1.0,
                              extra_body={'top_k': -1})
  finally:
    server.stop()
  got = [(p.temperature, p.top_p, p.top_k) for p in fake.params]
  assert got == [(0.6, 0.9, 20), (0.0, 0.9, 20), (0.6, 1.0, 0)]


def test_chat_without_the_generation_prompt(fake_server, fake):
  """add_generation_prompt false (vLLM's): the template renders no assistant opening."""
  messages = [{'role': 'user', 'content': 'hi'}]
  client = _client(fake_server)
  for add in (True, False, None):
    want = render_chat(FakeServed(), messages, add is not False)
    out = client.chat.completions.create(model='fake', messages=messages,
                                         max_tokens=len(want),
                                         extra_body={'add_generation_prompt': add})
    assert out.choices[0].message.content == want   # the fake engine echoes its prompt
  assert render_chat(FakeServed(), messages, True) != render_chat(FakeServed(), messages,
                                                                   False)


def test_text_prompts_get_the_tokenizers_special_tokens_chat_prompts_do_not(fake, tmp_path):
  """As vLLM: a completion's text prompt is encoded with the tokenizer.json's special
  tokens (a Llama's BOS), chat's rendered template without (it writes them itself); each
  endpoint's add_special_tokens overrides, and /tokenize follows the same rules."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import models, pre_tokenizers, processors  # pylint: disable=import-outside-toplevel
  vocab = {t: i for i, t in enumerate(['<unk>', '<s>', '</s>', 'w1', 'w2', ':', 'user'])}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(['<unk>', '<s>', '</s>'])
  bos = vocab['<s>']
  tok.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[
      ('<s>', bos)])
  tok.save(str(tmp_path / 'tokenizer.json'))
  hf = HFTokenizer(str(tmp_path / 'tokenizer.json'))
  words = hf.encode('w1 w2').tolist()
  assert len(words) == 2 and bos not in words
  served = FakeServed(tokenizer=hf)
  server = ServerThread(create_app(fake, served))
  try:
    client, url = _client(server), server.url
    messages = [{'role': 'user', 'content': 'w1 w2'}]
    rendered = hf.encode(render_chat(served, messages)).tolist()
    client.completions.create(model='fake', prompt='w1 w2', max_tokens=1)
    client.completions.create(model='fake', prompt='w1 w2', max_tokens=1,
                              extra_body={'add_special_tokens': False})
    client.completions.create(model='fake', prompt=words, max_tokens=1)   # ids: as given
    client.chat.completions.create(model='fake', messages=messages, max_tokens=1)
    client.chat.completions.create(model='fake', messages=messages, max_tokens=1,
                                   extra_body={'add_special_tokens': True})
    assert fake.prompts == [[bos] + words, words, words, rendered, [bos] + rendered]
    # truncate_prompt_tokens keeps the BOS and cuts the text's tokens, as vLLM does.
    assert hf.special_tokens_around('w1 w2') == (1, 0)
    client.completions.create(model='fake', prompt='w1 w2 w1', max_tokens=1,
                              extra_body={'truncate_prompt_tokens': 2})
    client.completions.create(model='fake', prompt=[bos] + words, max_tokens=1,
                              extra_body={'truncate_prompt_tokens': 2})   # ids: the last 2
    assert fake.prompts[-2:] == [[bos, words[0]], words]
    tokenize = lambda **body: httpx.post(url + '/tokenize', json=body).json()['tokens']  # noqa
    assert tokenize(prompt='w1 w2') == [bos] + words
    assert tokenize(prompt='w1 w2', add_special_tokens=False) == words
    assert tokenize(messages=messages) == rendered
  finally:
    server.stop()


def test_tokenize_and_detokenize_as_the_endpoints_see_prompts(fake_server):
  """vLLM's /tokenize: a prompt's ids as completions runs them, messages' as chat renders
  them (with or without the generation prompt); /detokenize inverts it."""
  tok, url = ByteTokenizer(), fake_server.url
  got = httpx.post(url + '/tokenize', json={'model': 'fake', 'prompt': 'héllo',
                                            'return_token_strs': True}).json()
  assert got['tokens'] == tok.encode('héllo').tolist() and got['count'] == 6
  assert got['max_model_len'] == 64 and len(got['token_strs']) == 6
  messages = [{'role': 'user', 'content': 'hi'}]
  for add in (True, False):
    got = httpx.post(url + '/tokenize', json={'messages': messages,
                                              'add_generation_prompt': add}).json()
    assert got['tokens'] == tok.encode(render_chat(FakeServed(), messages, add)).tolist()
    assert 'token_strs' not in got
  assert httpx.post(url + '/tokenize', json={'prompt': ''}).json()['tokens'] == []
  assert httpx.post(url + '/detokenize', json={'tokens': got['tokens']}).json() == {
      'prompt': render_chat(FakeServed(), messages, False)}
  for path, body, param in [('/tokenize', {}, 'prompt'),
                            ('/tokenize', {'prompt': 'a', 'messages': messages}, 'prompt'),
                            ('/tokenize', {'prompt': 'a', 'model': 'other'}, 'model'),
                            ('/tokenize', {'prompt': 'a', 'add_special': 1}, 'add_special'),
                            ('/detokenize', {'tokens': [1, 999]}, 'tokens'),
                            ('/detokenize', {'tokens': 'ab'}, 'tokens')]:
    resp = httpx.post(url + path, json=body)
    status = 404 if param == 'model' else 400   # a model not served: vLLM's 404
    assert resp.status_code == status and resp.json()['error']['param'] == param, (body, resp.text)


def test_queue_full_is_a_429(fake):
  fake.max_waiting, fake.paused = 2, True
  server = ServerThread(create_app(fake, FakeServed()))
  try:
    for i in range(2):
      fake.add_request([1, 2], sp_lib.SamplingParams(), request_id=f'filler-{i}')
    with pytest.raises(openai.RateLimitError, match='queue is full'):
      _client(server).completions.create(model='fake', prompt='hi', max_tokens=2)
    # A list of prompts is admitted whole or not at all.
    fake.abort('filler-0')
    resp = httpx.post(server.url + '/v1/completions',
                      json={'prompt': ['a', 'b'], 'max_tokens': 2})
    assert resp.status_code == 429 and fake.held == 1
    fake.abort('filler-1')
    fake.paused = False
    assert _client(server).completions.create(prompt='hi', model='fake',
                                              max_tokens=2).choices[0].text == 'hi'
  finally:
    server.stop()


def test_disconnect_aborts_streaming_and_plain_requests(fake_server, fake):
  fake.step_s = 0.02
  with httpx.stream('POST', fake_server.url + '/v1/completions',
                    json={'prompt': 'abc', 'max_tokens': 50, 'stream': True}) as resp:
    first = next(resp.iter_lines())
    assert first.startswith('data: ')
  _wait_for(lambda: fake.held == 0)
  assert len(fake.aborted) == 1
  # Non-streaming: the client gives up before the answer.
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(fake_server.url + '/v1/completions',
               json={'prompt': 'abc', 'max_tokens': 50}, timeout=0.3)
  _wait_for(lambda: fake.held == 0)
  assert len(fake.aborted) == 2


class _BrokenStream:
  """An engine stream that raises after its first output (a pump that dies)."""

  def __init__(self, stream):
    self.stream, self.request_id = stream, stream.request_id

  async def __aiter__(self):
    async for out in self.stream:
      yield out
      raise RuntimeError('the stream broke')


class _BrokenEngine(FakeEngine):
  """`mode` 'stream': each stream dies after one output; 'output': its second output is
  not a RequestOutput, so reading it fails in the server itself."""

  def __init__(self, mode):
    super().__init__()
    self.mode = mode

  def add_request(self, prompt_ids, params, request_id=None):
    stream = super().add_request(prompt_ids, params, request_id)
    if self.mode == 'stream':
      return _BrokenStream(stream)
    stream.put(outputs.RequestOutput(request_id, [], '', None, False, None,
                                        len(prompt_ids), 0))
    stream.put(object())
    return stream


@pytest.fixture
def broken_server(request):
  engine = _BrokenEngine(request.param)
  server = ServerThread(create_app(engine, FakeServed()))
  yield server, engine
  server.stop()
  engine.shutdown()


@pytest.mark.parametrize('broken_server', ['stream'], indirect=True)
def test_a_stream_that_dies_ends_with_an_error_chunk(broken_server):
  server, engine = broken_server
  with httpx.stream('POST', server.url + '/v1/completions', timeout=30,
                    json={'model': 'fake', 'prompt': 'abcdef', 'max_tokens': 50,
                          'stream': True}) as resp:
    events = [l[len('data: '):] for l in resp.iter_lines() if l.startswith('data: ')]
  assert events[-1] == '[DONE]', events
  last = json.loads(events[-2])
  assert last['error']['code'] == 'engine_error' and last['status_code'] == 500, events
  with pytest.raises(openai.APIError):   # the client sees the failure, not a clean end
    for _ in _client(server).completions.create(model='fake', prompt='abc', max_tokens=50,
                                                 stream=True):
      pass
  _wait_for(lambda: engine.held == 0)


@pytest.mark.parametrize('broken_server', ['output'], indirect=True)
def test_a_server_failure_on_a_plain_request_is_a_500(broken_server):
  server, engine = broken_server
  resp = httpx.post(server.url + '/v1/completions', timeout=30,
                    json={'model': 'fake', 'prompt': 'abc', 'max_tokens': 50})
  assert resp.status_code == 500, resp.text
  assert resp.json()['error']['type'] == 'server_error', resp.text
  _wait_for(lambda: engine.held == 0)


def test_disconnect_before_the_first_token(fake_server, fake):
  fake.paused = True
  with pytest.raises(httpx.ReadTimeout):
    with httpx.stream('POST', fake_server.url + '/v1/completions',
                      json={'prompt': 'abc', 'max_tokens': 5, 'stream': True},
                      timeout=0.3) as resp:
      list(resp.iter_lines())
  _wait_for(lambda: fake.held == 0)
  assert len(fake.aborted) == 1


# ------------------------------------------------------------------ the real engine

@pytest.fixture(scope='module')
def real_engine(tiny_served):
  from serve.config import ServeConfig  # pylint: disable=import-outside-toplevel
  engine = engine_lib.Engine(tiny_served, ServeConfig(
      num_blocks=48, max_num_seqs=8, max_num_batched_tokens=64, max_waiting_requests=64))
  yield engine
  engine.shutdown()


@pytest.fixture(scope='module')
def real_server(real_engine, tiny_served):
  server = ServerThread(create_app(real_engine, tiny_served, model_name='tiny'))
  yield server
  server.stop()


def _assert_at_rest(engine):
  """No request left anywhere and every KV block back in the pool."""
  _wait_for(lambda: engine.num_unfinished == 0)
  stats = engine.stats()
  assert (stats.num_running, stats.num_waiting) == (0, 0)
  kv = engine.scheduler.kv
  assert kv.num_free_blocks == kv.num_usable_blocks


# Non-ASCII on purpose: the byte tokenizer splits each of these characters over tokens.
PROMPT = 'Grüße aus Köln — ça va? 東京 '


def _streamed_texts(client, n, **kw) -> tuple[list[str], list[str]]:
  texts, reasons = [''] * n, [None] * n
  for chunk in client.completions.create(stream=True, **kw):
    for c in chunk.choices:
      texts[c.index] += c.text
      reasons[c.index] = c.finish_reason or reasons[c.index]
  return texts, reasons


def _first_wide_char(text: str) -> str | None:
  return next((ch for ch in text if ord(ch) > 127 and ch != '\ufffd'), None)


@pytest.mark.parametrize('sampling', [{'temperature': 0.0}, {'temperature': 2.0, 'seed': 7}])
def test_stream_concatenates_to_the_plain_text(real_server, real_engine, tiny_served,
                                               sampling):
  client = _client(real_server)
  prompts = [f'{i} {PROMPT}' for i in range(8)]
  kw = dict(model='tiny', prompt=prompts, max_tokens=20, **sampling)
  plain = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
  texts = [c.text for c in plain]
  assert _streamed_texts(client, len(prompts), **kw) == (
      texts, [c.finish_reason for c in plain])
  # The server is a faithful transport: the engine alone gives the same texts.
  ids = [tiny_served.tokenizer.encode(p).tolist() for p in prompts]
  direct = real_engine.generate(ids, sp_lib.SamplingParams(max_tokens=20, **sampling))
  assert [d.text for d in direct] == texts
  _assert_at_rest(real_engine)


def test_multibyte_output_and_stop_string_split_over_tokens(real_server, real_engine,
                                                            tiny_served):
  # Hot sampling from the barely trained byte model sometimes emits a valid multi-byte
  # character, split over several tokens: find a seed that does, with the engine alone.
  prompt = 'Köln '
  ids = tiny_served.tokenizer.encode(prompt).tolist()
  hot = dict(max_tokens=40, temperature=2.0)
  direct = real_engine.generate([ids] * 16, [sp_lib.SamplingParams(seed=s, **hot)
                                             for s in range(16)])
  seed, text = next((s, d.text) for s, d in enumerate(direct) if _first_wide_char(d.text))
  client = _client(real_server)
  kw = dict(model='tiny', prompt=prompt, seed=seed, **hot)
  assert client.completions.create(**kw).choices[0].text == text
  assert _streamed_texts(client, 1, **kw)[0] == [text]
  stop = _first_wide_char(text)
  expected = ([text[:text.index(stop)]], ['stop'])
  stopped = client.completions.create(stop=[stop], **kw).choices[0]
  assert ([stopped.text], [stopped.finish_reason]) == expected
  assert _streamed_texts(client, 1, stop=[stop], **kw) == expected
  _assert_at_rest(real_engine)


def test_chat_stream_and_plain_agree(real_server, real_engine):
  client = _client(real_server)
  kw = dict(model='tiny', messages=[{'role': 'user', 'content': 'Wie geht\'s? ✓'}],
            max_tokens=20, temperature=0.0)
  plain = client.chat.completions.create(**kw)
  chunks = list(client.chat.completions.create(stream=True,
                                               stream_options={'include_usage': True}, **kw))
  assert chunks[0].choices[0].delta.role == 'assistant'
  text = ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)
  assert text == plain.choices[0].message.content
  assert chunks[-1].usage.model_dump() == plain.usage.model_dump()
  assert plain.usage.completion_tokens <= 20 and plain.usage.prompt_tokens > 0
  _assert_at_rest(real_engine)


def test_logprobs_agree_with_greedy_choice(real_server):
  client = _client(real_server)
  out = client.chat.completions.create(
      model='tiny', messages=[{'role': 'user', 'content': 'hello'}], max_tokens=5,
      temperature=0.0, logprobs=True, top_logprobs=3)
  for item in out.choices[0].logprobs.content:
    tops = [t.logprob for t in item.top_logprobs]
    # Greedy: the chosen token is the most likely one, and the list is sorted.
    assert len(tops) == 3 and tops == sorted(tops, reverse=True)
    assert item.logprob == pytest.approx(tops[0], abs=1e-5) and item.logprob <= 0
  plain = client.completions.create(model='tiny', prompt='hello', max_tokens=5,
                                    temperature=0.0, logprobs=0)
  assert len(plain.choices[0].logprobs.token_logprobs) == plain.usage.completion_tokens


def test_logit_bias_and_penalties_reach_the_sampler(real_server):
  """OpenAI's logit_bias (token ids as string keys) and the penalties, end to end: +100 on
  the byte 'Q' makes greedy output all Qs, as long as repeating it is not penalised away."""
  client = _client(real_server)
  q = {str(ord('Q')): 100}
  out = client.completions.create(model='tiny', prompt='hello', max_tokens=5, temperature=0.0,
                                  logit_bias=q, presence_penalty=2.0, frequency_penalty=2.0)
  assert out.choices[0].text == 'QQQQQ'
  chat = client.chat.completions.create(
      model='tiny', messages=[{'role': 'user', 'content': 'hello'}], max_tokens=5,
      temperature=0.0, logit_bias={str(ord('Q')): -100, str(ord('Z')): 100},
      extra_body={'repetition_penalty': 1.5})
  assert chat.choices[0].message.content == 'ZZZZZ'


def test_n_seeded_choices_are_the_requests_with_seeds_s_to_s_plus_n(real_server):
  client = _client(real_server)
  ask = dict(model='tiny', prompt='def ', max_tokens=8, temperature=1.0)
  out = client.completions.create(n=3, seed=11, **ask)
  texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
  alone = [client.completions.create(seed=11 + j, **ask).choices[0].text for j in range(3)]
  assert texts == alone and len(set(texts)) == 3


def test_echo_scores_the_prompt_as_the_training_forward_does(real_server, real_engine,
                                                             tiny_served):
  """echo with max_tokens 0 and logprobs (how lm-evaluation-harness asks for a
  log-likelihood): the prompt back as the text, each token's log p under the training
  forward (the first None), no completion tokens; streamed, the same."""
  import jax  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  cfg, prompt = tiny_served.model_cfg, list(b'def main(args):\n  return')
  full = np.asarray(jax.nn.log_softmax(model.logits(
      tiny_served.params, model.forward(tiny_served.params, np.asarray([prompt]), cfg),
      cfg)[0, :, :257], axis=-1))
  want = full[np.arange(len(prompt) - 1), prompt[1:]]
  client = _client(real_server)
  out = client.completions.create(model='tiny', prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=2)
  choice = out.choices[0]
  assert choice.text == bytes(prompt).decode() and choice.finish_reason == 'length'
  lp = choice.logprobs
  assert lp.tokens == [chr(t) for t in prompt] and lp.token_logprobs[0] is None
  np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=2e-4)
  assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
  assert lp.text_offset == list(range(len(prompt)))
  assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 0)
  chunks = list(client.completions.create(model='tiny', prompt=prompt, max_tokens=0,
                                          echo=True, logprobs=2, stream=True))
  assert ''.join(c.choices[0].text for c in chunks) == choice.text
  streamed = [x for c in chunks if c.choices[0].logprobs
              for x in c.choices[0].logprobs.token_logprobs]
  assert streamed == lp.token_logprobs
  # n=3 streamed: one choice scores the prompt; the others' echo waits for it and is equal
  per = {}
  for c in client.completions.create(model='tiny', prompt=prompt, max_tokens=2, echo=True,
                                     logprobs=2, stream=True, n=3, temperature=1.0):
    for ch in c.choices:
      if ch.logprobs:
        per.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
  assert sorted(per) == [0, 1, 2]
  for index, values in per.items():
    assert values[0] is None and len(values) == len(prompt) + 2, index
    np.testing.assert_allclose(values[1:len(prompt)], want, atol=2e-4)
  # several prompts x n: choice i echoes prompt i // n
  many = client.completions.create(model='tiny', prompt=[prompt, prompt[:5]], max_tokens=0,
                                   echo=True, logprobs=0, n=2)
  assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == (
      [choice.text] * 2 + [bytes(prompt[:5]).decode()] * 2)
  np.testing.assert_allclose(many.choices[3].logprobs.token_logprobs[1:], want[:4], atol=2e-4)
  assert all(c.finish_reason == 'length' for c in many.choices)
  # vLLM's prompt_logprobs (n=2: one choice scores the prompt, both carry it), and chat's
  # at the top level
  rows = full[np.arange(len(prompt) - 1)]   # rank: the tokens at least as likely (float error)
  above = (rows >= want[:, None] + 1e-4).sum(1) + 1
  within = (rows >= want[:, None] - 1e-4).sum(1)
  scored = httpx.post(real_server.url + '/v1/completions', json={
      'prompt': prompt, 'max_tokens': 1, 'prompt_logprobs': 2, 'n': 2}).json()
  for c in scored['choices']:
    entries = c['prompt_logprobs']
    assert entries[0] is None and len(entries) == len(prompt)
    for q, (token, item) in enumerate(zip(prompt[1:], entries[1:])):
      own = item[str(token)]
      assert own['decoded_token'] == chr(token) and above[q] <= own['rank'] <= within[q]
      np.testing.assert_allclose(own['logprob'], want[q], atol=2e-4)
      top = np.argsort(-full[q])[:2]
      assert all(item[str(t)]['rank'] == r for r, t in enumerate(top, 1))
      assert set(item) == {str(token), *map(str, top)}
  chat = httpx.post(real_server.url + '/v1/chat/completions', json={
      'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 1,
      'prompt_logprobs': 0}).json()
  assert chat['prompt_logprobs'][0] is None
  assert len(chat['prompt_logprobs']) == chat['usage']['prompt_tokens']
  assert all(len(item) == 1 for item in chat['prompt_logprobs'][1:])
  # echo with a completion: the prompt text, then what the same request without it gives
  plain = client.completions.create(model='tiny', prompt='def ', max_tokens=4, temperature=0)
  echoed = client.completions.create(model='tiny', prompt='def ', max_tokens=4,
                                     temperature=0, echo=True)
  assert echoed.choices[0].text == 'def ' + plain.choices[0].text
  _assert_at_rest(real_engine)


def test_concurrent_streams_with_disconnects_free_everything(real_server, real_engine):
  rng = np.random.default_rng(0)
  plans = [(int(rng.integers(4, 16)), int(rng.integers(0, 6)) if rng.random() < 0.5 else None)
           for _ in range(24)]
  results = [None] * len(plans)

  def run(i, max_tokens, leave_after):
    body = {'prompt': f'{i} ' + PROMPT, 'max_tokens': max_tokens, 'stream': True,
            'temperature': 1.0, 'seed': i, 'ignore_eos': True}
    with httpx.stream('POST', real_server.url + '/v1/completions', json=body,
                      timeout=60) as resp:
      assert resp.status_code == 200, resp.read()
      for n, line in enumerate(resp.iter_lines()):
        if leave_after is not None and n >= leave_after:
          results[i] = 'left'
          return   # closes the connection mid-stream
        if line == 'data: [DONE]':
          results[i] = 'done'

  threads = [threading.Thread(target=run, args=(i, *plan)) for i, plan in enumerate(plans)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert results.count('done') == sum(p[1] is None for p in plans)
  _assert_at_rest(real_engine)
  assert _client(real_server).completions.create(model='tiny', prompt='ok',
                                                 max_tokens=2).usage.completion_tokens == 2


def test_disconnect_aborts_the_engine_request_early(real_server, real_engine):
  before = real_engine.stats()
  body = {'prompt': 'ab', 'max_tokens': 60, 'ignore_eos': True, 'stream': True}
  with httpx.stream('POST', real_server.url + '/v1/completions', json=body) as resp:
    assert next(resp.iter_lines()).startswith('data: ')
  _assert_at_rest(real_engine)
  after = real_engine.stats()
  assert after.finished['abort'] - before.finished['abort'] == 1
  assert after.generation_tokens - before.generation_tokens < 60


def test_structured_output_through_the_openai_client(real_server, real_engine):
  """response_format json_schema (chat, streamed and not, n=2) and vLLM's guided_choice:
  every choice parses and fits; an expression the vocabulary cannot spell is a 400."""
  client = _client(real_server)
  schema = {'type': 'object', 'properties': {'ok': {'type': 'boolean'}}, 'required': ['ok']}
  fmt = {'type': 'json_schema', 'json_schema': {'name': 'flag', 'schema': schema}}
  kw = dict(model='tiny', messages=[{'role': 'user', 'content': 'hi'}], max_tokens=30,
            response_format=fmt, n=2, seed=3)
  whole = client.chat.completions.create(**kw)
  texts = [c.message.content for c in whole.choices]
  assert all(isinstance(json.loads(t)['ok'], bool) for t in texts), texts
  assert {c.finish_reason for c in whole.choices} == {'stop'}
  pieces = ['', '']
  for chunk in client.chat.completions.create(stream=True, **kw):
    for c in chunk.choices:
      pieces[c.index] += c.delta.content or ''
  assert pieces == texts   # seeded: the same choices streamed
  out = client.completions.create(model='tiny', prompt='pick: ', max_tokens=10,
                                  extra_body={'guided_choice': ['red', 'green', 'blue']})
  assert out.choices[0].text in ('red', 'green', 'blue')
  resp = httpx.post(real_server.url + '/v1/completions',
                    json={'prompt': 'x', 'guided_regex': '(unclosed'})
  assert resp.status_code == 400 and 'cannot be compiled' in resp.json()['error']['message']
  assert resp.json()['error']['param'] == 'guided_regex'
  # Scoring a prompt (echo, max_tokens 0) generates nothing to guide: the field is moot.
  scored = client.completions.create(model='tiny', prompt='abc', max_tokens=0, echo=True,
                                     logprobs=0, extra_body={'guided_choice': ['x']})
  assert scored.choices[0].text == 'abc'
  _assert_at_rest(real_engine)


def test_grammar_output_through_the_openai_client(real_server, real_engine):
  """vLLM's guided_grammar (completions) and structured_outputs' grammar (chat, streamed):
  every text is a sentence of the grammar, by our own recognizer, or a prefix of one cut
  by max_tokens; a grammar that cannot be read is a 400 naming the field it came in."""
  from tests.test_serve_engine import LISTS_GRAMMAR, nested_digits  # pylint: disable=C0415
  client = _client(real_server)
  out = client.completions.create(model='tiny', prompt='list: ', max_tokens=16, n=3, seed=5,
                                  extra_body={'guided_grammar': LISTS_GRAMMAR})
  for c in out.choices:
    assert nested_digits(c.text.encode())[c.finish_reason == 'stop'], c.text
  pieces, ends = '', []
  for chunk in client.chat.completions.create(
      model='tiny', messages=[{'role': 'user', 'content': 'a list'}], max_tokens=16,
      stream=True, seed=2, extra_body={'structured_outputs': {'grammar': LISTS_GRAMMAR}}):
    for c in chunk.choices:
      pieces += c.delta.content or ''
      ends += [c.finish_reason] if c.finish_reason else []
  assert pieces.startswith('[') and nested_digits(pieces.encode())[ends == ['stop']], pieces
  for body, field in [({'guided_grammar': 'root ::= ("a"'}, 'guided_grammar'),
                      ({'structured_outputs': {'grammar': 'start: x'}}, 'structured_outputs')]:
    resp = httpx.post(real_server.url + '/v1/completions', json={'prompt': 'x', **body})
    assert resp.status_code == 400 and resp.json()['error']['param'] == field, resp.text
  # Scoring a prompt (echo, max_tokens 0) generates nothing to guide: the field is moot.
  scored = client.completions.create(model='tiny', prompt='abc', max_tokens=0, echo=True,
                                     logprobs=0, extra_body={'guided_grammar': LISTS_GRAMMAR})
  assert scored.choices[0].text == 'abc'
  _assert_at_rest(real_engine)


def test_bad_inputs_on_the_real_engine_leave_nothing_behind(real_server, real_engine):
  for body in ({'prompt': 'x' * 60, 'max_tokens': 10}, {'prompt': [320]},
               {'prompt': 'hi', 'top_k': -5}, {'prompt': 'hi', 'min_p': 2}):
    resp = httpx.post(real_server.url + '/v1/completions', json=body)
    assert resp.status_code == 400, (body, resp.text)
  _assert_at_rest(real_engine)


def _metric_values(server) -> dict:
  from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=import-outside-toplevel
  text = httpx.get(server.url + '/metrics').text
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def test_stats_line_reports_rates_since_the_last_one_and_is_quiet_when_idle():
  from serve.api.metrics import StatsLogger  # pylint: disable=import-outside-toplevel
  snapshots = iter([
      outputs.EngineStats(0, 0, 0.0, 0, 0, 0, 0, {}),
      outputs.EngineStats(0, 0, 0.0, 0, 0, 0, 0, {}),            # idle: no line
      outputs.EngineStats(3, 1, 0.25, 200, 50, 200, 40, {}),     # 2 s later
      outputs.EngineStats(0, 0, 0.0, 200, 50, 200, 60, {}, 2),   # 4 s later
      outputs.EngineStats(0, 0, 0.0, 200, 50, 200, 60, {}, 2)])  # idle again
  times = iter([0.0, 1.0, 3.0, 7.0, 9.0])
  fake = type('E', (), {'stats': lambda self: next(snapshots)})()
  logger = StatsLogger(fake, clock=lambda: next(times))
  assert logger.line() is None
  assert logger.line() == ('Engine: prompt 100.0 tokens/s, generation 20.0 tokens/s; '
                           '3 running, 1 waiting; KV cache 25.0% used; prefix cache hits '
                           '25.0% of 200 prompt tokens.')
  assert logger.line() == ('Engine: prompt 0.0 tokens/s, generation 5.0 tokens/s; 0 '
                           'running, 0 waiting; KV cache 0.0% used; 2 preempted (KV cache '
                           'full).')
  assert logger.line() is None


def test_preemptions_are_a_counter(fake, monkeypatch):
  from serve.api.metrics import ServerMetrics  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(fake, 'stats',
                      lambda: outputs.EngineStats(0, 0, 0.0, 0, 0, 0, 0, {}, 7))
  text = ServerMetrics(fake).render().decode()
  assert 'meshlm:num_preemptions_total 7.0' in text.splitlines()


def test_speculative_decoding_counters_and_stats_line(fake, monkeypatch):
  from serve.api.metrics import ServerMetrics, StatsLogger  # pylint: disable=import-outside-toplevel
  spec = dict(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=40,
              spec_decode_num_accepted_tokens=30,
              spec_decode_num_accepted_tokens_per_pos=(10, 9, 7, 4))
  stats = iter([outputs.EngineStats(0, 0, 0.0, 0, 0, 0, 0, {}),
                outputs.EngineStats(1, 0, 0.1, 0, 0, 0, 40, {}, **spec)])
  fake_stats = type('E', (), {'stats': lambda self: next(stats)})()
  logger = StatsLogger(fake_stats, clock=iter([0.0, 2.0]).__next__)
  assert logger.line().endswith('; drafts accepted 75.0% of 40 tokens, 4.00 tokens a draft '
                                'step.')
  monkeypatch.setattr(fake, 'stats', lambda: outputs.EngineStats(
      0, 0, 0.0, 0, 0, 0, 0, {}, **spec))
  text = ServerMetrics(fake).render().decode().splitlines()
  for name in ('spec_decode_num_drafts', 'spec_decode_num_draft_tokens',
               'spec_decode_num_accepted_tokens'):
    assert f'meshlm:{name}_total {float(spec[name])}' in text
  for pos, value in enumerate(spec['spec_decode_num_accepted_tokens_per_pos']):
    assert (f'meshlm:spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}} '
            f'{float(value)}') in text


def test_metrics_count_what_was_served(real_server, real_engine):
  before = _metric_values(real_server)
  client = _client(real_server)
  outs = [client.completions.create(model='tiny', prompt=p, max_tokens=m,
                                    extra_body={'ignore_eos': True})
          for p, m in (('one', 3), ('two two', 5), ('three', 4))]
  _wait_for(lambda: real_engine.num_unfinished == 0)
  after = _metric_values(real_server)
  delta = lambda name, labels=(): after[(name, labels)] - before.get((name, labels), 0)  # noqa
  assert delta('meshlm:prompt_tokens_total') == sum(o.usage.prompt_tokens for o in outs)
  assert delta('meshlm:generation_tokens_total') == 12
  assert delta('meshlm:request_success_total', (('finished_reason', 'length'),)) == 3
  assert delta('meshlm:time_to_first_token_seconds_count') == 3
  assert delta('meshlm:e2e_request_latency_seconds_count') == 3
  assert delta('meshlm:inter_token_latency_seconds_count') == 2 + 4 + 3
  assert delta('meshlm:e2e_request_latency_seconds_sum') > delta(
      'meshlm:time_to_first_token_seconds_sum') > 0
  assert after[('meshlm:num_requests_running', ())] == 0
  assert after[('meshlm:num_preemptions_total', ())] == real_engine.scheduler.num_preemptions
  assert after[('meshlm:num_requests_waiting', ())] == 0
  assert after[('meshlm:kv_cache_usage_perc', ())] == 0
  assert after[('meshlm:prefix_cache_queries_total', ())] >= after[
      ('meshlm:prefix_cache_hits_total', ())] >= 0


# ------------------------------------------------------------------ a Hugging Face model

@pytest.fixture(scope='module')
def hf_server(tmp_path_factory):
  """A small random Llama saved by transformers, with a word-level tokenizer.json."""
  from serve.config import ServeConfig  # pylint: disable=import-outside-toplevel
  from serve.load.hf_model import load_hf_model  # pylint: disable=import-outside-toplevel
  from tests import test_serve_hf  # pylint: disable=import-outside-toplevel
  path = tmp_path_factory.mktemp('hf_llama')
  test_serve_hf.save_llama(path)
  test_serve_hf.write_tokenizer(path, chat_template=test_serve_hf.LLAMA3_TEMPLATE)
  served = load_hf_model(str(path))
  engine = engine_lib.Engine(served, ServeConfig(num_blocks=40, max_num_seqs=4,
                                                 max_num_batched_tokens=64))
  server = ServerThread(create_app(engine, served, model_name='llama'))
  yield server, engine, served
  server.stop()
  engine.shutdown()


def test_hf_tokenizer_keeps_word_spacing_when_streamed(hf_server):
  server, engine, served = hf_server
  client = _client(server)
  kw = dict(model='llama', prompt='w1 w2 w3 w4', max_tokens=12, temperature=0.0)
  plain = client.completions.create(**kw).choices[0]
  # Independent of our detokenizer: the tokenizer's own decode of the greedy tokens.
  tokens = engine.generate([served.tokenizer.encode('w1 w2 w3 w4').tolist()],
                           sp_lib.SamplingParams(max_tokens=12, temperature=0.0))[0]
  words = served.tokenizer.decode(tokens.token_ids)
  assert plain.text.strip() == words and len(words.split()) >= 8, (plain.text, words)
  assert _streamed_texts(client, 1, **kw) == ([plain.text], [plain.finish_reason])
  # A stop string spanning two words (and so two tokens) in the middle of the output.
  split = words.split()
  stop = f'{split[3]} {split[4]}'
  cut = plain.text[:plain.text.index(stop)]
  expected = ([cut], ['stop'])
  assert _streamed_texts(client, 1, stop=[stop], **kw) == expected
  stopped = client.completions.create(stop=[stop], **kw).choices[0]
  assert ([stopped.text], [stopped.finish_reason]) == expected
  chat = dict(model='llama', messages=[{'role': 'user', 'content': 'w7 w8'}], max_tokens=8,
              temperature=0.0)
  whole = client.chat.completions.create(**chat).choices[0].message.content
  pieces = ''.join(c.choices[0].delta.content or ''
                   for c in client.chat.completions.create(stream=True, **chat) if c.choices)
  assert pieces == whole and whole.strip()
  _assert_at_rest(engine)


# ------------------------------------------------------------------ SIGTERM (subprocess)

SUBPROCESS_SERVER = '''
import sys
from serve.__main__ import run
from serve.api.server import create_app
from tests.test_serve_server import FakeEngine, FakeServed
engine = FakeEngine(step_s=0.05)
run(create_app(engine, FakeServed()), engine, host='127.0.0.1', port=int(sys.argv[1]),
    grace_s=float(sys.argv[2]), log_level='warning')
'''


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _sse_stream(url, body, sink: list):
  with httpx.stream('POST', url + '/v1/completions', json={**body, 'stream': True},
                    timeout=30) as resp:
    for line in resp.iter_lines():
      if line.startswith('data: '):
        sink.append(line[len('data: '):])


def test_sigterm_drains_then_exits_cleanly():
  port = _free_port()
  url = f'http://127.0.0.1:{port}'
  proc = subprocess.Popen([sys.executable, '-c', SUBPROCESS_SERVER, str(port), '1.5'],
                          cwd=ROOT)
  try:
    _wait_for(lambda: proc.poll() is not None or _health(url) == 200, timeout=60)
    assert proc.poll() is None, 'the server process died at start'
    short, long = [], []   # 10 tokens (0.5 s) finish in the grace period; 60 do not
    threads = [threading.Thread(target=_sse_stream, args=(url, body, sink)) for body, sink in
               (({'prompt': 'ab', 'max_tokens': 10}, short),
                ({'prompt': 'xy', 'max_tokens': 60}, long))]
    for t in threads:
      t.start()
    _wait_for(lambda: short and long)
    proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: _health(url) == 503, timeout=5)
    refused = httpx.post(url + '/v1/completions', json={'prompt': 'hi'})
    assert refused.status_code == 503 and 'shutting down' in refused.json()['error']['message']
    for t in threads:
      t.join(30)
    assert proc.wait(timeout=30) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  chunks = [json.loads(c) for c in short[:-1]]
  assert short[-1] == '[DONE]' and chunks[-1]['choices'][0]['finish_reason'] == 'length'
  assert ''.join(c['choices'][0]['text'] for c in chunks) == 'ababababab'
  assert long[-1] == '[DONE]' and 'grace period' in json.loads(long[-2])['error']['message']


def test_cli_serves_a_checkpoint_with_the_key_from_the_environment(tiny_workdir, tmp_path):
  port = _free_port()
  url = f'http://127.0.0.1:{port}'
  env = {**os.environ, 'MESHLM_API_KEY': 'sesame', 'JAX_PLATFORMS': 'cpu'}
  log = tmp_path / 'serve.log'
  proc = subprocess.Popen([sys.executable, '-m', 'serve', '--checkpoint', tiny_workdir,
                           '--port', str(port), '--num-blocks', '16', '--max-num-seqs', '2',
                           '--log-level', 'warning', '--log-stats-interval', '0.2'],
                          cwd=ROOT, env=env, stdout=log.open('w'))
  try:
    _wait_for(lambda: proc.poll() is not None or _health(url) == 200, timeout=120)
    assert proc.poll() is None, 'the server process died at start'
    assert httpx.get(url + '/v1/models').status_code == 401
    client = openai.OpenAI(base_url=url + '/v1', api_key='sesame', max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt='def ', max_tokens=4,
                                    extra_body={'ignore_eos': True})
    assert out.usage.completion_tokens == 4
    # --log-stats-interval: a line covering the 4 tokens' interval (and none while idle)
    stats_line = r'Engine: prompt [\d.]+ tokens/s, generation [1-9][\d.]* tokens/s; '
    _wait_for(lambda: re.search(stats_line, log.read_text()), timeout=10)
    count = log.read_text().count('Engine: ')
    time.sleep(1.0)   # five idle intervals: at most the one still covering the request
    assert log.read_text().count('Engine: ') <= count + 1
    proc.send_signal(signal.SIGINT)   # Ctrl-C: the same drain as SIGTERM
    assert proc.wait(timeout=60) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


class Fatal(BaseException):
  """What no `except Exception` catches: it ends the engine's loop thread."""


def test_health_is_503_and_open_requests_fail_once_the_engine_loop_dies(tiny_served,
                                                                        monkeypatch):
  from serve.config import ServeConfig  # pylint: disable=import-outside-toplevel
  engine = engine_lib.Engine(tiny_served, ServeConfig(num_blocks=16, max_num_seqs=2,
                                                      max_num_batched_tokens=32))
  entered, release = threading.Event(), threading.Event()

  def dies(*args):
    entered.set()
    release.wait(30)
    raise Fatal('injected fatal error')
  monkeypatch.setattr(engine.runner, 'step', dies)
  server = ServerThread(create_app(engine, tiny_served, model_name='tiny'))
  try:
    assert _health(server.url) == 200
    sink = []
    reader = threading.Thread(target=_sse_stream, args=(server.url, {
        'model': 'tiny', 'prompt': 'ab', 'max_tokens': 8}, sink))
    reader.start()
    assert entered.wait(30) and _health(server.url) == 200   # in a step: alive
    release.set()
    reader.join(30)
    assert sink[-1] == '[DONE]'
    error = json.loads(sink[-2])['error']
    assert error['code'] == 'engine_dead' and 'loop died: Fatal' in error['message']
    resp = httpx.get(server.url + '/health', timeout=5)
    assert resp.status_code == 503 and 'injected fatal error' in resp.json()['error']['message']
    refused = httpx.post(server.url + '/v1/completions', json={'model': 'tiny', 'prompt': 'a'})
    assert refused.status_code == 503 and refused.json()['error']['code'] == 'engine_dead'
  finally:
    release.set()
    server.stop()
    engine.shutdown()


@pytest.mark.parametrize('hold', ['engine lock', 'tokenizer'])
def test_the_event_loop_never_waits_on_the_engine_or_the_tokenizer(tiny_served, monkeypatch,
                                                                   hold):
  """While one request waits for the engine's lock (held across a step's scheduling and
  emission) or for a slow tokenizer, the server still answers GET /v1/models at once and
  the request completes afterwards. Before, both ran on the event loop: it stopped."""
  from serve.config import ServeConfig  # pylint: disable=import-outside-toplevel
  engine = engine_lib.Engine(tiny_served, ServeConfig(num_blocks=16, max_num_seqs=2,
                                                      max_num_batched_tokens=32))
  entered, release = threading.Event(), threading.Event()
  real_encode = tiny_served.tokenizer.encode

  def slow_encode(*args, **kwargs):
    entered.set()
    release.wait(30)
    return real_encode(*args, **kwargs)
  if hold == 'tokenizer':
    monkeypatch.setattr(tiny_served.tokenizer, 'encode', slow_encode)
  server = ServerThread(create_app(engine, tiny_served, model_name='tiny'))
  done = []
  post = threading.Thread(target=lambda: done.append(httpx.post(
      server.url + '/v1/completions', json={'model': 'tiny', 'prompt': 'ab', 'max_tokens': 2},
      timeout=60)))
  try:
    if hold == 'engine lock':
      engine._lock.acquire()   # pylint: disable=protected-access
      monkeypatch.setattr(engine, 'check_prompt', lambda *a, _real=engine.check_prompt:
                          (entered.set(), _real(*a))[1])
    post.start()
    assert entered.wait(30)
    time.sleep(0.2)   # the request is now waiting (on the loop, before the change)
    start = time.perf_counter()
    assert httpx.get(server.url + '/v1/models', timeout=10).status_code == 200
    assert time.perf_counter() - start < 2.0
  finally:
    if hold == 'engine lock':
      engine._lock.release()   # pylint: disable=protected-access
    release.set()
    post.join(60)
    server.stop()
    engine.shutdown()
  assert done and done[0].status_code == 200, done


def test_the_drain_aborts_a_request_submitted_after_it_began(fake, monkeypatch):
  """Requests are prepared and submitted in worker threads, so one can come in after the
  drain's first abort pass; it is aborted too, not left to run past the grace period."""
  import asyncio  # pylint: disable=import-outside-toplevel
  state = create_app(fake, FakeServed()).state.meshlm
  aborted = []
  monkeypatch.setattr(fake, 'abort', aborted.append)

  async def scenario():
    state.active['early'] = object()
    drain = asyncio.create_task(state.drain(0.0))
    await asyncio.sleep(0.2)   # the drain has aborted 'early' and waits for it to end
    state.active['late'] = object()   # submitted by a worker thread meanwhile
    await asyncio.sleep(0.3)
    state.active.clear()   # both handlers end
    await drain
  asyncio.run(scenario())
  assert aborted == ['early', 'late']


DYING_SERVER = '''
import sys
from serve.__main__ import run
from serve.api.server import create_app
from serve.config import ServeConfig
from serve.engine.core import Engine
from serve.load.checkpoint import load_checkpoint
class Fatal(BaseException):
  pass
served = load_checkpoint(sys.argv[1])
engine = Engine(served, ServeConfig(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=32))
def dies(*args):
  raise Fatal('injected fatal error')
engine.runner.step = dies
sys.exit(run(create_app(engine, served, model_name='tiny'), engine, host='127.0.0.1',
             port=int(sys.argv[2]), grace_s=1.0, log_level='warning', health_interval_s=0.1))
'''


def test_the_server_exits_nonzero_after_failing_open_requests_when_the_engine_dies(
    tiny_workdir, tmp_path):
  port = _free_port()
  url = f'http://127.0.0.1:{port}'
  log = tmp_path / 'stderr.log'
  proc = subprocess.Popen([sys.executable, '-c', DYING_SERVER, tiny_workdir, str(port)],
                          cwd=ROOT, stderr=log.open('w'))
  try:
    _wait_for(lambda: proc.poll() is not None or _health(url) == 200, timeout=120)
    assert proc.poll() is None, 'the server process died at start'
    resp = httpx.post(url + '/v1/completions', json={'model': 'tiny', 'prompt': 'ab',
                                                     'max_tokens': 4}, timeout=30)
    assert resp.status_code == 503 and resp.json()['error']['code'] == 'engine_dead'
    assert proc.wait(timeout=30) == 1
    assert 'the engine is dead (the engine loop died: Fatal' in log.read_text()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def _health(url) -> int | None:
  try:
    return httpx.get(url + '/health', timeout=2).status_code
  except httpx.TransportError:
    return None


# ------------------------------------------------------------------ load benchmark client

def test_serve_load_measures_the_pace_it_is_served_at(fake_server, fake):
  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel
  fake.step_s = 0.02   # the fake emits one token per 20 ms: TPOT and ITL must say so
  args = serve_load.parse_args(['--url', fake_server.url, '--num-prompts', '6',
                                '--input-len', '5', '--output-len', '6',
                                '--max-concurrency', '3', '--warmup', '0'])
  summary = serve_load.benchmark(fake_server.url, args)
  assert (summary['completed'], summary['failed']) == (6, 0)
  assert summary['output_tokens'] == 36
  for key in ('tpot_ms', 'itl_ms'):
    assert 18 < summary[key]['p50'] < 60, (key, summary[key])
  # Two waves of 3 (max concurrency): the whole run takes about 2 x 6 steps.
  assert 0.2 < summary['wall_s'] < 1.5 and summary['ttft_ms']['p50'] > 0
  assert fake.held == 0
  # the probe asked GET /v1/models every 20 ms while the load ran
  assert summary['models_probes'] >= 5 and summary['models_probe_ms']['p50'] > 0
