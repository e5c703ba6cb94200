"""Exact mode through the transformers adapter equals transformers' DynamicCache.

Small random-weight Llama, Qwen2 and Mistral models; GPU budgets 8x to 64x below the
context's KV; block sizes, lookahead depths, GQA ratios and prompt lengths that are not a
multiple of the block size vary. Fresh random prompts each run.
"""
from __future__ import annotations

import pytest
import torch

from tests.models import build, reference_greedy
from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model
from tierkv.config import load_config

CASES = [
    # arch, heads, kv heads, block tokens, lookahead, prompt tokens, prefill chunk
    ("llama", 8, 2, 4, 1, 257, 64),
    ("qwen2", 4, 4, 16, 2, 700, 256),
    ("mistral", 8, 1, 8, 3, 523, 100),
    ("llama", 4, 2, 1, 2, 131, 50),
]


def tiny_config(block_tokens: int, lookahead: int, chunk: int, *, num_layers: int, kv_heads: int, head_dim: int,
                far_reads: str = "staged") -> dict:
    """far_reads: scheduler.cpu_far_reads; "staged" (the staging ring a GPU uses) unless a test asks for the
    CPU device's default, "direct"."""
    block_bytes = 2 * kv_heads * block_tokens * head_dim * 4
    sink, window = block_tokens, 2 * block_tokens
    slots_per_layer = 1 + 3 + 1  # sinks + window (+ partial) + one far-cache block
    return {
        "cache": {"block_tokens": block_tokens, "gpu_budget_bytes": slots_per_layer * num_layers * block_bytes,
                  "sink_tokens": sink, "window_tokens": window},
        "tiers": [{"kind": "cpu", "capacity_bytes": "64MiB"}],
        "scheduler": {"lookahead_layers": lookahead, "staging_bytes": (lookahead + 1) * 3 * block_bytes,
                      "prefill_chunk_tokens": chunk, "cpu_far_reads": far_reads},
    }


@torch.no_grad()
def tiered_greedy(model, runtime, ids: list[int], num_new: int, chunk: int):
    cache = TieredCache(runtime, ids)
    kwargs = forward_kwargs(model, cache)
    logits = None
    for pos in range(0, len(ids), chunk):
        logits = model(torch.tensor([ids[pos : pos + chunk]]), **kwargs).logits[0, -1]
    tokens, all_logits = [], [logits]
    for _ in range(num_new):
        token = int(torch.argmax(logits))
        tokens.append(token)
        cache.seq.token_ids.append(token)
        logits = model(torch.tensor([[token]]), **kwargs).logits[0, -1]
        all_logits.append(logits)
    cache.finish()
    return tokens, all_logits


@pytest.mark.parametrize("far_reads", ["staged", "direct"])
@pytest.mark.parametrize("arch,heads,kv_heads,block_tokens,lookahead,prompt_len,chunk", CASES)
def test_greedy_tokens_and_logits_match_dynamic_cache(arch, heads, kv_heads, block_tokens, lookahead, prompt_len, chunk,
                                                      far_reads):
    model, reference = build(arch, num_heads=heads, num_kv_heads=kv_heads)
    config = load_config(tiny_config(block_tokens, lookahead, chunk, num_layers=2, kv_heads=kv_heads, head_dim=16,
                                     far_reads=far_reads), env={})
    runtime = runtime_for_model(model, config, model_id=f"test-{arch}")
    try:
        budget_tokens = config.cache.gpu_budget_bytes // (runtime.layout.num_bytes // block_tokens * 2)
        assert 8 * budget_tokens <= prompt_len <= 64 * budget_tokens, "the case must be 8x-64x the budget"
        ids = torch.randint(0, 512, (prompt_len,)).tolist()
        ref_tokens, ref_logits = reference_greedy(reference, ids, 10)
        tokens, logits = tiered_greedy(model, runtime, ids, 10, chunk)
        assert tokens == ref_tokens
        for step, (got, want) in enumerate(zip(logits, ref_logits)):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
        stats = runtime.stats()
        if far_reads == "staged":
            assert stats["scheduler"]["chunks_streamed"] > 0, "the far blocks must actually stream"
        else:  # read in place in the CPU tier's slab, nothing staged
            assert stats["scheduler"]["chunks_streamed"] == 0 and runtime.active.far_in_place.num_blocks_read > 0
        assert runtime.pool.resident_bytes <= config.cache.gpu_budget_bytes
    finally:
        runtime.close()
