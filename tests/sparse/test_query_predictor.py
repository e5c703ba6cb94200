"""The `query` sparse predictor and the far-block cache, on CPU through the PyTorch reference.

The prediction of layer L+1 from layer L's input equals layer L+1's selection when the layer
in between adds nothing to the residual stream; planted needles are in the prediction; outputs
equal the `none` and `previous` predictors' (the prediction never changes what attention reads);
the counters add up; the cache keeps blocks across steps and replaces the least recently used.
"""
from __future__ import annotations

import pytest
import torch

from tests.integrations.hf.test_exact_hf import tiered_greedy, tiny_config
from tests.models import build, reference_greedy
from tests.sparse.test_planted_needle import CONTEXT, DIM, HEADS, KV_HEADS, T, planted_case
from tierkv.integrations.hf import runtime_for_model
from tierkv.attention import reference
from tierkv.config import ConfigError, load_config
from tierkv.engine.runtime import KVRuntime
from tierkv.sparse.block_cache import FarBlockCache

BLOCK_TOKENS, HEAD_DIM, NUM_KV_HEADS = 4, 16, 2
BLOCK_BYTES = 2 * NUM_KV_HEADS * BLOCK_TOKENS * HEAD_DIM * 4


def hf_settings(predictor: str, *, num_layers: int, budget_tokens: int = 16, **scheduler) -> dict:
    settings = tiny_config(BLOCK_TOKENS, 1, 64, num_layers=num_layers, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    settings["scheduler"].update(policy="sparse", sparse_token_budget=budget_tokens, predictor=predictor,
                                 staging_bytes=64 * BLOCK_BYTES)
    settings["scheduler"].update(scheduler)
    return settings


def run_greedy(model, predictor: str, ids: list[int], num_new: int, *, num_layers: int, chunk: int = 64, **scheduler):
    """Greedy decode through TieredCache; returns tokens, logits, the sequence, stats before and after."""
    runtime = runtime_for_model(model, load_config(hf_settings(predictor, num_layers=num_layers, **scheduler), env={}),
                                model_id="query-test")
    try:
        before = runtime.stats()
        captured = {}
        original = runtime.new_sequence

        def new_sequence(token_ids=None):
            captured["seq"] = original(token_ids)
            return captured["seq"]

        runtime.new_sequence = new_sequence
        tokens, logits = tiered_greedy(model, runtime, ids, num_new, chunk)
        return tokens, logits, captured["seq"], before, runtime.stats()
    finally:
        runtime.close()


def test_prediction_equals_next_layer_selection_when_the_hidden_state_does_not_change():
    model, _ = build("llama", num_heads=4, num_kv_heads=NUM_KV_HEADS, num_layers=2)
    with torch.no_grad():  # layer 0 adds nothing to the residual: layer 1's input is layer 0's input
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
    ids = torch.randint(0, 512, (300,)).tolist()
    _, _, seq, _, _ = run_greedy(model, "query", ids, 6, num_layers=2, predict_with_previous=False)
    layer1 = seq.predictor.query.layer_totals[1]
    k, num_steps = 16 // BLOCK_TOKENS, 6
    assert len(seq.predictor.query.step_totals) == num_steps
    assert layer1["needed"] == k * num_steps  # far blocks outnumber k: the selection is a real choice
    assert layer1["predicted"] == layer1["used"] == layer1["needed"]  # precision = recall = 1
    assert layer1["hits"] == layer1["needed"] and layer1["misses"] == 0
    assert seq.predictor.query.layer_totals[0]["predicted"] == 0  # nothing precedes layer 0


def test_planted_needles_are_in_the_prediction():
    recalled, planted = 0, 0
    for _ in range(2):
        q, keys, values, needles = planted_case()
        runtime = KVRuntime(load_config({
            "cache": {"block_tokens": T, "gpu_budget_bytes": 2 * 8 * 2 * KV_HEADS * T * DIM * 4, "sink_tokens": T,
                      "window_tokens": 4 * T},
            "tiers": [{"kind": "cpu", "capacity_bytes": 2 * (CONTEXT // T + 16) * 2 * KV_HEADS * T * DIM * 4}],
            "scheduler": {"cpu_far_reads": "staged",
                          "policy": "sparse", "sparse_token_budget": 2048, "lookahead_layers": 1,
                          "staging_bytes": 3 * 32 * 2 * KV_HEADS * T * DIM * 4, "predictor": "query",
                          "predict_with_previous": False},
        }, env={}), num_layers=2, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32, device="cpu",
            model_id="needle-query")
        runtime.query_projector = lambda layer, hidden, position: hidden.view(HEADS, DIM)
        try:
            seq = runtime.new_sequence()
            for start in range(0, CONTEXT, 16384):  # the same KV in both layers: layer 1's needles are layer 0's
                for layer in range(2):
                    seq.append(layer, keys[start : start + 16384], values[start : start + 16384])
            seq.observe_layer_input(0, q[0].flatten(), None)
            seq.append(0, keys[CONTEXT:], values[CONTEXT:])  # predicts layer 1 from layer 0's input
            predicted = seq.predictor.query._predicted[1].nonzero().flatten().tolist()
            seq.attend(0, q, DIM**-0.5)
            seq.append(1, keys[CONTEXT:], values[CONTEXT:])
            out = seq.attend(1, q, DIM**-0.5)
            stats = seq.read_stats()
            layer1 = seq.predictor.query.layer_totals[1]
            seq.finish()
        finally:
            runtime.close()
        recalled += len(set(needles) & set(predicted))
        planted += len(needles)
        assert len(predicted) == 2048 // T
        assert layer1["hits"] == layer1["used"] == 2048 // T and layer1["misses"] == 0
        assert stats["gpu_hit_rate"] is not None
        dense, _ = reference.contiguous_partial_attention(q, keys, values, scale=DIM**-0.5)
        assert ((out - dense).norm() / dense.norm()).item() <= 1e-2
    assert recalled / planted >= 0.99


def test_outputs_equal_the_none_and_previous_predictors():
    model, _ = build("llama", num_heads=4, num_kv_heads=NUM_KV_HEADS, num_layers=3)
    ids = torch.randint(0, 512, (250,)).tolist()
    none_tokens, none_logits, *_ = run_greedy(model, "none", ids, 8, num_layers=3)
    prev_tokens, prev_logits, *_ = run_greedy(model, "previous", ids, 8, num_layers=3)
    for with_previous in (True, False):
        tokens, logits, seq, _, _ = run_greedy(model, "query", ids, 8, num_layers=3, predict_with_previous=with_previous)
        assert tokens == none_tokens == prev_tokens
        assert seq.predictor.query.totals()["misses"] > 0  # the guesses were not all right, yet nothing changed
        for got, want, prev in zip(logits, none_logits, prev_logits):
            assert torch.equal(got, want)  # one staged chunk of the same blocks in both: bit-identical
            torch.testing.assert_close(got, prev, rtol=1e-5, atol=1e-5)  # `previous` splits hits and misses


def test_full_budget_with_the_query_predictor_equals_dense_attention():
    model, reference_model = build("qwen2", num_heads=4, num_kv_heads=NUM_KV_HEADS, num_layers=2)
    ids = torch.randint(0, 512, (60,)).tolist()  # 15 blocks: a 64-token budget covers every far block
    expected, ref_logits = reference_greedy(reference_model, ids, 6)
    tokens, logits, *_ = run_greedy(model, "query", ids, 6, num_layers=2, budget_tokens=64)
    assert tokens == expected
    for got, want in zip(logits, ref_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_counters_add_up():
    model, _ = build("llama", num_heads=4, num_kv_heads=NUM_KV_HEADS, num_layers=3)
    ids = torch.randint(0, 512, (250,)).tolist()
    num_new, k = 8, 16 // BLOCK_TOKENS
    # the prompt in one prefill chunk: nothing old to stream, so every H2D byte is the predictor's
    _, _, seq, before, after = run_greedy(model, "query", ids, num_new, num_layers=3, chunk=len(ids))
    totals = seq.predictor.query.totals()
    assert totals["needed"] == k * 3 * num_new
    assert totals["hits"] + totals["misses"] == totals["needed"]
    assert totals["used"] <= min(totals["predicted"], totals["needed"])
    assert sum(s["needed"] for s in seq.predictor.query.step_totals) == totals["needed"]
    prefetch = after["prefetch"]
    assert prefetch["precision"] == pytest.approx(totals["used"] / totals["predicted"])
    assert prefetch["recall"] == pytest.approx(totals["used"] / totals["needed"])
    assert after["scheduler"]["stalls"] - before["scheduler"]["stalls"] == totals["misses"]
    h2d_bytes = after["transfer"]["h2d_bytes"] - before["transfer"]["h2d_bytes"]
    assert h2d_bytes == (totals["copied"] + totals["misses"]) * BLOCK_BYTES > 0
    reads = seq.read_stats()
    assert reads["streamed_block_reads"] == totals["misses"]


def test_far_block_cache_keeps_blocks_across_steps_and_evicts_the_least_recently_used():
    cache = FarBlockCache(num_layers=1, staging_blocks=4 + 2, blocks_per_step=2, block_bytes=1, device=torch.device("cpu"))
    assert cache.slots_per_layer == 4
    cache.reserve(16)
    everything = torch.arange(16)

    def step(tick, ids):  # one step: look the ids up, mark the hits, admit the rest
        ids = torch.tensor(ids)
        local = cache.lookup(0, ids)
        cache.touch(0, local, tick)
        return torch.where(local >= 0, local, cache.admit(0, ids, local < 0, tick, step_tick=tick))

    assert (step(1, [1, 2]) >= 0).all()
    assert (step(2, [3, 4]) >= 0).all()
    assert (step(3, [2, 5]) >= 0).all()  # 2 is a hit, 5 takes the least recently used slot: block 1's
    cached = {b for b, s in zip(everything.tolist(), cache.lookup(0, everything).tolist()) if s >= 0}
    assert cached == {2, 3, 4, 5}
    slots = cache.lookup(0, torch.tensor([2, 3, 4, 5]))
    assert sorted(slots.tolist()) == [0, 1, 2, 3]  # one slot each
    # within a step, nothing touched since the step began is replaced: 4 slots, 4 touched, no room
    cache.touch(0, slots, 4)
    assert (cache.admit(0, torch.tensor([7]), torch.tensor([True]), 5, step_tick=4) == -1).all()
    cache.invalidate()
    assert (cache.lookup(0, everything) == -1).all()


def test_constant_query_hits_the_cache_from_the_second_step_without_a_projector():
    q, keys, values, _ = planted_case()
    settings = {
        "cache": {"block_tokens": T, "gpu_budget_bytes": 8 * 2 * KV_HEADS * T * DIM * 4, "sink_tokens": T,
                  "window_tokens": 4 * T},
        "tiers": [{"kind": "cpu", "capacity_bytes": (CONTEXT // T + 16) * 2 * KV_HEADS * T * DIM * 4}],
        "scheduler": {"cpu_far_reads": "staged", "policy": "sparse", "sparse_token_budget": 2048, "lookahead_layers": 1,
                      "staging_bytes": 3 * 32 * 2 * KV_HEADS * T * DIM * 4, "predictor": "query",
                      "predict_with_previous": False},
    }
    runtime = KVRuntime(load_config(settings, env={}), num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM,
                        dtype=torch.float32, device="cpu", model_id="cache-query")
    try:
        seq = runtime.new_sequence()
        for start in range(0, CONTEXT, 16384):
            seq.append(0, keys[start : start + 16384], values[start : start + 16384])
        for step in range(3):
            seq.append(0, keys[CONTEXT:] if step == 0 else torch.randn(1, KV_HEADS, DIM),
                       values[CONTEXT:] if step == 0 else torch.randn(1, KV_HEADS, DIM))
            seq.attend(0, q, DIM**-0.5)
        seq.read_stats()
        steps = seq.predictor.query.step_totals
        seq.finish()
    finally:
        runtime.close()
    k = 2048 // T
    assert [s["misses"] for s in steps] == [k, 0, 0]  # kept across steps: no prediction needed
    assert [s["hits"] for s in steps] == [0, k, k]


@pytest.mark.parametrize("scheduler,key,allowed", [
    ({"predictor": "guess"}, "scheduler.predictor", "allowed: previous, none, query"),
    ({"predict_with_previous": "yes"}, "scheduler.predict_with_previous", "expected true or false"),
])
def test_bad_predictor_settings_name_key_value_and_what_is_allowed(scheduler, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": scheduler}, env={})
    assert info.value.key == key and allowed in str(info.value)


def test_query_predictor_refuses_a_staging_too_small_for_its_cache():
    config = load_config(hf_settings("query", num_layers=2, staging_bytes=8 * BLOCK_BYTES), env={})
    with pytest.raises(ConfigError, match="predictor 'query'") as info:
        KVRuntime(config, num_layers=2, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                  device="cpu", model_id="small-staging")
    assert info.value.key == "scheduler.staging_bytes"
