"""Host-side bookkeeping for one forward step of one sequence: which blocks attention reads.

Primitives: `StepPlan`, `plan_step`, `step_blocks`.

A step appends `num_new_tokens` tokens at positions [t0, t0 + n). Attention reads three parts:

    blocks 0 .. first_block-1 (all full, all in the CPU tier):
        resident ones  -> paged attention over the GPU slots         (`resident_*`)
        the others     -> streamed through the staging ring in chunks (`streamed_blocks`)
    tokens first_block*T .. t0+n-1 (the partial block's old tokens + the new ones):
        -> attention over the freshly assembled chunk, causal          (the "fresh" part)

Every layer of a step has the same block structure, so one plan serves all layers. The plan is
plain Python (ints, lists, ranges): no torch import, no device. Its index lists reach the step's
device through `tierkv.transfer.step_indices` (the doing side).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.storage.gpu import ResidencyPlan


@dataclass
class StepPlan:
    t0: int                               # tokens held before the step
    num_new_tokens: int
    block_tokens: int                     # T
    first_block: int                      # block holding position t0
    num_blocks_after: int                 # blocks after the step
    resident_blocks: list[int]            # old full blocks read from GPU slots
    resident_slots: list[int]             # their local slots (within a layer)
    streamed_blocks: range                # old full blocks streamed from the CPU tier
    num_fresh_full: int                   # fresh blocks that are full after the step (written to CPU)
    fresh_resident_index: list[int]       # fresh blocks (0 = first_block) that stay resident
    fresh_resident_slots: list[int]       # their local slots

    @property
    def resident_start_pos(self) -> list[int]:
        """Position of each resident block's first token."""
        return [b * self.block_tokens for b in self.resident_blocks]

    @property
    def fresh_positions(self) -> range:
        """Positions of the fresh part: the partial block's old tokens and the new ones."""
        return range(self.first_block * self.block_tokens, self.t0 + self.num_new_tokens)

    @property
    def q_positions(self) -> range:
        """Positions of the step's new tokens (its queries)."""
        return range(self.t0, self.t0 + self.num_new_tokens)


def step_blocks(residency: "ResidencyPlan", block_tokens: int, t0: int, num_new_tokens: int) -> tuple[list[int], range]:
    """The old full blocks a step of `num_new_tokens` tokens at t0 reads from GPU slots (sinks and far
    cache, then the window), and those it streams from the CPU tier (host only).

    The streamed range always starts at the front region's end P and never runs backwards: a
    sequence that has not filled the front region yet (first_block < P) streams range(P, P), an
    empty far set, so every consumer (`len`, `torch.arange(start, stop)`, slicing, the bound
    kernels' `first <= stop`) sees a well-formed, empty range.

        blocks:  0 .. P-1 (front) | P .. window_start-1 (streamed) | window_start .. first_block-1
    """
    if t0 < 0 or num_new_tokens < 1 or block_tokens < 1:
        raise ValueError(f"step_blocks: t0 {t0} (>= 0), num_new_tokens {num_new_tokens} (>= 1), "
                         f"block_tokens {block_tokens} (>= 1)")
    first_block = t0 // block_tokens
    num_blocks_after = -(-(t0 + num_new_tokens) // block_tokens)
    front = residency.num_front_blocks
    resident = list(range(min(first_block, front)))
    window_start = max(front, num_blocks_after - residency.num_window_blocks)
    resident += list(range(window_start, first_block))
    return resident, range(front, max(front, min(first_block, window_start)))


def plan_step(residency: "ResidencyPlan", block_tokens: int, t0: int, num_new_tokens: int) -> StepPlan:
    """The plan of a step of `num_new_tokens` tokens at t0 (ValueError for a negative t0, no tokens or
    blocks of no tokens)."""
    resident, streamed = step_blocks(residency, block_tokens, t0, num_new_tokens)
    first_block = t0 // block_tokens
    t1 = t0 + num_new_tokens
    num_blocks_after = -(-t1 // block_tokens)
    fresh_resident = [b for b in range(first_block, num_blocks_after) if residency.is_resident(b, num_blocks_after)]
    return StepPlan(
        t0=t0,
        num_new_tokens=num_new_tokens,
        block_tokens=block_tokens,
        first_block=first_block,
        num_blocks_after=num_blocks_after,
        resident_blocks=resident,
        resident_slots=[residency.slot_of(b) for b in resident],
        streamed_blocks=streamed,
        num_fresh_full=t1 // block_tokens - first_block,
        fresh_resident_index=[b - first_block for b in fresh_resident],
        fresh_resident_slots=[residency.slot_of(b) for b in fresh_resident],
    )
