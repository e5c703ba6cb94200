"""`model.generate(cache=TieredCache(...))` works like transformers' own cache."""
from __future__ import annotations

import torch

from tests.models import build
from tierkv.integrations.hf import TieredCache, restore_attention, runtime_for_model
from tierkv.config import load_config


def test_generate_with_tiered_cache_matches_default_cache():
    model, reference = build("qwen2", num_heads=4, num_kv_heads=2)
    block_bytes = 2 * 2 * 4 * 16 * 4
    config = load_config({
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * block_bytes, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": "16MiB"}],
        "scheduler": {"staging_bytes": 3 * 4 * block_bytes, "cpu_far_reads": "staged"},
    }, env={})
    runtime = runtime_for_model(model, config, model_id="generate-test")
    try:
        ids = torch.randint(0, 512, (1, 150))
        cache = TieredCache(runtime)  # no token ids: blocks get per-sequence keys, no prefix sharing
        ours = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
        cache.finish()
        theirs = reference.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(ours, theirs)
        assert runtime.stats()["scheduler"]["chunks_streamed"] > 0
        assert runtime.cpu.used_bytes == 0, "per-sequence blocks are removed when the sequence finishes"
    finally:
        runtime.close()


def test_plain_generate_after_runtime_for_model_uses_stock_attention_and_restores():
    model, reference = build("llama", num_heads=4, num_kv_heads=2)
    previous = model.config._attn_implementation
    config = load_config({"tiers": [{"kind": "cpu", "capacity_bytes": "16MiB"}]}, env={})
    runtime = runtime_for_model(model, config, model_id="fallback-test")
    try:
        ids = torch.randint(0, 512, (1, 40))
        theirs = reference.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), theirs)
        # a left-padded batch of two through the fallback: each row as transformers computes it
        batch = torch.randint(0, 512, (2, 24))
        mask = torch.ones_like(batch)
        mask[1, :5] = 0
        ours = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(ours, reference.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False))
        # the newer keyword: cache= (transformers deprecates past_key_values)
        cache = TieredCache(runtime)
        assert torch.equal(model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False), theirs)
        cache.finish()
        restore_attention(model)
        assert model.config._attn_implementation == previous
    finally:
        runtime.close()
