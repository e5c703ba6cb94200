"""A GGUF file's metadata (the key-value pairs of its header), read without its tensors or vocabulary: the model's KV
shape in milliseconds, so a config that pins another shape is refused before the weights load (transformers' own
GGUF reader takes seconds on a 49k-token vocabulary, the load itself tens of seconds).

Primitives: `check_gguf_magic`, `read_gguf_metadata`, `gguf_kv_shape`.

    GGUF v2/v3 header (little-endian)               read_gguf_metadata(path)
      b"GGUF", version u32, tensors u64, pairs u64   -> {key: value} for every scalar and string value;
      each pair: key (u64 length + UTF-8), type u32,    an array's value is ARRAY (skipped, never decoded)
      value (scalar, string, or array: type u32,
      count u64, elements)

The shape is mapped from the metadata by transformers' own table (`GGUF_CONFIG_MAPPING`) into the architecture's
config class, for the architectures in `CHECKED_ARCHITECTURES` (those checked against transformers' own GGUF config
in tests/test_gguf_header.py); for any other, or a header that cannot be read, `gguf_kv_shape` returns None and the
shape is checked after the load, as before.
"""
from __future__ import annotations

import os
import struct

ARRAY = object()  # the value of a key whose GGUF value is an array (its elements skipped)

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEY_BYTES = 1 << 16  # a key is a dotted name (GGUF: at most 65535 bytes)
_MAX_ARRAY_DEPTH = 8  # GGUF files nest none; a deeper one is no model's header

CHECKED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class _Reader:
    """Sequential reads of a GGUF header; ValueError naming the file for anything that runs past its end."""

    def __init__(self, f, path: str):
        self._f, self._path = f, path
        self._size = os.fstat(f.fileno()).st_size

    def left(self) -> int:
        return self._size - self._f.tell()

    def _need(self, n: int) -> None:
        if n > self.left():
            raise ValueError(f"model: {self._path}: its GGUF header claims {n} bytes past the file's end")

    def bytes(self, n: int) -> bytes:
        self._need(n)
        return self._f.read(n)

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.bytes(struct.calcsize(fmt)))[0]

    def skip(self, n: int) -> None:
        self._need(n)
        self._f.seek(n, os.SEEK_CUR)

    def string(self, limit: int | None = None) -> str:
        n = self.unpack("<Q")
        if limit is not None and n > limit:
            raise ValueError(f"model: {self._path}: a GGUF key of {n} bytes (at most {limit})")
        return self.bytes(n).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            self._skip_array(depth)
            return ARRAY
        raise ValueError(f"model: {self._path}: a GGUF value of unknown type {kind}")

    def _skip_array(self, depth: int) -> None:
        if depth >= _MAX_ARRAY_DEPTH:
            raise ValueError(f"model: {self._path}: GGUF arrays nested over {_MAX_ARRAY_DEPTH} deep")
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if kind in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[kind]))
            return
        if count * 8 > self.left():  # a string or an array takes at least 8 bytes
            raise ValueError(f"model: {self._path}: a GGUF array of {count} elements runs past the file's end")
        if kind == _STRING:
            for _ in range(count):
                self.skip(self.unpack("<Q"))
            return
        for _ in range(count):
            self.value(kind, depth + 1)


def check_gguf_magic(magic: bytes, path: str) -> None:
    """ValueError naming `path` unless `magic`, its first bytes, are GGUF's (an empty or other file)."""
    if magic != b"GGUF":
        raise ValueError(f"model: {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")


def read_gguf_metadata(path: str | os.PathLike) -> dict:
    """Every key of a GGUF v2/v3 file's header with its value (arrays as ARRAY); ValueError naming the file when it
    is not one or its header runs past the file's end; OSError when it cannot be read."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        reader = _Reader(f, path)
        check_gguf_magic(reader.bytes(min(4, reader.left())), path)
        version = reader.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"model: {path} is GGUF version {version}; versions 2 and 3 are read")
        reader.unpack("<Q")  # the tensor count
        pairs = reader.unpack("<Q")
        metadata = {}
        for _ in range(pairs):  # each pair takes at least 12 bytes: a count past the file's end fails in a read
            key = reader.string(_MAX_KEY_BYTES)
            metadata[key] = reader.value(reader.unpack("<I"))
        return metadata


def gguf_kv_shape(path: str | os.PathLike) -> dict[str, int] | None:
    """num_layers, num_kv_heads, head_dim of a GGUF file (`ModelShape.kv_shape`), mapped from its header as
    transformers maps it; None for an architecture outside CHECKED_ARCHITECTURES or a header that cannot be read
    or mapped (the shape is then checked after the load)."""
    from tierkv.model_shape import model_shape

    try:
        metadata = read_gguf_metadata(path)
    except (OSError, ValueError):
        return None
    architecture = metadata.get("general.architecture")
    if architecture not in CHECKED_ARCHITECTURES:
        return None
    try:
        from transformers import AutoConfig
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError:
        return None
    config = {}
    for suffix, name in GGUF_CONFIG_MAPPING.get(architecture, {}).items():
        value = metadata.get(f"{architecture}.{suffix}")
        if value is ARRAY:  # a per-layer list (heads per layer): transformers' reader decides, after the load
            return None
        if value is not None and name is not None:
            config[name] = value
    try:  # the architecture's config class fills what the header leaves out (qwen3's head_dim), as in the load
        made = AutoConfig.for_model(architecture, **config)
    except Exception:  # noqa: BLE001  (values the config class refuses, in its own words: the load says them)
        return None
    try:
        return model_shape(made, os.fspath(path)).kv_shape()
    except ValueError:
        return None
