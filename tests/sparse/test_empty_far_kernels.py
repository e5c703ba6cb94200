"""The Triton kernels of the sparse step with an empty far set (a sequence shorter than the front
region, a decode batch without far blocks, an empty selection): no launch with a zero-size grid, and
results of the right (empty) shape. The kernels are replaced by recorders (no GPU, no interpreter
needed): a launch whose grid has a zero dimension fails the test."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")


class _Launches:
    """Stands for a @triton.jit kernel: `kernel[grid](...)` records the grid; a zero-size grid fails."""

    def __init__(self):
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        assert all(g > 0 for g in grid), f"a launch with a zero-size grid {grid}"
        self.grids.append(grid)
        return lambda *args, **kwargs: None


@pytest.fixture
def recorded(monkeypatch):
    from tierkv import cache_kernels, sparse_kernels

    launches = {}
    for module, name in ((cache_kernels, "_place_kernel"), (cache_kernels, "_place_lru_kernel"),
                         (cache_kernels, "_copy_sources_kernel"), (sparse_kernels, "_block_bounds_kernel"),
                         (sparse_kernels, "_block_bounds_rows_kernel")):
        launches[name] = _Launches()
        monkeypatch.setattr(module, name, launches[name])
    return launches


@pytest.mark.parametrize("m,k", [(0, 4), (3, 0), (0, 0)])
def test_placement_and_copy_sources_of_empty_selections_launch_nothing(recorded, m, k):
    from tierkv.cache_kernels import copy_sources, place_rows, place_rows_lru

    sets, layers, slots = 2, 3, max(k, 1)
    held = torch.full((sets, layers, k), -1, dtype=torch.int64)
    ids = torch.zeros((m, k), dtype=torch.int64)
    row_sets = torch.zeros(m, dtype=torch.int64)
    counters = torch.zeros(3, dtype=torch.int64)
    got_slots, miss = place_rows(held, row_sets, 1, ids, counters)
    assert got_slots.shape == miss.shape == (m, k) and miss.dtype == torch.bool
    lru_held = torch.full((sets, layers, slots), -1, dtype=torch.int64)
    clock = torch.zeros(sets, dtype=torch.int64)
    got_slots, miss = place_rows_lru(lru_held, torch.zeros_like(lru_held), clock, row_sets, 1, ids, counters)
    assert got_slots.shape == miss.shape == (m, k)
    assert clock.tolist() == [0, 0] and counters.tolist() == [0, 0, 0]  # nothing placed, nothing counted
    src = copy_sources(torch.zeros(m, dtype=torch.int64), ids, torch.zeros((m, k), dtype=torch.bool))
    assert src.shape == (m, k)
    assert not recorded["_place_kernel"].grids and not recorded["_place_lru_kernel"].grids
    assert not recorded["_copy_sources_kernel"].grids


def test_bounds_of_an_empty_far_set_launch_nothing(recorded):
    from tierkv.sparse_kernels import block_bounds, block_bounds_rows

    table = torch.randn(5, 2, 32)
    q = torch.randn(4, 16)
    for first in (0, 3, 5):
        assert block_bounds(table, q, first, first).shape == (0,)
    out = torch.empty((0, 5))
    none = torch.zeros(0, dtype=torch.int64)
    block_bounds_rows(none, table, torch.randn(0, 4, 16), none, out)
    block_bounds_rows(torch.zeros(2, dtype=torch.int64), table, torch.randn(2, 4, 16),
                      torch.zeros(2, dtype=torch.int64), torch.empty((2, 0)))
    with pytest.raises(ValueError, match="blocks 3..2"):  # a backward range is refused, not launched
        block_bounds(table, q, 3, 2)
    assert not recorded["_block_bounds_kernel"].grids and not recorded["_block_bounds_rows_kernel"].grids
    block_bounds(table, q, 0, 5)  # the recorder sees a real launch
    assert recorded["_block_bounds_kernel"].grids == [(1,)]
