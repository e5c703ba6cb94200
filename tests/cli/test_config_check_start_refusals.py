"""`tierkv config check` refuses what a start refuses, in the start's words, and creates nothing."""
from __future__ import annotations

import os

import pytest
import torch
import yaml

from tierkv.blocks import BlockLayout
from tierkv.cli import main
from tierkv.config import ConfigError, load_config
from tierkv.storage import build_tiers

LAYOUT = BlockLayout(num_kv_heads=1, block_tokens=4, head_dim=8, dtype=torch.float16)


@pytest.fixture(autouse=True)
def no_secret_or_token_in_the_environment(monkeypatch):
    for var in ("TIERKV_STORAGE__SECRET", "TIERKV_STORAGE__SECRET_FILE", "TIERKV_CONTROL_TOKEN", "TIERKV_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)


def check(tmp_path, capsys, text: str) -> tuple[int, str]:
    path = tmp_path / f"c{len(list(tmp_path.glob('c*.yaml')))}.yaml"
    path.write_text(text)
    capsys.readouterr()
    code = main(["config", "check", str(path)])
    return code, capsys.readouterr().err


def disk(tmp_path, extra: str = "") -> str:
    return f"tiers:\n  - kind: cpu\n    capacity_bytes: 1GiB\n  - kind: disk\n    path: {tmp_path / 'kv'}\n{extra}"


def start_error(text: str) -> str:
    """What a start says of the same config (its tiers built as TieredLLM builds them)."""
    with pytest.raises(ConfigError) as info:  # the load refuses some (encrypt on a trusted tier), the tiers the rest
        config = load_config(yaml.safe_load(text), env={})
        build_tiers(config.tiers, LAYOUT, storage=config.storage).close()
    return str(info.value)


def test_an_untrusted_tier_with_no_secret_at_all(tmp_path, capsys):
    code, err = check(tmp_path, capsys, disk(tmp_path))
    assert code == 2 and "storage.secret_file" in err and "tiers[1] keeps blocks others can write" in err
    assert start_error(disk(tmp_path)) in err  # the start's very words
    redis = "tiers:\n  - kind: cpu\n  - kind: redis\n    url: redis://127.0.0.1:1/0\n"
    code, err = check(tmp_path, capsys, redis)
    assert code == 2 and "the redis tier tiers[1]" in err
    code, _ = check(tmp_path, capsys, disk(tmp_path, "    trusted: true\n"))
    assert code == 0


@pytest.mark.parametrize("secret_file,words", [("/etc/passwd/secret", "/etc/passwd is not one"),
                                               ("/proc/self/tierkv/secret", "pseudo file system")])
def test_a_secret_file_that_cannot_be_created(tmp_path, capsys, secret_file, words):
    text = disk(tmp_path, f"storage:\n  secret_file: {secret_file}\n  create_secret_file: true\n")
    code, err = check(tmp_path, capsys, text)
    assert code == 2 and "config key 'storage.secret_file'" in err and words in err
    made = tmp_path / "made" / "below" / "secret"
    code, _ = check(tmp_path, capsys, disk(tmp_path, f"storage:\n  secret_file: {made}\n  create_secret_file: true\n"))
    assert code == 0 and not (tmp_path / "made").exists()


def test_encrypt_on_a_trusted_tier(tmp_path, capsys):
    text = disk(tmp_path, "    trusted: true\n    encrypt: true\n")
    code, err = check(tmp_path, capsys, text)
    assert code == 2 and "config key 'tiers[1].encrypt'" in err and "needs an untrusted tier" in err
    assert "tiers[1].trusted" in err and start_error(text) in err


@pytest.mark.parametrize("mode", [0o770, 0o707], ids=["group", "others"])
def test_a_disk_directory_others_can_write(tmp_path, capsys, mode):
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv").chmod(mode)
    text = disk(tmp_path, "    trusted: true\n")
    code, err = check(tmp_path, capsys, text)
    assert code == 2 and "config key 'tiers[1].path'" in err and "is writable by group or others" in err
    assert start_error(text) in err  # the start's very words
    assert oct(os.stat(tmp_path / "kv").st_mode & 0o777) == oct(mode)  # unchanged
    (tmp_path / "kv").chmod(0o755)
    assert check(tmp_path, capsys, text)[0] == 0 and os.stat(tmp_path / "kv").st_mode & 0o777 == 0o755


def test_a_control_endpoint_without_a_usable_token(tmp_path, capsys, monkeypatch):
    control = "metrics:\n  prometheus_port: 9400\n  control_enabled: true\n"
    code, err = check(tmp_path, capsys, control)
    assert code == 2 and "the control endpoint needs a token" in err
    code, err = check(tmp_path, capsys, control + "  control_token: short-token\n")
    assert code == 2 and "config key 'metrics.control_token'" in err and "at least 16 characters" in err
    monkeypatch.setenv("TIERKV_CONTROL_TOKEN", "short-token")
    code, err = check(tmp_path, capsys, control)
    assert code == 2 and "at least 16 characters" in err
    monkeypatch.setenv("TIERKV_CONTROL_TOKEN", "a-token-of-enough-length")
    assert check(tmp_path, capsys, control)[0] == 0
