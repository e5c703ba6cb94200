"""Failures the chain must count and report as they are, never as stored: a disk directory replaced by a file,
Redis refusing single SETs (OOM at maxmemory, READONLY), a write-through backlog dropped at close."""
from __future__ import annotations

import logging
import shutil

import pytest

from tests.storage.blocks import make_block, same
from tierkv.storage.chain import TierChain
from tierkv.storage.cpu import CpuTier
from tierkv.storage.disk import DiskTier


def key_of(i: int) -> str:
    return f"{i:064x}/L{i % 2}"


def write(chain: TierChain, layout, ids: list[int]) -> None:
    keys = [key_of(i) for i in ids]
    assert all(r.ok for r in chain.put_many(keys, [make_block(layout, i) for i in ids]))
    chain.write_through(keys)
    chain.flush()


def _warnings(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == logger]


def test_a_directory_replaced_by_a_file_fails_puts_instead_of_counting_them_stored(layout, tmp_path, caplog):
    """The directory swapped for a regular file (ENOTDIR under it): the active segment, unlinked with it, is
    forgotten (its blocks lost, counted), puts fail and count as failed write-throughs, one line per kind of
    failure; once the file is gone the directory is made again and puts succeed."""
    path = tmp_path / "disk"
    cpu = CpuTier("cpu", layout, 64 * layout.num_bytes, pin_memory=False)
    disk = DiskTier("disk", layout, 64 * layout.num_bytes, path)
    chain = TierChain([cpu, disk], write_through=[False, True])
    try:
        write(chain, layout, [0, 1, 2, 3])
        shutil.rmtree(path)
        path.write_text("x")  # a tmp cleaner, then someone's file under the name
        with caplog.at_level(logging.WARNING, logger="tierkv.storage.disk"):
            for i in range(4, 24):
                write(chain, layout, [i])
        stats = chain.snapshot()
        assert stats["chain"]["written_through"] == 4 and stats["chain"]["write_through_failed"] == 20
        assert disk.counters["put_failures"] == 20 and disk.counters["puts"] == 4
        assert disk.counters["lost_blocks"] == 4 and disk.used_bytes == 0
        assert disk.contains_many([key_of(i) for i in range(24)]) == [False] * 24
        lines = _warnings(caplog, "tierkv.storage.disk")
        assert len(lines) <= 3, lines  # segment lost, directory gone, put failed: not a line per put
        assert not any("stat" in line for line in lines), lines

        path.unlink()  # the file removed: the next put makes the directory again
        write(chain, layout, [24])
        assert disk.counters["puts"] == 5 and same(disk.get(key_of(24)), make_block(layout, 24))
    finally:
        chain.close()


@pytest.mark.redis
def test_redis_at_maxmemory_reports_its_oom_replies(layout, redis_server, redis_namespace, caplog):
    """maxmemory with noeviction: every SET gets an OOM error reply. Each counts as a failed put, and the reply
    is logged naming the tier (once per 10 s), kept as the tier's last_error and in the chain's spill_errors,
    as a disk's ENOSPC is; the tier stays healthy (it still serves reads)."""
    pytest.importorskip("redis")
    import redis as redislib

    from tierkv.storage.redis_tier import RedisTier

    client = redislib.Redis.from_url(redis_server.url, socket_timeout=2)
    old = client.config_get("maxmemory*")
    tier = RedisTier("redis", layout, None, url=redis_server.url, namespace=redis_namespace)
    chain = TierChain([CpuTier("cpu", layout, 4 * layout.num_bytes, pin_memory=False), tier],
                      write_through=[False, True])
    try:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # below what the server uses already: every write is refused
        with caplog.at_level(logging.WARNING, logger="tierkv.storage.redis_tier"):
            for i in range(8):  # CPU holds 4: the rest spill to Redis too
                write(chain, layout, [i])
        stats = chain.snapshot()
        assert tier.counters["puts"] == 0 and tier.counters["put_failures"] >= 8
        assert stats["chain"]["write_through_failed"] == 8 and stats["chain"]["dropped"] == 4
        lines = _warnings(caplog, "tierkv.storage.redis_tier")
        assert len(lines) == 1 and "redis:" in lines[0] and "maxmemory" in lines[0], lines
        assert stats["chain"]["spill_errors"] and "maxmemory" in stats["chain"]["spill_errors"][-1]
        assert "maxmemory" in tier.last_error and tier.is_healthy
    finally:
        client.config_set("maxmemory", old["maxmemory"])
        client.config_set("maxmemory-policy", old["maxmemory-policy"])
        client.close()
        chain.close()


@pytest.mark.redis
def test_a_readonly_reply_is_logged_and_kept(layout, redis_server, redis_namespace, caplog, monkeypatch):
    """A replica's READONLY reply (here the link's reply, as redis-py returns it) is a failed put, logged and
    kept in last_error; a later link failure is the newer last_error."""
    redislib = pytest.importorskip("redis")

    from tierkv.storage.redis_tier import RedisTier

    tier = RedisTier("redis", layout, None, url=redis_server.url, namespace=redis_namespace)
    readonly = redislib.exceptions.ReadOnlyError("You can't write against a read only replica.")
    monkeypatch.setattr(tier._link, "set_many", lambda names, values, ttl_ms: [readonly] * len(names))
    try:
        with caplog.at_level(logging.WARNING, logger="tierkv.storage.redis_tier"):
            (result,) = tier.put_many([key_of(0)], [make_block(layout, 0)])
        assert not result.ok and "read only replica" in result.error and tier.counters["put_failures"] == 1
        assert any("read only replica" in line for line in _warnings(caplog, "tierkv.storage.redis_tier"))
        assert "read only replica" in tier.last_error and tier.is_healthy
        tier._link.last_error = "127.0.0.1: ConnectionError: a newer failure"  # as _mark_down sets it
        assert tier.last_error == "127.0.0.1: ConnectionError: a newer failure"
    finally:
        tier.close()


@pytest.mark.redis
def test_a_backlog_dropped_at_close_is_counted_failed_once(layout, redis_server, redis_namespace):
    """Redis down until close: the blocks it never got count in write_through_failed, and the backlog that
    held them is empty afterwards (not reported pending as well)."""
    pytest.importorskip("redis")
    from tierkv.storage.redis_tier import RedisTier

    tier = RedisTier("redis", layout, None, url=redis_server.url, namespace=redis_namespace, retry_interval_s=60)
    chain = TierChain([CpuTier("cpu", layout, 64 * layout.num_bytes, pin_memory=False), tier],
                      write_through=[False, True])
    try:
        redis_server.kill()
        write(chain, layout, [0, 1, 2])
        write(chain, layout, [3, 4])
        assert chain.snapshot()["chain"]["write_through_backlog"] == 5
        chain.close()
        stats = chain.snapshot()["chain"]
        assert stats["write_through_failed"] == 5 and stats["write_through_backlog"] == 0
    finally:
        chain.close()
        redis_server.ensure_running()
