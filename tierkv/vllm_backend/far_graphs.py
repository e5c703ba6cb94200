"""CUDA graphs of the hot window's sparse decode rows: one request's selection, fetch and far
attention of one layer, captured once and replayed each step until its inputs move.

Primitives: `sparse_row_body`, `SparseRowGraphs` (`attend`, `forget`, `stats`).

Under vLLM's eager forward the sparse far path of a decoding row costs about 1.4 ms of host time
per layer (some 30 launches and their Python, results/profile-vllm-sparse-h200-04f0bf7.txt)
against about 0.25 ms of GPU work, and the merge with the near part another 0.37 ms. A graph
per (request, layer) turns that into a copy of the query, one replay, and one launch that merges
the graph's far part with the near part into vLLM's output (`FarKV.attend_into`,
`tierkv.attention.merge_two_into`):

    captured:  bound = [kmax | kmin] . [max(q,0) | min(q,0)], blocks at or past num_far masked
                 (one kernel, tierkv.sparse_kernels)
               ids = sorted top-k of the bound      slots = the layer's pinned CPU-tier slots[ids]
               copy kernel: CPU tier[slots] -> staging[graph slots], on the compute stream
               (out, lse) = attention of q over those staging slots

The far count is an input of the graph (the bound runs over the whole summary table, blocks
past the count masked), so a growing far part replays the same graph; it is captured again only
when the layer's summary table or its pinned-slot buffer is reallocated (both double, unless the
engine's max_model_len sized them once). Rows it
cannot serve go the eager way (`FarKV.attend_parts`): far blocks without a summary, a selection
larger than the staging region, engines without the copy kernel, CPU. With a quantized CPU tier
the graph copies the selected blocks' codes and scales and dequantizes them into staging. A
capture that fails turns the graphs off for the engine's life (logged, counted); the eager path
gives the same result. All graphs draw on one memory pool and replay on the compute stream in
order, one at a time. A graph's scratch may lie where another graph, captured later into the same
pool, keeps scratch of its own (a recapture breaks the capture order), so what must outlive a
replay, the inputs and outputs, is allocated outside the pool and copied in and out inside the
graph. A pool whose graphs were all freed cannot take another capture; the next capture opens a
new one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tierkv.attention import paged_partial_attention
from tierkv.block_io import dequantize_into

logger = logging.getLogger(__name__)


def packed_buffers(far, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """With a quantized CPU tier: device buffers for one selection's codes (uint8 [k, 2, H, T, D]),
    scales (float32 [k, 2, H]) and their order (int64 arange(k)); None for an unquantized tier."""
    cpu, k = far.store.cpu, far.sparse_blocks
    if cpu.quant_format is None:
        return None
    return (torch.empty((k, *cpu.slab.shape[1:]), dtype=cpu.slab.dtype, device=device),
            torch.empty((k, *cpu.scales.shape[1:]), dtype=cpu.scales.dtype, device=device),
            torch.arange(k, device=device))


def sparse_row_body(far, req, layer: int, q: torch.Tensor, num_far: torch.Tensor, staging: torch.Tensor,
                    staging_slots: torch.Tensor, block_tokens: torch.Tensor, scale: float,
                    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sparse decode row's far part of `layer`, device work only: (out [1, H, D], lse [1, H],
    ids [k]), float32. q [1, H, D]; num_far: int64 0-d, its far blocks (all summarized, more than
    k); staging_slots, block_tokens: int64 [k] on the device (k = far.sparse_blocks). packed: a
    quantized CPU tier's buffers (`packed_buffers`): the selected blocks' codes and scales are
    copied there and dequantized into staging (half the PCIe bytes at fp8 or int8)."""
    ids = req.summaries.select_masked(layer, q[0], num_far, far.sparse_blocks)
    slots = req.pinned_slots_dev[layer].index_select(0, ids)
    cpu, engine = far.store.cpu, far.store.io.engine
    if cpu.quant_format is None:
        engine.gather_h2d_inline(cpu.slab, slots, staging, staging_slots)
    else:
        codes, scales, order = packed
        engine.gather_h2d_inline(cpu.slab, slots, codes, order)
        engine.gather_h2d_inline(cpu.scales, slots, scales, order)
        dequantize_into(codes, scales, cpu.quant_format, staging, staging_slots)
    out, lse = paged_partial_attention(q, staging, staging_slots, ids * far.block_tokens, block_tokens, scale=scale)
    return out, lse, ids


