"""Speculative decoding: its configuration and n-gram drafts."""
