"""The configs ship inside the package and load by name, for the library, the CLI and vLLM's connector."""
from __future__ import annotations

import pytest

from tierkv.config import ConfigError, load_config
from tierkv.configs import SHIPPED_DIR, resolve_config_path, shipped_names


def test_every_shipped_config_loads_by_name_and_equals_its_file():
    names = shipped_names()
    assert {"default", "long-128k", "vllm-128k"} <= set(names)
    for name in names:
        assert load_config(name, env={}) == load_config(SHIPPED_DIR / f"{name}.yaml", env={})


def test_a_file_in_the_working_directory_wins_and_unknown_names_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").write_text("cache: {block_tokens: 8}\n")
    assert resolve_config_path("default") == tmp_path.joinpath("default").relative_to(tmp_path)
    assert load_config("default", env={}).cache.block_tokens == 8
    with pytest.raises(ConfigError, match="shipped config: default, long-128k"):
        load_config("long-128", env={})


def test_the_vllm_connector_takes_a_shipped_name():
    from tierkv.integrations.vllm.config import config_from_kv_transfer

    assert config_from_kv_transfer({"config_file": "vllm-128k"}, block_size=64, env={}) == \
        load_config("vllm-128k", env={})
    with pytest.raises(ConfigError, match="kv_connector_extra_config.config_file"):
        config_from_kv_transfer({"config_file": "vllm-129k"}, block_size=16, env={})


@pytest.mark.parametrize("extra,key,words", [
    ("vllm-128k", "kv_connector_extra_config", "expected a mapping"),
    ([("config_file", "vllm-128k")], "kv_connector_extra_config", "expected a mapping"),
    ({"config_file": "vllm-128k", "model_id": ""}, "kv_connector_extra_config.model_id", "non-empty string"),
    ({"config_file": "vllm-128k", "model_id": ["x"]}, "kv_connector_extra_config.model_id", "non-empty string"),
    ({"config_file": 5}, "kv_connector_extra_config.config_file", "expected a path"),
    ({"config_file": None}, "config_file (set by TIERKV_CONFIG_FILE)", "must be an existing tierkv YAML file"),
])
def test_a_bad_extra_config_is_named(extra, key, words):
    from tierkv.integrations.vllm.config import config_from_kv_transfer

    with pytest.raises(ConfigError, match=words) as info:
        config_from_kv_transfer(extra, block_size=64, env={"TIERKV_CONFIG_FILE": "/nonexistent/tierkv.yaml"})
    assert info.value.key == key
