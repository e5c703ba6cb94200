"""Hot-window sparse decode of requests shorter than a selection, on CPU (the graphs' recording replaced
by `tests.integrations.vllm.test_hot_window.fake_graphs`; real captures: tests/gpu/test_far_graphs_gpu.py).

With the engine's max_model_len below the sparse token budget, every request's key-summary tables
(allocated at max_model_len's blocks) are shorter than one selection of k blocks. The graphed step
and the body vLLM captures in its full decode graph must still select [m, k] ids (-1 past each row's
far blocks) and give the eager path's output, at every position from no far block to the last."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tests.integrations.vllm.test_connector import BS, LAYERS, NAMES  # noqa: E402
from tests.integrations.vllm.test_far_graphed_caches import full_body_equals_eager  # noqa: E402
from tests.integrations.vllm.test_hot_window import D, HQ, _Window, computed_far, fake_graphs  # noqa: E402


def decode_step_equals_eager(far, store, rows, q) -> None:
    """One decode step of `rows` (req_id, tokens before, 1), queries q [n, HQ, D]: each layer's output
    through `attend_into` (the graphs, where they serve) equals the eager path's merged with random
    near parts, or the near parts alone where no row has a far block."""
    from tierkv.attention import merge_partials

    far.begin_step(rows)
    near = (torch.randn(len(rows), HQ, D), torch.randn(len(rows), HQ))
    for name in NAMES:
        layer = store.layer_index[name]
        saved, far.graphs = far.graphs, None  # the eager path
        far_part = far.attend(layer, q, 0.3)
        far.graphs = saved
        want = near[0] if far_part is None else merge_partials([near, far_part])[0]
        got = torch.full_like(want, float("nan"))
        far.attend_into(got, layer, q, *near, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    far.end_step()


@pytest.mark.parametrize("blocks", [2, 3])
def test_tables_shorter_than_a_selection_serve_the_graphed_step(tmp_path, monkeypatch, blocks):
    """Requests of `blocks` blocks, max_model_len just that (k = 4 blocks): each position from the
    window's end to the last token decodes through the graphs as the eager path does."""
    fake_graphs(monkeypatch)
    window = BS // 2
    store, _, far = computed_far(tmp_path, ("a", "b"), max_rows=2, window=window, blocks=blocks,
                                 max_model_len=blocks * BS)
    try:
        assert far.sparse_blocks > blocks
        served = 0
        for position in range(window - 1, blocks * BS, 3):
            rows = [("a", position, 1), ("b", max(0, position - BS), 1)]
            decode_step_equals_eager(far, store, rows, torch.randn(2, HQ, D))
            served += far.stats()["cuda_graphs"]["graph_rows"]
        assert served > 0, "the graphs must serve some step"
    finally:
        far.close()
        store.close()


def test_the_full_decode_body_serves_requests_shorter_than_a_selection(tmp_path, monkeypatch):
    """`FullDecodeRows.attend` (what vLLM captures) with summary tables shorter than a selection: a row
    with one far block, a row with none and a padded row equal the eager step."""
    from types import SimpleNamespace

    from tierkv.integrations.vllm.full_graph_rows import FullDecodeRows

    fake_graphs(monkeypatch)
    window, blocks = 2 * BS, 3
    store, caches, far = computed_far(tmp_path, ("a", "b"), max_rows=3, window=window, blocks=blocks,
                                      max_model_len=blocks * BS)
    windows = {store.layer_index[n]: _Window(caches[n]) for n in NAMES}
    try:
        full = FullDecodeRows(far, 3, store.layer_index)
        position = {"a": blocks * BS - 1, "b": window - 3}
        rows = far.begin_step([(req, position[req], 1) for req in ("a", "b")])
        assert [r.num_far_blocks for r in rows] == [1, 0] and far.sparse_blocks > blocks
        assert full.write(rows)
        n = 3
        seq_lens = torch.tensor([r.num_computed + 1 for r in rows] + [0], dtype=torch.int32)
        meta = SimpleNamespace(block_table=torch.arange(blocks, dtype=torch.int32).repeat(n, 1),
                               seq_lens=seq_lens, query_start_loc=torch.arange(n + 1, dtype=torch.int32))
        q = torch.randn(n, HQ, D)
        width = -(-(window + BS) // BS) + 1
        shifted = torch.stack([torch.arange(r.num_far_blocks, r.num_far_blocks + width).clamp(max=blocks - 1)
                               for r in rows])
        seqused = torch.tensor([r.num_computed + 1 - r.num_far_blocks * BS for r in rows], dtype=torch.int32)
        full_body_equals_eager(far, full, windows, rows, q, shifted, seqused, meta, window, "short tables")
        far.end_step()
        assert LAYERS == len(windows)
    finally:
        far.close()
        store.close()
