"""Elastic GPU budget: resizing between and during requests never changes the output."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.models import build, reference_greedy
from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model
from tierkv.config import ConfigError, load_config
from tierkv.llm import TieredLLM

BLOCK_BYTES = 2 * 2 * 4 * 16 * 4  # K+V, 2 kv heads, 4 tokens, head_dim 16, fp32
LAYERS = 2


def config(slots_per_layer: int = 6):
    return load_config({
        "cache": {"block_tokens": 4, "gpu_budget_bytes": LAYERS * slots_per_layer * BLOCK_BYTES,
                  "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": "16MiB"}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
    }, env={})


@torch.no_grad()
def test_resizing_between_decode_steps_keeps_tokens_and_logits():
    model, reference = build("llama", num_heads=8, num_kv_heads=2)
    runtime = runtime_for_model(model, config(), model_id="elastic")
    try:
        ids = torch.randint(0, 512, (181,)).tolist()
        ref_tokens, ref_logits = reference_greedy(reference, ids, 8)
        cache = TieredCache(runtime, ids)
        kwargs = forward_kwargs(model, cache)
        logits = model(torch.tensor([ids]), **kwargs).logits[0, -1]
        budgets = [40, 5, 5, 12, 30, 5, 6, 20]  # slots per layer before each decode step
        tokens = []
        for step, slots in enumerate(budgets):
            torch.testing.assert_close(logits, ref_logits[step], rtol=1e-4, atol=1e-4)
            token = int(torch.argmax(logits))
            tokens.append(token)
            runtime.set_gpu_budget(LAYERS * slots * BLOCK_BYTES)  # applied when the next step starts
            cache.seq.token_ids.append(token)
            logits = model(torch.tensor([[token]]), **kwargs).logits[0, -1]
            assert runtime.wait_for_budget(0)
            assert runtime.residency.slots_per_layer == slots
            assert runtime.pool.resident.shape[1] == slots
        cache.finish()
        assert tokens == ref_tokens
        gpu = runtime.stats()["gpu"]
        assert gpu["budget_changes"] == len(budgets)
        assert gpu["returned_bytes"] == LAYERS * BLOCK_BYTES * ((40 - 5) + (30 - 5))
        assert gpu["budget_bytes"] == LAYERS * 20 * BLOCK_BYTES
    finally:
        runtime.close()


def test_budget_too_small_for_sinks_and_window_is_refused_and_nothing_changes():
    model, _ = build("llama", num_heads=8, num_kv_heads=2)
    runtime = runtime_for_model(model, config(), model_id="elastic")
    try:
        with pytest.raises(ConfigError, match="sinks \\+ window need 4 per layer"):
            runtime.set_gpu_budget(LAYERS * 3 * BLOCK_BYTES)
        assert runtime.residency.slots_per_layer == 6
        assert runtime.wait_for_budget(0)
    finally:
        runtime.close()


def test_tiered_llm_budget_change_while_a_request_runs_gives_the_same_tokens():
    model, reference = build("llama", num_heads=8, num_kv_heads=2)
    llm = TieredLLM(model, config(), show_progress=False)
    prompt = torch.randint(0, 512, (300,)).tolist()
    expected, _ = reference_greedy(reference, prompt, 30)
    started = threading.Event()
    original_decode = llm._decode

    def decode_and_signal(*args, **kwargs):
        started.set()
        return original_decode(*args, **kwargs)

    llm._decode = decode_and_signal
    outputs = []
    with llm:
        worker = threading.Thread(target=lambda: outputs.extend(llm.generate([prompt], max_new_tokens=30)))
        worker.start()
        assert started.wait(60)
        llm.set_gpu_budget(LAYERS * 5 * BLOCK_BYTES, timeout_s=60)   # during the request
        worker.join(120)
        llm.set_gpu_budget(LAYERS * 9 * BLOCK_BYTES)                  # between requests: applied at once
        assert llm.runtime.residency.slots_per_layer == 9
        (again,) = llm.generate([prompt], max_new_tokens=30)
        with pytest.raises(ValueError, match="budget: got 0"):
            llm.set_gpu_budget(0)
        with pytest.raises(ValueError, match="cannot read '-1GiB' as a size"):
            llm.set_gpu_budget("-1GiB")
    assert outputs[0].token_ids == expected
    assert again.token_ids == expected


def test_a_change_made_after_the_last_step_applies_when_the_request_finishes(monkeypatch):
    """set_gpu_budget from another thread while the request samples its last token: the request finishes
    at the old size and the change applies as it ends (wait=True returns, the engine is idle at the new
    size), not at the next request."""
    import tierkv.llm as llm_module

    model, _ = build("llama", num_heads=8, num_kv_heads=2)
    llm = TieredLLM(model, config(), show_progress=False)
    sample, calls, done = llm_module.sample_next, [], {}

    def last_token_resizes(logits, params, generator):
        calls.append(1)
        if len(calls) == params.max_new_tokens:  # the last token: no forward step follows
            thread = threading.Thread(target=lambda: done.setdefault(
                "ok", llm.set_gpu_budget(LAYERS * 9 * BLOCK_BYTES, wait=True, timeout_s=20) or True))
            thread.start()
            thread.join(0.3)  # it cannot apply while the request holds its sequence
        return sample(logits, params, generator)

    monkeypatch.setattr(llm_module, "sample_next", last_token_resizes)
    try:
        llm.generate([list(range(1, 60))], max_new_tokens=5)
        deadline = time.monotonic() + 20
        while "ok" not in done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done.get("ok") is True
        assert llm.runtime.config.cache.gpu_budget_bytes == LAYERS * 9 * BLOCK_BYTES
        assert llm.runtime._pending_budget is None
    finally:
        llm.close()
