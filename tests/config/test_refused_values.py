"""Values the loader refuses as a start would, and refuses quickly: alias bombs on a size, port 0, a short token."""
from __future__ import annotations

import time

import pytest

from tierkv.config import ConfigError, config_errors, load_config
from tierkv.units import parse_bytes


def alias_bomb(levels: int) -> str:
    """A few hundred bytes of YAML whose `cache.gpu_budget_bytes` is a list standing for 10**levels entries."""
    names = [f"l{i}" for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]" for prev, name in zip(names, names[1:])]
    lines.append(f"cache:\n  gpu_budget_bytes: [{', '.join([f'*{names[-1]}'] * 10)}]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_on_a_size_is_refused_at_once_with_a_short_message(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(9))
    start = time.perf_counter()
    errors = config_errors(path, env={})
    assert time.perf_counter() - start < 10.0  # expanded, the 10**9 strings would take minutes and gigabytes
    (error,) = [e for e in errors if e.key == "cache.gpu_budget_bytes"]
    assert "got a list" in str(error) and len(str(error)) < 1500


def test_a_size_error_shows_a_bounded_value():
    with pytest.raises(ValueError) as info:
        parse_bytes("9 parsecs" * 10_000)
    assert len(str(info.value)) < 600 and "9 parsecs" in str(info.value)
    with pytest.raises(ValueError, match="got a dict"):
        parse_bytes({"a": 1})


@pytest.mark.parametrize("url", ["redis://h:0/0", "redis://h:65536/0", "rediss://u:pw@h:0", "redis+cluster://a:0,b"])
def test_a_redis_port_outside_1_to_65535_is_refused_by_name(url):
    tiers = [{"kind": "cpu"}, {"kind": "redis", "url": url, "trusted": True}]
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.url.*the port must be 1 to 65535") as info:
        load_config({"tiers": tiers}, env={})
    assert "pw" not in str(info.value)
    tiers[1]["url"] = "redis://h:65535/0"
    assert load_config({"tiers": tiers}, env={}).tiers[1].url == "redis://h:65535/0"


@pytest.mark.parametrize("token,words", [("short-token", "at least 16 characters, got 11"),
                                         ("0123456789abcdef\n", "whitespace at either end")])
def test_a_control_token_no_client_could_use_is_refused_when_the_config_loads(token, words):
    with pytest.raises(ConfigError, match=f"metrics.control_token.*{words}") as info:
        load_config({"metrics": {"control_token": token}}, env={})
    assert token.strip() not in str(info.value)
    with pytest.raises(ConfigError, match="TIERKV_METRICS__CONTROL_TOKEN"):
        load_config(None, env={"TIERKV_METRICS__CONTROL_TOKEN": token})
    assert load_config({"metrics": {"control_token": "0123456789abcdef"}}, env={}).metrics.control_token


def test_an_inline_secret_is_measured_as_a_start_reads_it():
    """ASCII whitespace at the ends does not count (bytes.strip, as the secret file's content is stripped)."""
    with pytest.raises(ConfigError, match="storage.secret.*got 15"):
        load_config({"storage": {"secret": "  0123456789abcde \n"}}, env={})
    assert load_config({"storage": {"secret": " 0123456789abcdef "}}, env={}).storage.secret
    kept = "\u3000" + "0123456789abcd"  # 14 ASCII characters and an ideographic space a start keeps (3 bytes)
    assert load_config({"storage": {"secret": kept}}, env={}).storage.secret == kept


def test_tiers_given_as_names_say_a_mapping_is_expected():
    with pytest.raises(ConfigError, match=r"expected a mapping with a 'kind' \(e.g. \{kind: cpu\}\)") as info:
        load_config({"tiers": ["cpu", "disk"]}, env={})
    assert info.value.key == "tiers[0]"


def test_an_empty_config_file_variable_is_unset_and_a_bad_one_is_named(tmp_path):
    assert load_config(None, env={"TIERKV_CONFIG_FILE": ""}) == load_config(None, env={})
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"TIERKV_CONFIG_FILE": str(tmp_path / "missing.yaml")})
    assert info.value.key == "config_file (set by TIERKV_CONFIG_FILE)"


@pytest.mark.parametrize("first,second", [
    ("redis://h", "redis://:pw@H:6379/0"), ("redis://h/2", "redis://h:6379?db=2"), ("unix:///tmp/r.sock", "unix:///tmp/r.sock?db=0"),
    ("redis+cluster://a:7000,b:7001", "redis+cluster://b:7001,a:7000"),
])
def test_two_redis_tiers_on_one_keyspace_are_refused(first, second):
    tiers = [{"kind": "cpu", "capacity_bytes": "64MiB"}, {"kind": "redis", "url": first}, {"kind": "redis", "url": second}]
    with pytest.raises(ConfigError, match=r"tiers\[1\] already uses that server") as info:
        load_config({"tiers": tiers}, env={})
    assert info.value.key == "tiers[2].namespace"
    tiers[2]["namespace"] = "other"
    assert len(load_config({"tiers": tiers}, env={}).tiers) == 3


def test_redis_tiers_on_other_databases_or_ports_are_kept_apart():
    tiers = [{"kind": "cpu", "capacity_bytes": "64MiB"}, {"kind": "redis", "url": "redis://h/0"},
             {"kind": "redis", "url": "redis://h/1"}, {"kind": "redis", "url": "redis://h:6380/0"}]
    assert len(load_config({"tiers": tiers}, env={}).tiers) == 4


@pytest.mark.parametrize("host", [" ", "not a host!!", "a b", "", "x" * 300])
def test_a_metrics_host_no_server_could_bind_is_refused_at_load(host):
    with pytest.raises(ConfigError) as info:
        load_config({"metrics": {"host": host}}, env={})
    assert info.value.key == "metrics.host"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "0.0.0.0", "::", "gpu-7.example.com", "fe80::1%eth0"])
def test_hosts_and_addresses_are_taken(host):
    assert load_config({"metrics": {"host": host}}, env={}).metrics.host == host


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_refused(name):
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"name": name}}, env={})
    assert info.value.key == "model.name"


@pytest.mark.parametrize("first,second", [
    ("TIERKV_TIERS__0__CAPACITY_BYTES", "TIERKV_TIERS__00__CAPACITY_BYTES"),
    ("TIERKV_CACHE__BLOCK_TOKENS", "TIERKV_cache__block_tokens"),
])
def test_two_spellings_of_one_key_in_the_environment_are_refused(first, second):
    with pytest.raises(ConfigError, match=f"{first}|{second}") as info:
        load_config(None, env={first: "1MiB" if "BYTES" in first else "16", second: "2MiB" if "BYTES" in first else "32"})
    assert "sets the same key" in str(info.value)
