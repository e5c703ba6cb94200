"""`tierkv budget` and config reload: the GPU budget of a running TieredLLM changes, nothing else can."""
from __future__ import annotations

import pytest

from tests.metrics.test_prometheus import free_port
from tests.metrics.workload import make_llm
from tierkv.cli import main


TOKEN = "a-test-token-of-some-length"


def test_budget_command_resizes_a_running_tiered_llm(tmp_path, capsys):
    llm = make_llm(tmp_path, prometheus_port=free_port(), control_token=TOKEN)
    with llm:
        before = llm.runtime.residency.slots_per_layer
        new_budget = llm.config.cache.gpu_budget_bytes * 2
        assert main(["budget", "--token", TOKEN, "--endpoint", llm.metrics.url, str(new_budget)]) == 0
        assert llm.runtime.residency.slots_per_layer == 2 * before
        assert llm.stats()["gpu"]["budget_bytes"] == new_budget
        assert "GPU KV budget set to" in capsys.readouterr().out
        # a budget too small for sinks + window: refused by the process, exit 2, nothing changes
        assert main(["budget", "--token", TOKEN, "--endpoint", llm.metrics.url, "1"]) == 2
        assert "sinks + window" in capsys.readouterr().err
        assert llm.runtime.residency.slots_per_layer == 2 * before


@pytest.mark.parametrize("argv,code,message", [
    (["budget", "--endpoint", "http://127.0.0.1:9", "1GiB"], 1, "cannot reach"),
    (["budget", "--endpoint", "http://127.0.0.1:9", "lots"], 2, "size"),
    (["budget", "--endpoint", "http://127.0.0.1:9", "0"], 2, "must be positive"),
    (["budget", "--endpoint", "http://[::1", "1GiB"], 2, "--endpoint: got 'http://[::1'; not a URL"),
    (["budget", "--endpoint", "http://127.0.0.1:abc", "1GiB"], 2, "--endpoint: got 'http://127.0.0.1:abc'"),
    (["budget", "--endpoint", "http://127.0.0.1:99999", "1GiB"], 2, "Port out of range"),
    (["budget", "--endpoint", "http://", "1GiB"], 2, "no host"),
    (["top", "--endpoint", "http://127.0.0.1:abc", "--once"], 2, "endpoint: got 'http://127.0.0.1:abc'"),
])
def test_budget_command_bad_arguments(argv, code, message, capsys):
    assert main(argv) == code
    assert message in capsys.readouterr().err


def test_budget_command_needs_an_endpoint(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["budget", "1GiB"])
    assert exited.value.code == 2
    assert "--endpoint" in capsys.readouterr().err


def test_config_reload_applies_the_budget_and_refuses_other_keys(tmp_path):
    llm = make_llm(tmp_path)
    with llm:
        config = llm.config
        budget = config.cache.gpu_budget_bytes
        changed = llm.reload_config({
            "model": {"name": config.model.name}, "cache": {**vars(config.cache), "gpu_budget_bytes": budget * 3},
            "tiers": [vars(t) for t in config.tiers], "scheduler": vars(config.scheduler), "metrics": vars(config.metrics),
        })
        assert changed == ["cache.gpu_budget_bytes"]
        assert llm.runtime.config.cache.gpu_budget_bytes == budget * 3
        with pytest.raises(ValueError, match="cache.block_tokens cannot change at run time"):
            llm.reload_config({"model": {"name": config.model.name}, "cache": {**vars(config.cache), "block_tokens": 8},
                               "tiers": [vars(t) for t in config.tiers], "scheduler": vars(config.scheduler),
                               "metrics": vars(config.metrics)})


