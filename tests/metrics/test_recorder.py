"""MetricsRecorder: snapshot lines from a scripted stats() source, rates, the JSONL file, sampling."""
from __future__ import annotations

import json
import threading

import pytest

from tierkv.metrics import MetricsRecorder, PrefetchRecorder
from tierkv.metrics.snapshot import SCHEMA, histogram_quantile


class Script:
    """A stats() source with hand-set figures, and a clock the test moves."""

    def __init__(self):
        self.now = 1000.0
        self.h2d = 0
        self.cpu = {"lookups": 0, "hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0}
        self.get_latency = {"buckets_s": [0.001, 0.01], "counts": [0, 0, 0], "sum_s": 0.0, "count": 0}
        self.prefetch = PrefetchRecorder(num_layers=2)

    def stats(self) -> dict:
        return {
            "gpu": {"resident_bytes": 100, "staging_bytes": 20, "budget_bytes": 128},
            "transfer": {"h2d_bytes": self.h2d, "d2h_bytes": 0, "backend": "torch_cpu"},
            "scheduler": {"chunks_streamed": 0, "bytes_streamed": 0, "stalls": 0},
            "prefetch": self.prefetch.snapshot(),
            "chain": {"spilled": 0, "dropped": 0, "promoted": 0, "in_flight": 0, "spill_errors": []},
            "tiers": [dict(self.cpu, tier="cpu", healthy=True, latency={"get": dict(self.get_latency)})],
        }

    def clock(self) -> float:
        return self.now


def test_lines_hold_totals_and_rates_since_the_previous_line(tmp_path):
    s = Script()
    rec = MetricsRecorder(s.stats, jsonl_path=tmp_path / "m.jsonl", clock=s.clock)
    first = rec.snapshot("start")
    assert first["rates"] == {} and first["schema"] == SCHEMA and first["seq"] == 0
    assert first["figures"]["gpu.held_bytes"] == 120
    assert first["figures"]["prefetch.precision"] is None and first["figures"]["prefetch.recall"] is None
    assert first["info"]["transfer.backend"] == "torch_cpu"
    assert "tier.gpu.lookups" not in first["figures"]  # no sequence seen: no invented GPU figures

    s.now += 2.0
    s.h2d = 4096
    s.cpu.update(lookups=4, hits=3, misses=1, bytes_read=3 * 1024)
    s.get_latency.update(counts=[3, 1, 0], sum_s=0.008, count=4)
    second = rec.snapshot()
    r = second["rates"]
    assert r["transfer.h2d_bytes_per_s"] == 2048.0
    assert r["tier.cpu.bytes_read_per_s"] == 1536.0
    assert r["tier.cpu.hit_rate_interval"] == 0.75
    assert r["latency.cpu.get.mean_s_interval"] == pytest.approx(0.002)
    assert r["scheduler.stalls_interval"] == 0

    s.now += 1.0
    third = rec.snapshot()
    assert third["rates"]["tier.cpu.hit_rate_interval"] is None  # no lookups in the interval: no rate
    assert third["rates"]["transfer.h2d_bytes_per_s"] == 0.0
    rec.close()
    rec.close()  # twice is fine
    on_disk = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in on_disk] == ["start", "interval", "interval", "final"]
    assert on_disk[1] == json.loads(json.dumps(second))
    assert len({line["run_id"] for line in on_disk}) == 1
    with pytest.raises(RuntimeError, match="closed"):
        rec.snapshot()


def test_a_counter_that_goes_down_gives_no_rate_rather_than_a_negative_one():
    s = Script()
    rec = MetricsRecorder(s.stats, clock=s.clock)
    s.h2d = 100
    rec.snapshot()
    s.now += 1
    s.h2d = 50
    assert rec.snapshot()["rates"]["transfer.h2d_bytes_per_s"] is None


