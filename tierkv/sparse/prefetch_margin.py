"""Next-step prefetch of the full decode graph's sparse rows: each layer also copies in the far blocks
ranked just below its selection, on a side stream, so the next step finds them in the request's
far-block cache.

Primitives: `MarginPrefetch` (`rank`, `after_selection`, `join`, `stats`), `check_margin`,
`precision_recall`.

Consecutive decode steps select mostly the same blocks; what a step adds is mostly what the step
before ranked just below its top-k (the bound of q . k moves a little between steps). With
`scheduler.sparse_prefetch_margin` m, after a layer's selection (k blocks, placed and attended as
before), per row:

    margin ids   ranks k .. k+m-1 of the same scores (ids past the row's far count: none)
    placement    into the row's cache set of the layer, least recently used slot first; the
                 selection's k slots were stamped last, so with C >= k + m slots (`check_margin`)
                 no block the step reads is replaced
    copy         the margin blocks the set did not hold, CPU tier -> their slots (a quantized
                 tier: codes and scales into buffers of the prefetch's own, then dequantized),
                 on a side stream that waits for the layer's work and runs beside the next
                 layers; the last layer of the forward joins it (`join`)

A block the next step selects and the margin fetched is a hit there; a selected block neither
held nor fetched is still fetched at selection (a stall), so the output never depends on the
prediction. The caches mark the slots the margin fills until a selection reads them, which gives
the prefetch's precision and recall (`stats`).

The ranking is one top-k of width k + m (`rank`): its first k are the selection. The placement and
the copy sources run on the compute stream (the sets' clocks are shared by the layers); what the
side stream reads is in buffers of its own per layer, so the next layers' work never overwrites it.
Without CUDA the copy runs at once.
"""
from __future__ import annotations

import torch

from tierkv.block_io import dequantize_into
from tierkv.config import ConfigError
from tierkv.sparse.far_source import FarSource
from tierkv.sparse.step import copy_sources_of


def check_margin(margin: int, k: int, slots_per_layer: int, per_layer: bool) -> None:
    """scheduler.sparse_prefetch_margin `margin` must fit beside a selection of k blocks in a cache
    set's slots per layer, so that a prefetched block never replaces one the step reads."""
    key = "scheduler.sparse_prefetch_margin"
    if margin < 0:
        raise ConfigError(key, margin, "blocks per layer, 0 or more")
    if margin == 0:
        return
    if not per_layer:
        raise ConfigError(key, margin, "the far-block caches keep nothing across steps here (scheduler.staging_bytes "
                          "too small for them, see the warning above, or scheduler.sparse_cache_selections 0); raise "
                          "staging_bytes or set the margin to 0")
    if k + margin > slots_per_layer:
        raise ConfigError(key, margin, f"a cache set holds {slots_per_layer} blocks per layer, and a selection of {k} "
                          f"blocks plus the margin needs {k + margin}; raise scheduler.sparse_cache_selections to "
                          f"{-(-(k + margin) // k)} or lower the margin to {slots_per_layer - k}")


def precision_recall(used: int, copied: int, misses: int) -> tuple[float | None, float | None]:
    """The prefetch's precision, used / copied, and recall, used / (used + the selections' misses):
    the part of what the selections would otherwise have fetched that it brought in time (None where
    nothing was counted)."""
    return (used / copied if copied else None), (used / (used + misses) if used + misses else None)


