"""Far blocks read in place from the CPU tier when the "GPU" device is the CPU.

Primitives: `reads_in_place`, `InPlaceFarReads` (`attend`).

On a CUDA device the far blocks (neither sinks nor window) cross PCIe through the staging ring,
a region at a time, and each region is one partial attention merged into the layer's result. On a
CPU device there is no PCIe: the far blocks already sit in the CPU tier's slab, in the memory the
attention kernel reads. Copying them into staging first, a region at a time, only adds copies and
per-call overhead (a copy, a gather, a kernel call and an LSE merge per region), so here a layer's
far part is one partial attention over the slab itself::

    CPU tier slab [num_slots, 2, Hkv, T, D]
        slots of the layer's far blocks (all streamed blocks, or the sparse selection)
        --> one paged partial attention (one gather inside the kernel wrapper) --> (out, lse)

Every far block precedes every query of the step (far blocks end before the step's first block),
so no causal mask applies. A quantized tier's codes are dequantized for the call (the same
`dequantize_blocks` the staged path runs), so both paths read the same values.

Selected by `scheduler.cpu_far_reads` ("direct", the default; "staged" keeps the staging ring on
a CPU device too, the path a CUDA device takes, e.g. to test it without a GPU).
"""
from __future__ import annotations

import torch

from tierkv.attention import contiguous_partial_attention


def reads_in_place(cpu_far_reads: str, device: torch.device | str) -> bool:
    """Whether a runtime on `device` attends far blocks from the CPU tier's slab (`scheduler.cpu_far_reads`)."""
    return torch.device(device).type == "cpu" and cpu_far_reads == "direct"


class InPlaceFarReads:
    """The far part of a layer's attention, read from the CPU tier's slab (a `CpuTier`, plain or quantized)."""

    def __init__(self, tier):
        if tier.slab.device.type != "cpu":
            raise ValueError(f"in-place far reads need the CPU tier's slab on the CPU, got {tier.slab.device}")
        self.tier = tier
        layout = tier.layout
        self.block_tokens = layout.block_tokens
        # a plain tier holds bit-identical copies of the resident blocks too (every full block is written
        # back): they are read from the slab in the same call; a quantized tier's copies are lossy
        self.reads_resident = tier.quant_format is None
        self.num_blocks_read = 0  # block reads served from the slab in place (all layers), in whole blocks:
        # per-KV-head selections read Hkv slices of a block per block counted, the same bytes as per layer
        # keys then values, heads first, reused by every call: [2, Hkv, capacity_blocks, T, D], the KV dtype
        self._keys = torch.empty((2, layout.num_kv_heads, 0, layout.block_tokens, layout.head_dim), dtype=layout.dtype)

    def attend(
        self,
        q: torch.Tensor,                       # [num_q, num_heads, head_dim], CPU, the KV dtype
        layer_slots: torch.Tensor,             # int64 [num_blocks_written] CPU-tier slot of each block of the layer, CPU
        blocks: range | torch.Tensor,          # blocks to read: a range, int64 [k], or int64 [Hkv, k] per KV head, CPU
        *,
        scale: float,
        fresh: torch.Tensor | None = None,     # [2, num_fresh, num_kv_heads, head_dim] more keys and values, KV dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """float32 (out [num_q, num_heads, head_dim], lse [num_q, num_heads]) over the listed blocks (all
        full) and the `fresh` tokens, one kernel call, no mask: every key must precede or be at every
        query's position (far blocks always are; fresh tokens in a one-token decode step); None when
        there is no key. Blocks [Hkv, k]: KV head h reads its own row (`sparse_selection: per_kv_head`),
        every head the same number of keys."""
        slots = self._slots(layer_slots, blocks)
        if slots.dim() == 2 and slots.shape[0] != self._keys.shape[1]:
            raise ValueError(f"per-KV-head blocks: {slots.shape[0]} rows for {self._keys.shape[1]} KV heads")
        num_blocks, num_fresh = slots.shape[-1], 0 if fresh is None else fresh.shape[1]
        if num_blocks == 0 and num_fresh == 0:
            return None
        self.num_blocks_read += num_blocks
        T = self.block_tokens
        keys = self._buffer(num_blocks + -(-num_fresh // T))
        if num_blocks:
            self._gather(slots, keys[:, :, :num_blocks])
        flat = keys.flatten(2, 3)  # [2, Hkv, capacity * T, D], a view
        if num_fresh:
            flat[:, :, num_blocks * T : num_blocks * T + num_fresh] = fresh.transpose(1, 2)
        kv = flat[:, :, : num_blocks * T + num_fresh].transpose(1, 2)  # [2, num_keys, Hkv, D] views
        return contiguous_partial_attention(q, kv[0], kv[1], scale=scale)

    def _gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """The blocks of `slots` into out [2, Hkv, k, T, D]: slots [k] for every KV head in one copy, or
        [Hkv, k], row h for KV head h; from the slab as it is, or a quantized tier's dequantized blocks."""
        pool = self._pool(slots.flatten())  # a quantized tier: the listed blocks in order, dequantized
        positions = torch.arange(slots.numel()).view(slots.shape)
        if slots.dim() == 1:  # [num_slots, 2, Hkv, T, D] viewed heads first -> out, one copy
            source, index = (self.tier.slab, slots) if pool is None else (pool, positions)
            torch.index_select(source.permute(1, 2, 0, 3, 4), 2, index, out=out)
            return
        for h in range(slots.shape[0]):
            source, index = (self.tier.slab, slots[h]) if pool is None else (pool, positions[h])
            torch.index_select(source.select(2, h).transpose(0, 1), 1, index, out=out[:, h])

    def _slots(self, layer_slots: torch.Tensor, blocks: range | torch.Tensor) -> torch.Tensor:
        """int64 CPU-tier slots of the listed blocks ([num_blocks], or [Hkv, k] for per-head rows)."""
        if not isinstance(blocks, range):
            return layer_slots[blocks]
        if len(blocks) and blocks.stop > layer_slots.numel():  # an empty far set may start past the written blocks
            raise IndexError(f"blocks {blocks.start}..{blocks.stop - 1}: only {layer_slots.numel()} blocks of "
                             f"this layer are in the CPU tier")
        return layer_slots[blocks.start : blocks.stop]

    def _pool(self, slots: torch.Tensor) -> torch.Tensor | None:
        """None for a plain tier (its slab is read as it is); a quantized tier's blocks, dequantized
        (`CpuTier.read_slots`: the values the staged path's dequantization gives)."""
        if self.tier.quant_format is None:
            return None
        return self.tier.read_slots(slots.tolist())

    def _buffer(self, num_blocks: int) -> torch.Tensor:
        """The reused key/value buffer, grown (doubling) to hold at least `num_blocks` blocks."""
        if self._keys.shape[2] < num_blocks:
            shape = list(self._keys.shape)
            shape[2] = max(num_blocks, 2 * shape[2])
            self._keys = torch.empty(shape, dtype=self._keys.dtype)
        return self._keys
