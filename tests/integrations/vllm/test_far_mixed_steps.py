"""Steps that mix decoding rows with a prefill chunk streaming far KV (`far_graphed.GraphedRows.plan`):
the graphs, and so the far-block caches, serve the decoding rows beside the streamed chunks, on CPU
with the graphs' recording replaced (tests/integrations/vllm/test_hot_window.fake_graphs)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tierkv.attention import merge_partials  # noqa: E402

from tests.integrations.vllm.test_connector import BS, LAYERS, NAMES, NUM_BLOCKS  # noqa: E402
from tests.integrations.vllm.test_hot_window import H, HQ, D, computed_far, fake_graphs  # noqa: E402


def test_decoding_rows_beside_a_streaming_prefill_chunk_are_graphed_and_cached(tmp_path, monkeypatch):
    """Two decoding rows and, between them, a prefill chunk of a request whose far blocks stream in
    full: the graphs serve both decoding rows (their caches count their selections; the second step
    finds them held, the same queries), the prefill row streams its chunks the eager way, and every
    layer's output equals an engine without graphs."""
    fake_graphs(monkeypatch)
    blocks = 30
    caches = {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}
    (tmp_path / "eager").mkdir()
    (tmp_path / "graphs").mkdir()
    eager_store, _, eager = computed_far(tmp_path / "eager", ("a", "p", "b"), max_rows=2, staging_blocks=128,
                                         sparse_graphs=False, blocks=blocks, caches=caches)
    graph_store, _, graphed = computed_far(tmp_path / "graphs", ("a", "p", "b"), max_rows=2, staging_blocks=128,
                                           blocks=blocks, caches=caches)
    k = graphed.sparse_blocks
    try:
        q = torch.randn(1 + 8 + 1, HQ, D)
        for step in range(2):
            rows = [("a", blocks * BS - 4 + step, 1), ("p", 20 * BS, 8), ("b", blocks * BS - 9 + step, 1)]
            for far in (eager, graphed):
                far_rows = far.begin_step(rows)
            assert far_rows[1].num_far_blocks > 0 and graphed._pieces  # the prefill chunk streams far KV
            near = (torch.randn(q.shape[0], HQ, D), torch.randn(q.shape[0], HQ))
            for name in NAMES:
                layer = graph_store.layer_index[name]
                want = merge_partials([near, eager.attend(layer, q, 0.3)])[0]
                got = torch.full_like(want, float("nan"))
                graphed.attend_into(got, layer, q, *near, 0.3)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step} layer {layer}")
            for far in (eager, graphed):
                far.end_step()
        stats = graphed.stats()
        assert graphed.graphs.counts["graph_rows"] == 2 * 2 * LAYERS  # both decoding rows, both steps, every layer
        assert stats["cache_hits"] + stats["cache_misses"] == 2 * 2 * k * LAYERS
        assert stats["cache_hits"] >= 2 * (k - 1) * LAYERS  # the second step: the same queries, nearly all held
        assert stats["chunks_streamed"] > 0
    finally:
        for far, store in ((eager, eager_store), (graphed, graph_store)):
            far.close()
            store.close()
