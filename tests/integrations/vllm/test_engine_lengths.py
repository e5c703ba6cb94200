"""TieredLLM(backend="vllm")'s lengths, checked before vLLM starts: max_model_len a positive number of tokens
(vLLM's -1 would have sized the hot window for 1 token and reserved no key summaries), and max_num_seqs within
the tokens a step schedules (vLLM refused it naming max_num_batched_tokens, which the user never passed)."""
from __future__ import annotations

import pytest

from tests.integrations.vllm.test_hot_window import _checkpoint
from tierkv.config import load_config

pytest.importorskip("vllm")


def _args(tmp_path, policy: str = "exact", max_model_len=None, **kwargs):
    from tierkv.integrations.vllm.engine_args import tiered_engine_args

    config = load_config({"cache": {"block_tokens": 64, "gpu_budget_bytes": "8GiB", "window_tokens": 2048},
                          "scheduler": {"policy": policy, "staging_bytes": "512MiB", "prefill_chunk_tokens": 128}},
                         env={})
    return tiered_engine_args(_checkpoint(tmp_path), config, str(tmp_path / "tierkv.yaml"), kwargs, hot_window=True,
                              max_model_len=max_model_len, gpu_memory_utilization=0.5,
                              enable_prefix_caching=False)


@pytest.mark.parametrize("policy", ["exact", "sparse"])
@pytest.mark.parametrize("value", [-1, 0, "128k", 2.5, True])
@pytest.mark.parametrize("where", ["argument", "engine"])
def test_a_max_model_len_that_is_no_length_is_refused_by_name(tmp_path, policy, value, where):
    given = {"max_model_len": value} if where == "argument" else {"engine_kwargs": {"max_model_len": value}}
    with pytest.raises(ValueError, match=r"max_model_len: got .*a positive number of tokens") as refused:
        if where == "argument":
            _args(tmp_path, policy, max_num_seqs=2, **given)
        else:
            _args(tmp_path, policy, max_num_seqs=2, **given["engine_kwargs"])
    assert ("vLLM's -1" in str(refused.value)) == (value == -1)


def test_max_num_seqs_above_the_step_tokens_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"max_num_seqs=256 is above scheduler\.prefill_chunk_tokens=128"):
        _args(tmp_path, max_num_seqs=256)
    with pytest.raises(ValueError, match=r"max_num_seqs=256 is above max_num_batched_tokens=200"):
        _args(tmp_path, max_num_seqs=256, max_num_batched_tokens=200)
    assert _args(tmp_path, max_num_seqs=128).kwargs["max_num_batched_tokens"] == 128
    assert _args(tmp_path, max_num_seqs=256, max_num_batched_tokens=256).kwargs["max_num_batched_tokens"] == 256
    assert "max_num_seqs" not in _args(tmp_path).kwargs  # left to vLLM, which caps its default at the step's tokens


def test_the_plan_refuses_what_vllm_would(tmp_path):
    from tierkv.cli.plan import PRESETS, make_plan

    config = load_config({"cache": {"block_tokens": 64, "window_tokens": 2048, "gpu_budget_bytes": 8 << 30},
                          "scheduler": {"prefill_chunk_tokens": 128, "staging_bytes": 512 << 20}}, env={})
    plan = make_plan(PRESETS["llama-3.1-8b"], 8192, config, backend="vllm", max_num_seqs=256)
    assert not plan["gpu"]["fits"] and "scheduler.prefill_chunk_tokens (128" in plan["gpu"]["refusal"]
    assert make_plan(PRESETS["llama-3.1-8b"], 8192, config, backend="vllm", max_num_seqs=128)["gpu"]["fits"]


def test_the_file_tieredllm_writes_is_loaded_without_the_environment_again(tmp_path, monkeypatch):
    """TieredLLM sizes the staging for its rows and writes the config; the connector loaded that file with
    TIERKV_* applied again, so a variable naming a sized key undid the size vLLM's pool was planned with."""
    from tests.integrations.vllm.test_hot_window import fake_vllm_llm
    from tierkv.config import ConfigError
    from tierkv.integrations.vllm.config import config_from_kv_transfer
    from tierkv.integrations.vllm.llm import VllmTieredLLM

    monkeypatch.setenv("TIERKV_SCHEDULER__STAGING_BYTES", "768MiB")
    given = fake_vllm_llm(monkeypatch)
    config = {"cache": {"block_tokens": 64, "window_tokens": 2048, "gpu_budget_bytes": 12 << 30},
              "scheduler": {"policy": "sparse", "staging_bytes": 768 << 20, "sparse_cuda_graphs": True,
                            "vllm_rows_from_batch": True, "prefill_chunk_tokens": 8192, "sparse_cache_selections": 2}}
    llm = VllmTieredLLM(_checkpoint(tmp_path), config, max_model_len=131072, max_num_seqs=4, enforce_eager=True)
    try:
        extra = given["kv_transfer_config"]["kv_connector_extra_config"]
        assert extra["resolved"] is True
        loaded = config_from_kv_transfer(extra, block_size=64)
        assert loaded.scheduler.staging_bytes == llm.config.scheduler.staging_bytes > 768 << 20
        again = config_from_kv_transfer({**extra, "resolved": False}, block_size=64)
        assert again.scheduler.staging_bytes == 768 << 20  # what the variable did before
    finally:
        llm.close()
    for bad, key in (({"config_file": ""}, "config_file"), ({"config_file": "vllm-128k", "resolved": "yes"}, "resolved")):
        with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}"):
            config_from_kv_transfer(bad, block_size=64, env={"TIERKV_CONFIG_FILE": "vllm-128k"})
