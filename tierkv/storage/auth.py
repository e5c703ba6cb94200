"""Authenticated blocks for tiers others can write to (Redis) or that outlive the process (disk).

Primitives: `BlockSealer` (names, seal, open), `SealedLayout`, `AuthFailure`, `sealer_for_tier`, `check_tier_secret`,
`is_sealed` (the secret itself: `tierkv.storage.secret_file`).

Every sub-key comes from the deployment's secret (HMAC-SHA256 of the secret and a label):

    name(key)   = hex(BLAKE2b-128 keyed by k_names)  the tier's key: unguessable without the secret (k_names per mode)
    sealed block, S = 288 + N bytes (N = the block's bytes), stored as a flat uint8 block:

    offset  size  field
    0       4     magic b"TKVS"
    4       1     format version (1)
    5       1     mode: 1 = HMAC-SHA256, 2 = AES-256-GCM over key field and payload
    6       2     key length (<= 176 bytes)
    8       12    nonce (random per seal)
    20      44    zeros
    64      192   key field: the block's key, zero padded, encrypted (mode 1: AES-GCM of its own, tag inside)
    256     N     payload: the block's bytes (mode 2: encrypted)
    256+N   32    mode 1: HMAC over (layout, bytes [0, 256+N)); mode 2: GCM tag (16 bytes) + 16 zeros

The layout (shape, dtype) is authenticated too. `open` checks the tag, then that the stored key is
the key asked for, so a genuine block replayed under another name, a truncated or altered one,
or one sealed with another secret raises `AuthFailure`. The stored key is encrypted in both modes
so the values do not name the prompts they came from; the payload is plain in mode 1.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tierkv.blocks import BlockLayout, dtype_name
from tierkv.config import ConfigError
from tierkv.storage.secret_file import _MIN_SECRET_BYTES, SECRET_ENV, SECRET_FILE_ENV, load_secret

if TYPE_CHECKING:
    from tierkv.config import StorageConfig, TierConfig

MAGIC = b"TKVS"
FORMAT_VERSION = 1
MODE_MAC, MODE_AEAD = 1, 2
MAX_KEY_BYTES = 176
HEADER_BYTES, KEY_FIELD_BYTES, TAG_BYTES = 64, 192, 32
PAYLOAD_OFFSET = HEADER_BYTES + KEY_FIELD_BYTES
_HEAD = struct.Struct("<4sBBH12s")


class AuthFailure(ValueError):
    """Stored bytes are not a block this deployment sealed under this key."""


@dataclass(frozen=True)
class SealedLayout(BlockLayout):
    """The layout an inner tier stores sealed blocks in: flat uint8, [2, 1, 1, S / 2], whatever layout was sealed.

    Layouts of one byte size (bf16 and fp16 of one shape, int8 and fp8 packed ones) seal to the same shape and
    dtype; `sealed_from` tells their blocks apart where a tier must know whose they are without opening them
    (a disk tier's start-up scan: disk_record_layout).
    """

    sealed_from: BlockLayout

_NAME_CACHE_SIZE = 1 << 18  # names, about 200 bytes each


def _subkey(secret: bytes, label: str) -> bytes:
    return hmac.digest(secret, b"tierkv/" + label.encode(), "sha256")


class BlockSealer:
    """Seals and opens blocks of one layout with keys derived from `secret`; thread-safe."""

    def __init__(self, secret: bytes, layout: BlockLayout, *, encrypt: bool):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if len(secret) < _MIN_SECRET_BYTES:
            raise ValueError(f"secret: {len(secret)} bytes; at least {_MIN_SECRET_BYTES} needed")
        self.layout = layout
        self.encrypt = encrypt
        self.mode = MODE_AEAD if encrypt else MODE_MAC
        # names of their own per mode: a reader of the other mode (a move to encrypt: true) never finds, fails to
        # open and deletes a block a peer sealed the other way
        self._names_key = _subkey(secret, "names/v2" if not encrypt else "names/v2/aead")
        self._cached_name = functools.lru_cache(maxsize=_NAME_CACHE_SIZE)(self._name_now)
        self._mac_key = _subkey(secret, "mac/v1")
        self._aead = AESGCM(_subkey(secret, "aead/v1"))
        self._layout_bytes = f"{tuple(layout.shape)}/{dtype_name(layout.dtype)}".encode()
        self.num_bytes = PAYLOAD_OFFSET + layout.num_bytes + TAG_BYTES
        # what the inner tier stores: flat bytes, as [2, 1, 1, S / 2] uint8 (S is even: num_bytes is)
        self.sealed_layout = SealedLayout(1, 1, self.num_bytes // 2, torch.uint8, sealed_from=layout)

    def name(self, key: str) -> str:
        """The tier's key for `key`: a keyed hash (BLAKE2b, 128 bits), so nobody without the secret
        can compute or probe it. Recent names are cached: a 128k-token prefix of a 32-layer model
        asks for 65k names per lookup."""
        return self._cached_name(key)

    def _name_now(self, key: str) -> str:
        return hashlib.blake2b(key.encode(), key=self._names_key, digest_size=16).hexdigest()

    def seal(self, key: str, block: torch.Tensor) -> torch.Tensor:
        """block (layout shape and dtype, CPU) -> sealed bytes shaped as `sealed_layout`."""
        key_bytes = key.encode()
        if len(key_bytes) > MAX_KEY_BYTES:
            raise ValueError(f"block key of {len(key_bytes)} bytes; sealed blocks hold keys up to {MAX_KEY_BYTES}")
        n = self.layout.num_bytes
        out = torch.empty(self.num_bytes, dtype=torch.uint8)  # memoryview copies: one thread, no torch fill
        view = memoryview(out.numpy())
        nonce = os.urandom(12)
        view[:PAYLOAD_OFFSET] = bytes(PAYLOAD_OFFSET)
        view[PAYLOAD_OFFSET + n :] = bytes(TAG_BYTES)
        view[:_HEAD.size] = _HEAD.pack(MAGIC, FORMAT_VERSION, self.mode, len(key_bytes), nonce)
        aad = self._layout_bytes + bytes(view[:HEADER_BYTES])
        payload = memoryview(block.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy())
        if self.mode == MODE_AEAD:  # the key field and payload, encrypted from a buffer of their own: newer
            # cryptography (51) refuses an output that overlaps its input; in place, every encrypted put failed there
            body = torch.zeros(PAYLOAD_OFFSET - HEADER_BYTES + n, dtype=torch.uint8)
            plain = memoryview(body.numpy())
            plain[: len(key_bytes)] = key_bytes
            plain[PAYLOAD_OFFSET - HEADER_BYTES :] = payload
            self._aead.encrypt_into(nonce, plain, aad, view[HEADER_BYTES : PAYLOAD_OFFSET + n + 16])
        else:
            view[PAYLOAD_OFFSET : PAYLOAD_OFFSET + n] = payload
            padded = key_bytes.ljust(KEY_FIELD_BYTES - 16, b"\0")
            self._aead.encrypt_into(nonce, padded, aad, view[HEADER_BYTES:PAYLOAD_OFFSET])
            mac = hmac.new(self._mac_key, self._layout_bytes, "sha256")
            mac.update(view[: PAYLOAD_OFFSET + n])
            view[PAYLOAD_OFFSET + n :] = mac.digest()
        return out.view(self.sealed_layout.shape)

    def open(self, key: str | None, sealed: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Verify sealed bytes (any shape of `num_bytes` uint8, CPU) -> (stored key, block).

        key: the key it must have been sealed under; None accepts any (the stored key is returned,
        authenticated). The block is a fresh tensor or a view into `sealed`. Raises AuthFailure.
        """
        flat = sealed.reshape(-1)
        if flat.dtype != torch.uint8 or flat.numel() != self.num_bytes:
            raise AuthFailure(f"block {key}: {flat.numel()} {flat.dtype} values, a sealed block is {self.num_bytes} uint8")
        view = memoryview(flat.numpy())
        magic, version, mode, key_len, nonce = _HEAD.unpack_from(view, 0)
        if magic != MAGIC or version != FORMAT_VERSION or mode != self.mode or key_len > MAX_KEY_BYTES:
            raise AuthFailure(f"block {key}: not a sealed block of this format and mode "
                              f"(magic {magic!r}, version {version}, mode {mode}, expected mode {self.mode})")
        aad = self._layout_bytes + bytes(view[:HEADER_BYTES])
        n = self.layout.num_bytes
        if mode == MODE_AEAD:
            if any(view[PAYLOAD_OFFSET + n + 16 :]):  # the unused half of the tag field: not covered by GCM
                raise AuthFailure(f"block {key}: authentication failed (bytes after the tag altered)")
            plain = torch.empty(KEY_FIELD_BYTES + n, dtype=torch.uint8)  # every byte written by decrypt_into
            self._decrypt(key, nonce, view[HEADER_BYTES : PAYLOAD_OFFSET + n + 16], aad, memoryview(plain.numpy()))
            stored_key, payload = bytes(plain[:key_len].numpy()), plain[KEY_FIELD_BYTES:]
        else:
            mac = hmac.new(self._mac_key, self._layout_bytes, "sha256")
            mac.update(view[: PAYLOAD_OFFSET + n])
            if not hmac.compare_digest(mac.digest(), view[PAYLOAD_OFFSET + n :]):
                raise AuthFailure(f"block {key}: authentication failed (forged, altered, or another secret)")
            field = bytearray(KEY_FIELD_BYTES - 16)
            self._decrypt(key, nonce, view[HEADER_BYTES:PAYLOAD_OFFSET], aad, memoryview(field))
            stored_key, payload = bytes(field[:key_len]), flat[PAYLOAD_OFFSET : PAYLOAD_OFFSET + n]
        found = stored_key.decode(errors="replace")
        if key is not None and found != key:
            raise AuthFailure(f"block {key}: a genuine block of another key ({found[:80]!r}) stored under its name")
        return found, _as_block(payload, self.layout)

    def _decrypt(self, key: str | None, nonce: bytes, data: memoryview, aad: bytes, out: memoryview) -> None:
        from cryptography.exceptions import InvalidTag

        try:
            self._aead.decrypt_into(nonce, data, aad, out)
        except InvalidTag:
            raise AuthFailure(f"block {key}: authentication failed (forged, altered, or another secret)") from None


def _as_block(payload: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """payload: flat uint8 [layout.num_bytes] -> [2, H, T, D] in the layout's dtype (a view when aligned)."""
    if payload.storage_offset() % layout.dtype.itemsize:
        payload = payload.clone()
    return payload.view(layout.dtype).reshape(layout.shape)


# -- the secret ------------------------------------------------------------------------------------
def is_sealed(tier_config: "TierConfig") -> bool:
    """Whether a start seals the tier's blocks with the storage secret (and so reads it): disk and Redis tiers
    unless marked trusted; the CPU tier never (its blocks stay in this process)."""
    return tier_config.kind != "cpu" and not tier_config.trusted


def check_tier_secret(index: int, tier_config: "TierConfig", storage: "StorageConfig") -> None:
    """ConfigError where a start refuses tier `index` before reading a secret: `encrypt: true` on a trusted tier,
    or a tier that seals its blocks with no secret set at all."""
    if not is_sealed(tier_config):
        if getattr(tier_config, "encrypt", False):
            from tierkv.config.rules import encrypt_on_trusted

            raise encrypt_on_trusted(index)
        return
    if storage.secret is None and storage.secret_file is None:
        raise ConfigError(
            "storage.secret_file", None,
            f"the {tier_config.kind} tier tiers[{index}] keeps blocks others can write or a later process reads: "
            f"set storage.secret_file (or the {SECRET_FILE_ENV} / {SECRET_ENV} environment variable) to the "
            f"deployment's secret, or mark the tier 'trusted: true' if nobody else can write to it",
        )


def sealer_for_tier(index: int, tier_config: "TierConfig", storage: "StorageConfig",
                    layout: BlockLayout) -> BlockSealer | None:
    """The sealer of a disk or Redis tier; None for a trusted one. Raises ConfigError without a secret."""
    check_tier_secret(index, tier_config, storage)
    if not is_sealed(tier_config):
        return None
    return BlockSealer(load_secret(storage), layout, encrypt=tier_config.encrypt)
