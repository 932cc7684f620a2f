"""A response streamed as server-sent events, or collected and answered as JSON."""

import asyncio

from fastapi import responses

from serve.api.choices import abort, collect, ended_early, outputs
from serve.api.responses import chunk_usage, error_event, include_usage, sse, usage
from serve.api.state import Choice, ServerState


async def events(state, reqs, body, meta, choice_fn, decodes: bool):
  """The SSE stream: a chunk per delta that choice_fn(r, out) turns into a choice (None:
  nothing to send; in a worker thread when it `decodes` token ids, as logprobs do); a
  request cut short ends the stream with an error event, otherwise the usage chunk if
  asked for; then [DONE]."""
  async for r, out in outputs(state, reqs):
    err = ended_early(state, [r])
    if err:
      yield error_event(err)
      break
    choice = await asyncio.to_thread(choice_fn, r, out) if decodes else choice_fn(r, out)
    if choice is not None:
      yield sse({**meta, 'choices': [choice], **chunk_usage(body, r)})
  else:
    if include_usage(body):
      yield sse({**meta, 'choices': [], 'usage': usage(reqs)})
  yield 'data: [DONE]\n\n'


class AbortOnClose(responses.StreamingResponse):
  """An SSE response that aborts its unfinished requests however it ends.

  A generator's `finally` never runs if the response is cancelled before its first
  chunk (client gone while the prompt was still being prefilled); this wrapper always does.
  """

  def __init__(self, content, state: ServerState, reqs: list[Choice]):
    super().__init__(content, media_type='text/event-stream',
                     headers={'Cache-Control': 'no-cache'})
    self._state, self._reqs = state, reqs

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      abort(self._state, self._reqs)


async def respond(state, request, reqs, body, want_logprobs, events_fn, json_fn):
  if body.stream:
    return AbortOnClose(events_fn(state, reqs, body, want_logprobs), state, reqs)
  await collect(state, request, reqs)
  err = ended_early(state, reqs)
  if err:
    raise err
  return await asyncio.to_thread(json_fn, state, reqs, want_logprobs)   # decodes logprobs
