"""Predictor `cache` in the transformers engine (`tierkv.sparse.predict_cache`): the vLLM backend's far-block
caches and sparse step for one sequence. Its outputs equal predictor `none`'s (the same selection,
exact attention over it), a repeated selection is read from the caches without a copy, a step that
streams through the staging memory empties them, a new sequence starts empty, and staging too small
for the caches is a ConfigError naming scheduler.staging_bytes. On CPU the sparse step runs eagerly
(its PyTorch paths); tests/gpu/test_planted_needle_gpu.py runs it on CUDA, graphs included."""
from __future__ import annotations

import pytest
import torch

from tests.integrations.hf.test_exact_hf import tiered_greedy, tiny_config
from tests.models import build, reference_greedy
from tests.sparse.test_planted_needle import CONTEXT, T, planted_case, runtime_with
from tierkv.integrations.hf import runtime_for_model
from tierkv.attention import reference
from tierkv.config import ConfigError, load_config
from tierkv.engine.runtime import KVRuntime


def decode_steps(predictor: str, q, keys, values, steps: int, prefill_between: bool = False, dtype=torch.float32):
    """`steps` decode steps of one sequence over the planted context, each with the query q: per step the
    output, the block reads from the GPU and streamed so far (`read_stats`), the dense output over the
    tokens so far, and (predictor cache) the caches' hits and misses so far."""
    kv_heads, dim, device = keys.shape[1], keys.shape[2], keys.device
    runtime = runtime_with(2048, predictor=predictor, kv_heads=kv_heads, dim=dim, dtype=dtype, device=device)
    keys, values, q = keys.to(dtype).float(), values.to(dtype).float(), q.to(dtype)
    results = []
    try:
        seq = runtime.new_sequence()
        for start in range(0, CONTEXT, 16384):
            seq.append(0, keys[start : start + 16384].to(dtype), values[start : start + 16384].to(dtype))
        for step in range(steps):
            if prefill_between and step == 1:  # a two-token step streams the far blocks through staging
                extra_k, extra_v = (torch.randn(2, kv_heads, dim, device=device).to(dtype) for _ in range(2))
                seq.append(0, extra_k, extra_v)
                seq.attend(0, torch.cat([q, q]), dim**-0.5)
                keys, values = torch.cat([keys, extra_k.float()]), torch.cat([values, extra_v.float()])
            new_k, new_v = (torch.randn(1, kv_heads, dim, device=device).to(dtype) for _ in range(2))
            keys, values = torch.cat([keys, new_k.float()]), torch.cat([values, new_v.float()])
            seq.append(0, new_k, new_v)
            out = seq.attend(0, q, dim**-0.5)
            dense, _ = reference.contiguous_partial_attention(q.float(), keys, values, scale=dim**-0.5)
            stats = seq.read_stats()
            cached = runtime.cached_sparse.stats() if predictor == "cache" else {}
            results.append((out, stats["resident_block_reads"], stats["streamed_block_reads"], dense,
                            (cached.get("cache_hits"), cached.get("cache_misses")), cached.get("cuda_graphs")))
        seq.finish()
        return results
    finally:
        runtime.close()


def test_cached_outputs_equal_none_and_a_repeated_selection_is_not_copied_again():
    q, keys, values, _ = planted_case()
    keys, values = keys[:CONTEXT], values[:CONTEXT]
    none = decode_steps("none", q, keys, values, 3)
    cached = decode_steps("cache", q, keys, values, 3)
    k = 2048 // T
    for (out_none, *_), (out, _, _, dense, *_) in zip(none, cached):
        torch.testing.assert_close(out, out_none, rtol=1e-5, atol=1e-6)
        assert ((out - dense).norm() / dense.norm()).item() <= 1e-2
    # every step selects the same k far blocks: the first copies them, the next two read them in place
    assert [c[4] for c in cached] == [(0, k), (k, k), (2 * k, k)]
    assert cached[2][2] == cached[0][2]  # nothing more streamed
    assert cached[2][1] - cached[0][1] == none[2][1] - none[0][1] + 2 * k  # the hits count as GPU reads
    assert none[2][2] - none[0][2] == 2 * k  # predictor none copies each selection again


