"""The control endpoint and the metrics server against the attacks they must stop, on a real server
on a loopback port: no credential, cross-site text/plain POSTs, DNS rebinding (foreign Host or
Origin), huge bodies, impossible budgets; and the security headers on every response."""
from __future__ import annotations

import http.client
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import tierkv.llm as llm_module
from tests.metrics.test_prometheus import free_port
from tests.metrics.workload import make_llm
from tierkv.budget_change import parse_budget
from tierkv.config import ConfigError, MetricsConfig
from tierkv.dashboard.guard import SECURITY_HEADERS
from tierkv.metrics import MetricsService
from tierkv.metrics.control import MAX_BODY_BYTES

TOKEN = "s3cret-token-for-tests-0123456789"


class Budget:
    """A set_gpu_budget that records what reached it and refuses what the runtime would refuse by value."""

    def __init__(self):
        self.calls = []

    def __call__(self, budget):
        self.calls.append(parse_budget(budget))


def service(budget=None, **metrics) -> MetricsService:
    config = MetricsConfig(prometheus_port=free_port(), snapshot_interval_s=3600.0, **metrics)
    return MetricsService.from_config(config, lambda: {"gpu": {"budget_bytes": 1}}, set_gpu_budget=budget, host=None)


def request(svc, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body) of one request to `svc`'s server; Host is the server's unless given."""
    conn = http.client.HTTPConnection("127.0.0.1", svc.server.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Host": f"127.0.0.1:{svc.server.port}", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def post_budget(svc, budget, *, token: str | None = TOKEN, content_type="application/json", headers=None):
    all_headers = {"Content-Type": content_type, **(headers or {})}
    if token is not None:
        all_headers["Authorization"] = f"Bearer {token}"
    return request(svc, "POST", "/api/gpu_budget", json.dumps({"budget": budget}).encode(), all_headers)


@pytest.fixture
def control():
    budget = Budget()
    svc = service(budget, control_enabled=True, control_token=TOKEN)
    yield svc, budget
    svc.close()


def test_the_control_is_off_unless_configured():
    budget = Budget()
    svc = service(budget)
    try:
        status, _, body = post_budget(svc, "1GiB")
        assert status == 404 and b"control endpoint is off" in body and budget.calls == []
    finally:
        svc.close()


def test_the_control_needs_a_token_from_the_config_or_the_environment(monkeypatch):
    monkeypatch.delenv("TIERKV_CONTROL_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="needs a token"):
        service(Budget(), control_enabled=True)
    with pytest.raises(ConfigError, match="at least 16 characters"):
        service(Budget(), control_enabled=True, control_token="short")
    monkeypatch.setenv("TIERKV_CONTROL_TOKEN", TOKEN)
    budget = Budget()
    svc = service(budget, control_enabled=True)
    try:
        assert post_budget(svc, "1MiB")[0] == 200 and budget.calls == [2**20]
    finally:
        svc.close()


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer wrong-token-of-some-length", f"Basic {TOKEN}",
                                           f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Bearer  {TOKEN[1:]}"])
def test_a_request_without_the_token_is_refused(control, authorization):
    svc, budget = control
    headers = {} if authorization is None else {"Authorization": authorization}
    status, response_headers, _ = post_budget(svc, "1GiB", token=None, headers=headers)
    assert status == 401 and response_headers["WWW-Authenticate"].startswith("Bearer")
    assert budget.calls == []


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""])
def test_a_cross_site_simple_post_is_refused(control, content_type):
    svc, budget = control  # what a form or fetch(no-cors) from any page can send without a preflight
    status, _, body = post_budget(svc, "1GiB", content_type=content_type)
    assert status == 415 and b"application/json" in body and budget.calls == []


def test_a_huge_or_missing_content_length_is_refused_without_reading_the_body(control):
    svc, budget = control
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}

    def raw_post(length: str | None) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", svc.server.port, timeout=10)
        conn.putrequest("POST", "/api/gpu_budget")
        for key, value in {**headers, **({} if length is None else {"Content-Length": length})}.items():
            conn.putheader(key, value)
        conn.endheaders(b'{"budget": "1GiB"}')  # less than announced: the server must not wait for the rest
        response = conn.getresponse()
        try:
            return response.status, response.read().decode()
        finally:
            conn.close()

    status, body = raw_post(str(10**12))
    assert status == 413 and str(MAX_BODY_BYTES) in body
    assert raw_post(None)[0] == 411
    assert raw_post("lots")[0] == 400 and raw_post("-5")[0] == 400  # not a length
    assert post_budget(svc, "x" * MAX_BODY_BYTES)[0] == 413
    assert budget.calls == []


@pytest.mark.parametrize("method,path", [("GET", "/api/snapshots?since=0"), ("GET", "/metrics"), ("GET", "/"),
                                         ("POST", "/api/gpu_budget")])
def test_dns_rebinding_a_foreign_host_or_origin_is_refused_on_every_path(control, method, path):
    svc, budget = control
    port = svc.server.port
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    body = b'{"budget": "1MiB"}' if method == "POST" else None
    for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1.attacker.example:{port}", "", "[::1"):
        status, headers, _ = request(svc, method, path, body, {"Host": host, **auth})
        assert status in (400, 421), host
        assert headers["X-Content-Type-Options"] == "nosniff"
    for origin in ("http://attacker.example", f"http://attacker.example:{port}", "null", f"http://localhost:{port}1",
                   f"file://127.0.0.1:{port}"):
        status, _, _ = request(svc, method, path, body, {"Origin": origin, **auth})
        assert status == 403, origin
    assert budget.calls == []
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):  # this server, by its names
        status, _, _ = request(svc, method, path, body, {"Host": host, "Origin": f"http://{host}", **auth})
        assert status == 200, host


def test_every_response_carries_the_security_headers(control):
    svc, _ = control
    responses = [request(svc, "GET", path) for path in ("/", "/static/dashboard.js", "/api/snapshots", "/metrics",
                                                        "/nowhere", "/api/snapshots?since=x")]
    responses += [post_budget(svc, "1MiB"), post_budget(svc, "1MiB", token=None), request(svc, "GET", "/api/gpu_budget"),
                  request(svc, "GET", "/", headers={"Host": "evil.example"})]
    for status, headers, _ in responses:
        for key, value in SECURITY_HEADERS:
            if key != "Content-Security-Policy":
                assert headers.get(key) == value, (status, key)
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
        assert "unsafe-inline" not in headers["Content-Security-Policy"].split("script-src")[1].split(";")[0]


def test_the_dashboard_server_is_guarded_as_well(tmp_path):
    from tierkv.cli.dashboard_cmd import dashboard_server
    from tierkv.metrics.sources import RecorderSource
    from tierkv.metrics.recorder import MetricsRecorder

    recorder = MetricsRecorder(lambda: {"gpu": {"budget_bytes": 1}})
    recorder.snapshot()
    server = dashboard_server(RecorderSource(recorder), "127.0.0.1", 0)
    try:
        svc = MetricsService(recorder, server)
        assert request(svc, "GET", "/api/snapshots", headers={"Host": "attacker.example"})[0] == 421
        status, headers, _ = request(svc, "GET", "/api/snapshots")
        assert status == 200 and headers["X-Frame-Options"] == "DENY"
    finally:
        server.close()


@pytest.fixture(scope="module")
def served_llm(tmp_path_factory):
    llm = make_llm(tmp_path_factory.mktemp("control"), prometheus_port=free_port(), control_token=TOKEN)
    yield llm, MetricsService(None, llm.metrics.server)
    llm.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=64), st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80) | st.floats() | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["budget", "x"]), inner, max_size=2),
    max_leaves=4).map(lambda value: json.dumps(value).encode())))
def test_any_body_is_applied_or_refused_with_a_4xx_and_the_budget_stays_valid(served_llm, body):
    llm, svc = served_llm
    before = llm.runtime.config.cache.gpu_budget_bytes
    status, _, reply = request(svc, "POST", "/api/gpu_budget", body,
                               {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    assert status in (200, 400, 409), reply
    if status != 200:
        assert llm.runtime.config.cache.gpu_budget_bytes == before and "error" in json.loads(reply)
    assert llm.runtime.pool.resident.shape[1] == llm.runtime.residency.slots_per_layer
    llm.set_gpu_budget(before)


def test_an_impossible_budget_posted_during_a_request_is_refused_and_the_request_keeps_its_tokens(
        served_llm, monkeypatch):
    llm, svc = served_llm
    prompt = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(7)).tolist()
    (expected,) = llm.generate([prompt], max_new_tokens=8)
    real_sample, replies = llm_module.sample_next, []

    def sample(*args):
        if len(replies) == 0 and llm.runtime.active is not None and len(llm.runtime.active.token_ids) > len(prompt) + 2:
            replies.append(post_budget(svc, "1000TiB"))  # mid-decode
        return real_sample(*args)

    monkeypatch.setattr(llm_module, "sample_next", sample)
    (out,) = llm.generate([prompt], max_new_tokens=8)
    assert out.token_ids == expected.token_ids
    status, _, body = replies[0]
    assert status == 409 and "can give at most" in json.loads(body)["error"]
    assert llm.stats()["gpu"]["budget_refusals"] >= 1
    status, _, body = request(svc, "GET", "/metrics")
    assert b"tierkv_gpu_budget_refusals_total" in body


def raw_exchange(svc, data: bytes, *, wait_s: float = 5.0) -> bytes:
    """Send `data` as is on a fresh connection; what the server answers before closing (or b'')."""
    import socket

    with socket.create_connection(("127.0.0.1", svc.server.port), timeout=wait_s) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionError):
            pass
        return b"".join(chunks)


def _post_head(svc, length: str) -> bytes:
    return (f"POST /api/gpu_budget HTTP/1.1\r\nHost: 127.0.0.1:{svc.server.port}\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("length,status", [("-1", b"400"), ("+13", b"400"), ("1_3", b"400"), ("1 3", b"400"),
                                           ("99999999999999999999999", b"413")])
def test_an_odd_content_length_is_refused_by_name(control, length, status):
    svc, budget = control
    reply = raw_exchange(svc, _post_head(svc, length) + b'{"budget": 1}')
    assert reply.split(b" ", 2)[1] == status and (b"Content-Length" in reply or b"at most" in reply)
    assert budget.calls == []


def test_deep_json_and_a_short_body_are_400s(control, monkeypatch):
    from tierkv.dashboard import server as app_server

    svc, budget = control
    deep = b"[" * 3000 + b"]" * 3000
    status, _, body = request(svc, "POST", "/api/gpu_budget", deep,
                              {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert status == 413 or (status == 400 and b"not JSON" in body)
    nested = b'{"budget": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    assert len(nested) <= MAX_BODY_BYTES
    status, _, body = request(svc, "POST", "/api/gpu_budget", nested,
                              {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert status == 400, body  # a RecursionError was a 500 and a traceback
    monkeypatch.setattr(app_server._QuietHandler, "timeout", 0.5)  # for connections made from here on
    reply = raw_exchange(svc, _post_head(svc, "40") + b'{"budget": 1')  # 12 of 40 bytes, then nothing
    assert reply.split(b" ", 2)[1] in (b"400", b"408") and budget.calls == []


def test_idle_connections_are_closed_and_capped(control, monkeypatch):
    """A client opening many connections and sending half a request line holds no thread for ever: each is
    closed after the read timeout, and past MAX_CONNECTIONS at once a new one hangs up the one open longest."""
    import socket
    import threading
    import time

    from tierkv.dashboard import server as app_server

    svc, _ = control
    monkeypatch.setattr(app_server._QuietHandler, "timeout", 1.0)

    def handlers() -> int:  # this server's own request threads (the process may run others: a test's leftovers)
        targets = [getattr(t, "_target", None) for t in threading.enumerate()]
        return sum(getattr(f, "__self__", None) is svc.server._server and f.__name__ == "process_request_thread"
                   for f in targets)

    idle = [socket.create_connection(("127.0.0.1", svc.server.port), timeout=5) for _ in range(app_server.MAX_CONNECTIONS + 20)]
    for sock in idle:
        sock.sendall(b"GET /metr")
    time.sleep(0.5)
    assert handlers() <= app_server.MAX_CONNECTIONS
    deadline = time.monotonic() + 10
    while handlers() > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert handlers() == 0  # every handler ended with its timeout
    for sock in idle:
        sock.close()
    assert request(svc, "GET", "/metrics")[0] == 200  # and the server still answers


def test_slow_clients_holding_every_slot_do_not_lock_out_a_scrape_or_a_budget_change(control, monkeypatch):
    """MAX_CONNECTIONS clients each sending a byte more often than the read timeout held every slot for as long
    as they liked: every scrape and budget change was closed unanswered. A new connection hangs up the one
    open longest, so both are answered while the slow clients go on."""
    import socket
    import threading
    import time

    from tierkv.dashboard import server as app_server

    svc, budget = control
    monkeypatch.setattr(app_server._QuietHandler, "timeout", 1.0)
    slow = [socket.create_connection(("127.0.0.1", svc.server.port), timeout=5) for _ in range(app_server.MAX_CONNECTIONS)]
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            for sock in slow:
                try:
                    sock.sendall(b"G")
                except OSError:
                    pass  # hung up by the server
            time.sleep(0.3)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        assert request(svc, "GET", "/metrics")[0] == 200
        assert post_budget(svc, "1GiB")[0] == 200 and budget.calls
    finally:
        stop.set()
        thread.join()
        for sock in slow:
            sock.close()


def test_a_budget_change_waiting_for_the_engine_is_never_hung_up_for_new_connections(monkeypatch):
    """A budget change waits in set_gpu_budget until the engine applies it (seconds): the oldest connection then,
    but one being answered, so MAX_CONNECTIONS new ones hang up those still sending their request, never it
    (it was: the change applied while its client was told the connection closed)."""
    import socket
    import threading
    import time

    from tierkv.dashboard import server as app_server

    applied, reply, waiting_for_engine = [], {}, threading.Event()

    def slow_budget(budget):
        waiting_for_engine.set()
        time.sleep(1.5)
        applied.append(parse_budget(budget))

    svc = service(slow_budget, control_enabled=True, control_token=TOKEN)
    others = []
    try:
        waiting = threading.Thread(target=lambda: reply.update(status=post_budget(svc, "1GiB")[0]), daemon=True)
        waiting.start()
        assert waiting_for_engine.wait(10)  # the change is being answered, on the oldest connection
        others = [socket.create_connection(("127.0.0.1", svc.server.port), timeout=5)
                  for _ in range(app_server.MAX_CONNECTIONS + 5)]
        waiting.join(timeout=10)
        assert reply == {"status": 200} and applied == [parse_budget("1GiB")]
    finally:
        for sock in others:
            sock.close()
        svc.close()


def test_a_token_with_whitespace_at_an_end_is_refused_at_start():
    with pytest.raises(ConfigError, match="whitespace at either end"):
        service(Budget(), control_enabled=True, control_token=TOKEN + "\n")


def test_a_change_not_applied_in_time_is_202_pending_not_a_failure():
    def slow(budget):
        raise TimeoutError("the GPU budget change to 1 did not take effect within 0.1 s; it stays pending")

    svc = service(slow, control_enabled=True, control_token=TOKEN)
    try:
        status, _, body = post_budget(svc, "1GiB")
        assert status == 202 and "stays pending" in json.loads(body)["pending"]
    finally:
        svc.close()
