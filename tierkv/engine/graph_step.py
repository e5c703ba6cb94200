"""One decode step of a sequence in the form a CUDA graph can replay: its host side, and the append
and attention its forward runs instead of `SequenceKV`'s own.

Primitives: `GraphStep` (`begin`, `end`, `kv_rows`, `append`, `attend`).

A one-token decode step under predictor 'cache' that does not complete a block changes only
device values from the step before (`tierkv.engine.decode_graph` replays it). Per layer:

    append:  the new K/V rows [2H, D] --index_copy_--> the layer's resident slots viewed as
             [slots * 2 * H * T, D], at rows kv_rows (read from the device):
             row of (kv, head) = ((partial_slot * 2 + kv) * H + head) * T + offset
    attend:  q over [resident blocks | partial block] (one paged attention; block slots, first
             positions and token counts read from the device), then predictor 'cache''s far part
             and the merge (`CachedSparse.attend_far`)

`SequenceKV.append` and `attend` hand their work here while a `GraphStep` is begun on the
sequence; `end` does the host bookkeeping of the step (token counts, resident reads) once, whether
the forward ran or a graph replayed it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.attention import paged_partial_attention
from tierkv.scheduler import step_blocks


@dataclass
class GraphStep:
    """The new token at position t0 lands at `offset` of the partial block, in GPU slot `partial_slot`;
    attention reads the resident blocks' slots plus the partial block's (`block_slots`, their first
    positions `block_starts`, their token counts `block_fills`); the far part has `num_far` blocks.
    `inputs`: the device tensors the step's forward reads (its `DecodeStep` sets them)."""

    seq: object
    t0: int
    offset: int
    partial_slot: int
    block_slots: list[int]
    block_starts: list[int]
    block_fills: list[int]
    num_far: int
    inputs: object = None

    @classmethod
    def begin(cls, seq) -> "GraphStep | None":
        """The host side of `seq`'s next one-token decode step, when its forward only reads device values:
        a pending GPU budget applied, finished write-backs completed, the far part's step begun. None
        (the step runs eagerly) for another policy or predictor, an empty sequence, a step that
        completes a block (saved to the CPU tier), a partial block that is not resident."""
        rt = seq.rt
        T, t0 = rt.layout.block_tokens, seq.num_tokens[0]
        far = seq.predictor.graph_far()  # predictor 'cache' only
        if far is None or seq.is_finished or t0 == 0 or (t0 + 1) % T == 0:
            return None
        seq._complete_finished_d2h()
        rt.apply_pending_budget(seq)
        first, residency = t0 // T, rt.residency
        if not residency.is_resident(first, first + 1):
            return None
        resident, streamed = step_blocks(residency, T, t0, 1)
        rt.streamer.clear()
        far.begin_step(seq, streamed)
        slots = [residency.slot_of(b) for b in resident] + [residency.slot_of(first)]
        step = cls(seq=seq, t0=t0, offset=t0 - first * T, partial_slot=slots[-1], block_slots=slots,
                   block_starts=[b * T for b in resident] + [first * T],
                   block_fills=[T] * len(resident) + [t0 - first * T + 1], num_far=len(streamed))
        seq._graph_step = step
        return step

    def end(self, done: bool = True) -> None:
        """After the step's forward or replay (done), or instead of it (not done: it runs eagerly)."""
        seq = self.seq
        seq._graph_step = None
        if done:
            seq.num_tokens = [n + 1 for n in seq.num_tokens]
            seq.num_resident_reads += (len(self.block_slots) - 1) * seq.rt.num_layers

    def kv_rows(self, num_kv_heads: int, block_tokens: int) -> list[int]:
        """Where the new token's K then V rows go, head after head (see the module docstring)."""
        base = self.partial_slot * 2 * num_kv_heads
        return [(base + i) * block_tokens + self.offset for i in range(2 * num_kv_heads)]

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """k_new, v_new [1, H, D] into the partial block's GPU slot, at rows read from the device."""
        rows = self.seq.rt.pool.resident[layer].view(-1, k_new.shape[-1])
        rows.index_copy_(0, self.inputs.kv_rows, torch.cat([k_new[0], v_new[0]]))

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [1, H, D] over the resident and partial blocks, then the far part; float32 [1, H, D]."""
        inputs, seq = self.inputs, self.seq
        near = paged_partial_attention(q, seq.rt.pool.resident[layer], inputs.block_slots, inputs.block_starts,
                                       inputs.block_fills, scale=scale)
        return seq.predictor.graph_far().attend_far(layer, q, near, scale, inputs.row_inputs[layer])
