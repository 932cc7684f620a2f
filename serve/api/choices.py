"""The engine side of an HTTP request: n choices per prompt submitted as engine requests
(off the event loop), their streams merged as they come, and aborted however the request
ends (client gone, server draining)."""

import asyncio
import collections
import dataclasses
import uuid

import fastapi

from serve.api import openai_sampling
from serve.api.protocol import ApiError, engine_dead_error
from serve.api.responses import logprob_entries
from serve.api.state import Choice, ServerState
from serve.engine.errors import EngineClosed, EngineDeadError, QueueFull, UnknownAdapter


def submit(state: ServerState, prompts: list[list[int]], params: list,
           n: int | None = 1, adapter: str | None = None) -> list[Choice]:
  """Adds n requests per prompt to the engine, or none at all (429 when the queue is full).

  A prompt's n choices are independent requests; with a seed, choice j samples with
  seed + j, as vLLM's parallel sampling does, so the n differ and each can be reproduced
  alone. Only the first choice computes the prompt's logprobs: the others read them from
  it (`prompt_scores`), and `outputs` holds their outputs until it has them. adapter:
  the LoRA adapter they run on (None: the base)."""
  base, n = uuid.uuid4().hex, n or 1
  limit = state.engine.max_waiting_requests
  if len(prompts) * n > limit:
    raise ApiError(400, f'n: {len(prompts)} prompts x n={n} are {len(prompts) * n} requests, '
                   f'more than the server ever queues ({limit}, --max-waiting-requests); '
                   'send fewer per call.', param='n')
  reqs, lora = [], {} if adapter is None else {'lora': adapter}
  try:
    for i, (ids, p) in enumerate(zip(prompts, params)):
      for j in range(n):
        child = p if p.seed is None else dataclasses.replace(p, seed=p.seed + j)
        waits = bool(j) and p.prompt_logprobs is not None
        if waits:
          child = dataclasses.replace(child, prompt_logprobs=None)
        rid = f'{base}-{i * n + j}'
        stream = state.engine.add_request(ids, child, request_id=rid, **lora)
        reqs.append(Choice(rid, i * n + j, ids, stream, counts_prompt=j == 0,
                           waits_for_scores=waits, adapter=adapter))
        reqs[-1].first = reqs[-1] if j == 0 else reqs[-1 - j]
        state.active[rid] = reqs[-1]
  except QueueFull as e:
    abort(state, reqs)
    raise ApiError(429, f'The server is busy: its waiting queue is full ({e}).',
                   type_='rate_limit_error', code='queue_full') from None
  except EngineDeadError:
    abort(state, reqs)
    raise engine_dead_error(state.engine.health()) from None
  except EngineClosed as e:
    abort(state, reqs)
    raise ApiError(503, str(e), type_='server_error', code='shutting_down') from None
  except UnknownAdapter as e:   # unloaded since the request was read
    abort(state, reqs)
    raise ApiError(404, str(e), param='model', type_='NotFoundError',
                   code='model_not_found') from None
  except ValueError as e:   # the engine refusing a request that can never fit
    abort(state, reqs)
    raise ApiError(400, str(e), param=getattr(e, 'param', None)) from None
  return reqs


def abort(state: ServerState, reqs: list[Choice]) -> None:
  for r in reqs:
    if r.finish_reason is None:
      state.engine.abort(r.rid)
      _finish(state, r, 'abort')


def _finish(state: ServerState, r: Choice, reason: str) -> None:
  r.finish_reason = reason
  state.active.pop(r.rid, None)


def _apply(state: ServerState, r: Choice, out):
  """Folds one RequestOutput delta into its request; the delta as the client sees it."""
  if out.prompt_logprobs is not None:
    r.prompt_logprobs = out.prompt_logprobs
  if r.prompt_only:
    out = dataclasses.replace(out, new_token_ids=[], new_text='', logprobs=None,
                              finish_reason='length' if out.finish_reason in ('stop', 'length')
                              else out.finish_reason)
  r.text += out.new_text
  r.token_ids.extend(out.new_token_ids)
  if out.logprobs:
    r.logprobs.extend(logprob_entries(out))
  if out.finished:
    _finish(state, r, out.finish_reason)
  return out


