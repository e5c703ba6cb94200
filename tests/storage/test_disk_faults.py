"""DiskTier under faults: restarts, crashes mid-append, torn tails, corrupt records, a full disk, capacity."""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.storage import disk_segments as seg
from tierkv.storage.base import TierError
from tierkv.storage.disk import DiskTier
from tests.storage.blocks import make_block

CAPACITY_BYTES = 64 << 20


def key_of(i: int, layer: int = 0) -> str:
    return f"{i:064x}/L{layer}"


def scan(root: Path) -> list[tuple[Path, list[tuple[int, seg.RecordHeader]], int, int]]:
    """(segment path, [(offset, header)], end of the last whole record, file size) per segment file."""
    found = []
    for path in sorted(Path(root).glob("*.seg")):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            records, end, _ = seg.scan_segment(fd, size)
        finally:
            os.close(fd)
        found.append((path, records, end, size))
    return found


def keys_on_disk(root: Path) -> list[str]:
    """Keys of the records a restart would find, in write order."""
    return [h.key for _, records, _, _ in scan(root) for _, h in records]


def torn_bytes(root: Path) -> int:
    """Bytes of data after the last whole record of each segment (a torn tail); holes punched over
    removed records there do not count."""
    torn = 0
    for path, _, end, size in scan(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            data_start = os.lseek(fd, end, os.SEEK_DATA) if end < size else size
        except OSError:  # ENXIO: nothing but holes after the last record
            data_start = size
        finally:
            os.close(fd)
        torn += size - data_start
    return torn


def record_of(tier: DiskTier, key: str) -> tuple[Path, int, int]:
    """(segment path, offset, record bytes) of the record the tier serves `key` from."""
    entry = tier._index[key]
    return Path(tier._segment_path(entry.segment_id)), entry.offset, entry.record_num_bytes


def test_blocks_survive_restart_bit_exact(layout, tmp_path):
    blocks = {key_of(i, layer): make_block(layout, 10 * i + layer) for i in range(5) for layer in range(3)}
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert all(r.ok for r in tier.put_many(list(blocks), list(blocks.values())))
        used = tier.used_bytes
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert tier.used_bytes == used
        assert all(tier.contains_many(list(blocks)))
        for key, block in blocks.items():
            got = tier.get(key)
            assert got.dtype == block.dtype and torch.equal(got.view(torch.int16), block.view(torch.int16))


def test_restart_keeps_lru_order_and_shrinks_to_capacity(layout, tmp_path):
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        for i in range(4):
            tier.put(key_of(i), make_block(layout, i))
        assert tier.get(key_of(0)) is not None  # LRU order now 1, 2, 3, 0
    with DiskTier("disk", layout, 2 * layout.num_bytes, tmp_path) as tier:  # smaller: the oldest two go
        assert [tier.contains(key_of(i)) for i in range(4)] == [True, False, False, True]
        assert tier.counters["evictions"] == 2
        assert sorted(keys_on_disk(tmp_path)) == [key_of(0), key_of(3)]
        assert torch.equal(tier.get(key_of(0)), make_block(layout, 0))


def test_restart_after_a_crash_keeps_write_order(layout, tmp_path):
    tier = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path)
    for i in range(4):
        tier.put(key_of(i), make_block(layout, i))
    assert tier.get(key_of(0)) is not None
    # The process dies: no close, no saved LRU order; the log's write order stands.
    with DiskTier("disk", layout, 2 * layout.num_bytes, tmp_path) as restarted:
        assert [restarted.contains(key_of(i)) for i in range(4)] == [False, False, True, True]


