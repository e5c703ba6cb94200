"""DiskTier reads (disk_reads): device reads in pieces checked behind the reads, page-cache misses, mixed headers."""
from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from tierkv.storage import disk_io, disk_reads
from tierkv.storage.disk import DiskTier
from tests.storage.blocks import make_block

CAPACITY_BYTES = 64 << 20
PIECE_BYTES = 64 << 10  # 8 KiB blocks in 12 KiB records: 6 records a piece


def key_of(i: int) -> str:
    return f"{i:064x}/L0"


def flip_payload_byte(tier: DiskTier, key: str) -> None:
    entry = tier._index[key]
    with open(tier._segment_path(entry.segment_id), "r+b") as f:
        f.seek(entry.offset + entry.header_num_bytes + 100)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture
def from_device(monkeypatch):
    """Every read goes to the device (cachestat says nothing is cached), in pieces of PIECE_BYTES;
    yields the ids of the threads that checked blocks."""
    monkeypatch.setattr(disk_io, "cached_bytes", lambda *args: 0)
    monkeypatch.setattr(disk_reads, "_MIN_PIECE_BYTES", PIECE_BYTES)
    monkeypatch.setattr(disk_reads, "_MAX_PIECE_BYTES", PIECE_BYTES)
    checked_on: set[int] = set()
    check_slots = disk_reads.BatchReader._check_slots

    def recording(self, *args):
        checked_on.add(threading.get_ident())
        return check_slots(self, *args)

    monkeypatch.setattr(disk_reads.BatchReader, "_check_slots", recording)
    return checked_on


def test_corrupt_block_mid_batch_from_the_device_is_a_counted_miss_and_the_rest_are_exact(
    layout, tmp_path, from_device
):  # fmt: skip
    keys, blocks = [key_of(i) for i in range(40)], [make_block(layout, i) for i in range(40)]
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, num_io_threads=2, segment_bytes=200 << 10) as tier:
        for start in range(0, 40, 20):  # a segment takes a put_many past segment_bytes, then the next begins
            assert all(r.ok for r in tier.put_many(keys[start : start + 20], blocks[start : start + 20]))
        assert len(list(tmp_path.glob("*.seg"))) == 2
        flip_payload_byte(tier, keys[17])
        got = tier.get_many(keys[::-1])[::-1]  # asked out of disk order
        assert got[17] is None
        assert all(torch.equal(g.view(torch.int16), b.view(torch.int16)) for i, (g, b) in enumerate(zip(got, blocks))
                   if i != 17)  # fmt: skip
        assert tier.counters["corrupt_blocks"] == 1 and tier.counters["misses"] == 1
        assert not tier.contains(keys[17]) and tier.used_bytes == 39 * layout.num_bytes
    assert from_device - {threading.get_ident()}, "no piece was checked behind the reads"


def test_failed_device_read_mid_batch_fails_the_rest_of_its_run_only(layout, tmp_path, from_device, monkeypatch):
    keys, blocks = [key_of(i) for i in range(20)], [make_block(layout, i) for i in range(20)]
    read_at, calls = disk_io.read_at, []

    def failing_second(*args):
        calls.append(args[2])
        if len(calls) == 2:
            raise OSError(errno.EIO, "injected")
        return read_at(*args)

    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, num_io_threads=2) as tier:
        tier.put_many(keys, blocks)
        monkeypatch.setattr(disk_io, "read_at", failing_second)
        got = tier.get_many(keys)
        first_piece = sum(g is not None for g in got)
        assert 0 < first_piece < 20 and all(g is None for g in got[first_piece:])  # one segment: one run
        assert all(torch.equal(g, b) for g, b in zip(got[:first_piece], blocks))
        assert tier.counters["errors"] == 20 - first_piece and tier.counters["corrupt_blocks"] == 0
        monkeypatch.setattr(disk_io, "read_at", read_at)
        assert all(torch.equal(g, b) for g, b in zip(tier.get_many(keys), blocks))  # kept: a read error drops nothing


def test_page_cache_misses_found_while_copying_are_read_from_the_device(layout, tmp_path, monkeypatch):
    keys, blocks = [key_of(i) for i in range(200)], [make_block(layout, i) for i in range(200)]
    read_cached, read_at, calls = disk_io.read_cached, disk_io.read_at, {"cached": 0, "device": 0}

    def missing_second(*args):
        calls["cached"] += 1
        return 0 if calls["cached"] == 2 else read_cached(*args)  # like RWF_NOWAIT on pages no longer cached

    def counted(*args):
        calls["device"] += 1
        return read_at(*args)

    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, num_io_threads=2) as tier:
        tier.put_many(keys, blocks)  # 2.4 MiB: copied a MiB at a time
        monkeypatch.setattr(disk_io, "cached_bytes", lambda *args: None)  # a kernel without cachestat
        monkeypatch.setattr(disk_io, "read_cached", missing_second)
        monkeypatch.setattr(disk_io, "read_at", counted)
        got = tier.get_many(keys)
        assert calls["cached"] >= 2 and calls["device"] >= 1
        assert all(torch.equal(g, b) for g, b in zip(got, blocks))
        assert tier.counters["corrupt_blocks"] == 0 and tier.counters["hits"] == 200


@pytest.mark.parametrize("where", ["page_cache", "device"])
def test_records_with_larger_headers_share_a_batch_bit_exact(layout, tmp_path, monkeypatch, where):
    keys = [key_of(i) if i % 3 else f"{i}/" + "k" * 5000 for i in range(30)]  # every third: an 8 KiB header region
    blocks = [make_block(layout, i) for i in range(30)]
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        tier.put_many(keys, blocks)
        assert {tier._index[k].header_num_bytes for k in keys} == {4096, 8192}
        if where == "device":
            monkeypatch.setattr(disk_io, "cached_bytes", lambda *args: 0)
            monkeypatch.setattr(disk_reads, "_MIN_PIECE_BYTES", PIECE_BYTES)
        got = tier.get_many(keys)
        assert all(torch.equal(g.view(torch.int16), b.view(torch.int16)) for g, b in zip(got, blocks))
        assert all(g.is_contiguous() and g.data_ptr() % 4096 == 0 for g in got)
        assert tier.counters["corrupt_blocks"] == 0
