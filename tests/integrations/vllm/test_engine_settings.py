"""TieredLLM(backend="vllm")'s engine settings vLLM would refuse only after loading the model, checked before it
starts: a block_size other than cache.block_tokens (the connector refused it once running), and under the hot
window a quantized kv_cache_dtype (the attention backend refused it at the first forward) or
`scheduler.sparse_selection: per_kv_head` (the worker refused it when vLLM handed it the caches)."""
from __future__ import annotations

import pytest

from tests.integrations.vllm.test_hot_window import _checkpoint
from tierkv.config import ConfigError, load_config

pytest.importorskip("vllm")


def _args(tmp_path, *, hot_window: bool = True, policy: str = "exact", selection: str = "per_layer", **kwargs):
    from tierkv.integrations.vllm.engine_args import tiered_engine_args

    config = load_config({"cache": {"block_tokens": 64, "gpu_budget_bytes": "8GiB", "window_tokens": 2048},
                          "scheduler": {"policy": policy, "staging_bytes": "512MiB", "prefill_chunk_tokens": 128,
                                        "sparse_selection": selection}}, env={})
    return tiered_engine_args(_checkpoint(tmp_path), config, str(tmp_path / "tierkv.yaml"), kwargs,
                              hot_window=hot_window, max_model_len=None, gpu_memory_utilization=0.5,
                              enable_prefix_caching=False)


@pytest.mark.parametrize("hot_window", [True, False])
def test_a_block_size_other_than_the_config_s_blocks_is_refused_by_name(tmp_path, hot_window):
    with pytest.raises(ValueError, match=r"block_size: got 16; .*cache\.block_tokens \(64\)"):
        _args(tmp_path, hot_window=hot_window, block_size=16)
    assert _args(tmp_path, hot_window=hot_window, block_size=64).kwargs["block_size"] == 64


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "nvfp4"])
def test_a_quantized_vllm_kv_cache_is_refused_under_the_hot_window_only(tmp_path, dtype):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype: got '{dtype}'; the hot window keeps vLLM's pool"):
        _args(tmp_path, kv_cache_dtype=dtype)
    assert _args(tmp_path, hot_window=False, kv_cache_dtype=dtype).kwargs["kv_cache_dtype"] == dtype
    assert _args(tmp_path, kv_cache_dtype="bfloat16").kwargs["kv_cache_dtype"] == "bfloat16"


def test_per_kv_head_selection_is_refused_under_the_hot_window_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"scheduler\.sparse_selection'?: got 'per_kv_head'") as refused:
        _args(tmp_path, policy="sparse", selection="per_kv_head")
    assert refused.value.key == "scheduler.sparse_selection"
    _args(tmp_path, policy="exact", selection="per_kv_head")  # the exact policy selects nothing


def test_the_plan_refuses_per_kv_head_selection_under_vllm(tmp_path):
    from tierkv.cli.plan import PRESETS, make_plan

    config = load_config({"cache": {"block_tokens": 64}, "scheduler": {"policy": "sparse",
                                                                       "sparse_selection": "per_kv_head"}}, env={})
    with pytest.raises(ConfigError, match=r"scheduler\.sparse_selection"):
        make_plan(PRESETS["llama-3.1-8b"], 131072, config, backend="vllm")
