"""GPU: the sparse policy's staging (ring, eager regions, far-block caches) follows a run-time GPU
budget under eager vLLM (`FarKV.make_staging` / `use_staging`): a shrink between requests returns the
pool's and the staging's bytes to the driver, tierkv's step graphs are captured again over the new
caches, and greedy tokens do not change; a grow restores the start-up staging. The 8-layer model of
benchmarks/vllm_check.py at a 16k context, in a module of its own (one engine per module)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (the GPU machine's bundle: ../shared/device/vllm)")

from benchmarks.bench_vllm_resize import BIG, free_elsewhere  # noqa: E402
from tests.gpu.test_vllm_resize_gpu import prompt, repeat_tokens, resizable_engine, tokens  # noqa: E402


@pytest.fixture(scope="module")
def sparse_llm(tmp_path_factory):
    engine = resizable_engine(tmp_path_factory, "sparse", enforce_eager=True)
    yield engine
    engine.close()


def test_a_shrink_remakes_the_sparse_staging_frees_it_and_tokens_stay(sparse_llm):
    llm = sparse_llm
    reference = repeat_tokens(llm, prompt(1))
    before, gpu_before = llm.stats()["hot_window"], llm.stats()["gpu"]
    free_before = free_elsewhere()
    # every row's window beside half the staging: vLLM's pool gives up its blocks first, then the staging is cut
    tight = (llm.resizer.rows_pool_bytes + llm.summary_reserved_bytes + llm.full_graph_reserved_bytes
             + llm.config.scheduler.staging_bytes // 2)
    assert tight < BIG
    llm.set_gpu_budget(tight)
    freed = free_elsewhere() - free_before
    after, gpu_after = llm.stats()["hot_window"], llm.stats()["gpu"]
    staging_freed = before["staging_bytes"] - after["staging_bytes"]
    assert staging_freed > 0
    assert freed >= 0.95 * (gpu_before["pool_bytes"] - gpu_after["pool_bytes"] + staging_freed)
    assert tokens(llm, prompt(1)) == reference
    graphs = llm.stats()["hot_window"]["cuda_graphs"]
    assert graphs is None or graphs["graph_captures"] >= (before["cuda_graphs"] or {}).get("graph_captures", 0)
    llm.set_gpu_budget(BIG)
    assert llm.stats()["hot_window"]["staging_bytes"] == before["staging_bytes"]
    assert tokens(llm, prompt(1)) == reference
