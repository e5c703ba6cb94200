"""The far kernels' warm-up (tierkv.attention.warmup) compiles every variant a step can reach.

The kernels are replaced by recorders that note the compile key Triton would build for each launch
(constexpr values, tensor dtypes and 16-byte alignment, the class of each int: 1, a multiple of 16
or other; without what the kernel marks do_not_specialize), so the test runs on CPU: the keys of
launches shaped as the far path makes them (1..63 queries, q rows and block lists sliced at any
offset, any block and split count) must all be among the warm-up's.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from tierkv.blocks import BlockLayout

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

ENGINES = [  # (query heads, layout)
    (32, BlockLayout(8, 64, 128, torch.bfloat16)),
    (14, BlockLayout(2, 16, 64, torch.float16)),
    (8, BlockLayout(8, 64, 80, torch.float32)),
    (64, BlockLayout(1, 32, 128, torch.bfloat16)),
]


def _spec(kernel) -> tuple[list[str], set[str], set[str], set[str]]:
    """(parameter names, constexpr names, do_not_specialize, do_not_specialize_on_alignment)."""
    options = getattr(kernel, "kwargs", None) or vars(kernel)  # interpreted or compiled
    params = inspect.signature(kernel.fn).parameters
    names = list(params)
    constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    return (names, constexprs, set(options.get("do_not_specialize") or ()),
            set(options.get("do_not_specialize_on_alignment") or ()))


class Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records the launch's compile key."""

    def __init__(self, kernel):
        self.name = kernel.fn.__name__
        self.names, self.constexprs, self.dns, self.dnsoa = _spec(kernel)
        self.defaults = {n: p.default for n, p in inspect.signature(kernel.fn).parameters.items()
                         if p.default is not inspect.Parameter.empty}
        self.keys: set[tuple] = set()

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        values = {**self.defaults, **dict(zip(self.names, args)), **kwargs}
        key = [self.name, values.get("num_warps"), values.get("num_stages")]
        for name in self.names:
            key.append((name, self._class_of(name, values[name])))
        self.keys.add(tuple(key))

    def _class_of(self, name: str, value):
        if name in self.constexprs:
            return value
        if isinstance(value, torch.Tensor):
            return (value.dtype, None if name in self.dnsoa else value.data_ptr() % 16 == 0)
        if isinstance(value, bool) or not isinstance(value, int):
            return type(value).__name__
        return None if name in self.dns else ("1" if value == 1 else "16" if value % 16 == 0 else "")


@pytest.fixture
def recorded(monkeypatch):
    """(triton_paged, {kernel name: Recorder}) with the far kernels recording instead of launching."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # as tests/attention/test_triton.py imports them on CPU
    from tierkv.attention import triton_kernels, triton_paged
    recorders = {}
    for name in ("partial_attention_kernel", "merge_splits_kernel"):
        recorders[name] = Recorder(getattr(triton_kernels, name))
        monkeypatch.setattr(triton_kernels, name, recorders[name])
    return triton_paged, recorders


def _keys(recorders) -> set[tuple]:
    keys = set().union(*(r.keys for r in recorders.values()))
    for r in recorders.values():
        r.keys.clear()
    return keys


def _far_path_launches(triton_paged, num_heads: int, layout: BlockLayout, rows: bool) -> None:
    """Launches as the far path makes them: each row's queries (a slice of the step's) over a slice of a
    staging chunk's block lists, then the merges of its parts with the near part."""
    H, T, D = layout.num_kv_heads, layout.block_tokens, layout.head_dim
    pool = torch.zeros((48, 2, H, T, D), dtype=layout.dtype)
    slots = torch.arange(48, dtype=torch.int64)
    starts, fills = slots * T, torch.full((48,), T, dtype=torch.int64)
    q_step = torch.zeros(70, num_heads, D, dtype=layout.dtype)
    for num_q in range(1, 64):
        for first, num_blocks in ((0, 1), (1, 3), (3, 17), (5, 40), (0, 48)):
            q = q_step[first : first + num_q]
            end = first + min(num_blocks, 48 - first)
            triton_paged.paged_partial_attention(q, pool, slots[first:end], starts[first:end], fills[first:end],
                                                 scale=0.1)
    part = (torch.zeros(5, num_heads, D), torch.zeros(5, num_heads))
    for num_parts in range(2, 80):
        triton_paged.merge_partials([part] * num_parts)
    if rows:
        for num_rows, k in ((1, 1), (3, 5), (8, 6)):
            lists = [t[: num_rows * k].view(num_rows, k) for t in (slots, starts, fills)]
            triton_paged.paged_rows_attention(q_step[:num_rows], pool, *lists, scale=0.1)


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("num_heads, layout", ENGINES)
def test_warm_up_covers_every_far_launch(recorded, num_heads, layout, rows):
    from tierkv.attention.warmup import launch_far_variants
    triton_paged, recorders = recorded
    launches = launch_far_variants(num_heads, layout, torch.device("cpu"), rows)
    warmed = _keys(recorders)
    assert len(warmed) == launches  # no launch of the warm-up repeats a variant
    _far_path_launches(triton_paged, num_heads, layout, rows)
    missed = _keys(recorders) - warmed
    assert not missed, f"variants the warm-up does not compile: {sorted(missed, key=str)}"


def test_warm_up_launches_one_per_tile_shape_and_one_merge(recorded):
    from tierkv.attention.warmup import far_query_counts, launch_far_variants
    triton_paged, _ = recorded
    assert far_query_counts(4) == [1, 5, 9]  # BLOCK_M 16 (1-4 queries), 32 (5-8), 64 (9-63)
    assert {triton_paged._plan(n, 4, 8, 64, b, torch.device("cpu"), None).block_m
            for n in range(1, 64) for b in range(1, 200)} == {16, 32, 64}
    assert launch_far_variants(32, ENGINES[0][1], torch.device("cpu")) == 4
    assert launch_far_variants(32, ENGINES[0][1], torch.device("cpu"), rows=True) == 5


def test_warm_up_is_a_no_op_on_cpu_and_imports_no_triton():
    code = ("import sys, torch\nfrom tierkv.attention.warmup import warm_far_kernels\nfrom tierkv.blocks import "
            "BlockLayout\nassert warm_far_kernels(32, BlockLayout(8, 64, 128, torch.bfloat16), 'cpu', rows=True) == 0\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
