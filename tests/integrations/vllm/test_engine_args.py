"""vLLM's own LLM with tierkv: `vllm_engine_args` gives arguments vLLM's EngineArgs takes, whose
connector config turns the hot window on (checked against vLLM's own classes on CPU)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from tierkv.config import ConfigError, load_config  # noqa: E402
from tierkv.integrations.vllm.engine_args import vllm_engine_args  # noqa: E402


def test_the_arguments_build_vllms_engine_args_and_name_the_hot_window_pool():
    from vllm import EngineArgs
    from vllm.config import KVTransferConfig

    args = vllm_engine_args("vllm-128k")
    config = load_config("vllm-128k")
    engine = EngineArgs(model="/models/llama-3.1-8b", max_model_len=131072, **args)  # every name is vLLM's
    assert isinstance(engine.kv_transfer_config, KVTransferConfig)
    assert engine.kv_transfer_config.kv_connector == "TierKVConnector"
    assert engine.kv_transfer_config.kv_connector_extra_config["config_file"] == "vllm-128k"
    assert engine.block_size == config.cache.block_tokens and engine.enforce_eager
    assert engine.kv_cache_memory_bytes == config.cache.gpu_budget_bytes - config.scheduler.staging_bytes
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert engine.attention_config.backend == AttentionBackendEnum.CUSTOM and engine.enable_prefix_caching is False
    plain = vllm_engine_args("vllm-128k", hot_window=False)
    assert "kv_cache_memory_bytes" not in plain and "attention_config" not in plain


def test_its_connector_config_turns_full_attention_into_the_hot_window_spec():
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    args = vllm_engine_args("vllm-128k")
    config = load_config("vllm-128k")
    vllm_config = VllmConfig(cache_config=CacheConfig(block_size=args["block_size"]),
                             device_config=DeviceConfig(device="cpu"), kv_transfer_config=args["kv_transfer_config"])
    layer = SimpleNamespace(attn_type="decoder", kv_cache_dtype="auto", sliding_window=None, num_kv_heads=8,
                            head_size=128, head_size_v=128, kv_cache_torch_dtype=torch.bfloat16,
                            attn_backend=AttentionBackendEnum.CUSTOM.get_class())
    spec = Attention.get_kv_cache_spec(layer, vllm_config)
    assert type(spec) is SlidingWindowSpec and spec.sliding_window == config.cache.window_tokens


def test_the_sparse_policy_is_sent_to_tieredllm():
    with pytest.raises(ConfigError, match="scheduler.policy.*use TieredLLM"):
        vllm_engine_args("vllm-128k-sparse")


def test_a_float32_checkpoint_is_sized_in_16_bits_as_vllms_auto_dtype_runs_it(tmp_path):
    """vLLM's auto dtype runs a float32 checkpoint in 16 bits (`_resolve_auto_dtype`): the pool's need is
    a 16-bit checkpoint's; only dtype='float32' given to the engine doubles it."""
    import json

    from vllm.config.model import _resolve_auto_dtype

    from tierkv.integrations.vllm.pool_sizing import hot_window_pool_need

    assert _resolve_auto_dtype("llama", torch.float32, is_pooling_model=False).itemsize == 2
    needs = {}
    for dtype in ("float32", "bfloat16"):
        model = tmp_path / dtype
        model.mkdir()
        (model / "config.json").write_text(json.dumps({
            "model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
            "hidden_size": 512, "max_position_embeddings": 8192, "torch_dtype": dtype}))
        needs[dtype] = hot_window_pool_need(model, load_config("vllm-128k"), {"max_model_len": 8192})
    assert needs["float32"] == needs["bfloat16"]
    assert hot_window_pool_need(tmp_path / "float32", load_config("vllm-128k"),
                                {"max_model_len": 8192, "dtype": "float32"}) == 2 * needs["bfloat16"]


def test_a_block_the_tiers_cannot_load_is_recomputed_by_vllm():
    """vLLM's default kv_load_failure_policy 'fail' fails a request whose block load errs; tierkv's
    kv_transfer_config asks for 'recompute' (the connector reports such blocks as load errors)."""
    from vllm.config import KVTransferConfig

    from tierkv.integrations.vllm.config import kv_transfer_config

    assert KVTransferConfig().kv_load_failure_policy == "fail"  # vLLM's default: why tierkv sets it
    assert KVTransferConfig(**kv_transfer_config("x.yaml")).kv_load_failure_policy == "recompute"
    assert vllm_engine_args("vllm-128k")["kv_transfer_config"].kv_load_failure_policy == "recompute"


def test_vllm_engine_args_refuses_before_vllm_starts_what_tieredllm_refuses(tmp_path):
    """A misspelt connector entry and `cache.window_tokens: 0` under the hot window failed only inside vLLM's
    start-up (the connector's checks), after the model had loaded."""
    from tierkv.config import ConfigError

    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.model_ld'?: got 'x'.*did you mean 'model_id'"):
        vllm_engine_args("vllm-128k", model_ld="x")
    assert vllm_engine_args("vllm-128k", model_id="x")["kv_transfer_config"].kv_connector_extra_config["model_id"] == "x"
    zero = tmp_path / "w0.yaml"
    zero.write_text("cache:\n  block_tokens: 16\n  window_tokens: 0\n  gpu_budget_bytes: 2GiB\n")
    with pytest.raises(ConfigError, match=r"cache\.window_tokens'?: got 0"):
        vllm_engine_args(str(zero))
    assert vllm_engine_args(str(zero), hot_window=False)["block_size"] == 16  # a plain pool never reads the window