def test_budget_command_sends_the_token_from_the_flag_or_the_environment(tmp_path, capsys, monkeypatch):
    llm = make_llm(tmp_path, prometheus_port=free_port(), control_token=TOKEN)
    with llm:
        budget = llm.config.cache.gpu_budget_bytes
        monkeypatch.delenv("TIERKV_CONTROL_TOKEN", raising=False)
        assert main(["budget", "--endpoint", llm.metrics.url, str(budget * 2)]) == 2
        assert "needs its token" in capsys.readouterr().err
        assert main(["budget", "--token", "wrong-token-of-some-length", "--endpoint", llm.metrics.url, "1MiB"]) == 2
        err = capsys.readouterr().err  # a wrong token is not told to pass one (it was passed)
        assert "refused the token from --token" in err and "needs its token" not in err
        monkeypatch.setenv("TIERKV_CONTROL_TOKEN", "another-wrong-token-of-some-length")
        assert main(["budget", "--endpoint", llm.metrics.url, "1MiB"]) == 2
        assert "refused the token from TIERKV_CONTROL_TOKEN" in capsys.readouterr().err
        assert llm.config.cache.gpu_budget_bytes == budget
        monkeypatch.setenv("TIERKV_CONTROL_TOKEN", TOKEN)
        assert main(["budget", "--endpoint", llm.metrics.url, str(budget * 2)]) == 0
        assert llm.config.cache.gpu_budget_bytes == budget * 2


@pytest.mark.parametrize("status,body", [("200 OK", b"<html>hello</html>"), ("404 Not Found", b"<html>no</html>"),
                                         ("200 OK", b"[1, 2]")])
def test_budget_command_says_when_the_url_is_not_a_tierkv_endpoint(status, body, capsys):
    from tierkv.dashboard.app import serve

    def app(environ, start_response):
        start_response(status, [("Content-Type", "text/html"), ("Content-Length", str(len(body)))])
        return [body]

    server = serve(app, "127.0.0.1", 0)
    try:
        assert main(["budget", "--token", TOKEN, "--endpoint", server.url, "1GiB"]) == 1
    finally:
        server.close()
    assert "not a tierkv endpoint" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint", ["notaurl", "127.0.0.1:9400"])
@pytest.mark.parametrize("argv", [["budget", "1GiB"], ["top", "--once"], ["dashboard"]])
def test_every_command_refuses_an_endpoint_without_a_scheme_alike(argv, endpoint, capsys):
    assert main([*argv, "--endpoint", endpoint]) == 2  # one check: no command guesses http:// and fails later
    err = capsys.readouterr().err
    assert f"error: --endpoint: got {endpoint!r}; expected http://host:port" in err and "cannot reach" not in err


def test_budget_command_refuses_an_endpoint_that_is_not_http(capsys):
    assert main(["budget", "--endpoint", "ftp://127.0.0.1:9", "1GiB"]) == 2
    assert "expected http://host:port" in capsys.readouterr().err


def test_a_401_with_an_error_page_that_is_not_json_still_asks_for_the_token(capsys):
    """A proxy in front of the endpoint answers 401 with HTML: the status decides, not the body."""
    import http.server
    import threading

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802  (http.server's name)
            self.send_response(401)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html>401 Authorization Required</html>")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert main(["budget", "--endpoint", f"http://127.0.0.1:{server.server_port}", "1GiB"]) == 2
        assert "needs its token" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_a_redirect_is_not_followed_with_the_token(capsys):
    """An endpoint answering 302 to another server: urllib followed it with the Authorization header (as a GET)
    and the command said the budget was set. The redirect is refused, naming where it pointed; the other server
    sees nothing."""
    from tierkv.dashboard.app import serve

    seen = []

    def elsewhere(environ, start_response):
        seen.append(environ.get("HTTP_AUTHORIZATION"))
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b"{}"]

    other = serve(elsewhere, "127.0.0.1", 0)

    def redirecting(environ, start_response):
        start_response("302 Found", [("Location", f"{other.url}/api/gpu_budget"), ("Content-Length", "0")])
        return [b""]

    server = serve(redirecting, "127.0.0.1", 0)
    try:
        assert main(["budget", "--token", TOKEN, "--endpoint", server.url, "1GiB"]) == 1
    finally:
        server.close()
        other.close()
    assert seen == [] and "a redirect to" in capsys.readouterr().err


