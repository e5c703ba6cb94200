"""The far blocks of a hot-window step that the CUDA graphs do not serve (`FarKV`'s eager part).

Primitives: `EagerRows` (`plan`, `attend_parts`). No vLLM import: tested on CPU with the PyTorch
reference attention; the kernels, row assembly and near merge are `far_attention`'s.

A row's far blocks reach the staging one of two ways:

    streamed   the step's far blocks of all requests form one list per layer (request after request);
               the lookahead streamer copies it through the main ring chunk by chunk, layers
               L+1..L+d while L computes, and each row attends its pieces of each chunk
    selected   under `scheduler.policy: sparse` a decoding row attends the `sparse_token_budget / T`
               far blocks with the largest key bound (tierkv.sparse: per-block key min/max kept on the
               device by `request_summaries.KeySummaries`), fetched through the eager regions once
               selected; prefill stays exact

A decoding row whose far blocks lack summaries (a prefix the tiers served) is streamed exactly once,
which leaves the summaries; a few missing ones (window blocks loaded from the tiers that became far)
are fetched and summarized before the selection.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tierkv.attention import paged_partial_attention
from tierkv.integrations.vllm.far_attention import chunk_partial, profiled
from tierkv.integrations.vllm.far_step import FarRow, StepLayout, StreamPlan


class EagerRows:
    def __init__(self, far):
        """far: the engine's FarKV: its step's rows, requests, streamers, key summaries and counters."""
        self.far = far

    def plan(self, rows: Sequence[FarRow], layout: StepLayout) -> None:
        """Plan the main ring's copies of the step's streamed far blocks (`layout.streamed` per row):
        per layer, the rows' far blocks one after another. Starts no copy."""
        far = self.far
        far_reqs = [(far.requests[r.req_id], n) for r, n in zip(rows, layout.streamed) if n]
        if far_reqs:  # per layer: the rows' far blocks one after another (views when one row has any)
            cpu_slots = [req_slots[0] if len(req_slots) == 1 else torch.cat(req_slots)
                         for req_slots in ([req.pinned_slots[layer][:n] for req, n in far_reqs]
                                           for layer in range(far.store.num_layers))]  # fmt: skip
        else:  # nothing streamed (a decode step of sparse rows): one empty list for every layer
            cpu_slots = [torch.empty(0, dtype=torch.int64)] * far.store.num_layers
        num_tokens = rows[-1].q_end if rows else 0
        decode = all(r.q_end - r.q_start == 1 for r in rows)
        plan = StreamPlan(range(0, layout.num_streamed), 1 if decode else max(2, num_tokens))
        far.streamer.plan(plan, cpu_slots, far.block_tokens)

    def attend_parts(self, layer: int, q: torch.Tensor, scale: float, dense, skip, pieces: list,
                     offsets: list) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """`FarKV.attend_parts` for a step with streamed chunks or sparse rows: per row index, its
        partial results, the streamed chunks' first, then the sparse rows' selections (rows in `skip`
        left out). pieces, offsets: the step's `StepLayout.pieces` and `.offsets`."""
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._attend_streamed(layer, q, scale, dense, pieces, offsets, parts)
        for i in self.far.sparse_rows:  # fetched once selected: each piece counts as a stall
            if i not in skip:
                self._attend_selected(i, layer, q, scale, parts)
        return parts

    def _attend_streamed(self, layer: int, q: torch.Tensor, scale: float, dense, pieces: list, offsets: list,
                         parts: dict) -> None:
        """Into `parts`: the rows' partial attentions over this layer's staging chunks, in order."""
        far = self.far
        staging = far.pool.staging
        for c, chunk in enumerate(far.streamer.chunks_for_layer(layer)):  # run to its end: it records events
            for i, first, end in pieces[c]:
                row = far.rows[i]
                parts.setdefault(i, []).append(chunk_partial(q[row.q_start : row.q_end], staging, chunk, first, end,
                                                             scale, dense))  # fmt: skip
                far.counts["far_blocks_read"] += end - first
                if far.sparse_blocks is not None:  # the row's block index of the chunk's first block here
                    index = c * far.pool.region_blocks + first - offsets[i]
                    far.key_summaries.summarize_staged(row, layer, index, staging, chunk.slots[first:end])

    def _attend_selected(self, i: int, layer: int, q: torch.Tensor, scale: float, parts: dict) -> None:
        """Into `parts`: sparse row i's partial attentions over its selected far blocks of `layer`,
        fetched once selected (its missing key summaries made first)."""
        far = self.far
        row = far.rows[i]
        req = far.requests[row.req_id]
        q_row = q[row.q_start : row.q_end]
        if req.summaries is None or row.num_far_blocks > req.summaries.prefix[layer]:
            with profiled("tierkv.sparse.summarize"):
                far.key_summaries.summarize_missing(row, req, layer)
        with profiled("tierkv.sparse.select"):
            ids = far.key_summaries.select(req, layer, q_row[0], row.num_far_blocks)
            far.overlap.note(far.counts["steps"], req.previous, layer, ids)
            slots = req.pinned_slots_dev[layer].index_select(0, ids)
        far.count_selections(ids.numel(), row.near_blocks(far.block_tokens), 1)
        with profiled("tierkv.sparse.fetch_attend"):
            fetcher = far.sparse_streamer
            for chunk in fetcher.fetch_now(layer, slots, ids * far.block_tokens, far.block_tokens):
                parts.setdefault(i, []).append(paged_partial_attention(
                    q_row, fetcher.pool.staging, chunk.slots, chunk.start_pos, chunk.num_tokens, scale=scale))
