"""tierkv: a tiered KV-cache runtime — a small, resizable GPU hot window, pinned CPU, disk and Redis below.

The public names: `TierKVConfig`, `load_config`, `ConfigError`, `TieredLLM`.
Heavy optional parts (redis, vllm, the dashboard, transformers) load only when used.
"""
from __future__ import annotations

from tierkv.config import ConfigError, TierKVConfig, load_config

__all__ = ["ConfigError", "TierKVConfig", "TieredLLM", "load_config"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "TieredLLM":
        from tierkv.llm import TieredLLM

        return TieredLLM
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
