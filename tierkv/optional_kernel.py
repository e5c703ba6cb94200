"""A GPU kernel that may not build on this machine (no triton, an unsupported device or version):
its callers fall back to PyTorch from the first failure on, and the reason is kept.

Primitives: `OptionalKernel` (`run`, `ok`, `error`), `fallbacks` (every kernel of the process that
stopped being used, and why: what a stats report shows, so a slow run that fell back says so).

A failure inside a CUDA graph capture is re-raised instead: the capture is void already, and a
fallback there would be captured too. The graph's owner falls back as a whole.
"""
from __future__ import annotations

import weakref
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


_ALL: "weakref.WeakSet[OptionalKernel]" = weakref.WeakSet()  # every live one (module-level kernels live on)


def fallbacks() -> list[str]:
    """The reasons of every OptionalKernel of this process that has fallen back to PyTorch."""
    return sorted(kernel.error for kernel in list(_ALL) if not kernel.ok and kernel.error)


class OptionalKernel:
    def __init__(self, name: str):
        self.name = name
        self.ok = True
        self.error: str | None = None  # why it stopped being used
        _ALL.add(self)

    def run(self, launch: Callable[[], T], on_cuda: bool) -> tuple[bool, T | None]:
        """(True, launch()) while the kernel works; (False, None) once it has failed, the
        failure's reason in `error`. on_cuda: whether it launches on a CUDA stream (a failure
        there during a graph capture is re-raised)."""
        if not self.ok:
            return False, None
        try:
            return True, launch()
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot build must not stop generation
            if on_cuda and torch.cuda.is_current_stream_capturing():
                raise
            self.ok, self.error = False, f"{self.name}: {type(exc).__name__}: {exc}"
            return False, None
