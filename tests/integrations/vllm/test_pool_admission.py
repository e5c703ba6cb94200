"""The hot-window pool tierkv's start-up check accepts is one vLLM admits a request into.

vLLM 0.26 admits a waiting request only when its whole admission (`max_admission_blocks_per_request`
under `scheduler_reserve_full_isl`, on by default) is free, and its pool never frees the null block.
A pool of exactly the admission's blocks passes vLLM's own start-up check, then admits nothing: the
engine steps idle forever (seen on the GPU with the real SmolLM2 model under the sparse policy, where the
key summaries left vLLM 11 blocks for an 11-block admission). Here vLLM's own KV cache manager decides,
on drawn shapes and configs: the smallest pool `check_hot_window_pool` accepts admits the first chunk;
one block less, which it refuses, would not have.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

import torch  # noqa: E402
from vllm.config import SchedulerConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tierkv.config import ConfigError, load_config  # noqa: E402
from tierkv.integrations.vllm.pool_sizing import check_hot_window_pool, hot_window_pool_need  # noqa: E402


def _admits(num_blocks: int, spec: SlidingWindowSpec, layers: int, prompt: int, chunk: int, in_flight: int,
            max_model_len: int) -> bool:
    """Whether vLLM's KV cache manager (its scheduler's admission of a waiting request) gives a fresh
    `prompt`-token request its first chunk in a pool of `num_blocks`."""
    names = [f"layer.{i}" for i in range(layers)]
    tensors = [KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[n]) for n in names]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                           kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)])
    manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=spec.block_size,
                             hash_block_size=spec.block_size, max_in_flight_tokens=in_flight, enable_caching=False)
    request = Request("r", list(range(prompt)), SamplingParams(max_tokens=4), None)
    got = manager.allocate_slots(request, min(chunk, prompt), full_sequence_must_fit=True, has_scheduled_reqs=False)
    return got is not None


def test_vllm_admits_whole_requests_by_default():
    """What this file's checks stand on: vLLM's scheduler reserves a request's whole admission, and the
    names `pool_sizing.check_admission` reads (it skips a config that lacks them: a vLLM that moved them
    fails here, not silently there)."""
    from vllm.config import VllmConfig

    assert SchedulerConfig.__dataclass_fields__["scheduler_reserve_full_isl"].default is True
    assert callable(SlidingWindowSpec.max_admission_blocks_per_request)
    assert isinstance(VllmConfig.max_in_flight_tokens, property)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(layers=st.integers(1, 30), kv_heads=st.sampled_from([1, 3, 8]), head_dim=st.sampled_from([64, 128]),
       block=st.sampled_from([16, 32, 64]), window=st.sampled_from([64, 128, 2048]),
       chunk=st.sampled_from([256, 512, 2048, 8192]), use_async=st.booleans(),
       max_model_len=st.sampled_from([4096, 8192, 131072]), prompt=st.integers(1, 20000))
def test_the_smallest_pool_the_check_accepts_admits_a_request(tmp_path, layers, kv_heads, head_dim, block, window,
                                                               chunk, use_async, max_model_len, prompt):
    prompt = min(prompt, max_model_len - 1)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": layers, "num_attention_heads": kv_heads * 3, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "hidden_size": kv_heads * 3 * head_dim, "max_position_embeddings": max_model_len}))
    config = load_config({"cache": {"block_tokens": block, "window_tokens": window},
                          "scheduler": {"prefill_chunk_tokens": chunk}}, env={})
    engine = {"max_num_batched_tokens": chunk, "max_model_len": max_model_len, "async_scheduling": use_async}
    spec = SlidingWindowSpec(block_size=block, num_kv_heads=kv_heads, head_size=head_dim, dtype=torch.bfloat16,
                             sliding_window=window)
    block_bytes = spec.page_size_bytes * layers
    need = hot_window_pool_need(str(model), config, engine)
    assert need % block_bytes == 0
    smallest = need // block_bytes
    check_hot_window_pool(str(model), config, {**engine, "kv_cache_memory_bytes": smallest * block_bytes})
    in_flight = chunk * (2 if use_async else 1)
    assert _admits(smallest, spec, layers, prompt, chunk, in_flight, max_model_len)
    with pytest.raises(ConfigError, match="cache.gpu_budget_bytes"):
        check_hot_window_pool(str(model), config, {**engine, "kv_cache_memory_bytes": (smallest - 1) * block_bytes})


def test_the_real_models_sparse_pool_that_stepped_idle_is_refused(tmp_path):
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64) with the accuracy run's sparse settings: a pool
    of 11 blocks (what the summaries left) passed vLLM's check and admitted nothing; tierkv refuses it
    and accepts 12, which vLLM admits."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "hidden_size": 576, "max_position_embeddings": 8192}))
    config = load_config({"cache": {"block_tokens": 64, "window_tokens": 128},
                          "scheduler": {"prefill_chunk_tokens": 512}}, env={})
    engine = {"max_num_batched_tokens": 512, "max_model_len": 8192}
    spec = SlidingWindowSpec(block_size=64, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    block_bytes = spec.page_size_bytes * 30
    assert not _admits(11, spec, 30, 2112, 512, 512, 8192)
    with pytest.raises(ConfigError, match="needs 16.88 MiB"):
        check_hot_window_pool(str(tmp_path), config, {**engine, "kv_cache_memory_bytes": 11 * block_bytes})
    check_hot_window_pool(str(tmp_path), config, {**engine, "kv_cache_memory_bytes": 12 * block_bytes})
    assert _admits(12, spec, 30, 2112, 512, 512, 8192)


def _scheduler_with_pool(tmp_path, num_blocks: int):
    """vLLM's own Scheduler (its connector, tierkv's, made in its constructor) over the SmolLM2 shape's
    hot-window spec with `num_blocks` pool blocks, and the accuracy run's sparse config."""
    from vllm.config import AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from tierkv.integrations.vllm import hot_window, kv_transfer_config

    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 2, "head_dim": 64,
        "max_position_embeddings": 8192, "vocab_size": 49152, "torch_dtype": "bfloat16"}))
    config_file = tmp_path / "tierkv.yaml"
    config_file.write_text("cache: {block_tokens: 64, window_tokens: 128}\n"
                           "tiers: [{kind: cpu, capacity_bytes: 64MiB}]\n"
                           "scheduler: {staging_bytes: 4MiB, prefill_chunk_tokens: 512, policy: sparse, "
                           "sparse_token_budget: 512}\nmetrics: {enabled: false}\n")
    hot_window.register()
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=8192, enforce_eager=True),
        cache_config=CacheConfig(block_size=64, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512, max_model_len=8192,
                                         is_encoder_decoder=False, async_scheduling=False),  # as TieredLLM passes it
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(str(config_file), model_id="smollm2-shape")),
        device_config=DeviceConfig(device="cpu"), attention_config=AttentionConfig(backend="CUSTOM"))  # the hot window
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    spec = SlidingWindowSpec(block_size=64, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    kv_config = KVCacheConfig(num_blocks=num_blocks,
                              kv_cache_tensors=[KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[n])
                                                for n in names],
                              kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config, kv_config, StructuredOutputManager(vllm_config), block_size=64)


