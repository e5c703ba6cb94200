"""Key summaries of one request's blocks under the hot window's sparse policy, and the selection.

Primitives: `RequestSummaries` (`update`, `put`, `reset`, `select`, `unsummarized`, `num_bytes`),
`summary_bytes_per_request`, `KeySummaries` (`summarize`, `select`, `is_selectable`, `summarize_staged`,
`summarize_missing`, `release`), `SelectionOverlap` (`samples`, `note`, `value`).

Per layer the device holds each block's elementwise key min and max (`tierkv.sparse.BlockSummaries`,
filled from the copies the connector saves), and which blocks have one, on the host and on the
device. A decoding row attends

    every far block without a summary (a prefix served by the tiers, never computed here)
  + the k summarized far blocks with the largest upper bound of q . k

so a block is never dropped for lack of a summary; with k covering them, all far blocks.
(`FarKV` summarizes such blocks before it selects: a row missing more than a selection's worth is
streamed exactly, and the streamed chunks leave them; a few are fetched and summarized.)
"""
from __future__ import annotations

import numpy as np
import torch

from tierkv.transfer.device import to_device_no_sync
from tierkv.sparse.summaries import BlockSummaries, key_bounds, top_blocks

OVERLAP_EVERY = 32  # steps between samples of the selection overlap (a sampled step and the one before it
#   cost about 2.5 and 0.5 ms more at 32 layers: the comparison and the copy are launches per layer)


class RequestSummaries:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_blocks: int | None = None, bound_weight: float = 1.0):
        """max_blocks: the blocks of the longest request (tables never grow past it); bound_weight: the
        selection score's (`BlockSummaries`)."""
        self.device = device
        self.summaries = BlockSummaries(num_layers, num_kv_heads, head_dim, dtype, device, max_blocks, bound_weight)
        # which blocks have a summary, per layer and block: rows of one host array and of one device
        # tensor (so every layer's flags are set in one fill), as long as the tables' capacity
        self._flags = np.zeros((num_layers, 0), dtype=bool)
        self._flags_dev = torch.zeros((num_layers, 0), dtype=torch.bool, device=device)
        self.is_summarized, self.is_summarized_dev = list(self._flags), list(self._flags_dev.unbind(0))
        self.prefix = [0] * num_layers  # per layer: blocks [0, prefix) all have a summary (host-known)

    def update(self, layer: int, first: int, blocks: torch.Tensor) -> None:
        """blocks [n, 2, H, T, D] on the device: the request's blocks first..first+n-1 of `layer`."""
        if blocks.shape[0]:
            self.put(layer, first, key_bounds(blocks))

    def put(self, layers: int | range, first: int, bounds: torch.Tensor) -> None:
        """The summaries (`tierkv.sparse.key_bounds`) of the request's blocks first.. of layer `layers`,
        bounds [n, H, 2D]; of consecutive layers `layers` (a range), bounds [len(layers), n, H, 2D]:
        one copy and one fill on the device whatever the number of layers."""
        self.summaries.put(layers, first, bounds)
        end = first + bounds.shape[-3]
        if self._flags.shape[1] < self.summaries.capacity:
            self._grow_flags(self.summaries.capacity)
        rows = range(layers, layers + 1) if isinstance(layers, int) else layers
        self._flags[rows.start : rows.stop, first:end] = True
        self._flags_dev[rows.start : rows.stop, first:end].fill_(True)
        for at in rows:
            if first <= self.prefix[at] < end:
                gaps = np.flatnonzero(~self._flags[at, end:])
                self.prefix[at] = end + int(gaps[0]) if gaps.size else self._flags.shape[1]

    def _grow_flags(self, capacity: int) -> None:
        have = self._flags.shape[1]
        flags = np.zeros((self._flags.shape[0], capacity), dtype=bool)
        flags[:, :have] = self._flags
        flags_dev = torch.zeros((self._flags.shape[0], capacity), dtype=torch.bool, device=self.device)
        flags_dev[:, :have] = self._flags_dev
        self._flags, self._flags_dev = flags, flags_dev
        self.is_summarized, self.is_summarized_dev = list(flags), list(flags_dev.unbind(0))

    def reset(self) -> None:
        """No block has a summary any more (for another request). The tables keep their memory and
        addresses; their stale rows count nowhere: the selection reads a row only where `prefix` or
        `is_summarized` vouches for it, and the masked selection only below the far count."""
        self._flags[:] = False
        self._flags_dev.fill_(False)
        self.prefix = [0] * len(self.prefix)

    def select(self, layer: int, q: torch.Tensor, num_far: int, k: int) -> torch.Tensor:
        """q [num_heads, head_dim] -> int64 [m] far block indices on q's device, in block order.
        The common case, every far block summarized, reads no host array."""
        if num_far <= self.prefix[layer]:
            if k >= num_far:
                return torch.arange(num_far, device=q.device)
            return top_blocks(self.summaries.upper_bounds(layer, q, range(num_far)).unsqueeze(0), k)[0]
        missing = self.unsummarized(layer, num_far)
        if k >= num_far - missing.size:
            return torch.arange(num_far, device=q.device)
        covered = min(num_far, self.is_summarized[layer].size)  # the tables cover blocks [0, covered)
        scores = self.summaries.upper_bounds(layer, q, range(covered))
        scores = torch.where(self.is_summarized_dev[layer][:covered], scores, float("-inf"))
        chosen = torch.topk(scores, k, sorted=False).indices
        if missing.size:
            chosen = torch.cat([chosen, to_device_no_sync(missing.tolist(), q.device)])
        return torch.sort(chosen).values

    def unsummarized(self, layer: int, num_far: int) -> np.ndarray:
        """int64 indices of blocks [0, num_far) of `layer` without a summary, ascending (host)."""
        known = self.is_summarized[layer][:num_far]
        return np.concatenate([np.flatnonzero(~known), np.arange(known.size, num_far)])

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.summaries.tables)


