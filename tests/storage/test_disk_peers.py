"""Disk tiers sharing one directory while they live (tensor-parallel ranks, a second process): a tier that
starts beside a live one changes no file at start-up, and each punches and deletes only in segments it
created, so no tier's blocks are destroyed by another; a tier that starts alone repairs the directory as
before. Peers in one process stand for processes (each holds its own lock on its live file)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from tierkv.storage.disk import DiskTier
from tierkv.storage.disk_peers import DirectoryPeers

CAPACITY = 64 << 20


def block(layout, seed: int) -> torch.Tensor:
    return torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed)).to(layout.dtype)


def key(i: int) -> str:
    return f"{i:064x}/L0"


def test_a_tier_starting_beside_live_ones_destroys_none_of_their_blocks(layout, tmp_path):
    a = DiskTier("a", layout, CAPACITY, tmp_path)
    a.put_many([key(i) for i in range(10)], [block(layout, i) for i in range(10)])
    b = DiskTier("b", layout, CAPACITY, tmp_path)  # indexes a's first ten
    a.put_many([key(i) for i in range(10, 20)], [block(layout, i) for i in range(10, 20)])  # b does not know these
    b.put_many([key(i) for i in range(10, 20)], [block(layout, i) for i in range(10, 20)])  # so it writes them again
    c = DiskTier("c", layout, CAPACITY, tmp_path)  # sees b's copies supersede a's: it must not punch a's
    try:
        got = a.get_many([key(i) for i in range(20)])
        assert all(torch.equal(g, block(layout, i)) for i, g in enumerate(got))
        assert a.counters["corrupt_blocks"] == 0 and c.counters["corrupt_blocks"] == 0
        got = c.get_many([key(i) for i in range(20)])
        assert all(torch.equal(g, block(layout, i)) for i, g in enumerate(got))
    finally:
        for tier in (c, b, a):
            tier.close()
    alone = DiskTier("d", layout, CAPACITY, tmp_path)  # alone: repairs, the superseded copies punched
    try:
        assert alone.counters.by_reason("scan_dropped_records").get("superseded") == 10
        assert all(torch.equal(g, block(layout, i)) for i, g in enumerate(alone.get_many([key(i) for i in range(20)])))
    finally:
        alone.close()


def test_a_block_its_writer_evicted_is_lost_to_a_peer_not_corrupt(layout, tmp_path):
    small = 4 * layout.num_bytes
    a = DiskTier("a", layout, small, tmp_path)
    a.put_many([key(i) for i in range(4)], [block(layout, i) for i in range(4)])
    b = DiskTier("b", layout, CAPACITY, tmp_path)  # indexes a's four
    try:
        a.put_many([key(i) for i in range(4, 8)], [block(layout, i) for i in range(4, 8)])  # a evicts (punches) 0-3
        assert b.get_many([key(i) for i in range(4)]) == [None] * 4
        assert b.counters["corrupt_blocks"] == 0
        assert b.counters.by_reason("lost_blocks") == {"removed_by_peer": 4}
        b.put_many([key(i) for i in range(8, 40)], [block(layout, i) for i in range(8, 40)])
        b.remove_many([key(i) for i in range(4, 8)])  # a's records: b forgets them, a still serves them
        assert all(torch.equal(g, block(layout, i)) for i, g in
                   zip(range(4, 8), a.get_many([key(i) for i in range(4, 8)])))
        assert a.counters["corrupt_blocks"] == 0
    finally:
        b.close()
        a.close()


def test_a_dead_tiers_live_file_is_told_from_a_live_ones(tmp_path):
    live = DirectoryPeers(tmp_path)
    probe = DirectoryPeers(tmp_path)
    try:
        assert probe.others_live()
        live.close()
        probe._checked = None
        assert not probe.others_live()
        script = textwrap.dedent(f"""
            import os, sys
            sys.path.insert(0, {os.getcwd()!r})
            from tierkv.storage.disk_peers import DirectoryPeers
            DirectoryPeers({str(tmp_path)!r})
            os._exit(0)  # dies without closing: the kernel drops its lock, the file stays
        """)
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
        assert len([n for n in os.listdir(tmp_path) if n.startswith(".live-")]) == 2
        probe._checked = None
        assert not probe.others_live()  # the dead one's file is removed on the way
        assert [n for n in os.listdir(tmp_path) if n.startswith(".live-")] == [probe.name]
    finally:
        probe.close()


def test_tiers_of_two_block_layouts_on_one_directory_keep_each_others_records(tmp_path):
    """Two models (or block sizes) on one directory, as the default path puts every model: each tier leaves
    the other's records as they are, alive or at a restart, counted as foreign_records (the scan used to
    punch them: a second model's start wiped the first's blocks, found by a shared-tier probe)."""
    from tierkv.blocks import BlockLayout

    small, large = BlockLayout(2, 4, 8, torch.float32), BlockLayout(2, 8, 8, torch.float32)
    capacity = 64 * large.num_bytes
    rows = {name: [torch.randn(layout.shape) for _ in range(20)] for name, layout in (("s", small), ("l", large))}
    first = DiskTier("first", small, capacity, tmp_path)
    assert all(r.ok for r in first.put_many([f"s{i}" for i in range(20)], rows["s"]))
    second = DiskTier("second", large, capacity, tmp_path)  # starts while the first runs
    assert all(r.ok for r in second.put_many([f"l{i}" for i in range(20)], rows["l"]))
    assert second.counters.snapshot()["foreign_records"] == 20
    assert all(torch.equal(got, want) for got, want in zip(first.get_many([f"s{i}" for i in range(20)]), rows["s"]))
    first.close()
    second.close()
    for layout, name, other in ((small, "s", "l"), (large, "l", "s")):  # each restarted alone
        again = DiskTier("again", layout, capacity, tmp_path)
        try:
            got = again.get_many([f"{name}{i}" for i in range(20)])
            assert all(g is not None and torch.equal(g, w) for g, w in zip(got, rows[name]))
            assert again.get(f"{other}0") is None and again.counters.snapshot()["foreign_records"] == 20
        finally:
            again.close()