def test_an_engine_whose_pool_admits_nothing_fails_at_start_with_the_sizes(tmp_path):
    """Past every check before it (a pool given to vLLM by hand, say), the connector refuses at the
    engine's start, with vLLM's own admission arithmetic, a pool its scheduler would never admit a
    request into; one block more starts and admits the request."""
    with pytest.raises(ConfigError, match=r"pool of 11 blocks, 10 of them free.*only with 11 free"):
        _scheduler_with_pool(tmp_path / "a", 11)
    scheduler = _scheduler_with_pool(tmp_path / "b", 12)
    scheduler.add_request(Request("r", list(range(2112)), SamplingParams(max_tokens=2), None))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 512}


@pytest.mark.parametrize("fields,refused", [({"sliding_window": 4096}, True), ({"sliding_window": 1024}, True),
                                            ({"sliding_window": 4096, "use_sliding_window": False}, False),
                                            ({}, False)])
def test_a_model_with_its_own_sliding_window_is_refused_by_the_hot_window(tmp_path, fields, refused):
    """vLLM keeps such a model's layers in their own sliding-window spec (the hot window rewrites only full
    attention), and the far part would add the blocks before that window: the model never attends them.
    TieredLLM's engine arguments and `tierkv plan --backend vllm` refuse it by name."""
    from tierkv.cli.plan import load_shape, make_plan
    from tierkv.integrations.vllm.engine_args import tiered_engine_args

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_hidden_layers": 4,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "max_position_embeddings": 32768,
        **fields}))
    config = load_config({"cache": {"block_tokens": 64, "window_tokens": 2048, "gpu_budget_bytes": "4GiB"}}, env={})
    plan = make_plan(load_shape(str(tmp_path)), 32768, config, backend="vllm", max_num_seqs=1)
    if refused:
        with pytest.raises(ValueError, match=r"attend a sliding window of \d+ tokens.*hot_window=False"):
            tiered_engine_args(tmp_path, config, "unused.yaml", {}, hot_window=True, max_model_len=32768,
                               gpu_memory_utilization=0.9, enable_prefix_caching=False)
        assert plan["gpu"]["fits"] is False and "own sliding window" in plan["gpu"]["refusal"]
    else:
        tiered_engine_args(tmp_path, config, "unused.yaml", {}, hot_window=True, max_model_len=32768,
                           gpu_memory_utilization=0.9, enable_prefix_caching=False)
        assert plan["gpu"]["fits"] is True


