"""Sealed disk tiers of two models on one directory (the default path is one for every model, the secret one per
user): bf16 and fp16 blocks of one shape seal to the same flat uint8 layout, yet each tier leaves the other's
records as plain tiers do (foreign_records, outside its capacity, never evicted by it). Evicted records a tier
cannot open (another secret) are dropped without being reported as authentication failures; a read of one still is."""
from __future__ import annotations

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.storage.auth import BlockSealer
from tierkv.storage.disk import DiskTier
from tierkv.storage.sealed import SealedTier

BF16 = BlockLayout(num_kv_heads=2, block_tokens=8, head_dim=32, dtype=torch.bfloat16)
FP16 = BlockLayout(num_kv_heads=2, block_tokens=8, head_dim=32, dtype=torch.float16)
SECRET = b"per-user-secret-0123456789abcdef"
NUM_BLOCKS = 8


def block_of(layout: BlockLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, 256, (layout.num_bytes,), dtype=torch.uint8, generator=g)
    return flat.view(layout.dtype).view(layout.shape)


def sealed_tier(path, layout: BlockLayout, *, secret: bytes = SECRET, encrypt: bool = False,
                return_evicted: bool = True) -> SealedTier:
    sealer = BlockSealer(secret, layout, encrypt=encrypt)
    inner = DiskTier("disk", sealer.sealed_layout, NUM_BLOCKS * sealer.num_bytes, path, return_evicted=return_evicted)
    return SealedTier(inner, layout, sealer)


def fill(tier: SealedTier, prefix: str) -> list:
    """NUM_BLOCKS blocks under prefix; the PutResults' evicted (key, block) pairs."""
    evicted = []
    for i in range(NUM_BLOCKS):
        result = tier.put(f"{prefix}{i}/L0", block_of(tier.layout, i))
        assert result.ok
        evicted += result.evicted
    return evicted


def num_served(tier: SealedTier, prefix: str) -> int:
    found = tier.get_many([f"{prefix}{i}/L0" for i in range(NUM_BLOCKS)])
    return sum(b is not None and torch.equal(b.view(torch.uint8), block_of(tier.layout, i).view(torch.uint8))
               for i, b in enumerate(found))


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("return_evicted", [True, False])
def test_a_sealed_tier_leaves_the_records_of_another_layout_of_one_byte_size(tmp_path, encrypt, return_evicted):
    assert BF16.num_bytes == FP16.num_bytes  # the case: both seal to one inner layout's shape and dtype
    with sealed_tier(tmp_path, BF16, encrypt=encrypt) as a:
        fill(a, "a")
    with sealed_tier(tmp_path, FP16, encrypt=encrypt, return_evicted=return_evicted) as b:
        counts = b.counters.snapshot()
        assert counts["foreign_records"] == NUM_BLOCKS and b.used_bytes == 0  # outside its capacity
        assert fill(b, "b") == []  # a full tier of its own blocks: nothing of A's evicted to make room
        counts = b.counters.snapshot()
        assert counts["evictions"] == 0 and counts["auth_failures"] == 0
        assert num_served(b, "b") == NUM_BLOCKS
    with sealed_tier(tmp_path, BF16, encrypt=encrypt) as a:
        assert a.counters.snapshot()["foreign_records"] == NUM_BLOCKS
        assert num_served(a, "a") == NUM_BLOCKS and a.counters.snapshot()["auth_failures"] == 0


def test_sealed_records_written_before_the_layout_tag_are_still_the_tiers_own(tmp_path):
    """Records an earlier version wrote name the sealed uint8 layout only: a tier takes them as its own, as it
    did, so an upgrade keeps its blocks (and they age out through its LRU)."""
    sealer = BlockSealer(SECRET, BF16, encrypt=False)
    untagged = BlockLayout(1, 1, sealer.num_bytes // 2, torch.uint8)  # what sealed_layout was
    assert tuple(untagged.shape) == tuple(sealer.sealed_layout.shape)
    with DiskTier("disk", untagged, NUM_BLOCKS * sealer.num_bytes, tmp_path) as old:
        for i in range(NUM_BLOCKS):
            assert old.put(sealer.name(f"a{i}/L0"), sealer.seal(f"a{i}/L0", block_of(BF16, i))).ok
    with sealed_tier(tmp_path, BF16) as tier:
        assert tier.counters.snapshot()["foreign_records"] == 0 and tier.used_bytes == NUM_BLOCKS * sealer.num_bytes
        assert num_served(tier, "a") == NUM_BLOCKS
        evicted = fill(tier, "b")  # the old records are the least recently used: evicted first, handed down
        assert sorted(key for key, _ in evicted) == [f"a{i}/L0" for i in range(NUM_BLOCKS)]
        assert tier.counters.snapshot()["auth_failures"] == 0


def test_evicted_blocks_sealed_under_a_rotated_secret_are_dropped_not_reported_as_forged(tmp_path, caplog):
    with sealed_tier(tmp_path, BF16, secret=b"old-secret-0123456789abcdef") as old:
        fill(old, "k")
    with sealed_tier(tmp_path, BF16) as new, caplog.at_level("WARNING"):
        assert len(new.inner._index) == NUM_BLOCKS  # ours by layout: they age out through the LRU
        assert fill(new, "n") == []  # none can be opened, so none travels down the chain
        counts = new.counters.snapshot()
        assert counts["evictions"] == NUM_BLOCKS and counts["auth_failures"] == 0
        assert not [r for r in caplog.records if "failed authentication" in r.getMessage()]
        assert num_served(new, "n") == NUM_BLOCKS


def test_a_record_under_our_name_that_fails_authentication_on_a_read_still_counts(tmp_path):
    """What an eviction drops quietly, a read still reports: a record the tier finds under a name it asked for."""
    with sealed_tier(tmp_path, BF16, secret=b"old-secret-0123456789abcdef") as old:
        fill(old, "k")
    with sealed_tier(tmp_path, BF16) as new:
        forged = torch.zeros(new.sealer.sealed_layout.shape, dtype=torch.uint8)
        assert new.inner.put(new.sealer.name("k0/L0"), forged).ok
        assert new.get("k0/L0") is None
        assert new.counters.snapshot()["auth_failures"] == 1
        assert new.sealer.name("k0/L0") not in new.inner._index  # dropped, never served
