"""A step plan's index lists on the step's device: what attention and the resident writes read.

Primitives: `StepIndices`, `step_indices`.

    plan = plan_step(residency, T, t0, n)        # host only (tierkv.scheduler.plan)
    index = step_indices(plan, device)           # 7 int64 copies, staged through pinned memory on CUDA

The copies go through `to_device_no_sync`: on CUDA the host never waits for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tierkv.transfer.device import to_device_no_sync

if TYPE_CHECKING:
    from tierkv.scheduler.plan import StepPlan


@dataclass(frozen=True)
class StepIndices:
    """int64 tensors on the step's device (k: resident fresh blocks, n: new tokens)."""

    resident_slots: torch.Tensor          # [len(resident_blocks)] local GPU slots of the old resident blocks
    resident_start_pos: torch.Tensor      # [len(resident_blocks)] their first token's position
    resident_num_tokens: torch.Tensor     # [len(resident_blocks)] T each (they are full)
    fresh_positions: torch.Tensor         # [t0 + n - first_block*T] positions of the fresh part
    q_positions: torch.Tensor             # [n] positions of the new tokens
    fresh_resident_index: torch.Tensor    # [k] fresh blocks (0 = first_block) that stay resident
    fresh_resident_slots: torch.Tensor    # [k] their local GPU slots


def step_indices(plan: "StepPlan", device: torch.device) -> StepIndices:
    """`plan`'s index lists as int64 tensors on `device` (no host wait on CUDA)."""
    return StepIndices(
        resident_slots=to_device_no_sync(plan.resident_slots, device),
        resident_start_pos=to_device_no_sync(plan.resident_start_pos, device),
        resident_num_tokens=to_device_no_sync([plan.block_tokens] * len(plan.resident_blocks), device),
        fresh_positions=to_device_no_sync(torch.arange(plan.fresh_positions.start, plan.fresh_positions.stop), device),
        q_positions=to_device_no_sync(torch.arange(plan.q_positions.start, plan.q_positions.stop), device),
        fresh_resident_index=to_device_no_sync(plan.fresh_resident_index, device),
        fresh_resident_slots=to_device_no_sync(plan.fresh_resident_slots, device),
    )