def test_the_hot_window_backend_refuses_a_layer_with_its_own_sliding_window():
    """The attention backend's own guard, for an engine built past TieredLLM (vLLM's LLM with
    tierkv's engine arguments written by hand)."""
    from tierkv.integrations.vllm.backend import HotWindowImpl

    impl = HotWindowImpl.__new__(HotWindowImpl)  # the guard reads plain attributes: no GPU needed
    impl.attn_type, impl.dcp_world_size, impl.kv_cache_dtype = "decoder", 1, "auto"
    impl.alibi_slopes, impl.logits_soft_cap = None, None
    meta = type("Meta", (), {"use_cascade": False})()
    impl.sliding_window = (-1, -1)
    impl._check_supported(meta, None, None)
    impl.sliding_window = (4095, 0)
    with pytest.raises(NotImplementedError, match="own sliding window of 4096 tokens"):
        impl._check_supported(meta, None, None)


def test_a_rope_scaled_model_is_sized_for_the_length_vllm_derives(tmp_path):
    """No max_model_len given: vLLM runs a yarn-scaled model (2048 positions, factor 4) at 8192 tokens,
    so the pool must hold a window of 2048 and a 2048-token chunk uncapped (66 blocks), not capped at
    2048 tokens (34). vLLM derives the length itself (with the engine's hf_overrides, which the sizing
    reads too)."""
    from tierkv.integrations.vllm.engine_args import tiered_engine_args, vllm_max_model_len

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 64,
        "max_position_embeddings": 2048, "vocab_size": 1000, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}))
    assert vllm_max_model_len(tmp_path) == 8192
    overridden = {"hf_overrides": {"rope_scaling": None, "rope_parameters": None, "max_position_embeddings": 1024}}
    assert vllm_max_model_len(tmp_path, overridden) == 1024
    block = 2 * 2 * 2 * 64 * 64 * 2  # K and V, 2 layers, 2 KV heads, 64 tokens of 64 dims, bf16

    def args(pool_blocks: int):
        config = load_config({"cache": {"block_tokens": 64, "window_tokens": 2048,
                                        "gpu_budget_bytes": (4 << 20) + pool_blocks * block},
                              "scheduler": {"staging_bytes": 4 << 20, "prefill_chunk_tokens": 2048}}, env={})
        return tiered_engine_args(tmp_path, config, "unused.yaml", {}, hot_window=True, max_model_len=None,
                                  gpu_memory_utilization=0.9, enable_prefix_caching=False)

    with pytest.raises(ConfigError, match="cache.gpu_budget_bytes"):
        args(40)
    accepted = args(66)
    assert "max_model_len" not in accepted.kwargs and accepted.kwargs["kv_cache_memory_bytes"] == 66 * block
