"""GPU: a model that attends its own sliding window (Mistral's config.json sliding_window) through
`TieredLLM(backend="vllm", hot_window=False)`: tierkv's connector runs its plain path (no far reader, no far
staging), a repeated prompt's window blocks come from the tiers, and every token equals plain vLLM's (no
connector) on the same prompts. A 4-layer Mistral-shaped model with random weights and a 256-token window;
prompts of 1500 and 3000 tokens, each run twice."""
from __future__ import annotations

import gc
import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (the GPU machine's bundle: ../shared/device/vllm)")

WINDOW, CONTEXT = 256, 4096


def _build_mistral(path: str) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=CONTEXT,
                           sliding_window=WINDOW, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config.architectures = ["MistralForCausalLM"]
    model = MistralForCausalLM(config)
    for p in model.parameters():  # sharper logits than the default std 0.02: fewer near-ties
        p.data.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def test_a_models_own_window_runs_the_plain_path_with_plain_vllms_tokens(tmp_path):
    from vllm import LLM, SamplingParams

    from tierkv.llm import TieredLLM

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = str(tmp_path / "mistral")
    _build_mistral(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(n)] for n in (1500, 3000)]
    common = dict(max_model_len=CONTEXT, max_num_seqs=1, gpu_memory_utilization=0.3, skip_tokenizer_init=True,
                  enforce_eager=True, enable_prefix_caching=False)
    plain = LLM(model=model, **common)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate([{"prompt_token_ids": p} for p in prompts],
                                                                     params, use_tqdm=False)]
    del plain
    _free()

    kv_per_token = 2 * 4 * 8 * 128 * 2
    config = {"cache": {"block_tokens": 16},
              "tiers": [{"kind": "cpu", "capacity_bytes": kv_per_token * 4 * CONTEXT}]}
    llm = TieredLLM(model, config, backend="vllm", hot_window=False, **common)
    try:
        got, loaded = [], []
        for p in prompts:
            for _ in (0, 1):  # the second run's prompt is a tier hit: its window's blocks are loaded
                before = llm.stats()["counts"].get("blocks_loaded", 0)
                got.append(llm.generate([p], max_new_tokens=8, ignore_eos=True)[0].token_ids)
                loaded.append(llm.stats()["counts"].get("blocks_loaded", 0) - before)
        stats = llm.stats()
    finally:
        llm.close()
        _free()
    assert "hot_window" not in stats  # no far reader, no far staging: the plain path
    assert got == [e for e in expected for _ in (0, 1)]
    assert loaded[0] == 0 and loaded[2] == 0  # first runs: nothing in the tiers yet
    # the repeats load their window's blocks only (vLLM gives the blocks before the window its null block)
    assert all(0 < loaded[2 * i + 1] < len(p) // 16 // 2 for i, p in enumerate(prompts)), loaded
