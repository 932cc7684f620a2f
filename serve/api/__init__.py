"""The OpenAI-compatible HTTP front end: routes, request bodies, completions, chat,
tokenization, tool calling, chat templates and Prometheus metrics."""
