"""The deployment's secret reads the same from every source, and a secret file that cannot be read says why."""
from __future__ import annotations

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.config import ConfigError, StorageConfig, load_config
from tierkv.storage.auth import BlockSealer, load_secret

SECRET = "0123456789abcdef-deployment"
LAYOUT = BlockLayout(num_kv_heads=1, block_tokens=4, head_dim=8, dtype=torch.float16)


def secret_file(tmp_path, content: str) -> str:
    path = tmp_path / "secret"
    path.write_text(content)
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize("inline", [f"  {SECRET}\n", f"\t{SECRET} ", SECRET])
def test_an_inline_secret_and_a_file_holding_it_give_the_same_key_bytes(tmp_path, inline):
    from_file = load_secret(StorageConfig(secret_file=secret_file(tmp_path, f"{SECRET}\n")))
    from_config = load_secret(load_config({"storage": {"secret": inline}}, env={}).storage)
    from_env = load_secret(load_config(None, env={"TIERKV_STORAGE__SECRET": inline}).storage)
    assert from_file == from_config == from_env == SECRET.encode()
    block = torch.arange(2 * 4 * 8, dtype=torch.float16).reshape(LAYOUT.shape)
    sealed = BlockSealer(from_config, LAYOUT, encrypt=False).seal("k", block)
    assert torch.equal(BlockSealer(from_file, LAYOUT, encrypt=False).open("k", sealed)[1], block)
    assert BlockSealer(from_env, LAYOUT, encrypt=True).name("k") == BlockSealer(from_file, LAYOUT, encrypt=True).name("k")


@pytest.mark.parametrize("create", [True, False])
def test_a_secret_file_that_is_a_directory_says_so(tmp_path, create):
    (tmp_path / "secret").mkdir()
    with pytest.raises(ConfigError, match="storage.secret_file.*it is a directory") as info:
        load_secret(StorageConfig(secret_file=str(tmp_path / "secret"), create_secret_file=create))
    assert "create_secret_file" not in str(info.value)


def test_a_missing_secret_file_still_names_create_secret_file(tmp_path):
    with pytest.raises(ConfigError, match="set storage.create_secret_file: true"):
        load_secret(StorageConfig(secret_file=str(tmp_path / "missing")))


def test_a_fifo_or_device_at_the_secret_path_is_refused_without_reading_it(tmp_path):
    """A FIFO would block the start for ever, /dev/zero fill the memory: refused by what it is."""
    import os
    import threading

    fifo = tmp_path / "fifo-secret"
    os.mkfifo(fifo, 0o600)
    result = {}

    def load(path):
        try:
            load_secret(StorageConfig(secret_file=str(path)))
        except ConfigError as exc:
            result[str(path)] = str(exc)

    zero = tmp_path / "zero-secret"
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero):
        worker = threading.Thread(target=load, args=(path,), daemon=True)
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), f"{path}: the secret's read blocked"
        assert "expected a regular file" in result[str(path)]


def test_a_secret_file_too_large_for_a_secret_is_refused(tmp_path):
    path = tmp_path / "secret"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte the old code read whole
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="expected a secret of at most 65536 bytes"):
        load_secret(StorageConfig(secret_file=str(path)))
