"""RedisTier against a real redis-server: round trips, TTL, corrupt values, a dying server."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.storage.redis_tier import RedisTier
from tests.storage.blocks import make_block

pytestmark = pytest.mark.redis
redis = pytest.importorskip("redis")


def key_of(i: int, layer: int = 0) -> str:
    return f"{i:064x}/L{layer}"


def wait_until(condition, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


class _Recording:
    """A redis client that notes the name of every attribute asked of it (a command, its connection pool)."""

    def __init__(self, client, touched: list):
        self._client, self._touched = client, touched

    def __getattr__(self, name):
        self._touched.append(name)
        return getattr(self._client, name)


@pytest.fixture
def raw(redis_server, redis_namespace):
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    yield client
    client.close()


@pytest.fixture
def make_tier(layout, redis_server, redis_namespace):
    tiers = []

    def make(block_layout=None, **kwargs) -> RedisTier:
        kwargs.setdefault("url", redis_server.url)
        kwargs.setdefault("namespace", redis_namespace)
        capacity_bytes = kwargs.pop("capacity_bytes", None)
        tier = RedisTier("redis", block_layout or layout, capacity_bytes, **kwargs)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def test_round_trip_single_and_batched(layout, make_tier, raw, redis_namespace):
    tier = make_tier()
    blocks = [make_block(layout, i) for i in range(6)]
    keys = [key_of(i) for i in range(6)]
    assert tier.put(keys[0], blocks[0]).ok
    assert all(r.ok for r in tier.put_many(keys[1:], blocks[1:]))
    assert raw.exists(f"{redis_namespace}:{keys[0]}")
    got = tier.get_many(keys + [key_of(99)])
    assert got[-1] is None
    assert all(torch.equal(g.view(torch.int16), b.view(torch.int16)) for g, b in zip(got, blocks))
    assert tier.contains_many([keys[0], key_of(99)]) == [True, False]
    assert tier.remove_many([keys[0], key_of(99)]) == [True, False]
    assert not tier.contains(keys[0]) and tier.get(keys[0]) is None
    snap = tier.counters.snapshot()
    assert (snap["hits"], snap["misses"], snap["puts"], snap["removes"], snap["errors"]) == (6, 2, 6, 1, 0)
    assert tier.is_healthy


def test_ttl_expires_blocks(layout, make_tier, raw, redis_namespace):
    tier = make_tier(ttl_s=0.2)
    assert tier.put(key_of(1), make_block(layout, 1)).ok
    assert 0 < raw.pttl(f"{redis_namespace}:{key_of(1)}") <= 200
    wait_until(lambda: tier.get(key_of(1)) is None, timeout_s=3, what="the TTL to expire the block")
    assert tier.used_bytes == 0  # the client-side record of it is dropped with it


@pytest.mark.parametrize("damage", ["flip_payload_byte", "flip_header_byte", "truncate", "garbage"])
def test_corrupt_value_is_a_counted_miss_and_deleted(layout, make_tier, raw, redis_namespace, damage):
    tier = make_tier()
    key, name = key_of(3), f"{redis_namespace}:{key_of(3)}"
    tier.put(key, make_block(layout, 3))
    value = bytearray(raw.get(name))
    if damage == "flip_payload_byte":
        value[-1] ^= 0x80
    elif damage == "flip_header_byte":
        value[9] ^= 0x01
    elif damage == "truncate":
        value = value[: len(value) - 10]
    else:
        value = bytearray(b"not a block")
    raw.set(name, bytes(value))
    assert tier.get(key) is None
    assert tier.counters["corrupt_blocks"] == 1 and tier.counters["misses"] == 1
    assert not raw.exists(name)
    assert tier.is_healthy


def test_an_intact_block_of_another_layout_is_a_foreign_miss_and_deleted(layout, make_tier, raw, redis_namespace):
    """A block of another layout under a key (block addresses name the storage formats, so an older writer's):
    a miss counted as foreign_records, not corrupt_blocks, and deleted; never held (contains_many), so a chain
    stores the block over it."""
    other = BlockLayout(layout.num_kv_heads, layout.block_tokens + 1, layout.head_dim, torch.uint8)  # int8 codes, scales
    theirs, ours = make_tier(block_layout=other), make_tier()
    assert theirs.put(key_of(5), torch.randint(0, 255, other.shape, dtype=torch.uint8)).ok
    assert ours.contains_many([key_of(5)]) == [False] and ours.get(key_of(5)) is None
    assert ours.counters["foreign_records"] == 1 and ours.counters["corrupt_blocks"] == 0
    assert ours.contains_many([key_of(5)]) == [False] and not raw.exists(f"{redis_namespace}:{key_of(5)}")
    block = make_block(layout, 5)
    assert ours.put(key_of(5), block).ok and torch.equal(ours.get(key_of(5)), block)


@pytest.mark.parametrize("kind", ["list", "hash"])
def test_a_key_of_another_redis_type_is_a_counted_corrupt_miss_and_deleted(layout, make_tier, raw, redis_namespace,
                                                                           kind):
    """MGET answers nil for a key holding a list or a hash: not a plain miss (EXISTS says it is there, so a
    write-through would never store the block again) but a corrupt value, counted and deleted."""
    tier = make_tier()
    keys = [key_of(i) for i in range(4)]
    tier.put_many(keys, [make_block(layout, i) for i in range(4)])
    name = f"{redis_namespace}:{keys[1]}"
    raw.delete(name)
    raw.rpush(name, b"x") if kind == "list" else raw.hset(name, "f", b"x")
    got = tier.get_many(keys + [key_of(99)])  # and one key that is simply missing
    assert got[1] is None and got[4] is None and all(got[i] is not None for i in (0, 2, 3))
    assert tier.counters["corrupt_blocks"] == 1 and tier.counters["misses"] == 2
    assert not raw.exists(name) and tier.contains_many(keys) == [True, False, True, True]
    assert tier.counters["errors"] == 0 and tier.is_healthy


def test_namespaces_are_isolated(layout, make_tier, redis_namespace):
    ours, theirs = make_tier(), make_tier(namespace=redis_namespace + "-other")
    ours.put(key_of(1), make_block(layout, 1))
    assert theirs.get(key_of(1)) is None and not theirs.contains(key_of(1))
    theirs.put(key_of(1), make_block(layout, 2))
    assert torch.equal(ours.get(key_of(1)), make_block(layout, 1))
    theirs.remove(key_of(1))


def test_capacity_deletes_least_recently_used(layout, make_tier, raw, redis_namespace):
    tier = make_tier(capacity_bytes=3 * layout.num_bytes + 5)  # 3 blocks
    keys = [key_of(i) for i in range(4)]
    tier.put_many(keys[:3], [make_block(layout, i) for i in range(3)])
    assert tier.get(keys[0]) is not None  # 1 is now the least recently used
    result = tier.put(keys[3], make_block(layout, 3))
    assert result.ok and result.evicted == []
    assert [raw.exists(f"{redis_namespace}:{k}") for k in keys] == [1, 0, 1, 1]
    assert tier.used_bytes == 3 * layout.num_bytes and tier.counters["evictions"] == 1


def test_server_killed_between_batches(layout, make_tier, redis_server):
    tier = make_tier(retry_interval_s=30.0)
    keys = [key_of(i) for i in range(8)]
    blocks = [make_block(layout, i) for i in range(8)]
    assert all(r.ok for r in tier.put_many(keys[:4], blocks[:4]))
    redis_server.kill()
    results = tier.put_many(keys[4:], blocks[4:])  # no exception reaches us
    assert [r.ok for r in results] == [False] * 4 and all("unavailable" in r.error for r in results)
    assert not tier.is_healthy
    errors = tier.counters["errors"]
    client, touched = tier._link._client, []
    tier._link._client = _Recording(client, touched)  # unhealthy: answered without touching the network
    assert tier.get_many(keys) == [None] * 8
    assert tier.contains_many(keys) == [False] * 8 and tier.remove_many(keys) == [False] * 8
    assert not tier.put(keys[0], blocks[0]).ok
    tier._link._client = client
    assert touched == []
    assert tier.counters["errors"] == errors + 4
    assert tier.counters["put_failures"] == 5


def test_server_killed_during_large_get_many(layout, make_tier, redis_server):
    tier = make_tier(retry_interval_s=30.0)
    keys = [key_of(i) for i in range(64)]
    blocks = [make_block(layout, i) for i in range(64)]
    assert all(r.ok for r in tier.put_many(keys, blocks))
    tier._batch_len = 4  # many round trips, so the kill lands mid-batch
    first_chunk_done = threading.Event()
    real_per_key = tier._link.per_key

    def slow_per_key(command, names, args=None):
        first_chunk_done.set()
        time.sleep(0.005)  # keeps the batch in flight while the killer thread runs
        return real_per_key(command, names, args)

    tier._link.per_key = slow_per_key
    killer = threading.Thread(target=lambda: (first_chunk_done.wait(5), redis_server.kill()))
    killer.start()
    got = tier.get_many(keys)
    killer.join(5)
    assert all(g is None or torch.equal(g, b) for g, b in zip(got, blocks))
    assert any(g is None for g in got)
    assert not tier.is_healthy and tier.counters["errors"] >= 1
    assert tier.counters["lookups"] == 64 and tier.counters["hits"] == sum(g is not None for g in got)


def test_recovers_after_server_restart(layout, make_tier, redis_server):
    tier = make_tier(retry_interval_s=0.2)
    redis_server.kill()
    assert tier.get(key_of(1)) is None
    assert not tier.is_healthy
    redis_server.restart()
    wait_until(lambda: tier.put(key_of(1), make_block(layout, 1)).ok, timeout_s=5, what="the tier to recover")
    assert tier.is_healthy
    assert torch.equal(tier.get(key_of(1)), make_block(layout, 1))


def test_malformed_url_raises_naming_it(layout):
    for url in ["localhost:6379", "redis://host:notaport", "http://host:6379", "redis://", "redis://host/db0"]:
        with pytest.raises(ValueError, match="malformed Redis url") as info:
            RedisTier("redis", layout, None, url=url)
        assert repr(url) in str(info.value)


def test_server_down_at_construction_starts_unhealthy(layout):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket closes
    started = time.monotonic()
    with RedisTier("redis", layout, None, url=f"redis://127.0.0.1:{port}/0", retry_interval_s=60) as tier:
        assert time.monotonic() - started < 2
        assert not tier.is_healthy and tier.counters["errors"] == 1
        assert tier.get(key_of(1)) is None and not tier.put(key_of(1), make_block(layout, 1)).ok
        assert "Connection" in tier.last_error


def test_a_namespace_of_corrupt_values_logs_one_line(layout, make_tier, raw, redis_namespace, caplog):
    import logging

    tier = make_tier()
    keys = [key_of(i) for i in range(12)]
    tier.put_many(keys, [make_block(layout, i) for i in range(12)])
    for key in keys:
        raw.set(f"{redis_namespace}:{key}", b"garbage")
    with caplog.at_level(logging.WARNING, logger="tierkv.storage.redis_tier"):
        assert tier.get_many(keys) == [None] * 12
    assert tier.counters["corrupt_blocks"] == 12
    assert len([r for r in caplog.records if "corrupt value" in r.getMessage()]) == 1


def test_refused_credentials_are_logged_as_such_not_as_an_unreachable_server(layout, make_tier, raw, redis_server,
                                                                             caplog):
    raw.execute_command("ACL", "SETUSER", "tierkv-probe", "on", ">right-password", "~*", "+@all")
    try:
        url = redis_server.url.replace("redis://", "redis://tierkv-probe:wrong-password@", 1)
        with caplog.at_level("WARNING", logger="tierkv"):
            tier = make_tier(url=url)
            assert tier.get(key_of(0)) is None and not tier.put(key_of(0), make_block(layout, 0)).ok
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "refused this tier's credentials" in logged and "unreachable" not in logged
        assert "wrong-password" not in logged
    finally:
        raw.execute_command("ACL", "DELUSER", "tierkv-probe")


def test_a_giant_value_planted_under_a_key_is_not_read_into_memory(layout, make_tier, raw):
    """A value of hundreds of MB under a block's key was read whole by MGET: now only a bounded prefix is sent;
    the key counts as corrupt, not held, and the next store replaces it."""
    tier = make_tier()
    keys = [key_of(i) for i in range(3)]
    assert all(r.ok for r in tier.put_many(keys, [make_block(layout, i) for i in range(3)]))
    raw.set(tier._redis_key(keys[1]), b"\0" * (64 << 20))
    sent = []
    real_per_key = tier._link.per_key

    def measured(command, names, args=None):
        replies = real_per_key(command, names, args)
        sent.extend(len(r[1]) for r in replies if isinstance(r, tuple) and isinstance(r[1], bytes))
        return replies

    tier._link.per_key = measured
    got = tier.get_many(keys)
    assert got[1] is None and torch.equal(got[0], make_block(layout, 0)) and torch.equal(got[2], make_block(layout, 2))
    assert max(sent) < 1 << 20 and tier.counters["corrupt_blocks"] == 1
    assert tier.contains_many(keys) == [True, False, True]
    assert tier.put(keys[1], make_block(layout, 1)).ok and torch.equal(tier.get(keys[1]), make_block(layout, 1))
