"""A CPU tier with no tier below drops its evictions without copying them out of the slab (a 100k-token prefix
evicting the one before it copied 13 GB on the host for nothing), and still counts them; with a tier below, the
evicted bytes reach it whole."""
from __future__ import annotations

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.storage import CpuTier, TierChain
from tierkv.storage.disk import DiskTier

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=4, head_dim=16, dtype=torch.bfloat16)


def blocks_for(prefix: str, num: int) -> dict[str, torch.Tensor]:
    return {f"{prefix}{i}/L0": torch.randn(LAYOUT.shape).to(LAYOUT.dtype) for i in range(num)}


def counting_reads(cpu: CpuTier) -> list[int]:
    """Slots read out of the slab from now on (CpuTier.read_slots), one list entry per slot."""
    reads, original = [], cpu.read_slots

    def read_slots(slots):
        reads.extend(slots)
        return original(slots)

    cpu.read_slots = read_slots
    return reads


@pytest.mark.parametrize("path", ["put_many", "prepare_put"])
def test_the_last_tier_drops_evictions_without_reading_them(path):
    cpu = CpuTier("cpu", LAYOUT, 4 * LAYOUT.num_bytes)
    chain = TierChain([cpu])
    try:
        first, second = blocks_for("a", 4), blocks_for("b", 3)
        chain.put_many(list(first), list(first.values()))
        reads = counting_reads(cpu)
        if path == "put_many":
            chain.put_many(list(second), list(second.values()))
        else:  # the write-back's path: prepare, spill the evictions, write the slots, complete
            slots, evicted = cpu.prepare_put(list(second))
            assert [key for key, _ in evicted] == ["a0/L0", "a1/L0", "a2/L0"]
            chain.spill(0, evicted)
            cpu.write_slots(slots, torch.stack(list(second.values())))
            cpu.complete_put(list(second))
        chain.flush()
        assert reads == []
        assert chain.snapshot()["chain"]["dropped"] == 3 and cpu.counters.snapshot()["evictions"] == 3
        got = chain.get_many([*second, "a3/L0"], promote=False)
        for found, block in zip(got, [*second.values(), first["a3/L0"]]):
            assert found is not None and torch.equal(found, block)
        assert chain.locate_many(["a0/L0", "a1/L0", "a2/L0"]) == [None, None, None]
    finally:
        chain.close()


def test_a_tier_below_gets_the_evicted_bytes(tmp_path):
    cpu = CpuTier("cpu", LAYOUT, 4 * LAYOUT.num_bytes)
    chain = TierChain([cpu, DiskTier("disk", LAYOUT, 64 * LAYOUT.num_bytes, tmp_path / "disk")])
    try:
        first, second = blocks_for("a", 4), blocks_for("b", 4)
        chain.put_many(list(first), list(first.values()))
        slots, evicted = cpu.prepare_put(list(second))
        assert all(block is not None for _, block in evicted)
        chain.spill(0, evicted)
        cpu.write_slots(slots, torch.stack(list(second.values())))
        cpu.complete_put(list(second))
        chain.flush()
        assert chain.locate_many(list(first)) == [1, 1, 1, 1]
        for found, block in zip(chain.get_many(list(first), promote=False), first.values()):
            assert found is not None and torch.equal(found, block)
        assert chain.snapshot()["chain"]["dropped"] == 0
    finally:
        chain.close()


def test_a_cpu_tier_on_its_own_still_returns_evicted_bytes():
    cpu = CpuTier("cpu", LAYOUT, 2 * LAYOUT.num_bytes)
    blocks = blocks_for("a", 3)
    results = cpu.put_many(list(blocks), list(blocks.values()))
    evicted = [pair for result in results for pair in result.evicted]
    assert [key for key, _ in evicted] == ["a0/L0"] and torch.equal(evicted[0][1], blocks["a0/L0"])


def test_a_wrapped_cpu_tier_as_the_last_tier_drops_and_counts():
    from tierkv.quant import packed_layout
    from tierkv.storage.auth import BlockSealer
    from tierkv.storage.quantized import QuantizedTier
    from tierkv.storage.sealed import SealedTier

    sealer = BlockSealer(b"0123456789abcdef0123456789abcdef", LAYOUT, encrypt=False)
    packed = packed_layout(LAYOUT, "int8")
    for tier in (SealedTier(CpuTier("cpu", sealer.sealed_layout, 4 * sealer.num_bytes, pin_memory=False), LAYOUT,
                            sealer, seal_threads=1),
                 QuantizedTier(CpuTier("cpu", packed, 4 * packed.num_bytes, pin_memory=False), LAYOUT, "int8")):
        chain = TierChain([tier])
        try:
            first, second = blocks_for("a", 4), blocks_for("b", 1)
            chain.put_many(list(first), list(first.values()))
            results = chain.put_many(list(second), list(second.values()))  # evicts a0
            chain.flush()
            assert all(r.ok for r in results) and chain.snapshot()["chain"]["dropped"] == 1
            assert chain.locate_many(["a0/L0", "b0/L0"]) == [None, 0]
        finally:
            chain.close()
