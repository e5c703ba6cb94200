"""Two tiers of one kind (disk tiers on two paths, Redis tiers in two namespaces) keep apart in the metrics: the
second is "<kind>_2" in figures, latency, Prometheus labels and `top`; a kind met once keeps its name."""
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
        assert first.name == second.name == "disk"  # what the tiers are called: after their kind
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
