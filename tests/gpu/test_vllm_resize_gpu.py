"""GPU: the vLLM hot-window pool shrunk and grown at run time (set_gpu_budget on backend="vllm"):
the memory shows as free to another process within a second, vLLM's own block count follows,
and greedy tokens do not change, between and during requests. An 8-layer model of
benchmarks/vllm_check.py at a 16k context; the 128k rows are benchmarks/bench_vllm_resize.py."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (the GPU machine's bundle: ../shared/device/vllm)")

from benchmarks.bench_vllm_resize import BIG, SMALL, free_elsewhere, resize_config, tight_budget  # noqa: E402
from benchmarks.vllm_check import build_model, kv_per_token  # noqa: E402

CONTEXT, TOKENS = 16_000, 24


def resizable_engine(tmp_path_factory, policy: str, **engine_args):
    """A TieredLLM under vLLM of the 8-layer model with the hot window of `bench_vllm_resize.resize_config`
    for `policy`, one request at a time, at CONTEXT tokens."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tierkv.llm import TieredLLM

    model = str(tmp_path_factory.mktemp("model"))
    build_model(model)
    config = resize_config(str(tmp_path_factory.mktemp("out")), policy, kv_per_token(), CONTEXT)
    return TieredLLM(model, config, backend="vllm", max_model_len=CONTEXT + 256, max_num_seqs=1,
                     gpu_memory_utilization=0.5, skip_tokenizer_init=True, enable_prefix_caching=False, **engine_args)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    engine = resizable_engine(tmp_path_factory, "exact")
    yield engine
    engine.close()


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(CONTEXT)]


def tokens(llm, ids) -> list[int]:
    return llm.generate([ids], max_new_tokens=TOKENS, ignore_eos=True)[0].token_ids


def repeat_tokens(llm, ids) -> list[int]:
    """Tokens of a repeat of `ids` (its prefix served by the tiers, as every later run of it is): the
    first run computes the prompt and attends its last chunk in another order (other bf16 rounding)."""
    llm.generate([ids], max_new_tokens=1, ignore_eos=True)
    return tokens(llm, ids)


def test_a_shrink_between_requests_frees_the_pool_for_another_process_and_tokens_stay(llm):
    reference = repeat_tokens(llm, prompt(1))
    pool_before = llm.stats()["gpu"]["pool_bytes"]
    free_before = free_elsewhere()
    started = time.perf_counter()
    llm.set_gpu_budget(SMALL)
    assert time.perf_counter() - started < 1.0
    freed = free_elsewhere() - free_before
    stats = llm.stats()["gpu"]
    expected = pool_before - stats["pool_bytes"]
    assert expected > GiB_QUARTER and freed >= 0.95 * expected
    assert llm.engine.llm_engine.vllm_config.cache_config.num_gpu_blocks == stats["pool_blocks"]
    assert tokens(llm, prompt(1)) == reference
    llm.set_gpu_budget(BIG)
    assert llm.stats()["gpu"]["pool_bytes"] == pool_before and tokens(llm, prompt(1)) == reference


GiB_QUARTER = 1 << 28


def test_a_shrink_that_cuts_the_ring_frees_its_bytes_whole_and_tokens_stay(llm):
    """Every row's window beside half the staging: vLLM's pool and the staging ring both shrink, from buffers a
    resize made (the 0.5 GiB step first). Each lives in an allocator pool of its own (`own_segments`), so all
    their bytes go back (from the shared pool, segments other tensors held kept some: 0.25-0.66x on the H100)."""
    reference = repeat_tokens(llm, prompt(1))
    llm.set_gpu_budget(SMALL)
    before = llm.stats()
    tight = tight_budget(llm)
    free_before = free_elsewhere()
    llm.set_gpu_budget(tight)
    freed = free_elsewhere() - free_before
    after = llm.stats()
    staging = [s["hot_window"]["staging_bytes"] for s in (before, after)]
    assert staging[1] < staging[0]  # the ring was re-made smaller
    expected = before["gpu"]["pool_bytes"] - after["gpu"]["pool_bytes"] + staging[0] - staging[1]
    assert freed >= 0.95 * expected, f"{freed} of {expected} bytes seen free by another process"
    assert tokens(llm, prompt(1)) == reference
    llm.set_gpu_budget(BIG)


@pytest.mark.parametrize("budget", [SMALL, BIG])
def test_a_change_during_a_request_applies_at_a_step_boundary_and_tokens_stay(llm, budget):
    llm.set_gpu_budget(BIG if budget == SMALL else SMALL)
    reference = repeat_tokens(llm, prompt(2))
    core, applied = llm.resizer.core, {}
    during_before = llm.stats()["gpu"]["changes_during_requests"]

    def change():
        while not core.scheduler.has_unfinished_requests():
            time.sleep(0.001)
        llm.set_gpu_budget(budget, timeout_s=300)
        applied["during"] = core.scheduler.has_unfinished_requests()  # still running when it applied

    thread = threading.Thread(target=change)
    thread.start()
    out = tokens(llm, prompt(2))
    thread.join()
    assert out == reference and llm.stats()["gpu"]["budget_bytes"] == budget and "during" in applied
    if budget == BIG:  # a grow never waits for blocks: it applies at a boundary of the running request
        assert llm.stats()["gpu"]["changes_during_requests"] == during_before + 1


def test_a_budget_too_small_for_one_window_is_refused_and_the_engine_goes_on(llm):
    from tierkv.budget_change import BudgetRefused

    before = llm.stats()["gpu"]
    # half a window's blocks: the staging ring follows the budget, so any fixed size could fit a window
    too_small = llm.resizer.window_blocks // 2 * llm.resizer.bytes_per_block
    with pytest.raises(BudgetRefused, match="window needs"):
        llm.set_gpu_budget(too_small)
    assert llm.stats()["gpu"]["pool_blocks"] == before["pool_blocks"]
    assert len(tokens(llm, prompt(3))) == TOKENS
