"""RedisTier on a real three-node Redis Cluster: spread, dead and frozen nodes, slot migration, URLs."""
from __future__ import annotations

import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.config import ConfigError, load_config
from tierkv.storage.redis_tier import RedisTier
from tierkv.redis_url import parse_cluster_url
from tests.storage.blocks import make_block, same

pytestmark = pytest.mark.redis
redis = pytest.importorskip("redis")

TIMEOUT_S = 0.3
# long enough that the live nodes' work fits under it on a loaded machine, so one timeout, two (a retry) and
# none (skipped) read apart
FROZEN_TIMEOUT_S = 2.0


def key_of(i: int) -> str:
    return f"{i:064x}/L{i % 2}"


def wait_until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def make_tier(layout, redis_cluster):
    tiers = []
    namespace = f"cluster-{uuid.uuid4().hex[:10]}"

    def make(**kwargs) -> RedisTier:
        kwargs.setdefault("url", redis_cluster.url)
        kwargs.setdefault("namespace", namespace)
        kwargs.setdefault("timeout_s", TIMEOUT_S)
        tier = RedisTier("redis", layout, kwargs.pop("capacity_bytes", None), **kwargs)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def spread(tier: RedisTier, cluster, keys: list[str]) -> list[int]:
    """The node index that serves each key."""
    owners = cluster.owners()
    from redis.crc import key_slot

    return [owners[key_slot(tier._redis_key(k).encode())] for k in keys]


def test_blocks_spread_over_every_node_and_round_trip(layout, make_tier, redis_cluster):
    tier = make_tier(ttl_s=60)
    keys = [key_of(i) for i in range(48)]
    blocks = [make_block(layout, i) for i in range(48)]
    assert all(r.ok for r in tier.put_many(keys, blocks))
    nodes = spread(tier, redis_cluster, keys)
    assert set(nodes) == {0, 1, 2}  # 48 random slots: every node holds some
    for i in range(3):  # each key is stored on the node that serves its slot, with its TTL
        with redis_cluster.client(i) as client:
            for key, node in zip(keys, nodes):
                if node == i:
                    assert 0 < client.pttl(tier._redis_key(key)) <= 60_000
    got = tier.get_many(keys + [key_of(999)])
    assert got[-1] is None and all(same(g, b) for g, b in zip(got, blocks))
    assert tier.contains_many([keys[0], key_of(999)]) == [True, False]
    assert tier.remove_many([keys[0], keys[1], key_of(999)]) == [True, True, False]
    assert tier.get_many(keys[:2]) == [None, None]
    snap = tier.counters.snapshot()
    assert (snap["hits"], snap["misses"], snap["puts"], snap["removes"], snap["errors"]) == (48, 3, 48, 2, 0)
    assert tier.is_healthy and tier.down_nodes == []


def test_a_key_of_another_redis_type_on_a_node_is_a_counted_corrupt_miss_and_deleted(layout, make_tier,
                                                                                       redis_cluster):
    """A node's GET answers WRONGTYPE for a key holding a list: counted as a corrupt block (not a link error)
    and deleted, so the block can be stored again; the other keys are hits."""
    tier = make_tier()
    keys = [key_of(i) for i in range(6)]
    tier.put_many(keys, [make_block(layout, i) for i in range(6)])
    name = tier._redis_key(keys[2])
    with redis_cluster.client(spread(tier, redis_cluster, [keys[2]])[0]) as node:
        node.delete(name)
        node.rpush(name, b"x")
        got = tier.get_many(keys)
        assert got[2] is None and all(got[i] is not None for i in range(6) if i != 2)
        assert tier.counters["corrupt_blocks"] == 1 and tier.counters["errors"] == 0
        assert not node.exists(name)


def test_capacity_and_namespace_as_on_one_server(layout, make_tier):
    tier = make_tier(capacity_bytes=4 * layout.num_bytes)
    other = make_tier(namespace="cluster-other-" + uuid.uuid4().hex[:8])
    keys = [key_of(i) for i in range(6)]
    tier.put_many(keys[:4], [make_block(layout, i) for i in range(4)])
    assert tier.get(keys[0]) is not None  # keys[1] is now the least recently used
    tier.put_many(keys[4:], [make_block(layout, i) for i in range(4, 6)])
    assert tier.contains_many(keys) == [True, False, False, True, True, True]
    assert tier.used_bytes == 4 * layout.num_bytes and tier.counters["evictions"] == 2
    assert other.get_many(keys) == [None] * 6


