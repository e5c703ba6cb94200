"""The lookahead streamer: copies non-resident blocks of layers L+1..L+d while layer L computes.

Primitives: `LookaheadStreamer` (`plan`, `run`, `chunks_for_layer`, `fetch_now`), `StagedChunk`.

Which chunk goes to which staging region, and when its copy may be issued, is decided on the host
by `tierkv.scheduler.staging_ring.ChunkRing`; this module does it: the copies, the events that
order them against attention, and the device tensors attention reads.

`run()` only enqueues copies (no host sync); `chunks_for_layer(L)` makes the compute stream
wait on each chunk's copy and nothing else. A chunk that was not copied ahead of its
attention is copied at once and counted as a stall: results never depend on the prefetch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from tierkv.scheduler.plan import StepPlan
from tierkv.scheduler.staging_ring import ChunkRing
from tierkv.storage.gpu import GpuBlockPool
from tierkv.transfer.device import to_device_no_sync


@dataclass
class StagedChunk:
    slots: torch.Tensor        # int64 [n] staging slots holding the chunk, on device
    start_pos: torch.Tensor    # int64 [n] position of each block's first token, on device
    num_tokens: torch.Tensor   # int64 [n] all block_tokens (streamed blocks are full)


class LookaheadStreamer:
    def __init__(self, io, pool: GpuBlockPool, lookahead_layers: int, recorder=None):
        """io: a `tierkv.block_io.BlockIO` (CPU tier to device copies; its engine owns the streams).
        `recorder`: an optional `tierkv.metrics.prefetch.PrefetchRecorder` told of every chunk."""
        self.io = io
        self.engine = io.engine
        self.recorder = recorder
        self.pool = pool
        self.lookahead_layers = lookahead_layers
        device = pool.staging.device
        # Copy destinations stay host tensors (the engine stages them), attention reads device copies.
        self._region_slots_host = [torch.tensor(list(pool.region_slots(r)), dtype=torch.int64) for r in range(pool.num_regions)]
        self._region_slots = [to_device_no_sync(s, device) for s in self._region_slots_host]
        self._full_blocks_cached: tuple[torch.Tensor, int] | None = None
        self.num_stalls = 0
        self.num_chunks_streamed = 0
        self.bytes_streamed = 0
        self.num_chunks_carried = 0     # next-step chunks copied during the last layer and used
        self.num_chunks_discarded = 0   # ... and not used (the next step's plan differed)
        self.bytes_discarded = 0        # their bytes (counted in bytes_streamed too: they crossed PCIe)
        # Kept across steps: the first copies of a step wait until the previous step's attention
        # has read the region they overwrite.
        self._region_free_event: list = [None] * self.pool.num_regions
        self._carried: list[tuple[int, range, torch.Tensor, object]] = []  # (layer, blocks, src slots, handle)
        self._is_decode = False
        self._ring = ChunkRing(pool.num_regions, pool.region_blocks)
        self._chunk_meta_key: tuple | None = None
        self._chunk_meta_cached: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._reset()

    COUNTERS = ("num_stalls", "num_chunks_streamed", "bytes_streamed", "num_chunks_carried", "num_chunks_discarded",
                "bytes_discarded")

    def carry_counts(self, previous: "LookaheadStreamer") -> None:
        """Count on from `previous` (the streamer this one replaces over a re-made staging ring)."""
        for name in self.COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(previous, name))

    def _reset(self) -> None:
        self._ring.clear()
        self._cpu_slots: list[torch.Tensor] = []
        self._handles: list = []
        self._chunk_meta: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._after = None

    def plan(self, step: StepPlan, cpu_slots_per_layer: list[torch.Tensor], block_tokens: int, after=None) -> None:
        """Host only: lay out this step's chunks.

        cpu_slots_per_layer[layer]: int64 [len(step.streamed_blocks)] CPU-tier slots of the
        streamed blocks, in block order. `after`: what every copy waits for (e.g. the last D2H).
        """
        self._reset()
        self._after = after
        streamed = step.streamed_blocks
        self._ring.lay_out(streamed, len(cpu_slots_per_layer))
        device = self.pool.staging.device
        # (start_pos, num_tokens) of each chunk of a layer; the staging region is chosen per chunk.
        # Read-only on the device, so a step with the same chunks (most decode steps) reuses them.
        meta_key = (streamed.start, streamed.stop, self.pool.region_blocks, block_tokens)
        if meta_key != self._chunk_meta_key:
            self._chunk_meta_key = meta_key
            self._chunk_meta_cached = [
                (to_device_no_sync(torch.arange(r.start, r.stop) * block_tokens, device),
                 to_device_no_sync(torch.full((len(r),), block_tokens), device))
                for r in self._ring.block_ranges
            ]
        self._chunk_meta = self._chunk_meta_cached
        self._cpu_slots = cpu_slots_per_layer
        self._handles = [None] * len(self._ring.chunks)
        self._is_decode = step.num_new_tokens == 1
        self._adopt_carried()

    def _adopt_carried(self) -> None:
        """Use the chunks copied ahead at the end of the last step where this plan wants the same
        blocks from the same CPU slots (a prefix of its chunks); the rest are superseded: later
        copies into their regions queue behind them on the same copy stream."""
        carried, self._carried = self._carried, []
        for g, (layer, blocks, src, handle) in enumerate(carried):
            if (g >= len(self._ring.chunks) or self._ring.chunks[g] != (layer, blocks)
                    or not torch.equal(self._cpu_slots[layer][blocks.start : blocks.stop], src)):
                self._discard(carried[g:])
                return
            self._handles[g] = handle
            self._ring.num_issued = g + 1
            self.num_chunks_carried += 1

    def _carry_into_next_step(self) -> None:
        """After the last layer's chunks of a decode step: copy the first chunks (one per staging
        region) of the same plan, which the next decode step reads again unless the window moved,
        so the copy stream does not idle while the host finishes this step and starts the next."""
        self._carried = []
        for g in range(min(self.pool.num_regions, len(self._ring.chunks))):
            layer, blocks = self._ring.chunks[g]
            src = self._cpu_slots[layer][blocks.start : blocks.stop]
            # only the region's previous reader to wait for: these blocks were streamed this step
            self._carried.append((layer, blocks, src, self._gather_chunk(g, waits_for_plan=False)))

    @property
    def chunks_per_layer(self) -> int:
        return len(self._chunk_meta)

    def run(self, through_layer: int) -> None:
        """Enqueue copies for chunks of layers <= through_layer while a staging region is free."""
        while (g := self._ring.next_to_issue(through_layer)) is not None:
            self._issue(g)
            self._ring.num_issued += 1

    def _issue(self, g: int) -> None:
        self._handles[g] = self._gather_chunk(g, waits_for_plan=True)

    def _gather_chunk(self, g: int, *, waits_for_plan: bool):
        """Enqueue chunk g's copy into its staging region once the region's last reader is done
        (and, with `waits_for_plan`, once the plan's `after` has happened); counted as streamed."""
        layer, blocks = self._ring.chunks[g]
        region = self._ring.region_of(g)
        waits = (self._region_free_event[region], self._after if waits_for_plan else None)
        handle = self.io.gather(self._cpu_slots[layer][blocks.start : blocks.stop], self.pool.staging,
                                self._region_slots_host[region][: len(blocks)], after=[e for e in waits if e is not None])
        self.num_chunks_streamed += 1
        self.bytes_streamed += handle.num_bytes
        return handle

    def wait_for_chunk(self, handle, layer: int, *, is_late: bool, host_wait_s: float | None) -> None:
        """Make the current stream wait for a chunk's copy and report the chunk to the recorder.

        On CUDA the wait is timed by the GPU: two events bracket the stream's wait, the second
        completing once the copy has landed. On a CPU engine the copy ran synchronously and
        `host_wait_s` (the caller's host time for it, or None where it was not late) is the wait.
        """
        if self.recorder is not None and self.engine.device.type == "cuda":
            start_event, end_event = self.recorder.chunk_wait_events()
            start_event.record()
            handle.wait_on_current_stream()
            end_event.record()
            self.recorder.record_chunk_timed(layer, is_late=is_late, start=start_event, end=end_event)
            return
        if self.recorder is not None:
            self.recorder.record_chunk(layer, is_late=is_late, wait_s=host_wait_s)
        handle.wait_on_current_stream()

    def clear(self) -> None:
        """Forget the current plan (a step that streams nothing ahead, e.g. a sparse decode step)."""
        self._discard(self._carried)
        self._carried = []
        self._reset()

    def _discard(self, carried: list) -> None:
        self.num_chunks_discarded += len(carried)
        self.bytes_discarded += sum(handle.num_bytes for *_, handle in carried)

    def fetch_now(self, layer: int, cpu_slots: torch.Tensor, start_pos: list[int] | torch.Tensor, block_tokens: int,
                  after=None) -> Iterator[StagedChunk]:
        """Blocks nobody predicted: copy them now, a staging region at a time, each piece a stall.

        cpu_slots: int64 [n] CPU-tier slots, on the CPU or on the device (then the copy kernel
        reads them there and the host never waits); start_pos: first token position of each
        block, a list or an int64 tensor on the device.
        """
        device = self.pool.staging.device
        region_blocks = self.pool.region_blocks
        for piece, start in enumerate(range(0, cpu_slots.numel(), region_blocks)):
            region = self._ring.region_of(piece)
            count = min(region_blocks, cpu_slots.numel() - start)
            waits = [e for e in (self._region_free_event[region], after, self.engine.record_compute_event()) if e is not None]
            start_s = time.perf_counter()
            staging_slots = (self._region_slots if cpu_slots.is_cuda else self._region_slots_host)[region][:count]
            handle = self.io.gather(cpu_slots[start : start + count], self.pool.staging, staging_slots, after=waits)
            self.num_stalls += 1
            self.num_chunks_streamed += 1
            self.bytes_streamed += handle.num_bytes
            self.wait_for_chunk(handle, layer, is_late=True, host_wait_s=time.perf_counter() - start_s)
            positions = (start_pos[start : start + count] if isinstance(start_pos, torch.Tensor)
                         else to_device_no_sync(start_pos[start : start + count], device))
            yield StagedChunk(self._region_slots[region][:count], positions, self.full_blocks(block_tokens)[:count])
            self.engine.release_event(self._region_free_event[region])
            self._region_free_event[region] = self.engine.record_compute_event()

    def full_blocks(self, block_tokens: int) -> torch.Tensor:
        """int64 [region_blocks] of `block_tokens` on the device (the token counts of full blocks),
        made once; read-only."""
        if self._full_blocks_cached is None or self._full_blocks_cached[1] != block_tokens:
            tokens = torch.full((self.pool.region_blocks,), block_tokens, dtype=torch.int64, device=self.pool.staging.device)
            self._full_blocks_cached = (tokens, block_tokens)
        return self._full_blocks_cached[0]

    def chunks_for_layer(self, layer: int) -> Iterator[StagedChunk]:
        """Each streamed chunk of `layer`, ready to read on the current stream once yielded."""
        per_layer = self.chunks_per_layer
        for c in range(per_layer):
            g = self._ring.chunk_index(layer, c)
            is_late = g >= self._ring.num_issued
            wait_s = None
            if is_late:  # not prefetched: fetch now and count it
                self.num_stalls += 1
                start = time.perf_counter()
                self.run(through_layer=layer)
                if self.engine.device.type == "cpu":  # the copy ran synchronously: its time is the stall
                    wait_s = time.perf_counter() - start
            self.wait_for_chunk(self._handles[g], layer, is_late=is_late, host_wait_s=wait_s)
            start_pos, num_tokens = self._chunk_meta[c]
            region = self._ring.region_of(g)
            yield StagedChunk(self._region_slots[region][: num_tokens.numel()], start_pos, num_tokens)
            self.engine.release_event(self._region_free_event[region])
            self._region_free_event[region] = self.engine.record_compute_event()
            self._ring.num_consumed += 1
            self.run(through_layer=layer + self.lookahead_layers)
        if self._is_decode and layer == len(self._cpu_slots) - 1 and per_layer:
            self._carry_into_next_step()