def test_index_rebuild_from_segments(layout, tmp_path):
    """Many segments, overwrites and removals: a restart finds exactly the live blocks, bit-exact."""
    segment_bytes = 3 * (layout.num_bytes + seg.ALIGN)  # three records a segment
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, segment_bytes=segment_bytes) as tier:
        for first in range(0, 12, 3):  # a put_many goes to one segment; the next one starts another
            keys = [key_of(i) for i in range(first, first + 3)]
            assert all(r.ok for r in tier.put_many(keys, [make_block(layout, i) for i in range(first, first + 3)]))
        assert tier.put(key_of(3), make_block(layout, 103)).ok  # overwritten: the later record wins
        assert tier.remove_many([key_of(6), key_of(7), key_of(8)]) == [True, True, True]  # a whole segment
        assert tier.remove(key_of(9))
        used = tier.used_bytes
    assert len(list(tmp_path.glob("*.seg"))) == 4  # the segment of 6, 7 and 8 is gone
    os.unlink(tmp_path / "lru.order")  # rebuilt from the segments alone
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, segment_bytes=segment_bytes) as tier:
        live = [i for i in range(12) if i not in (6, 7, 8, 9)]
        assert tier.used_bytes == used == len(live) * layout.num_bytes
        assert tier.contains_many([key_of(i) for i in range(12)]) == [i in live for i in range(12)]
        for i in live:
            assert torch.equal(tier.get(key_of(i)), make_block(layout, 103 if i == 3 else i))
        assert tier.counters["corrupt_blocks"] == 0
        assert sorted(keys_on_disk(tmp_path)) == sorted(key_of(i) for i in live)  # superseded record punched


class SimulatedCrash(BaseException):
    """The process dies: no except-OSError cleanup runs."""


def process_died(tier: DiskTier) -> None:
    """What the kernel does for a dead process: its lock on the directory's live file goes (disk_peers),
    so the next tier on the directory starts alone and repairs it."""
    tier._files.peers.close()


def test_failed_append_is_cut_away_and_old_value_stays(layout, tmp_path, monkeypatch):
    key = key_of(1)
    old, new = make_block(layout, 1), make_block(layout, 2)
    tier = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path)
    assert tier.put(key, old).ok
    real_pwritev = os.pwritev

    def failing_pwritev(fd, buffers, offset):
        real_pwritev(fd, [memoryview(buffers[0])[:100]], offset)  # part of the record reaches the file
        raise OSError(errno.EIO, "injected write failure")

    monkeypatch.setattr(os, "pwritev", failing_pwritev)
    result = tier.put(key, new)
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    assert not result.ok and "EIO" in result.error
    assert torn_bytes(tmp_path) == 0  # the failed put cut its bytes away
    assert torch.equal(tier.get(key), old)
    assert tier.counters["put_failures"] == 1 and tier.counters["errors"] == 1
    assert tier.put(key_of(2), new).ok and torch.equal(tier.get(key_of(2)), new)
    tier.close()


@pytest.mark.parametrize("torn_at", ["header", "payload", "last_byte"])
def test_crash_mid_append_leaves_no_torn_block_after_restart(layout, tmp_path, monkeypatch, torn_at, caplog):
    """The crash equivalent of dying between write and rename: a torn record at the tail of a segment."""
    key = key_of(1)
    old, new = make_block(layout, 1), make_block(layout, 2)
    tier = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path)
    assert tier.put(key, old).ok
    assert tier.put(key_of(2), make_block(layout, 3)).ok
    real_pwritev = os.pwritev
    num_bytes = {"header": 7, "payload": seg.ALIGN + layout.num_bytes // 2, "last_byte": seg.ALIGN + layout.num_bytes - 1}

    def crashing_pwritev(fd, buffers, offset):
        whole = b"".join(bytes(b) for b in buffers)
        real_pwritev(fd, [whole[: num_bytes[torn_at]]], offset)
        raise SimulatedCrash()

    monkeypatch.setattr(os, "pwritev", crashing_pwritev)
    with pytest.raises(SimulatedCrash):
        tier.put(key, new)  # dies with part of the new record written
    process_died(tier)
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    assert torn_bytes(tmp_path) == num_bytes[torn_at]

    with caplog.at_level(logging.WARNING, logger="tierkv.storage.disk"):
        restarted = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path)  # the old process is gone
    assert f"dropping {num_bytes[torn_at]} bytes after the last whole record" in caplog.text
    assert torn_bytes(tmp_path) == 0  # the torn tail was cut off
    assert torch.equal(restarted.get(key), old)
    assert torch.equal(restarted.get(key_of(2)), make_block(layout, 3))
    assert restarted.counters["corrupt_blocks"] == 0
    assert restarted.put(key, new).ok and torch.equal(restarted.get(key), new)
    restarted.close()


