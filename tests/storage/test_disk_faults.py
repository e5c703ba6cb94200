"""DiskTier under faults: restarts, crashes mid-put, corrupt files, a full disk, capacity."""
from __future__ import annotations

import errno
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from tierkv.storage.base import TierError
from tierkv.storage.disk import DiskTier

CAPACITY_BYTES = 64 << 20


def make_block(layout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=gen).to(layout.dtype)


def key_of(i: int, layer: int = 0) -> str:
    return f"{i:064x}/L{layer}"


def files_under(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{suffix}"))


def file_of(tier: DiskTier, key: str) -> Path:
    return Path(tier._file_path(key))


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
            os.utime(file_of(tier, key_of(i)), ns=(10**18 + i, 10**18 + i))  # distinct mtimes
    with DiskTier("disk", layout, 2 * layout.num_bytes, tmp_path) as tier:  # smaller: the oldest two go
        assert [tier.contains(key_of(i)) for i in range(4)] == [False, False, True, True]
        assert tier.counters["evictions"] == 2
        assert len(files_under(tmp_path, ".blk")) == 2


class SimulatedCrash(BaseException):
    """The process dies: no except-OSError cleanup runs."""


def test_crash_between_write_and_rename_leaves_old_value(layout, tmp_path, monkeypatch):
    key = key_of(1)
    old, new = make_block(layout, 1), make_block(layout, 2)
    tier = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path)
    assert tier.put(key, old).ok
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(src).startswith(str(tmp_path)):
            raise OSError(errno.EIO, "injected rename failure")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    result = tier.put(key, new)
    assert not result.ok and "EIO" in result.error
    assert files_under(tmp_path, ".tierkv-tmp") == []  # the failed put cleaned up after itself
    assert torch.equal(tier.get(key), old)
    assert tier.counters["put_failures"] == 1 and tier.counters["errors"] == 1

    def crashing_replace(src, dst):
        raise SimulatedCrash()

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(SimulatedCrash):
        tier.put(key, new)  # dies after writing the temp file, before the rename
    monkeypatch.setattr(os, "replace", real_replace)
    final = file_of(tier, key)
    # Also what a crash mid-write leaves: a complete and a truncated temp file.
    complete = final.parent / (final.name[: -len(".blk")] + ".999.1.tierkv-tmp")
    truncated = final.parent / (final.name[: -len(".blk")] + ".999.2.tierkv-tmp")
    complete.write_bytes(final.read_bytes())
    truncated.write_bytes(final.read_bytes()[:100])
    assert len(files_under(tmp_path, ".tierkv-tmp")) >= 3

    restarted = DiskTier("disk", layout, CAPACITY_BYTES, tmp_path)  # the old process is gone
    assert files_under(tmp_path, ".tierkv-tmp") == []
    assert torch.equal(restarted.get(key), old)
    assert restarted.counters["corrupt_blocks"] == 0
    restarted.close()


@pytest.mark.parametrize("damage", ["flip_payload_byte", "flip_header_byte", "truncate", "empty"])
def test_corrupt_file_is_a_counted_miss_and_removed(layout, tmp_path, damage):
    with DiskTier("disk", layout, CAPACITY_BYTES, tmp_path) as tier:
        key, other = key_of(7), key_of(8)
        tier.put(key, make_block(layout, 7))
        tier.put(other, make_block(layout, 8))
        path = file_of(tier, key)
        data = bytearray(path.read_bytes())
        if damage == "flip_payload_byte":
            data[-100] ^= 0x01
        elif damage == "flip_header_byte":
            data[10] ^= 0x40
        elif damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data = bytearray()
        path.write_bytes(bytes(data))

        assert tier.get(key) is None
        assert tier.counters["corrupt_blocks"] == 1
        assert tier.counters["misses"] == 1
        assert not path.exists() and not tier.contains(key)
        assert tier.used_bytes == layout.num_bytes
        assert torch.equal(tier.get(other), make_block(layout, 8))