def test_a_killed_node_costs_only_its_keys_and_recovers(layout, make_tier, redis_cluster):
    tier = make_tier(retry_interval_s=0.5)
    keys = [key_of(i) for i in range(60)]
    blocks = [make_block(layout, i) for i in range(60)]
    assert all(r.ok for r in tier.put_many(keys, blocks))
    nodes = spread(tier, redis_cluster, keys)
    dead = nodes[0]
    redis_cluster.kill(dead)
    got = tier.get_many(keys)
    assert [g is None for g in got] == [n == dead for n in nodes]
    assert all(same(g, b) for g, b, n in zip(got, blocks, nodes) if n != dead)
    assert tier.is_healthy and tier.down_nodes == [redis_cluster.nodes[dead].address]
    fresh = [make_block(layout, 100 + i) for i in range(60)]
    results = tier.put_many(keys, fresh)  # within the retry interval: the dead node is skipped
    assert [r.ok for r in results] == [n != dead for n in nodes]
    assert all("unavailable" in r.error for r in results if not r.ok)
    assert tier.counters["put_failures"] == nodes.count(dead) and tier.counters["errors"] == 2
    redis_cluster.restart(dead)  # same port, same cluster config file: it serves its slots again, empty
    wait_until(lambda: tier.put_many(keys, fresh) and tier.down_nodes == [] and all(
        g is not None for g in tier.get_many(keys)), what="the restarted node to serve again")
    assert all(same(g, b) for g, b in zip(tier.get_many(keys), fresh))


def test_a_frozen_node_stalls_one_call_for_at_most_the_timeout(layout, make_tier, redis_cluster):
    """A node that accepts connections and never answers: one call waits timeout_s, later calls skip it."""
    tier = make_tier(retry_interval_s=30.0, timeout_s=FROZEN_TIMEOUT_S)
    keys = [key_of(i) for i in range(30)]
    blocks = [make_block(layout, i) for i in range(30)]
    assert all(r.ok for r in tier.put_many(keys, blocks))
    nodes = spread(tier, redis_cluster, keys)
    frozen = nodes[0]
    redis_cluster.freeze(frozen)
    try:
        started = time.monotonic()
        got = tier.get_many(keys)
        first_s = time.monotonic() - started
        started = time.monotonic()
        again = tier.get_many(keys)
        assert not tier.put(keys[0], blocks[0]).ok
        later_s = time.monotonic() - started
    finally:
        redis_cluster.thaw(frozen)
    assert [g is None for g in got] == [n == frozen for n in nodes]
    assert [g is None for g in again] == [n == frozen for n in nodes]
    assert FROZEN_TIMEOUT_S * 0.9 <= first_s < 2 * FROZEN_TIMEOUT_S  # one timeout, not one per key or per retry
    assert later_s < FROZEN_TIMEOUT_S  # the frozen node is skipped without touching the network
    assert tier.down_nodes == [redis_cluster.nodes[frozen].address]


def test_no_reachable_node_starts_unhealthy_and_answers_at_once(layout, free_cluster_url, caplog):
    url = free_cluster_url.replace("://", "://app:Sup3rSecretPw@")
    started = time.monotonic()
    with RedisTier("redis", layout, None, url=url, timeout_s=TIMEOUT_S, retry_interval_s=60) as tier:
        assert not tier.is_healthy and tier.counters["errors"] == 1
        assert tier.get(key_of(1)) is None and not tier.put(key_of(1), make_block(layout, 1)).ok
        assert tier.contains_many([key_of(1)]) == [False] and tier.remove(key_of(1)) is False
        assert tier.counters["errors"] == 5 and tier.down_nodes == ["topology"]
        assert tier.last_error and "Sup3rSecretPw" not in tier.last_error
    assert time.monotonic() - started < 2
    assert caplog.records and "Sup3rSecretPw" not in caplog.text


@pytest.fixture
def free_cluster_url():
    from tests.storage.conftest import free_port

    return f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"


