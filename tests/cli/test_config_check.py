"""`tierkv config check`: prints the resolved config; bad configs exit 2 naming key and value."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from tierkv.cli import main
from tierkv.config import load_config
from tierkv.config.load import to_dict

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_a_shipped_config_round_trips(capsys):
    assert main(["config", "check", str(CONFIGS / "long-128k.yaml")]) == 0
    captured = capsys.readouterr()
    printed = yaml.safe_load(captured.out)
    assert printed == to_dict(load_config(CONFIGS / "long-128k.yaml"))
    assert load_config(printed, env={}) == load_config(CONFIGS / "long-128k.yaml")
    assert "OK; GPU budget checked against the model's KV shape" in captured.err


def test_environment_overrides_show_in_the_resolved_config(capsys, monkeypatch):
    monkeypatch.setenv("TIERKV_CONFIG_FILE", str(CONFIGS / "default.yaml"))
    monkeypatch.setenv("TIERKV_SCHEDULER__LOOKAHEAD_LAYERS", "5")
    assert main(["config", "check", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["scheduler"]["lookahead_layers"] == 5 and printed["cache"]["gpu_budget_bytes"] == 1024**2


def write(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_bad_configs_exit_2_naming_key_and_value(tmp_path, capsys):
    cases = [
        ("cache:\n  gpu_budjet_bytes: 1GiB\n", "config key 'cache.gpu_budjet_bytes'", "did you mean 'gpu_budget_bytes'"),
        ("cache:\n  gpu_budget_bytes: 2 parsecs\n", "config key 'cache.gpu_budget_bytes'", "units"),
        ("tiers:\n  - kind: tape\n", "config key 'tiers[0].kind'", "allowed: cpu, disk, redis"),
        ("model: {name: m, num_layers: 32, num_kv_heads: 8, head_dim: 128, kv_dtype: bfloat16}\n"
         "cache: {block_tokens: 64, gpu_budget_bytes: 64MiB}\n", "config key 'cache.gpu_budget_bytes'",
         "sinks + window need"),
        (": : :\n", "config key 'config_file'", "expected valid YAML"),
    ]
    for text, key, detail in cases:
        assert main(["config", "check", write(tmp_path, text)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tierkv config check: error:") and key in err and detail in err, err


def test_a_missing_file_exits_2(capsys):
    assert main(["config", "check", "/no/such/config.yaml"]) == 2
    assert "expected an existing YAML file" in capsys.readouterr().err


def test_an_empty_path_is_refused_as_one_not_read_as_the_working_directory(capsys):
    assert main(["config", "check", ""]) == 2
    err = capsys.readouterr().err
    assert "PATH '': config key 'config_file': got ''" in err and "not an empty path" in err, err
    assert "built-in defaults" not in err and "'.'" not in err


def test_many_files_every_error_of_each_and_sizes_human_readable(tmp_path, capsys):
    good = CONFIGS / "default.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  block_tokens: 0\n  sink_tokens: many\nmetrics:\n  enabled: 3\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x80")
    assert main(["config", "check", str(good), str(bad), str(binary)]) == 2
    out, err = capsys.readouterr()
    for key in ("cache.block_tokens", "cache.sink_tokens", "metrics.enabled"):
        assert f"error: {bad}: config key '{key}'" in err
    assert f"error: {binary}: config key 'config_file'" in err and "UTF-8" in err
    assert f"{good}: OK" in err and "1 of 3 configs OK" in err
    assert "gpu_budget_bytes: 1048576  # 1.00 MiB (1048576 bytes)" in out
    docs = list(yaml.safe_load_all(out))
    assert docs[0] == to_dict(load_config(good, env={}))  # the comments leave the data as it was


def test_the_config_named_by_the_environment_is_named_in_the_report(capsys, monkeypatch):
    monkeypatch.setenv("TIERKV_CONFIG_FILE", "long-128k")
    assert main(["config", "check"]) == 0
    assert "tierkv config check: $TIERKV_CONFIG_FILE long-128k and TIERKV_* environment: OK" in capsys.readouterr().err


def test_the_secret_file_is_checked_as_a_start_would_and_never_created(tmp_path, capsys):
    """Where a start reads it (an untrusted disk or Redis tier seals its blocks with it), not elsewhere."""
    secret = tmp_path / "keys" / "secret"

    made = []

    def write(tmp_path, text):  # a file of its own each (the module's write reuses one name)
        made.append(tmp_path / f"c{len(made)}.yaml")
        made[-1].write_text(text)
        return str(made[-1])

    tiers = f"tiers:\n  - kind: cpu\n    capacity_bytes: 1GiB\n  - kind: disk\n    path: {tmp_path / 'kv'}\n"
    cpu_only = write(tmp_path, f"tiers:\n  - kind: cpu\n    capacity_bytes: 1GiB\nstorage:\n  secret_file: {secret}\n")
    assert main(["config", "check", cpu_only]) == 0  # a start never reads it
    missing = write(tmp_path, f"{tiers}storage:\n  secret_file: {secret}\n")
    assert main(["config", "check", missing]) == 2
    assert "storage.secret_file" in capsys.readouterr().err and not secret.exists()
    created_at_start = write(tmp_path, f"{tiers}storage:\n  secret_file: {secret}\n  create_secret_file: true\n")
    assert main(["config", "check", created_at_start]) == 0 and not secret.exists()
    no_home = write(tmp_path, f"{tiers}storage:\n  secret_file: ~nosuchuser-tierkv/secret\n")
    capsys.readouterr()
    assert main(["config", "check", no_home]) == 2 and "storage.secret_file" in capsys.readouterr().err
    secret.parent.mkdir(mode=0o700)
    secret.write_text("x" * 40)
    secret.chmod(0o644)
    capsys.readouterr()
    assert main(["config", "check", missing]) == 2
    assert "chmod 600" in capsys.readouterr().err
    secret.chmod(0o600)
    assert main(["config", "check", missing]) == 0
