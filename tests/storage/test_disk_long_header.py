"""Records whose header is longer than one 4096-byte page (keys of thousands of bytes; the tier takes keys up to
65535 bytes) are found again at the next start, like any other record."""
from __future__ import annotations

from tierkv.storage import disk_segments as seg
from tierkv.storage.disk import DiskTier
from tests.storage.blocks import make_block, same

CAPACITY_BLOCKS = 16


def test_records_with_long_headers_survive_a_restart(layout, tmp_path):
    keys = ["short/L0", "x" * 5000, "y" * 9000, "z" * seg.MAX_KEY_BYTES, "after/L0"]  # headers of 1, 2, 3, 17 pages
    blocks = [make_block(layout, i) for i in range(len(keys))]
    with DiskTier("disk", layout, CAPACITY_BLOCKS * layout.num_bytes, tmp_path) as tier:
        for key, block in zip(keys, blocks):
            assert tier.put(key, block).ok
    with DiskTier("disk", layout, CAPACITY_BLOCKS * layout.num_bytes, tmp_path) as tier:
        counts = tier.counters.snapshot()
        assert counts["scan_dropped_records"] == 0, counts["scan_dropped_records_by_reason"]
        assert all(tier.contains_many(keys))
        assert all(same(found, block) for found, block in zip(tier.get_many(keys), blocks))
    with DiskTier("disk", layout, CAPACITY_BLOCKS * layout.num_bytes, tmp_path) as tier:  # nothing was punched
        assert all(same(found, block) for found, block in zip(tier.get_many(keys), blocks))


def test_a_torn_record_with_a_long_header_is_cut_as_a_tail(layout, tmp_path):
    """A long header whose record runs past the end of the file (a torn append) is a tail, cut off as before."""
    with DiskTier("disk", layout, CAPACITY_BLOCKS * layout.num_bytes, tmp_path) as tier:
        assert tier.put("first/L0", make_block(layout, 0)).ok
        assert tier.put("w" * 6000, make_block(layout, 1)).ok
    (segment,) = tmp_path.glob("*.seg")
    size = segment.stat().st_size
    with open(segment, "r+b") as f:
        f.truncate(size - seg.ALIGN)  # the long record loses its last page
    with DiskTier("disk", layout, CAPACITY_BLOCKS * layout.num_bytes, tmp_path) as tier:
        assert tier.contains("first/L0") and not tier.contains("w" * 6000)
        assert tier.counters.snapshot()["scan_dropped_records_by_reason"] == {"torn_tail": 1}


def test_a_damaged_long_header_drops_only_its_record(layout, tmp_path):
    """A long header that fails its checksum is a damaged record, as a short one is; the records after it stay."""
    keys = ["v" * 7000, "next/L0"]
    with DiskTier("disk", layout, CAPACITY_BLOCKS * layout.num_bytes, tmp_path) as tier:
        for i, key in enumerate(keys):
            assert tier.put(key, make_block(layout, i)).ok
    (segment,) = tmp_path.glob("*.seg")
    with open(segment, "r+b") as f:
        f.seek(seg.ALIGN + 100)  # in the key, on the header's second page
        f.write(b"w")
    with DiskTier("disk", layout, CAPACITY_BLOCKS * layout.num_bytes, tmp_path) as tier:
        assert tier.contains_many(keys) == [False, True]
        assert same(tier.get("next/L0"), make_block(layout, 1))
        assert tier.counters.snapshot()["scan_dropped_records_by_reason"] == {"header_damaged": 1}
