"""TIERKV_* variables are read by the type their field declares, never as YAML: text verbatim, numbers decimal."""
from __future__ import annotations

import pytest

from tierkv.config import ConfigError, load_config


@pytest.mark.parametrize("var,raw,field", [
    ("TIERKV_STORAGE__SECRET", "s3cret#not-a-comment 'quoted' \\n \"x\"", lambda c: c.storage.secret),
    ("TIERKV_STORAGE__SECRET", "'0123456789abcdef'", lambda c: c.storage.secret),
    ("TIERKV_STORAGE__SECRET", "0123456789abcdef # tail", lambda c: c.storage.secret),
    ("TIERKV_MODEL__NAME", "0100", lambda c: c.model.name),
    ("TIERKV_MODEL__NAME", "true", lambda c: c.model.name),
    ("TIERKV_MODEL__NAME", "1:30", lambda c: c.model.name),
    ("TIERKV_METRICS__JSONL_PATH", "/tmp/run #1.jsonl", lambda c: c.metrics.jsonl_path),
    ("TIERKV_METRICS__CONTROL_TOKEN", "tok#en-'0123456789'", lambda c: c.metrics.control_token),
    ("TIERKV_TIERS__0__STORAGE_DTYPE", "int8", lambda c: c.tiers[0].storage_dtype),
])
def test_a_text_field_takes_the_variable_verbatim(var, raw, field):
    assert field(load_config(None, env={var: raw})) == raw


def test_numbers_are_plain_decimals_not_yaml_octal_or_base_60():
    config = load_config(None, env={"TIERKV_CACHE__BLOCK_TOKENS": "0100", "TIERKV_CACHE__GPU_BUDGET_BYTES": "0100",
                                    "TIERKV_METRICS__SNAPSHOT_INTERVAL_S": "0.25", "TIERKV_CACHE__SINK_TOKENS": " 8 "})
    assert config.cache.block_tokens == 100 and config.cache.gpu_budget_bytes == 100
    assert config.metrics.snapshot_interval_s == 0.25 and config.cache.sink_tokens == 8
    for var in ("TIERKV_CACHE__BLOCK_TOKENS", "TIERKV_METRICS__SNAPSHOT_INTERVAL_S"):
        with pytest.raises(ConfigError, match=f"set by {var}.*got '1:30'"):
            load_config(None, env={var: "1:30"})
    with pytest.raises(ConfigError, match="TIERKV_CACHE__BLOCK_TOKENS.*expected an integer"):
        load_config(None, env={"TIERKV_CACHE__BLOCK_TOKENS": "0x10"})


def test_sizes_booleans_and_empty_values_read_as_a_yaml_file_gives_them():
    env = {"TIERKV_CACHE__GPU_BUDGET_BYTES": "2GiB", "TIERKV_METRICS__ENABLED": "false",
           "TIERKV_METRICS__PROMETHEUS_PORT": "", "TIERKV_STORAGE__SECRET_FILE": ""}
    config = load_config({"metrics": {"prometheus_port": 9400}, "storage": {"secret_file": "/x"}}, env=env)
    assert config.cache.gpu_budget_bytes == 2 * 2**30 and config.metrics.enabled is False
    assert config.metrics.prometheus_port is None and config.storage.secret_file is None
    for word, value in (("yes", True), ("On", True), ("no", False), ("OFF", False)):  # YAML 1.1's, as in a file
        assert load_config(None, env={"TIERKV_METRICS__ENABLED": word}).metrics.enabled is value
    with pytest.raises(ConfigError, match="TIERKV_METRICS__ENABLED.*expected true or false"):
        load_config(None, env={"TIERKV_METRICS__ENABLED": "maybe"})


def test_flow_lists_and_mappings_only_where_the_field_is_a_list_or_section():
    config = load_config(None, env={"TIERKV_TIERS": "[{kind: cpu, capacity_bytes: 1GiB}]",
                                    "TIERKV_MODEL": "{name: m, num_layers: 2}"})
    assert config.tiers[0].capacity_bytes == 2**30 and (config.model.name, config.model.num_layers) == ("m", 2)
    with pytest.raises(ConfigError, match="TIERKV_CACHE__GPU_BUDGET_BYTES.*cannot read '\\[1, 2\\]'"):
        load_config(None, env={"TIERKV_CACHE__GPU_BUDGET_BYTES": "[1, 2]"})
    assert load_config(None, env={"TIERKV_MODEL__NAME": "[a, b]"}).model.name == "[a, b]"


def test_a_tier_entry_is_read_by_its_own_kind(tmp_path):
    tiers = [{"kind": "cpu"}, {"kind": "disk", "path": str(tmp_path / "kv"), "trusted": True}]
    config = load_config({"tiers": tiers}, env={"TIERKV_TIERS__1__PATH": str(tmp_path / "k#v"),
                                                "TIERKV_TIERS__1__CAPACITY_BYTES": "010GB"})
    assert config.tiers[1].path == str(tmp_path / "k#v") and config.tiers[1].capacity_bytes == 10 * 10**9


@pytest.mark.parametrize("index,said", [("-1", "'-1' is not an index"), ("X", "'X' is not an index"),
                                        ("2", "index 2 is out of range")])
def test_a_tier_index_out_of_range_or_not_a_number_says_what_is_allowed(index, said):
    with pytest.raises(ConfigError) as refused:
        load_config("default", env={f"TIERKV_TIERS__{index}__PATH": "/tmp/x"})  # default.yaml has 2 tiers
    message = str(refused.value)
    assert said in message and "'tiers' has 2 entries, so the index must be 0..1" in message, message
    assert "below that" not in message