def test_a_step_through_staging_empties_the_caches_and_outputs_stay_exact():
    q, keys, values, _ = planted_case()
    keys, values = keys[:CONTEXT], values[:CONTEXT]
    cached = decode_steps("cache", q, keys, values, 2, prefill_between=True)
    none = decode_steps("none", q, keys, values, 2, prefill_between=True)
    for (out, *_), (out_none, *_rest) in zip(cached, none):
        torch.testing.assert_close(out, out_none, rtol=1e-5, atol=1e-6)
    k = 2048 // T
    # after the streamed step the selection is copied again, though it is the same: k more misses
    assert [c[4] for c in cached] == [(0, k), (0, 2 * k)]


@pytest.mark.parametrize("storage", ["auto", "int8"])
def test_greedy_tokens_with_the_cache_equal_none_and_a_full_budget_equals_exact(storage):
    """Over a quantized CPU tier too: the misses' codes and scales are copied, then dequantized into the
    caches, as the vLLM backend's step does."""
    model, reference_model = build("llama", num_heads=8, num_kv_heads=2)
    ids = torch.randint(0, 512, (211,)).tolist()
    outputs = {}
    # 256 tokens cover the 219 of the prompt and its tokens: every far block selected (caches of a selection
    # per layer: 2 x 64 blocks of staging)
    # "cache+margin": caches of two selections and a prefetch margin of 4 blocks
    margin = {"sparse_cache_selections": 2, "sparse_prefetch_margin": 4}
    for name, budget, extra in (("none", 32, {}), ("cache", 32, {}), ("cache+margin", 32, margin), ("cache", 256, {})):
        predictor = name.split("+")[0]
        settings = tiny_config(4, 1, 64, num_layers=2, kv_heads=2, head_dim=16)
        settings["tiers"][0]["storage_dtype"] = storage
        settings["scheduler"].update(policy="sparse", sparse_token_budget=budget, predictor=predictor,
                                     staging_bytes=128 * 2 * 2 * 4 * 16 * 4, **extra)
        runtime = runtime_for_model(model, load_config(settings, env={}), model_id=f"cached-{name}")
        try:
            outputs[name, budget] = tiered_greedy(model, runtime, ids, 8, 64)
            # a second sequence on the same runtime: the caches start empty, the tokens are the same
            assert tiered_greedy(model, runtime, ids, 8, 64)[0] == outputs[name, budget][0]
        finally:
            runtime.close()
    for run in (("cache", 32), ("cache+margin", 32)):
        assert outputs[run][0] == outputs["none", 32][0]
        for got, want in zip(outputs[run][1], outputs["none", 32][1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if storage != "auto":  # the quantized tier's rounding: no comparison with DynamicCache
        return
    expected, ref_logits = reference_greedy(reference_model, ids, 8)
    assert outputs["cache", 256][0] == expected
    for got, want in zip(outputs["cache", 256][1], ref_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_staging_too_small_for_the_caches_is_a_config_error():
    settings = tiny_config(4, 1, 64, num_layers=2, kv_heads=2, head_dim=16)
    settings["scheduler"].update(policy="sparse", sparse_token_budget=64, predictor="cache",
                                 sparse_cache_selections=2, staging_bytes=32 * 2 * 2 * 4 * 16 * 4)
    model, _ = build("llama", num_heads=8, num_kv_heads=2)
    with pytest.raises(ConfigError, match="scheduler.staging_bytes.*predictor 'cache' keeps 2 selection"):
        runtime_for_model(model, load_config(settings, env={}), model_id="cached-small")  # refused at the start


@torch.no_grad()
@torch.no_grad()
def decode_under_budgets(model, runtime, ids: list[int], budgets: list[int], fronts: set, step=None):
    """Greedy tokens and logits of `ids`, a new GPU budget (bytes) set before each decode step; each
    step's first far block (resident front blocks) added to `fronts`. step: a callable token -> logits
    made from the cache (`tierkv.engine.decode_graph.DecodeStep`), else the plain model call."""
    from tierkv.integrations.hf import TieredCache, forward_kwargs

    cache = TieredCache(runtime, ids)
    kwargs = forward_kwargs(model, cache)
    logits = model(torch.tensor([ids]), **kwargs).logits[0, -1]
    decode = step(model, cache) if step is not None else None
    tokens, all_logits = [], [logits]
    for budget in budgets:
        token = int(torch.argmax(logits))
        tokens.append(token)
        runtime.set_gpu_budget(budget)
        cache.seq.token_ids.append(token)
        logits = decode(token) if decode is not None else model(torch.tensor([[token]]), **kwargs).logits[0, -1]
        all_logits.append(logits)
        assert runtime.config.cache.gpu_budget_bytes == budget
        fronts.add(runtime.residency.num_front_blocks)
    cache.finish()
    return tokens, all_logits


def test_gpu_budget_changes_between_steps_restart_the_caches_and_keep_the_output():
    """A new GPU budget between decode steps moves the first far block (more or fewer resident front
    blocks): the caches start over, and tokens and logits stay those of predictor `none` under the same
    budget changes."""
    model, _ = build("llama", num_heads=8, num_kv_heads=2)
    block_bytes = 2 * 2 * 4 * 16 * 4
    ids = torch.randint(0, 512, (181,)).tolist()
    budgets = [40, 5, 12, 5, 30, 6]  # resident slots per layer before each decode step
    runs, fronts = {}, set()
    for predictor in ("none", "cache"):
        settings = {
            "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * block_bytes, "sink_tokens": 4, "window_tokens": 8},
            "tiers": [{"kind": "cpu", "capacity_bytes": "16MiB"}],
            "scheduler": {"cpu_far_reads": "staged",
                          "lookahead_layers": 1, "staging_bytes": 16 * block_bytes, "prefill_chunk_tokens": 64,
                          "policy": "sparse", "sparse_token_budget": 16, "predictor": predictor},
        }
        runtime = runtime_for_model(model, load_config(settings, env={}), model_id=f"elastic-{predictor}")
        try:
            runs[predictor] = decode_under_budgets(model, runtime, ids, [2 * slots * block_bytes for slots in budgets],
                                                   fronts)
        finally:
            runtime.close()
    assert len(fronts) >= 3  # the first far block moved between steps
    assert runs["cache"][0] == runs["none"][0]
    for got, want in zip(runs["cache"][1], runs["none"][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def margin_case(margin: int, device: str = "cpu", sequences: int = 1):
    """Two decode steps of one layer over 64 blocks of 4 tokens, k = 4 far blocks per step, caches of two
    selections, prefetch margin `margin`. Blocks 20-23 (A) have keys 3 e1 - e2, blocks 40-43 (B) 2 e1 + 3 e2,
    the rest small noise: the first query (along e1) selects A and ranks B just below it; the second
    (along e2) selects B and ranks A last. Per step: the output, predictor none's, the caches' hits and
    misses so far (of the last of `sequences` such sequences on one runtime); then the runtime's stats
    and the caches'. On CUDA the graphs capture the prefetch."""
    kv_heads, dim, tokens = 2, 16, 256
    keys = 0.1 * torch.randn(tokens, kv_heads, dim, device=device)
    e1, e2 = torch.eye(dim, device=device)[0], torch.eye(dim, device=device)[1]
    keys[20 * 4 : 24 * 4] = 3 * e1 - e2
    keys[40 * 4 : 44 * 4] = 2 * e1 + 3 * e2
    values = torch.randn(tokens, kv_heads, dim, device=device)
    queries = [4.0 * e1.expand(1, 8, dim).clone(), 4.0 * e2.expand(1, 8, dim).clone()]
    decode_kv = [(torch.randn(1, kv_heads, dim, device=device), torch.randn(1, kv_heads, dim, device=device))
                 for _ in queries]
    block_bytes = 2 * kv_heads * 4 * dim * 4
    runs = {}
    for predictor in ("none", "cache"):
        config = load_config({
            "cache": {"block_tokens": 4, "gpu_budget_bytes": 8 * block_bytes, "sink_tokens": 4, "window_tokens": 16},
            "tiers": [{"kind": "cpu", "capacity_bytes": 80 * block_bytes}],
            "scheduler": {"cpu_far_reads": "staged",
                          "policy": "sparse", "sparse_token_budget": 16, "lookahead_layers": 1,
                          "predictor": predictor,
                          "staging_bytes": 8 * block_bytes,
                          **({"sparse_cache_selections": 2, "sparse_prefetch_margin": margin}
                             if predictor == "cache" else {})},
        }, env={})
        runtime = KVRuntime(config, num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32,
                            device=device, model_id=f"margin-{predictor}")
        try:
            for _ in range(sequences):
                seq = runtime.new_sequence()
                seq.append(0, keys, values)
                steps = []
                for q, (k_new, v_new) in zip(queries, decode_kv):
                    seq.append(0, k_new, v_new)
                    out = seq.attend(0, q, dim**-0.5)
                    counts = runtime.cached_sparse.caches.counters[:2].tolist() if predictor == "cache" else None
                    steps.append((out, counts))
                seq.finish()
            runs[predictor] = steps, runtime.stats(), (runtime.cached_sparse.stats() if predictor == "cache" else None)
        finally:
            runtime.close()
    for (out, _), (out_none, _) in zip(runs["cache"][0], runs["none"][0]):
        torch.testing.assert_close(out, out_none, rtol=1e-4, atol=1e-5)  # the prediction never changes the output
    return runs["cache"]


def test_a_prefetch_margin_brings_the_next_selection_and_counts_precision_and_recall():
    """With a margin of 4 the first step copies in B beside its selection A; the second step selects B and
    finds it on the GPU (4 hits, no miss, no stall). Without the margin the second step misses all 4."""
    steps, stats, cached = margin_case(4)
    assert [counts for _, counts in steps] == [[0, 4], [4, 4]]
    prefetch = cached["prefetch"]
    # step 1 copies B (4), step 2 the four noise blocks ranked below B (A is ranked last); B was used
    assert (prefetch["prefetch_copied"], prefetch["prefetch_used"]) == (8, 4)
    assert stats["prefetch"]["precision"] == 4 / 8 and stats["prefetch"]["recall"] == 4 / (4 + 4)
    assert stats["scheduler"]["stalls"] == 1  # only the first step's layer waited for copies
    block_bytes = 2 * 2 * 4 * 16 * 4
    # what crossed PCIe into the caches: step 1's 4 misses and the margin's 8 blocks, in the engine's count too
    assert stats["scheduler"]["far_cache_copied_bytes"] == 12 * block_bytes
    assert stats["transfer"]["h2d_bytes"] >= 12 * block_bytes
    steps, stats, cached = margin_case(0)
    assert [counts for _, counts in steps] == [[0, 4], [0, 8]]
    assert cached["prefetch"] is None and stats["prefetch"]["precision"] is None
    assert stats["scheduler"]["stalls"] == 2
    assert stats["scheduler"]["far_cache_copied_bytes"] == 8 * block_bytes


def test_the_runtime_stats_count_every_sequence_and_the_cache_stats_the_last():
    """Three sequences on one runtime: each starts with empty caches (the same counts as the first), while
    the runtime's stalls and prefetch counts are the totals of all three."""
    steps, stats, cached = margin_case(4, sequences=3)
    assert [counts for _, counts in steps] == [[0, 4], [4, 4]]
    assert (cached["prefetch"]["prefetch_copied"], cached["prefetch"]["prefetch_used"]) == (8, 4)
    assert stats["scheduler"]["stalls"] == 3
    assert (stats["prefetch"]["prefetched_blocks"], stats["prefetch"]["used_blocks"]) == (24, 12)
    assert stats["prefetch"]["precision"] == 12 / 24 and stats["prefetch"]["recall"] == 12 / (12 + 12)
    assert stats["scheduler"]["far_cache_copied_bytes"] == 3 * 12 * (2 * 2 * 4 * 16 * 4)


def test_a_prefetch_margin_that_does_not_fit_the_caches_is_a_config_error():
    """k = 4 blocks and two selections hold 8 slots per layer: a margin of 5 would replace blocks the step
    reads (refused when the runtime starts); a margin with predictor none has nothing to fill."""
    settings = tiny_config(4, 1, 64, num_layers=2, kv_heads=2, head_dim=16)
    settings["scheduler"].update(policy="sparse", sparse_token_budget=16, predictor="cache", sparse_cache_selections=2,
                                 sparse_prefetch_margin=5, staging_bytes=64 * 2 * 2 * 4 * 16 * 4)
    model, _ = build("llama", num_heads=8, num_kv_heads=2)
    with pytest.raises(ConfigError, match="sparse_prefetch_margin.*raise scheduler.sparse_cache_selections to 3"):
        runtime_for_model(model, load_config(settings, env={}), model_id="margin-too-wide")
    settings["scheduler"].update(predictor="none", sparse_prefetch_margin=2)
    with pytest.raises(ConfigError, match="sparse_prefetch_margin.*predictor 'cache'"):
        load_config(settings, env={})
