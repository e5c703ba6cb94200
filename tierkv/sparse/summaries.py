"""Sparse retrieval for decode: per-block key summaries on the GPU and top-k block selection.

Primitives: `key_bounds`, `selection_query`, `check_bound_weight`, `BlockSummaries` (`update`, `put`,
`upper_bounds`, `head_bounds`, `masked_bounds`), `masked_bounds_rows`, `top_blocks`, `check_candidates`,
`select_far_blocks`, `select_far_blocks_on_device`, `select_far_blocks_per_kv_head`.

For every full block of every layer the GPU keeps, per KV head, the elementwise min and max of
its keys (as Quest does): 2 x num_kv_heads x head_dim values per block, max and min side by
side. For a query q, the largest score any key of block b can give head h is bounded by

    ub[b, h] = sum_d max(q[h, d] * kmin[b, h', d], q[h, d] * kmax[b, h', d])     (h' = h's KV head)

A block's score mixes that bound with the score of the block's midpoint key (kmax + kmin) / 2,
weighted by `scheduler.sparse_bound_weight` w (`selection_query`; w = 1: the bound alone, as Quest).
A decode step reads the resident blocks (sinks, far-block cache, window) plus the k far
blocks with the largest score (max over heads), k = sparse_token_budget / block_tokens, and
attention over that set is exact. When k covers every far block, sparse equals exact.
Selection happens at attention time; `tierkv.sparse.predict_previous` copies each layer's previous
selection ahead, `tierkv.sparse.predict_query` predicts the next layers' selection from the hidden state
into a far-block cache, and a selected block that was not prefetched is fetched at once as a stall.
"""
from __future__ import annotations

import torch

from tierkv.attention import triton_installed
from tierkv.optional_kernel import OptionalKernel


_KERNEL = OptionalKernel("block_bounds")


def _kernel_bounds(table: torch.Tensor, q: torch.Tensor, first: int, stop: int,
                   limit: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   bound_weight: float = 1.0) -> torch.Tensor | None:
    """`tierkv.sparse.kernels.block_bounds` (one launch) for CUDA tables where triton is installed;
    None where it cannot run (the PyTorch path serves from then on, the reason in `_KERNEL.error`)."""
    if not (table.is_cuda and triton_installed()):
        return None

    def launch() -> torch.Tensor:
        from tierkv.sparse.kernels import block_bounds

        return block_bounds(table, q, first, stop, limit, out, bound_weight=bound_weight)

    return _KERNEL.run(launch, on_cuda=True)[1]


_ROWS_KERNEL = OptionalKernel("block_bounds_rows")


def masked_bounds_rows(tables: list[torch.Tensor], q: torch.Tensor, limits: torch.Tensor, out: torch.Tensor,
                       addresses: torch.Tensor | None = None, bound_weight: float = 1.0) -> bool:
    """out float32 [m, width] = each row's masked bound (`BlockSummaries.masked_bounds`) over its
    own table (tables[r], the layer's table of row r's request; limits int64 [m]: the far counts,
    at most each table's size; q [m, num_heads, head_dim]) in one launch
    (`tierkv.sparse.kernels.block_bounds_rows`), -inf at and past each limit; addresses: the
    tables' addresses, int64 [m] on the device (a CUDA graph's static input; made here when not
    given); bound_weight: `selection_query`'s. False, with out untouched, where the kernel cannot serve (CPU, no triton, tables of
    different dtypes or layouts, or not 16-byte aligned: the kernel reads them in 128-bit vectors;
    tables this module allocates always are): the caller bounds row by row."""
    like = tables[0]
    if not (like.is_cuda and triton_installed()) or any(
            t.dtype != like.dtype or t.shape[1:] != like.shape[1:] or not t.is_contiguous() or t.data_ptr() % 16
            for t in tables):
        return False

    def launch() -> None:
        from tierkv.sparse.kernels import block_bounds_rows

        at = addresses if addresses is not None else torch.tensor([t.data_ptr() for t in tables], dtype=torch.int64,
                                                                   device=like.device)
        block_bounds_rows(at, like, q, limits, out, bound_weight=bound_weight)

    return _ROWS_KERNEL.run(launch, on_cuda=True)[0]


