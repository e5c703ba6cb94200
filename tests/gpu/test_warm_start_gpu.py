"""GPU: an eager TieredLLM under vLLM runs vLLM's warm-up forward at every count of `warm_token_counts` on its
real model runner before serving, and the requests after it give the tokens of an engine started without it
(the warm-up reads and writes no KV). The 8-layer model of benchmarks/vllm_check.py, 4k tokens, two engines
one after the other."""
from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (the GPU machine's bundle: ../shared/device/vllm)")

from benchmarks.bench_vllm_resize import resize_config  # noqa: E402
from benchmarks.vllm_check import build_model, kv_per_token  # noqa: E402

CONTEXT = 4096


def _run(model: str, out: str, prompts: list[list[int]]) -> tuple[list[int], list[list[int]], int]:
    from tierkv.llm import TieredLLM

    config = resize_config(out, "exact", kv_per_token(), CONTEXT)
    llm = TieredLLM(model, config, backend="vllm", max_model_len=CONTEXT + 64, max_num_seqs=1,
                    gpu_memory_utilization=0.5, skip_tokenizer_init=True, enable_prefix_caching=False)
    try:  # each prompt twice: the second run's prefix comes from the tiers, its last tokens computed
        outs = [llm.generate([p], max_new_tokens=8, ignore_eos=True)[0].token_ids for p in prompts for _ in (0, 1)]
        step = llm.engine.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        return list(llm.warmed_token_counts), outs, step
    finally:
        llm.close()


def test_the_warm_up_runs_every_count_and_changes_no_token(tmp_path, monkeypatch):
    from tierkv.integrations.vllm import llm as vllm_front
    from tierkv.integrations.vllm.warm_start import warm_token_counts

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = str(tmp_path / "model")
    build_model(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(n)] for n in (CONTEXT - 31, 1500)]
    counts, warmed, step = _run(model, str(tmp_path / "a"), prompts)
    assert counts == warm_token_counts(step) and counts[:64] == list(range(1, 65))
    monkeypatch.setattr(vllm_front, "warm_engine", lambda llm: [])
    none, cold, _ = _run(model, str(tmp_path / "b"), prompts)
    assert none == [] and warmed == cold
