"""The sparse decode step inside vLLM's full decode graph (`scheduler.sparse_full_graphs`): per-row
inputs written before each step, one body that vLLM captures with the rest of the model.

Primitives: `FullDecodeRows` (`write`, `attend`, `counted_step`), `full_graphs_configured`.

Under compiled vLLM, with the attention backend declaring support for uniform single-token decode,
vLLM captures each decode batch size once at start-up, the whole forward in one graph, and replays
it for decode steps. A captured graph bakes addresses, not requests, and vLLM captures before any
request exists, so everything a step's rows need lives in buffers of `max_rows` rows written before
the step (`write`, from the connector's `start_load_kv`), and vLLM's own persistent metadata:

    buffers (written each step)     far count per row (0: none, or a padded row), cache set, and per
                                    layer the addresses of the row's key-summary table and slot list
                                    (a row without far blocks reads a dummy's, masked to nothing)
    next-step prefetch (optional)   the blocks ranked below each layer's selection, copied into the
                                    rows' caches on a side stream (`prefetch_margin.MarginPrefetch`)
    vLLM's metadata (in place)      block table, key counts, query offsets

    captured, per layer (`attend`): the window's block table shifted past each row's far blocks
                                    (a device gather) and FlashAttention over it; the rows' far part
                                    as the split graphs run it (`tierkv.sparse.step.sparse_rows_body`, every
                                    row's input by address); the LSE merge into vLLM's output

A step whose rows the body cannot serve (far blocks without summaries, no cache set left, more rows
than buffers) must not replay: `write` says so, and the connector asks vLLM to run the step eagerly.
On a replay vLLM's per-layer connector hooks do not run, so the step's saves happen after it
(`TierKVConnector.wait_for_save`). Built from the vLLM 0.26.0 source and tested on CPU (the window
part as a PyTorch attention); not yet run on a GPU.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tierkv.attention import merge_two_into
from tierkv.sparse.far_source import SimpleRow
from tierkv.sparse.summaries import BlockSummaries
from tierkv.sparse.step import packed_buffers, sparse_rows_body
from tierkv.sparse.prefetch_margin import MarginPrefetch


def full_graphs_configured(config) -> bool:
    """Whether a tierkv config asks for the sparse step inside vLLM's full decode graph."""
    scheduler = config.scheduler
    return scheduler.policy == "sparse" and scheduler.sparse_cuda_graphs and scheduler.sparse_full_graphs


