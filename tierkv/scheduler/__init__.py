"""The lookahead scheduler: host-side plans per step, copies enqueued ahead of compute.

Primitives: `plan_step` / `StepPlan` / `step_blocks` (CPU only), `LookaheadStreamer` (enqueues copies).
"""
from tierkv.scheduler.lookahead import LookaheadStreamer, StagedChunk
from tierkv.scheduler.plan import StepPlan, plan_step, step_blocks

__all__ = ["LookaheadStreamer", "StagedChunk", "StepPlan", "plan_step", "step_blocks"]
