"""The engine, structured as vLLM v1's: requests, the KV block pool and cache manager, the
scheduler, the engine loop and its output processing (detokenizing, streaming)."""