def test_gpu_reads_come_from_the_sequences_and_are_folded_when_the_next_starts():
    s = Script()
    live = {"value": None}
    rec = MetricsRecorder(s.stats, clock=s.clock, live_reads=lambda: live["value"])
    live["value"] = ("seq-a", {"resident_block_reads": 2, "streamed_block_reads": 6})
    f = rec.snapshot()["figures"]
    assert (f["tier.gpu.hits"], f["tier.gpu.misses"], f["tier.gpu.lookups"], f["tier.gpu.hit_rate"]) == (2, 6, 8, 0.25)
    live["value"] = ("seq-a", {"resident_block_reads": 4, "streamed_block_reads": 12})
    live_figures = rec.snapshot()["figures"]
    assert live_figures["tier.gpu.lookups"] == 16
    live["value"] = ("seq-b", {"resident_block_reads": 1, "streamed_block_reads": 0})
    line = rec.snapshot()
    assert (line["figures"]["tier.gpu.hits"], line["figures"]["tier.gpu.lookups"]) == (5, 17)
    assert line["rates"]["tier.gpu.hit_rate_interval"] == 1.0


def test_request_lines_carry_the_request_and_count_prefix_reuse_by_tier():
    s = Script()
    rec = MetricsRecorder(s.stats, clock=s.clock)
    rec.record_request({"prompt_tokens": 10, "prefix_blocks_by_tier": {"disk": 3, "cpu": 1}})
    line = rec.record_request({"prompt_tokens": 12, "prefix_blocks_by_tier": {"cpu": 2}})
    assert line["kind"] == "request" and line["request"]["prompt_tokens"] == 12
    assert line["figures"]["requests.prefix_blocks.cpu"] == 3 and line["figures"]["requests.prefix_blocks.disk"] == 3


def test_history_is_bounded_and_lines_since_resumes():
    s = Script()
    rec = MetricsRecorder(s.stats, clock=s.clock, history=3)
    for _ in range(5):
        rec.snapshot()
    lines, next_n = rec.lines_since(0)
    assert [line["seq"] for line in lines] == [2, 3, 4] and next_n == 5
    assert rec.lines_since(next_n) == ([], 5)
    rec.snapshot()
    assert [line["seq"] for line in rec.lines_since(next_n)[0]] == [5]


def test_the_sampling_thread_writes_lines_until_closed(tmp_path):
    s = Script()
    calls = threading.Semaphore(0)

    def source():
        calls.release()
        return s.stats()

    rec = MetricsRecorder(source, jsonl_path=tmp_path / "m.jsonl")
    rec.start(interval_s=0.01)
    with pytest.raises(RuntimeError, match="already running"):
        rec.start(interval_s=0.01)
    for _ in range(3):
        assert calls.acquire(timeout=10), "the sampling thread took no snapshot"
    rec.close()
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert kinds[-1] == "final" and kinds.count("interval") >= 2
    assert rec.sampling_errors == []


def test_prefetch_recorder_reports_only_what_it_was_told():
    p = PrefetchRecorder(num_layers=3)
    assert p.snapshot() == {"precision": None, "recall": None, "stall_s": None}
    p.record_chunk(0, is_late=False, wait_s=0.0)
    p.record_chunk(2, is_late=True, wait_s=0.004)
    p.record_chunk(2, is_late=True, wait_s=0.001)
    snap = p.snapshot()
    assert snap["layers"] == {"chunks": [1, 0, 2], "late_chunks": [0, 0, 2], "wait_s": [0.0, 0.0, 0.005]}
    assert snap["stall_s"] == pytest.approx(0.005) and snap["late_chunks"] == 2
    assert snap["precision"] is None  # chunks say nothing about a selection
    p.record_selection(num_prefetched=10, num_used=8, num_needed=16)
    snap = p.snapshot()
    assert (snap["precision"], snap["recall"]) == (0.8, 0.5)
    with pytest.raises(ValueError, match="layer: got 3"):
        p.record_chunk(3, is_late=False)
    with pytest.raises(ValueError, match="num_used"):
        p.record_selection(num_prefetched=2, num_used=3, num_needed=5)


