"""Adapters to serving front ends: `transformers` (a Cache + attention function)."""
