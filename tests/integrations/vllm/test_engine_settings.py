"""TieredLLM(backend="vllm")'s engine settings vLLM would refuse only after loading the model, checked before it
starts: a block_size other than cache.block_tokens (the connector refused it once running), and under the hot
window a quantized kv_cache_dtype (the attention backend refused it at the first forward) or
`scheduler.sparse_selection: per_kv_head` (the worker refused it when vLLM handed it the caches)."""
from __future__ import annotations

import pytest

from tests.integrations.vllm.test_hot_window import _checkpoint
from tierkv.config import ConfigError, load_config

pytest.importorskip("vllm")


def _args(tmp_path, *, hot_window: bool = True, policy: str = "exact", selection: str = "per_layer",
          prefix_caching: bool | None = False, **kwargs):
    from tierkv.integrations.vllm.engine_args import tiered_engine_args

    config = load_config({"cache": {"block_tokens": 64, "gpu_budget_bytes": "8GiB", "window_tokens": 2048},
                          "scheduler": {"policy": policy, "staging_bytes": "512MiB", "prefill_chunk_tokens": 128,
                                        "sparse_selection": selection}}, env={})
    return tiered_engine_args(_checkpoint(tmp_path), config, str(tmp_path / "tierkv.yaml"), kwargs,
                              hot_window=hot_window, max_model_len=None, gpu_memory_utilization=0.5,
                              enable_prefix_caching=prefix_caching)


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


@pytest.mark.parametrize("hot_window", [True, False])
def test_another_kv_connector_is_refused_by_name_not_run_in_tierkv_s_place(tmp_path, hot_window):
    """A kv_transfer_config among TieredLLM's engine arguments replaced tierkv's connector while the pool stayed
    sized by the tierkv config."""
    other = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    with pytest.raises(ValueError, match=r"kv_transfer_config: TieredLLM runs vLLM with tierkv's connector"):
        _args(tmp_path, hot_window=hot_window, kv_transfer_config=other)


def test_vllm_s_prefix_cache_asked_for_under_the_hot_window_is_refused_not_turned_off(tmp_path):
    with pytest.raises(ValueError, match=r"enable_prefix_caching=True: the hot window runs vLLM's prefix cache off"):
        _args(tmp_path, prefix_caching=True)
    assert _args(tmp_path, prefix_caching=None).kwargs["enable_prefix_caching"] is False  # left out: off
    assert _args(tmp_path, hot_window=False, prefix_caching=None).kwargs["enable_prefix_caching"] is True  # vLLM's
    assert _args(tmp_path, hot_window=False, prefix_caching=True).kwargs["enable_prefix_caching"] is True
    assert _args(tmp_path, hot_window=False, prefix_caching=False).kwargs["enable_prefix_caching"] is False


def test_prefill_without_chunks_is_refused_under_the_hot_window_naming_the_chunk(tmp_path):
    """vLLM refused it only at start-up, naming max_num_batched_tokens, a value tierkv set and the user never gave."""
    with pytest.raises(ValueError, match=r"enable_chunked_prefill=False: the hot window prefills in chunks of "
                                         r"scheduler\.prefill_chunk_tokens \(128 tokens"):
        _args(tmp_path, enable_chunked_prefill=False)
    assert _args(tmp_path, enable_chunked_prefill=True).kwargs["enable_chunked_prefill"] is True
    assert _args(tmp_path, hot_window=False, enable_chunked_prefill=False).kwargs["enable_chunked_prefill"] is False


@pytest.mark.parametrize("hot_window", [True, False])
@pytest.mark.parametrize("field, value, named", [
    ("kv_lora_rank", 512, "multi-head latent attention"),                      # DeepSeek-V2/V3 shapes
    ("attention_chunk_size", 8192, "chunked local attention"),                 # Llama 4 shapes
    ("layer_types", ["linear_attention", "full_attention"], "'linear_attention'"),  # Qwen3-Next shapes
])
def test_attention_the_connector_cannot_serve_is_refused_before_vllm_loads_the_model(tmp_path, hot_window, field,
                                                                                      value, named):
    """The connector refused these only once vLLM had loaded the model and handed it the KV cache groups."""
    from tierkv.integrations.vllm.engine_args import tiered_engine_args

    config = load_config({"cache": {"block_tokens": 64, "gpu_budget_bytes": "8GiB"},
                          "scheduler": {"staging_bytes": "512MiB", "prefill_chunk_tokens": 128}}, env={})

    def args(model):
        return tiered_engine_args(model, config, str(tmp_path / "t.yaml"), {}, hot_window=hot_window, max_model_len=None,
                                  gpu_memory_utilization=0.5, enable_prefix_caching=None)

    (tmp_path / "bad").mkdir()
    (tmp_path / "fine").mkdir()
    with pytest.raises(ValueError, match=rf"config\.json {field} .*{named}.*full attention"):
        args(_checkpoint(tmp_path / "bad", **{field: value}))
    args(_checkpoint(tmp_path / "fine", layer_types=["full_attention"] * 32))  # a Llama/Qwen2 config's own list
    args(_checkpoint(tmp_path / "fine", layer_types=["attention"] * 32))  # granite-4.0-micro: dense, hybrid class