class MarginPrefetch:
    def __init__(self, source: FarSource, caches, margin: int, max_rows: int):
        """source: the engine's far blocks; caches: its RowCaches (per layer, at least k + margin slots);
        margin: blocks per layer and row; max_rows: the most rows of a step."""
        check_margin(margin, source.sparse_blocks, caches.width if caches is not None else 0,
                     caches is not None and caches.per_layer)
        device = source.device
        self.source, self.caches, self.margin = source, caches, margin
        num_layers, cpu = source.num_layers, source.cpu
        # per layer: the CPU-tier slot of each margin block to copy (-1: none) and its cache slot (-1: none)
        self.sources = torch.full((num_layers, max_rows * margin), -1, dtype=torch.int64, device=device)
        self.targets = torch.full_like(self.sources, -1)
        self.codes = self.scales = None
        if cpu.quant_format is not None:  # one layer's codes and scales at a time (the side stream runs in order)
            self.codes = torch.empty((max_rows * margin, *cpu.slab.shape[1:]), dtype=cpu.slab.dtype, device=device)
            self.scales = torch.empty((max_rows * margin, *cpu.scales.shape[1:]), dtype=cpu.scales.dtype,
                                      device=device)
            self._order = torch.arange(max_rows * margin, device=device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # margin blocks already held, copied in, rows that copied any (on the device until `stats`)
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)
        self._forked = False

    def rank(self, scores: torch.Tensor) -> torch.Tensor | None:
        """The k + margin highest-scoring blocks of each row of scores [m, blocks] (float32, blocks past
        a row's far count masked), highest first: int64 [m, min(k + margin, blocks)]. Its first k are
        the selection (the same blocks as `tierkv.sparse.top_blocks`, in score order), the rest the
        margin: one top-k for both. None when no block lies below the selection."""
        width = min(self.source.sparse_blocks + self.margin, scores.shape[1])
        return torch.topk(scores, width, dim=1, sorted=True).indices if width > self.source.sparse_blocks else None

    def after_selection(self, reqs: list, layer: int, ranked: torch.Tensor, num_far: torch.Tensor,
                        sets: torch.Tensor, lists: torch.Tensor | None) -> None:
        """After the layer's selection, the first k of `ranked` (`rank`'s): place and copy each row's
        margin blocks, the rest of it (device work only; the copy on the side stream)."""
        k = self.source.sparse_blocks
        margin = ranked[:, k:]
        ids = torch.where(margin < num_far.unsqueeze(1), margin, -1)
        slots, miss = self.caches.place_rows([req.cache for req in reqs], sets, layer, ids, self.counters,
                                             prefetch=True)
        count = margin.numel()
        sources, targets = self.sources[layer, :count], self.targets[layer, :count]
        sources.copy_(copy_sources_of(reqs, layer, ids, miss, lists).view(-1))
        targets.copy_(torch.where(miss, slots, -1).view(-1))
        if self.stream is None:
            self._copy(sources, targets)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self._copy(sources, targets)
        self._forked = True

    def _copy(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """The blocks at `sources` (CPU-tier slots, -1: none) into the caches' `targets` slots."""
        cpu, engine, blocks = self.source.cpu, self.source.engine, self.caches.blocks
        if self.codes is None:
            engine.gather_h2d_inline(cpu.slab, sources, blocks, targets)
            return
        count = sources.numel()
        order = self._order[:count]
        engine.gather_h2d_inline(cpu.slab, sources, self.codes, order)
        engine.gather_h2d_inline(cpu.scales, sources, self.scales, order)
        dequantize_into(self.codes[:count], self.scales[:count], cpu.quant_format, blocks, targets)

    def join(self) -> None:
        """The compute stream waits for every copy forked since the last join (the forward's last layer)."""
        if self._forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._forked = False

    def stats(self) -> dict:
        """The counters, read from the device (one sync). Of the blocks the margin copied in, those a
        later selection read before they were replaced (`prefetch_used`): precision = used / copied;
        recall = used / (used + the selections' misses), the part of what the selections would
        otherwise have fetched that the prefetch brought in time."""
        held, copied, rows, used, misses = torch.cat(
            [self.counters, self.caches.prefetch_used, self.caches.counters[1:2]]).tolist()
        precision, recall = precision_recall(used, copied, misses)
        return {"prefetch_margin": self.margin, "prefetch_held": held, "prefetch_copied": copied,
                "prefetch_rows_copied": rows, "prefetch_used": used,
                "prefetch_precision": precision, "prefetch_recall": recall}
