

def test_a_metrics_file_must_be_a_file_that_can_be_written(tmp_path):
    import pytest

    from tierkv.config import ConfigError, load_config

    for value, problem in ((str(tmp_path), "it is a directory"), ("/proc/nope/x.jsonl", "pseudo file system"),
                           (str(tmp_path / "a-file" / "x.jsonl"), "is not one")):
        (tmp_path / "a-file").write_text("")
        with pytest.raises(ConfigError, match=f"metrics.jsonl_path': got '{value}'.*{problem}"):
            load_config({"metrics": {"jsonl_path": value}}, env={})
    assert load_config({"metrics": {"jsonl_path": str(tmp_path / "new" / "x.jsonl")}}, env={})


def test_a_metrics_file_under_home_is_written_there(tmp_path, monkeypatch):
    from tierkv.metrics.recorder import MetricsRecorder

    monkeypatch.setenv("HOME", str(tmp_path))
    recorder = MetricsRecorder(lambda: {"x": 1}, jsonl_path="~/runs/x.jsonl")
    assert recorder.jsonl_path == tmp_path / "runs" / "x.jsonl"


def test_a_config_passed_beside_tierkv_config_file_says_the_file_is_not_read(tmp_path, caplog):
    """TIERKV_CONFIG_FILE names the file only when no config is passed; both given and different:
    a warning names the file left unread (the passed config wins, the TIERKV_* fields still apply)."""
    import logging

    from tierkv.config import load_config

    env_file, passed = tmp_path / "env.yaml", tmp_path / "passed.yaml"
    env_file.write_text("cache:\n  block_tokens: 32\n")
    passed.write_text("cache:\n  block_tokens: 64\n")
    env = {"TIERKV_CONFIG_FILE": str(env_file), "TIERKV_CACHE__WINDOW_TOKENS": "4096"}
    with caplog.at_level(logging.WARNING, logger="tierkv.config"):
        config = load_config(str(passed), env=env)
    assert config.cache.block_tokens == 64 and config.cache.window_tokens == 4096
    assert any(str(env_file) in r.getMessage() and "not read" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierkv.config"):
        assert load_config(str(env_file), env=env).cache.block_tokens == 32  # the same file: nothing to say
        assert load_config(None, env=env).cache.block_tokens == 32             # read from the variable
        load_config({"cache": {"block_tokens": 16}}, env=env)                  # a mapping wins too
    assert [r.getMessage() for r in caplog.records if "not read" in r.getMessage()] == [
        f"tierkv: TIERKV_CONFIG_FILE={env_file} is not read: the config passed (a mapping) is used instead"]


def test_a_config_file_under_home_is_read_where_the_paths_inside_it_are(tmp_path, monkeypatch):
    """`~/x.yaml` given as the config (load_config, the connector's kv_connector_extra_config.config_file) was
    reported as a file that does not exist, though the paths inside a config expand `~`."""
    import pytest

    from tierkv.config import ConfigError, load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tk.yaml").write_text("cache:\n  block_tokens: 32\n")
    assert load_config("~/tk.yaml", env={}).cache.block_tokens == 32
    with pytest.raises(ConfigError, match=r"expected an existing YAML file"):
        load_config("~/missing.yaml", env={})
    vllm_config = pytest.importorskip("tierkv.integrations.vllm.config", reason="the connector's reader needs vLLM")
    assert vllm_config.config_from_kv_transfer({"config_file": "~/tk.yaml"}, block_size=32).cache.block_tokens == 32