def test_blocks_stay_findable_while_and_after_their_slots_move(layout, make_tier, redis_cluster):
    """Slots of one node move to another (CLUSTER SETSLOT IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE).

    While the first slot is migrating, one of its keys has already moved and a new key of it is
    written (both answered with ASK), and lookups go on; afterwards the old owner answers MOVED."""
    from redis.crc import key_slot

    tier = make_tier()
    keys = [key_of(i) for i in range(30)]
    blocks = [make_block(layout, i) for i in range(30)]
    assert all(r.ok for r in tier.put_many(keys, blocks))
    nodes = spread(tier, redis_cluster, keys)
    src, dst = nodes[0], (nodes[0] + 1) % 3
    slot_of = lambda key: key_slot(tier._redis_key(key).encode())  # noqa: E731
    first = slot_of(keys[0])
    new_key = next(key_of(i) for i in range(1000, 10**6) if slot_of(key_of(i)) == first)  # same slot, not stored
    new_block = make_block(layout, 7)
    slots = [first] + sorted({slot_of(k) for k, n in zip(keys, nodes) if n == src} - {first})
    during: list = []

    def while_migrating(slot: int) -> None:
        if slot != first:
            return
        with redis_cluster.client(src) as source:  # keys[0] moves first: src answers ASK for it
            source.execute_command("MIGRATE", "127.0.0.1", redis_cluster.nodes[dst].port, "", 0, 5000,
                                   "KEYS", tier._redis_key(keys[0]))
        during.append(tier.get_many(keys))
        during.append(tier.put(new_key, new_block))
        with redis_cluster.client(dst) as target:
            pipe = target.pipeline(transaction=False)
            pipe.execute_command("ASKING")
            pipe.exists(tier._redis_key(new_key))
            during.append(pipe.execute()[1])
        during.append(tier.get(new_key))

    redis_cluster.move_slots(slots, src, dst, before_migrate=while_migrating)
    got, put, on_target, new_got = during
    assert all(same(g, b) for g, b in zip(got, blocks))
    assert put.ok and on_target == 1 and same(new_got, new_block)
    assert all(same(g, b) for g, b in zip(tier.get_many(keys), blocks))  # MOVED, then the patched map
    assert spread(tier, redis_cluster, keys) == [dst if n == src else n for n in nodes]
    assert tier.contains_many(keys + [new_key]) == [True] * 31 and tier.counters["errors"] == 0


# -- URLs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, problem", [
    ("redis+cluster://", "no startup node"),
    ("redis+cluster://h1:7000,", "has no host"),
    ("redis+cluster://h1:7000,h2:notaport", "h2:notaport"),
    ("redis+cluster://h1:7000/3", "only database 0"),
    ("redis+cluster://h1:7000?timeout=1", "no query"),
    ("redis+cluster://h1:99999", "h1:99999"),
    ("redis+cluster://h1:7000,bad_host!:7000", "not a valid name"),
])  # fmt: skip
def test_bad_cluster_urls_name_the_key_and_the_problem(url, problem):
    with pytest.raises(ConfigError, match=problem) as info:
        load_config({"tiers": [{"kind": "cpu"}, {"kind": "redis", "url": url, "trusted": True}]}, env={})
    assert info.value.key == "tiers[1].url" and "redis+cluster://" in str(info.value)


hosts = st.one_of(st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z0-9-]{1,10}){0,2}", fullmatch=True),
                  st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t))))


@settings(max_examples=200, deadline=None)
@given(nodes=st.lists(st.tuples(hosts, st.one_of(st.none(), st.integers(1, 65535))), min_size=1, max_size=6),
       tls=st.booleans(), db=st.sampled_from(["", "/", "/0"]))
def test_cluster_urls_parse_to_their_startup_nodes(nodes, tls, db):
    url = f"{'rediss' if tls else 'redis'}+cluster://" + ",".join(
        host if port is None else f"{host}:{port}" for host, port in nodes) + db
    parsed = parse_cluster_url(url)
    assert parsed.is_tls == tls
    assert parsed.startup_nodes == [(host, 6379 if port is None else port) for host, port in nodes]
    load_config({"tiers": [{"kind": "cpu"}, {"kind": "redis", "url": url, "trusted": True}]}, env={})


def test_cluster_url_credentials():
    parsed = parse_cluster_url("redis+cluster://app:s%40cret@h1:7000,h2")
    assert (parsed.username, parsed.password, parsed.startup_nodes) == ("app", "s@cret", [("h1", 7000), ("h2", 6379)])
