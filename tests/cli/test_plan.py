"""`tierkv plan`: the numbers for real model shapes, counted again by hand; bad arguments."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierkv.cli import main

LONG_128K = str(Path(__file__).resolve().parents[2] / "configs" / "long-128k.yaml")
KIB = 1024


def plan_json(capsys, *args) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_8b_at_128k_with_a_2gib_budget(capsys):
    plan = plan_json(capsys, "--model-config", "llama-3.1-8b", "--context", "128k", "--gpu-budget", "2GiB",
                     "--config", LONG_128K, "--vllm-kv-pool", "10GiB")
    assert plan["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 128 * KIB
    assert plan["kv_bytes"] == 16 * KIB**3
    block = 2 * 8 * 64 * 128 * 2  # 256 KiB: K+V, 8 heads, 64 tokens, 128 dims, bf16
    assert plan["block_bytes"] == block
    # by hand: 2 GiB / (256 KiB x 32 layers) = 256 slots per layer; window = 4096/64 + 1 = 65; front = 191
    g = plan["gpu"]
    assert (g["slots_per_layer"], g["window_blocks"], g["sink_blocks"], g["far_cache_blocks"]) == (256, 65, 1, 190)
    # decoding token 131073: 2049 blocks per layer, 256 of them resident, the rest streamed
    d = plan["decode_step"]
    assert d["streamed_blocks_per_layer"] == 2049 - 256
    assert d["streamed_bytes"] == 1793 * 32 * block
    assert d["pcie_floor_s"] == pytest.approx(1793 * 32 * block / 55e9)
    assert plan["cpu"]["fits"] is True
    assert plan["vllm"]["kv_pool_needed_bytes"] == 16 * KIB**3 and plan["vllm"]["fits"] is False


def test_text_output_names_tiers_floor_and_vllm_verdict(capsys):
    assert main(["plan", "--model-config", "qwen2-7b", "--context", "32768", "--gpu-budget", "1GiB",
                 "--vllm-kv-pool", "2GiB", "--h2d-gbps", "25"]) == 0
    out = capsys.readouterr().out
    assert "qwen2-7b: 28 layers x 4 KV heads x 128 dims, bfloat16 -> 56.00 KiB of KV per token" in out
    for needle in ("GPU  sinks", "GPU  far cache", "GPU  window", "GPU  staging", "CPU  all blocks",
                   "PCIe floor", "at 25 GB/s H2D", "fits: vLLM alone can hold it"):
        assert needle in out


def test_a_local_config_json_is_read(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
        "torch_dtype": "float16", "max_position_embeddings": 1024, "_name_or_path": "tiny"}))
    plan = plan_json(capsys, "--model-config", str(tmp_path), "--context", "2048", "--gpu-budget", "4MiB")
    assert plan["model"]["head_dim"] == 64 and plan["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 2
    assert main(["plan", "--model-config", str(tmp_path / "config.json"), "--context", "2048", "--gpu-budget", "4MiB"]) == 0
    assert "warning     the model's max_position_embeddings is 1024" in capsys.readouterr().out


def _config_json(tmp_path, **extra) -> str:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
        "max_position_embeddings": 32768, **extra}))
    return str(tmp_path)


def test_a_model_with_its_own_sliding_window_is_planned_with_what_the_runtime_refuses(tmp_path, capsys):
    """Mistral v0.1-style sliding_window: the transformers engine serves at most the window, the vLLM hot
    window not at all; the plan says so (it planned 32k tokens for a 4096-token window without a word)."""
    model = _config_json(tmp_path, sliding_window=4096)
    plan = plan_json(capsys, "--model-config", model, "--context", "32768", "--gpu-budget", "4MiB")
    assert plan["model"]["sliding_window"] == 4096
    assert plan["warnings"] == ["the model attends its own sliding window of 4096 tokens: the transformers engine "
                                "serves sequences of at most 4096 tokens and refuses this 32768-token request"]
    assert plan_json(capsys, "--model-config", model, "--context", "4096", "--gpu-budget", "4MiB")["warnings"] == []
    assert main(["plan", "--model-config", model, "--context", "32768", "--gpu-budget", "4MiB"]) == 0
    assert "warning     the model attends its own sliding window of 4096 tokens" in capsys.readouterr().out
    vllm = plan_json(capsys, "--model-config", model, "--context", "4096", "--gpu-budget", "64MiB", "--backend", "vllm")
    assert len(vllm["warnings"]) == 1 and "refuses the hot window" in vllm["warnings"][0]
    # turned off (Qwen2's use_sliding_window: false): nothing to say
    off = _config_json(tmp_path, sliding_window=4096, use_sliding_window=False)
    assert plan_json(capsys, "--model-config", off, "--context", "32768", "--gpu-budget", "4MiB")["warnings"] == []


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_a_multi_head_latent_attention_model_is_refused_by_name(tmp_path, capsys, where):
    shape = {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512, "kv_lora_rank": 512}
    model = _config_json(tmp_path, **(shape if where == "top" else {"text_config": shape}))
    assert main(["plan", "--model-config", model, "--context", "4096", "--gpu-budget", "4MiB"]) == 2
    assert "multi-head latent attention (kv_lora_rank=512)" in capsys.readouterr().err


def test_a_budget_that_holds_everything_streams_nothing(capsys):
    plan = plan_json(capsys, "--model-config", "mistral-7b", "--context", "4096", "--gpu-budget", "4GiB")
    assert plan["decode_step"]["streamed_bytes"] == 0 and plan["decode_step"]["pcie_floor_s"] == 0


@pytest.mark.parametrize("args,message", [
    (["--model-config", "gpt-5", "--context", "1k"], "'gpt-5' is neither a preset"),
    (["--model-config", "llama-3.1-8b", "--context", "12x"], "--context: cannot read '12x' as a number of tokens"),
    (["--model-config", "llama-3.1-8b", "--context", "0"], "--context: '0' is 0 tokens: expected a whole number"),
    (["--model-config", "llama-3.1-8b", "--context", "1.0001k"], "'1.0001k' is 1024.1 tokens"),
    (["--model-config", "llama-3.1-8b", "--context", "1G"], "k/K/Ki = 1024, M/Mi = 1048576"),
    (["--model-config", "llama-3.1-8b", "--context", "-5"], "cannot read '-5'"),
    (["--model-config", "llama-3.1-8b", "--context", "1k", "--gpu-budget", "lots"], "cannot read 'lots' as a size"),
    (["--model-config", "llama-3.1-8b", "--context", "1k", "--gpu-budget", "1MiB"],
     "--gpu-budget 1MiB: holds 0 blocks"),
    (["--model-config", "llama-3.1-8b", "--context", "1k", "--h2d-gbps", "0"], "--h2d-gbps: got 0.0; must be a finite number > 0"),
    (["--model-config", "llama-3.1-8b", "--context", "1k", "--h2d-gbps", "nan"], "--h2d-gbps: got nan"),
    (["--model-config", "llama-3.1-8b", "--context", "1k", "--config", "/no/such.yaml"], "config_file"),
])
def test_bad_arguments_exit_2_naming_the_problem(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierkv plan: error:") and message in err


def test_a_bad_config_json_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"hidden_size": 3}')
    assert main(["plan", "--model-config", str(tmp_path), "--context", "1k"]) == 2
    err = capsys.readouterr().err
    assert "not a transformers model config (model: " in err and "num_hidden_layers=None" in err


@pytest.mark.parametrize("context,tokens", [("1M", 1048576), ("1Mi", 1048576), ("128k", 131072), ("128K", 131072),
                                            ("128Ki", 131072), ("0.5M", 524288), ("131072", 131072)])
def test_context_with_k_and_m_suffixes(capsys, context, tokens):
    plan = plan_json(capsys, "--model-config", "llama-3.1-8b", "--context", context, "--gpu-budget", "2GiB")
    assert plan["context_tokens"] == tokens


def test_help_states_what_the_suffixes_mean(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "1M = 1048576" in " ".join(capsys.readouterr().out.split())


def test_a_quantized_cpu_tier_holds_and_streams_slots_not_blocks(tmp_path, capsys):
    import json

    config = tmp_path / "q.yaml"
    config.write_text("cache: {block_tokens: 16, gpu_budget_bytes: 3GiB, sink_tokens: 64, window_tokens: 1024}\n"
                      "tiers:\n  - {kind: cpu, capacity_bytes: 48GiB, storage_dtype: int8}\n")
    plain = tmp_path / "p.yaml"
    plain.write_text(config.read_text().replace(", storage_dtype: int8", ""))
    plans = []
    for path in (plain, config):
        assert main(["plan", "--model-config", "llama-3.1-8b", "--context", "128k", "--config", str(path), "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    exact, int8 = plans
    assert exact["cpu"]["slot_bytes"] == exact["block_bytes"]
    assert int8["cpu"]["slot_bytes"] < exact["block_bytes"] * 0.6  # one byte per bf16 value, plus scales
    assert int8["decode_step"]["streamed_bytes"] < exact["decode_step"]["streamed_bytes"] * 0.6
    assert int8["cpu"]["bytes_needed"] == int8["cpu"]["blocks_needed"] * int8["cpu"]["slot_bytes"]


def test_a_size_that_cannot_be_read_names_its_flag(capsys):
    assert main(["plan", "--model-config", "llama-3.1-8b", "--context", "1k", "--gpu-budget", "1.5GiBx"]) == 2
    assert "--gpu-budget: cannot read '1.5GiBx'" in capsys.readouterr().err


def _llama_8b_dir(tmp_path) -> str:
    """A checkpoint directory of Llama-3.1-8B's shape (config.json only)."""
    shape = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
             "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    return str(tmp_path)


