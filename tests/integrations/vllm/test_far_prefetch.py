"""The full decode graph's next-step prefetch (`far_prefetch.MarginPrefetch`,
scheduler.sparse_prefetch_margin) on CPU: the output stays the eager step's, the blocks ranked below
a selection are in the cache at the next step, and a margin that does not fit is a config error."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from tierkv.attention import merge_partials  # noqa: E402
from tierkv.config import ConfigError, load_config  # noqa: E402
from tierkv.integrations.vllm.full_graph_rows import FullDecodeRows  # noqa: E402
from tierkv.sparse.prefetch_margin import MarginPrefetch, check_margin  # noqa: E402

from tests.integrations.vllm.test_connector import BS, LAYERS, NAMES  # noqa: E402
from tests.integrations.vllm.test_hot_window import HQ, D, _Window, computed_far, fake_graphs, write_config  # noqa: E402

FULL = ("sparse_full_graphs: true",)


def drifting_steps(tmp_path, margin: int, steps: int, queries: list[torch.Tensor]) -> dict:
    """`steps` decode steps of one request through FullDecodeRows.attend, caches of two selections,
    the next-step prefetch of `margin` blocks per layer (0: off); each step's output checked against
    the eager step's. The far path's stats after the last step."""
    window, blocks = 2 * BS, 30
    lines = FULL + ((f"sparse_prefetch_margin: {margin}",) if margin else ())
    store, caches, far = computed_far(tmp_path, ("a",), max_rows=2, staging_blocks=128, window=window, blocks=blocks,
                                      max_model_len=blocks * BS, cache_selections=2, scheduler_lines=lines)
    windows = {store.layer_index[n]: _Window(caches[n]) for n in NAMES}
    try:
        full = FullDecodeRows(far, 2, store.layer_index)
        assert (full.prefetch is not None) == bool(margin)
        position = (blocks - 3) * BS - 4
        for step in range(steps):
            rows = far.begin_step([("a", position + step, 1)])
            assert rows[0].num_far_blocks > far.sparse_blocks + margin
            assert full.write(rows)
            full.counted_step(rows)
            n = 2  # padded to a captured size: the second row reads nothing
            seq_lens = torch.tensor([rows[0].num_computed + 1, 0], dtype=torch.int32)
            meta = SimpleNamespace(block_table=torch.arange(blocks, dtype=torch.int32).repeat(n, 1),
                                   seq_lens=seq_lens, query_start_loc=torch.arange(n + 1, dtype=torch.int32))
            q = torch.cat([queries[step], torch.zeros(1, HQ, D)])
            shifted = torch.arange(rows[0].num_far_blocks, rows[0].num_far_blocks + 8).unsqueeze(0)
            seqused = torch.tensor([rows[0].num_computed + 1 - rows[0].num_far_blocks * BS], dtype=torch.int32)
            for layer, win in windows.items():
                near = win(q[:1], shifted.to(torch.int32), seqused, meta.query_start_loc[:2], window + BS)
                saved, far.graphs = far.graphs, None  # the eager path, same FarKV
                want = merge_partials([near, far.attend(layer, q[:1], 0.3)])[0]
                far.graphs = saved
                got = torch.full((n, HQ, D), float("nan"))
                full.attend(got, layer, q, 0.3, win, meta)
                torch.testing.assert_close(got[:1], want, rtol=1e-5, atol=1e-6, msg=f"step {step} layer {layer}")
            far.end_step()
        return far.stats()
    finally:
        far.close()
        store.close()


def test_the_next_step_prefetch_keeps_the_output_and_turns_next_steps_misses_into_hits(tmp_path, monkeypatch):
    """A query drifting from one direction to another changes its selection a little each step. With
    the prefetch each layer's blocks ranked just below its selection are copied into the cache, so the
    next step finds most of what it adds: more hits and fewer misses (stalls) than without, every step's
    output equal to the eager path's, every prefetched block counted once (held or copied), its
    copies counted in the bytes that crossed PCIe, and the copied blocks a later selection read
    counted as used (the prefetch's precision and recall)."""
    torch.manual_seed(7)
    fake_graphs(monkeypatch)
    steps = 16
    start, end = torch.randn(1, HQ, D), torch.randn(1, HQ, D)
    queries = [start + (end - start) * s / (steps - 1) for s in range(steps)]
    stats = {}
    for margin in (0, 4):
        (tmp_path / str(margin)).mkdir()
        stats[margin] = drifting_steps(tmp_path / str(margin), margin, steps, queries)
    k = 4  # computed_far's budget: 4 blocks
    for margin, s in stats.items():
        assert s["cache_hits"] + s["cache_misses"] == steps * LAYERS * k
    off, on = stats[0], stats[4]
    assert on["cache_misses"] < off["cache_misses"] and on["cache_hits"] > off["cache_hits"]
    assert on["cache_stalled_rows"] <= off["cache_stalled_rows"]
    prefetch = on["full_decode_graphs"]
    assert prefetch["prefetch_held"] + prefetch["prefetch_copied"] == steps * LAYERS * 4
    assert prefetch["prefetch_copied"] > 0
    block_bytes = 2 * 2 * BS * D * 4  # H = 2 KV heads, float32
    assert on["cache_copied_bytes"] == (on["cache_misses"] + prefetch["prefetch_copied"]) * block_bytes
    assert "prefetch_copied" not in off["full_decode_graphs"]
    # of the blocks the margin copied in, those a later selection read: each such read is a hit
    used = prefetch["prefetch_used"]
    assert 0 < used <= min(prefetch["prefetch_copied"], on["cache_hits"])
    assert prefetch["prefetch_precision"] == used / prefetch["prefetch_copied"]
    assert prefetch["prefetch_recall"] == used / (used + on["cache_misses"])


def test_a_prefetch_margin_that_does_not_fit_is_a_config_error(tmp_path, monkeypatch):
    """The margin needs the full decode graph and caches of two selections or more (checked when the
    config loads), and slots beside the selection (checked when the graph's rows are built: k = 4
    here, two selections hold 8 slots per layer, so a margin of 5 does not fit)."""
    for lines, words in ((("sparse_prefetch_margin: 2",), "sparse_full_graphs"),
                         (FULL + ("sparse_prefetch_margin: 2", "sparse_cache_selections: 1"), "set it to 2")):
        path = write_config(tmp_path, window=2 * BS, staging_blocks=64, sparse_tokens=4 * BS, sparse_graphs=True,
                            scheduler_lines=lines)
        if "sparse_cache_selections: 1" in lines:  # the helper writes its own selections line: keep one
            text = open(path).read().replace("  sparse_cache_selections: 1\n", "", 1)
            open(path, "w").write(text)
        with pytest.raises(ConfigError, match="sparse_prefetch_margin") as err:
            load_config(path, env={})
        assert words in str(err.value)
    fake_graphs(monkeypatch)
    store, _, far = computed_far(tmp_path, ("a",), max_rows=2, staging_blocks=128, max_model_len=30 * BS, cache_selections=2,
                                 scheduler_lines=FULL + ("sparse_prefetch_margin: 5",))
    try:
        with pytest.raises(ConfigError, match="needs 9; raise scheduler.sparse_cache_selections to 3 or lower the "
                                              "margin to 4"):
            FullDecodeRows(far, 2, store.layer_index)
        assert MarginPrefetch(far.source, far.row_caches, 4, 2).margin == 4
    finally:
        far.close()
        store.close()
    with pytest.raises(ConfigError, match="keep nothing across steps"):
        check_margin(2, 4, 4, per_layer=False)
    check_margin(0, 4, 4, per_layer=False)  # no margin: nothing to fit


def test_a_margin_for_the_transformers_engine_is_refused_under_vllm(tmp_path):
    """The loader lets predictor 'cache' (the transformers engine's) carry a margin; vLLM's connector,
    whose margin runs only inside its full decode graph, refuses it without that graph."""
    from tierkv.integrations.vllm.config import config_from_kv_transfer

    path = write_config(tmp_path, window=2 * BS, staging_blocks=64, sparse_tokens=4 * BS, sparse_graphs=True,
                        cache_selections=2, scheduler_lines=("predictor: cache", "sparse_prefetch_margin: 2"))
    assert load_config(path, env={}).scheduler.sparse_prefetch_margin == 2
    with pytest.raises(ConfigError, match="sparse_prefetch_margin.*under vLLM.*sparse_full_graphs true"):
        config_from_kv_transfer({"config_file": path}, block_size=BS, env={})
    text = open(path).read() + "  sparse_full_graphs: true\n"
    open(path, "w").write(text)
    assert config_from_kv_transfer({"config_file": path}, block_size=BS, env={}).scheduler.sparse_full_graphs
