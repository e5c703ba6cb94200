"""`benchmarks/bench_sparse.py`'s decoding in turns, on CPU: every run prefills its own cache, then
their decode steps alternate with each run's own attention function (tierkv's for a TieredCache,
sdpa for HF's caches), so all runs decode what they would alone. `logits_gap` compares prefills."""
from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache

from benchmarks.bench_sparse import decode_in_turns, logits_gap
from tests.integrations.hf.test_exact_hf import tiny_config
from tests.models import build
from tierkv.integrations.hf import ATTN_NAME, TieredCache, runtime_for_model
from tierkv.config import load_config


def test_runs_in_turns_decode_what_each_would_alone_with_their_own_attention():
    model, _ = build("llama", num_heads=8, num_kv_heads=2)
    ids = torch.randint(0, 512, (150,)).tolist()
    # exact mode with a budget under the prompt's KV: the tierkv run streams its far blocks
    runtime = runtime_for_model(model, load_config(tiny_config(4, 1, 64, num_layers=2, kv_heads=2, head_dim=16),
                                                   env={}))
    try:
        cache = TieredCache(runtime, ids)
        # the tierkv run's steps through a DecodeStep, as bench_sparse's are (on CPU it runs them eagerly)
        runs = [("dynamic", DynamicCache(config=model.config), 150, None, "sdpa", False),
                ("static", StaticCache(config=model.config, max_cache_len=160), 64, None, "sdpa", False),
                ("tierkv", cache, 64, cache.seq.token_ids.append, ATTN_NAME, True)]
        rows = decode_in_turns(model, runs, ids, 5)
        cache.finish()
        assert runtime.stats()["decode_graph"]["eager_steps"] == 5
    finally:
        runtime.close()
    alone = decode_in_turns(model, [("dynamic", DynamicCache(config=model.config), 150, None, "sdpa", False)], ids, 5)
    assert rows["dynamic"]["tokens"] == rows["static"]["tokens"] == rows["tierkv"]["tokens"] == alone["dynamic"]["tokens"]
    for name in ("static", "tierkv"):
        gap = logits_gap(rows[name]["prefill_logits"], rows["dynamic"]["prefill_logits"])
        assert gap["same_greedy_token"] and gap["relative_l2"] < 1e-5, (name, gap)
    for row in rows.values():
        assert len(row["step_ms"]) == 5 and row["decode_ms_per_token"] > 0
        assert row["allocator"] == {"device_mallocs": 0, "device_frees": 0, "alloc_retries": 0}  # no CUDA here
    shifted = logits_gap(rows["dynamic"]["prefill_logits"] + 1.0, rows["dynamic"]["prefill_logits"])
    assert abs(shifted["max_abs_diff"] - 1.0) < 1e-4 and shifted["same_greedy_token"]
