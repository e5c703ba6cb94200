"""Run-time budget changes through reload_config and a caller's config object: the last change asked for wins
(a reload met a pending set_gpu_budget and did nothing), and a TieredLLM keeps its own copy of a TierKVConfig
(edits to the caller's object, or another TieredLLM built from it, changed what this one reported)."""
from __future__ import annotations

import threading
import time

from tests.models import build, small_config
from tierkv.config.load import to_dict
from tierkv.integrations.hf import TieredCache
from tierkv.llm import TieredLLM

SLOT = 2 * 2 * 4 * 16 * 4 * 2  # one block of each of the 2 layers


def _llm(name: str, seed: int = 0) -> tuple[TieredLLM, object]:
    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=seed)
    config = small_config(name, num_layers=2, num_kv_heads=2, head_dim=16, prefill_chunk_tokens=64)  # 6 slots
    return TieredLLM(model, config, show_progress=False), config


def test_a_reload_replaces_a_pending_budget_change():
    llm, config = _llm("pending")
    with llm:
        original = to_dict(config)
        cache = TieredCache(llm.runtime, [1, 2, 3])  # a request in flight: a change waits for its next step
        llm.set_gpu_budget(12 * SLOT, wait=False)
        assert llm.runtime.pending_budget_bytes == 12 * SLOT
        reloaded = []  # a reload waits for its change, as set_gpu_budget does: from another thread, as in serving
        thread = threading.Thread(target=lambda: reloaded.append(llm.reload_config(original)))
        thread.start()
        deadline = time.monotonic() + 30
        while llm.runtime.pending_budget_bytes != original["cache"]["gpu_budget_bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        cache.finish()  # the request ends: the change waiting applies
        thread.join(30)
        assert reloaded == [["cache.gpu_budget_bytes"]]
        assert llm.runtime.residency.slots_per_layer == 6
        assert llm.config.cache.gpu_budget_bytes == original["cache"]["gpu_budget_bytes"]
        assert llm.runtime.pending_budget_bytes is None and llm.reload_config(original) == []


def test_a_tieredllm_keeps_its_own_copy_of_a_config_object():
    llm, config = _llm("alias")
    with llm:
        config.cache.gpu_budget_bytes = 12 * SLOT  # the caller edits its object, then reloads it
        assert llm.reload_config(config) == ["cache.gpu_budget_bytes"]
        assert llm.runtime.residency.slots_per_layer == 12 == llm.stats()["gpu"]["budget_bytes"] // SLOT
    _, shared = _llm("shared")
    a = TieredLLM(build("llama", num_heads=8, num_kv_heads=2, seed=1)[0], shared, show_progress=False)
    b = TieredLLM(build("llama", num_heads=8, num_kv_heads=2, seed=2)[0], shared, show_progress=False)
    with a, b:
        a.set_gpu_budget(10 * SLOT)
        assert b.stats()["gpu"]["budget_bytes"] == 6 * SLOT == b.runtime.residency.slots_per_layer * SLOT
        wanted = {**to_dict(shared), "cache": {**to_dict(shared)["cache"], "gpu_budget_bytes": 10 * SLOT}}
        assert b.reload_config(wanted) == ["cache.gpu_budget_bytes"]
        assert b.runtime.residency.slots_per_layer == 10