def selection_query(q: torch.Tensor, bound_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The two vectors (a, b) a block's score is a . kmax + b . kmin of, for q [..., head_dim] (float32):

        score = w * (Quest's bound: sum_d max(q_d kmax_d, q_d kmin_d)) + (1 - w) * q . (kmax + kmin) / 2

    with w = bound_weight: at 1 the upper bound of any key's score in the block (Quest), at 0 the
    score of the block's midpoint key, between them a mix that ranks blocks by more than their most
    extreme key (`benchmarks/accuracy_selection.py` measures the choice on real text). One form
    for every path: the PyTorch matmul here and the Triton kernels (`tierkv.sparse.kernels`)."""
    q = q.float()
    mid = (0.5 - 0.5 * bound_weight) * q
    return bound_weight * q.clamp(min=0) + mid, bound_weight * q.clamp(max=0) + mid


def check_bound_weight(bound_weight: float) -> float:
    """bound_weight as a float; ValueError unless it is a finite number in [0, 1]."""
    weight = float(bound_weight)
    if not 0.0 <= weight <= 1.0:  # also false for nan
        raise ValueError(f"sparse bound weight: got {bound_weight!r}; expected a number in [0, 1]")
    return weight


def key_bounds(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [..., 2, num_kv_heads, block_tokens, head_dim] (K, V) -> [..., num_kv_heads, 2 * head_dim]:
    each block's elementwise key max, then its key min."""
    keys = blocks.select(-4, 0)                                             # [..., H_kv, T, D]
    return torch.cat([keys.amax(dim=-2), keys.amin(dim=-2)], dim=-1)


def _layer_slice(layers: range) -> slice:
    if layers.step != 1 or not len(layers):
        raise ValueError(f"layers: consecutive layers expected, got {layers}")
    return slice(layers.start, layers.stop)


class BlockSummaries:
    """Per layer one table [capacity_blocks, num_kv_heads, 2 * head_dim] on the device: each block's
    key max in the first head_dim values, its key min in the rest (`kmax`, `kmin`: per-layer views
    of those halves). The layers' tables are views of one tensor [num_layers, capacity, ...], grown
    together as needed, so the blocks of consecutive layers are written in one copy (`put` with a
    range of layers). With `max_blocks` (the blocks of the longest request) the tensor is allocated
    at that size once, at the first update, and never grows: its memory is
    `num_layers * max_blocks * 2 * num_kv_heads * head_dim * itemsize`, and it never moves (a CUDA graph
    reading a table stays valid)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_blocks: int | None = None, bound_weight: float = 1.0):
        self._shape = (num_kv_heads, head_dim)
        self.bound_weight = check_bound_weight(bound_weight)  # the score's mix (`selection_query`)
        self.max_blocks = max_blocks
        self._dtype, self._device = dtype, device
        self._all = torch.empty((num_layers, 0, num_kv_heads, 2 * head_dim), dtype=dtype, device=device)
        self.tables = list(self._all.unbind(0))

    @property
    def kmax(self) -> list[torch.Tensor]:
        return [t[..., : self._shape[1]] for t in self.tables]

    @property
    def kmin(self) -> list[torch.Tensor]:
        return [t[..., self._shape[1] :] for t in self.tables]

    @property
    def capacity(self) -> int:
        """Blocks each layer's table holds now."""
        return self._all.shape[1]

    def reserve(self, num_blocks: int) -> None:
        """Tables of at least `num_blocks` rows (grown, zero-filled past the written rows, as `put` grows them)."""
        self._grow(num_blocks)

    def from_block(self, first: int) -> "BlockSummaries":
        """The same summaries from block `first` on, as views (no copy): block `first` is row 0 of each
        table. Valid until the tables grow (`put` past the capacity)."""
        view = object.__new__(BlockSummaries)
        view._shape, view.max_blocks, view._dtype, view._device = self._shape, None, self._dtype, self._device
        view.bound_weight = self.bound_weight
        view._all = self._all[:, first:]
        view.tables = list(view._all.unbind(0))
        return view

    def update(self, layer: int, first_block: int, blocks: torch.Tensor) -> None:
        """blocks: [n, 2, num_kv_heads, block_tokens, head_dim] full blocks first_block..first_block+n-1."""
        if blocks.shape[0]:
            self.put(layer, first_block, key_bounds(blocks))

    def put(self, layers: int | range, first_block: int, bounds: torch.Tensor) -> None:
        """Summaries (`key_bounds`) of blocks first_block.. of layer `layers`, bounds [n, H_kv, 2D];
        of consecutive layers `layers` (a range), bounds [len(layers), n, H_kv, 2D], in one copy."""
        n = bounds.shape[-3]
        if n == 0:
            return
        end = first_block + n
        self._grow(end)
        target = self.tables[layers] if isinstance(layers, int) else self._all[_layer_slice(layers)]
        target[..., first_block:end, :, :] = bounds.to(self._device, self._dtype)

    def _grow(self, num_blocks: int) -> None:
        have = self.capacity
        if num_blocks <= have:
            return
        capacity = max(num_blocks, 2 * have, 64) if self.max_blocks is None else max(num_blocks, self.max_blocks)
        grown = torch.zeros((self._all.shape[0], capacity, *self._all.shape[2:]), dtype=self._dtype,
                            device=self._device)
        grown[:, :have] = self._all
        self._all = grown
        self.tables = list(grown.unbind(0))

    def upper_bounds(self, layer: int, q: torch.Tensor, block_ids: torch.Tensor | range) -> torch.Tensor:
        """q [num_heads, head_dim], block_ids int64 [m] or a range -> float32 [m]: max over heads of ub[b, h].

        max(q_d kmin_d, q_d kmax_d) is q_d kmax_d where q_d > 0 and q_d kmin_d otherwise (kmax >= kmin),
        so the bound is one batched matmul of each block's [kmax | kmin] with [max(q, 0) | min(q, 0)],
        reading each summary once. A range reads a slice of the table, without gathering it; on CUDA
        it is one kernel (`tierkv.sparse.kernels`).
        """
        table = self.tables[layer]
        if isinstance(block_ids, range):
            check_candidates(block_ids)
            if not len(block_ids):  # an empty far set: nothing to score, no kernel launched
                return torch.empty(0, dtype=torch.float32, device=q.device)
            bounds = _kernel_bounds(table, q, block_ids.start, block_ids.stop, bound_weight=self.bound_weight)
            if bounds is not None:
                return bounds
        return self.head_bounds(layer, q, block_ids).amax(dim=0)

    def head_bounds(self, layer: int, q: torch.Tensor, block_ids: torch.Tensor | range) -> torch.Tensor:
        """q [num_heads, head_dim], block_ids int64 [m] or a range -> float32 [num_heads, m]: each
        query head's score of each block (`selection_query`; ub[b, h] at bound_weight 1), of which
        `upper_bounds` is the max over heads. PyTorch on every device."""
        table = self.tables[layer]
        if isinstance(block_ids, range):
            check_candidates(block_ids)
        rows = table[block_ids.start : block_ids.stop] if isinstance(block_ids, range) else table.index_select(0, block_ids)
        num_heads = q.shape[0]
        num_kv_heads = self._shape[0]
        qg = q.float().view(num_kv_heads, num_heads // num_kv_heads, -1)            # [H_kv, g, D]
        split = torch.cat(selection_query(qg, self.bound_weight), dim=-1)            # [H_kv, g, 2D]
        ub = torch.bmm(rows.float().transpose(0, 1), split.transpose(1, 2))         # [H_kv, m, g]
        return ub.permute(0, 2, 1).reshape(num_heads, -1)

    def masked_bounds(self, layer: int, q: torch.Tensor, limit: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """`upper_bounds` of every row of the layer's table, rows at or past `limit` (int64 0-d on
        the device) -inf: float32 [rows], written into `out` when given (contiguous float32 [rows]).
        Fixed shapes while the limit grows (a CUDA graph input)."""
        table = self.tables[layer]
        bounds = _kernel_bounds(table, q, 0, table.shape[0], limit, out, self.bound_weight)
        if bounds is not None:
            return bounds
        scores = self.upper_bounds(layer, q, range(table.shape[0]))
        scores = torch.where(torch.arange(table.shape[0], device=q.device) < limit, scores, float("-inf"))
        return scores if out is None else out.copy_(scores)


def top_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [m, k]: each row's k highest-scoring blocks of scores [m, blocks], in block order. The
    top-k is unsorted (one sort kernel fewer on CUDA: its order is replaced by block order anyway).
    Block order, as the eager selection: the attention kernel rounds its softmax weights to the KV
    dtype tile by tile, so another order gives results that differ from the eager path's at that
    rounding."""
    return torch.sort(torch.topk(scores, k, dim=1, sorted=False).indices, dim=1).values


def check_candidates(candidates: range) -> None:
    """ValueError unless `candidates` is a far-block range that runs forward by one (possibly empty,
    start == stop, as for a sequence shorter than the front region: `scheduler.plan.step_blocks`)."""
    if candidates.step != 1 or candidates.start < 0 or candidates.stop < candidates.start:
        raise ValueError(f"far-block candidates: got {candidates}; expected range(first, stop) with "
                         f"0 <= first <= stop and step 1")


def select_far_blocks(summaries: BlockSummaries, layer: int, q: torch.Tensor, candidates: range, k: int) -> list[int]:
    """The k candidate blocks with the largest upper bound for q [num_heads, head_dim], in block order
    (empty for an empty candidate range)."""
    check_candidates(candidates)
    if k >= len(candidates):
        return list(candidates)
    if k <= 0:
        return []
    scores = summaries.upper_bounds(layer, q, candidates)
    top = torch.topk(scores, k).indices + candidates.start
    return sorted(top.tolist())


def select_far_blocks_on_device(summaries: BlockSummaries, layer: int, q: torch.Tensor, candidates: range,
                                k: int) -> torch.Tensor:
    """Like `select_far_blocks`, but the ids stay on q's device: int64 [min(k, len(candidates))], in
    block order (int64 [0] for an empty candidate range). No host sync: the caller copies the blocks
    with device-side slot lists."""
    check_candidates(candidates)
    if k >= len(candidates):
        return torch.arange(candidates.start, candidates.stop, device=q.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=q.device)
    scores = summaries.upper_bounds(layer, q, candidates)
    return torch.sort(torch.topk(scores, k).indices).values + candidates.start


def select_far_blocks_per_kv_head(summaries: BlockSummaries, layer: int, q: torch.Tensor, candidates: range,
                                  k: int) -> torch.Tensor:
    """`scheduler.sparse_selection: per_kv_head`: each KV head's own k candidate blocks, by the max of
    its query heads' scores (`BlockSummaries.head_bounds`): int64 [num_kv_heads, min(k, len(candidates))]
    on q's device, each row in block order (every candidate in every row where k covers them)."""
    check_candidates(candidates)
    num_kv_heads = summaries.tables[layer].shape[1]
    n = len(candidates)
    if k >= n or k <= 0:
        ids = torch.arange(candidates.start, candidates.start + (n if k > 0 else 0), device=q.device)
        return ids.expand(num_kv_heads, -1)
    scores = summaries.head_bounds(layer, q, candidates).view(num_kv_heads, q.shape[0] // num_kv_heads, n).amax(1)
    return torch.sort(torch.topk(scores, k, dim=1).indices, dim=1).values + candidates.start
