"""In-place far reads on a CPU device (`tierkv.attention.cpu_far`): the same outputs as the staged path
(`scheduler.cpu_far_reads: staged`, the path a CUDA device takes) and as a float64 dense reference.

Unit level: `InPlaceFarReads.attend` over random blocks of a slab (ranges and selections, any order,
none at all), with fresh tokens of any count (partial blocks), GQA groupings, float32 / bfloat16 and
an int8 tier, against the float64 attention of the same keys; one object reused over calls of
growing and shrinking size (its buffer is reused).

Sequence level: `SequenceKV` layer by layer with random K, V and queries, prompts of many lengths
(shorter than the front region: no far block; partial last blocks; several prefill chunks) then
decode steps across block boundaries, policies exact and sparse, plain and int8 CPU tiers: the
direct runtime's output (out) and the staged runtime's are compared with each other and with the
dense reference, and the direct runtime's LSE-bearing parts are exercised through the merge.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tierkv.attention import contiguous_partial_attention, merge_partials, paged_partial_attention, reference
from tierkv.attention.cpu_far import InPlaceFarReads, reads_in_place
from tierkv.blocks import BlockLayout
from tierkv.config import ConfigError, load_config
from tierkv.engine.runtime import KVRuntime
from tierkv.storage.cpu import CpuTier

LAYERS = 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def dense64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]; k, v [m, Hkv, D], every key visible -> float64 (out [n, H, D], lse [n, H])."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    logits = torch.einsum("nhd,mhd->nhm", q.double(), k) * scale
    return torch.einsum("nhm,mhd->nhd", torch.softmax(logits, -1), v), torch.logsumexp(logits, -1)


# -- unit: InPlaceFarReads.attend -----------------------------------------------------------------
def filled_tier(layout: BlockLayout, num_slots: int, quant_format: str | None, gen: torch.Generator) -> CpuTier:
    tier = CpuTier("cpu", layout, num_slots * layout.num_bytes, pin_memory=False, quant_format=quant_format)
    blocks = torch.randn(tier.num_slots, *layout.shape, generator=gen).to(layout.dtype)
    tier.write_slots(range(tier.num_slots), blocks)
    return tier


def expected_keys(tier: CpuTier, slots: list[int], fresh: torch.Tensor | None):
    """The keys and values the call must attend, token-major [m, Hkv, D], from the tier's own read."""
    parts_k, parts_v = [], []
    if slots:
        blocks = tier.read_slots(slots)  # [nb, 2, Hkv, T, D], dequantized where quantized
        parts_k.append(blocks[:, 0].permute(0, 2, 1, 3).flatten(0, 1))
        parts_v.append(blocks[:, 1].permute(0, 2, 1, 3).flatten(0, 1))
    if fresh is not None:
        parts_k.append(fresh[0])
        parts_v.append(fresh[1])
    return torch.cat(parts_k), torch.cat(parts_v)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(num_kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3]), block_tokens=st.integers(1, 8),
       head_dim=st.sampled_from([4, 8, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       quant=st.sampled_from([None, "int8"]), num_q=st.integers(1, 3), data=st.data())
def test_one_call_equals_the_dense_attention_of_the_same_keys(num_kv_heads, group, block_tokens, head_dim, dtype,
                                                             quant, num_q, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    layout = BlockLayout(num_kv_heads, block_tokens, head_dim, dtype)
    tier = filled_tier(layout, 12, quant, gen)
    num_blocks_written = data.draw(st.integers(0, 10), label="blocks written")
    layer_slots = torch.randperm(tier.num_slots, generator=gen)[:num_blocks_written]  # any slot order
    if data.draw(st.booleans(), label="a range") or num_blocks_written == 0:
        start = data.draw(st.integers(0, num_blocks_written), label="start")
        blocks = range(start, data.draw(st.integers(start, num_blocks_written), label="stop"))
        chosen = list(blocks)
    else:
        chosen = data.draw(st.lists(st.integers(0, num_blocks_written - 1), unique=True, max_size=num_blocks_written),
                           label="selection")
        blocks = torch.tensor(chosen, dtype=torch.int64)
    num_fresh = data.draw(st.integers(0, 2 * block_tokens), label="fresh tokens")
    fresh = (torch.randn(2, num_fresh, num_kv_heads, head_dim, generator=gen).to(dtype) if num_fresh else None)
    q = torch.randn(num_q, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    got = InPlaceFarReads(tier).attend(q, layer_slots, blocks, scale=scale, fresh=fresh)
    if not chosen and fresh is None:
        assert got is None
        return
    k, v = expected_keys(tier, layer_slots[chosen].tolist() if chosen else [], fresh)
    want_out, want_lse = dense64(q, k, v, scale)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], want_out.float(), **tol)
    torch.testing.assert_close(got[1], want_lse.float(), **tol)
    region = data.draw(st.integers(1, 4), label="staging region blocks")
    staged = staged_parts(tier, layer_slots[chosen] if chosen else torch.empty(0, dtype=torch.int64), region, q,
                          fresh, scale)
    torch.testing.assert_close(got[0], staged[0], **tol)  # the staged path's (out, lse): chunks merged
    torch.testing.assert_close(got[1], staged[1], **tol)


def staged_parts(tier: CpuTier, slots: torch.Tensor, region_blocks: int, q: torch.Tensor, fresh, scale: float):
    """The staged path's computation of the same part: the blocks copied into a staging ring a region at
    a time (dequantized as BlockIO does), each region one paged partial attention, all merged; the
    fresh tokens one more part."""
    T = tier.layout.block_tokens
    parts = []
    for start in range(0, slots.numel(), region_blocks):
        chunk = slots[start : start + region_blocks]
        staging = tier.read_slots(chunk.tolist())  # [n, 2, Hkv, T, D], the KV dtype
        n = chunk.numel()
        parts.append(paged_partial_attention(q, staging, torch.arange(n), torch.arange(start, start + n) * T,
                                             torch.full((n,), T), scale=scale))
    if fresh is not None:
        parts.append(contiguous_partial_attention(q, fresh[0], fresh[1], scale=scale))
    return parts[0] if len(parts) == 1 else merge_partials(parts)


def test_one_object_reused_over_growing_and_shrinking_calls():
    """The key buffer is reused and grown: each call sees only its own keys."""
    gen = torch.Generator().manual_seed(3)
    layout = BlockLayout(2, 4, 8, torch.float32)
    tier = filled_tier(layout, 40, None, gen)
    reads = InPlaceFarReads(tier)
    layer_slots = torch.randperm(40, generator=gen)
    for num_blocks, num_fresh in [(3, 1), (20, 4), (1, 0), (0, 3), (37, 2), (5, 5)]:
        q = torch.randn(1, 4, 8, generator=gen)
        fresh = torch.randn(2, num_fresh, 2, 8, generator=gen) if num_fresh else None
        out, lse = reads.attend(q, layer_slots, range(num_blocks), scale=0.3, fresh=fresh)
        k, v = expected_keys(tier, layer_slots[:num_blocks].tolist(), fresh)
        want_out, want_lse = dense64(q, k, v, 0.3)
        torch.testing.assert_close(out, want_out.float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse, want_lse.float(), rtol=1e-4, atol=1e-5)
    assert reads.num_blocks_read == 3 + 20 + 1 + 37 + 5


def test_a_range_past_the_written_blocks_is_refused_an_empty_one_is_not():
    tier = filled_tier(BlockLayout(1, 2, 4, torch.float32), 4, None, torch.Generator().manual_seed(0))
    with pytest.raises(IndexError, match="only 2 blocks"):
        InPlaceFarReads(tier).attend(torch.randn(1, 1, 4), torch.tensor([0, 1]), range(1, 3), scale=1.0)
    # an empty far set may start past the written blocks (a sequence shorter than the front region)
    assert InPlaceFarReads(tier).attend(torch.randn(1, 1, 4), torch.tensor([0, 1]), range(3, 3), scale=1.0) is None


def test_reads_in_place_only_on_a_cpu_device_and_only_when_direct():
    assert reads_in_place("direct", "cpu") and reads_in_place("direct", torch.device("cpu"))
    assert not reads_in_place("staged", "cpu")
    assert not reads_in_place("direct", "cuda") and not reads_in_place("direct", "cuda:1")


def test_the_config_key_names_its_choices():
    assert load_config({}, env={}).scheduler.cpu_far_reads == "direct"
    with pytest.raises(ConfigError, match="cpu_far_reads"):
        load_config({"scheduler": {"cpu_far_reads": "inplace"}}, env={})


# -- sequence level: direct against staged against dense --------------------------------------------
def runtime(far_reads: str, *, policy: str, predictor: str, heads: tuple[int, int], block_tokens: int,
            storage_dtype: str, budget_blocks: int) -> KVRuntime:
    num_kv_heads, head_dim = heads[1], 8
    T = block_tokens
    block_bytes = 2 * num_kv_heads * T * head_dim * 4
    sink, window = T, 2 * T  # front: 1 sink block + 1 far-cache block; window: 3 blocks
    config = load_config({
        "cache": {"block_tokens": T, "gpu_budget_bytes": 5 * LAYERS * block_bytes, "sink_tokens": sink,
                  "window_tokens": window},
        "tiers": [{"kind": "cpu", "capacity_bytes": 512 * block_bytes, "storage_dtype": storage_dtype}],
        "scheduler": {"policy": policy, "predictor": predictor, "lookahead_layers": 1,
                      "sparse_token_budget": budget_blocks * T, "staging_bytes": 3 * 3 * block_bytes,
                      "prefill_chunk_tokens": 64, "cpu_far_reads": far_reads},
    }, env={})
    return KVRuntime(config, num_layers=LAYERS, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.float32,
                     device="cpu", model_id="cpu-far")


def run_steps(rt: KVRuntime, keys, values, queries, steps) -> list[torch.Tensor]:
    """Every layer's output of every step ([n, H, D] each), appending keys/values [L, t, Hkv, D]."""
    outs = []
    seq = rt.new_sequence()
    try:
        for start, stop in steps:
            for layer in range(LAYERS):
                seq.append(layer, keys[layer, start:stop], values[layer, start:stop])
                outs.append(seq.attend(layer, queries[layer, start:stop], 8**-0.5))
    finally:
        seq.finish()
    return outs


CASES = st.fixed_dictionaries({
    "policy_predictor": st.sampled_from([("exact", "previous"), ("sparse", "none"), ("sparse", "previous")]),
    "heads": st.sampled_from([(2, 2), (4, 2), (6, 2), (3, 1), (4, 1)]),
    "block_tokens": st.sampled_from([1, 2, 4]),
    "storage_dtype": st.sampled_from(["auto", "auto", "int8"]),
    "budget_blocks": st.integers(1, 3),
    "prompt": st.integers(1, 40),
    "decode": st.integers(1, 12),
    "chunk": st.integers(3, 64),
    "seed": st.integers(0, 2**16),
})


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES)
def test_direct_equals_staged_and_the_dense_reference(case):
    policy, predictor = case["policy_predictor"]
    num_heads, num_kv_heads = case["heads"]
    T, prompt, chunk = case["block_tokens"], case["prompt"], case["chunk"]
    total = prompt + case["decode"]
    gen = torch.Generator().manual_seed(case["seed"])
    keys, values = (torch.randn(LAYERS, total, num_kv_heads, 8, generator=gen) for _ in range(2))
    queries = torch.randn(LAYERS, total, num_heads, 8, generator=gen)
    steps = [(s, min(s + chunk, prompt)) for s in range(0, prompt, chunk)] + [(t, t + 1) for t in range(prompt, total)]
    kwargs = dict(policy=policy, predictor=predictor, heads=case["heads"], block_tokens=T,
                  storage_dtype=case["storage_dtype"], budget_blocks=case["budget_blocks"])
    results = {}
    for far_reads in ("direct", "staged"):
        rt = runtime(far_reads, **kwargs)
        try:
            results[far_reads] = run_steps(rt, keys, values, queries, steps)
            sched = rt.stats()["scheduler"]
            has_far = total - 1 > 5 * T  # a step reads a block past the front and before the window
            if far_reads == "direct":
                assert sched["chunks_streamed"] == 0, "the direct path must not stage far blocks"
            elif has_far and policy == "exact" and len(steps) > 1:
                assert sched["chunks_streamed"] > 0, "the staged path must stream far blocks"
        finally:
            rt.close()
    for i, (direct, staged) in enumerate(zip(results["direct"], results["staged"])):
        # same keys, same selection (sparse: the same top-k bound), another summation order
        torch.testing.assert_close(direct, staged, rtol=1e-4, atol=1e-5, msg=lambda m: f"{case} output {i}: {m}")
    if policy == "exact" and case["storage_dtype"] == "auto":  # exact, plain tier: dense causal attention
        i = 0
        for start, stop in steps:
            for layer in range(LAYERS):
                for t in range(start, stop):
                    want, _ = dense64(queries[layer, t : t + 1], keys[layer, : t + 1], values[layer, : t + 1], 8**-0.5)
                    torch.testing.assert_close(results["direct"][i][t - start], want[0].float(), rtol=1e-4, atol=1e-5)
                i += 1