def summary_bytes_per_request(max_model_len: int, block_tokens: int, num_layers: int, num_kv_heads: int,
                              head_dim: int, dtype_bytes: int) -> int:
    """GPU bytes of one request's key summaries at most: a key min and max per block, KV head and
    layer for the ceil(max_model_len / block_tokens) blocks its tables may hold (`FarKV` caps them
    there). 2 * num_kv_heads * head_dim * dtype_bytes / block_tokens bytes per token and layer."""
    return -(-max_model_len // block_tokens) * num_layers * 2 * num_kv_heads * head_dim * dtype_bytes


class KeySummaries:
    """The sparse policy's key summaries of a `FarKV`'s requests, kept up to date from three sources
    (the blocks the connector saves, the chunks streamed for a row, and blocks fetched because a row
    lacks a few), and the eager path's selection over them."""

    def __init__(self, far):
        """far: the engine's FarKV (its requests, store, staging and selection size)."""
        self.far = far
        self._spare: list[RequestSummaries] = []  # finished requests' (far.reuses_buffers), emptied

    def release(self, req) -> None:
        """A finished request's summaries go to the next request that needs some (emptied, their tables
        kept where they are)."""
        if req.summaries is not None:  # (the finished request object itself is dropped)
            req.summaries.reset()
            self._spare.append(req.summaries)

    @property
    def spare_bytes(self) -> int:
        """GPU bytes of the summaries kept for the next requests."""
        return sum(s.num_bytes for s in self._spare)

    def summarize(self, layers: int | range, spans, blocks: torch.Tensor) -> None:
        """Key min/max of blocks just saved, kept per request and block index: `blocks` [n, 2, H, T, D]
        on the device, the spans' blocks in order (`BlockSpan`s with req_id, block_ids, hashes), of
        layer `layers`; of consecutive layers `layers` (a range), blocks [len(layers), n, 2, H, T, D].
        The bounds of all the blocks are computed at once, then each run of a request's consecutive
        blocks is written in one copy: a block-completing step of many requests and layers costs a
        few device calls per request, not per request and layer."""
        bounds = key_bounds(blocks)
        offset = 0
        for span in spans:
            req = self.far.requests.get(span.req_id)
            n = len(span.block_ids)
            indices = [req.index.get(h) for h in span.hashes] if req is not None else [None] * n
            i = 0
            while i < n:  # runs of consecutive block indices, one update each
                if indices[i] is None:
                    i += 1
                    continue
                j = i + 1
                while j < n and indices[j] == indices[j - 1] + 1:
                    j += 1
                self._summaries_of(req).put(layers, indices[i], bounds[..., offset + i : offset + j, :, :])
                i = j
            offset += n

    def _summaries_of(self, req) -> RequestSummaries:
        """req's summaries, made (or taken from a finished request's) at its first update."""
        if req.summaries is None and self._spare:
            req.summaries = self._spare.pop()
        elif req.summaries is None:
            store = self.far.store
            layout = store.layout
            req.summaries = RequestSummaries(store.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                                             store.device, self.far.max_blocks, self.far.source.bound_weight)
        return req.summaries

    def _update(self, req, layer: int, first: int, blocks: torch.Tensor) -> None:
        """req's blocks first..first+n-1 of `layer` (blocks [n, 2, H, T, D])."""
        self._summaries_of(req).update(layer, first, blocks)

    def select(self, req, layer: int, q: torch.Tensor, num_far: int) -> torch.Tensor:
        """Far blocks a decoding row attends (`RequestSummaries.select`): int64 [m] on the device."""
        if req.summaries is None:  # nothing computed here: every far block
            return torch.arange(num_far, device=q.device)
        return req.summaries.select(layer, q, num_far, self.far.sparse_blocks)

    def is_selectable(self, row) -> bool:
        """A decoding row (a `FarRow`) selects when at most one selection's worth of its far blocks
        lacks a key summary in some layer (those are fetched and summarized first: window blocks
        vLLM loaded from the tiers, now far); with more (a prefix the tiers served) it streams
        exactly this once, and the streamed chunks leave the summaries. Host-known, no device read."""
        req = self.far.requests.get(row.req_id)
        summarized = min(req.summaries.prefix) if req is not None and req.summaries is not None else 0
        return row.num_far_blocks - summarized <= self.far.sparse_blocks

    def summarize_staged(self, row, layer: int, first_block: int, staging: torch.Tensor, slots: torch.Tensor) -> None:
        """Summarize a streamed piece (the row's far blocks first_block.. in `slots` of `staging`)
        unless each of its blocks has a summary (a prefix served by the tiers has none; the prefill
        or first decode step that streams it gives them, so the next steps can select)."""
        req = self.far.requests[row.req_id]
        if req.summaries is not None and req.summaries.prefix[layer] >= first_block + slots.numel():
            return
        self._update(req, layer, first_block, staging.index_select(0, slots))

    def summarize_missing(self, row, req, layer: int) -> None:
        """Fetch and summarize a decoding row's far blocks of `layer` that have no summary, so the
        selection ranks them with the rest (at most one selection's worth: blocks vLLM loaded into
        its window from the tiers, now far). Each piece counts as a stall."""
        far = self.far
        missing = (req.summaries.unsummarized(layer, row.num_far_blocks) if req.summaries is not None
                   else np.arange(row.num_far_blocks))
        slots = req.pinned_slots[layer][torch.from_numpy(missing)]
        fetcher, done = far.sparse_streamer, 0
        for chunk in fetcher.fetch_now(layer, slots, (missing * far.block_tokens).tolist(), far.block_tokens):
            ids = missing[done : done + chunk.slots.numel()]
            blocks = fetcher.pool.staging.index_select(0, chunk.slots)
            runs = np.flatnonzero(np.diff(ids) != 1) + 1  # starts of runs of consecutive blocks
            for a, b in zip([0, *runs], [*runs, ids.size]):
                self._update(req, layer, int(ids[a]), blocks[a:b])
            done += ids.size


class SelectionOverlap:
    """Of the blocks selected in a sampled step (every OVERLAP_EVERY steps), how many the same
    request and layer selected the step before: what a GPU cache of the last selection would hit.
    Counted on the device with elementwise ops (torch.isin may sort through a host-synchronizing
    unique); `value` reads the count."""

    def __init__(self, device: torch.device):
        self._hits = torch.zeros(1, dtype=torch.int64, device=device)
        self._of = 0

    @staticmethod
    def samples(step: int) -> bool:
        """Whether `note` reads step `step`'s selections (a sampled step, or the one before it)."""
        return step % OVERLAP_EVERY in (0, OVERLAP_EVERY - 1)

    def note(self, step: int, previous: dict[int, torch.Tensor], layer: int, ids: torch.Tensor,
             row: int | None = None, num_far: int | None = None) -> None:
        """Step `step`'s selection ids at `layer` (its row `row` when given: ids [m, k]) of a request
        whose sampled selections are `previous` (per layer): the step before a sample keeps a copy,
        the sampled step compares with it. num_far: the row's far blocks, when fewer than its ids
        (the rest are -1, no block, and count nowhere)."""
        if step % OVERLAP_EVERY == 0:
            before = previous.pop(layer, None)
            if before is not None:
                selected = ids if row is None else ids[row]
                same = (selected.unsqueeze(1) == before.unsqueeze(0)).any(dim=1)
                self._hits += (same & (selected >= 0)).sum()
                self._of += selected.numel() if num_far is None else min(num_far, selected.numel())
        elif (step + 1) % OVERLAP_EVERY == 0:
            previous[layer] = (ids if row is None else ids[row]).clone()

    def value(self) -> float | None:
        """The sampled overlap so far (reads the device count), None before any sample."""
        return self._hits.item() / self._of if self._of else None
