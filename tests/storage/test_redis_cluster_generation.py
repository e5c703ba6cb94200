"""Generation over a Redis Cluster tier: a node failing mid-generation, slots moving, two processes.

Tokens are always those of the model without tierkv; a failing node costs prefix reuse (its
keys are misses, puts to it fail and are counted), never a wrong token, and never more than
one socket timeout per thread and retry interval.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.models import build
from tierkv.config import load_config
from tierkv.llm import TieredLLM
from tierkv.storage.redis_cluster import ClusterLink
from tierkv.storage.redis_tier import RedisTier

pytestmark = pytest.mark.redis
pytest.importorskip("redis")

BLOCK_BYTES = 2 * 2 * 4 * 16 * 4
TIMEOUT_S = 0.3
RETRY_INTERVAL_S = 1.0
ROOT = Path(__file__).resolve().parents[2]


def config_for(url: str, namespace: str):
    return load_config({
        "model": {"name": "cluster-llama"},
        "storage": {"secret": "redis-cluster-test-secret-0123"},  # a sealed Redis tier, as shipped
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": 4096 * BLOCK_BYTES},
                  {"kind": "redis", "url": url, "namespace": namespace, "timeout_s": TIMEOUT_S,
                   "retry_interval_s": RETRY_INTERVAL_S}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
    }, env={})


def redis_tier_of(llm: TieredLLM) -> RedisTier:
    tier = llm.runtime.chain.tiers[1]
    while not isinstance(tier, RedisTier):
        tier = tier.inner
    return tier


def generate(model, url: str, namespace: str, prompt: list[int]):
    with TieredLLM(copy.deepcopy(model), config_for(url, namespace), show_progress=False) as llm:
        (out,) = llm.generate([prompt], max_new_tokens=4)
    return out


@pytest.fixture
def call_times(monkeypatch):
    """(node, seconds) of every call the cluster links make to a node."""
    times: list[tuple[str, float]] = []
    real = ClusterLink._call_node

    def timed(self, node, num_keys, op):
        started = time.monotonic()
        try:
            return real(self, node, num_keys, op)
        finally:
            times.append((node, time.monotonic() - started))

    monkeypatch.setattr(ClusterLink, "_call_node", timed)
    return times


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_node_failing_mid_generation_never_changes_tokens(redis_cluster, call_times, monkeypatch, fault):
    model, reference = build("llama", num_heads=8, num_kv_heads=2, seed=3)
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (103, 70)]
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    url, namespace = redis_cluster.url, f"gen-{uuid.uuid4().hex[:10]}"
    victim = 1
    real_set_many, num_sets = ClusterLink.set_many, [0]

    def set_many_failing_at_the_second(self, names, values, ttl_ms):
        num_sets[0] += 1
        if num_sets[0] == 2:  # mid-prefill: the first write-through batch is stored, the rest is not yet
            redis_cluster.kill(victim) if fault == "kill" else redis_cluster.freeze(victim)
            failed_at[0] = time.monotonic()
        return real_set_many(self, names, values, ttl_ms)

    failed_at = [0.0]
    monkeypatch.setattr(ClusterLink, "set_many", set_many_failing_at_the_second)
    try:
        with TieredLLM(copy.deepcopy(model), config_for(url, namespace), show_progress=False) as first:
            (a,) = first.generate([prompts[0]], max_new_tokens=4)
            first.runtime.chain.flush()
            chain, tier = first.stats()["chain"], redis_tier_of(first)
            assert a.token_ids == expected[0]
            # the victim's keys wait in the backlog (the CPU tier holds them), none counted lost
            assert chain["written_through"] > 0 and chain["write_through_failed"] == 0
            assert chain["write_through_backlog"] == chain["write_through_deferred"] > 0
            assert tier.counters["put_failures"] >= chain["write_through_deferred"] and tier.counters["errors"] > 0
            assert tier.is_healthy and redis_cluster.nodes[victim].address in tier.last_error  # the others serve

            b = generate(model, url, namespace, prompts[0])  # another runtime while the node is down
            assert b.token_ids == expected[0] and b.stats["prefix_tokens"] < 100  # its keys are misses
            down_s = time.monotonic() - failed_at[0]

            redis_cluster.restart(victim) if fault == "kill" else redis_cluster.thaw(victim)
            redis_cluster.wait_ready()
            deadline = time.monotonic() + 10
            while tier.down_nodes and time.monotonic() < deadline:  # the retry interval passes
                time.sleep(0.05)
            failed_before = first.stats()["chain"]["write_through_failed"]
            (c,) = first.generate([prompts[1]], max_new_tokens=4)  # the same runtime, node back
            first.runtime.chain.flush()
            assert c.token_ids == expected[1]
            chain = first.stats()["chain"]
            assert chain["write_through_failed"] == failed_before == 0 and tier.down_nodes == []
            assert chain["write_through_backlog"] == 0  # prompt 1's keys went with prompt 2's write-through
        e = generate(model, url, namespace, prompts[0])
        assert e.token_ids == expected[0]
        if fault == "freeze":  # the thawed node kept what it held: every block of prompt 1 is in the cluster now
            assert e.stats["prefix_tokens"] == 100  # (a killed one restarts empty, losing what it held before)
    finally:
        redis_cluster.ensure_healthy()
    d = generate(model, url, namespace, prompts[1])  # every block of prompt 2 is in the cluster
    assert d.token_ids == expected[1]
    assert d.stats["prefix_tokens"] == 68 and d.stats["prefix_blocks_by_tier"] == {"redis": 2 * 17}
    victim_calls = [s for node, s in call_times if node == redis_cluster.nodes[victim].address]
    assert max(victim_calls) < TIMEOUT_S + 0.5  # no call waits longer than the socket timeout (and slack)
    slow = sum(s >= 0.8 * TIMEOUT_S for s in victim_calls)
    threads = 3  # the caller and two write-through workers may each find the node before it is marked down
    assert slow <= threads * (1 + down_s / RETRY_INTERVAL_S)
    assert (slow >= 1) == (fault == "freeze")


def test_blocks_moved_between_requests_serve_the_next_request(redis_cluster):
    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=6)
    prompt = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(6)).tolist()
    url, namespace = redis_cluster.url, f"move-{uuid.uuid4().hex[:10]}"
    with TieredLLM(copy.deepcopy(model), config_for(url, namespace), show_progress=False) as first:
        (a,) = first.generate([prompt], max_new_tokens=4)
        first.runtime.chain.flush()
        names = [name for name in redis_tier_of(first)._written]
    from redis.crc import key_slot

    owners = redis_cluster.owners()
    slots = sorted({key_slot(f"{namespace}:{name}".encode()) for name in names if owners[key_slot(
        f"{namespace}:{name}".encode())] == 0})
    assert slots  # node 0 holds some of the prompt's blocks
    redis_cluster.move_slots(slots, 0, 2)
    b = generate(model, url, namespace, prompt)
    assert b.token_ids == a.token_ids
    assert b.stats["prefix_tokens"] == 116 and b.stats["prefix_blocks_by_tier"] == {"redis": 2 * 29}


def test_a_second_process_reuses_the_first_ones_prefix_through_the_cluster(redis_cluster):
    """Two processes on one machine (this one, then a child), each with its own CPU tier: two hosts, in effect."""
    namespace = f"procs-{uuid.uuid4().hex[:10]}"
    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=5)
    prompt = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    with TieredLLM(copy.deepcopy(model), config_for(redis_cluster.url, namespace), show_progress=False) as llm:
        (first,) = llm.generate([prompt], max_new_tokens=3)
    # closed: its write-through is flushed
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from tests.models import build
        from tests.storage.test_redis_cluster_generation import config_for
        from tierkv.llm import TieredLLM
        model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=5)
        with TieredLLM(model, config_for({redis_cluster.url!r}, {namespace!r}), show_progress=False) as llm:
            (out,) = llm.generate([{prompt!r}], max_new_tokens=3)
        print(json.dumps({{"tokens": out.token_ids, "prefix": out.stats["prefix_tokens"],
                          "by_tier": out.stats["prefix_blocks_by_tier"]}}))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    second = json.loads(run.stdout.strip().splitlines()[-1])
    assert first.stats["prefix_tokens"] == 0
    assert second["prefix"] == 96 and second["by_tier"] == {"redis": 2 * 24}
    assert second["tokens"] == first.token_ids
