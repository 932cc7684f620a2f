"""What the engine raises at admission: the server answers 429 or 503 with them."""


class QueueFull(RuntimeError):
  """More requests wait than ServeConfig.max_waiting_requests allows (HTTP 429)."""


class EngineClosed(RuntimeError):
  """The engine is shutting down and admits no new requests (HTTP 503)."""


class EngineDeadError(EngineClosed):
  """The engine loop died or stopped making progress (vLLM's EngineDeadError): every open
  request has failed with it, and no request is admitted again (HTTP 503)."""


class UnknownAdapter(KeyError):
  """A request names a model that is neither the base nor a loaded LoRA adapter (HTTP 404,
  code model_not_found, as vLLM)."""

  def __str__(self) -> str:
    return str(self.args[0])