class FullDecodeRows:
    def __init__(self, far, max_rows: int, layer_index: dict[str, int]):
        """far: the engine's FarKV (sparse policy, its CUDA graphs on, max_model_len known);
        max_rows: the largest batch vLLM captures a graph for (at least its max_num_seqs; padded
        rows read nothing); layer_index: layer name -> index."""
        if far.graphs is None or far.max_blocks is None:
            raise ValueError("scheduler.sparse_full_graphs: needs the sparse CUDA graphs (CUDA, a copy-kernel transfer "
                             "backend) and the engine's max_model_len")
        self.far, self.max_rows, self.layer_index = far, max_rows, layer_index
        store, layout = far.store, far.store.layout
        num_layers, device = store.num_layers, store.device
        # a row without far blocks (or a padded row) reads these: masked to nothing, but real addresses
        self.dummy_table = torch.zeros((far.max_blocks, layout.num_kv_heads, 2 * layout.head_dim), dtype=layout.dtype,
                                       device=device)
        self.dummy_list = torch.zeros(far.max_blocks, dtype=torch.int64, device=device)
        table = BlockSummaries(num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, device, far.max_blocks,
                               far.source.bound_weight)
        table.tables = [self.dummy_table] * num_layers
        self.dummy = SimpleRow(None, table, [self.dummy_list] * num_layers)
        # rows 0..max_rows-1: far count, cache set, then per layer the summary tables' and the slot lists'
        # addresses; one host mirror, one copy per step
        self.inputs = torch.zeros((2 + 2 * num_layers, max_rows), dtype=torch.int64, device=device)
        self._host = torch.zeros_like(self.inputs, device="cpu", pin_memory=device.type == "cuda")
        # written through numpy: a tensor's item assignment costs microseconds, and a step writes
        # 2 + 2 x layers values per row (640 at 10 rows of 32 layers: 11.4 ms of host time per step, profiled)
        self._host_np = self._host.numpy()
        self._copied = None  # the last copy's event (CUDA): the host mirror is rewritten only once it has run
        self.packed = packed_buffers(far.source, device, max_rows)
        # scheduler.sparse_prefetch_margin: each layer also fetches the blocks ranked below its selection
        # for the next step, on a side stream the forward's last layer joins
        margin = far.store.config.scheduler.sparse_prefetch_margin
        self.prefetch = MarginPrefetch(far.source, far.row_caches, margin, max_rows) if margin else None
        self.rows: list = [self.dummy] * max_rows  # the requests behind the rows (the PyTorch fallbacks read them)
        self.counts = {"full_steps": 0, "full_steps_refused": 0}
        # the window's shifted block table and key counts: every layer reads the same ones, so the first
        # layer of a forward makes them and the others reuse them (inside one captured forward too)
        self._first_layer = min(layer_index.values()) if layer_index else 0
        self._last_layer = max(layer_index.values()) if layer_index else num_layers - 1
        self._near: tuple | None = None  # (rows, near table, key counts)
        self._blank()
        far.full = self  # its stats report ours

    def _blank(self) -> None:
        host = self._host_np
        layers = self.far.store.num_layers
        host[:2] = 0
        host[2 : 2 + layers] = self.dummy_table.data_ptr()
        host[2 + layers :] = self.dummy_list.data_ptr()

    def write(self, rows: Sequence) -> bool:
        """Before a step that vLLM replays from a full decode graph: each batch row's (`FarRow`, in the
        batch's order) inputs into the buffers (one copy). False, with the buffers unchanged, when the
        body cannot serve the step: a row that is not a single decoding token (a prompt's last token is
        prefill), more rows than buffers, or a row with far blocks whose request the graphs cannot serve (not all of them
        summarized, or no cache set left)."""
        far = self.far
        if len(rows) > self.max_rows or any(r.q_end - r.q_start != 1 or r.req_id in far.prompt_steps for r in rows):
            self.counts["full_steps_refused"] += 1
            return False
        served = []
        for row in rows:
            req = far.requests.get(row.req_id) if row.num_far_blocks else None
            if row.num_far_blocks and (req is None or not far.graphs.servable(req, row.num_far_blocks)):
                self.counts["full_steps_refused"] += 1
                return False
            served.append(req)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy out of the host mirror has run
        self._blank()
        host, layers = self._host_np, far.store.num_layers
        self.rows = [self.dummy] * self.max_rows
        for r, (row, req) in enumerate(zip(rows, served)):
            if req is None:
                continue
            host[0, r] = row.num_far_blocks
            host[1, r] = req.cache.index
            tables = [table.data_ptr() for table in req.far_summaries.tables]
            if any(address % 16 for address in tables):  # the bound kernel reads them in 128-bit vectors
                raise RuntimeError(f"tierkv hot window: request {row.req_id}'s key-summary tables are not 16-byte "
                                   "aligned; the full decode graph's bound kernel reads them in vectors")
            host[2 : 2 + layers, r] = tables
            host[2 + layers :, r] = [slots.data_ptr() for slots in req.pinned_slots_dev]
            self.rows[r] = req
        self.inputs.copy_(self._host, non_blocking=True)
        if self.inputs.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.counts["full_steps"] += 1
        return True

    def counted_step(self, rows: Sequence) -> None:
        """The hot window's read counts of a step the full graph served (its Python never runs)."""
        far, k, layers = self.far, self.far.sparse_blocks, self.far.store.num_layers
        selected = sum(min(r.num_far_blocks, k) for r in rows)
        resident = sum(r.near_blocks(far.block_tokens) for r in rows if r.num_far_blocks)
        far.count_selections(layers * selected, layers * resident, layers * sum(1 for r in rows if r.num_far_blocks))

    def attend(self, output: torch.Tensor, layer: int, q: torch.Tensor, scale: float, window, meta) -> None:
        """output [n, H, D] = the attention of q [n, H, D] (a decode batch, one token per row, n at
        most max_rows) at `layer`: what vLLM captures for its full decode graph. window(q, table,
        seqused_k, cu_seqlens_q, max_seqlen_k) -> (out, lse [n, H]): the backend's FlashAttention over
        vLLM's pool; meta: vLLM's attention metadata (block_table, seq_lens, query_start_loc), the
        same storage every step. Device work only."""
        far, n = self.far, q.shape[0]
        num_far = self.inputs[0, :n]
        if layer == self._first_layer or self._near is None or self._near[0] != n:
            table = meta.block_table[:n]
            cols = table.shape[1]
            width = -(-(far.window_tokens + far.block_tokens) // far.block_tokens) + 1  # window blocks, at most
            index = (torch.arange(width, device=q.device).unsqueeze(0) + num_far.unsqueeze(1)).clamp_(max=cols - 1)
            self._near = (n, torch.gather(table, 1, index.to(torch.int64)),
                          meta.seq_lens[:n] - (num_far * far.block_tokens).to(meta.seq_lens.dtype))
        _, near_table, seqused_k = self._near
        near = window(q, near_table, seqused_k, meta.query_start_loc[: n + 1], far.window_tokens + far.block_tokens)
        layers = far.store.num_layers
        far_out, far_lse, _ = sparse_rows_body(
            far.source, self.rows[:n], layer, q, num_far, far.row_caches, scale, self.packed,
            sets=self.inputs[1, :n], tables=self.inputs[2 + layer, :n], lists=self.inputs[2 + layers + layer, :n],
            prefetch=self.prefetch)
        merge_two_into(output, near, (far_out, far_lse))
        if self.prefetch is not None and layer == self._last_layer:
            self.prefetch.join()

    def stats(self) -> dict:
        """Steps served and refused, and the next-step prefetch's counters (one device sync)."""
        return {**self.counts, **(self.prefetch.stats() if self.prefetch is not None else {})}
