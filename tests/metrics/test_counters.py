"""The counters add up on scripted workloads: hits + misses = lookups, bytes = blocks moved x block
size, hit rates equal a hand count. First a tier on its own, then a real TieredLLM run."""
from __future__ import annotations

import pytest
import torch

from tests.metrics.workload import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    NEW_TOKENS,
    NUM_LAYERS,
    PROMPT_TOKENS,
    make_llm,
    read_lines,
    run_workload,
)
from tierkv.blocks import BlockLayout
from tierkv.config import CpuTierConfig, DiskTierConfig
from tierkv.metrics.snapshot import flatten_stats
from tierkv.storage import build_tiers

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=4, head_dim=16, dtype=torch.float32)  # 1 KiB blocks


def block(i: int) -> torch.Tensor:
    return torch.full(LAYOUT.shape, float(i))


def test_a_tier_counts_a_scripted_sequence_of_puts_and_gets(tmp_path):
    chain = build_tiers([CpuTierConfig(capacity_bytes=8 * LAYOUT.num_bytes)], LAYOUT)
    cpu = chain.tiers[0]
    try:
        stored = [f"k{i}" for i in range(6)]
        cpu.put_many(stored, [block(i) for i in range(6)])
        script = ["k0", "k1", "x0", "k2", "x1", "k0", "k5", "x2", "x3"]
        got = cpu.get_many(script[:4]) + [cpu.get(k) for k in script[4:]]
        snap = cpu.counters.snapshot()
    finally:
        chain.close()
    hand_hits = sum(k in stored for k in script)  # 5 by hand: k0 k1 k2 k0 k5
    assert hand_hits == 5 and sum(b is not None for b in got) == 5
    assert snap["lookups"] == len(script) == snap["hits"] + snap["misses"]
    assert snap["hits"] == 5 and snap["misses"] == 4
    assert snap["hit_rate"] == pytest.approx(5 / 9)
    assert snap["puts"] == 6 and snap["bytes_written"] == 6 * LAYOUT.num_bytes
    assert snap["bytes_read"] == 5 * LAYOUT.num_bytes
    get_latency = snap["latency"]["get"]
    assert get_latency["count"] > 0 and sum(get_latency["counts"]) == get_latency["count"] and get_latency["sum_s"] > 0


def test_a_chain_spills_and_promotes_and_every_tier_adds_up(tmp_path):
    chain = build_tiers([CpuTierConfig(capacity_bytes=4 * LAYOUT.num_bytes),
                         DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=64 * LAYOUT.num_bytes, trusted=True)], LAYOUT)
    try:
        keys = [f"k{i}" for i in range(10)]
        chain.put_many(keys, [block(i) for i in range(10)])
        chain.flush()
        found = chain.get_many(keys[:6] + ["absent-1", "absent-2"])
        chain.flush()
        stats = {"chain": chain.snapshot()["chain"], "tiers": chain.snapshot()["tiers"]}
    finally:
        chain.close()
    figures, _, _, _ = flatten_stats(stats)
    # by hand: k0..k5 were evicted from the 4-slot CPU tier (k6..k9 stay), so all six come from disk
    assert [b is not None for b in found] == [True] * 6 + [False] * 2
    assert figures["chain.spilled"] >= 6 and figures["chain.dropped"] == 0
    assert figures["tier.cpu.hits"] == 0 and figures["tier.cpu.misses"] == 8
    assert figures["tier.disk.lookups"] == 8 and figures["tier.disk.hits"] == 6
    assert figures["tier.disk.hit_rate"] == pytest.approx(6 / 8)
    assert figures["tier.disk.bytes_read"] == 6 * LAYOUT.num_bytes
    assert figures["chain.promoted"] == 6
    assert figures["tier.disk.bytes_written"] == figures["tier.disk.puts"] * LAYOUT.num_bytes
    assert figures["tier.cpu.bytes_written"] == (10 + 6) * LAYOUT.num_bytes  # puts, then promotions
    for tier in ("cpu", "disk"):
        assert figures[f"tier.{tier}.hits"] + figures[f"tier.{tier}.misses"] == figures[f"tier.{tier}.lookups"]


