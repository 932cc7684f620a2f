"""Serving: KV block pool, scheduler, runner, engine, HTTP server (not built yet)."""
