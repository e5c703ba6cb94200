"""The lookahead scheduler's deciding side: host-only plans per step (plain Python, no torch, no
device; the copies they lead to are `tierkv.transfer.lookahead.LookaheadStreamer`'s).

Primitives: `plan_step` / `StepPlan` / `step_blocks` (which blocks a step reads and streams),
`ChunkRing` (which staging region each streamed chunk takes, and when its copy may be issued).
"""
from tierkv.scheduler.plan import StepPlan, plan_step, step_blocks
from tierkv.scheduler.staging_ring import ChunkRing

__all__ = ["ChunkRing", "StepPlan", "plan_step", "step_blocks"]
