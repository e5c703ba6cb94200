"""A config file's numbers read as the TIERKV_* variables read them: decimal integers (YAML 1.1 would read
0100 as octal, 1:30 as base 60, 0x20 as hex) and floats with an exponent (YAML 1.1 reads 1e2 as text)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tierkv.config import ConfigError, load_config

_FIELDS = {  # a field of each number type: integer, float, size
    "cache.block_tokens": ("TIERKV_CACHE__BLOCK_TOKENS", lambda c: c.cache.block_tokens),
    "metrics.snapshot_interval_s": ("TIERKV_METRICS__SNAPSHOT_INTERVAL_S", lambda c: c.metrics.snapshot_interval_s),
    "cache.gpu_budget_bytes": ("TIERKV_CACHE__GPU_BUDGET_BYTES", lambda c: c.cache.gpu_budget_bytes),
}


def _from_file(tmp_path, keypath: str, text: str):
    section, key = keypath.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: {text}\n")
    return load_config(path, env={})


@pytest.mark.parametrize("text,keypath,value", [
    ("0100", "cache.block_tokens", 100), ("+16", "cache.block_tokens", 16), ("0100", "cache.gpu_budget_bytes", 100),
    ("1e2", "metrics.snapshot_interval_s", 100.0), ("2.5E-1", "metrics.snapshot_interval_s", 0.25),
    ("1.0e+1", "metrics.snapshot_interval_s", 10.0), ("1e9", "cache.gpu_budget_bytes", 10**9),
    ("2GiB", "cache.gpu_budget_bytes", 2 * 2**30),
])
def test_a_number_in_a_file_is_read_as_written(tmp_path, text, keypath, value):
    assert _FIELDS[keypath][1](_from_file(tmp_path, keypath, text)) == value


@pytest.mark.parametrize("text,keypath", [
    ("1:30", "cache.block_tokens"), ("0x20", "cache.block_tokens"), ("0o17", "cache.block_tokens"),
    ("1_000", "cache.block_tokens"), ("1:30", "cache.gpu_budget_bytes"), ("0x20", "metrics.snapshot_interval_s"),
])
def test_a_number_yaml_1_1_would_convert_is_refused_by_its_key(tmp_path, text, keypath):
    with pytest.raises(ConfigError) as info:
        _from_file(tmp_path, keypath, text)
    assert info.value.key == keypath and text in str(info.value)


_NUMBERISH = st.text(alphabet="0123456789+-.eE:xo_", min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(text=_NUMBERISH, keypath=st.sampled_from(sorted(_FIELDS)))
def test_a_file_and_a_variable_read_the_same_text_alike(tmp_path_factory, text, keypath):
    """Either both give the same value or both refuse it naming the key."""
    var, field = _FIELDS[keypath]
    results = []
    for read in (lambda: _from_file(tmp_path_factory.mktemp("y"), keypath, f"'{text}'" if text[0] in "-+" and
                                     len(text) == 1 else text),
                 lambda: load_config(None, env={var: text})):
        try:
            results.append(("value", field(read())))
        except ConfigError as exc:
            assert exc.key.split(" (set by")[0] in (keypath, "config_file"), exc
            results.append(("refused",))
    file_result, env_result = results
    if file_result[0] == "value" or env_result[0] == "value":
        assert file_result == env_result, (text, keypath, results)


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(st.text(alphabet="0123456789abcdefxoE.+-_:", max_size=12), st.integers(), st.booleans(),
                       st.none(), st.floats(allow_nan=False)))
def test_what_the_project_writes_reads_back_as_written(value):
    """TieredLLM's vLLM config file and `config check`'s output: a hex token of digits and one 'e', or '0100',
    stays a string (YAML 1.1's dumper leaves them bare, and these numbers would read them as numbers)."""
    from tierkv.config.yaml_reader import _yaml_load, dump_yaml

    assert _yaml_load(dump_yaml({"v": value})) == {"v": value}
