"""A tier failing block after block logs one line per interval with the count, not one line per block:
corrupt disk records, an unreadable segment directory, a full disk (the counters keep the exact figures)."""
from __future__ import annotations

import errno
import logging
import os
from types import SimpleNamespace

from tests.storage.test_disk_reads import flip_payload_byte, key_of, make_block
from tierkv.storage.disk import DiskTier
from tierkv.storage.log_limit import LimitedWarning


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "tierkv.storage.disk"]


def test_twenty_corrupt_records_log_one_line_counting_them(layout, tmp_path, caplog):
    with DiskTier("disk", layout, 64 << 20, tmp_path) as tier:
        keys = [key_of(i) for i in range(20)]
        tier.put_many(keys, [make_block(layout, i) for i in range(20)])
        for key in keys:
            flip_payload_byte(tier, key)
        with caplog.at_level(logging.WARNING, logger="tierkv.storage.disk"):
            assert tier.get_many(keys) == [None] * 20
        assert tier.counters["corrupt_blocks"] == 20
    lines = _warnings(caplog)
    assert len(lines) == 1 and lines[0].startswith("1 x") and "corrupt" in lines[0]  # the first at once
    # (the other 19 wait for the interval; the counter has them all)


def test_an_unreadable_directory_logs_once_per_interval(layout, tmp_path, caplog, monkeypatch):
    with DiskTier("disk", layout, 64 << 20, tmp_path) as tier:
        keys = [key_of(i) for i in range(12)]
        tier.put_many(keys, [make_block(layout, i) for i in range(12)])
        real_open = os.open

        def refuse(path, *args, **kwargs):
            if str(path).startswith(str(tmp_path)):
                raise OSError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)
        with caplog.at_level(logging.WARNING, logger="tierkv.storage.disk"):
            for _ in range(3):
                tier.get_many(keys)
        monkeypatch.setattr(os, "open", real_open)
        errors = tier.counters["errors"]
    lines = [line for line in _warnings(caplog) if "I/O failed" in line]
    assert errors >= 3 and len(lines) == 1, (errors, lines)


def test_limited_warning_counts_what_it_held_back(caplog, monkeypatch):
    from tierkv.storage import log_limit

    now = [100.0]
    monkeypatch.setattr(log_limit, "time", SimpleNamespace(monotonic=lambda: now[0]))  # that module's clock only
    log = LimitedWarning(logging.getLogger("tierkv.test"), interval_s=10)
    with caplog.at_level(logging.WARNING, logger="tierkv.test"):
        for step in range(25):
            now[0] = 100.0 + step  # one a second: lines at 0 s, 10 s, 20 s
            log.note("thing %s", step)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["1 x (at most one line per 10s) thing 0", "10 x (at most one line per 10s) thing 10",
                     "10 x (at most one line per 10s) thing 20"]


def test_a_full_disk_logs_one_line_for_many_failed_puts(layout, tmp_path, caplog, monkeypatch):
    """Every put fails on a full device: the counters count each, the log says it once per interval."""
    with DiskTier("disk", layout, 64 << 20, tmp_path) as tier:
        def full(fd, buffers, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwritev", full)
        with caplog.at_level(logging.WARNING, logger="tierkv.storage.disk"):
            for i in range(15):
                assert not tier.put(key_of(i), make_block(layout, i)).ok
        assert tier.counters["put_failures"] == 15
    lines = [line for line in _warnings(caplog) if "put" in line]
    assert len(lines) == 1 and "ENOSPC" in lines[0]
