"""The disk tier's on-disk format: records appended to segment files.

Primitives: `RecordHeader`, `encode_header`, `parse_header`, `checksum`, `CHECKSUM_FUNCTIONS`,
`header_region_bytes`, `scan_segment`, `round_up`, `UnverifiableRecord`, `ALIGN`. The system calls
on segment files: disk_io.

A segment file (`<path>/<16 hex digits>.seg`) is a sequence of records, each starting at a
multiple of ALIGN (4096) bytes; a removed record is a hole punched over its whole range:

    record:  | header, zero-padded to a multiple of 4096 | payload | zeros up to a multiple of 4096 |

    header (format version 2)        header (format version 1, still read)
    offset  size  field              offset  size  field
    0       4     magic b"TKVS"      0       4     magic b"TKVS"
    4       2     format version     4       2     format version
    6       2     key bytes, k       6       2     key bytes, k
    8       8     payload bytes      8       8     payload bytes
    16      8     payload checksum   16      4     payload CRC-32
    24      1     checksum kind      20      1     ndim, n
    25      1     ndim, n            21      1     dtype name bytes, d
    26      1     dtype name bytes   22      4n    shape
    27      4n    shape (uint32)     ..      d     dtype name
    ..      d     dtype name, ascii  ..      k     key
    ..      k     key, utf-8         ..      4     CRC-32 of the header bytes before it
    ..      c     checksum of the header bytes before it (c = 4 for CRC-32, 8 for XXH3-64)

Every field is little endian. Checksum kinds: 1 CRC-32 (zlib's, computed by ISA-L's `isal`),
2 XXH3-64 (`xxhash`, about twice as fast on a CPU without VPCLMULQDQ); new records use
CHECKSUM_KIND, a version 1 record is CRC-32. The header's own checksum lets a scan trust key and
lengths without reading the payload; the payload's is checked on every read. A payload whose
size is a multiple of 4096 starts and ends on a 4096 boundary, so it can be read with O_DIRECT
straight into a caller's buffer.
"""
from __future__ import annotations

import functools
import os
import struct
from typing import NamedTuple

try:
    import xxhash
except ImportError:  # a machine without it (no package index): new records use CRC-32; XXH3 ones stay, unread
    xxhash = None
try:
    from isal.isal_zlib import crc32
except ImportError:  # same values, slower
    from zlib import crc32

from tierkv.storage.codec import CorruptBlock

ALIGN = 4096
MAGIC = b"TKVS"
FORMAT_VERSION = 2
CRC32, XXH3_64 = 1, 2  # checksum kinds
CHECKSUM_KIND = XXH3_64 if xxhash is not None else CRC32  # what new records use
MAX_KEY_BYTES = 0xFFFF
_FIXED = {1: struct.Struct("<4sHHQIBB"), 2: struct.Struct("<4sHHQQBBB")}  # per format version
_CHECKSUM_STRUCT = {CRC32: struct.Struct("<I"), XXH3_64: struct.Struct("<Q")}
CHECKSUM_FUNCTIONS = {CRC32: crc32}  # kind -> function of a buffer
if xxhash is not None:
    CHECKSUM_FUNCTIONS[XXH3_64] = xxhash.xxh3_64_intdigest
CHECKSUM_BYTES = {CRC32: 4, XXH3_64: 8}  # kind -> bytes of the header's own checksum


class UnverifiableRecord(CorruptBlock):
    """A record whose checksum kind this process cannot compute (XXH3-64 without xxhash): never
    read, never cut off the file (a process with xxhash reads it)."""


def checksum(kind: int, data: bytes | bytearray | memoryview) -> int:
    """The `kind` checksum of `data` (both functions release the GIL on large buffers)."""
    if kind in CHECKSUM_FUNCTIONS:
        return CHECKSUM_FUNCTIONS[kind](data)
    if kind in _CHECKSUM_STRUCT:
        raise UnverifiableRecord(f"checksum kind {kind} (XXH3-64) needs the xxhash package (pip install xxhash)")
    raise ValueError(f"checksum kind {kind!r}; known kinds are {CRC32} (CRC-32) and {XXH3_64} (XXH3-64)")


