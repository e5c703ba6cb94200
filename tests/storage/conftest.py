"""Fixtures for storage tests: a small block layout, a real redis-server, a namespace per test.

`redis_server` starts Debian's redis-server once per session on a free loopback port. Without
redis-server the Redis tests skip, except under CI (the CI variable set), where they fail:
CI must install it (apt-get install redis-server).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from tierkv.blocks import BlockLayout

_REDIS_CANDIDATES = ("/usr/bin/redis-server", "/usr/sbin/redis-server")
_START_DEADLINE_S = 10.0


@pytest.fixture
def layout() -> BlockLayout:
    """8 KiB blocks: [2, 2 kv heads, 16 tokens, 64 dims] bf16."""
    return BlockLayout(num_kv_heads=2, block_tokens=16, head_dim=64, dtype=torch.bfloat16)


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    return next((p for p in _REDIS_CANDIDATES if os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers_ping(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server child process on 127.0.0.1:`port`, with no persistence."""

    def __init__(self, executable: str, workdir: Path):
        self.executable = executable
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None
        self.extra_args: list[str] = []  # e.g. cluster mode (tests/storage/redis_cluster_nodes.py)

    def start(self) -> None:
        args = [
            self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--logfile", str(self.workdir / "redis.log"), *self.extra_args,
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + _START_DEADLINE_S
        while not answers_ping(self.port):
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING within {_START_DEADLINE_S}s: {self._log_tail()}")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the port stops answering at once."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=5)

    def restart(self) -> None:
        self.stop()
        self.start()

    def ensure_running(self) -> None:
        if self._proc is None or self._proc.poll() is not None or not answers_ping(self.port):
            self.restart()

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        if self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None

    def _log_tail(self) -> str:
        log = self.workdir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    executable = find_redis_server()
    if executable is None:
        reason = "redis-server not found (PATH, /usr/bin, /usr/sbin); install it: apt-get install redis-server"
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide redis-server for the Redis tier tests: {reason}", pytrace=False)
        pytest.skip(reason)
    server = RedisServer(executable, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_namespace(redis_server: RedisServer):
    """A fresh key namespace; the server is (re)started if an earlier test killed it."""
    redis_server.ensure_running()
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    yield namespace
    if answers_ping(redis_server.port):
        import redis

        client = redis.Redis.from_url(redis_server.url, socket_timeout=2)
        names = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if names:
            client.delete(*names)
        client.close()


@pytest.fixture(scope="session")
def redis_cluster_nodes(tmp_path_factory: pytest.TempPathFactory):
    """Three cluster-enabled redis-server masters on loopback (tests/storage/redis_cluster_nodes.py)."""
    from tests.storage.redis_cluster_nodes import RedisClusterNodes

    executable, cli = find_redis_server(), shutil.which("redis-cli")
    if executable is None or cli is None:
        reason = "redis-server and redis-cli (Debian: redis-server, redis-tools) are needed for the cluster tests"
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide them: {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = RedisClusterNodes(executable, cli, tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(redis_cluster_nodes):
    """The session's cluster with every node up (an earlier test may have killed or frozen one)."""
    redis_cluster_nodes.ensure_healthy()
    return redis_cluster_nodes