@dataclass
class _Graph:
    key: tuple              # what it baked in: the summary table and pinned-slot buffer (address, size), scale
    graph: torch.cuda.CUDAGraph
    q: torch.Tensor         # static inputs: the query [1, H, D] and the far count (int64 0-d)
    num_far: torch.Tensor
    out: torch.Tensor       # static outputs, valid until the next replay
    lse: torch.Tensor
    ids: torch.Tensor
    far_count: int          # the value num_far holds


class SparseRowGraphs:
    def __init__(self, far):
        """far: the engine's FarKV (sparse policy, CUDA, a copy-kernel engine)."""
        self.far = far
        streamer = far.sparse_streamer
        self.staging = streamer.pool.staging
        k = far.sparse_blocks
        region = streamer.pool.region_slots(0)
        self.staging_slots = (torch.arange(region.start, region.start + k, device=self.staging.device)
                              if len(region) >= k else None)  # a selection must fit one region
        self.block_tokens = streamer.full_blocks(far.block_tokens)[:k]
        self.packed = packed_buffers(far, self.staging.device)  # quantized CPU tier: codes and scales land here
        self.graphs: dict[tuple[str, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.side_stream = torch.cuda.Stream(self.staging.device)  # captures run here
        self.enabled = self.staging_slots is not None
        self.counts = {"graph_captures": 0, "graph_replays": 0, "graph_capture_errors": 0}

    @staticmethod
    def usable(far) -> bool:
        store = far.store
        return (far.sparse_blocks is not None and far.sparse_streamer is not None and store.device.type == "cuda"
                and store.io.engine.backend in ("cupy", "adaptive"))

    def attend(self, req_id: str, req, layer: int, q_row: torch.Tensor, num_far: int,
               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(out [1, H, D], lse [1, H], ids) of one decoding row's far part by its graph: static
        tensors, read them before this row's next step (`FarKV.attend_into` merges them with the
        near part in one launch). None when the eager path must serve it."""
        summaries = req.summaries
        if (not self.enabled or summaries is None or num_far > summaries.prefix[layer]
                or num_far <= self.far.sparse_blocks):
            return None
        table, slots = summaries.summaries.tables[layer], req.pinned_slots_dev[layer]
        key = (table.data_ptr(), table.shape[0], slots.data_ptr(), slots.numel(), scale)
        entry = self.graphs.get((req_id, layer))
        if entry is None or entry.key != key:
            entry = self._capture(req, layer, q_row, num_far, key, scale)
            if entry is None:
                return None
            self.graphs[(req_id, layer)] = entry
        entry.q.copy_(q_row)
        if entry.far_count != num_far:  # changes once per block of decoded tokens: a launch saved otherwise
            entry.num_far.fill_(num_far)
            entry.far_count = num_far
        entry.graph.replay()
        self.counts["graph_replays"] += 1
        return entry.out, entry.lse, entry.ids

    def _capture(self, req, layer: int, q_row: torch.Tensor, num_far: int, key: tuple, scale: float) -> _Graph | None:
        q = q_row.clone()
        far_count = torch.full((), num_far, dtype=torch.int64, device=q.device)

        def body():
            return sparse_row_body(self.far, req, layer, q, far_count, self.staging, self.staging_slots,
                                   self.block_tokens, scale, self.packed)

        if not self.graphs:  # every graph of the pool freed (requests finished): the pool is gone
            self.pool = torch.cuda.graph_pool_handle()
        current, side = torch.cuda.current_stream(), self.side_stream
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                first = body()  # first run outside the capture: kernels built, workspaces set
            outputs = [torch.empty_like(t) for t in first]  # outside the pool, on the compute stream
            with torch.cuda.stream(side):
                # capture_begin/end rather than torch.cuda.graph, which synchronizes and empties the
                # allocator's cache on entry: captures recur while a long request's tables grow
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    for output, result in zip(outputs, body()):
                        output.copy_(result)
                finally:
                    graph.capture_end()
            current.wait_stream(side)
            out, lse, ids = outputs
        except Exception:  # the eager path serves every row from now on; nothing was returned from here
            current.wait_stream(side)
            logger.exception("tierkv hot window: capturing a sparse decode graph failed; sparse rows run eagerly")
            self.enabled = False
            self.graphs.clear()
            self.counts["graph_capture_errors"] += 1
            return None
        self.counts["graph_captures"] += 1
        return _Graph(key, graph, q, far_count, out, lse, ids, num_far)

    def forget(self, req_id: str) -> None:
        """Drop a finished request's graphs."""
        for key in [k for k in self.graphs if k[0] == req_id]:
            del self.graphs[key]

    def stats(self) -> dict:
        return {**self.counts, "graphs": len(self.graphs), "graphs_enabled": self.enabled}
