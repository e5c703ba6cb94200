"""The transformers engine's one-token decode step, replayed from one CUDA graph.

Primitives: `DecodeStep` (call it with the next token: the logits after it).

A sparse decode step with predictor 'cache' does about 12 ms of GPU work at 128k on the H200, but
the eager step costs three to four times that in host time: the model's launches and tierkv's, some
1,800 per step. Between two steps that complete a block, what changes from one step to the next
is only device values:

    varies every step                    in the graph
    token id, its position               static input_ids, position_ids (written before the replay)
    where the new K/V go                 index_copy_ into the partial block's GPU slot at rows read
                                         from the device (`GraphStep.kv_rows`)
    the partial block's fill             one paged attention over the resident blocks and the
                                         partial block, token counts read from the device
    the far part                         predictor 'cache''s sparse step (its inputs are device
                                         buffers already: far count, caches, summaries, slot lists)

So the step is captured once (per sequence, block layout and far-part buffers) and then replayed:
the host writes one small int64 buffer and launches the graph. A step that completes a block (it
saves the block to the CPU tier and slides the window), the prefill, and every step after a failed
capture run eagerly through the model, as without graphs; they give the same result.

The capture runs the step once to build kernels, then records it; what that first run did to the
far-block caches and their counters is put back, so the replay right after, with the same token,
selects, evicts, copies and counts as an eager step would. The K/V write repeats the same values. Graphs draw on one
memory pool per `DecodeStep`; the logits are copied out right after each replay.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tierkv.engine.graph_step import GraphStep
from tierkv.transfer.device import to_device_no_sync
from tierkv.sparse.graph_capture import no_gc

logger = logging.getLogger(__name__)

GRAPHS_KEPT = 3  # captured step layouts kept per DecodeStep (the window filling up, a far part appearing)


@dataclass
class _Inputs:
    """A graph's static inputs: one int64 buffer [2 + 2H + 3 (R + 1)], written once per step, and its views."""

    buffer: torch.Tensor
    input_ids: torch.Tensor     # [1, 1]
    position_ids: torch.Tensor  # [1, 1]
    kv_rows: torch.Tensor       # [2H]
    block_slots: torch.Tensor   # [R + 1]: the resident blocks' slots, then the partial block's
    block_starts: torch.Tensor  # [R + 1]
    block_fills: torch.Tensor   # [R + 1]
    row_inputs: list            # per layer, the far part's static row inputs (`CachedSparse.graph_row_inputs`)

    @classmethod
    def empty(cls, num_kv_heads: int, num_blocks: int, row_inputs: list, device: torch.device) -> "_Inputs":
        buffer = torch.zeros(2 + 2 * num_kv_heads + 3 * num_blocks, dtype=torch.int64, device=device)
        rows_end = 2 + 2 * num_kv_heads
        lists = buffer[rows_end:].view(3, num_blocks)
        return cls(buffer, buffer[0:1].view(1, 1), buffer[1:2].view(1, 1), buffer[2:rows_end], lists[0], lists[1],
                   lists[2], row_inputs)

    def write(self, step: GraphStep, token: int, num_kv_heads: int, block_tokens: int) -> None:
        values = [token, step.t0, *step.kv_rows(num_kv_heads, block_tokens), *step.block_slots, *step.block_starts,
                  *step.block_fills]
        self.buffer.copy_(to_device_no_sync(values, self.buffer.device), non_blocking=True)


@dataclass
class _Entry:
    inputs: _Inputs
    graph: torch.cuda.CUDAGraph | None = None  # None: the graphed forward runs eagerly (`capture=False`)
    logits: torch.Tensor | None = None         # the graph's static output [1, 1, vocab]


