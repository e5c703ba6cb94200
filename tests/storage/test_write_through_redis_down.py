"""Write-through to Redis when the server (or a cluster node) goes down between two writes: the batch whose
puts find it down waits in the backlog, as later ones do, and reaches Redis once it is back; nothing the CPU
tier still holds counts failed."""
from __future__ import annotations

import uuid

import pytest

from tests.storage.blocks import make_block, same
from tests.storage.test_redis_cluster import key_of, spread, wait_until
from tierkv.storage.chain import TierChain
from tierkv.storage.cpu import CpuTier
from tierkv.storage.redis_tier import RedisTier

pytestmark = pytest.mark.redis
pytest.importorskip("redis")


def chain_over(layout, redis: RedisTier) -> TierChain:
    cpu = CpuTier("cpu", layout, 256 * layout.num_bytes, pin_memory=False)
    return TierChain([cpu, redis], write_through=[False, True])


def write(chain: TierChain, layout, ids: list[int]) -> None:
    keys = [key_of(i) for i in ids]
    assert all(r.ok for r in chain.put_many(keys, [make_block(layout, i) for i in ids]))
    chain.write_through(keys)
    chain.flush()



def test_the_batch_that_finds_the_server_down_is_written_once_it_is_back(layout, redis_server, redis_namespace):
    redis = RedisTier("redis", layout, None, url=redis_server.url, namespace=redis_namespace, retry_interval_s=0.2)
    chain = chain_over(layout, redis)
    try:
        write(chain, layout, [0, 1])
        redis_server.kill()
        write(chain, layout, [2, 3])  # its puts discover the server is gone
        write(chain, layout, [4, 5])  # the tier is now marked down: deferred before any put
        stats = chain.snapshot()["chain"]
        assert stats["write_through_failed"] == 0
        assert stats["write_through_deferred"] == 4 and stats["write_through_backlog"] == 4
        redis_server.restart()
        wait_until(lambda: redis.is_healthy, what="the tier's retry interval to pass")
        write(chain, layout, [6])  # takes the backlog along
        stats = chain.snapshot()["chain"]
        assert stats["write_through_backlog"] == 0 and stats["write_through_failed"] == 0
        got = redis.get_many([key_of(i) for i in range(2, 7)])
        assert all(same(g, make_block(layout, i)) for g, i in zip(got, range(2, 7)))
    finally:
        chain.close()
        redis_server.ensure_running()


def test_keys_of_a_killed_cluster_node_wait_for_it_while_the_others_are_written(layout, redis_cluster):
    redis = RedisTier("redis", layout, None, url=redis_cluster.url, namespace=f"wt-{uuid.uuid4().hex[:10]}",
                      timeout_s=2.0, retry_interval_s=0.5)
    chain = chain_over(layout, redis)
    try:
        ids = list(range(40))
        nodes = spread(redis, redis_cluster, [key_of(i) for i in ids])
        dead = nodes[0]
        redis_cluster.kill(dead)
        write(chain, layout, ids)
        on_dead = nodes.count(dead)
        stats = chain.snapshot()["chain"]
        assert redis.is_healthy  # the other primaries serve: the tier as a whole is up
        assert stats["written_through"] == len(ids) - on_dead and stats["write_through_failed"] == 0
        assert stats["write_through_deferred"] == on_dead and stats["write_through_backlog"] == on_dead
        write(chain, layout, [])  # retried while the node is still down: still waiting, counted once
        assert chain.snapshot()["chain"]["write_through_deferred"] == on_dead
        redis_cluster.restart(dead)
        wait_until(lambda: (write(chain, layout, []), chain.snapshot()["chain"]["write_through_backlog"] == 0)[1],
                   what="the backlog to reach the restarted node")
        stats = chain.snapshot()["chain"]
        assert stats["written_through"] == len(ids) and stats["write_through_failed"] == 0
        got = redis.get_many([key_of(i) for i in ids])
        assert all(same(g, make_block(layout, i)) for g, i in zip(got, ids))
    finally:
        chain.close()
        redis_cluster.ensure_healthy()
