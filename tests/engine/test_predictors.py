"""One predictor policy per sequence (`tierkv.engine.predictors`), chosen once from the config: the
class each `scheduler.predictor` gets, 'previous' falling back to 'none' when staging cannot hold its
blocks, and every predictor giving the same sparse decode output as 'none' (a predictor decides what
is copied early, never what is attended)."""
from __future__ import annotations

import pytest
import torch

from tierkv.config import load_config
from tierkv.engine.predictors import CachePredictor, NoPredictor, PreviousPredictor, QueryPredictor
from tierkv.engine.runtime import KVRuntime

T, KV_HEADS, DIM, LAYERS, BLOCKS = 4, 2, 8, 2, 24
BLOCK_BYTES = 2 * KV_HEADS * T * DIM * 4


def runtime_for(predictor: str, policy: str = "sparse", staging_blocks: int = 64, **scheduler) -> KVRuntime:
    config = load_config({
        "cache": {"block_tokens": T, "gpu_budget_bytes": 6 * LAYERS * BLOCK_BYTES, "sink_tokens": T,
                  "window_tokens": 2 * T},
        "tiers": [{"kind": "cpu", "capacity_bytes": (BLOCKS + 8) * LAYERS * BLOCK_BYTES}],
        "scheduler": {"policy": policy, "sparse_token_budget": 2 * T, "lookahead_layers": 1, "predictor": predictor,
                      "staging_bytes": staging_blocks * BLOCK_BYTES,
                      "cpu_far_reads": "staged",  # the predictors run where far blocks are copied (a GPU's path)
                      **scheduler},
    }, env={})
    return KVRuntime(config, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32,
                     device="cpu", model_id="predictors")


@pytest.mark.parametrize("predictor, policy_class", [
    ("none", NoPredictor), ("previous", PreviousPredictor), ("query", QueryPredictor), ("cache", CachePredictor)])
def test_each_predictor_gets_its_policy_and_exact_gets_none(predictor, policy_class):
    for policy, want in (("sparse", policy_class), ("exact", NoPredictor)):
        runtime = runtime_for(predictor, policy)
        try:
            seq = runtime.new_sequence()
            assert type(seq.predictor) is want
            seq.finish()
        finally:
            runtime.close()


def test_previous_without_staging_for_its_blocks_selects_on_demand():
    runtime = runtime_for("previous", staging_blocks=2)
    try:
        assert type(runtime.new_sequence().predictor) is NoPredictor
    finally:
        runtime.close()


def decode(predictor: str, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
           **scheduler) -> tuple[list, dict]:
    """Prefill keys/values [n, H, D] into every layer, then one decode step per query [steps, H, D]:
    each step's outputs per layer, and the sequence's read stats (scheduler: config keys)."""
    runtime = runtime_for(predictor, **scheduler)
    try:
        seq = runtime.new_sequence()
        outs = []
        for layer in range(LAYERS):
            seq.append(layer, keys, values)
            seq.attend(layer, queries[:1].expand(keys.shape[0], -1, -1).contiguous(), DIM**-0.5)
        for step in range(1, queries.shape[0]):
            q = queries[step : step + 1]
            for layer in range(LAYERS):
                seq.append(layer, q.clone(), q.clone())
                outs.append(seq.attend(layer, q, DIM**-0.5))
        stats = seq.read_stats()
        seq.finish()
        return outs, stats
    finally:
        runtime.close()


def test_every_predictor_attends_what_none_attends():
    torch.manual_seed(0)
    n = BLOCKS * T
    keys, values = torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM)
    queries = torch.randn(6, KV_HEADS, DIM)
    want, want_stats = decode("none", keys, values, queries)
    assert want_stats["streamed_block_reads"] > 0  # far blocks were selected and fetched
    for predictor in ("previous", "query", "cache"):
        got, stats = decode(predictor, keys, values, queries)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        total = stats["resident_block_reads"] + stats["streamed_block_reads"]
        assert total == want_stats["resident_block_reads"] + want_stats["streamed_block_reads"], predictor


def test_the_bound_weight_reaches_every_predictor():
    """scheduler.sparse_bound_weight ranks the far blocks of every predictor: at weight 0 (the midpoint
    key's score) all four attend what 'none' attends, and that differs from weight 1's (Quest's bound)
    selection on these keys, whose blocks hold one large key each beside blocks of steady ones."""
    torch.manual_seed(1)
    n = BLOCKS * T
    keys, values = torch.randn(n, KV_HEADS, DIM) * 0.3, torch.randn(n, KV_HEADS, DIM)
    queries = torch.randn(6, KV_HEADS, DIM)
    keys[T * 5 :: 3 * T] += 4 * torch.randn(1, KV_HEADS, DIM)  # every third block from block 5: one extreme key
    bound, _ = decode("none", keys, values, queries, sparse_bound_weight=1.0)
    want, _ = decode("none", keys, values, queries, sparse_bound_weight=0.0)
    assert any(not torch.allclose(a, b) for a, b in zip(bound, want))
    for predictor in ("previous", "query", "cache"):
        got, _ = decode(predictor, keys, values, queries, sparse_bound_weight=0.0)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_far_blocks_read_in_place_take_no_predictor():
    """A CPU device's default (scheduler.cpu_far_reads: direct) reads far blocks where they lie: no copy
    to hide, so every predictor setting gets the 'none' policy."""
    for predictor in ("previous", "query", "cache"):
        runtime = runtime_for(predictor, cpu_far_reads="direct")
        try:
            seq = runtime.new_sequence()
            assert type(seq.predictor) is NoPredictor and seq.far_in_place is not None
            seq.finish()
        finally:
            runtime.close()
