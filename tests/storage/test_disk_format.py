"""The disk tier's record format (checksum kinds, format versions) and its read path (cachestat, read buffers)."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from tierkv.storage import disk_io
from tierkv.storage import disk_segments as seg
from tierkv.storage.codec import CorruptBlock
from tierkv.storage.disk import DiskTier
from tierkv.storage.disk_buffers import ReadBufferPool, slab_bytes
from tests.storage.blocks import make_block

CAPACITY_BYTES = 64 << 20


def key_of(i: int) -> str:
    return f"{i:064x}/L0"


def payload_of(block: torch.Tensor) -> bytes:
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def write_segment(path: Path, layout, blocks: dict[str, torch.Tensor], kind: int, version: int) -> list[int]:
    """A segment file of these blocks as records of `version` with `kind` checksums; their offsets."""
    dtype_name = str(layout.dtype).removeprefix("torch.")
    offsets, parts, offset = [], [], 0
    for key, block in blocks.items():
        payload = payload_of(block)
        header = seg.encode_header(key, dtype_name, tuple(layout.shape), len(payload), seg.checksum(kind, payload),
                                   kind=kind, version=version)  # fmt: skip
        parts += [header.data, payload, bytes(seg.round_up(len(payload)) - len(payload))]
        offsets.append(offset)
        offset += header.record_num_bytes
    path.write_bytes(b"".join(parts))
    return offsets


def test_new_records_are_version_2_with_xxh3_checksums(layout, tmp_path):
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        tier.put(key_of(1), make_block(layout, 1))
    (path,) = tmp_path.glob("*.seg")
    data = path.read_bytes()
    assert data[:4] == seg.MAGIC and int.from_bytes(data[4:6], "little") == 2
    assert data[24] == seg.XXH3_64 == seg.CHECKSUM_KIND
    header = seg.parse_header(data)
    assert header.checksum_kind == seg.XXH3_64 and header.key == key_of(1)
    payload = data[header.header_num_bytes : header.header_num_bytes + layout.num_bytes]
    assert header.payload_checksum == seg.checksum(seg.XXH3_64, payload) != seg.checksum(seg.CRC32, payload)


def test_version_1_crc32_records_are_read_and_verified(layout, tmp_path):
    blocks = {key_of(i): make_block(layout, i) for i in range(3)}
    path = tmp_path / f"{0:016x}.seg"
    offsets = write_segment(path, layout, blocks, seg.CRC32, version=1)
    data = bytearray(path.read_bytes())
    data[offsets[2] + seg.ALIGN + 5] ^= 0x10  # the third block's payload: its CRC-32 no longer matches
    path.write_bytes(bytes(data))
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert tier.used_bytes == 3 * layout.num_bytes  # all three headers are whole: indexed
        assert torch.equal(tier.get(key_of(0)), blocks[key_of(0)])
        assert torch.equal(tier.get(key_of(1)), blocks[key_of(1)])
        assert tier.put(key_of(0), blocks[key_of(0)]).ok  # same bytes: the CRC-32 record is kept
        assert tier._index[key_of(0)].checksum_kind == seg.CRC32
        assert tier.get(key_of(2)) is None and tier.counters["corrupt_blocks"] == 1
        assert tier.put(key_of(1), blocks[key_of(1)]).ok  # its segment held a corrupt record: written afresh
        assert tier._index[key_of(1)].checksum_kind == seg.XXH3_64
        assert tier.put(key_of(2), make_block(layout, 2)).ok  # rewritten as a version 2 record
        assert tier._index[key_of(2)].checksum_kind == seg.XXH3_64
        assert torch.equal(tier.get(key_of(2)), make_block(layout, 2))


@pytest.mark.parametrize("kind", [seg.CRC32, seg.XXH3_64])
@pytest.mark.parametrize("where", ["payload", "header"])
def test_corruption_is_detected_with_either_checksum(layout, tmp_path, kind, where):
    blocks = {key_of(1): make_block(layout, 1), key_of(2): make_block(layout, 2)}
    path = tmp_path / f"{0:016x}.seg"
    offsets = write_segment(path, layout, blocks, kind, version=2)
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:  # indexes both, then one is damaged
        data = bytearray(path.read_bytes())
        data[offsets[1] + (seg.ALIGN + layout.num_bytes - 1 if where == "payload" else 12)] ^= 0x01
        path.write_bytes(bytes(data))
        assert tier.get(key_of(2)) is None
        assert tier.counters["corrupt_blocks"] == 1 and not tier.contains(key_of(2))
        assert torch.equal(tier.get(key_of(1)), blocks[key_of(1)])


def test_header_checksum_kinds_and_versions_are_checked():
    with pytest.raises(ValueError, match="version 1 holds CRC-32"):
        seg.encode_header("k", "bfloat16", (2,), 4, 0, kind=seg.XXH3_64, version=1)
    with pytest.raises(ValueError, match="checksum kind"):
        seg.encode_header("k", "bfloat16", (2,), 4, 0, kind=7)
    data = bytearray(seg.encode_header("k", "bfloat16", (2,), 4, 0).data)
    data[24] = 7  # an unknown kind
    with pytest.raises(CorruptBlock, match="unknown checksum kind"):
        seg.parse_header(data)
    old = seg.parse_header(seg.encode_header("k", "bfloat16", (2, 3), 4, 99, kind=seg.CRC32, version=1).data)
    assert (old.checksum_kind, old.payload_checksum, old.shape, old.header_num_bytes) == (seg.CRC32, 99, (2, 3), 4096)


def test_cached_bytes_sees_the_page_cache_without_reading(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(os.urandom(1 << 20))
    modes = disk_io.ReadModes()
    fd = os.open(path, os.O_RDONLY)
    try:
        if disk_io.cached_bytes(fd, 0, 1 << 20, modes) is None:
            pytest.skip("cachestat(2) is not available on this kernel")
        assert disk_io.cached_bytes(fd, 4096, 8192, modes) == 8192  # just written: cached
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if disk_io.cached_bytes(fd, 0, 1 << 20, modes) != 0:
            pytest.skip("this filesystem keeps the pages (tmpfs)")
        assert disk_io.cached_bytes(fd, 0, 1 << 20, modes) == 0  # asking did not read them in
    finally:
        os.close(fd)


def test_cold_get_reads_the_device_without_filling_the_page_cache(layout, tmp_path):
    blocks = [make_block(layout, i) for i in range(40)]
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        tier.put_many([key_of(i) for i in range(40)], blocks)
        (path,) = tmp_path.glob("*.seg")
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if disk_io.cached_bytes(fd, 0, path.stat().st_size, tier._modes) != 0:
                pytest.skip("no cachestat(2), or this filesystem keeps the pages")
            got = tier.get_many([key_of(i) for i in range(40)])
            assert all(torch.equal(g, b) for g, b in zip(got, blocks))
            if tier._modes.is_direct_ok:  # O_DIRECT, and no readahead started by a RWF_NOWAIT probe
                assert disk_io.cached_bytes(fd, 0, path.stat().st_size, tier._modes) == 0
        finally:
            os.close(fd)


def test_read_buffers_are_aligned_and_recycled_only_once_freed():
    pool = ReadBufferPool(max_free_bytes=8 << 20)
    first = pool.empty(3 << 20)
    assert first.numel() == 3 << 20 and first.data_ptr() % 4096 == 0 and slab_bytes(3 << 20) == 4 << 20
    row = first[1 << 20 :]  # a view keeps the slab
    ptr = first.data_ptr()
    del first
    gc.collect()
    second = pool.empty(3 << 20)
    assert second.data_ptr() != ptr  # still in use through `row`
    del row
    gc.collect()
    assert pool.free_bytes == 4 << 20
    third = pool.empty(3 << 20)
    assert third.data_ptr() == ptr and pool.free_bytes == 0  # the freed slab, reused
    del second, third
    gc.collect()
    assert pool.free_bytes == 8 << 20
    pool.empty(5 << 20)  # another size: a new slab; when freed, the oldest kept ones go
    gc.collect()
    assert pool.free_bytes <= 8 << 20
    pool.clear()
    assert pool.free_bytes == 0


def test_get_many_results_stay_valid_while_later_reads_reuse_buffers(layout, tmp_path):
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, read_buffer_bytes=1 << 20) as tier:
        tier.put_many([key_of(i) for i in range(8)], [make_block(layout, i) for i in range(8)])
        kept = tier.get_many([key_of(i) for i in range(4)])
        for _ in range(3):
            tier.get_many([key_of(i) for i in range(4, 8)])  # freed at once: their slab is reused
        assert all(torch.equal(k, make_block(layout, i)) for i, k in enumerate(kept))


def test_large_put_is_written_in_parts_at_their_offsets(layout, tmp_path):
    keys = [key_of(i) for i in range(300)]  # 300 x 8 KiB: over a MiB, so two parts on two threads
    blocks = [make_block(layout, i) for i in range(300)]
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, num_io_threads=2) as tier:
        assert all(r.ok for r in tier.put_many(keys, blocks))
        offsets = [tier._index[k].offset for k in keys]
        assert offsets == sorted(offsets) and len(set(offsets)) == 300  # batch order, no overlap
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as restarted:
        assert all(torch.equal(g, b) for g, b in zip(restarted.get_many(keys), blocks))
        assert restarted.counters["corrupt_blocks"] == 0


def test_a_failing_part_fails_the_whole_put_and_is_cut_away(layout, tmp_path, monkeypatch):
    keys = [key_of(i) for i in range(300)]
    blocks = [make_block(layout, i) for i in range(300)]
    real_pwritev = os.pwritev

    def failing_in_the_second_half(fd, buffers, offset):
        if offset >= 150 * (seg.ALIGN + layout.num_bytes):
            raise OSError(28, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, num_io_threads=2) as tier:
        monkeypatch.setattr(os, "pwritev", failing_in_the_second_half)
        results = tier.put_many(keys, blocks)
        monkeypatch.setattr(os, "pwritev", real_pwritev)
        assert not any(r.ok for r in results) and "ENOSPC" in results[0].error
        assert tier.used_bytes == 0 and all(p.stat().st_size == 0 for p in tmp_path.glob("*.seg"))
        assert all(r.ok for r in tier.put_many(keys[:3], blocks[:3]))
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as restarted:
        assert restarted.used_bytes == 3 * layout.num_bytes and restarted.counters["corrupt_blocks"] == 0


def test_without_xxhash_new_records_use_crc32_and_xxh3_records_stay_on_disk_unread(layout, tmp_path, monkeypatch):
    """A process without the xxhash package (a machine with no package index) writes CRC-32 records,
    treats XXH3 records as misses, and never cuts them off the file: a process with xxhash reads
    both afterwards."""
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        tier.put(key_of(1), make_block(layout, 1))
    (first,) = tmp_path.glob("*.seg")
    size_before = first.stat().st_size
    with monkeypatch.context() as m:
        m.setattr(seg, "CHECKSUM_FUNCTIONS", {seg.CRC32: seg.CHECKSUM_FUNCTIONS[seg.CRC32]})
        m.setattr(seg, "CHECKSUM_KIND", seg.CRC32)
        with pytest.raises(seg.UnverifiableRecord, match="xxhash"):
            seg.parse_header(first.read_bytes())
        with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
            assert tier.get(key_of(1)) is None  # unverifiable here: a miss
            assert first.stat().st_size == size_before  # and not dropped as a torn tail
            assert tier.put(key_of(2), make_block(layout, 2)).ok
            assert torch.equal(tier.get(key_of(2)), make_block(layout, 2))
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert torch.equal(tier.get(key_of(1)), make_block(layout, 1))
        assert torch.equal(tier.get(key_of(2)), make_block(layout, 2))


def test_tierkv_and_the_disk_tier_work_in_a_process_without_xxhash(tmp_path):
    """The GPU machine has no package index: importing tierkv and using a disk tier must not need it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import builtins
        real_import = builtins.__import__
        def without_xxhash(name, *args, **kwargs):
            if name == "xxhash":
                raise ImportError("no xxhash in this process")
            return real_import(name, *args, **kwargs)
        builtins.__import__ = without_xxhash
        import torch
        import tierkv
        from tierkv.blocks import BlockLayout
        from tierkv.storage import disk_segments as seg
        from tierkv.storage.disk import DiskTier
        assert seg.xxhash is None and seg.CHECKSUM_KIND == seg.CRC32
        layout = BlockLayout(2, 4, 8, torch.float32)
        block = torch.randn(layout.shape)
        with DiskTier("disk", layout, 1 << 20, {str(tmp_path)!r}) as tier:
            assert tier.put("k", block).ok and torch.equal(tier.get("k"), block)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
