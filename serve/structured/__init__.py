"""Structured output: regular expressions and grammars as per-token allowed sets."""
