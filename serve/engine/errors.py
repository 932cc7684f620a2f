"""What the engine raises at admission: the server answers 429 or 503 with them."""


class QueueFull(RuntimeError):
  """More requests wait than ServeConfig.max_waiting_requests allows (HTTP 429)."""


class EngineClosed(RuntimeError):
  """The engine is shutting down and admits no new requests (HTTP 503)."""


class EngineDeadError(EngineClosed):
  """The engine loop died or stopped making progress (vLLM's EngineDeadError): every open
  request has failed with it, and no request is admitted again (HTTP 503)."""
