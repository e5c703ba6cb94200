"""DiskTier trusts no directory: 0700 and 0600 whatever the umask, another user's or a shared
directory refused, symlinks planted at its file names never followed."""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from tierkv.storage.base import TierError
from tierkv.storage.disk import DiskTier
from tests.storage.blocks import make_block

CAPACITY_BYTES = 16 << 20
OTHER_UID = 65534  # nobody


def key_of(i: int) -> str:
    return f"{i:064x}/L0"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask():
    """Set a umask for the test; the old one comes back after."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o000, 0o077])
def test_directory_is_0700_and_files_0600_whatever_the_umask(layout, tmp_path, umask, mask):
    umask(mask)
    root = tmp_path / "parent" / "tierkv"
    tier = DiskTier("disk", layout, CAPACITY_BYTES, root, segment_bytes=1)  # a segment per put
    for i in range(3):
        assert tier.put(key_of(i), make_block(layout, i)).ok
    tier.close()
    assert mode_of(root) == 0o700
    names = sorted(p.name for p in root.iterdir())
    assert len([n for n in names if n.endswith(".seg")]) == 3 and "lru.order" in names, names
    assert {n: mode_of(root / n) for n in names} == {n: 0o600 for n in names}


def test_an_existing_directory_of_ours_readable_by_others_is_tightened(layout, tmp_path):
    root = tmp_path / "tierkv"
    root.mkdir()
    root.chmod(0o755)  # what an earlier version made under umask 022
    with DiskTier("disk", layout, CAPACITY_BYTES, root) as tier:
        assert tier.put(key_of(1), make_block(layout, 1)).ok
    assert mode_of(root) == 0o700


def forge_segment(layout, tmp_path: Path, key: str, block: torch.Tensor) -> Path:
    """A valid segment holding `key`, written by a tier of its own elsewhere: what an attacker can make."""
    source = tmp_path / "forger"
    with DiskTier("disk", layout, CAPACITY_BYTES, source) as forger:
        assert forger.put(key, block).ok
    (segment,) = source.glob("*.seg")
    return segment


def test_directory_owned_by_another_user_is_refused_and_its_segments_never_loaded(layout, tmp_path):
    root = tmp_path / "tierkv"  # as another user would have made /var/tmp/tierkv first
    root.mkdir(mode=0o700)
    shutil.copy(forge_segment(layout, tmp_path, key_of(1), make_block(layout, 666)), root / "0000000000000000.seg")
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(TierError) as info:
        DiskTier("disk", layout, CAPACITY_BYTES, root)
    message = str(info.value)
    assert str(root) in message and f"uid {OTHER_UID}" in message and "0o700" in message, message
    assert "owned by another user" in message and "directory of your own" in message, message


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o720, 0o702, 0o1777])
def test_directory_writable_by_group_or_others_is_refused(layout, tmp_path, mode):
    root = tmp_path / "tierkv"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(TierError, match="writable by group or others") as info:
        DiskTier("disk", layout, CAPACITY_BYTES, root)
    assert str(root) in str(info.value) and oct(mode) in str(info.value)
    assert mode_of(root) == mode  # refused, not changed behind the operator's back


def test_directory_path_that_is_a_symlink_to_another_users_directory_is_refused(layout, tmp_path):
    target = tmp_path / "theirs"
    target.mkdir(mode=0o700)
    os.chown(target, OTHER_UID, OTHER_UID)
    link = tmp_path / "tierkv"
    link.symlink_to(target)
    with pytest.raises(TierError, match="owned by another user") as info:
        DiskTier("disk", layout, CAPACITY_BYTES, link)
    assert str(target) in str(info.value)


def test_symlink_made_by_another_user_is_refused_even_to_our_directory(layout, tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = tmp_path / "tierkv"
    link.symlink_to(ours)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(TierError, match="symlink made by another user"):
        DiskTier("disk", layout, CAPACITY_BYTES, link)


def test_our_symlink_to_our_private_directory_is_followed(layout, tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = tmp_path / "tierkv"
    link.symlink_to(ours)
    with DiskTier("disk", layout, CAPACITY_BYTES, link) as tier:
        assert tier.put(key_of(1), make_block(layout, 1)).ok
    assert len(list(ours.glob("*.seg"))) == 1


@pytest.mark.parametrize("planted", ["lru.order.{pid}.tmp", "probe.{pid}.tmp", "lru.order"])
def test_symlink_planted_at_a_file_name_never_writes_its_target(layout, tmp_path, planted):
    root = tmp_path / "tierkv"
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    name = planted.format(pid=os.getpid())
    if name.startswith("probe."):  # made before the tier starts
        (root / name).symlink_to(victim)
    tier = DiskTier("disk", layout, CAPACITY_BYTES, root)
    assert tier.put(key_of(1), make_block(layout, 1)).ok
    if not name.startswith("probe."):  # planted while the tier runs, before close() saves the LRU order
        (root / name).symlink_to(victim)
    tier.close()
    assert victim.read_bytes() == b"precious" and mode_of(victim) == 0o644
    with DiskTier("disk", layout, CAPACITY_BYTES, root) as tier:
        assert torch.equal(tier.get(key_of(1)), make_block(layout, 1))
    assert victim.read_bytes() == b"precious"


def test_symlink_planted_as_a_segment_is_not_followed_nor_loaded(layout, tmp_path):
    root = tmp_path / "tierkv"
    root.mkdir(mode=0o700)
    forged = tmp_path / "forged.seg"
    shutil.copy(forge_segment(layout, tmp_path, key_of(1), make_block(layout, 666)), forged)
    with open(forged, "ab") as f:
        f.write(b"torn tail a scan would cut off")
    before = forged.read_bytes()
    (root / "0000000000000000.seg").symlink_to(forged)
    with DiskTier("disk", layout, CAPACITY_BYTES, root) as tier:
        assert not tier.contains(key_of(1)) and tier.get(key_of(1)) is None
        assert tier.counters["errors"] == 1  # the skipped file is logged and counted
        assert tier.put(key_of(2), make_block(layout, 2)).ok  # goes to a segment of its own
        assert torch.equal(tier.get(key_of(2)), make_block(layout, 2))
    assert forged.read_bytes() == before


def test_segment_file_of_another_user_in_our_directory_is_not_loaded(layout, tmp_path):
    root = tmp_path / "tierkv"
    root.mkdir(mode=0o700)
    planted = root / "0000000000000003.seg"
    shutil.copy(forge_segment(layout, tmp_path, key_of(1), make_block(layout, 666)), planted)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with DiskTier("disk", layout, CAPACITY_BYTES, root) as tier:
        assert not tier.contains(key_of(1)) and tier.counters["errors"] == 1
        assert tier.put(key_of(2), make_block(layout, 2)).ok
    assert planted.exists() and os.stat(planted).st_uid == OTHER_UID  # left alone


def test_directory_recreated_after_deletion_is_private_again(layout, tmp_path, umask):
    umask(0o000)
    root = tmp_path / "tierkv"
    with DiskTier("disk", layout, CAPACITY_BYTES, root) as tier:
        assert tier.put(key_of(1), make_block(layout, 1)).ok
        shutil.rmtree(root)
        assert tier.put(key_of(2), make_block(layout, 2)).ok
        assert torch.equal(tier.get(key_of(2)), make_block(layout, 2))
    assert mode_of(root) == 0o700 and {mode_of(p) for p in root.iterdir()} == {0o600}


def test_directory_recreated_by_another_user_after_deletion_fails_the_put_clearly(layout, tmp_path):
    root = tmp_path / "tierkv"
    with DiskTier("disk", layout, CAPACITY_BYTES, root) as tier:
        assert tier.put(key_of(1), make_block(layout, 1)).ok
        shutil.rmtree(root)
        root.mkdir(mode=0o777)  # someone else got there first
        root.chmod(0o777)
        result = tier.put(key_of(2), make_block(layout, 2))  # a failure as a value, counted
        assert not result.ok and "writable by group or others" in result.error and str(root) in result.error
        assert tier.counters["put_failures"] == 1 and not tier.contains(key_of(2))
        assert list(root.iterdir()) == []  # nothing written into it
