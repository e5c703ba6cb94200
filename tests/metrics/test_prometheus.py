"""The metrics endpoint of a real TieredLLM, scraped over HTTP: Prometheus text, JSON snapshots,
the live page; the port is free again after close()."""
from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request

import pytest

from tests.metrics.workload import BLOCK_BYTES, make_config, make_llm, run_workload

prometheus_parser = pytest.importorskip("prometheus_client.parser")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def samples(text: str) -> dict:
    """{(name, frozenset(labels)): value} of a Prometheus exposition."""
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_scraped_figures_equal_the_runtime_stats(tmp_path):
    port = free_port()
    llm = make_llm(tmp_path, prometheus_port=port)
    with llm:
        assert llm.metrics.url == f"http://127.0.0.1:{port}"
        outputs = run_workload(llm)
        stats = llm.stats()
        status, content_type, text = get(f"{llm.metrics.url}/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        m = samples(text)
        tiers = {t["tier"]: t for t in stats["tiers"]}
        for tier in ("cpu", "disk"):
            for field, name in (("lookups", "lookups"), ("hits", "hits"), ("misses", "misses"),
                                ("bytes_read", "read_bytes"), ("bytes_written", "written_bytes")):
                assert m[(f"tierkv_tier_{name}_total", frozenset({("tier", tier)}))] == tiers[tier][field]
            get_hist = tiers[tier]["latency"]["get"]
            assert m[("tierkv_tier_latency_seconds_count", frozenset({("tier", tier), ("op", "get")}))] == get_hist["count"]
            assert m[("tierkv_tier_latency_seconds_sum", frozenset({("tier", tier), ("op", "get")}))] == pytest.approx(get_hist["sum_s"])
        resident = sum(o.stats["resident_block_reads"] for o in outputs)
        streamed = sum(o.stats["streamed_block_reads"] for o in outputs)
        assert m[("tierkv_tier_hits_total", frozenset({("tier", "gpu")}))] == resident
        assert m[("tierkv_tier_misses_total", frozenset({("tier", "gpu")}))] == streamed
        assert m[("tierkv_tier_hit_ratio", frozenset({("tier", "gpu")}))] == pytest.approx(resident / (resident + streamed))
        assert m[("tierkv_transfer_bytes_total", frozenset({("direction", "h2d")}))] == stats["transfer"]["h2d_bytes"]
        assert m[("tierkv_transfer_bytes_total", frozenset({("direction", "d2h")}))] == stats["transfer"]["d2h_bytes"]
        assert m[("tierkv_scheduler_streamed_bytes_total", frozenset())] == (
            streamed * BLOCK_BYTES + stats["scheduler"]["bytes_discarded"])  # copied ahead for a step that wanted others
        assert m[("tierkv_scheduler_stalls_total", frozenset())] == stats["scheduler"]["stalls"]
        assert m[("tierkv_gpu_kv_held_bytes", frozenset())] == stats["gpu"]["resident_bytes"] + stats["gpu"]["staging_bytes"]
        assert m[("tierkv_gpu_kv_budget_bytes", frozenset())] == stats["gpu"]["budget_bytes"]
        assert m[("tierkv_requests_total", frozenset())] == 3
        assert m[("tierkv_chain_promoted_blocks_total", frozenset())] == stats["chain"]["promoted"]
        for tier, num_blocks in outputs[2].stats["prefix_blocks_by_tier"].items():
            assert m[("tierkv_prefix_blocks_total", frozenset({("tier", tier)}))] == num_blocks
        # exact mode has no predictor: precision and recall absent, not a made-up number
        assert not any(name.startswith("tierkv_prefetch_") for name, _ in m)
        # the streamer reports every chunk; on CPU a late chunk's copy time is its stall time
        assert m[("tierkv_scheduler_stall_seconds_total", frozenset())] == stats["prefetch"]["stall_s"]
        assert stats["prefetch"]["late_chunks"] == stats["scheduler"]["stalls"]

        status, content_type, body = get(f"{llm.metrics.url}/api/snapshots?since=0")
        reply = json.loads(body)
        assert status == 200 and content_type == "application/json"
        assert [line["kind"] for line in reply["lines"]][:4] == ["start", "request", "request", "request"]
        assert reply["next"] == len(reply["lines"])
        assert get(f"{llm.metrics.url}/api/snapshots?since={reply['next']}")[2] == json.dumps(
            {"lines": [], "next": reply["next"], "source": reply["source"]})
        status, content_type, page = get(f"{llm.metrics.url}/")
        assert status == 200 and "uPlot" in page and 'id="chart-hitrate"' in page
        assert get(f"{llm.metrics.url}/static/uPlot.iife.min.js")[0] == 200
        assert get(f"{llm.metrics.url}/nothing-here")[0] == 404
        assert get(f"{llm.metrics.url}/api/snapshots?since=x")[0] == 400
    with pytest.raises(OSError):  # closed with the LLM: the port is free and nothing answers
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with socket.socket() as sock:  # a new server can listen there again (closed connections may linger in TIME_WAIT)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_metrics_disabled_records_nothing(tmp_path):
    llm = make_llm(tmp_path)
    llm.metrics.close()
    from tierkv.config import MetricsConfig
    from tierkv.metrics import MetricsService

    service = MetricsService.from_config(MetricsConfig(enabled=False, jsonl_path=str(tmp_path / "m.jsonl")), llm.stats)
    assert service.recorder is None and service.url is None
    service.record_request({"prompt_tokens": 1})
    service.close()
    llm.close()
    assert not (tmp_path / "m.jsonl").exists()


def test_an_endpoint_without_prometheus_client_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"tierkv-runtime\[dashboard\]"):
        make_llm(tmp_path, prometheus_port=free_port())


def test_a_busy_port_names_the_config_key_and_leaves_nothing_running(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=rf"metrics.prometheus_port: cannot listen on 127.0.0.1:{port}"):
            make_llm(tmp_path, prometheus_port=port)


@pytest.mark.parametrize("host", ["192.0.2.1", "999.1.1.1"])  # TEST-NET-1 (no local interface), not an address
def test_a_host_nothing_can_listen_on_names_metrics_host(tmp_path, host):
    from tests.models import build
    from tierkv.llm import TieredLLM

    config = make_config(tmp_path, prometheus_port=free_port())
    config.metrics.host = host
    with pytest.raises(OSError, match=rf"metrics.host: cannot listen on {host}:"):
        TieredLLM(build("llama")[0], config, show_progress=False)
