"""vLLM's paged KV cache seen as tierkv blocks: layer order, block layouts, spans of blocks.

Primitives: `layer_order`, `PagedLayout` (`kind`, `read`, `read_layers`, `write`), `BlockSpan`.

    vLLM paged cache of one layer (FlashAttention, logical view):  [num_blocks, H, T, 2 * D]
    tierkv block:                                                  [2, H, T, D]   (K, V)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tierkv.blocks import BlockLayout

_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_order(layer_names: Sequence[str]) -> dict[str, int]:
    """Layer name -> index 0..L-1, by the first number in each name ('model.layers.7.self_attn.attn')."""
    def number(name: str) -> int:
        match = _LAYER_NUMBER.search(name)
        if match is None:
            raise ValueError(f"cannot tell the layer index of vLLM layer {name!r} (no number in its name)")
        return int(match.group(1))

    ordered = sorted(layer_names, key=number)
    numbers = [number(n) for n in ordered]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"vLLM layer names do not number the layers uniquely: {list(layer_names)[:8]}")
    return {name: i for i, name in enumerate(ordered)}


class PagedLayout:
    """Reads and writes tierkv blocks in one layer's paged vLLM KV cache tensor."""

    def __init__(self, layout: BlockLayout):
        self.layout = layout

    def kind(self, kv: torch.Tensor) -> str:
        H, T, D = self.layout.num_kv_heads, self.layout.block_tokens, self.layout.head_dim
        if kv.dim() == 4 and tuple(kv.shape[1:]) == (H, T, 2 * D):
            return "BHT2D"   # FlashAttention in vLLM 0.26: K and V packed in the last dim
        if kv.dim() == 5 and kv.shape[0] == 2 and tuple(kv.shape[2:]) == (T, H, D):
            return "2BTHD"   # the older [2, num_blocks, block_size, H, D]
        if kv.dim() == 5 and kv.shape[1] == 2 and tuple(kv.shape[2:]) == (T, H, D):
            return "B2THD"
        raise ValueError(
            f"vLLM KV cache of shape {tuple(kv.shape)} is not a layout tierkv reads "
            f"(H={H}, block_size={T}, head_dim={D}); use attention backend FLASH_ATTN"
        )

    def read(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks block_ids of the cache as a new contiguous [n, 2, H, T, D]."""
        kind = self.kind(kv)
        if kind == "BHT2D":
            x = kv.index_select(0, block_ids)                                 # [n, H, T, 2D]
            return x.unflatten(-1, (2, self.layout.head_dim)).permute(0, 3, 1, 2, 4).contiguous()
        if kind == "2BTHD":
            return kv.index_select(1, block_ids).permute(1, 0, 3, 2, 4).contiguous()
        return kv.index_select(0, block_ids).transpose(2, 3).contiguous()

    def read_layers(self, kvs: Sequence[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks block_ids of several layers' caches (of one layout) as a new contiguous
        [len(kvs), n, 2, H, T, D]: one gather per layer, one reordering for all."""
        kind = self.kind(kvs[0])
        if kind == "BHT2D":
            x = torch.stack([kv.index_select(0, block_ids) for kv in kvs])  # [L, n, H, T, 2D]
            return x.unflatten(-1, (2, self.layout.head_dim)).permute(0, 1, 4, 2, 3, 5).contiguous()
        return torch.stack([self.read(kv, block_ids) for kv in kvs])

    def write(self, kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """kv[block_ids] = blocks ([n, 2, H, T, D]) in the cache's own layout."""
        kind = self.kind(kv)
        if kind == "BHT2D":
            kv.index_copy_(0, block_ids, blocks.permute(0, 2, 3, 1, 4).flatten(-2))
        elif kind == "2BTHD":
            kv.index_copy_(1, block_ids, blocks.permute(1, 0, 3, 2, 4))
        else:
            kv.index_copy_(0, block_ids, blocks.transpose(2, 3))


@dataclass
class BlockSpan:
    """Blocks of one request to move: vLLM block ids and the chained hashes of their tokens. A save's
    `reads`: the blocks loaded in its step that the request's computed tokens attended (a load of one
    that fails makes the saved KV wrong: `VllmKVStore.savable`)."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]
    reads: list[int] = field(default_factory=list)
