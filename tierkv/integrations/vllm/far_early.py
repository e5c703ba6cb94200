"""A lone request's first far copies, started as soon as the scheduler has built its step.

Primitives: `start_far_copies`. No vLLM import.

A step whose far blocks are streamed waits, before its first copy, for vLLM to prepare the forward and for the
worker's `start_load_kv` (finished requests, window loads, pins). Where the scheduler and the worker share one
store (an in-process engine, no async scheduling: the step built is the next one run), the scheduler side does
the worker's first part for a step of one request at its end:

    build_connector_meta (scheduler)          start_load_kv (worker), later in the same step
      finished requests unpinned                finish: nothing left to do
      the request's hashes, its far blocks      add_hashes: the same hashes again; pins: none new
        pinned (the worker would pin the same)
      the step's chunks laid out, the first     begin_step's plan adopts them (the same blocks from the
        one per staging region copied            same CPU slots); any other plan discards them

With more than one request in the step, or chunks carried already (a decode step's), it does nothing: each
request's far blocks start where the batch's layout puts them, known only to the worker.
"""
from __future__ import annotations

from typing import Sequence

from tierkv.integrations.vllm.far_step import lay_out_step, step_rows


def start_far_copies(far, scheduled: dict[str, tuple[int, int]], hashes: Sequence[tuple[str, int, list[str]]],
                     finished: Sequence[str], prompt_steps: Sequence[str], far_floors: dict[str, int]) -> int:
    """The first far copies of a step of one request (a `TierKVMetadata`'s scheduled, hashes, finished,
    prompt_steps, far_floors) on `far`, the worker's FarKV; returns the chunks copied (0: nothing to start).
    A prompt step only (a decoding row may select its far blocks); none with a far floor (a recompute)."""
    if len(scheduled) != 1 or far_floors:
        return 0
    (req_id, (num_computed, num_new)), = scheduled.items()
    rows = step_rows([(req_id, num_computed, num_new)], far.window_tokens, far.block_tokens)
    if req_id not in prompt_steps or not rows[0].num_far_blocks or far.streamer.has_carried:
        return 0
    for done in finished:
        far.finish(done)
    for rid, start, block_hashes in hashes:
        if rid == req_id:
            far.add_hashes(rid, start, block_hashes)
    req = far.requests.get(req_id)
    if req is None or len(req.hashes) < rows[0].num_far_blocks:
        return 0
    far.counts["blocks_pinned"] += far.pins.pin(req_id, req, rows[0].num_far_blocks) * far.store.num_layers
    far.eager.plan(rows, lay_out_step(rows, [False], far.pool.region_blocks))
    copied = far.streamer.copy_ahead()
    far.counts["early_chunks"] += copied
    return copied
