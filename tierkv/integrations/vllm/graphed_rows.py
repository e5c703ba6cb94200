"""The sparse decode rows of a hot-window step that the CUDA graphs serve (`FarKV`'s graphed part).

Primitives: `GraphPlan`, `GraphedRows` (`plan`, `near_out_buffer`, `attend_whole`, `attend_rows`,
`write_rows`, `reset`).

At a step's first layer `plan` picks the decoding rows the graphs serve (each selectable, with
every far block summarized, at most `SparseStepGraphs.max_rows`) and works out what every layer of
the step shares: their query rows, whether those run consecutively, their window blocks. Then per
layer, one of

    attend_whole   every row of the step graphed: one replay runs the window part (vLLM's
                   FlashAttention), the selection, the fetch, the far attention and the merge
    attend_rows    the graphed rows' far parts, merged with near parts the backend computed,
                   then `write_rows` puts them into vLLM's output beside the eager rows'

and each replay counts its rows' selections (their far-block caches count hits and copies on the
device).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tierkv.transfer.device import to_device_no_sync
from tierkv.sparse.row_graph import NearInputs


def rows_of(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """t[start:end], or t itself when that is all of it (a slice costs host time in every layer)."""
    return t if start == 0 and end == t.shape[0] else t[start:end]


@dataclass
class GraphPlan:
    """The decoding rows of a step that the CUDA graphs serve, the same in each of its layers."""

    indices: list[int]                # into FarKV.rows, in the graph's row order
    starts: list[int]                 # their query rows
    contiguous: bool                  # starts run consecutively (no gather or scatter of rows)
    graph_rows: list[tuple]           # (req_id, request, far blocks), as SparseStepGraphs.attend takes them
    index: torch.Tensor | None        # starts on the device, when not contiguous
    resident_blocks: int              # the rows' window blocks, read from vLLM's pool in each layer
    sampled: bool                     # a step whose selections the overlap sample reads
    keys: dict[int, tuple] = field(default_factory=dict)  # per layer, the graph key (near_out_buffer made it)
    whole: bool | None = None         # its graphs run the window part too (None: not yet asked)
    near: NearInputs | None = None    # then their window inputs

    def covers(self, num_tokens: int) -> bool:
        """Whether its rows are the step's only rows, in order from the first (then FlashAttention
        may write their near part straight into a graph's input, or the graph run it)."""
        return self.contiguous and self.starts[0] == 0 and len(self.starts) == num_tokens