class RecordHeader(NamedTuple):
    key: str
    payload_num_bytes: int
    payload_checksum: int
    dtype_name: str
    shape: tuple[int, ...]
    header_num_bytes: int  # the padded header region: where the payload starts
    record_num_bytes: int  # header region + payload + padding: where the next record starts
    header_end: int  # where the header's own checksum ends (the padding starts)
    header_checksum: int
    checksum_kind: int = CHECKSUM_KIND  # of both checksums
    data: bytes = b""  # the header region, as encode_header made it (empty from parse_header)


def round_up(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN) * ALIGN


def encode_header(
    key: str, dtype_name: str, shape: tuple[int, ...], payload_num_bytes: int, payload_checksum: int,
    kind: int | None = None, version: int = FORMAT_VERSION,
) -> RecordHeader:  # fmt: skip
    """A record's header; `.data` is its region (zero-padded to a multiple of ALIGN). `kind`:
    CHECKSUM_KIND (what this process writes) unless given.

    ValueError on a huge key, or a kind the version cannot carry (version 1: CRC-32 only).
    """
    kind = CHECKSUM_KIND if kind is None else kind
    key_bytes, name = key.encode(), dtype_name.encode("ascii")
    shape = tuple(shape)
    if len(key_bytes) > MAX_KEY_BYTES:
        raise ValueError(f"block key of {len(key_bytes)} bytes is too long (at most {MAX_KEY_BYTES} utf-8 bytes)")
    if kind not in _CHECKSUM_STRUCT or (version == 1 and kind != CRC32) or version not in _FIXED:
        raise ValueError(f"checksum kind {kind!r} in format version {version!r}; version 1 holds CRC-32 (1) only")
    fixed = [MAGIC, version, len(key_bytes), payload_num_bytes, payload_checksum]
    fixed += [len(shape), len(name)] if version == 1 else [kind, len(shape), len(name)]
    head = _FIXED[version].pack(*fixed) + _shape_and_name(shape, name) + key_bytes
    header_checksum = CHECKSUM_FUNCTIONS[kind](head)
    head += _CHECKSUM_STRUCT[kind].pack(header_checksum)
    header_num_bytes = round_up(len(head))
    return RecordHeader(key, payload_num_bytes, payload_checksum, dtype_name, shape, header_num_bytes,
                        header_num_bytes + round_up(payload_num_bytes), len(head), header_checksum, kind,
                        head.ljust(header_num_bytes, b"\0"))  # fmt: skip


@functools.lru_cache(maxsize=16)
def _shape_and_name(shape: tuple[int, ...], name: bytes) -> bytes:
    return struct.pack(f"<{len(shape)}I", *shape) + name


ZEROED_HEADER = "not a record header (magic b'\\x00\\x00\\x00\\x00'"  # how parse_header names a punched one


def parse_header(data: bytes | bytearray | memoryview) -> RecordHeader:
    """The header at the start of `data` (format version 1 or 2); raises CorruptBlock, also when `data` is too short."""
    view = memoryview(data)
    try:
        offset, key_len, payload_num_bytes, payload_checksum, kind, ndim, name_len = _fixed_fields(view)
        shape = struct.unpack_from(f"<{ndim}I", view, offset)
        offset += 4 * ndim
        name = bytes(view[offset : offset + name_len]).decode("ascii")
        offset += name_len
        key = bytes(view[offset : offset + key_len]).decode()
        offset += key_len
        (stored_checksum,) = _CHECKSUM_STRUCT[kind].unpack_from(view, offset)
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptBlock(f"truncated or garbled record header ({exc})") from None
    if checksum(kind, view[:offset]) != stored_checksum:
        raise CorruptBlock(f"record header of {key[:80]!r}: checksum mismatch")
    header_end = offset + _CHECKSUM_STRUCT[kind].size
    header_num_bytes = round_up(header_end)
    record_num_bytes = header_num_bytes + round_up(payload_num_bytes)
    return RecordHeader(key, payload_num_bytes, payload_checksum, name, tuple(shape), header_num_bytes,
                        record_num_bytes, header_end, stored_checksum, kind)  # fmt: skip