def test_crash_after_append_before_indexing_serves_the_new_block(layout, tmp_path, monkeypatch):
    key = key_of(1)
    tier = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path)
    assert tier.put(key, make_block(layout, 1)).ok

    def crashing_commit(*args):
        raise SimulatedCrash()

    monkeypatch.setattr(tier, "_commit", crashing_commit)
    with pytest.raises(SimulatedCrash):
        tier.put(key, make_block(layout, 2))  # the whole record is in the file
    process_died(tier)
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as restarted:
        assert torch.equal(restarted.get(key), make_block(layout, 2))  # the later record of a key wins
        assert restarted.used_bytes == layout.num_bytes
        assert keys_on_disk(tmp_path) == [key]  # the older record was punched at start


def test_torn_tail_is_dropped_at_start(layout, tmp_path):
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert all(r.ok for r in tier.put_many([key_of(i) for i in range(3)], [make_block(layout, i) for i in range(3)]))
    (path,) = tmp_path.glob("*.seg")
    whole = path.read_bytes()
    record_num_bytes = len(whole) // 3
    with open(path, "ab") as f:
        f.write(whole[: record_num_bytes - 5])  # a record cut short: its last bytes never came
    assert torn_bytes(tmp_path) == record_num_bytes - 5
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert path.stat().st_size == len(whole)
        assert [torch.equal(tier.get(key_of(i)), make_block(layout, i)) for i in range(3)] == [True] * 3
        assert tier.counters["corrupt_blocks"] == 0 and tier.used_bytes == 3 * layout.num_bytes


