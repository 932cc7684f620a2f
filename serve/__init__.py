"""Serving: KV block pool, scheduler, model runner, sampler, engine, OpenAI-compatible
HTTP server and batch CLI, running the training code's model over a paged KV cache."""
