"""The Redis tier shared by several writers: no read deletes a block another writer stored since, a key holds a
block only when its value could be one (so spills and write-throughs store over bad values), a slot migrating
to a stopped node costs one timeout, and a redis:// url at a cluster node is refused. One server and a cluster."""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.storage.auth import BlockSealer
from tierkv.storage.chain import TierChain
from tierkv.storage.cpu import CpuTier
from tierkv.storage.redis_tier import RedisTier
from tierkv.storage.sealed import SealedTier
from tests.storage.blocks import make_block, same

pytestmark = pytest.mark.redis
redis = pytest.importorskip("redis")

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=8, head_dim=32, dtype=torch.bfloat16)
WHERE = ["server", "cluster"]


def key_of(i: int) -> str:
    return f"{i:064x}/L{i % 3}"


@pytest.fixture
def store(request):
    """(url, raw client for a tier's redis key) of the session's server or cluster, by the test's `where`."""
    if request.node.callspec.params["where"] == "server":
        server = request.getfixturevalue("redis_server")
        server.ensure_running()
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        yield server.url, client
    else:
        cluster = request.getfixturevalue("redis_cluster")
        nodes = [redis.cluster.ClusterNode("127.0.0.1", node.port) for node in cluster.nodes]
        client = redis.cluster.RedisCluster(startup_nodes=nodes, socket_timeout=2)
        yield cluster.url, client
    client.close()