@pytest.mark.parametrize("config_name, max_num_seqs, budget", [
    ("vllm-128k", 1, None), ("vllm-128k", 8, None), ("vllm-128k-sparse", 1, None), ("vllm-128k-sparse", 4, None),
    ("vllm-128k-sparse", 10, "60GiB"), ("long-128k-sparse", 2, None)])
def test_the_vllm_backend_splits_the_budget_as_the_engine_does(capsys, tmp_path, config_name, max_num_seqs, budget):
    """--backend vllm: the GPU held is the budget, and vLLM's pool, the staging and the sparse
    reservations are the ones TieredLLM(backend="vllm") starts the engine with."""
    pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")
    from tierkv.config import ConfigError, load_config
    from tierkv.integrations.vllm.batch_sizing import size_rows_for_batch
    from tierkv.integrations.vllm.engine_args import tiered_engine_args
    from tierkv.units import parse_bytes

    model = _llama_8b_dir(tmp_path)
    plan = plan_json(capsys, "--model-config", model, "--context", "131072", "--config", config_name,
                     "--backend", "vllm", "--max-num-seqs", str(max_num_seqs), *(["--gpu-budget", budget] if budget else []))
    config = load_config(config_name)
    if budget:
        config.cache.gpu_budget_bytes = parse_bytes(budget)
    g = plan["gpu"]
    try:  # as TieredLLM(backend="vllm") starts the engine
        config = size_rows_for_batch(model, config, {"max_num_seqs": max_num_seqs})
        engine = tiered_engine_args(model, config, "unused.yaml", {"max_num_seqs": max_num_seqs}, hot_window=True,
                                    max_model_len=131072, gpu_memory_utilization=0.9, enable_prefix_caching=False)
    except ConfigError:  # the engine refuses this budget at start-up: so does the plan
        assert g["fits"] is False and g["held_bytes"] == config.cache.gpu_budget_bytes
        return
    assert g["pool_bytes"] == engine.kwargs["kv_cache_memory_bytes"]
    assert g["summary_bytes"] == engine.summary_reserved_bytes
    assert g["full_graph_bytes"] == engine.full_graph_reserved_bytes
    assert g["pool_bytes"] + g["staging_bytes"] + g["summary_bytes"] + g["full_graph_bytes"] == g["held_bytes"]
    assert g["held_bytes"] == config.cache.gpu_budget_bytes and g["fits"] is True
    assert g["staging_bytes"] == config.scheduler.staging_bytes  # raised for the batch where the config asks
    assert g["compiled"] is (not engine.kwargs["enforce_eager"])
    sparse = config.scheduler.policy == "sparse"
    assert (g["summary_bytes"] > 0) is sparse
    streamed = plan["decode_step"]["streamed_blocks_per_layer"]
    far = 131072 // config.cache.block_tokens - config.cache.window_tokens // config.cache.block_tokens
    assert streamed == (config.scheduler.sparse_token_budget // config.cache.block_tokens if sparse else far)


def test_the_vllm_backend_says_when_the_engine_would_refuse_the_budget(capsys, tmp_path):
    """A budget whose pool cannot hold one request's window: the engine's start-up check refuses it,
    and the plan says DOES NOT FIT; the transformers plan of the same numbers holds budget + staging."""
    pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")
    from tierkv.config import ConfigError, load_config
    from tierkv.integrations.vllm.engine_args import tiered_engine_args

    model = _llama_8b_dir(tmp_path)
    config = load_config("vllm-128k")
    config.cache.gpu_budget_bytes = 1 << 30
    with pytest.raises(ConfigError, match="needs"):
        tiered_engine_args(model, config, "unused.yaml", {"max_num_seqs": 1}, hot_window=True, max_model_len=131072,
                           gpu_memory_utilization=0.9, enable_prefix_caching=False)
    assert main(["plan", "--model-config", model, "--context", "128k", "--config", "vllm-128k", "--gpu-budget",
                 "1GiB", "--backend", "vllm"]) == 0
    text = capsys.readouterr().out
    assert "DOES NOT FIT: the pool cannot hold one request's window" in text and "GPU KV: none held, the engine would not start with a budget of 1.00 GiB" in text
    assert "tierkv would hold none" in text and "tierkv holds" not in text  # the summary said 1.00 GiB held
    plan = plan_json(capsys, "--model-config", model, "--context", "128k", "--config", "vllm-128k",
                     "--gpu-budget", "1GiB")
    assert plan["backend"] == "transformers" and plan["gpu"]["staging_bytes"] > 0
    assert main(["plan", "--model-config", model, "--context", "128k", "--backend", "vllm", "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs: got 0" in capsys.readouterr().err


def test_the_vllm_backend_counts_the_cpu_tier_and_vllms_pool_for_the_whole_batch(capsys):
    one = plan_json(capsys, "--model-config", "llama-3.1-8b", "--context", "128k", "--config", "vllm-128k",
                    "--backend", "vllm")
    ten = plan_json(capsys, "--model-config", "llama-3.1-8b", "--context", "128k", "--config", "vllm-128k",
                    "--backend", "vllm", "--max-num-seqs", "10", "--gpu-budget", "60GiB")
    assert ten["cpu"]["bytes_needed"] == 10 * one["cpu"]["bytes_needed"] == 10 * 16 * KIB**3
    assert one["cpu"]["fits"] is True and ten["cpu"]["fits"] is False  # the shipped tier 0 holds 48 GiB
    assert ten["vllm"]["batch_pool_needed_bytes"] == 10 * one["vllm"]["kv_pool_needed_bytes"]
    assert ten["decode_step"] == one["decode_step"]  # per request


def test_the_vllm_backend_refuses_a_ring_too_small_for_its_regions(capsys, tmp_path):
    """The exact policy's staging ring needs one block per region (the connector's main ring at start)."""
    config = tmp_path / "small-ring.yaml"
    config.write_text("cache: {block_tokens: 16, window_tokens: 2048, gpu_budget_bytes: 4GiB}\n"
                      "tiers: [{kind: cpu, capacity_bytes: 48GiB}]\n"
                      "scheduler: {staging_bytes: 128KiB, lookahead_layers: 2}\n")
    plan = plan_json(capsys, "--model-config", "llama-3.1-8b", "--context", "32k", "--config", str(config),
                     "--backend", "vllm")
    assert plan["gpu"]["fits"] is False and "scheduler.staging_bytes" in plan["gpu"]["refusal"]
    assert "one per staging region" in plan["gpu"]["refusal"]


def test_a_request_shorter_than_the_budget_says_what_it_uses(capsys):
    """A 1-token request under a 2 GiB budget: the resident slots are the budget (allocated whole), the text
    says how much of it the blocks use, and vLLM's comparison says tierkv holds more instead of a percentage
    above 100."""
    assert main(["plan", "--model-config", "llama-3.1-8b", "--context", "1", "--gpu-budget", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert "resident 2.00 GiB (budget 2.00 GiB, the blocks above use 132.00 MiB of it)" in out
    assert "tierkv holds 2.25 GiB (more than vLLM alone needs" in out and "%)" not in out.split("vLLM alone")[1]
    assert main(["plan", "--model-config", "llama-3.1-8b", "--context", "128k", "--gpu-budget", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert "resident 2.00 GiB (budget 2.00 GiB) + staging" in out and "tierkv holds 2.25 GiB (14.1%)" in out


@pytest.mark.parametrize("extra, named", [({"text_config": [1, 2]}, "text_config"),
                                          ({"text_config": "x"}, "text_config"),
                                          ({"max_position_embeddings": "131072"}, "max_position_embeddings"),
                                          ({"max_position_embeddings": -5}, "max_position_embeddings")])
def test_a_malformed_config_json_value_exits_2_naming_the_key(tmp_path, capsys, extra, named):
    model = _config_json(tmp_path, **extra)
    for backend in ("transformers", "vllm"):
        assert main(["plan", "--model-config", model, "--context", "4096", "--gpu-budget", "64MiB",
                     "--backend", backend]) == 2
        err = capsys.readouterr().err
        assert named in err and "Traceback" not in err


def test_the_configs_model_shape_must_be_the_models_as_at_start(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  num_layers: 32\n  num_kv_heads: 8\n")
    assert main(["plan", "--model-config", _config_json(tmp_path), "--context", "4096", "--gpu-budget", "64MiB",
                 "--config", str(config)]) == 2
    assert "config key 'model.num_layers': got 32; the model has 4" in capsys.readouterr().err


def test_a_float32_checkpoint_is_planned_in_16_bits_under_vllm(tmp_path, capsys):
    model = _config_json(tmp_path, torch_dtype="float32")
    vllm = plan_json(capsys, "--model-config", model, "--context", "4096", "--gpu-budget", "64MiB", "--backend", "vllm")
    hf = plan_json(capsys, "--model-config", model, "--context", "4096", "--gpu-budget", "64MiB")
    assert hf["kv_bytes_per_token"] == 2 * vllm["kv_bytes_per_token"] == 2 * 2 * 4 * 2 * 64 * 2


def test_a_sparse_config_for_transformers_is_planned_as_its_selection_with_the_key_summaries(capsys):
    exact = plan_json(capsys, "--model-config", "llama-3.1-8b", "--context", "128k", "--config", "configs/long-128k.yaml")
    sparse = plan_json(capsys, "--model-config", "llama-3.1-8b", "--context", "128k",
                       "--config", "configs/long-128k-sparse.yaml")
    assert sparse["policy"] == "sparse" and sparse["decode_step"]["streamed_blocks_per_layer"] == 2048 // 64
    assert sparse["gpu"]["summary_bytes"] == 32 * 2048 * 2 * 8 * 128 * 2  # key max and min per block and KV head
    assert exact["decode_step"]["streamed_blocks_per_layer"] > 1000 and "summary_bytes" not in exact["gpu"]
    assert main(["plan", "--model-config", "llama-3.1-8b", "--context", "128k",
                 "--config", "configs/long-128k-sparse.yaml"]) == 0
    out = capsys.readouterr().out
    assert "decode step (sparse, at most" in out and "sparse key summaries 256.00 MiB" in out


def test_a_rope_scaled_models_length_is_the_one_vllm_derives(tmp_path, capsys):
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    scaled = plan_json(capsys, "--model-config", _config_json(tmp_path, rope_scaling=yarn), "--context", "128k",
                       "--gpu-budget", "1GiB", "--backend", "vllm", "--vllm-kv-pool", "64GiB")
    assert scaled["model"]["scaled_context"] == 131072 and scaled["vllm"]["fits"] is True
    assert not any("max_position_embeddings" in w for w in scaled["warnings"])
    assert scaled["gpu"]["fits"] is True and scaled["gpu"]["refusal"] is None
    (tmp_path / "plain").mkdir()
    plain = plan_json(capsys, "--model-config", _config_json(tmp_path / "plain"), "--context", "128k",
                      "--gpu-budget", "1GiB", "--backend", "vllm", "--vllm-kv-pool", "64GiB")
    assert plain["model"]["scaled_context"] is None and plain["vllm"]["fits"] is False  # past its 32768 positions
    assert "max_model_len" in plain["gpu"]["refusal"]


def test_vllm_alone_needs_its_null_block_beside_the_requests_blocks(capsys):
    need = 131072 * 32 * 2 * 8 * 128 * 2  # 16 GiB: 8192 blocks of 16 tokens
    exact = plan_json(capsys, "--model-config", "llama-3.1-8b", "--context", "128k", "--vllm-kv-pool", str(need))
    more = plan_json(capsys, "--model-config", "llama-3.1-8b", "--context", "128k",
                     "--vllm-kv-pool", str(need + 16 * 32 * 2 * 8 * 128 * 2))
    assert exact["vllm"]["fits"] is False and more["vllm"]["fits"] is True


def test_a_chunked_attention_model_is_planned_with_what_the_runtime_refuses(tmp_path, capsys):
    model = _config_json(tmp_path, attention_chunk_size=8192)
    plan = plan_json(capsys, "--model-config", model, "--context", "32768", "--gpu-budget", "4MiB")
    assert plan["model"]["attention_chunk"] == 8192
    assert plan["warnings"] == ["the model's layers attend in chunks of 8192 tokens (attention_chunk_size): the "
                                "transformers engine serves sequences of at most 8192 tokens and refuses this "
                                "32768-token request"]
    assert plan_json(capsys, "--model-config", model, "--context", "8192", "--gpu-budget", "4MiB")["warnings"] == []