def test_direct_decode_reads_far_blocks_in_place_and_counts_them():
    """A long decode with a far set: nothing goes through staging, the slab reads are counted, and the
    hit-rate statistics count the far blocks as streamed (read outside the hot window) as before."""
    rt = runtime("direct", policy="exact", predictor="previous", heads=(4, 2), block_tokens=2,
                 storage_dtype="auto", budget_blocks=1)
    try:
        gen = torch.Generator().manual_seed(0)
        keys, values = (torch.randn(LAYERS, 40, 2, 8, generator=gen) for _ in range(2))
        queries = torch.randn(LAYERS, 40, 4, 8, generator=gen)
        seq = rt.new_sequence()
        for start, stop in [(0, 30)] + [(t, t + 1) for t in range(30, 40)]:
            for layer in range(LAYERS):
                seq.append(layer, keys[layer, start:stop], values[layer, start:stop])
                seq.attend(layer, queries[layer, start:stop], 8**-0.5)
        stats = seq.read_stats()
        assert seq.far_in_place is not None and seq.far_in_place.num_blocks_read > 0
        assert stats["streamed_block_reads"] > 0
        assert rt.stats()["scheduler"]["chunks_streamed"] == 0
        seq.finish()
    finally:
        rt.close()


def test_the_runtime_counts_blocks_read_in_place_in_its_stats():
    """stats()["scheduler"] says how far blocks are read and counts the in-place reads over every sequence;
    a staged runtime says staged and counts none."""
    def runtime(far_reads: str) -> KVRuntime:
        config = load_config({
            "cache": {"block_tokens": 4, "gpu_budget_bytes": 6 * LAYERS * 2 * 2 * 4 * 8 * 4, "sink_tokens": 4,
                      "window_tokens": 8},
            "tiers": [{"kind": "cpu", "capacity_bytes": 64 * LAYERS * 2 * 2 * 4 * 8 * 4}],
            "scheduler": {"cpu_far_reads": far_reads},
        }, env={})
        return KVRuntime(config, num_layers=LAYERS, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu",
                         model_id="stats-in-place")

    for far_reads, want in (("direct", "in_place"), ("staged", "staged")):
        rt = runtime(far_reads)
        try:
            reads = []
            for _ in range(2):
                seq = rt.new_sequence()
                k = torch.randn(40, 2, 8)
                for layer in range(LAYERS):
                    seq.append(layer, k, k)
                    seq.attend(layer, torch.randn(40, 4, 8), 0.3)
                for layer in range(LAYERS):  # one decode step: 10 old full blocks per layer
                    seq.append(layer, k[:1], k[:1])
                    seq.attend(layer, torch.randn(1, 4, 8), 0.3)
                seq.finish()
                stats = rt.stats()["scheduler"]
                reads.append(stats["blocks_read_in_place"])
            assert stats["far_reads"] == want
            if want == "in_place":
                assert reads[0] > 0 and reads[1] > reads[0]  # every sequence's reads, added up
            else:
                assert reads == [0, 0] and stats["chunks_streamed"] > 0
        finally:
            rt.close()
