"""TieredLLM(backend="vllm") on a machine without a CUDA device: vLLM's own start error there names no device
("Device string must not be empty"); the front end says a CUDA GPU is needed and chains vLLM's error. A model
given as a shortcut or a .gguf file is pointed to the default backend."""
from __future__ import annotations

import pytest
import torch

from tests.test_llm_totals import _checkpoint


def _start_failing(tmp_path, monkeypatch, error: Exception, cuda: bool):
    """VllmTieredLLM over a vLLM whose LLM(...) raises `error`, with CUDA visible or not."""
    import vllm

    from tierkv.integrations.vllm.llm import VllmTieredLLM

    class FailingLLM:
        def __init__(self, **kwargs):
            raise error

    monkeypatch.setattr(vllm, "LLM", FailingLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    VllmTieredLLM(_checkpoint(tmp_path), {"cache": {"block_tokens": 16}}, hot_window=False)


def test_a_failed_start_without_a_cuda_device_names_the_gpu(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match=r"backend='vllm' runs on a CUDA GPU and none is visible") as caught:
        _start_failing(tmp_path, monkeypatch, RuntimeError("Device string must not be empty"), cuda=False)
    assert "Device string must not be empty" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_with_a_cuda_device_vllms_own_error_passes_unchanged(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="max_model_len 999999"):
        _start_failing(tmp_path, monkeypatch, ValueError("max_model_len 999999 exceeds the model's"), cuda=True)


@pytest.mark.parametrize("model", ["smollm2-135m", "model.Q4_1.gguf"])
def test_a_shortcut_or_gguf_is_pointed_to_the_default_backend(model):
    from tierkv import TieredLLM

    with pytest.raises(ValueError, match=r"needs a local checkpoint directory \(a \.gguf file or a shortcut"):
        TieredLLM(model, None, backend="vllm")
