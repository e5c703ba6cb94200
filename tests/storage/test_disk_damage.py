"""DiskTier against damage and loss: every fault ends as a counted miss or a clear error, never
wrong data, and the tier keeps working. Damaged records at start-up, segments or the whole
directory deleted or replaced while the tier runs, failed writes and reads; a fuzz over random
byte damage is the class test."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.blocks import BlockLayout
from tierkv.storage import disk_files
from tierkv.storage import disk_segments as seg
from tierkv.storage.base import TierError
from tierkv.storage.disk import DiskTier
from tests.storage.blocks import make_block, same

CAPACITY_BYTES = 16 << 20


def key_of(i: int) -> str:
    return f"{i:064x}/L0"


def segment_of(tier: DiskTier, key: str) -> Path:
    return Path(tier._segment_path(tier._index[key].segment_id))


def three_records(layout, root: Path) -> tuple[Path, list[int]]:
    """Blocks 0, 1, 2 in one segment, tier closed; (segment, record offsets)."""
    with DiskTier("disk", layout, CAPACITY_BYTES, root) as tier:
        assert all(r.ok for r in tier.put_many([key_of(i) for i in range(3)], [make_block(layout, i) for i in range(3)]))
        offsets = [tier._index[key_of(i)].offset for i in range(3)]
        (path,) = {segment_of(tier, key_of(i)) for i in range(3)}
    return path, offsets


def check_still_works(tier: DiskTier, layout) -> None:
    assert tier.put(key_of(100), make_block(layout, 100)).ok
    assert same(tier.get(key_of(100)), make_block(layout, 100))


# -- damage found at start-up -----------------------------------------------------------------
@pytest.mark.parametrize("where, reason", [(0, "header_damaged"), (1, "header_damaged"), (2, "torn_tail")])
def test_damaged_header_is_dropped_logged_and_counted_at_start(layout, tmp_path, caplog, where, reason):
    path, offsets = three_records(layout, tmp_path)
    data = bytearray(path.read_bytes())
    data[offsets[where] + 10] ^= 0x40
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="tierkv.storage.disk"):
        tier = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path)
    with tier:
        assert tier.counters["scan_dropped_records"] == 1
        assert tier.counters.by_reason("scan_dropped_records") == {reason: 1}
        assert tier.counters.snapshot()["scan_dropped_records_by_reason"] == {reason: 1}
        assert str(path) in caplog.text and "dropping" in caplog.text
        assert tier.contains_many([key_of(i) for i in range(3)]) == [i != where for i in range(3)]
        for i in range(3):
            got = tier.get(key_of(i))
            assert got is None if i == where else same(got, make_block(layout, i))
        check_still_works(tier, layout)
    if reason == "header_damaged":  # its bytes were freed at that start: the next one finds nothing to drop
        data = path.read_bytes()
        assert data[offsets[where] : offsets[where + 1]].count(0) == offsets[where + 1] - offsets[where]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierkv.storage.disk"):
        with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as again:
            assert again.counters["scan_dropped_records"] == 0 and "dropping" not in caplog.text
            assert [again.get(key_of(i)) is None for i in range(3)] == [i == where for i in range(3)]


def test_damaged_payload_is_a_counted_miss_after_restart(layout, tmp_path):
    path, offsets = three_records(layout, tmp_path)
    data = bytearray(path.read_bytes())
    data[offsets[1] + seg.ALIGN + 123] ^= 0x01
    path.write_bytes(bytes(data))
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert tier.get(key_of(1)) is None and tier.counters["corrupt_blocks"] == 1
        assert same(tier.get(key_of(0)), make_block(layout, 0)) and same(tier.get(key_of(2)), make_block(layout, 2))
        check_still_works(tier, layout)


def test_truncated_tail_is_counted(layout, tmp_path):
    path, offsets = three_records(layout, tmp_path)
    os.truncate(path, offsets[2] + seg.ALIGN + 100)
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert tier.counters.by_reason("scan_dropped_records") == {"torn_tail": 1}
        assert tier.contains_many([key_of(i) for i in range(3)]) == [True, True, False]
        assert path.stat().st_size == offsets[2]
        check_still_works(tier, layout)


# -- loss while running -------------------------------------------------------------------------
def test_active_segment_deleted_while_running(layout, tmp_path):
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert tier.put_many([key_of(0), key_of(1)], [make_block(layout, 0), make_block(layout, 1)])[0].ok
        os.unlink(segment_of(tier, key_of(0)))  # a tmp cleaner
        for i in range(2, 5):
            assert tier.put(key_of(i), make_block(layout, i)).ok
        for i in range(2, 5):  # puts after the loss are findable
            assert same(tier.get(key_of(i)), make_block(layout, i))
        assert tier.get_many([key_of(0), key_of(1)]) == [None, None]  # lost blocks are misses
        assert not tier.contains(key_of(0)) and tier.used_bytes == 3 * layout.num_bytes
        assert tier.counters.by_reason("lost_blocks") == {"segment_deleted": 2}
        assert tier.counters["corrupt_blocks"] == 0
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:  # and after a restart
        assert [tier.contains(key_of(i)) for i in range(5)] == [False, False, True, True, True]


def test_older_segment_deleted_while_running(layout, tmp_path):
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, segment_bytes=1) as tier:  # a segment per put
        for i in range(4):
            assert tier.put(key_of(i), make_block(layout, i)).ok
        os.unlink(segment_of(tier, key_of(1)))
        assert tier.get_many([key_of(i) for i in range(4)])[1] is None
        assert tier.counters.by_reason("lost_blocks") == {"segment_deleted": 1} and tier.counters["misses"] == 1
        assert [same(tier.get(key_of(i)), make_block(layout, i)) for i in (0, 2, 3)] == [True] * 3
        tier.remove(key_of(0))  # dropping records still works around the lost segment
        check_still_works(tier, layout)


def test_whole_directory_deleted_while_running(layout, tmp_path):
    root = tmp_path / "tierkv"
    with DiskTier("disk", layout, CAPACITY_BYTES, root, segment_bytes=1) as tier:
        for i in range(3):
            assert tier.put(key_of(i), make_block(layout, i)).ok
        shutil.rmtree(root)
        assert tier.put(key_of(3), make_block(layout, 3)).ok
        assert same(tier.get(key_of(3)), make_block(layout, 3))
        assert tier.get_many([key_of(i) for i in range(3)]) == [None] * 3
        assert tier.counters["lost_blocks"] == 3 and tier.used_bytes == layout.num_bytes
        assert (root / tier._files.peers.name).exists()  # announced again in the new directory (disk_peers)
        check_still_works(tier, layout)
    with DiskTier("disk", layout, CAPACITY_BYTES, root) as tier:
        assert same(tier.get(key_of(3)), make_block(layout, 3))


@pytest.mark.parametrize("which", ["active", "older"])
def test_segment_replaced_by_another_file(layout, tmp_path, which):
    """Another file renamed over a segment, here one holding the same keys with other bytes."""
    other = tmp_path / "other"
    with DiskTier("disk", layout, CAPACITY_BYTES, other) as impostor:
        assert impostor.put(key_of(0), make_block(layout, 666)).ok
        (impostor_segment,) = other.glob("*.seg")
    root = tmp_path / "tierkv"
    with DiskTier("disk", layout, CAPACITY_BYTES, root) as tier:
        assert tier.put(key_of(0), make_block(layout, 0)).ok
        if which == "older":
            tier._files.lock.acquire()  # end the segment: the next put begins another
            tier._files.active_size = tier.segment_bytes
            tier._files.lock.release()
            assert tier.put(key_of(1), make_block(layout, 1)).ok
        os.replace(impostor_segment, segment_of(tier, key_of(0)))
        assert tier.put(key_of(2), make_block(layout, 2)).ok
        assert same(tier.get(key_of(2)), make_block(layout, 2))
        assert tier.get(key_of(0)) is None
        assert tier.counters.by_reason("lost_blocks") == {"segment_replaced": 1}
        check_still_works(tier, layout)


# -- failed writes: a put that fails is never indexed -----------------------------------------
def short_then_enospc(real):
    def pwritev(fd, buffers, offset):
        real(fd, [memoryview(buffers[0])[:5]], offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return pwritev


def writes_nothing(real):
    return lambda fd, buffers, offset: 0


def raises(code):
    def make(real):
        def failing(*args, **kwargs):
            raise OSError(code, os.strerror(code))
        return failing
    return make


@pytest.mark.parametrize("target, make_fake, fsync", [
    ("pwritev", raises(errno.ENOSPC), False),
    ("pwritev", raises(errno.EIO), False),
    ("pwritev", short_then_enospc, False),
    ("pwritev", writes_nothing, False),
    ("fdatasync", raises(errno.EIO), True),
    ("create_segment", raises(errno.ENOSPC), False),
])  # fmt: skip
def test_failed_write_is_a_failed_put_and_nothing_is_indexed(layout, tmp_path, monkeypatch, target, make_fake, fsync):
    """A full file system (ENOSPC) first evicts room for the put (key 0 here, the only block) and tries once more;
    the fakes fail that too. Other errors leave the blocks held alone."""
    tier = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path, fsync=fsync, segment_bytes=1)
    assert tier.put(key_of(0), make_block(layout, 0)).ok
    owner = disk_files if target == "create_segment" else os
    real = getattr(owner, target)
    monkeypatch.setattr(owner, target, make_fake(real))
    result = tier.put(key_of(1), make_block(layout, 1))
    monkeypatch.setattr(owner, target, real)
    full = "ENOSPC" in (result.error or "")
    assert not result.ok and result.error and tier.counters["put_failures"] == 1
    assert not tier.contains(key_of(1)) and tier.get(key_of(1)) is None
    assert tier.counters["evictions"] == int(full)
    kept = tier.get(key_of(0))
    assert kept is None if full else same(kept, make_block(layout, 0))
    check_still_works(tier, layout)
    tier.close()
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as restarted:
        assert not restarted.contains(key_of(1)) and restarted.counters["scan_dropped_records"] == 0
        assert restarted.contains(key_of(0)) != full


# -- failed reads -------------------------------------------------------------------------------
def test_read_error_is_a_counted_miss_and_the_block_stays(layout, tmp_path, monkeypatch):
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        assert tier.put(key_of(0), make_block(layout, 0)).ok
        real = os.preadv
        monkeypatch.setattr(os, "preadv", raises(errno.EIO)(real))
        assert tier.get(key_of(0)) is None
        assert tier.counters["errors"] >= 1 and tier.counters["misses"] == 1
        monkeypatch.setattr(os, "preadv", real)
        assert same(tier.get(key_of(0)), make_block(layout, 0))  # a passing error drops nothing


def test_read_error_during_the_start_scan_is_a_clear_error(layout, tmp_path, monkeypatch):
    three_records(layout, tmp_path)
    monkeypatch.setattr(os, "pread", raises(errno.EIO)(os.pread))
    with pytest.raises(TierError, match=f"cannot scan '{tmp_path}'.*Input/output error"):
        DiskTier("disk", layout, CAPACITY_BYTES, tmp_path)


# -- the class test: random byte damage, then everything read back ------------------------------
SMALL = BlockLayout(num_kv_heads=1, block_tokens=8, head_dim=64, dtype=torch.bfloat16)  # 2 KiB blocks

damage = st.tuples(
    st.sampled_from(["flip", "truncate", "overwrite", "zero", "copy"]),
    st.integers(0, 10),  # which segment (modulo their number)
    st.floats(0, 1, allow_nan=False),  # where in it
    st.integers(1, 9000),  # how many bytes
    st.integers(0, 255),  # which byte / bit
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damages=st.lists(damage, min_size=1, max_size=4), overwrite=st.booleans())
def test_random_damage_never_returns_wrong_data(damages, overwrite):
    root = Path(tempfile.mkdtemp(prefix="tierkv-fuzz-"))
    try:
        expected = {key_of(i): make_block(SMALL, i) for i in range(8)}
        with DiskTier("disk", SMALL, CAPACITY_BYTES, root, segment_bytes=3 * (seg.ALIGN + SMALL.num_bytes)) as tier:
            for first in range(0, 8, 2):
                keys = [key_of(i) for i in (first, first + 1)]
                assert all(r.ok for r in tier.put_many(keys, [expected[k] for k in keys]))
            if overwrite:
                expected[key_of(3)] = make_block(SMALL, 33)
                assert tier.put(key_of(3), expected[key_of(3)]).ok
        for kind, which, where, length, byte in damages:
            segments = sorted(root.glob("*.seg"))
            if segments:
                apply_damage(segments[which % len(segments)], kind, where, length, byte)
        for _ in range(2):  # the second start scans what the first one left
            with DiskTier("disk", SMALL, CAPACITY_BYTES, root) as tier:
                for key, block in expected.items():
                    got = tier.get(key)
                    assert got is None or same(got, block), f"wrong data for {key}"
                assert tier.put(key_of(50), make_block(SMALL, 50)).ok
                assert same(tier.get(key_of(50)), make_block(SMALL, 50))
                expected[key_of(50)] = make_block(SMALL, 50)
    finally:
        shutil.rmtree(root)


def apply_damage(path: Path, kind: str, where: float, length: int, byte: int) -> None:
    data = bytearray(path.read_bytes())
    if not data:
        return
    at = min(len(data) - 1, int(where * len(data)))
    if kind == "flip":
        data[at] ^= 1 << (byte % 8)
    elif kind == "truncate":
        del data[at:]
    elif kind == "overwrite":
        data[at : at + length] = bytes([byte]) * len(data[at : at + length])
    elif kind == "zero":
        data[at : at + length] = bytes(len(data[at : at + length]))
    else:  # bytes from elsewhere in the file, e.g. another record's header, land here
        source = (at + length * seg.ALIGN) % len(data)
        chunk = data[source : source + length]
        data[at : at + len(chunk)] = chunk
    path.write_bytes(bytes(data))


def test_dropped_and_lost_counts_reach_stats_and_prometheus_by_reason(layout, tmp_path):
    from prometheus_client import generate_latest

    from tierkv.metrics.prometheus import TierKVCollector, new_registry
    from tierkv.metrics.snapshot import flatten_stats

    path, offsets = three_records(layout, tmp_path)
    data = bytearray(path.read_bytes())
    data[offsets[1] + 10] ^= 0x40
    path.write_bytes(bytes(data))
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        os.unlink(path)
        assert tier.get(key_of(0)) is None  # its segment is gone: 0 and 2 are lost
        figures, latency, info, layers = flatten_stats({"tiers": [tier.counters.snapshot()]})
    assert figures["tier.disk.scan_dropped_records"] == 1
    assert figures["tier.disk.scan_dropped_records_by_reason.header_damaged"] == 1
    assert figures["tier.disk.lost_blocks_by_reason.segment_deleted"] == 2
    text = generate_latest(new_registry(TierKVCollector(lambda: (figures, latency, info, layers)))).decode()
    assert 'tierkv_tier_scan_dropped_records_total{tier="disk"} 1.0' in text
    assert 'tierkv_tier_scan_dropped_records_by_reason_total{reason="header_damaged",tier="disk"} 1.0' in text
    assert 'tierkv_tier_lost_blocks_by_reason_total{reason="segment_deleted",tier="disk"} 2.0' in text
