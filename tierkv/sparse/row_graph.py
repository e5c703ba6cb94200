"""One layer's CUDA graph for one set of decoding rows: what it bakes in and what it holds.

Primitives: `row_key`, `NearInputs`, `RowGraph`, `static_inputs`.

A graph knows its rows by their buffers, not by request (`row_key`): another request holding the
same summary table and pinned-slot buffer (passed on when the first finished) replays the same
graph; a new buffer means a new capture. Its static inputs and outputs are allocated outside the
graphs' memory pool (`tierkv.sparse.graph_capture`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def row_key(req, layer: int) -> tuple:
    """What a graph bakes in for one row: its request's summary table and pinned-slot buffer of the
    layer (address, size) and its far-block cache set. Not the request: another one holding the
    same buffers (passed on when the first finished, `FarKV.reuses_buffers`) replays the same graph;
    a new buffer means a new capture."""
    table, slots = req.far_summaries.tables[layer], req.pinned_slots_dev[layer]
    return table.data_ptr(), table.shape[0], slots.data_ptr(), slots.numel(), req.cache.index


@dataclass
class NearInputs:
    """Static inputs of the window part when a step's graphs run it too (`attend_whole`), shared by
    every layer's graph of one set of rows and written once per step: each row's block table past its
    far blocks [m, C] and key count [m] (int32, as vLLM's), and query offsets 0..m (int32 [m + 1])."""

    table: torch.Tensor
    seqused_k: torch.Tensor
    cu_seqlens_q: torch.Tensor


@dataclass
class RowGraph:
    key: tuple              # what it baked in: per row the request and its summary table and pinned-slot
                            # buffer (address, size); the scale; for a whole graph, the window part's too
    graph: torch.cuda.CUDAGraph
    q: torch.Tensor         # static inputs: the rows' queries [m, H, D], far counts (int64 [m]) and, unless
    num_far: torch.Tensor   #   the graph runs the window part itself, near parts (out [m, H, D], lse float32
    near_out: torch.Tensor | None  # [m, H]); near_out is what the vLLM backend hands FlashAttention as its
    near_lse: torch.Tensor | None  # output when every row of the step is graphed
    out: torch.Tensor       # static outputs, valid until the next replay: the rows' attention, near and
    ids: torch.Tensor       #   far merged [m, H, D] (the output's dtype); their selections [m, k]
    far_counts: list[int]   # the values num_far holds
    request_ids: tuple[str, ...]  # the rows' requests, in order
    row_inputs: tuple       # their far-block cache sets, summary tables' and slot lists' addresses (int64 [m]
                            #   each), static
    near_inputs: NearInputs | None = None  # a whole graph's window inputs (kept alive with it)


def static_inputs(layer: int, rows: list[tuple[str, object, int]], q_rows: torch.Tensor, out_dtype: torch.dtype,
                  counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """A new graph's static tensors for decoding rows (req_id, request, far blocks), outside the graphs'
    pool, on q_rows' device: (q [m, H, D], a copy of q_rows; out [m, H, D] of out_dtype, unwritten;
    far counts int64 [m]; row inputs: the rows' cache sets and the addresses of their summary tables
    and slot lists, int64 [m] each, fixed for the graph's life: its key holds them)."""
    q = q_rows.clone()
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    far_counts = torch.tensor(counts, dtype=torch.int64, device=q.device)
    row_inputs = tuple(torch.tensor(values, dtype=torch.int64, device=q.device) for values in (
        [req.cache.index for _, req, _ in rows],
        [req.far_summaries.tables[layer].data_ptr() for _, req, _ in rows],
        [req.pinned_slots_dev[layer].data_ptr() for _, req, _ in rows]))
    return q, out, far_counts, row_inputs
