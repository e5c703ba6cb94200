"""The recorder's in-memory history stays within metrics.history_bytes under a load of many snapshots."""
from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from tests.metrics.test_recorder import Script
from tierkv.metrics import MetricsRecorder, MetricsService, PrefetchRecorder
from tierkv.metrics.history import History
from tierkv.config import ConfigError, MetricsConfig, load_config


def loaded_script(num_layers: int = 32) -> Script:
    """A stats() source the size of a loaded runtime's: per-layer prefetch arrays for 32 layers."""
    s = Script()
    s.prefetch = PrefetchRecorder(num_layers)
    for layer in range(num_layers):
        s.prefetch.record_chunk(layer, is_late=layer % 3 == 0, wait_s=0.001 * layer)
    return s


def test_many_snapshots_stay_within_the_byte_bound_and_keep_the_latest_lines():
    bound = 256 * 1024
    s = loaded_script()
    rec = MetricsRecorder(s.stats, clock=s.clock, history_bytes=bound)
    for _ in range(1500):
        s.now += 1.0
        s.h2d += 4096
        rec.snapshot()
        assert rec.history_bytes <= bound
    lines, next_n = rec.lines_since(0)
    assert next_n == 1500 and [line["seq"] for line in lines] == list(range(1500 - len(lines), 1500))
    line_bytes = len(json.dumps(lines[-1], default=str))
    assert len(lines) >= bound // line_bytes - 1  # the bound is used, not a few lines
    assert lines[-1]["figures"]["transfer.h2d_bytes"] == 1500 * 4096


def test_the_process_pays_about_the_bound_not_the_line_count():
    bound = 512 * 1024
    s = loaded_script()
    rec = MetricsRecorder(s.stats, clock=s.clock, history_bytes=bound)
    for _ in range(50):
        rec.snapshot()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            s.now += 1.0
            rec.snapshot()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown <= bound * 1.25 + 64 * 1024, grown  # 2,000 lines as dicts would take several MB


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=200),
       bound=st.integers(min_value=1, max_value=20000), max_lines=st.none() | st.integers(min_value=1, max_value=50))
def test_history_bounds_hold_for_any_line_sizes(sizes, bound, max_lines):
    history = History(bound, max_lines)
    for seq, size in enumerate(sizes):
        history.append(seq, b"0" * size)
        assert len(history) >= 1 and history.num_bytes == sum(len(e) for _, e in history._lines)
        assert history.num_bytes <= bound or len(history) == 1  # one line larger than the bound is still kept
        assert max_lines is None or len(history) <= max_lines
    assert [seq for seq, _ in history._lines] == list(range(len(sizes) - len(history), len(sizes)))


def test_the_config_key_reaches_the_recorder_and_is_checked():
    config = load_config({"metrics": {"history_bytes": "1MiB"}}, env={})
    assert config.metrics.history_bytes == 2**20 and MetricsConfig().history_bytes == 8 * 2**20
    service = MetricsService.from_config(config.metrics, Script().stats)
    try:
        assert service.recorder._history.max_bytes == 2**20
    finally:
        service.close()
    for bad in (0, "lots", -1):
        with pytest.raises(ConfigError, match="metrics.history_bytes"):
            load_config({"metrics": {"history_bytes": bad}}, env={})
