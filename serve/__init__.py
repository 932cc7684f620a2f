"""Serving the training code's model over a paged KV cache, laid out as vLLM v1 is:
api/ (the OpenAI-compatible HTTP server), engine/ (requests, block pool, KV cache manager,
scheduler, engine loop, output processing), worker/ (model runner, KV cache, sampler),
structured/ (structured output), spec/ (speculative decoding), load/ (checkpoints and
Hugging Face directories). Entry points: `python -m serve` (the server), `python -m
serve.generate` (the batch CLI), `python -m serve.hf_export`."""