class GraphedRows:
    def __init__(self, far):
        """far: the engine's FarKV: its step's rows, requests, counters and step graphs (`far.graphs`,
        a `SparseStepGraphs`, or None: then no row is graphed)."""
        self.far = far
        self._plan: GraphPlan | None = None  # the step's, from its first layer on
        self.whole_check: torch.Tensor | None = None  # attend_whole's check: largest |whole - split| so far

    def reset(self) -> None:
        """A new step (or the graphs turned off): the next `plan` looks at the rows again."""
        self._plan = None

    def plan(self) -> GraphPlan | None:
        """The step's decoding rows the graphs serve (at most their max_rows, all of them in every
        layer), worked out at the step's first layer and kept for its others; None without graphs.
        Rows that stream far chunks in the same step (prefill chunks) go the eager way beside them:
        the chunks live in the streamer's staging, the graphs' blocks in the far-block caches."""
        far = self.far
        graphs = far.graphs
        if graphs is None:
            return None
        if self._plan is None:
            indices = []
            for i in far.sparse_rows:
                row = far.rows[i]
                if len(indices) < graphs.max_rows and graphs.servable(far.requests[row.req_id], row.num_far_blocks):
                    indices.append(i)
            rows = [far.rows[i] for i in indices]
            starts = [r.q_start for r in rows]  # their query rows, one each
            contiguous = bool(starts) and starts == list(range(starts[0], starts[0] + len(rows)))
            self._plan = GraphPlan(
                indices, starts, contiguous,
                [(r.req_id, far.requests[r.req_id], r.num_far_blocks) for r in rows],
                None if contiguous or not starts else to_device_no_sync(starts, far.store.device),
                sum(r.near_blocks(far.block_tokens) for r in rows),
                far.overlap.samples(far.counts["steps"]))
        return self._plan

    def near_out_buffer(self, layer: int, num_tokens: int, scale: float) -> torch.Tensor | None:
        """Where the near part of `layer` may be written ([num_tokens, H, D]): the static input of the
        layer's kept graph when the graphs serve every row of the step; None otherwise."""
        plan = self.plan()
        if plan is None or not plan.covers(num_tokens):
            return None
        graphs = self.far.graphs
        key = plan.keys[layer] = graphs.key(layer, plan.graph_rows, scale)
        return graphs.near_buffer(layer, key)

    def attend_whole(self, output: torch.Tensor, layer: int, q: torch.Tensor, scale: float, window,
                     near_tables, check=None) -> bool:
        """`FarKV.attend_whole`: output [n, H, D] = the step's attention of q [n, H, D] at `layer` by
        one graph running the window part too; False when the caller must run the window part."""
        plan = self.plan()
        if plan is None or plan.whole is False:
            return False
        far = self.far
        graphs = far.graphs
        started = time.perf_counter()
        if plan.whole is None:  # the step's first layer: can its graphs run the window part too?
            plan.whole = False
            if graphs.whole_enabled and plan.covers(q.shape[0]):
                table, seqused_k, max_k = near_tables
                if max_k <= far.window_tokens + far.block_tokens:
                    plan.near = graphs.near_inputs_for(table, seqused_k)
                    plan.whole = True
            if not plan.whole:
                return False
        captures = graphs.counts["graph_captures"]
        key = (graphs.key(layer, plan.graph_rows, scale), window.key)
        replayed = graphs.attend_whole(layer, plan.graph_rows, q, window, plan.near,
                                       far.window_tokens + far.block_tokens, output.dtype, scale, key)
        if replayed is None:
            plan.whole = False
            return False
        self._count(plan, layer, replayed[1])
        near = check() if check is not None else None  # None: no check due
        if near is not None:
            split = graphs.attend(layer, plan.graph_rows, q, *near, output.dtype, scale)
            if split is not None:
                diff = (split[0].float() - replayed[0].float()).abs().max()
                self.whole_check = diff if self.whole_check is None else torch.maximum(self.whole_check, diff)
        output.copy_(replayed[0])
        far.host.note_layer(started, graphs.counts["graph_captures"] == captures and near is None)
        return True

    def attend_rows(self, layer: int, q: torch.Tensor, near_out: torch.Tensor, near_lse: torch.Tensor,
                    out_dtype: torch.dtype, scale: float) -> tuple[GraphPlan, tuple] | None:
        """The graphed rows' attention at `layer` (q [n, H, D], the step's near parts near_out [n, H,
        D] and near_lse [n, H]): (plan, (out [m, H, D], ids [m, k])) of one replay, merged with their
        near parts; None when the graphs serve no row of this step (or just turned off)."""
        plan = self.plan()
        if plan is None or not plan.indices:
            return None
        starts = plan.starts
        if plan.contiguous:
            a, b = starts[0], starts[0] + len(starts)
            inputs = rows_of(q, a, b), rows_of(near_out, a, b), rows_of(near_lse, a, b)
        else:
            inputs = tuple(t.index_select(0, plan.index) for t in (q, near_out, near_lse))
        replayed = self.far.graphs.attend(layer, plan.graph_rows, *inputs, out_dtype, scale, plan.keys.get(layer))
        if replayed is None:  # the graphs turned off: the eager path serves every row from now on
            self.reset()
            return None
        self._count(plan, layer, replayed[1])
        return plan, replayed

    @staticmethod
    def write_rows(output: torch.Tensor, plan: GraphPlan, out: torch.Tensor) -> None:
        """output's graphed rows = out [m, H, D] (`attend_rows`' merged rows)."""
        if plan.contiguous:
            rows_of(output, plan.starts[0], plan.starts[0] + len(plan.starts)).copy_(out)
        else:
            output.index_copy_(0, plan.index, out)

    def _count(self, plan: GraphPlan, layer: int, ids: torch.Tensor) -> None:
        """One replay at `layer`: ids, its selections [m, k]. Which of them the far-block caches held,
        and so the bytes the replay copied, the caches count on the device (`FarKV.stats` reads them)."""
        far = self.far
        m, k = len(plan.indices), far.sparse_blocks
        if plan.sampled:
            for n, (_, req, num_far) in enumerate(plan.graph_rows):
                far.overlap.note(far.counts["steps"], req.previous, layer, ids, n, num_far)
        far.count_selections(sum(min(n, k) for _, _, n in plan.graph_rows), plan.resident_blocks, m)
