"""Key summaries of one request's blocks under the hot window's sparse policy, and the selection.

Primitives: `RequestSummaries` (`update`, `select`, `unsummarized`, `num_bytes`), `summary_bytes_per_request`,
`SelectionOverlap` (`note`, `value`).

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

from tierkv.scheduler.plan import to_device_no_sync
from tierkv.sparse import BlockSummaries

OVERLAP_EVERY = 32  # steps between samples of the selection overlap (a sampled step and the one before it
#   cost about 2.5 and 0.5 ms more at 32 layers: the comparison and the copy are launches per layer)


class RequestSummaries:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_blocks: int | None = None):
        """max_blocks: the blocks of the longest request (tables never grow past it)."""
        self.device = device
        self.summaries = BlockSummaries(num_layers, num_kv_heads, head_dim, dtype, device, max_blocks)
        self.is_summarized = [np.zeros(0, dtype=bool) for _ in range(num_layers)]                 # host, per layer
        self.is_summarized_dev = [torch.zeros(0, dtype=torch.bool, device=device) for _ in range(num_layers)]
        self.prefix = [0] * num_layers  # per layer: blocks [0, prefix) all have a summary (host-known)

    def update(self, layer: int, first: int, blocks: torch.Tensor) -> None:
        """blocks [n, 2, H, T, D] on the device: the request's blocks first..first+n-1 of `layer`."""
        self.summaries.update(layer, first, blocks)
        end = first + blocks.shape[0]
        have = self.is_summarized[layer]
        if end > have.size:
            capacity = self.summaries.tables[layer].shape[0]
            self.is_summarized[layer] = np.concatenate([have, np.zeros(capacity - have.size, dtype=bool)])
            grown = torch.zeros(capacity, dtype=torch.bool, device=self.device)
            grown[: have.size] = self.is_summarized_dev[layer]
            self.is_summarized_dev[layer] = grown
        self.is_summarized[layer][first:end] = True
        self.is_summarized_dev[layer][first:end].fill_(True)
        if first <= self.prefix[layer] < end:
            have = self.is_summarized[layer]
            gaps = np.flatnonzero(~have[end:])
            self.prefix[layer] = end + int(gaps[0]) if gaps.size else have.size

    def select(self, layer: int, q: torch.Tensor, num_far: int, k: int) -> torch.Tensor:
        """q [num_heads, head_dim] -> int64 [m] far block indices on q's device, in block order.
        The common case, every far block summarized, reads no host array."""
        if num_far <= self.prefix[layer]:
            if k >= num_far:
                return torch.arange(num_far, device=q.device)
            scores = self.summaries.upper_bounds(layer, q, range(num_far))
            return torch.sort(torch.topk(scores, k, sorted=False).indices).values
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

    def select_masked(self, layer: int, q: torch.Tensor, num_far: torch.Tensor, k: int) -> torch.Tensor:
        """`select` for a row whose far blocks all have a summary and number more than k, with the
        far count a device scalar (int64, 0-d) and the bound taken over the whole table, blocks at
        or past the count masked out: the shapes stay fixed while the count grows, so a CUDA graph
        replays it until the table is reallocated. In block order, as `select`: the attention
        kernel rounds its softmax weights to the KV dtype tile by tile, so another order gives
        results that differ from the eager path's at that rounding."""
        # top-k unsorted (one sort kernel fewer on CUDA: its order is replaced by block order anyway)
        return torch.sort(torch.topk(self.summaries.masked_bounds(layer, q, num_far), k, sorted=False).indices).values

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.summaries.tables)


def summary_bytes_per_request(max_model_len: int, block_tokens: int, num_layers: int, num_kv_heads: int,
                              head_dim: int, dtype_bytes: int) -> int:
    """GPU bytes of one request's key summaries at most: a key min and max per block, KV head and
    layer for the ceil(max_model_len / block_tokens) blocks its tables may hold (`FarKV` caps them
    there). 2 * num_kv_heads * head_dim * dtype_bytes / block_tokens bytes per token and layer."""
    return -(-max_model_len // block_tokens) * num_layers * 2 * num_kv_heads * head_dim * dtype_bytes


class SelectionOverlap:
    """Of the blocks selected in a sampled step (every OVERLAP_EVERY steps), how many the same
    request and layer selected the step before: what a GPU cache of the last selection would hit.
    Counted on the device with elementwise ops (torch.isin may sort through a host-synchronizing
    unique); `value` reads the count."""

    def __init__(self, device: torch.device):
        self._hits = torch.zeros(1, dtype=torch.int64, device=device)
        self._of = 0

    def note(self, step: int, previous: dict[int, torch.Tensor], layer: int, ids: torch.Tensor,
             row: int | None = None) -> None:
        """Step `step`'s selection ids at `layer` (its row `row` when given: ids [m, k]) of a request
        whose sampled selections are `previous` (per layer): the step before a sample keeps a copy,
        the sampled step compares with it."""
        if step % OVERLAP_EVERY == 0:
            before = previous.pop(layer, None)
            if before is not None:
                selected = ids if row is None else ids[row]
                self._hits += (selected.unsqueeze(1) == before.unsqueeze(0)).any(dim=1).sum()
                self._of += selected.numel()
        elif (step + 1) % OVERLAP_EVERY == 0:
            previous[layer] = (ids if row is None else ids[row]).clone()

    def value(self) -> float | None:
        """The sampled overlap so far (reads the device count), None before any sample."""
        return self._hits.item() / self._of if self._of else None
