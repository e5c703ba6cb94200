"""Two tiers of one kind (disk tiers on two paths, Redis tiers in two namespaces) keep apart: the second is named
"<kind>_2" where the chain is built, so figures, latency, Prometheus labels, `top`, log lines and a request's
`prefix_blocks_by_tier` tell them apart; a kind met once keeps its name."""
from __future__ import annotations

import torch

from tierkv.blocks import BlockLayout
from tierkv.config import load_config
from tierkv.metrics.prometheus import TierKVCollector, new_registry
from tierkv.metrics.snapshot import flatten_stats, tier_names
from tierkv.storage import build_tiers

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=4, head_dim=8, dtype=torch.float32)


def _two_disks_stats(tmp_path) -> dict:
    """stats() of a real chain cpu, disk, disk: one block put into each disk tier, read back from the second twice."""
    disk = {"kind": "disk", "capacity_bytes": "1MiB", "trusted": True}
    config = load_config({"tiers": [{"kind": "cpu", "capacity_bytes": "1MiB"}, {**disk, "path": str(tmp_path / "a")},
                                    {**disk, "path": str(tmp_path / "b")}]}, env={})
    chain = build_tiers(config.tiers, LAYOUT, pin_memory=False)
    try:
        first, second = chain.tiers[1], chain.tiers[2]
        assert (first.name, second.name) == ("disk", "disk_2")  # the second of a kind numbered where it is built
        block = torch.ones(LAYOUT.shape)
        first.put("a", block)
        second.put("b", block)
        second.put("c", block)
        assert second.get("b") is not None and second.get("c") is not None and first.get("b") is None
        return chain.snapshot()
    finally:
        chain.close()


def test_two_disk_tiers_keep_their_own_figures(tmp_path):
    stats = _two_disks_stats(tmp_path)
    figures, latency, _, _ = flatten_stats(stats)
    assert tier_names(figures) == ["cpu", "disk", "disk_2"]
    assert figures["tier.disk.puts"] == 1 and figures["tier.disk.misses"] == 1 and figures["tier.disk.hits"] == 0
    assert figures["tier.disk_2.puts"] == 2 and figures["tier.disk_2.hits"] == 2
    assert {"disk.get", "disk_2.get"} <= set(latency)


def test_prometheus_labels_the_second_disk_tier_apart(tmp_path):
    from prometheus_client import generate_latest

    measured = flatten_stats(_two_disks_stats(tmp_path))
    text = generate_latest(new_registry(TierKVCollector(lambda: (*measured[:3], None)))).decode()
    puts = sorted(row for row in text.splitlines() if row.startswith("tierkv_tier_puts_total"))
    assert puts == ['tierkv_tier_puts_total{tier="cpu"} 0.0', 'tierkv_tier_puts_total{tier="disk"} 1.0',
                    'tierkv_tier_puts_total{tier="disk_2"} 2.0']


def test_names_met_once_are_kept_and_repeats_are_numbered():
    from tierkv.metrics.snapshot import distinct_tier_names

    assert distinct_tier_names(["cpu", "disk", "redis"]) == ["cpu", "disk", "redis"]
    assert distinct_tier_names(["cpu", "disk", "redis", "disk", "redis", "disk"]) == [
        "cpu", "disk", "redis", "disk_2", "redis_2", "disk_3"]
    # tensor parallel: each rank's tiers carry "@rank<i>" (tierkv.integrations.vllm.store_registry)
    assert distinct_tier_names(["cpu@rank0", "disk@rank0", "disk@rank0", "cpu@rank1", "disk@rank1", "disk@rank1"]) == [
        "cpu@rank0", "disk@rank0", "disk_2@rank0", "cpu@rank1", "disk@rank1", "disk_2@rank1"]
    assert distinct_tier_names(["disk", "disk", "disk_2"]) == ["disk", "disk_2", "disk_2_2"]


def test_a_request_names_the_second_disk_tier_its_prefix_came_from(tmp_path):
    """The engine's prefix read names the tier each block came from: with the CPU tier and the first disk tier
    too small for the prompt, blocks found in the second disk tier are counted under "disk_2", not "disk"."""
    from tests.models import build
    from tierkv.llm import TieredLLM
    from tierkv.sampling import SamplingParams

    model, _ = build("llama", num_heads=4, num_kv_heads=2)
    block_bytes = 2 * 2 * 4 * 16 * 4  # K+V, 2 kv heads, 4 tokens, head_dim 16, fp32
    disk = {"kind": "disk", "trusted": True, "write_through": True}
    config = load_config({
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 12 * block_bytes, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": 2 * 35 * block_bytes},
                  {**disk, "path": str(tmp_path / "a"), "capacity_bytes": 2 * 8 * block_bytes},
                  {**disk, "path": str(tmp_path / "b"), "capacity_bytes": 2 * 400 * block_bytes}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * block_bytes, "prefill_chunk_tokens": 64},
    }, env={})
    prompt = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    with TieredLLM(model, config, show_progress=False) as llm:
        assert [tier.name for tier in llm.runtime.chain.tiers] == ["cpu", "disk", "disk_2"]
        llm.generate([prompt], SamplingParams(max_new_tokens=2))
        llm.generate([list(range(1, 121))], SamplingParams(max_new_tokens=2))  # pushes the first out of the CPU tier
        (again,) = llm.generate([prompt], SamplingParams(max_new_tokens=2))
    by_tier = again.stats["prefix_blocks_by_tier"]
    assert by_tier.get("disk_2", 0) > 0, by_tier
    assert set(by_tier) <= {"cpu", "disk", "disk_2"}
