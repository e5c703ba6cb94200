"""An eager vLLM engine runs its forward at a ladder of token counts at start-up (`warm_start`), so a request's
first step at a new count (a repeated prefix's last 33 tokens) does not pay its GEMMs' first launch; a compiled
engine (whose start-up runs its CUDA graph capture sizes) is left as it is. The forwards themselves run on the GPU
machine (tests/gpu/test_warm_start_gpu.py)."""
from __future__ import annotations

from types import SimpleNamespace

import inspect

import pytest
import torch

from tierkv.integrations.vllm.warm_start import _run_counts, warm_engine, warm_token_counts


def test_the_ladder_covers_every_small_count_and_stays_within_the_step():
    counts = warm_token_counts(8192)
    assert counts[:64] == list(range(1, 65)) and counts == sorted(set(counts))
    assert {72, 128, 256, 512, 1024, 4096, 8192} <= set(counts) and max(counts) == 8192
    assert warm_token_counts(33) == list(range(1, 34))
    assert warm_token_counts(300)[-3:] == [248, 256, 300]
    assert len(warm_token_counts(1 << 16)) < 120  # about a second of forwards for an 8B model
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="max_tokens: got"):
            warm_token_counts(bad)


def _engine(enforce_eager: bool, max_tokens: int = 2048, fail_at: int | None = None, workers: int = 1):
    ran = []

    def dummy_run(n, **kwargs):
        if n == fail_at:
            raise torch.OutOfMemoryError(f"no memory for {n} tokens")
        ran.append((n, kwargs))

    worker = SimpleNamespace(model_runner=SimpleNamespace(
        _dummy_run=dummy_run, lora_config="lora",
        maybe_remove_all_loras=lambda config: ran.append(("loras removed", config))))
    config = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=enforce_eager),
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config),
                          collective_rpc=lambda method, timeout=None, args=(), kwargs=None: [
                              method(worker, *args) for _ in range(workers)])
    return llm, ran


def test_an_eager_engine_runs_vllm_s_warm_up_forward_at_each_count_on_its_workers():
    llm, ran = _engine(enforce_eager=True, max_tokens=2048)
    counts = warm_engine(llm)
    assert counts == warm_token_counts(2048) and [n for n, _ in ran[:-1]] == counts
    assert all(kwargs == {"skip_eplb": True, "remove_lora": False} for _, kwargs in ran[:-1])  # vLLM's own warm-up call
    assert ran[-1] == ("loras removed", "lora")  # once, after the runs, as vLLM's warm-up does


def test_a_failing_warm_up_is_logged_and_the_engine_serves_without_it(caplog):
    llm, ran = _engine(enforce_eager=True)

    def refuse(method, timeout=None, args=(), kwargs=None):
        raise RuntimeError("worker refused")

    llm.collective_rpc = refuse
    assert warm_engine(llm) == []
    assert any("worker refused" in r.getMessage() and "serves without the rest" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_forward_failing_mid_ladder_reports_the_counts_run_and_still_removes_the_dummy_adapters(caplog, workers):
    """vLLM's LoRA warm-up context removes its dummy adapters only on a clean exit: after a failure at count 40
    they would stay registered (a request's adapter of the same id would run on them) unless removed here."""
    llm, ran = _engine(enforce_eager=True, fail_at=40, workers=workers)
    assert warm_engine(llm) == list(range(1, 40))
    assert ran.count(("loras removed", "lora")) == workers and ran[-1] == ("loras removed", "lora")
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "stopped after 39 of" in message and "OutOfMemoryError: no memory for 40 tokens" in message


def test_the_call_binds_to_vllm_s_own_warm_up_forward():
    """The arguments `_run_counts` passes are those of vLLM's `GPUModelRunner._dummy_run` (the one vLLM's compiled
    start-up calls the same way), read from the installed vLLM, not a stand-in."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    signature = inspect.signature(GPUModelRunner._dummy_run)
    signature.bind(object(), 33, skip_eplb=True, remove_lora=False)
    assert signature.parameters["remove_lora"].default is True  # why the runs pass False and remove them once
    inspect.signature(GPUModelRunner.maybe_remove_all_loras).bind(object(), None)


def test_a_compiled_engine_is_not_run_again():
    llm, ran = _engine(enforce_eager=False)
    assert warm_engine(llm) == [] and ran == []


def test_tieredllm_warms_an_eager_engine_at_start_up(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from tests.integrations.vllm.test_hot_window import _checkpoint, fake_vllm_llm
    from tierkv.integrations.vllm.llm import VllmTieredLLM

    given = fake_vllm_llm(monkeypatch)
    config = {"cache": {"block_tokens": 64, "gpu_budget_bytes": "8GiB"},
              "scheduler": {"staging_bytes": "512MiB", "prefill_chunk_tokens": 256}}
    llm = VllmTieredLLM(_checkpoint(tmp_path), config, max_model_len=4096)
    try:
        assert given["enforce_eager"] is True  # the exact hot window's default
        (method, args), = given["rpc"]
        assert method is _run_counts and args == (warm_token_counts(256),)
        assert llm.warmed_token_counts == warm_token_counts(256)
    finally:
        llm.close()


def test_a_failing_adapter_removal_is_reported_beside_the_counts_that_ran(caplog):
    llm, ran = _engine(enforce_eager=True)

    def refuse(config):
        raise RuntimeError("adapter registry gone")

    runner = SimpleNamespace(_dummy_run=lambda n, **kwargs: ran.append((n, kwargs)), lora_config="lora",
                             maybe_remove_all_loras=refuse)
    llm.collective_rpc = lambda method, timeout=None, args=(), kwargs=None: [method(SimpleNamespace(model_runner=runner),
                                                                                    *args)]
    counts = warm_token_counts(2048)
    assert warm_engine(llm) == counts  # every forward ran: the counts are kept, the removal's failure is said
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "removing the dummy LoRA adapters: RuntimeError: adapter registry gone" in message
