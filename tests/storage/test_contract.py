"""One contract, every tier: cpu, disk, redis (a real redis-server) and redis-cluster (three nodes) behave alike."""
from __future__ import annotations

import threading

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.storage import CpuTier, SealedTier, StorageTier
from tierkv.storage.auth import BlockSealer
from tierkv.storage.disk import DiskTier
from tierkv.storage.redis_tier import RedisTier

TIER_KINDS = ["cpu", "disk", pytest.param("redis", marks=pytest.mark.redis), "sealed-disk", "encrypted-disk",
              pytest.param("sealed-redis", marks=pytest.mark.redis),
              pytest.param("redis-cluster", marks=pytest.mark.redis)]
SECRET = b"contract-test-secret-0123456789"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def random_block(layout: BlockLayout) -> torch.Tensor:
    # Random bit patterns, not just random values: every byte must survive the round trip.
    raw = torch.randint(0, 256, (layout.num_bytes,), dtype=torch.uint8)
    return raw.view(layout.dtype).reshape(layout.shape).clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
def make_tier(request, tmp_path):
    made: list[StorageTier] = []

    def make(kind: str, layout: BlockLayout, capacity_blocks: int) -> StorageTier:
        capacity = capacity_blocks * layout.num_bytes
        if kind.startswith(("sealed-", "encrypted-")):  # the inner tier holds the sealed form of each block
            sealer = BlockSealer(SECRET, layout, encrypt=kind.startswith("encrypted-"))
            inner = make(kind.split("-")[1], sealer.sealed_layout, capacity_blocks)
            made.remove(inner)  # closed by the sealed tier, which also ends its worker threads
            tier = SealedTier(inner, layout, sealer)
            made.append(tier)
            return tier
        if kind == "cpu":
            tier = CpuTier("cpu", layout, capacity)
        elif kind == "disk":
            tier = DiskTier("disk", layout, capacity, tmp_path / f"disk{len(made)}")
        else:
            server = request.getfixturevalue("redis_cluster" if kind == "redis-cluster" else "redis_server")
            namespace = f"contract-{request.node.name}-{len(made)}"
            tier = RedisTier("redis", layout, capacity, url=server.url, namespace=namespace)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def layout_of(dtype: torch.dtype) -> BlockLayout:
    return BlockLayout(num_kv_heads=2, block_tokens=8, head_dim=32, dtype=dtype)


@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact(make_tier, kind, dtype):
    layout = layout_of(dtype)
    tier = make_tier(kind, layout, capacity_blocks=16)
    blocks = {f"{i:064x}/L{i % 3}": random_block(layout) for i in range(5)}
    for key, block in blocks.items():
        assert tier.put(key, block).ok
    for key, block in blocks.items():
        assert tier.contains(key)
        got = tier.get(key)
        assert got is not None and same_bits(got, block)
    assert tier.get("absent/L0") is None
    assert not tier.contains("absent/L0")
    snap = tier.counters.snapshot()
    assert snap["hits"] == len(blocks) and snap["misses"] == 1 and snap["lookups"] == len(blocks) + 1


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_get_returns_a_copy_the_caller_owns(make_tier, kind):
    layout = layout_of(torch.float32)
    tier = make_tier(kind, layout, capacity_blocks=4)
    block = random_block(layout)
    tier.put("k/L0", block)
    got = tier.get("k/L0")
    got.fill_(7.0)
    assert same_bits(tier.get("k/L0"), block)


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_overwrite_and_remove(make_tier, kind):
    layout = layout_of(torch.bfloat16)
    tier = make_tier(kind, layout, capacity_blocks=4)
    first, second = random_block(layout), random_block(layout)
    assert tier.put("k/L0", first).ok
    assert tier.put("k/L0", second).ok
    assert same_bits(tier.get("k/L0"), second)
    assert tier.remove("k/L0") is True
    assert tier.remove("k/L0") is False
    assert tier.get("k/L0") is None and not tier.contains("k/L0")


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_batched_forms(make_tier, kind):
    layout = layout_of(torch.float16)
    tier = make_tier(kind, layout, capacity_blocks=32)
    keys = [f"b{i}/L0" for i in range(10)]
    blocks = [random_block(layout) for _ in keys]
    assert all(r.ok for r in tier.put_many(keys, blocks))
    probe = keys[:5] + ["missing/L0"] + keys[5:]
    assert tier.contains_many(probe) == [True] * 5 + [False] + [True] * 5
    got = tier.get_many(probe)
    assert got[5] is None
    for key, block in zip(keys, blocks):
        assert same_bits(got[probe.index(key)], block)
    assert tier.remove_many(keys[:3] + ["missing/L0"]) == [True, True, True, False]
    assert tier.contains_many(keys[:4]) == [False, False, False, True]
    with pytest.raises(ValueError, match="keys"):
        tier.put_many(keys[:2], blocks[:1])


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_capacity_evicts_least_recently_used(make_tier, kind):
    layout = layout_of(torch.bfloat16)
    tier = make_tier(kind, layout, capacity_blocks=4)
    blocks = {f"e{i}/L0": random_block(layout) for i in range(6)}
    keys = list(blocks)
    for key in keys[:4]:
        assert tier.put(key, blocks[key]).ok
    assert tier.get(keys[0]) is not None  # keys[0] is now the most recently used
    evicted = []
    for key in keys[4:]:
        result = tier.put(key, blocks[key])
        assert result.ok
        evicted.extend(result.evicted)
    present = tier.contains_many(keys)
    assert present == [True, False, False, True, True, True]
    assert tier.used_bytes <= tier.capacity_bytes
    assert tier.counters["evictions"] == 2
    for key, block in evicted:  # tiers that hand evicted data on hand the right bytes
        assert key in (keys[1], keys[2]) and same_bits(block, blocks[key])


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_rejects_a_block_of_the_wrong_shape_or_dtype(make_tier, kind):
    layout = layout_of(torch.bfloat16)
    tier = make_tier(kind, layout, capacity_blocks=4)
    with pytest.raises(ValueError, match="shape"):
        tier.put("w/L0", torch.zeros(3, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        tier.put("w/L0", torch.zeros(layout.shape, dtype=torch.float32))


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_concurrent_threads_never_see_torn_blocks(make_tier, kind):
    layout = layout_of(torch.float32)
    tier = make_tier(kind, layout, capacity_blocks=64)
    errors: list[str] = []

    def worker(worker_id: int) -> None:
        for round_ in range(15):
            key = f"t{worker_id}-{round_ % 4}/L0"
            block = torch.full(layout.shape, float(worker_id * 1000 + round_))
            if not tier.put(key, block).ok:
                errors.append(f"put {key} failed")
            got = tier.get(key)
            # Another thread never writes this key, so we must read back exactly what we wrote.
            if got is None or not torch.equal(got, block):
                errors.append(f"{key}: read back something else")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert tier.counters["puts"] == 60
