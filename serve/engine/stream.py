"""A request's outputs as a stream, bridging the engine thread to a reading thread or an
asyncio task."""

import asyncio
import queue
import threading

from serve.engine.outputs import CompletionResult, RequestOutput, collect


class RequestStream:
  """Outputs of one request, read from a thread (`for`) or asyncio (`async for`).

  The engine thread puts; with an asyncio reader the put goes through the reader's loop
  (call_soon_threadsafe), since asyncio queues are not thread-safe.
  """

  def __init__(self, request_id: str, prompt_ids: list[int], engine):
    self.request_id = request_id
    self.prompt_token_ids = prompt_ids
    self._engine = engine
    self._sync = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._loop = None
    self._async = None

  def put(self, out: RequestOutput) -> None:
    with self._lock:
      if self._async is None:
        self._sync.put(out)
        return
      try:
        self._loop.call_soon_threadsafe(self._async.put_nowait, out)
      except RuntimeError:   # the reader's loop is closed: nobody is listening
        pass

  def abort(self) -> None:
    self._engine.abort(self.request_id)

  def __iter__(self):
    while True:
      out = self._sync.get()
      yield out
      if out.finished:
        return

  async def __aiter__(self):
    with self._lock:
      self._loop, self._async = asyncio.get_running_loop(), asyncio.Queue()
      while not self._sync.empty():
        self._async.put_nowait(self._sync.get_nowait())
    while True:
      out = await self._async.get()
      yield out
      if out.finished:
        return

  def result(self) -> CompletionResult:
    """Blocks until the request finishes; the whole output."""
    return collect(self.request_id, self.prompt_token_ids, list(self))
