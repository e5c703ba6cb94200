"""`cache.window_tokens: 0`: the transformers engine runs it, vLLM's hot window cannot.

The schema keeps 0 (the transformers engine's GPU keeps the sinks and the block being written, and decodes
the dense tokens). Under vLLM the window is each layer's sliding window and the worker's far part, which
refused 0 only in `register_kv_caches`, after vLLM loaded the model, as a ValueError that named no key.
It is refused as a ConfigError naming `cache.window_tokens` by the pool check TieredLLM runs before vLLM
starts, by `tierkv plan --backend vllm`, and by the connector where the engine runs the hot window; an engine
without it (`hot_window=False`, a plain pool) never reads the window and runs with 0.
"""
from __future__ import annotations

import pytest
import torch

from tests.models import build, reference_greedy
from tierkv.cli.plan import PRESETS, make_plan
from tierkv.config import ConfigError, load_config
from tierkv.integrations.vllm.config import config_from_kv_transfer
from tierkv.integrations.vllm.pool_sizing import check_hot_window_pool
from tierkv.llm import TieredLLM
from tierkv.sampling import SamplingParams

BLOCK_BYTES = 2 * 2 * 4 * 16 * 4  # K+V, 2 kv heads, 4 tokens, head_dim 16, fp32
SHAPE = {"num_hidden_layers": 4, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
         "dtype_bytes": 2, "sliding_window": None}
REFUSED = r"cache\.window_tokens'?: got 0; under vLLM it must be at least 1"


def test_the_transformers_engine_decodes_a_window_of_0_tokens_as_dense_attention():
    model, reference = build("llama", num_heads=8, num_kv_heads=2)
    config = load_config({
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 0, "window_tokens": 0},
        "tiers": [{"kind": "cpu", "capacity_bytes": 4096 * BLOCK_BYTES}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
    }, env={})
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    with TieredLLM(model, config, show_progress=False) as llm:
        (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=4))
    assert out.token_ids == reference_greedy(reference, prompt, 4)[0]


def _vllm_config_file(tmp_path, window: int) -> str:
    path = tmp_path / f"w{window}.yaml"
    path.write_text(f"cache: {{block_tokens: 64, window_tokens: {window}}}\n")
    return str(path)


def test_the_vllm_connector_config_loads_a_window_of_0_tokens_for_engines_without_the_hot_window(tmp_path):
    """A plain pool (hot_window=False) never reads the window: the connector's config takes 0; the connector
    refuses it where a layer takes the hot-window spec (tests/integrations/vllm/test_connector_settings.py)."""
    assert config_from_kv_transfer({"config_file": _vllm_config_file(tmp_path, 0)}, block_size=64,
                                   env={}).cache.window_tokens == 0


def test_tieredllm_s_pool_check_and_the_vllm_plan_refuse_a_window_of_0_tokens(tmp_path):
    """The checks that read the config itself before vLLM starts (TieredLLM loads no connector config)."""
    config = load_config(_vllm_config_file(tmp_path, 0), env={})
    engine = {"max_num_batched_tokens": 8192, "max_model_len": 131072, "kv_cache_memory_bytes": 1 << 30}
    with pytest.raises(ConfigError, match=REFUSED):
        check_hot_window_pool(SHAPE, config, engine)
    with pytest.raises(ConfigError, match=REFUSED):
        make_plan(PRESETS["llama-3.1-8b"], 131072, config, backend="vllm")
    assert make_plan(PRESETS["llama-3.1-8b"], 131072, config)["gpu"]  # the transformers engine's plan runs it
