"""Self-describing binary form of a block, shared by the disk and Redis tiers.

Primitives: `encode_block`, `encode_block_bytes`, `header_num_bytes`, `decode_block`,
`decode_block_into`, `CorruptBlock`, `ForeignBlock`.

    offset  size  field
    0       4     magic b"TKVB"
    4       2     format version (little endian)
    6       1     dtype code
    7       1     ndim
    8       4*n   shape (uint32 each)
    ..      2     key length, then the key (utf-8)
    ..      8     payload bytes
    ..      4     crc32 over everything before it and the payload
    ..      ...   payload (the tensor's raw bytes)

A block whose checksum or key does not match raises `CorruptBlock`; tiers treat that as a miss,
count it, and drop the stored copy. An intact block of another shape or dtype (a writer of another
layout on the same keys) raises `ForeignBlock`, a CorruptBlock that a reader counts apart. The
CRC-32 is zlib's; ISA-L's (`isal`, a base dependency, about 3x faster) computes the same values and
is used when it imports.
"""
from __future__ import annotations

import struct

import torch

try:
    from isal.isal_zlib import crc32
except ImportError:  # same values, slower
    from zlib import crc32

MAGIC = b"TKVB"
FORMAT_VERSION = 1
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.uint8: 4, torch.int8: 5,
                torch.float8_e4m3fn: 6}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_PREFIX = struct.Struct("<4sHBB")


class CorruptBlock(ValueError):
    """Stored bytes do not form the block that was asked for."""


class ForeignBlock(CorruptBlock):
    """Intact stored bytes (checksum and key as written) of another shape or dtype than the reader's layout:
    not damage but a writer of another layout under the same key (block addresses name the tiers' storage
    formats, so an older writer); counted apart from corrupt blocks."""


def encode_block(key: str, block: torch.Tensor) -> list[memoryview | bytes]:
    """Header and payload as buffers (no copy of the payload); write them in order."""
    if block.dtype not in _DTYPE_CODES:
        raise ValueError(f"cannot store dtype {block.dtype}; storable: {list(_DTYPE_CODES)}")
    payload = memoryview(block.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy())
    key_bytes = key.encode()
    meta = b"".join(
        [
            _PREFIX.pack(MAGIC, FORMAT_VERSION, _DTYPE_CODES[block.dtype], block.dim()),
            struct.pack(f"<{block.dim()}I", *block.shape),
            struct.pack("<H", len(key_bytes)),
            key_bytes,
            struct.pack("<Q", payload.nbytes),
        ]
    )
    return [meta + struct.pack("<I", crc32(payload, crc32(meta))), payload]


def encode_block_bytes(key: str, block: torch.Tensor) -> bytes:
    return b"".join(encode_block(key, block))


def header_num_bytes(key: str, ndim: int) -> int:
    """Bytes before the payload in a block of `ndim` dimensions stored under `key`."""
    return _PREFIX.size + 4 * ndim + 2 + len(key.encode()) + 12


def decode_block(key: str, data: bytes | bytearray | memoryview, copy: bool = True) -> torch.Tensor:
    """Parse and verify; returns a tensor that owns its memory.

    copy=False hands `data` (a writable buffer the caller gives up) to the tensor without copying
    the payload; the caller should place the payload at an aligned offset.
    """
    view = memoryview(data)
    dtype, shape, offset = _parse_header(key, view)
    payload = view[offset:]
    _check_payload(key, view[:offset], payload)
    flat = torch.frombuffer(payload if not copy and not view.readonly else bytearray(payload), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def decode_block_into(key: str, data: bytes | bytearray | memoryview, out: torch.Tensor) -> None:
    """Verify `data` and copy its payload into `out`; raises CorruptBlock (ForeignBlock for an intact block of
    another shape or dtype), leaving `out` unspecified.

    out: a contiguous CPU tensor of the stored shape and dtype (the tier's layout).
    """
    view = memoryview(data)
    dtype, shape, offset = _parse_header(key, view)
    payload = view[offset:]
    _check_payload(key, view[:offset], payload)  # (the checksum covers the header: a garbled shape is corrupt)
    if dtype != out.dtype or shape != tuple(out.shape):
        raise ForeignBlock(f"block {key}: stored as {shape} {dtype}, expected {tuple(out.shape)} {out.dtype}")
    target = memoryview(out.view(torch.uint8).reshape(-1).numpy())
    if target.nbytes != payload.nbytes:
        raise CorruptBlock(f"block {key}: payload is {payload.nbytes} bytes, its shape and dtype need {target.nbytes}")
    target[:] = payload


def _check_payload(key: str, header: memoryview, payload: bytes | bytearray | memoryview) -> None:
    num_bytes, crc = struct.unpack_from("<QI", header, header.nbytes - 12)
    payload_bytes = memoryview(payload).nbytes
    if payload_bytes != num_bytes:
        raise CorruptBlock(f"block {key}: payload is {payload_bytes} bytes, header says {num_bytes}")
    if crc32(payload, crc32(header[:-4])) != crc:
        raise CorruptBlock(f"block {key}: checksum mismatch")


def _parse_header(key: str, view: memoryview) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, payload offset) from the header at the start of `view`; raises CorruptBlock."""
    try:
        magic, version, dtype_code, ndim = _PREFIX.unpack_from(view, 0)
        if magic != MAGIC or version != FORMAT_VERSION or dtype_code not in _CODE_DTYPES:
            raise CorruptBlock(f"block {key}: bad header (magic {magic!r}, version {version}, dtype code {dtype_code})")
        offset = _PREFIX.size
        shape = struct.unpack_from(f"<{ndim}I", view, offset)
        offset += 4 * ndim
        (key_len,) = struct.unpack_from("<H", view, offset)
        offset += 2
        stored_key = bytes(view[offset : offset + key_len])
        offset += key_len
        struct.unpack_from("<QI", view, offset)  # the length and CRC fields are there
    except struct.error as exc:
        raise CorruptBlock(f"block {key}: truncated header ({exc})") from None
    if stored_key != key.encode():
        raise CorruptBlock(f"block {key}: stored under another key {stored_key[:80]!r}")
    return _CODE_DTYPES[dtype_code], shape, offset + 12
