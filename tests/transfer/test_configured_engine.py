"""`scheduler.transfer_backend`: validated by the config loader, honoured on CUDA, ignored on CPU."""
from __future__ import annotations

import pytest
import torch

from tierkv.config import ConfigError, load_config
from tierkv.transfer import configured_engine


def test_the_config_names_a_backend_or_says_which_exist():
    assert load_config({}, env={}).scheduler.transfer_backend == "auto"
    assert load_config({"scheduler": {"transfer_backend": "memcpy_batch"}}, env={}).scheduler.transfer_backend == "memcpy_batch"
    with pytest.raises(ConfigError, match=r"scheduler.transfer_backend.*'memcpy'.*memcpy_batch"):
        load_config({"scheduler": {"transfer_backend": "memcpy"}}, env={})


@pytest.mark.parametrize("name", ["auto", "cupy", "memcpy_batch", "adaptive", "torch_uva", "copy_loop"])
def test_a_cpu_device_copies_with_torch_whatever_the_config_says(name):
    assert configured_engine("cpu", name).backend == "torch_cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_named_backend_is_used():
    assert configured_engine("cuda", "auto").backend in ("adaptive", "cupy")  # adaptive needs CUDA 12.8+
    assert configured_engine("cuda", "cupy").backend == "cupy"
    assert configured_engine("cuda", "torch_uva").backend == "torch_uva"
