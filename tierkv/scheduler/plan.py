"""Host-side bookkeeping for one forward step of one sequence: which blocks attention reads.

Primitives: `StepPlan`, `plan_step`, `step_blocks`, `to_device_no_sync`.

A step appends `num_new_tokens` tokens at positions [t0, t0 + n). Attention reads three parts:

    blocks 0 .. first_block-1 (all full, all in the CPU tier):
        resident ones  -> paged attention over the GPU slots         (`resident_*`)
        the others     -> streamed through the staging ring in chunks (`streamed_blocks`)
    tokens first_block*T .. t0+n-1 (the partial block's old tokens + the new ones):
        -> attention over the freshly assembled chunk, causal          (the "fresh" part)

Every layer of a step has the same block structure, so one plan serves all layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.storage.gpu import ResidencyPlan


def to_device_no_sync(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 tensor on `device`; on CUDA staged through pinned memory, so the host never waits."""
    if isinstance(values, torch.Tensor) and values.is_cuda and device.type == "cuda":
        return values.to(device, torch.int64, non_blocking=True)  # already on a GPU (a fetch's staging slots)
    host = torch.as_tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class StepPlan:
    t0: int                               # tokens held before the step
    num_new_tokens: int
    first_block: int                      # block holding position t0
    num_blocks_after: int                 # blocks after the step
    resident_blocks: list[int]            # old full blocks read from GPU slots
    resident_slots: torch.Tensor          # int64 [len(resident_blocks)] local slots, on device
    resident_start_pos: torch.Tensor      # int64 [len(resident_blocks)] on device
    resident_num_tokens: torch.Tensor     # int64 [len(resident_blocks)] on device
    streamed_blocks: range                # old full blocks streamed from the CPU tier
    fresh_positions: torch.Tensor         # int64 [t0 + n - first_block*T] on device
    q_positions: torch.Tensor             # int64 [n] on device
    num_fresh_full: int                   # fresh blocks that are full after the step (written to CPU)
    fresh_resident_index: torch.Tensor    # int64 [k] fresh blocks that stay resident, on device
    fresh_resident_slots: torch.Tensor    # int64 [k] their local slots, on device

    @property
    def num_fresh_tokens(self) -> int:
        return self.fresh_positions.numel()


def step_blocks(residency: ResidencyPlan, block_tokens: int, t0: int, num_new_tokens: int) -> tuple[list[int], range]:
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


def plan_step(residency: ResidencyPlan, block_tokens: int, t0: int, num_new_tokens: int, device: torch.device) -> StepPlan:
    first_block = t0 // block_tokens
    t1 = t0 + num_new_tokens
    num_blocks_after = -(-t1 // block_tokens)
    resident, streamed = step_blocks(residency, block_tokens, t0, num_new_tokens)
    fresh_resident = [b for b in range(first_block, num_blocks_after) if residency.is_resident(b, num_blocks_after)]
    return StepPlan(
        t0=t0,
        num_new_tokens=num_new_tokens,
        first_block=first_block,
        num_blocks_after=num_blocks_after,
        resident_blocks=resident,
        resident_slots=to_device_no_sync([residency.slot_of(b) for b in resident], device),
        resident_start_pos=to_device_no_sync([b * block_tokens for b in resident], device),
        resident_num_tokens=to_device_no_sync([block_tokens] * len(resident), device),
        streamed_blocks=streamed,
        fresh_positions=to_device_no_sync(torch.arange(first_block * block_tokens, t1), device),
        q_positions=to_device_no_sync(torch.arange(t0, t1), device),
        num_fresh_full=t1 // block_tokens - first_block,
        fresh_resident_index=to_device_no_sync([b - first_block for b in fresh_resident], device),
        fresh_resident_slots=to_device_no_sync([residency.slot_of(b) for b in fresh_resident], device),
    )