def expected_gpu_reads(num_prompt: int, num_prefix: int, front: int = 3, window: int = 3, chunk: int = 64) -> tuple[int, int]:
    """Attention block reads (resident, streamed) of one request, counted from the residency rule:
    block b of a layer is on the GPU iff b < front or b >= blocks_after_step - window."""
    T = BLOCK_TOKENS
    steps = [(t0, min(chunk, num_prompt - t0)) for t0 in range(num_prefix, num_prompt, chunk)]
    steps += [(num_prompt + i, 1) for i in range(NEW_TOKENS - 1)]  # the last token is sampled, not fed
    resident = streamed = 0
    for t0, n in steps:
        old_blocks = t0 // T
        window_start = max(front, -(-(t0 + n) // T) - window)
        resident += min(old_blocks, front) + max(0, old_blocks - window_start)
        streamed += max(0, min(old_blocks, window_start) - front)
    return resident * NUM_LAYERS, streamed * NUM_LAYERS


def test_a_real_run_adds_up_and_matches_a_hand_count(tmp_path):
    path = tmp_path / "m.jsonl"
    llm = make_llm(tmp_path, jsonl_path=path)
    with llm:
        outputs = run_workload(llm)
    lines = read_lines(path)
    assert [line["kind"] for line in lines] == ["start", "request", "request", "request", "final"]
    f = lines[-1]["figures"]
    for line in lines:
        for tier in ("cpu", "disk", "gpu"):
            if f"tier.{tier}.lookups" in line["figures"]:
                lf = line["figures"]
                assert lf[f"tier.{tier}.hits"] + lf[f"tier.{tier}.misses"] == lf[f"tier.{tier}.lookups"]

    # GPU hit rate: attention's block reads, counted by hand from the residency rule (6 slots per layer:
    # 1 sink block + 2 far-cache blocks in front, a 3-block window)
    reads = [expected_gpu_reads(PROMPT_TOKENS, 0), expected_gpu_reads(PROMPT_TOKENS, 0),
             expected_gpu_reads(PROMPT_TOKENS, outputs[2].stats["prefix_tokens"])]
    for out, (resident, streamed) in zip(outputs, reads):
        assert (out.stats["resident_block_reads"], out.stats["streamed_block_reads"]) == (resident, streamed)
    hits, misses = sum(r for r, _ in reads), sum(s for _, s in reads)
    assert (f["tier.gpu.hits"], f["tier.gpu.misses"]) == (hits, misses)
    assert f["tier.gpu.hit_rate"] == pytest.approx(hits / (hits + misses))
    for line, (resident, streamed) in zip(lines[1:4], reads):  # each request line: that request's own rate
        assert line["rates"]["tier.gpu.hit_rate_interval"] == pytest.approx(resident / (resident + streamed))

    # bytes = blocks moved x block size
    # every block attention streamed crossed PCIe once; chunks copied ahead for a next decode step
    # that then wanted other blocks (the window moved, or the request ended) crossed it for nothing
    assert f["scheduler.bytes_streamed"] == misses * BLOCK_BYTES + f["scheduler.bytes_discarded"]
    assert f["scheduler.chunks_carried"] > 0
    full_blocks = (PROMPT_TOKENS + NEW_TOKENS - 1) // BLOCK_TOKENS
    prefix_blocks = outputs[2].stats["prefix_tokens"] // BLOCK_TOKENS
    written = NUM_LAYERS * (full_blocks + full_blocks + (full_blocks - prefix_blocks))
    assert f["transfer.d2h_bytes"] == written * BLOCK_BYTES
    installed = NUM_LAYERS * 6  # the reused prefix's resident blocks (3 front + 3 window) gathered at once
    assert f["transfer.h2d_bytes"] == f["scheduler.bytes_streamed"] + installed * BLOCK_BYTES
    assert f["tier.cpu.bytes_written"] == f["transfer.d2h_bytes"] + f["chain.promoted"] * BLOCK_BYTES
    # each distinct block reaches disk once (written through as it lands in the CPU tier, or spilled
    # when evicted first): prompts A and B's blocks; the third request repeats A
    assert f["tier.disk.bytes_written"] == NUM_LAYERS * 2 * full_blocks * BLOCK_BYTES
    assert f["chain.written_through"] <= NUM_LAYERS * 2 * full_blocks
    assert f["tier.disk.bytes_read"] == f["tier.disk.hits"] * BLOCK_BYTES

    # prefix reuse by tier: what the third request reported, in the totals
    by_tier = outputs[2].stats["prefix_blocks_by_tier"]
    assert sum(by_tier.values()) == NUM_LAYERS * prefix_blocks and by_tier.get("disk", 0) > 0
    assert {t: f[f"requests.prefix_blocks.{t}"] for t in by_tier} == by_tier
    assert f["tier.disk.hits"] == by_tier["disk"] and f["tier.cpu.hits"] == by_tier.get("cpu", 0)
    assert f["requests.requests"] == 3 and f["requests.generated_tokens"] == 3 * NEW_TOKENS
    # prefetch quality is not invented: no predictor in exact mode
    assert f["prefetch.precision"] is None and f["prefetch.recall"] is None


def test_the_vllm_hot_windows_sparse_reads_become_the_gpu_tier():
    """Under vLLM no runtime reports tier "gpu": the hot window's sparse decode reads stand in for it
    (hits: window blocks and cache-held far blocks; misses: far blocks fetched when selected), so the
    dashboard's GPU hit rate card and chart show them; its rate per interval follows."""
    from tierkv.metrics.snapshot import derive_rates, flatten_stats, tier_names

    def stats(resident, selected, cache_hits):
        return {"counts": {"blocks_saved": 3},
                "hot_window": {"sparse_resident_reads": resident, "sparse_selected_reads": selected,
                               "cache_hits": cache_hits, "gpu_hit_rate": (resident + cache_hits) / (resident + selected)}}

    first, *_ = flatten_stats(stats(30, 40, 36))
    assert (first["tier.gpu.lookups"], first["tier.gpu.hits"], first["tier.gpu.misses"]) == (70, 66, 4)
    assert first["tier.gpu.hit_rate"] == first["hot_window.gpu_hit_rate"] == 66 / 70
    assert tier_names(first)[0] == "gpu"
    later, *_ = flatten_stats(stats(60, 80, 56))
    rates = derive_rates({"t": 0.0, "figures": first}, later, {}, 1.0)
    assert rates["tier.gpu.hit_rate_interval"] == (30 + 20) / 70  # 30 more resident reads and 20 more cache hits of 70
    # exact mode (no sparse reads) and a runtime's own gpu tier are left as they are
    assert not any(k.startswith("tier.gpu") for k in flatten_stats({"hot_window": {"sparse_resident_reads": 0}})[0])
    own, *_ = flatten_stats({"tiers": [{"tier": "gpu", "hits": 1, "lookups": 2, "hit_rate": 0.5}],
                             "hot_window": {"sparse_resident_reads": 9, "sparse_selected_reads": 9, "cache_hits": 0}})
    assert own["tier.gpu.hit_rate"] == 0.5 and own["tier.gpu.lookups"] == 2


def test_the_vllm_hot_windows_stalls_and_next_step_prefetch_reach_the_dashboard():
    """Under vLLM the dashboard's stall chart and prefetch precision / recall cards read the hot
    window's stalls and the full decode graph's next-step prefetch; a runtime's own figures win, and
    without the prefetch they stay None (not invented)."""
    from tierkv.metrics.snapshot import derive_rates, flatten_stats

    def stats(stalls, precision=None, recall=None):
        full = {"steps": 10} if precision is None else {"prefetch_copied": 50, "prefetch_used": 20,
                                                          "prefetch_precision": precision, "prefetch_recall": recall}
        return {"hot_window": {"stalls": stalls, "prefetch": {"precision": None, "recall": None},
                               "full_decode_graphs": full}}

    first, *_ = flatten_stats(stats(4, 0.4, 0.3))
    assert first["scheduler.stalls"] == 4
    assert (first["prefetch.precision"], first["prefetch.recall"]) == (0.4, 0.3)
    later, *_ = flatten_stats(stats(10, 0.5, 0.25))
    assert derive_rates({"t": 0.0, "figures": first}, later, {}, 1.0)["scheduler.stalls_interval"] == 6
    off, *_ = flatten_stats(stats(4))
    assert off["prefetch.precision"] is None and off["prefetch.recall"] is None and off["scheduler.stalls"] == 4
    own, *_ = flatten_stats({**stats(4, 0.4, 0.3), "scheduler": {"stalls": 1},
                             "prefetch": {"precision": 0.9, "recall": 0.8}})
    assert own["scheduler.stalls"] == 1 and (own["prefetch.precision"], own["prefetch.recall"]) == (0.9, 0.8)