@pytest.mark.parametrize("damage", ["flip_payload_byte", "flip_header_byte", "truncate", "zero"])
def test_corrupt_record_is_a_counted_miss_and_dropped(layout, tmp_path, damage):
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        key, other = key_of(7), key_of(8)
        tier.put(other, make_block(layout, 8))
        tier.put(key, make_block(layout, 7))  # the last record: "truncate" cuts only this one
        path, offset, record_num_bytes = record_of(tier, key)
        data = bytearray(path.read_bytes())
        if damage == "flip_payload_byte":
            data[offset + seg.ALIGN + layout.num_bytes - 100] ^= 0x01
        elif damage == "flip_header_byte":
            data[offset + 10] ^= 0x40
        elif damage == "truncate":
            data = data[: offset + record_num_bytes // 2]
        else:  # a lost write: the bytes never reached the device
            data[offset : offset + record_num_bytes] = bytes(record_num_bytes)
        path.write_bytes(bytes(data))

        assert tier.get(key) is None
        assert tier.counters["corrupt_blocks"] == 1
        assert tier.counters["misses"] == 1
        assert not tier.contains(key)
        assert tier.used_bytes == layout.num_bytes
        assert torch.equal(tier.get(other), make_block(layout, 8))
        assert keys_on_disk(tmp_path) == [other]  # dropped on disk too: a restart will not find it
        assert tier.put(key, make_block(layout, 7)).ok and torch.equal(tier.get(key), make_block(layout, 7))


def test_blocks_put_again_into_a_segment_found_corrupt_are_written_afresh(layout, tmp_path):
    """A segment with several damaged records: a lookup stops at the first (dropped), the request
    recomputes the rest and puts them again; those still indexed in that segment were taken as held
    (same checksum) and kept their damaged records, so each later lookup found one more. Now they are
    written afresh: after one put every block reads back intact."""
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        keys, blocks = [key_of(i) for i in range(6)], [make_block(layout, i) for i in range(6)]
        assert all(r.ok for r in tier.put_many(keys, blocks))
        path = record_of(tier, keys[0])[0]
        data = bytearray(path.read_bytes())
        for key in keys[2:]:  # four damaged payloads
            _, offset, _ = record_of(tier, key)
            data[offset + seg.ALIGN + 17] ^= 0x10
        path.write_bytes(bytes(data))
        assert tier.get(keys[2]) is None  # the lookup's first corrupt block: dropped
        # the rest of that segment counts as not held (a chain's write-through then writes it again)
        assert [tier.contains(k) for k in keys] == [False] * 6
        assert all(r.ok for r in tier.put_many(keys[2:], blocks[2:]))  # the request's recomputed blocks
        assert [tier.contains(k) for k in keys] == [False, False, True, True, True, True]
        assert record_of(tier, keys[3])[0] != path  # into a new segment: the suspected one takes no more
        assert [torch.equal(b, want) for b, want in zip(tier.get_many(keys), blocks)] == [True] * 6
        assert tier.counters["corrupt_blocks"] == 1


@pytest.fixture
def small_filesystem(tmp_path):
    """A 1 MiB tmpfs, or None where mounting is not permitted."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def check_full_disk_makes_room(layout, path: Path, capacity_bytes: int) -> None:
    """A file system smaller than capacity_bytes: the put that finds it full lowers max_blocks, evicts the least
    recently used blocks and is stored; later puts keep working (the tier does not stay full), nothing is torn,
    and every block is either read back bit-exact or a miss."""
    tier = DiskTier("disk", layout, capacity_bytes, path, return_evicted=False)
    initial = tier.max_blocks
    for i in range(400):
        assert tier.put(key_of(i), make_block(layout, i)).ok, f"put {i} failed: the tier stayed full"
    assert tier.max_blocks < initial and tier.counters["evictions"] > 0 and tier.counters["put_failures"] == 0
    from tierkv.storage.chain import TierChain
    from tierkv.storage.cpu import CpuTier

    shown = TierChain([CpuTier("cpu", layout, layout.num_bytes, pin_memory=False), tier]).snapshot()["tiers"][1]
    assert shown["capacity_bytes"] == tier.max_blocks * layout.num_bytes < capacity_bytes  # the stats say so
    assert shown["used_bytes"] == tier.used_bytes
    assert torn_bytes(path) == 0
    got = tier.get_many([key_of(i) for i in range(400)])
    assert all(g is None or torch.equal(g, make_block(layout, i)) for i, g in enumerate(got))
    assert all(g is not None for g in got[-tier.max_blocks // 2 :])  # the recent ones are kept
    tier.close()


def test_disk_full_on_real_tmpfs(layout, small_filesystem):
    if small_filesystem is None:
        pytest.skip("mount -t tmpfs is not permitted here; test_disk_full_injected_enospc covers the logic")
    check_full_disk_makes_room(layout, small_filesystem, CAPACITY_BYTES)


@pytest.mark.parametrize("freed", [True, False])
def test_disk_full_injected_enospc(layout, tmp_path, monkeypatch, freed, caplog):
    """ENOSPC injected into os.pwritev after a few blocks (a short write first, as a filling disk does). The put
    tries again, then lowers the capacity to the 5 blocks held and evicts the oldest; if that freed room it is
    stored, else it fails naming ENOSPC after that one round (no loop), nothing torn, the other blocks intact."""
    real_pwritev, calls = os.pwritev, [0]
    tier = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, return_evicted=False)

    def pwritev_until_full(fd, buffers, offset):
        calls[0] += 1
        if calls[0] <= 5 or (freed and tier.counters["evictions"] > 0):
            return real_pwritev(fd, buffers, offset)
        if calls[0] == 6:
            return real_pwritev(fd, [memoryview(buffers[0])[:7]], offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for i in range(5):
        assert tier.put(key_of(i), make_block(layout, i)).ok
    monkeypatch.setattr(os, "pwritev", pwritev_until_full)
    calls[0] = 5
    with caplog.at_level(logging.WARNING):
        result = tier.put(key_of(5), make_block(layout, 5))
    assert "is full: capacity lowered from 8192 to 5 blocks" in caplog.text
    assert tier.max_blocks == 5 and not tier.contains(key_of(0)) and tier.counters["evictions"] == 1
    assert torn_bytes(tmp_path) == 0
    if freed:
        assert result.ok and torch.equal(tier.get(key_of(5)), make_block(layout, 5))
        assert tier.put(key_of(6), make_block(layout, 6)).ok and len(tier._index) == 5
    else:
        assert not result.ok and "ENOSPC" in result.error and tier.counters["put_failures"] == 1
        assert calls[0] == 9 and tier.get(key_of(5)) is None  # the short write and its rest, again, after evicting
    for i in range(1, 5):
        got = tier.get(key_of(i))
        assert got is None or torch.equal(got, make_block(layout, i))
    assert torch.equal(tier.get(key_of(4)), make_block(layout, 4))
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    tier.close()


def test_a_full_disk_hands_its_evicted_blocks_down(layout, tmp_path, monkeypatch):
    """With a tier below (return_evicted), the blocks a full disk evicts come back in the put's result."""
    tier = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, return_evicted=True)
    for i in range(3):
        assert tier.put(key_of(i), make_block(layout, i)).ok
    real_pwritev = os.pwritev

    def full_until_evicted(fd, buffers, offset):
        if tier.counters["evictions"] == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", full_until_evicted)
    result = tier.put(key_of(3), make_block(layout, 3))
    assert result.ok and [k for k, _ in result.evicted] == [key_of(0)]
    assert torch.equal(result.evicted[0][1], make_block(layout, 0))
    tier.close()


