"""OptionalKernel: a kernel that fails once is not tried again, the reason is kept, and a failure
inside a CUDA graph capture is re-raised instead of falling back."""
from __future__ import annotations

import pytest
import torch

from tierkv.optional_kernel import OptionalKernel


def test_a_failing_kernel_falls_back_from_then_on_with_its_reason():
    kernel, calls = OptionalKernel("demo"), []

    def works():
        calls.append("works")
        return 7

    assert kernel.run(works, on_cuda=False) == (True, 7)

    def fails():
        calls.append("fails")
        raise RuntimeError("no triton here")

    assert kernel.run(fails, on_cuda=False) == (False, None)
    assert not kernel.ok and kernel.error == "demo: RuntimeError: no triton here"
    assert kernel.run(works, on_cuda=False) == (False, None)  # not tried again
    assert calls == ["works", "fails"]
    # the process's fallbacks name it (what the hot window's stats report as kernel_fallbacks)
    from tierkv.optional_kernel import fallbacks

    fine = OptionalKernel("fine")
    assert fine.run(works, on_cuda=False) == (True, 7)
    reasons = fallbacks()
    assert "demo: RuntimeError: no triton here" in reasons
    assert not any(reason.startswith("fine:") for reason in reasons)  # a working kernel adds nothing


def test_a_failure_during_a_graph_capture_is_raised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    kernel = OptionalKernel("demo")

    def fails():
        raise RuntimeError("cannot launch while capturing")

    with pytest.raises(RuntimeError, match="while capturing"):
        kernel.run(fails, on_cuda=True)
    assert kernel.ok  # the capture's owner falls back; the kernel stays in use
    assert kernel.run(fails, on_cuda=False) == (False, None)  # off a CUDA stream: the usual fallback
