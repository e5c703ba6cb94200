"""The part of vLLM's `LLM` that tierkv's vLLM front end reads (`llm_engine.vllm_config`, `engine_core.shutdown`,
`collective_rpc` for the start-up warm-up), for the tests' stand-ins of `vllm.LLM`; one place, so a new field the
front end reads is added once."""
from __future__ import annotations

from types import SimpleNamespace


def engine_namespace(kwargs: dict, shutdown=lambda: None, engine_id: str = "fake-engine") -> SimpleNamespace:
    """`llm.llm_engine` as VllmTieredLLM reads it, from the keyword arguments the stand-in was built with."""
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=engine_id),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(enforce_eager=kwargs.get("enforce_eager", False)),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 8192)))
    return SimpleNamespace(engine_core=SimpleNamespace(shutdown=shutdown), model_config=None, vllm_config=config)


class FakeEngineBase:
    """A `vllm.LLM` stand-in's base: records the warm-up's collective_rpc calls in `rpc_calls` and answers as a
    worker that ran every count (none run)."""

    def __init__(self, **kwargs):
        self.llm_engine = engine_namespace(kwargs)
        self.rpc_calls: list = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpc_calls.append((method, args))
        return [(len(args[0]) if args else 0, "")]
