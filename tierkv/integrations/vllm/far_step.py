"""One step of the hot window's far path, host side: its rows, which of them select or stream, the
streamed chunks' pieces, and where the step's host time went.

Primitives: `far_blocks`, `FarRow`, `step_rows`, `StepLayout`, `lay_out_step`, `StreamPlan`, `HostTimes`. No vLLM
import, no device work.

The rows' streamed far blocks form one list per layer, row after row; the lookahead streamer
copies it through the staging ring in chunks of `region_blocks`, and each chunk holds pieces of
one or more rows:

    rows' streamed blocks:  | row 0: 5 blocks     | row 2: 6 blocks         |     (row 1 selects: none)
    offsets:                  0                    5
    chunks (region 4):      | chunk 0     | chunk 1     | chunk 2     |
    pieces:                 [(0, 0, 4)]  [(0, 0, 1), (2, 1, 4)]  [(2, 0, 3)]    (row, first, end) in the chunk
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


def far_blocks(num_computed: int, window_tokens: int, block_tokens: int) -> int:
    """Blocks read from the tiers by a request with `num_computed` tokens before this step: the
    full blocks vLLM may have freed (it keeps the last `window_tokens` computed tokens)."""
    return max(0, (num_computed - window_tokens + 1) // block_tokens)


@dataclass(frozen=True)
class FarRow:
    """One request of a step, in the step's token order."""

    req_id: str
    q_start: int          # first of its query rows in the step's flattened tokens
    q_end: int
    num_computed: int     # tokens before this step
    num_far_blocks: int   # blocks [0, num_far_blocks) come from the tiers

    def near_blocks(self, block_tokens: int) -> int:
        """Blocks its near part reads from vLLM's pool (the window and the step's own tokens)."""
        return -(-(self.num_computed + self.q_end - self.q_start - self.num_far_blocks * block_tokens) // block_tokens)


def step_rows(rows: Sequence[tuple[str, int, int]], window_tokens: int, block_tokens: int,
              far_floors: Mapping[str, int] | None = None) -> list[FarRow]:
    """rows: (req_id, tokens before the step, tokens in the step) in the step's token order; far_floors: requests
    whose far part must reach further (vLLM holds its null block there: a recompute after a failed window load)."""
    result, q, floors = [], 0, far_floors or {}
    for req_id, num_computed, num_new in rows:
        far = max(far_blocks(num_computed, window_tokens, block_tokens), floors.get(req_id, 0))
        result.append(FarRow(req_id, q, q + num_new, num_computed, far))
        q += num_new
    return result


@dataclass(frozen=True)
class StepLayout:
    """Which far rows of a step select their blocks (sparse) and how the others' are streamed."""

    sparse_rows: list[int]                     # rows (indices) that select their far blocks
    streamed: list[int]                        # per row, far blocks streamed in full (0 for sparse rows)
    offsets: list[int]                         # per row, where its streamed blocks start in the step's list
    num_streamed: int                          # the step's streamed blocks, all rows
    pieces: list[list[tuple[int, int, int]]]   # per chunk: (row index, first, end) in the chunk


def lay_out_step(rows: list[FarRow], is_sparse: list[bool], region_blocks: int) -> StepLayout:
    """The layout of a step whose rows with `is_sparse` select; chunks of `region_blocks` blocks."""
    sparse_rows = [i for i, r in enumerate(rows) if is_sparse[i] and r.num_far_blocks]
    streamed = [0 if is_sparse[i] else r.num_far_blocks for i, r in enumerate(rows)]
    offsets, total = [], 0
    for n in streamed:
        offsets.append(total)
        total += n
    pieces = []
    for start in range(0, total, region_blocks):
        end = min(start + region_blocks, total)
        pieces.append([(i, max(o, start) - start, min(o + n, end) - start)
                       for i, (n, o) in enumerate(zip(streamed, offsets)) if n and o < end and o + n > start])  # fmt: skip
    return StepLayout(sparse_rows, streamed, offsets, total, pieces)


@dataclass(frozen=True)
class StreamPlan:
    """What `LookaheadStreamer.plan` reads of a step: the streamed block range and the step size."""

    streamed_blocks: range
    num_new_tokens: int


class HostTimes:
    """The far path's own host time: per step (begin_step, and all its layer calls), and per layer
    call of steady decode steps (no streamed chunks, no capture, no check)."""

    def __init__(self) -> None:
        self._decode: deque[float] = deque(maxlen=4096)  # a layer call's seconds, steady decode steps
        # per step, the host ms of begin_step and of all the step's layer calls (last 512 steps): where
        # a slow step's time went, ours or not
        self._steps: deque[tuple[float, float]] = deque(maxlen=512)
        self._begin_s = self._attend_s = 0.0

    def began(self, started: float) -> None:
        """begin_step, begun at `started` (time.perf_counter), is done."""
        self._begin_s, self._attend_s = time.perf_counter() - started, 0.0

    def note_layer(self, started: float, steady: bool) -> None:
        """A layer call's host time (from `started`) into its step's total, and into the decode median when `steady`."""
        spent = time.perf_counter() - started
        self._attend_s += spent
        if steady:
            self._decode.append(spent)

    def end_step(self) -> None:
        self._steps.append((round(1e3 * self._begin_s, 3), round(1e3 * self._attend_s, 3)))

    def stats(self) -> dict:
        # the far path's own host time per layer call in decode steps, median of the last 4096 calls
        # that captured no graph (no profiler needed)
        return {"decode_host_us_per_layer": 1e6 * float(np.median(self._decode)) if self._decode else None,
                "step_host_ms": list(self._steps)}  # per step (begin_step, its attend_into calls), last 512
