"""GPU: the hot window's sparse decode rows replayed from CUDA graphs (one graph per layer for the
step's rows, their far parts merged with near parts inside it, the near part written where the
graph reads it, as the vLLM backend does)
equal the eager path, step
after step, while the far part grows (a new far block every block_tokens steps), for two requests
in one graph, one of them alone (a second set of rows captured beside the first), both again (the
kept graph replays), then a new request once both finished (it takes a finished request's summary
tables and slot lists, and captures for them), and one more in its place (which replays those
graphs, no capture, its far-block cache emptied), and the host is never synchronized by a replay; a
repeated query finds its selection in the far-block cache and copies nothing more; at 16- and
64-token blocks, the summary tables allocated once for the engine's longest request, and over an
fp8 CPU tier (codes and scales dequantized inside the graph). No vLLM needed
(tierkv.integrations.vllm.far_rows alone)."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tierkv.attention import merge_partials  # noqa: E402
from tierkv.blocks import BlockLayout  # noqa: E402
from tierkv.config import load_config  # noqa: E402
from tierkv.integrations.vllm.far_rows import FarKV  # noqa: E402
from tierkv.integrations.vllm.store import BlockSpan, VllmKVStore  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, TOKENS = 32, 8, 128, 3, 9600
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def sparse_far(tmp_path, caches, prompts, graphs: bool, BS: int, storage: str = "auto", cache_selections: int = 1,
               margin: int = 0):
    BLOCKS = TOKENS // BS
    block_bytes = 2 * KV_HEADS * BS * DIM * 2
    config = load_config({
        "cache": {"block_tokens": BS, "window_tokens": 4 * BS},
        "tiers": [{"kind": "cpu", "capacity_bytes": (len(prompts) * BLOCKS * LAYERS + 64) * block_bytes,
                   "storage_dtype": storage}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 1024 * block_bytes, "policy": "sparse",
                      "sparse_token_budget": 32 * BS, "sparse_cuda_graphs": graphs,
                      "sparse_cache_selections": cache_selections,
                      **({"sparse_full_graphs": True, "sparse_prefetch_margin": margin} if margin else {})},
    }, env={})
    store = VllmKVStore(config, BlockLayout(KV_HEADS, BS, DIM, torch.bfloat16), NAMES, "graphs", "cuda")
    store.register(caches)
    far = FarKV(store, 4 * BS, max_model_len=TOKENS + 8 * BS, max_rows=len(prompts))
    for req, tokens in prompts.items():
        add_request(store, far, caches, req, tokens)
    return store, far


def add_request(store, far, caches, req, tokens):
    """A request whose blocks per layer were computed (saved and summarized) from `caches`."""
    BLOCKS = TOKENS // far.block_tokens
    hashes = store.extend_hashes([], tokens, BLOCKS)
    far.add_hashes(req, 0, hashes)
    for name in NAMES:
        spans = [BlockSpan(req, list(range(BLOCKS)), hashes)]
        far.summarize(store.layer_index[name], spans, store.save_layer(store.layer_index[name], caches[name], spans))
    store.poll(wait=True)


def compare_steps(eager, graphed, requests: dict[str, int], steps: int, repeat_query: bool = False,
                  alternate: int = 1):
    """`steps` decode steps of `requests` (id: position of its first step's token), each layer's
    far attention by graphs equal to the eager path's; after the first step (which may capture a new
    set of rows) no step waits for the GPU, the steps whose far counts grow included. repeat_query:
    the same queries every `alternate` steps (so nearly the same selections: the far-block caches
    hold them)."""
    fixed = [torch.randn(len(requests), HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(alternate)]
    for step in range(steps):
        rows = [(req, first + step, 1) for req, first in requests.items()]
        q = fixed[step % alternate] if repeat_query else torch.randn(len(rows), HEADS, DIM, device="cuda",
                                                                      dtype=torch.bfloat16)
        for far in (eager, graphed):
            far_rows = far.begin_step(rows)
        assert all(r.num_far_blocks > graphed.sparse_blocks for r in far_rows)  # every row graph-served
        for layer in range(LAYERS):
            near = (torch.randn(len(rows), HEADS, DIM, device="cuda"), torch.randn(len(rows), HEADS, device="cuda"))
            want = merge_partials([near, eager.attend(layer, q, DIM ** -0.5)])[0]
            got = torch.full_like(want, float("nan"))
            if step > 0:  # replays must not wait for the GPU (overlap-sampling steps included)
                torch.cuda.set_sync_debug_mode("error")
            try:  # what the vLLM backend does: the near part written where the kept graph reads it, if any
                buffer = graphed.near_out_buffer(layer, len(rows), DIM ** -0.5)
                near_out = near[0] if buffer is None else buffer.copy_(near[0])
                graphed.attend_into(got, layer, q, near_out, near[1], DIM ** -0.5)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if step > 0:  # the step's rows' graph was captured at its first step
                assert buffer is not None
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for far in (eager, graphed):
            far.end_step()


@pytest.mark.parametrize("BS,storage", [(16, "auto"), (64, "auto"), (64, "float8_e4m3fn")])
def test_graph_replays_equal_the_eager_path_across_recaptures(tmp_path, BS, storage):
    BLOCKS = TOKENS // BS
    caches = {n: torch.randn(BLOCKS, KV_HEADS, BS, 2 * DIM, device="cuda", dtype=torch.bfloat16) for n in NAMES}
    prompts = {r: [random.randrange(1 << 16) for _ in range(BLOCKS * BS)] for r in ("a", "b")}
    eager_store, eager = sparse_far(tmp_path / "eager", caches, prompts, graphs=False, BS=BS, storage=storage)
    graph_store, graphed = sparse_far(tmp_path / "graphs", caches, prompts, graphs=True, BS=BS, storage=storage)
    assert eager.graphs is None and graphed.graphs is not None and graphed.graphs.enabled
    # staging, and a quantized tier's code and scale buffers, stay within scheduler.staging_bytes
    assert graphed.stats()["staging_bytes"] <= graph_store.config.scheduler.staging_bytes
    try:
        start = (BLOCKS - 3) * BS - 2  # the far part grows by one block during the steps below
        steps = 2 * BS + 4
        compare_steps(eager, graphed, {"a": start, "b": start - 5}, steps)
        tables = graphed.requests["a"].summaries.summaries.tables
        assert [t.shape[0] for t in tables] == [BLOCKS + 8] * LAYERS  # max_model_len's blocks, allocated once
        counts = graphed.stats()["cuda_graphs"]
        assert counts["graph_capture_errors"] == 0 and counts["graph_rows"] == 2 * LAYERS * steps
        assert counts["graph_replays"] == LAYERS * steps  # one replay per layer serves both rows
        # one capture per layer at first use: the summary tables and pinned-slot buffers are sized for
        # max_model_len and never move, so growing far parts replay with larger far counts
        assert counts["graph_captures"] == LAYERS
        # a step of "a" alone: a new set of rows, captured into the pool beside the live graphs of both;
        # then both again: their kept graphs replay, no capture
        compare_steps(eager, graphed, {"a": start + steps}, 2)
        compare_steps(eager, graphed, {"a": start + steps + 2, "b": start - 5 + steps}, 2)
        counts = graphed.stats()["cuda_graphs"]
        assert counts["graph_capture_errors"] == 0 and counts["graph_captures"] == 2 * LAYERS
        assert counts["graphs"] == 2 * LAYERS
        # both requests finish: their graphs stay, and their summary tables and slot lists pass to the
        # next requests (max_model_len is known). "c" takes b's, last released: no kept graph serves b's
        # buffers alone, so it captures one and replays it
        for far in (eager, graphed):
            far.finish("a")
            far.finish("b")
        assert graphed.stats()["cuda_graphs"]["graphs"] == 2 * LAYERS
        tokens = [random.randrange(1 << 16) for _ in range(BLOCKS * BS)]
        for far, store in ((eager, eager_store), (graphed, graph_store)):
            add_request(store, far, caches, "c", tokens)
        compare_steps(eager, graphed, {"c": start}, 4)
        counts = graphed.stats()["cuda_graphs"]
        assert counts["graph_capture_errors"] == 0 and counts["graphs"] == 3 * LAYERS and counts["graphs_enabled"]
        assert counts["graph_captures"] == 3 * LAYERS
        # "c" finishes and "d" takes its buffers: c's graphs replay for "d", no capture, outputs still equal
        tokens = [random.randrange(1 << 16) for _ in range(BLOCKS * BS)]
        for far, store in ((eager, eager_store), (graphed, graph_store)):
            far.finish("c")
            add_request(store, far, caches, "d", tokens)
        compare_steps(eager, graphed, {"d": start + 7}, 3)
        assert graphed.stats()["cuda_graphs"]["graph_captures"] == 3 * LAYERS
        # the kernels ran, not their PyTorch fallbacks (which give the same outputs, so only this shows it)
        from tierkv import block_io
        from tierkv.sparse import summaries as sparse

        assert sparse._KERNEL.ok, sparse._KERNEL.error
        assert sparse._ROWS_KERNEL.ok, sparse._ROWS_KERNEL.error  # the bound of all rows in one launch
        from tierkv.sparse import row_caches as far_cache

        assert far_cache._ROWS_KERNEL.ok, far_cache._ROWS_KERNEL.error  # the caches' placement kernel
        if storage != "auto":
            assert block_io._FUSED.ok, block_io._FUSED.error
        # both paths count the same reads: the window resident, the selection; the graphed rows fetch
        # only what their far-block caches lacked (fresh random queries: few hits)
        e, g = eager.stats(), graphed.stats()
        for key in ("sparse_resident_reads", "sparse_selected_reads"):
            assert e[key] == g[key], key
        assert e["cache_hits"] == 0 and g["sparse_fetched_reads"] == g["sparse_selected_reads"] - g["cache_hits"]
        assert g["cache_hits"] + g["cache_misses"] == g["sparse_selected_reads"]
        assert 0 < e["gpu_hit_rate"] <= g["gpu_hit_rate"] < 1
        # a query that repeats: after its first step the cache serves its selection, and only a block that
        # becomes far on the way can be new (at most one per row and layer); outputs still equal
        before = g
        repeats = 6
        compare_steps(eager, graphed, {"d": start + 10}, repeats, repeat_query=True)
        g = graphed.stats()
        hits, misses = g["cache_hits"] - before["cache_hits"], g["cache_misses"] - before["cache_misses"]
        k = graphed.sparse_blocks
        assert hits + misses == repeats * LAYERS * k
        assert misses <= LAYERS * (k + 1) and hits >= (repeats - 1) * LAYERS * (k - 1)
        assert g["bytes_streamed"] - before["bytes_streamed"] == misses * graph_store.cpu.slot_bytes
    finally:
        for far, store in ((eager, eager_store), (graphed, graph_store)):
            far.close()
            store.close()


class TorchWindow:
    """The window part as a whole step graph runs it, in torch ops that read only device tensors (so it
    can be captured): each row's query over the first seqused_k[r] keys of its blocks table[r] in a
    layer's pool [blocks, KV_HEADS, BS, 2 * DIM]. The vLLM backend's is FlashAttention."""

    def __init__(self, pool, scale):
        self.pool, self.scale, self.key = pool, scale, ("torch-window", pool.data_ptr())

    def __call__(self, q, table, seqused_k, cu_seqlens_q, max_seqlen_k):
        m, cols = table.shape
        bs = self.pool.shape[2]
        kv = self.pool[table.long()]  # [m, C, KV_HEADS, BS, 2D]
        kv = kv.permute(0, 1, 3, 2, 4).reshape(m, cols * bs, KV_HEADS, 2 * DIM).float()
        k = kv[..., :DIM].repeat_interleave(HEADS // KV_HEADS, dim=2)
        v = kv[..., DIM:].repeat_interleave(HEADS // KV_HEADS, dim=2)
        scores = torch.einsum("mhd,mkhd->mhk", q.float(), k) * self.scale
        valid = torch.arange(cols * bs, device=q.device).unsqueeze(0) < seqused_k.unsqueeze(1)  # [m, keys]
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        return torch.einsum("mhk,mkhd->mhd", torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, dim=-1)


def test_whole_graphs_run_the_window_part_and_equal_the_split_path(tmp_path):
    """Every row of each step graphed: one graph per layer runs the window part (here in torch ops)
    with the far part, reading the block table and key counts written once per step; equal to the
    window part run eagerly plus the eager far path, while positions and far counts grow, with no
    host sync after the first step, one capture per layer, and a check run finding the split graphs
    give the same."""
    BS = 64
    BLOCKS = TOKENS // BS
    scale = DIM ** -0.5
    caches = {n: torch.randn(BLOCKS, KV_HEADS, BS, 2 * DIM, device="cuda", dtype=torch.bfloat16) for n in NAMES}
    prompts = {r: [random.randrange(1 << 16) for _ in range(BLOCKS * BS)] for r in ("a", "b")}
    eager_store, eager = sparse_far(tmp_path / "eager", caches, prompts, graphs=False, BS=BS)
    graph_store, graphed = sparse_far(tmp_path / "graphs", caches, prompts, graphs=True, BS=BS)
    windows = [TorchWindow(caches[n], scale) for n in NAMES]
    try:
        start = {"a": (BLOCKS - 3) * BS - 2, "b": (BLOCKS - 3) * BS - 7}
        steps = BS + 4  # the far parts grow by a block on the way
        for step in range(steps):
            rows = [(req, first + step, 1) for req, first in start.items()]
            for far in (eager, graphed):
                far_rows = far.begin_step(rows)
            q = torch.randn(len(rows), HEADS, DIM, device="cuda", dtype=torch.bfloat16)
            near_len = [r.num_computed + 1 - r.num_far_blocks * BS for r in far_rows]
            seqused = torch.tensor(near_len, dtype=torch.int32, device="cuda")
            table = torch.randint(0, BLOCKS, (len(rows), 8), dtype=torch.int32, device="cuda")
            cu = torch.arange(len(rows) + 1, dtype=torch.int32, device="cuda")
            for layer, window in enumerate(windows):
                near = window(q, table, seqused, cu, max(near_len))
                want = merge_partials([near, eager.attend(layer, q, scale)])[0]
                got = torch.full_like(want, float("nan"))
                if step > 0:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    assert graphed.attend_whole(got, layer, q, scale, window, (table, seqused, max(near_len)),
                                                check=(lambda: window(q, table, seqused, cu, max(near_len)))
                                                if step == 0 else None)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for far in (eager, graphed):
                far.end_step()
        counts = graphed.stats()["cuda_graphs"]
        assert counts["graph_capture_errors"] == 0 and counts["whole_capture_errors"] == 0
        assert counts["whole_graph_replays"] == LAYERS * steps
        assert counts["graph_captures"] == 2 * LAYERS  # a whole graph per layer, and the check's split twin
        assert graphed.stats()["whole_check_max_abs"] < 1e-2
        for key in ("sparse_resident_reads", "sparse_selected_reads"):
            assert eager.stats()[key] == graphed.stats()[key], key
    finally:
        for far, store in ((eager, eager_store), (graphed, graph_store)):
            far.close()
            store.close()


def test_caches_of_two_selections_replay_and_keep_alternating_selections(tmp_path):
    """scheduler.sparse_cache_selections: 2 (two selections per layer, least recently used replaced,
    placed by the LRU kernel inside the graphs): replays equal the eager path with no host sync, and
    queries alternating between two directions copy nothing after their first two steps but a block
    that becomes far on the way."""
    BS = 64
    BLOCKS = TOKENS // BS
    caches = {n: torch.randn(BLOCKS, KV_HEADS, BS, 2 * DIM, device="cuda", dtype=torch.bfloat16) for n in NAMES}
    prompts = {"a": [random.randrange(1 << 16) for _ in range(BLOCKS * BS)]}
    eager_store, eager = sparse_far(tmp_path / "eager", caches, prompts, graphs=False, BS=BS)
    graph_store, graphed = sparse_far(tmp_path / "graphs", caches, prompts, graphs=True, BS=BS, cache_selections=2)
    try:
        k = graphed.sparse_blocks
        assert graphed.row_caches.width == 2 * k and graphed.row_caches.per_layer
        steps = 10
        compare_steps(eager, graphed, {"a": (BLOCKS - 3) * BS - 2}, steps, repeat_query=True, alternate=2)
        g = graphed.stats()
        assert g["cache_hits"] + g["cache_misses"] == steps * LAYERS * k
        assert g["cache_misses"] <= LAYERS * (2 * k + 2)  # the first two steps, and a block become far
        from tierkv.sparse import row_caches as far_cache

        assert far_cache._ROWS_KERNEL.ok, far_cache._ROWS_KERNEL.error  # the LRU form of the rows kernel
        assert g["cuda_graphs"]["graph_capture_errors"] == 0
    finally:
        for far, store in ((eager, eager_store), (graphed, graph_store)):
            far.close()
            store.close()


def test_decoding_rows_beside_a_streaming_prefill_chunk_replay_their_graphs(tmp_path):
    """Two decoding rows and, between them, a prefill chunk of 16 tokens whose far KV streams in full
    (c9e0b27: such steps used to send every decoding row the eager way): the graphs serve both
    decoding rows beside the streamed chunks, every layer's output equals an engine without graphs,
    and with the same queries the later steps find the selections in the far-block caches."""
    BS = 64
    BLOCKS = TOKENS // BS
    scale = DIM ** -0.5
    caches = {n: torch.randn(BLOCKS, KV_HEADS, BS, 2 * DIM, device="cuda", dtype=torch.bfloat16) for n in NAMES}
    prompts = {r: [random.randrange(1 << 16) for _ in range(BLOCKS * BS)] for r in ("a", "p", "b")}
    eager_store, eager = sparse_far(tmp_path / "eager", caches, prompts, graphs=False, BS=BS)
    graph_store, graphed = sparse_far(tmp_path / "graphs", caches, prompts, graphs=True, BS=BS)
    try:
        k, steps = graphed.sparse_blocks, 3
        q = torch.randn(1 + 16 + 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        for step in range(steps):
            rows = [("a", (BLOCKS - 3) * BS - 2 + step, 1), ("p", 40 * BS, 16), ("b", (BLOCKS - 5) * BS + step, 1)]
            for far in (eager, graphed):
                far_rows = far.begin_step(rows)
            assert far_rows[1].num_far_blocks > 0 and graphed._pieces  # the prefill chunk streams far KV
            for layer in range(LAYERS):
                near = (torch.randn(q.shape[0], HEADS, DIM, device="cuda"), torch.randn(q.shape[0], HEADS, device="cuda"))
                want = merge_partials([near, eager.attend(layer, q, scale)])[0]
                got = torch.full_like(want, float("nan"))
                graphed.attend_into(got, layer, q, near[0], near[1], scale)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"step {step} layer {layer}")
            for far in (eager, graphed):
                far.end_step()
        g = graphed.stats()
        assert g["cuda_graphs"]["graph_rows"] == steps * 2 * LAYERS and g["cuda_graphs"]["graph_capture_errors"] == 0
        assert g["cache_hits"] + g["cache_misses"] == steps * 2 * k * LAYERS
        assert g["cache_hits"] >= (steps - 1) * 2 * (k - 1) * LAYERS  # at most a block become far is new
        assert g["chunks_streamed"] > 0
    finally:
        for far, store in ((eager, eager_store), (graphed, graph_store)):
            far.close()
            store.close()


def test_a_captured_full_decode_body_replays_the_eager_step(tmp_path):
    """scheduler.sparse_full_graphs without vLLM: every layer's `FullDecodeRows.attend` captured once in
    one graph with no request known (as vLLM captures at start-up, every row a dummy), over static metadata of
    four rows (a request with many far blocks, one with fewer than a selection, one with none, a
    padded row); then per step the rows' inputs are written (`write`) and the metadata refreshed in
    place, and the replays equal the window part plus the eager far path, while positions and far
    counts grow, with no host sync in the replays."""
    stats = full_body_steps(tmp_path, margin=0, storage="auto", drift=False)
    assert "prefetch_copied" not in stats["full_decode_graphs"]


@pytest.mark.parametrize("storage", ["auto", "float8_e4m3fn"])
def test_the_next_step_prefetch_runs_on_a_side_stream_inside_the_captured_body(tmp_path, storage):
    """scheduler.sparse_prefetch_margin inside the captured full decode body: each layer forks the copy
    of the blocks ranked below its selection to a side stream, the last layer joins it, and the
    replays still equal the eager step (bf16 and fp8 CPU tiers, no host sync). Queries drifting from
    one direction to another: the prefetch turns most of the next steps' misses into hits, against
    the same steps without it."""
    k = 32
    off = full_body_steps(tmp_path / "off", margin=0, storage=storage, drift=True)
    on = full_body_steps(tmp_path / "on", margin=k, storage=storage, drift=True)
    prefetch = on["full_decode_graphs"]
    assert prefetch["prefetch_copied"] > 0
    assert 0 < prefetch["prefetch_used"] <= min(prefetch["prefetch_copied"], on["cache_hits"])  # the kernel's marks
    assert on["cache_hits"] + on["cache_misses"] == off["cache_hits"] + off["cache_misses"]
    assert on["cache_misses"] < off["cache_misses"], (on["cache_misses"], off["cache_misses"])


def full_body_steps(tmp_path, margin: int, storage: str, drift: bool) -> dict:
    """The captured full decode body over 4 rows, BS + 4 steps, each replay checked against the eager
    step; margin: scheduler.sparse_prefetch_margin (caches of two selections when set); drift: the
    queries move from one direction to another in small steps (else fresh each step). The graphed
    far path's stats."""
    from types import SimpleNamespace

    from tierkv.integrations.vllm.full_graph_rows import FullDecodeRows

    BS = 64
    BLOCKS = TOKENS // BS
    steps = BS + 4
    scale = DIM ** -0.5
    caches = {n: torch.randn(BLOCKS, KV_HEADS, BS, 2 * DIM, device="cuda", dtype=torch.bfloat16) for n in NAMES}
    prompts = {r: [random.randrange(1 << 16) for _ in range(BLOCKS * BS)] for r in ("a", "b", "c")}
    eager_store, eager = sparse_far(tmp_path / "eager", caches, prompts, graphs=False, BS=BS, storage=storage)
    graph_store, graphed = sparse_far(tmp_path / "graphs", caches, prompts, graphs=True, BS=BS, storage=storage,
                                      cache_selections=2 if margin else 1, margin=margin)
    windows = [TorchWindow(caches[n], scale) for n in NAMES]
    ends = torch.randn(2, 4, HEADS, DIM, device="cuda")
    try:
        full = FullDecodeRows(graphed, 4, graph_store.layer_index)
        n = 4
        meta = SimpleNamespace(block_table=torch.arange(BLOCKS, dtype=torch.int32, device="cuda").repeat(n, 1),
                               seq_lens=torch.zeros(n, dtype=torch.int32, device="cuda"),
                               query_start_loc=torch.arange(n + 1, dtype=torch.int32, device="cuda"))
        q = torch.zeros(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        outs = [torch.zeros(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in NAMES]
        # as vLLM captures a full decode graph: a warm-up forward (every layer, eagerly: kernels built),
        # then one graph over every layer's body (the first layer makes the window's shifted table and
        # key counts, the others read them)
        for layer, window in enumerate(windows):
            full.attend(outs[layer], layer, q, scale, window, meta)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for layer, window in enumerate(windows):
                full.attend(outs[layer], layer, q, scale, window, meta)
        k = graphed.sparse_blocks
        start = {"a": (BLOCKS - 3) * BS - 2, "b": 4 * BS + (k - 3) * BS, "c": 4 * BS - 9}
        for step in range(steps):
            rows = [(req, first + step, 1) for req, first in start.items()]
            eager.begin_step(rows)
            far_rows = graphed.begin_step(rows)
            assert far_rows[0].num_far_blocks > k > far_rows[1].num_far_blocks > 0 == far_rows[2].num_far_blocks
            assert full.write(far_rows)
            meta.seq_lens[:3] = torch.tensor([r.num_computed + 1 for r in far_rows], dtype=torch.int32)
            if drift:
                q.copy_(ends[0] + (ends[1] - ends[0]) * step / (steps - 1))
            else:
                q.copy_(torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16))
            # the window's blocks of the reference pool (every id a block of it: columns past a row's near keys
            # are never read, but they are gathered)
            shifted = torch.stack([torch.arange(r.num_far_blocks, r.num_far_blocks + 8).clamp(max=BLOCKS - 1)
                                   for r in far_rows]).to(device="cuda", dtype=torch.int32)
            near_len = torch.tensor([r.num_computed + 1 - r.num_far_blocks * BS for r in far_rows], dtype=torch.int32,
                                    device="cuda")
            torch.cuda.set_sync_debug_mode("error")
            try:
                graph.replay()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            cu = torch.arange(4, dtype=torch.int32, device="cuda")
            for layer, window in enumerate(windows):
                near = window(q[:3], shifted, near_len, cu, int(near_len.max()))
                want = merge_partials([near, eager.attend(layer, q[:3], scale)])[0]
                torch.testing.assert_close(outs[layer][:3], want.to(torch.bfloat16), rtol=2e-2, atol=2e-2,
                                           msg=f"step {step} layer {layer}")
            for far in (eager, graphed):
                far.end_step()
        assert full.stats()["full_steps"] == steps
        return graphed.stats()
    finally:
        for far, store in ((eager, eager_store), (graphed, graph_store)):
            far.close()
            store.close()