class FakeTimingEvent:
    """Stands in for a CUDA timing event: completes when the test says, reports a set time."""

    def __init__(self, t_ms: float, done: bool = True):
        self.t_ms, self.done, self.synchronized = t_ms, done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized, self.done = True, True

    def elapsed_time(self, end: "FakeTimingEvent") -> float:
        return end.t_ms - self.t_ms


def test_gpu_timed_chunk_waits_are_read_when_complete_and_sum_into_stall_time():
    p = PrefetchRecorder(num_layers=2)
    p.record_chunk_timed(0, is_late=False, start=FakeTimingEvent(10.0), end=FakeTimingEvent(10.5))
    pending_end = FakeTimingEvent(25.0, done=False)
    p.record_chunk_timed(1, is_late=True, start=FakeTimingEvent(20.0), end=pending_end)
    p._resolve(block=False)  # the second wait has not completed: left for later
    assert p._pending and p._pending[0][3] is pending_end
    snap = p.snapshot()  # waits for it
    assert pending_end.synchronized
    assert snap["layers"]["wait_s"] == [pytest.approx(0.0005), pytest.approx(0.005)]
    assert snap["stall_s"] == pytest.approx(0.005)  # only the late chunk's wait is a stall
    assert snap["layers"]["late_chunks"] == [0, 1] and len(p._free_events) == 4  # events reused


def test_reported_prefetch_figures_reach_the_line():
    s = Script()
    rec = MetricsRecorder(s.stats, clock=s.clock)
    s.prefetch.record_chunk(1, is_late=True, wait_s=0.5)
    s.prefetch.record_selection(num_prefetched=4, num_used=2, num_needed=2)
    line = rec.snapshot()
    assert line["prefetch_layers"]["late_chunks"] == [0, 1]
    assert (line["figures"]["prefetch.precision"], line["figures"]["prefetch.recall"]) == (0.5, 1.0)
    assert line["figures"]["prefetch.stall_s"] == 0.5


def test_histogram_quantile_reads_bucket_bounds():
    h = {"buckets_s": [0.001, 0.01], "counts": [3, 1, 1], "sum_s": 1.0, "count": 5}
    assert histogram_quantile(h, 0.5) == 0.001
    assert histogram_quantile(h, 0.8) == 0.01
    assert histogram_quantile(h, 0.99) == float("inf")
    assert histogram_quantile({"buckets_s": [1.0], "counts": [0, 0], "sum_s": 0, "count": 0}, 0.5) is None


def test_the_jsonl_is_never_written_through_a_symbolic_link(tmp_path):
    """A link at the metrics path (another user's, in a shared directory) chose the file appended to: refused by
    config check with the key, and by the recorder itself (a link made after the check); a new file is 0600."""
    import os
    import stat

    from tierkv.config import ConfigError, load_config
    from tierkv.metrics.recorder import MetricsRecorder

    target, link = tmp_path / "someone-elses-file", tmp_path / "run.jsonl"
    target.write_text("theirs\n")
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="metrics.jsonl_path.*symbolic link"):
        load_config({"metrics": {"jsonl_path": str(link)}}, env={})
    with pytest.raises(ValueError, match="symbolic link"):
        MetricsRecorder(lambda: {}, jsonl_path=link)
    with pytest.raises(ConfigError, match="metrics.jsonl_path.*regular file"):
        load_config({"metrics": {"jsonl_path": "/dev/null"}}, env={})
    assert target.read_text() == "theirs\n"
    recorder = MetricsRecorder(lambda: {}, jsonl_path=tmp_path / "new.jsonl")
    recorder.close()
    assert stat.S_IMODE(os.stat(tmp_path / "new.jsonl").st_mode) == 0o600