async def outputs(state: ServerState, reqs: list[Choice]):
  """(request, delta) from all of reqs as they come; a stream that ends early is an abort."""
  queue = asyncio.Queue()

  async def pump(r):
    try:
      async for out in r.stream:
        queue.put_nowait((r, out))
    except Exception as e:  # pylint: disable=broad-except  (fails this request only)
      queue.put_nowait((r, e))
    finally:
      queue.put_nowait((r, None))

  def scored(first):   # its prompt's scores are there, or will never come
    return first.prompt_logprobs is not None or first.finish_reason is not None

  tasks = [asyncio.ensure_future(pump(r)) for r in reqs]
  held = {}   # a first choice's rid -> its siblings' items, in order, until scored(first)
  try:
    remaining = len(reqs)
    while remaining:
      item = await queue.get()
      r = item[0]
      if r.waits_for_scores and (r.first.rid in held or not scored(r.first)):
        held.setdefault(r.first.rid, []).append(item)
        continue
      pending = collections.deque([item])
      while pending:
        r, out = pending.popleft()
        if out is None or isinstance(out, Exception):
          remaining -= out is None
          if r.finish_reason is None:
            if out is not None:   # a broken stream: make sure the engine lets it go too
              state.engine.abort(r.rid)
            _finish(state, r, 'abort' if out is None else 'error')
            yield r, None         # readers learn of the early end (ended_early says why)
        else:
          yield r, _apply(state, r, out)
        if r.rid in held and scored(r):
          pending.extend(held.pop(r.rid))
  finally:
    for t in tasks:
      t.cancel()


async def collect(state: ServerState, request: fastapi.Request, reqs: list[Choice]) -> None:
  """Runs reqs to the end, aborting them if the client goes away first."""
  async def consume():
    async for _ in outputs(state, reqs):
      pass

  async def watch():
    # The body is read: the next message uvicorn gives is the disconnect.
    while (await request.receive())['type'] != 'http.disconnect':
      pass

  consumer, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(watch())
  try:
    await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    consumer.cancel()
    watcher.cancel()
    abort(state, reqs)
  if consumer.done() and not consumer.cancelled() and consumer.exception() is not None:
    raise consumer.exception()   # our failure, not an abort: a 500 (`unexpected`)


def ended_early(state: ServerState, reqs: list[Choice]) -> ApiError | None:
  """The error for a request the server or the engine cut short, if any."""
  dead = state.engine.health() if any(r.finish_reason == 'error' for r in reqs) else None
  if dead is not None:
    return engine_dead_error(dead)
  for r in reqs:
    if r.finish_reason == 'error':
      return ApiError(500, 'The engine failed while generating this request; see the server '
                      'log. Other requests are unaffected.', type_='server_error',
                      code='engine_error')
    if r.finish_reason == 'abort':
      why = ('the server is shutting down and the request did not finish within the grace '
             'period' if r.rid in state.shutdown_aborted else 'the request was aborted')
      return ApiError(503, f'Generation stopped early: {why}.', type_='server_error',
                      code='aborted')
  return None


async def submit_off_loop(state: ServerState, prompts, params, n,
                          adapter: str | None = None) -> list[Choice]:
  """submit in a worker thread; if the client goes away meanwhile, what it submitted
  is aborted once it is in."""
  submitting = asyncio.get_running_loop().run_in_executor(
      state.submitters, submit, state, prompts, params, n, adapter)
  try:
    return await asyncio.shield(submitting)
  except asyncio.CancelledError:
    submitting.add_done_callback(
        lambda f: f.cancelled() or f.exception() is not None or abort(state, f.result()))
    raise


async def compile_guided(state: ServerState, body: dict, params,
                         field: str | None = None) -> None:
  """Structured output's expression compiled off the event loop (seconds for a large
  vocabulary; cached), so other streams go on meanwhile; a 400 naming the field (by
  default the body's structured-output one) if the vocabulary cannot follow it."""
  if not params.guided:
    return
  try:
    await asyncio.to_thread(state.engine.compile_guided, params)
  except ValueError as e:
    field = field or openai_sampling.guided_field(body)
    raise ApiError(400, f'{field}: {e}', param=field) from None
