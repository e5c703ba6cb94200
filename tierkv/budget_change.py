"""GPU budget changes: what is refused before anything moves, and the outcome a caller waits on.

Primitives: `parse_budget`, `check_fits_device`, `BudgetChange`, `BudgetRefused`, `HotWindowLost`.

A change goes through three gates; each refusal names the sizes and leaves the old budget working:

    parse_budget        the value: a positive whole number of bytes or a size such as "1GiB"
                        (not a bool, NaN, inf, zero, a negative number or an unknown unit)
    plan_residency      the split: sinks + window must fit (tierkv.storage.gpu, ConfigError)
    check_fits_device   the device: the new pool must fit what the device can give it
    resize_hot_window   the allocation itself, between forward steps (tierkv.engine.elastic): a failure
                        there rolls back to the old pool and resolves the change with BudgetRefused
"""
from __future__ import annotations

import math
import numbers
import os
import threading

import torch

from tierkv.units import format_bytes, parse_bytes


class BudgetRefused(RuntimeError):
    """A GPU budget change that cannot be applied; the old budget stays in force."""

    def __init__(self, budget_bytes: int, reason: str):
        self.budget_bytes, self.reason = budget_bytes, reason
        super().__init__(f"GPU budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) refused: {reason}")


class HotWindowLost(RuntimeError):
    """A resize failed and so did rebuilding the old pool: the running sequence cannot go on."""


MAX_BUDGET_BYTES = 2**50  # 1 PiB, the config's largest size too


def parse_budget(value: object) -> int:
    """Bytes in a budget value (int or size string); ValueError naming the value and what is allowed."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"budget: got {value!r}; expected a finite positive number of bytes or a size such as '1GiB'")
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    try:
        num_bytes = parse_bytes(value)
    except ValueError as exc:
        raise ValueError(f"budget: {exc}") from None
    if num_bytes <= 0:
        raise ValueError(f"budget: got {value!r}; must be positive")
    if num_bytes > MAX_BUDGET_BYTES:  # no device is that large, and formatting it would overflow a float
        shown = value if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise ValueError(f"budget: got {shown}; at most {MAX_BUDGET_BYTES} bytes (1 PiB)")
    return num_bytes


def device_bytes_available(device: torch.device) -> int | None:
    """Bytes a new KV pool on `device` could take besides the current pool; None where unknown.

    CUDA: free memory plus the allocator's cached, unused bytes. CPU (the pool lives in host
    memory): the physical memory of the machine, an upper bound.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def check_fits_device(device: torch.device, new_pool_bytes: int, held_bytes: int) -> None:
    """Raise BudgetRefused when a pool of `new_pool_bytes` cannot fit `device` even once the
    current pool (`held_bytes`) is freed."""
    available = device_bytes_available(device)
    if available is not None and new_pool_bytes > available + held_bytes:
        raise BudgetRefused(
            new_pool_bytes,
            f"its resident pool needs {format_bytes(new_pool_bytes)} and {device} can give at most "
            f"{format_bytes(available + held_bytes)} ({format_bytes(available)} available + "
            f"{format_bytes(held_bytes)} the current pool holds)",
        )


class BudgetChange:
    """One requested budget. Resolved when applied or refused; a change replaced by a later one
    before it took effect resolves with the later one's outcome."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.error: BaseException | None = None
        self._done = threading.Event()

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    def resolve(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once applied, False on timeout; raises the refusal (BudgetRefused) when refused."""
        if not self._done.wait(timeout_s):
            return False
        if self.error is not None:
            raise self.error
        return True
