"""The CPU tier's latency histograms: the runtime reads and writes it through the two-phase slot
API (acquire, prepare_put/complete_put), not get/put, and those calls are timed too, so a real
TieredLLM run gives the dashboard's latency chart a CPU line."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tierkv.storage.cpu_slots as cpu_slots_module
from tests.metrics.workload import read_lines, record_jsonl
from tierkv.blocks import BlockLayout
from tierkv.storage.cpu import CpuTier

LAYOUT = BlockLayout(num_kv_heads=1, block_tokens=4, head_dim=8, dtype=torch.float32)


class Clock:
    """perf_counter() that moves one second per call: a call's time is the number of readings it takes."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(cpu_slots_module, "time", SimpleNamespace(perf_counter=clock))  # that module's clock only
    return clock


def latency(tier: CpuTier, op: str) -> dict:
    return tier.counters.snapshot()["latency"][op]


def block(value: float) -> torch.Tensor:
    return torch.full(LAYOUT.shape, float(value))


def test_two_phase_put_is_the_tiers_own_time_in_prepare_and_complete(clock):
    tier = CpuTier("cpu", LAYOUT, 8 * LAYOUT.num_bytes, pin_memory=False)
    tier.prepare_put(["a", "b"])   # 1 s
    clock.now += 250.0             # the D2H copy and the rest of a step: not the tier's time
    tier.prepare_put(["c"])        # 1 s
    clock.now += 500.0
    tier.complete_put(["a", "b"])  # 1 s
    tier.complete_put(["c"])       # 1 s
    put = latency(tier, "put")
    assert put["count"] == 2 and put["sum_s"] == pytest.approx(4.0)
    tier.acquire(["a", "missing"])  # 1 s
    assert latency(tier, "get")["sum_s"] == pytest.approx(1.0)
    tier.prepare_put(["d"])
    tier.abort_put(["d"])      # never completed: no sample, nothing left behind
    tier.complete_put([])      # an empty batch: no sample
    assert latency(tier, "put")["count"] == 2 and not tier._prepare_s


def test_every_batched_read_and_write_records_one_sample():
    tier = CpuTier("cpu", LAYOUT, 8 * LAYOUT.num_bytes, pin_memory=False)
    tier.put_many(["a", "b"], [block(1), block(2)])
    slots, _ = tier.prepare_put(["c"])
    tier.write_slots(slots, block(3).unsqueeze(0))
    tier.complete_put(["c"])
    assert latency(tier, "put")["count"] == 2
    tier.acquire(["a", "c", "missing"])
    tier.release(["a", "c"])
    tier.get_many(["b"])
    get = latency(tier, "get")
    assert get["count"] == 2 and sum(get["counts"]) == 2 and get["sum_s"] > 0
    assert tier.counters["lookups"] == 4


def test_a_real_run_records_cpu_tier_latency_for_the_dashboard(tmp_path, monkeypatch):
    calls = {"acquire": 0, "get_many": 0, "put_many": 0, "complete_put": 0}
    for name in calls:
        original = getattr(CpuTier, name)

        def counted(self, keys, *args, _original=original, _name=name, **kwargs):
            calls[_name] += bool(keys) or _name != "complete_put"
            return _original(self, keys, *args, **kwargs)

        monkeypatch.setattr(CpuTier, name, counted)
    path, _, stats = record_jsonl(tmp_path, snapshot_interval_s=0.05)
    cpu = next(t for t in stats["tiers"] if t["tier"] == "cpu")
    assert calls["acquire"] > 0 and calls["complete_put"] > 0  # the runtime's data path
    assert cpu["latency"]["get"]["count"] == calls["acquire"] + calls["get_many"]
    assert cpu["latency"]["put"]["count"] == calls["complete_put"] + calls["put_many"]
    assert cpu["latency"]["get"]["sum_s"] > 0 and cpu["latency"]["put"]["sum_s"] > 0
    lines = read_lines(path)
    assert lines[-1]["latency"]["cpu.get"]["count"] == cpu["latency"]["get"]["count"]
    # the chart's CPU lines: a mean latency in some interval
    for op in ("get", "put"):
        assert any(line["rates"].get(f"latency.cpu.{op}.mean_s_interval") for line in lines), op