def test_threads_on_a_full_disk_do_not_ratchet_the_capacity_down(layout, tmp_path, monkeypatch):
    """Eight threads putting into an 8 MiB tmpfs: each full write makes room once, after trying again (another
    thread may have made it meanwhile), so the capacity settles near what fits, not near nothing (each thread
    lowering it to what was left after the others' evictions took it down to a handful of blocks)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount_point)],
                      capture_output=True).returncode != 0:
        pytest.skip("mount -t tmpfs is not permitted here; test_disk_full_injected_enospc covers one thread")
    try:
        tier = DiskTier("disk", layout, CAPACITY_BYTES, mount_point, segment_bytes=1 << 20)  # evicted blocks read back
        read_blocks = tier._read_blocks

        def slow_read_back(*args):  # a slow disk: evicted blocks are read back before their space is freed
            time.sleep(0.005)
            return read_blocks(*args)

        monkeypatch.setattr(tier, "_read_blocks", slow_read_back)
        fits = (8 << 20) // (seg.round_up(layout.num_bytes) + seg.ALIGN)

        def worker(w: int) -> None:
            for n in range(0, 200, 5):
                keys = [key_of(w * 1000 + n + j) for j in range(5)]
                tier.put_many(keys, [make_block(layout, w * 1000 + n + j) for j in range(5)])

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert tier.max_blocks >= fits // 2, f"capacity {tier.max_blocks} blocks where {fits} fit"
        keys = [key_of(w * 1000 + n) for w in range(8) for n in range(200)]
        got = tier.get_many(keys)
        assert all(g is None or torch.equal(g, make_block(layout, int(k[:64], 16))) for k, g in zip(keys, got))
        assert sum(g is not None for g in got) >= fits // 2
        tier.close()
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_capacity_evicts_least_recently_used(layout, tmp_path):
    keys = [key_of(i) for i in range(4)]
    with DiskTier("disk", layout, 3 * layout.num_bytes + 5, tmp_path / "disk") as tier:  # 3 blocks
        for i in range(3):
            assert tier.put(keys[i], make_block(layout, i)).evicted == []
        assert tier.get(keys[0]) is not None  # 0 is now the most recent; 1 is the oldest
        result = tier.put(keys[3], make_block(layout, 3))
        assert result.ok and [k for k, _ in result.evicted] == [keys[1]]
        assert torch.equal(result.evicted[0][1], make_block(layout, 1))
        assert keys[1] not in keys_on_disk(tmp_path / "disk")
        assert tier.contains_many(keys) == [True, False, True, True]
        assert tier.used_bytes == 3 * layout.num_bytes and tier.counters["evictions"] == 1
        tier.return_evicted = False  # the chain has no tier below: drop unread
        result = tier.put(keys[1], make_block(layout, 1))
        assert result.ok and result.evicted == [] and tier.counters["evictions"] == 2
        assert tier.contains_many(keys) == [True, True, False, True]  # 2 was the oldest
        assert sorted(keys_on_disk(tmp_path / "disk")) == sorted(keys[i] for i in (0, 1, 3))


def test_unwritable_path_raises_naming_it(layout, tmp_path):
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("x")
    bad = not_a_dir / "blocks"
    with pytest.raises(TierError, match="plain-file/blocks"):
        DiskTier("disk", layout, CAPACITY_BYTES, bad)
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTier("disk", layout, 10, tmp_path)


def test_concurrent_puts_and_gets_of_same_keys_never_tear(layout, tmp_path):
    versions = [make_block(layout, seed) for seed in range(4)]
    keys = [key_of(i) for i in range(8)]
    errors: list[str] = []
    with DiskTier("disk", layout, 6 * layout.num_bytes, tmp_path) as tier:

        def writer(seed: int) -> None:
            for _ in range(25):
                for key in keys:
                    if not tier.put(key, versions[seed]).ok:
                        errors.append("put failed")

        def reader() -> None:
            for _ in range(50):
                for block in tier.get_many(keys):
                    if block is not None and not any(torch.equal(block, v) for v in versions):
                        errors.append("torn block")

        threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(4)]
        threads += [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert errors == [] and tier.counters["corrupt_blocks"] == 0
        assert tier.used_bytes <= tier.capacity_bytes
        assert tier.used_bytes == layout.num_bytes * len(keys_on_disk(tmp_path))
        assert torn_bytes(tmp_path) == 0


def test_reput_of_identical_bytes_only_refreshes_and_different_bytes_rewrite(tmp_path):
    from tierkv.blocks import BlockLayout
    from tierkv.storage.disk import DiskTier

    layout = BlockLayout(2, 8, 32, torch.bfloat16)
    tier = DiskTier("disk", layout, 3 * layout.num_bytes, tmp_path / "d")
    try:
        blocks = {k: torch.randn(layout.shape).to(layout.dtype) for k in ("a/L0", "b/L0", "c/L0")}
        for key, block in blocks.items():
            assert tier.put(key, block).ok
        written = tier.counters["bytes_written"]
        assert tier.put("a/L0", blocks["a/L0"]).ok           # same content address, same bytes
        assert tier.counters["bytes_written"] == written     # nothing rewritten
        tier.put("d/L0", torch.randn(layout.shape).to(layout.dtype))
        assert tier.contains_many(["a/L0", "b/L0"]) == [True, False]  # the refresh made "a" most recent
        other = torch.randn(layout.shape).to(layout.dtype)
        assert tier.put("a/L0", other).ok
        assert torch.equal(tier.get("a/L0"), other)          # different bytes are written
    finally:
        tier.close()


def test_two_live_tiers_on_one_path_each_write_their_own_segments(layout, tmp_path):
    """Tensor-parallel ranks may share a disk path: segment ids never collide, no put fails."""
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as a, DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as b:
        assert a.put(key_of(1), make_block(layout, 1)).ok and b.put(key_of(2), make_block(layout, 2)).ok
        assert torch.equal(a.get(key_of(1)), make_block(layout, 1)) and torch.equal(b.get(key_of(2)), make_block(layout, 2))
    assert sorted(keys_on_disk(tmp_path)) == [key_of(1), key_of(2)]


def test_removed_records_at_a_segment_tail_are_trimmed_on_restart_without_a_warning(layout, tmp_path, caplog):
    """Removing the newest records punches holes at the segment's tail; a restart trims them quietly
    (a warning there would say data was dropped) and keeps the rest."""
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert all(r.ok for r in tier.put_many([key_of(i) for i in range(4)], [make_block(layout, i) for i in range(4)]))
        assert tier.remove_many([key_of(2), key_of(3)]) == [True, True]
    with caplog.at_level(logging.DEBUG, logger="tierkv.storage.disk"):
        with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
            assert tier.contains_many([key_of(i) for i in range(4)]) == [True, True, False, False]
            assert torch.equal(tier.get(key_of(1)), make_block(layout, 1))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, [r.getMessage() for r in warnings]
    assert any("trimming" in r.getMessage() and "punched holes" in r.getMessage() for r in caplog.records)


def test_a_sealed_disk_tier_shows_the_capacity_its_inner_tier_holds(tmp_path):
    """The stats' capacity_bytes passes through a wrapping tier (sealed, quantized): a sealed disk tier's lowered
    capacity showed the configured one."""
    from tierkv.blocks import BlockLayout
    from tierkv.storage.auth import BlockSealer
    from tierkv.storage.chain import TierChain
    from tierkv.storage.cpu import CpuTier
    from tierkv.storage.sealed import SealedTier

    layout = BlockLayout(2, 8, 16, torch.float16)
    sealer = BlockSealer(b"0123456789abcdef-deployment", layout, encrypt=False)
    inner = DiskTier("disk", sealer.sealed_layout, 64 * sealer.num_bytes, tmp_path)
    with SealedTier(inner, layout, sealer) as tier:
        inner.max_blocks = 5  # as a full file system leaves it (_make_room)
        shown = TierChain([CpuTier("cpu", layout, layout.num_bytes, pin_memory=False), tier]).snapshot()["tiers"][1]
        assert shown["capacity_bytes"] == 5 * sealer.num_bytes


_FILE_SIZE_LIMIT_SCRIPT = """
import resource, sys, torch
from tierkv.blocks import BlockLayout
from tierkv.storage.disk import DiskTier
from tests.storage.blocks import make_block, same
layout = BlockLayout(num_kv_heads=2, block_tokens=16, head_dim=64, dtype=torch.bfloat16)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
tier = DiskTier("disk", layout, 64 << 20, sys.argv[1])
results = [tier.put(f"{i:064x}/L0", make_block(layout, i)) for i in range(40)]
assert all(r.ok for r in results), [r.error for r in results if not r.ok][:2]
assert all(same(tier.get(f"{i:064x}/L0"), make_block(layout, i)) for i in range(40))
assert tier.counters["put_failures"] == 0, tier.counters
tier.close()
"""


def test_a_file_size_limit_below_segment_bytes_fills_the_segment_and_the_next_takes_the_blocks(tmp_path):
    """RLIMIT_FSIZE of 64 KiB (a real limit, in a child process; segments are at least 1 MiB): each segment that
    meets it (EFBIG) is full and the next one takes the blocks, so no put fails; after a restart without the
    limit every block reads back bit for bit from several segments, none past the limit."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([os.sys.executable, "-c", _FILE_SIZE_LIMIT_SCRIPT, str(tmp_path)], cwd=root,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "met a file size limit at" in run.stderr
    segments = sorted(tmp_path.glob("*.seg"))
    assert len(segments) >= 5 and all(p.stat().st_size <= 64 << 10 for p in segments)
    layout_ = BlockLayout(num_kv_heads=2, block_tokens=16, head_dim=64, dtype=torch.bfloat16)
    tier = DiskTier("disk", layout_, CAPACITY_BYTES, tmp_path)
    try:
        for i in range(40):
            assert torch.equal(tier.get(key_of(i)).view(torch.uint8), make_block(layout_, i).view(torch.uint8))
    finally:
        tier.close()