def scan_segment(
    fd: int, size: int, damaged: list[tuple[int, int]] | None = None
) -> tuple[list[tuple[int, RecordHeader]], int, bool]:
    """([(offset, header)] of the whole records in a segment, the end of the last one, whether the
    scan stopped at a record this process cannot verify (then the end is the file's: nothing is cut)).

    Holes (removed records) are skipped with SEEK_DATA, other bytes that are not a header one
    ALIGN step at a time. A record running past the end of the file is a torn tail: the scan
    stops before it. A header longer than ALIGN (a long key) is read whole. Payloads are not read
    here; reads check them. `damaged`, when given, gets
    the [start, end) of each run of data that is neither a header nor a hole and lies before a
    whole record (a record whose header was damaged; what follows the last record is the tail).
    """
    records, offset, valid_end, bad_start = [], 0, 0, None
    while offset < size:
        head = _read_header(fd, offset)
        try:
            header = parse_header(head)
        except UnverifiableRecord:  # keep the rest of the file as it is: its records are misses here
            return records, size, True
        except CorruptBlock:
            is_hole = len(head) == ALIGN and head.count(0) == ALIGN
            if is_hole and bad_start is not None and damaged is not None:
                damaged.append((bad_start, offset))
            bad_start = None if is_hole else offset if bad_start is None else bad_start
            if is_hole:  # a hole: jump to the next data
                try:
                    offset = max(offset + ALIGN, os.lseek(fd, offset + ALIGN, os.SEEK_DATA) // ALIGN * ALIGN)
                except OSError:  # ENXIO: only holes up to the end
                    break
            else:
                offset += ALIGN
            continue
        if offset + header.record_num_bytes > size:
            break
        if bad_start is not None and damaged is not None:
            damaged.append((bad_start, offset))
        bad_start = None
        records.append((offset, header))
        offset = valid_end = offset + header.record_num_bytes
    return records, valid_end, False


def _read_header(fd: int, offset: int) -> bytes:
    """The bytes of the header at `offset`: one ALIGN page, or as many as its fixed fields say it spans (a key of
    thousands of bytes); short at the end of the file. Garbled fields claim at most some 66 KiB."""
    head = os.pread(fd, ALIGN, offset)
    claimed = _claimed_header_end(head)
    if claimed is not None and claimed > len(head) == ALIGN:
        head += os.pread(fd, claimed - ALIGN, offset + ALIGN)
    return head


def _fixed_fields(view) -> tuple[int, int, int, int, int, int, int]:
    """The fixed part of the header at the start of `view` (format version 1 or 2): (its size, key length,
    payload bytes, payload checksum, checksum kind, ndim, dtype name length). CorruptBlock when it is no header
    (magic, version, an unknown checksum kind); struct.error when `view` is too short."""
    magic, version = struct.unpack_from("<4sH", view, 0)
    if magic != MAGIC or version not in _FIXED:
        raise CorruptBlock(f"not a record header (magic {bytes(magic)!r}, version {version})")
    fields = _FIXED[version].unpack_from(view, 0)
    if version == 1:
        (_, _, key_len, payload_num_bytes, payload_checksum, ndim, name_len), kind = fields, CRC32
    else:
        _, _, key_len, payload_num_bytes, payload_checksum, kind, ndim, name_len = fields
    if kind not in _CHECKSUM_STRUCT:
        raise CorruptBlock(f"record header with an unknown checksum kind {kind}")
    return _FIXED[version].size, key_len, payload_num_bytes, payload_checksum, kind, ndim, name_len


def _claimed_header_end(head: bytes) -> int | None:
    """Where the header at the start of `head` says its own checksum ends; None when it is no header's start
    (parse_header then says why)."""
    try:
        size, key_len, _, _, kind, ndim, name_len = _fixed_fields(memoryview(head))
    except (CorruptBlock, struct.error):
        return None
    return size + 4 * ndim + name_len + key_len + _CHECKSUM_STRUCT[kind].size


def header_region_bytes(key: str, dtype_name: str, ndim: int, kind: int | None = None) -> int:
    """The padded header region encode_header makes for this key and layout (version 2)."""
    kind = CHECKSUM_KIND if kind is None else kind
    head = _FIXED[2].size + 4 * ndim + len(dtype_name) + len(key.encode()) + _CHECKSUM_STRUCT[kind].size
    return round_up(head)