@pytest.fixture
def make_tier(store):
    url, _ = store
    namespace = f"race-{uuid.uuid4().hex[:10]}"
    made = []

    def make(layout: BlockLayout = LAYOUT, **kwargs) -> RedisTier:
        kwargs.setdefault("timeout_s", 0.5)
        tier = RedisTier(f"redis{len(made)}", layout, kwargs.pop("capacity_bytes", None), url=url,
                         namespace=namespace, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def before_command(tier: RedisTier, command: str, action) -> None:
    """Run `action()` once, right before `tier` sends its first batch of `command` (a per-key command)."""
    link, sent = tier._link, []
    original = link.per_key

    def per_key(cmd, names, args=None):
        if cmd == command and not sent:
            sent.append(cmd)
            action()
        return original(cmd, names, args)

    link.per_key = per_key


# -- deletes race no writer ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", WHERE)
def test_a_miss_keeps_a_block_stored_between_its_get_and_its_type_check(make_tier, where):
    """A's read misses (GET nil); B stores the block, told ok; A then asks the key's TYPE ("string" now)."""
    a, b = make_tier(), make_tier()
    key, block = key_of(7), make_block(LAYOUT, 7)
    before_command(a, "type", lambda: b.put(key, block))
    assert a.get(key) is None
    assert same(b.get(key), block) and a.counters["corrupt_blocks"] == 0


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("bad", ["garbage", "list"])
def test_a_bad_value_rewritten_before_its_delete_stays(make_tier, store, where, bad):
    """A reads a damaged value (or a list) under a block's key and deletes it; B stored the block there after A's
    read and before A's delete: the delete leaves B's block."""
    _, raw = store
    a, b = make_tier(), make_tier()
    key, block = key_of(3), make_block(LAYOUT, 3)
    name = a._redis_key(key)
    if bad == "garbage":
        raw.set(name, b"not a block" * 10)
    else:
        raw.rpush(name, b"x")
    before_command(a, "drop_if_same" if bad == "garbage" else "drop_if_not_string", lambda: b.put(key, block))
    assert a.get(key) is None and a.counters["corrupt_blocks"] == 1
    assert same(b.get(key), block)


@pytest.mark.parametrize("where", WHERE)
def test_an_unchanged_bad_value_is_still_deleted(make_tier, store, where):
    _, raw = store
    tier = make_tier()
    names = [tier._redis_key(key_of(i)) for i in range(3)]
    raw.set(names[0], b"garbage")
    raw.rpush(names[1], b"x")
    raw.hset(names[2], "f", "v")
    assert tier.get_many([key_of(i) for i in range(3)]) == [None] * 3
    assert tier.counters["corrupt_blocks"] == 3 and not any(raw.exists(n) for n in names)


@pytest.mark.parametrize("where", WHERE)
def test_a_reader_beside_a_writer_loses_no_block(make_tier, where):
    """One tier reads every key over and over while another stores them: each block told stored is there after."""
    reader, writer = make_tier(), make_tier()
    keys = [key_of(i) for i in range(240)]
    blocks = [make_block(LAYOUT, i) for i in range(240)]
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            reader.get_many(keys)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for start in range(0, len(keys), 8):
            assert all(r.ok for r in writer.put_many(keys[start : start + 8], blocks[start : start + 8]))
    finally:
        done.set()
        thread.join()
    assert all(same(g, b) for g, b in zip(writer.get_many(keys), blocks))
    assert reader.counters["corrupt_blocks"] == 0


@pytest.mark.parametrize("where", ["server"])
def test_a_sealed_value_rewritten_before_its_delete_stays(store, where):
    """A sealed tier's read of a forged value deletes it only while it is still the forged one."""
    url, _ = store
    sealer = BlockSealer(b"secret-0123456789abcdef", LAYOUT, encrypt=False)
    namespace = f"sealed-race-{uuid.uuid4().hex[:10]}"
    inners = [RedisTier(f"r{i}", sealer.sealed_layout, None, url=url, namespace=namespace) for i in range(2)]
    a, b = (SealedTier(inner, LAYOUT, sealer) for inner in inners)
    try:
        key, block = key_of(5), make_block(LAYOUT, 5)
        forged = torch.randint(0, 256, sealer.sealed_layout.shape, dtype=torch.uint8)
        assert inners[0].put(sealer.name(key), forged).ok
        before_command(inners[0], "drop_if_same", lambda: b.put(key, block))
        assert a.get(key) is None and a.counters["auth_failures"] == 1
        assert same(b.get(key), block)
        assert inners[1].put(sealer.name(key), forged).ok and a.get(key) is None
        assert not inners[0].contains(sealer.name(key))  # unchanged since the read: deleted
    finally:
        for tier in (a, b):
            tier.close()


# -- what a key holds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", WHERE)
def test_a_key_holds_a_block_only_as_a_value_that_could_be_one(make_tier, store, where):
    _, raw = store
    tier, theirs = make_tier(ttl_s=60), make_tier(BlockLayout(2, 9, 32, torch.bfloat16))
    good = [key_of(i) for i in range(2)]
    assert all(r.ok for r in tier.put_many(good, [make_block(LAYOUT, 0), make_block(LAYOUT, 1)]))
    bad = [key_of(i) for i in range(10, 15)]
    value = raw.get(tier._redis_key(good[0]))
    raw.set(tier._redis_key(bad[0]), b"garbage")
    raw.set(tier._redis_key(bad[1]), value[:-1])  # truncated
    raw.rpush(tier._redis_key(bad[2]), b"x")
    assert theirs.put(bad[3], make_block(theirs.layout, 3)).ok  # another layout
    raw.set(tier._redis_key(bad[4]), value.replace(good[0].encode(), bad[4].encode()), px=5000)  # expiring soon
    assert tier.contains_many(good + bad + [key_of(99)]) == [True, True] + [False] * 6
    assert tier.counters["errors"] == 0
    hour = make_tier(ttl_s=3600)  # well before its expiry a key holds its block: reuse keeps nearly all of ttl_s
    raw.pexpire(tier._redis_key(good[1]), 20 * 60_000)
    assert hour.contains_many(good) == [True, True]


@pytest.mark.parametrize("where", WHERE)
def test_a_spill_stores_a_block_over_a_bad_value(make_tier, store, where):
    """The chain spills a block evicted from the CPU tier to Redis unless Redis holds it: garbage there is not
    holding it, so the block is stored and read back."""
    _, raw = store
    redis_tier = make_tier()
    cpu = CpuTier("cpu", LAYOUT, 2 * LAYOUT.num_bytes, pin_memory=False)
    chain = TierChain([cpu, redis_tier])
    try:
        raw.set(redis_tier._redis_key(key_of(5)), b"garbage from another writer")
        chain.put_many([key_of(i) for i in range(5, 9)], [make_block(LAYOUT, i) for i in range(5, 9)])
        chain.flush()
        assert not cpu.contains(key_of(5))
        assert same(chain.get_many([key_of(5)])[0], make_block(LAYOUT, 5))
    finally:
        chain.close()


# -- cluster topology ------------------------------------------------------------------------------------
def test_a_slot_migrating_to_a_stopped_node_costs_one_timeout(redis_cluster):
    """Keys of a slot MIGRATING to a frozen node get ASK; the first follow's timeout marks that node down and the
    batch's other keys for it are answered at once (they used to wait one timeout each)."""
    from redis.crc import key_slot

    namespace = "{race-ask}"
    tier = RedisTier("redis", LAYOUT, None, url=redis_cluster.url, namespace=namespace, timeout_s=0.3)
    slot = key_slot(namespace.encode())
    src = redis_cluster.owners()[slot]
    dst = (src + 1) % 3
    with redis_cluster.client(src) as source, redis_cluster.client(dst) as target:
        target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", redis_cluster.node_id(src))
        source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", redis_cluster.node_id(dst))
    redis_cluster.freeze(dst)
    try:
        start = time.monotonic()
        assert tier.get_many([key_of(i) for i in range(60)]) == [None] * 60
        elapsed = time.monotonic() - start
        assert tier.down_nodes == [redis_cluster.nodes[dst].address]
        assert elapsed < 6.0, f"60 keys redirected to a stopped node took {elapsed:.1f} s"
    finally:
        redis_cluster.thaw(dst)
        for i in (src, dst):
            with redis_cluster.client(i) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        tier.close()


def test_a_redis_url_at_a_cluster_node_is_refused_naming_the_cluster_url(redis_cluster, monkeypatch):
    from tierkv.storage.redis_link import SingleLink

    closed = []
    real_close = SingleLink.close
    monkeypatch.setattr(SingleLink, "close", lambda link: (closed.append(link), real_close(link)))
    with pytest.raises(ValueError, match=r"Redis Cluster node.*redis\+cluster://"):
        RedisTier("redis", LAYOUT, None, url=redis_cluster.nodes[0].url)
    assert len(closed) == 1  # the refused start left no connection open


def test_a_server_without_scripting_keeps_a_bad_value_that_is_then_not_held(tmp_path):
    """EVAL renamed away (a managed server): the conditional delete fails, so the damaged value stays; reads stay
    misses (never wrong bytes, nothing raised) and the key is not held, so a chain's next put stores over it."""
    from tests.storage.conftest import RedisServer, find_redis_server

    server = RedisServer(find_redis_server(), tmp_path)
    server.extra_args = ["--rename-command", "EVAL", ""]
    server.start()
    tier = RedisTier("redis", LAYOUT, None, url=server.url, namespace="noscript")
    raw = redis.Redis.from_url(server.url, socket_timeout=2)
    try:
        key, block = key_of(1), make_block(LAYOUT, 1)
        assert tier.put(key, block).ok and tier.contains(key)
        name = tier._redis_key(key)
        value = raw.get(name)
        raw.setrange(name, len(value) - 1, bytes([value[-1] ^ 1]))  # one payload bit: same length
        assert tier.get(key) is None and tier.counters["corrupt_blocks"] == 1
        assert raw.exists(name) and not tier.contains(key)
        assert tier.put(key, block).ok and tier.contains(key) and same(tier.get(key), block)
    finally:
        raw.close()
        tier.close()
        server.stop()


def test_a_key_of_another_type_reached_through_a_redirect_is_dropped_not_an_error(redis_cluster):
    """While its slot migrates, a list under a block's key moved to the target already: the GET's ASK is followed
    to a WRONGTYPE reply, which is the key's own answer (another type: counted and deleted), not a failed call."""
    from redis.crc import key_slot

    tier = RedisTier("redis", LAYOUT, None, url=redis_cluster.url, namespace=f"redir-{uuid.uuid4().hex[:8]}",
                     timeout_s=0.5)
    key = key_of(11)
    name = tier._redis_key(key)
    slot = key_slot(name.encode())
    src = redis_cluster.owners()[slot]
    dst = (src + 1) % 3
    with redis_cluster.client(src) as source:
        source.rpush(name, b"x")
    seen = []

    def while_migrating(moving: int) -> None:
        with redis_cluster.client(src) as source:
            source.execute_command("MIGRATE", "127.0.0.1", redis_cluster.nodes[dst].port, "", 0, 5000, "KEYS", name)
        seen.append(tier.get(key))
        seen.append((tier.counters["corrupt_blocks"], tier.counters["errors"]))

    try:
        redis_cluster.move_slots([slot], src, dst, before_migrate=while_migrating)
        assert seen == [None, (1, 0)]
        with redis_cluster.client(dst) as target:
            assert not target.exists(name)
    finally:
        tier.close()


@pytest.mark.parametrize("where", WHERE)
def test_a_batch_with_corrupt_and_foreign_values_deletes_each(make_tier, store, where):
    """Each bad value's delete compares against what was read under that key (a foreign block read before a
    corrupt one paired each key with the other's value, and neither was deleted)."""
    _, raw = store
    tier, theirs = make_tier(), make_tier(BlockLayout(2, 9, 32, torch.bfloat16))
    keys = [key_of(i) for i in range(20, 24)]
    assert theirs.put(keys[0], make_block(theirs.layout, 0)).ok  # foreign first
    raw.set(tier._redis_key(keys[1]), b"corrupt")
    assert theirs.put(keys[2], make_block(theirs.layout, 2)).ok
    raw.set(tier._redis_key(keys[3]), b"corrupt too")
    assert tier.get_many(keys) == [None] * 4
    assert tier.counters["foreign_records"] == 2 and tier.counters["corrupt_blocks"] == 2
    assert not any(raw.exists(tier._redis_key(k)) for k in keys)
