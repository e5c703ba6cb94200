"""GPU: planted needles in a 128k context, at the Llama-3.1-8B attention shape (32 query heads, 8 KV
heads, head_dim 128) in bf16, fresh random draws each run. Recall of the planted blocks at least 99%,
output within 1e-2 of dense attention over all 128k tokens (the same bf16 KV, float32 math) at a
2048-token budget, and the window alone far off:

- the vLLM backend's far path (`FarKV`), eagerly and replayed from its CUDA graphs;
- the transformers engine (`SequenceKV`).

The CPU suite runs the same checks through the PyTorch reference paths
(tests/sparse/test_planted_needle_far.py, tests/sparse/test_planted_needle.py)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tests.sparse import test_planted_needle as transformers_engine  # noqa: E402
from tests.sparse.test_planted_needle_far import check_planted_needles  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128


@pytest.mark.parametrize("graphs", [False, True])
def test_planted_needles_in_the_far_path_on_cuda(tmp_path, graphs):
    worst = check_planted_needles(tmp_path, HEADS, KV_HEADS, DIM, 64, torch.bfloat16, "cuda", graphs=graphs)
    print(f"far path, graphs {graphs}: largest relative error {worst:.2e}")


def test_planted_needles_in_the_transformers_engine_on_cuda():
    transformers_engine.check_planted_needles(HEADS, KV_HEADS, DIM, torch.bfloat16, "cuda")


def test_the_cached_predictor_replays_its_graphs_and_equals_none_on_cuda():
    """Predictor `cache` in the transformers engine on CUDA: the far part of each decode step replayed
    from one CUDA graph per layer (captured at the first step), outputs equal predictor `none`'s, the
    repeated selection read from the caches, and within 1e-2 of dense attention."""
    from tests.sparse.test_cached_predictor import decode_steps
    from tests.sparse.test_planted_needle import CONTEXT, T
    from tests.sparse.test_planted_needle_far import planted_case

    q, keys, values, _ = planted_case(HEADS, KV_HEADS, DIM, T, CONTEXT, device="cuda")
    keys, values = keys[:CONTEXT], values[:CONTEXT]
    none = decode_steps("none", q, keys, values, 3, dtype=torch.bfloat16)
    cached = decode_steps("cache", q, keys, values, 3, dtype=torch.bfloat16)
    k = 2048 // T
    for (out_none, *_), (out, _, _, dense, *_) in zip(none, cached):
        torch.testing.assert_close(out, out_none, rtol=2e-2, atol=2e-3)
        assert ((out - dense).norm() / dense.norm()).item() <= 1e-2
    assert [c[4] for c in cached] == [(0, k), (k, k), (2 * k, k)]
    graphs = cached[-1][5]
    assert graphs is not None and graphs["graph_capture_errors"] == 0, graphs
    assert graphs["graph_captures"] == 1 and graphs["graph_replays"] == 3, graphs


def test_the_cached_predictors_prefetch_margin_runs_inside_its_graphs_on_cuda():
    """Predictor `cache` with a prefetch margin on CUDA: each layer's graph forks the margin's copy and
    joins it; the second step finds the blocks the first ranked below its selection (the CPU test's
    counts), and the output stays predictor `none`'s."""
    from tests.sparse.test_cached_predictor import margin_case

    steps, stats, cached = margin_case(4, device="cuda")
    graphs = cached["cuda_graphs"]
    assert graphs is not None and graphs["graph_capture_errors"] == 0, graphs
    assert graphs["graph_captures"] == 1 and graphs["graph_replays"] == 2, graphs
    assert [counts for _, counts in steps] == [[0, 4], [4, 4]]
    assert (cached["prefetch"]["prefetch_copied"], cached["prefetch"]["prefetch_used"]) == (8, 4)
    assert stats["scheduler"]["stalls"] == 1