class DecodeStep:
    def __init__(self, model, cache, capture: bool | None = None):
        """model: a transformers causal LM using the "tierkv" attention; cache: its `TieredCache`.
        capture: record and replay CUDA graphs (default: on CUDA with a copy-kernel transfer backend,
        scheduler.decode_cuda_graph true, predictor 'cache'); False runs the graphed forward eagerly
        (what the CPU tests check against the plain step)."""
        from tierkv.integrations.hf import forward_kwargs

        self.model, self.cache = model, cache
        self.kwargs = forward_kwargs(model, cache)
        rt = cache.seq.rt
        self.rt = rt
        cached = rt.cached_sparse if rt.config.scheduler.predictor == "cache" else None
        graphs_usable = cached is not None and cached.graphs is not None  # CUDA and a copy-kernel backend
        self.capture = (rt.config.scheduler.decode_cuda_graph and graphs_usable) if capture is None else capture
        self.enabled = cached is not None and rt.config.scheduler.policy == "sparse" and (
            capture is False or self.capture)
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.pool = None
        self.side_stream = torch.cuda.Stream(rt.device) if self.capture else None
        self.counts = rt.decode_graph_counts

    @torch.no_grad()
    def __call__(self, token: int) -> torch.Tensor:
        """Decode `token` (already appended to the sequence's token ids by the caller, if it keeps
        them): the logits after it, [vocab], a tensor of their own."""
        seq = self.cache.seq
        step = GraphStep.begin(seq) if self.enabled else None
        if step is None:
            return self._eager(token)
        entry = self._entry(step, token)
        if entry is None:  # the capture failed: this step and the rest run eagerly
            step.end(done=False)
            return self._eager(token)
        step.inputs = entry.inputs
        layout = self.rt.layout
        entry.inputs.write(step, token, layout.num_kv_heads, layout.block_tokens)
        self.counts["graph_steps"] += 1
        if entry.graph is None:
            logits = self._forward(entry.inputs)
        else:
            entry.graph.replay()
            logits = entry.logits
            self.counts["replays"] += 1
        step.end()
        return logits[0, -1].clone()

    def _eager(self, token: int) -> torch.Tensor:
        self.counts["eager_steps"] += 1
        ids = torch.tensor([[token]], device=self.rt.device)
        return self.model(ids, logits_to_keep=1, **self.kwargs).logits[0, -1]

    def _forward(self, inputs: _Inputs) -> torch.Tensor:
        return self.model(inputs.input_ids, position_ids=inputs.position_ids, logits_to_keep=1, **self.kwargs).logits

    def _key(self, step: GraphStep) -> tuple:
        """What a graph bakes in: the block count, the pools' and far part's buffers."""
        rt = self.rt
        return (len(step.block_slots), rt.pool.resident.data_ptr(), rt.pool.staging.data_ptr(),
                rt.cached_sparse.graph_key())

    def _entry(self, step: GraphStep, token: int) -> _Entry | None:
        key = self._key(step)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry
        if len(self.entries) >= GRAPHS_KEPT:
            self.entries.popitem(last=False)
        inputs = _Inputs.empty(self.rt.layout.num_kv_heads, len(step.block_slots),
                               self.rt.cached_sparse.graph_row_inputs(), self.rt.device)
        entry = _Entry(inputs)
        if self.capture and not self._record(step, token, entry):
            return None
        self.entries[key] = entry
        return entry

    def _record(self, step: GraphStep, token: int, entry: _Entry) -> bool:
        """Run the step's forward once, then capture it into entry (False if the capture failed: logged,
        counted, graphs off for this DecodeStep). The far-block caches and counters are put back after: the
        replay that follows, with the same token, makes the same selections, evictions and copies again."""
        cached = self.rt.cached_sparse
        saved = cached.caches.snapshot()
        counted = cached.prefetch.counters.clone() if cached.prefetch is not None else None
        if not self.entries:  # every graph of the pool freed: a new pool
            self.pool = torch.cuda.graph_pool_handle()
        step.inputs = entry.inputs
        layout = self.rt.layout
        entry.inputs.write(step, token, layout.num_kv_heads, layout.block_tokens)
        current, side = torch.cuda.current_stream(), self.side_stream
        side.wait_stream(current)
        start = time.perf_counter()
        try:
            with torch.cuda.stream(side):
                self._forward(entry.inputs)  # kernels built, workspaces set
                graph = torch.cuda.CUDAGraph()
                with no_gc():
                    graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        logits = self._forward(entry.inputs)
                    finally:
                        graph.capture_end()
            current.wait_stream(side)
        except Exception:
            current.wait_stream(side)
            logger.exception("tierkv: capturing the decode step failed; decode steps run eagerly from now on")
            self.enabled = False
            self.counts["capture_errors"] += 1
            return False
        finally:
            cached.caches.restore(saved)
            if counted is not None:
                cached.prefetch.counters.copy_(counted)
            self.counts["capture_s"] += time.perf_counter() - start
        entry.graph, entry.logits = graph, logits
        self.counts["captures"] += 1
        return True
