"""Blocks and their content addresses.

Primitives: `BlockLayout` (shape and dtype of one block), `model_fingerprint`,
`chain_block_hashes`, `chain_root_digest`, `block_key`, `block_keys_for_prompt`.

A block is the K and V of `block_tokens` consecutive tokens of one layer:

    block tensor: [2, num_kv_heads, block_tokens, head_dim]   (index 0 = K, 1 = V)

Its address is a chained hash, so two requests that share a prefix share its blocks,
across requests, processes and hosts, while different models never mix:

    h_0 = sha256(fingerprint)                       fingerprint = model + KV dtype + shape
    h_i = sha256(h_{i-1} || token ids of block i)   (the last block may be partial)
    key(i, layer) = hex(h_i) + "/L" + layer
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16; raises ValueError naming what is allowed."""
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; allowed: {sorted(_DTYPE_NAMES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class BlockLayout:
    """Shape and dtype of one KV block of one layer."""

    num_kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def num_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.block_tokens * self.head_dim * self.dtype.itemsize

    def empty(self, num_blocks: int, device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
        """Uninitialised [num_blocks, 2, num_kv_heads, block_tokens, head_dim] tensor."""
        return torch.empty((num_blocks, *self.shape), dtype=self.dtype, device=device, pin_memory=pin_memory)


def model_fingerprint(model_id: str, num_layers: int, layout: BlockLayout, extra: dict | None = None) -> str:
    """A short digest naming everything that makes KV bytes incompatible between two runs."""
    fields = {
        "model": model_id,
        "num_layers": num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "block_tokens": layout.block_tokens,
        "kv_dtype": dtype_name(layout.dtype),
        **(extra or {}),
    }
    blob = json.dumps(fields, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def chain_block_hashes(token_ids: Sequence[int], block_tokens: int, fingerprint: str,
                       parent_hash: str | None = None) -> list[str]:
    """Chained hashes of the blocks of a token sequence; the last entry covers a partial block.

    `parent_hash`: the hash of the block just before `token_ids` (to extend a chain). Each block's
    hash is sha256(parent's digest + its ids as little-endian int64).
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    ids = _as_int64(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of ints, got shape {ids.shape}")
    parent = bytes.fromhex(parent_hash) if parent_hash else chain_root_digest(fingerprint)
    # one conversion of the whole sequence, then a view per block: a 100k-token prompt's 1.5k hashes are
    # on the scheduler's path of every prefix lookup (a per-block astype + tobytes cost a third more)
    data = memoryview(ids.astype("<i8", copy=False).tobytes())
    step, sha256, hashes = 8 * block_tokens, hashlib.sha256, []
    for start in range(0, len(data), step):
        digest = sha256(parent)
        digest.update(data[start : start + step])
        parent = digest.digest()
        hashes.append(parent.hex())
    return hashes


def chain_root_digest(fingerprint: str) -> bytes:
    """The parent digest of a chain's first block, for the model `fingerprint` names."""
    return hashlib.sha256(fingerprint.encode()).digest()


def _as_int64(token_ids: Sequence[int]) -> np.ndarray:
    """token_ids as int64: a list of ints through np.fromiter (faster than np.asarray for a long
    list); anything else, or a list fromiter refuses (nested), through np.asarray."""
    if isinstance(token_ids, list):
        try:
            return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        except (TypeError, ValueError):
            pass
    return np.asarray(token_ids, dtype=np.int64)


def block_key(block_hash: str, layer: int) -> str:
    return f"{block_hash}/L{layer}"


def block_keys(block_hashes: Sequence[str], layer: int, suffix: str = "") -> list[str]:
    """`block_key(h, layer) + suffix` for each hash: one string join per block (a prefix of 100k
    tokens is 50k keys over 32 layers, built on every lookup and pin)."""
    tail = block_key("", layer) + suffix  # block_key's format, built once
    return [h + tail for h in block_hashes]


def block_keys_for_prompt(
    token_ids: Sequence[int], block_tokens: int, fingerprint: str, num_layers: int
) -> list[list[str]]:
    """keys[layer][block_index] for every layer of a token sequence."""
    hashes = chain_block_hashes(token_ids, block_tokens, fingerprint)
    return [block_keys(hashes, layer) for layer in range(num_layers)]