@pytest.fixture
def small_filesystem(tmp_path):
    """A 1 MiB tmpfs, or None where mounting is not permitted."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def check_fill_until_full(layout, path: Path, capacity_bytes: int, space_freed=lambda: None) -> None:
    """Put blocks until one fails; it must say ENOSPC, leave nothing torn, keep earlier blocks."""
    tier = DiskTier("disk", layout, capacity_bytes, path, return_evicted=False)
    stored, failure = [], None
    for i in range(10_000):
        result = tier.put(key_of(i), make_block(layout, i))
        if not result.ok:
            failure = (key_of(i), result)
            break
        stored.append(i)
    assert failure is not None, "the disk never filled up"
    key, result = failure
    assert "ENOSPC" in result.error and "no space" in result.error.lower(), result.error
    assert tier.counters["put_failures"] == 1 and tier.counters["errors"] >= 1
    assert files_under(path, ".tierkv-tmp") == []
    assert not tier.contains(key) and tier.get(key) is None
    assert stored, "not even one block fitted"
    for i in stored:
        assert torch.equal(tier.get(key_of(i)), make_block(layout, i))
    tier.remove(key_of(stored[0]))  # free a slot: puts work again
    space_freed()
    assert tier.put(key, make_block(layout, 99)).ok
    tier.close()


def test_disk_full_on_real_tmpfs(layout, small_filesystem):
    if small_filesystem is None:
        pytest.skip("mount -t tmpfs is not permitted here; test_disk_full_injected_enospc covers the logic")
    check_fill_until_full(layout, small_filesystem, CAPACITY_BYTES)


def test_disk_full_injected_enospc(layout, tmp_path, monkeypatch):
    """The same checks with ENOSPC injected into os.writev after a few blocks (any filesystem)."""
    real_writev, calls = os.writev, [0]

    def writev_until_full(fd, buffers):
        calls[0] += 1
        if calls[0] <= 5:
            return real_writev(fd, buffers)
        if calls[0] == 6:  # a short write first, as a filling disk does
            return real_writev(fd, [memoryview(buffers[0])[:7]])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", writev_until_full)
    space_freed = lambda: monkeypatch.setattr(os, "writev", real_writev)  # noqa: E731
    check_fill_until_full(layout, tmp_path, CAPACITY_BYTES, space_freed=space_freed)
    assert calls[0] == 7


def test_capacity_evicts_least_recently_used(layout, tmp_path):
    keys = [key_of(i) for i in range(4)]
    with DiskTier("disk", layout, 3 * layout.num_bytes + 5, tmp_path / "disk") as tier:  # 3 blocks
        for i in range(3):
            assert tier.put(keys[i], make_block(layout, i)).evicted == []
        assert tier.get(keys[0]) is not None  # 0 is now the most recent; 1 is the oldest
        result = tier.put(keys[3], make_block(layout, 3))
        assert result.ok and [k for k, _ in result.evicted] == [keys[1]]
        assert torch.equal(result.evicted[0][1], make_block(layout, 1))
        assert not file_of(tier, keys[1]).exists()
        assert tier.contains_many(keys) == [True, False, True, True]
        assert tier.used_bytes == 3 * layout.num_bytes and tier.counters["evictions"] == 1
        tier.return_evicted = False  # the chain has no tier below: drop unread
        result = tier.put(keys[1], make_block(layout, 1))
        assert result.ok and result.evicted == [] and tier.counters["evictions"] == 2
        assert tier.contains_many(keys) == [True, True, False, True]  # 2 was the oldest
        assert len(files_under(tmp_path / "disk", ".blk")) == 3
        assert files_under(tmp_path / "disk", ".tierkv-tmp") == []


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
        assert tier.used_bytes == layout.num_bytes * len(files_under(tmp_path, ".blk"))
        assert files_under(tmp_path, ".tierkv-tmp") == []


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
