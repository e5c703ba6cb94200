"""The decode step a CUDA graph replays (`tierkv.engine.decode_graph`), run here without the capture: its
graphed forward (the new K/V written into the partial block's slot at rows read from the device, one
paged attention over the resident and partial blocks, predictor 'cache''s far part with static row
inputs) gives the tokens, logits and cache counts of the plain step, for three architectures, with
and without a prefetch margin, over steps that complete blocks (those run eagerly). On CPU a
`DecodeStep` left to its defaults never captures: every step is eager. tests/gpu/test_decode_graph_gpu.py
replays the graphs on CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.integrations.hf.test_exact_hf import tiered_greedy, tiny_config
from tests.models import build
from tests.sparse.test_cached_predictor import decode_under_budgets
from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model
from tierkv.config import load_config
from tierkv.engine.decode_graph import DecodeStep

BLOCK_TOKENS = 4


def sparse_settings(budget: int = 32, **scheduler) -> dict:
    settings = tiny_config(BLOCK_TOKENS, 1, 64, num_layers=2, kv_heads=2, head_dim=16)
    settings["scheduler"].update(policy="sparse", sparse_token_budget=budget, predictor="cache",
                                 staging_bytes=128 * 2 * 2 * BLOCK_TOKENS * 16 * 4, **scheduler)
    return settings


@torch.no_grad()
def stepped_greedy(model, runtime, ids: list[int], num_new: int, capture: bool | None = False):
    """tiered_greedy's tokens and logits, each decode step through a DecodeStep."""
    cache = TieredCache(runtime, ids)
    kwargs = forward_kwargs(model, cache)
    logits = None
    for pos in range(0, len(ids), 64):
        logits = model(torch.tensor([ids[pos : pos + 64]]), **kwargs).logits[0, -1]
    step = DecodeStep(model, cache, capture=capture)
    tokens, all_logits = [], [logits]
    for _ in range(num_new):
        token = int(torch.argmax(logits))
        tokens.append(token)
        cache.seq.token_ids.append(token)
        logits = step(token)
        all_logits.append(logits)
    read_stats = cache.seq.read_stats()
    cache.finish()
    return tokens, all_logits, read_stats


@pytest.mark.parametrize("arch,margin,storage", [("llama", 0, "auto"), ("qwen2", 0, "auto"), ("mistral", 0, "auto"),
                                                  ("llama", 4, "auto"), ("llama", 0, "int8")])
def test_graphed_forward_equals_the_plain_step(arch, margin, storage):
    """int8: a quantized CPU tier, whose misses' codes and scales are copied and dequantized."""
    model, _ = build(arch, num_heads=8, num_kv_heads=2, seed=3)
    ids = torch.randint(0, 512, (211,)).tolist()
    extra = {"sparse_cache_selections": 2, "sparse_prefetch_margin": margin} if margin else {}
    settings = sparse_settings(**extra)
    settings["tiers"][0]["storage_dtype"] = storage
    results = {}
    for name in ("plain", "graphed"):
        runtime = runtime_for_model(model, load_config(settings, env={}), model_id=f"graph-{arch}")
        try:
            if name == "plain":
                tokens, logits = tiered_greedy(model, runtime, ids, 14, 64)
                reads = None
            else:
                tokens, logits, reads = stepped_greedy(model, runtime, ids, 14)
            results[name] = tokens, logits, runtime.stats(), reads, dict(runtime.decode_graph_counts)
        finally:
            runtime.close()
    (tokens, logits, stats, _, _), (g_tokens, g_logits, g_stats, reads, counts) = results["plain"], results["graphed"]
    assert g_tokens == tokens
    for got, want in zip(g_logits, logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # 211 prompt tokens, 14 steps: those at t0 = 211, 215, 219, 223 complete a block (eager), 10 run graphed
    assert counts == {"graph_steps": 10, "replays": 0, "eager_steps": 4, "captures": 0, "capture_errors": 0,
                      "capture_s": 0.0}
    assert g_stats["scheduler"]["stalls"] == stats["scheduler"]["stalls"] > 0
    assert g_stats["scheduler"]["far_cache_copied_bytes"] == stats["scheduler"]["far_cache_copied_bytes"] > 0
    counted = ("precision", "recall", "prefetched_blocks", "used_blocks")  # not the streamer's timings
    assert [g_stats["prefetch"].get(key) for key in counted] == [stats["prefetch"].get(key) for key in counted]
    assert reads["resident_block_reads"] > 0 and reads["gpu_hit_rate"] is not None


@torch.no_grad()
def test_gpu_budget_changes_between_graphed_steps_give_the_plain_steps_output():
    """A new GPU budget before a step is applied by the graphed step's host side: the resident blocks and
    the first far block move, and tokens and logits stay those of plain steps under the same changes."""
    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=6)
    block_bytes = 2 * 2 * BLOCK_TOKENS * 16 * 4
    ids = torch.randint(0, 512, (181,)).tolist()
    budgets = [40, 5, 12, 12, 5, 30, 6, 6]  # resident slots per layer before each decode step
    runs, fronts = {}, set()
    for name in ("plain", "graphed"):
        settings = sparse_settings(budget=16)
        settings["cache"].update(gpu_budget_bytes=2 * 6 * block_bytes, sink_tokens=BLOCK_TOKENS, window_tokens=8)
        runtime = runtime_for_model(model, load_config(settings, env={}), model_id=f"elastic-graph-{name}")
        try:
            graphed = (lambda model, cache: DecodeStep(model, cache, capture=False)) if name == "graphed" else None
            tokens, all_logits = decode_under_budgets(model, runtime, ids, [2 * slots * block_bytes for slots in budgets],
                                                      fronts, step=graphed)
            runs[name] = tokens, all_logits, dict(runtime.decode_graph_counts)
        finally:
            runtime.close()
    assert len(fronts) >= 3  # the first far block moved between steps
    assert runs["graphed"][2]["graph_steps"] >= 5, runs["graphed"][2]  # 181 + 8 tokens: at most 2 complete a block
    assert runs["graphed"][0] == runs["plain"][0]
    for got, want in zip(runs["graphed"][1], runs["plain"][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_decode_step_on_cpu_by_default_and_under_the_exact_policy_runs_eagerly():
    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=4)
    ids = torch.randint(0, 512, (99,)).tolist()
    for settings in (sparse_settings(), tiny_config(BLOCK_TOKENS, 1, 64, num_layers=2, kv_heads=2, head_dim=16)):
        runtime = runtime_for_model(model, load_config(settings, env={}), model_id="graph-eager")
        try:
            tokens, _, _ = stepped_greedy(model, runtime, ids, 5, capture=None)
            expected, _ = tiered_greedy(model, runtime, ids, 5, 64)
            assert tokens == expected
            assert runtime.stats()["decode_graph"] == {"graph_steps": 0, "replays": 0, "eager_steps": 5,
                                                       "captures": 0, "capture_errors": 0, "capture_s": 0.0}
        finally:
            runtime.close()


def test_no_gc_turns_the_collector_off_for_a_capture_and_back_on_after_an_error():
    import gc

    from tierkv.sparse.graph_capture import no_gc

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"):
        with no_gc():
            assert not gc.isenabled()
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