def _hostile_server(behaviour: str):
    """A server answering a budget POST with a trickle (a byte every 0.2 s until `_close`), an endless body, or an
    error whose text carries terminal escape sequences and a forged line. Its `closed` is set once a handler finds
    the client's connection closed; `handlers` holds the threads that ran one."""
    import http.server
    import json
    import threading

    stop, closed, handlers = threading.Event(), threading.Event(), []

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802  (http.server's name)
            handlers.append(threading.current_thread())
            try:
                if behaviour == "trickle":
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    while not stop.is_set():
                        self.wfile.write(b"X")
                        self.wfile.flush()
                        stop.wait(0.2)
                    return
                self.send_response(200 if behaviour == "endless" else 400)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                if behaviour == "endless":
                    while True:
                        self.wfile.write(b" " * 65536)
                self.wfile.write(json.dumps({"error": "\x1b]0;pwned\x07\x1b[2J\nforged: budget set"}).encode())
            except (BrokenPipeError, ConnectionResetError):
                closed.set()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    server.daemon_threads = True
    server.stop, server.closed, server.handlers = stop, closed, handlers
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _close(server) -> None:
    server.stop.set()  # a trickling handler ends at once, not when its client gives up
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("behaviour,code,words", [
    ("trickle", 1, "no complete reply within --timeout 1 s"),
    ("endless", 1, "a reply over 65536 bytes"),
    ("escapes", 2, "the endpoint refused 1GiB: ?]0;pwned??[2J?forged: budget set"),
])
def test_a_hostile_endpoint_is_bounded_in_time_and_size_and_its_text_is_defused(capsys, behaviour, code, words):
    import time

    server = _hostile_server(behaviour)
    try:
        started = time.monotonic()
        assert main(["budget", "--endpoint", f"http://127.0.0.1:{server.server_port}", "--timeout", "1",
                     "1GiB"]) == code
        assert time.monotonic() - started < 10
        err = capsys.readouterr().err
        assert words in err and "\x1b" not in err
    finally:
        _close(server)


def test_a_trickling_endpoint_leaves_no_thread_or_socket_behind(capsys):
    """Past --timeout the command closed nothing: the exchange's thread was left reading the trickle with its socket
    open, for as long as the server kept sending. Now the socket carries the deadline and is closed on return."""
    import threading

    server = _hostile_server("trickle")
    before = set(threading.enumerate())
    try:
        assert main(["budget", "--endpoint", f"http://127.0.0.1:{server.server_port}", "--timeout", "1",
                     "1GiB"]) == 1
        assert "no complete reply within --timeout 1 s" in capsys.readouterr().err
        assert server.closed.wait(5), "the command's socket is still open"
        for handler in server.handlers:
            handler.join(5)
        assert set(threading.enumerate()) - before == set()
    finally:
        _close(server)


def test_the_token_goes_to_the_endpoint_not_to_a_proxy_from_the_environment():
    """urllib sent the request (and its bearer token) to $http_proxy: a dead proxy made a live endpoint unreachable,
    a live one saw the token. Run as a user runs it, in a process started with the variables set."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tierkv.dashboard.app import serve

    seen = []

    def endpoint(environ, start_response):
        seen.append(environ.get("HTTP_AUTHORIZATION"))
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b"{}"]

    repo = Path(__file__).resolve().parents[2]
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy", "https_proxy")}
    env.update(PYTHONPATH=str(repo), http_proxy=dead_proxy, HTTP_PROXY=dead_proxy, https_proxy=dead_proxy,
               HTTPS_PROXY=dead_proxy, TIERKV_CONTROL_TOKEN=TOKEN)
    server = serve(endpoint, "127.0.0.1", 0)
    try:
        done = subprocess.run([sys.executable, "-m", "tierkv.cli", "budget", "--endpoint", server.url, "1GiB"],
                              cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.close()
    assert done.returncode == 0, done.stderr
    assert seen == [f"Bearer {TOKEN}"] and "GPU KV budget set to 1GiB" in done.stdout
