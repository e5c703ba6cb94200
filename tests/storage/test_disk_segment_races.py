"""A disk tier's segments changed by something else while it runs or starts: a peer removing an emptied
segment between a starting tier's listing and its open, and an active segment cut short. No start fails,
and no block reported stored is lost at the next start."""
from __future__ import annotations

import os

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.storage import disk_scan
from tierkv.storage.disk import DiskTier
from tests.storage.blocks import make_block, same

CAPACITY_BYTES = 16 << 20
LAYOUT = BlockLayout(2, 8, 16, torch.float16)


def key_of(i: int) -> str:
    return f"{i:064x}/L0"


def test_a_segment_removed_between_the_listing_and_its_open_is_skipped(tmp_path, monkeypatch):
    with DiskTier("disk", LAYOUT, CAPACITY_BYTES, tmp_path) as first:
        first.put_many([key_of(0)], [make_block(LAYOUT, 0)])
    with DiskTier("disk", LAYOUT, CAPACITY_BYTES, tmp_path) as second:  # a second segment
        second.put_many([key_of(1)], [make_block(LAYOUT, 1)])
    segments = sorted(tmp_path.glob("*.seg"))
    assert len(segments) == 2
    real_open, removed = disk_scan.files.open_segment, []

    def peer_removes_first_segment(path, flags):
        if not removed and str(path) == str(segments[0]):
            os.unlink(path)  # what a live peer does to a segment it emptied
            removed.append(path)
        return real_open(path, flags)

    monkeypatch.setattr(disk_scan.files, "open_segment", peer_removes_first_segment)
    with DiskTier("disk", LAYOUT, CAPACITY_BYTES, tmp_path) as tier:
        assert removed
        assert tier.get(key_of(0)) is None
        assert same(tier.get(key_of(1)), make_block(LAYOUT, 1))
        assert tier.counters.snapshot()["errors"] == 0


@pytest.mark.parametrize("cut", [100, 4096 + 10, "last record"])
def test_blocks_stored_after_the_active_segment_was_cut_survive_a_restart(tmp_path, cut):
    with DiskTier("disk", LAYOUT, CAPACITY_BYTES, tmp_path) as tier:
        assert all(r.ok for r in tier.put_many([key_of(i) for i in range(6)], [make_block(LAYOUT, i) for i in range(6)]))
        (segment,) = tmp_path.glob("*.seg")
        size = segment.stat().st_size
        os.truncate(segment, size - 10 if cut == "last record" else cut)
        assert all(r.ok for r in tier.put_many([key_of(i) for i in range(6, 10)],
                                               [make_block(LAYOUT, i) for i in range(6, 10)]))
        for i in range(6, 10):
            assert same(tier.get(key_of(i)), make_block(LAYOUT, i))
        for i in range(6):  # cut away or not: the old block or a miss, never other bytes
            got = tier.get(key_of(i))
            assert got is None or same(got, make_block(LAYOUT, i))
    with DiskTier("disk", LAYOUT, CAPACITY_BYTES, tmp_path) as again:
        for i in range(6, 10):
            assert same(again.get(key_of(i)), make_block(LAYOUT, i)), i


@pytest.mark.parametrize("planted", ["fifo", "huge"])
def test_a_planted_order_file_is_ignored_not_read(tmp_path, planted):
    """lru.order is a hint: a FIFO there blocked the start for ever, a huge file was read whole."""
    import threading

    with DiskTier("disk", LAYOUT, CAPACITY_BYTES, tmp_path) as tier:
        tier.put_many([key_of(0)], [make_block(LAYOUT, 0)])
    order = tmp_path / "lru.order"
    order.unlink(missing_ok=True)
    if planted == "fifo":
        os.mkfifo(order, 0o600)
    else:
        with open(order, "wb") as f:
            f.truncate(1 << 40)  # sparse
    got = {}

    def start():
        with DiskTier("disk", LAYOUT, CAPACITY_BYTES, tmp_path) as again:
            got["block"] = again.get(key_of(0))

    worker = threading.Thread(target=start, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "the start blocked on the planted order file"
    assert same(got["block"], make_block(LAYOUT, 0))


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_deleted_segments_blocks_are_not_held_so_a_spill_writes_them_again(tmp_path, how):
    """contains answered from the index alone: a segment removed by a tmp cleaner still 'held' its blocks, so the
    chain skipped spilling them and they were lost while the tier looked healthy."""
    from tierkv.storage.chain import TierChain
    from tierkv.storage.cpu import CpuTier

    cpu = CpuTier("cpu", LAYOUT, 2 * LAYOUT.num_bytes, pin_memory=False)
    disk = DiskTier("disk", LAYOUT, CAPACITY_BYTES, tmp_path / "d")
    chain = TierChain([cpu, disk])
    try:
        keys = [key_of(i) for i in range(4)]
        assert all(r.ok for r in disk.put_many(keys, [make_block(LAYOUT, i) for i in range(4)]))
        (segment,) = (tmp_path / "d").glob("*.seg")
        segment.unlink()
        if how == "replaced":
            segment.write_bytes(b"\0" * 4096)
        assert disk.contains_many(keys) == [False] * 4
        assert disk.counters.by_reason("lost_blocks") == {f"segment_{how}": 4}
        for i, key in enumerate(keys):  # through the CPU tier: each eviction spills to disk again
            chain.put_many([key], [make_block(LAYOUT, i)])
        chain.flush()
        for i, key in enumerate(keys[:2]):  # evicted from the 2-slot CPU tier: on disk, written afresh
            assert same(disk.get(key), make_block(LAYOUT, i))
    finally:
        chain.close()  # its spill workers and both tiers
