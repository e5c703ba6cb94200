"""The step plan is host data (ints, lists, ranges) and `step_indices` puts its index lists on the
device: over any residency, block size, position and step length, every old full block is read once
(resident or streamed), no two blocks of a step share a GPU slot, and the device tensors hold exactly
the plan's lists as int64."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from tierkv.scheduler.plan import plan_step
from tierkv.storage.gpu import ResidencyPlan
from tierkv.transfer.step_indices import step_indices

steps = st.tuples(st.integers(0, 8), st.integers(1, 8), st.integers(1, 16), st.integers(0, 400), st.integers(1, 80))


def _host_values(value) -> bool:
    if isinstance(value, (list, range)):
        return all(isinstance(v, int) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


@given(steps)
def test_a_plan_is_host_data_and_reads_every_old_block_once(case):
    front, window, T, t0, n = case
    residency = ResidencyPlan(num_front_blocks=front, num_window_blocks=window)
    plan = plan_step(residency, T, t0, n)
    assert all(_host_values(v) for v in vars(plan).values()), vars(plan)
    first, after = t0 // T, -(-(t0 + n) // T)
    assert (plan.first_block, plan.num_blocks_after, plan.num_fresh_full) == (first, after, (t0 + n) // T - first)
    assert sorted(plan.resident_blocks + list(plan.streamed_blocks)) == list(range(first))
    assert all(residency.is_resident(b, after) for b in plan.resident_blocks)
    assert not any(residency.is_resident(b, after) for b in plan.streamed_blocks)
    fresh = [first + i for i in plan.fresh_resident_index]
    assert fresh == [b for b in range(first, after) if residency.is_resident(b, after)]
    slots = plan.resident_slots + plan.fresh_resident_slots
    assert len(set(slots)) == len(slots) and all(0 <= s < front + window for s in slots)
    assert list(plan.q_positions) == list(range(t0, t0 + n))
    assert list(plan.fresh_positions) == list(range(first * T, t0 + n))
    assert plan.resident_start_pos == [b * T for b in plan.resident_blocks]


@given(steps)
def test_the_device_indices_are_the_plans_lists_as_int64(case):
    front, window, T, t0, n = case
    plan = plan_step(ResidencyPlan(front, window), T, t0, n)
    index = step_indices(plan, torch.device("cpu"))
    expected = {"resident_slots": plan.resident_slots, "resident_start_pos": plan.resident_start_pos,
                "resident_num_tokens": [T] * len(plan.resident_blocks), "fresh_positions": list(plan.fresh_positions),
                "q_positions": list(plan.q_positions), "fresh_resident_index": plan.fresh_resident_index,
                "fresh_resident_slots": plan.fresh_resident_slots}
    assert set(expected) == set(vars(index))
    for name, values in expected.items():
        tensor = getattr(index, name)
        assert tensor.dtype == torch.int64 and tensor.device.type == "cpu" and tensor.tolist() == values, name


@pytest.mark.parametrize("t0, n, T", [(-1, 1, 4), (0, 0, 4), (0, 1, 0)])
def test_a_step_of_no_tokens_or_before_the_start_is_refused(t0, n, T):
    with pytest.raises(ValueError, match="step_blocks"):
        plan_step(ResidencyPlan(2, 2), T, t0, n)



def test_own_segments_off_cuda_allocates_as_usual_and_yields_no_pool():
    """`own_segments` (a resize's buffers in an allocator pool of their own) is a CUDA matter: on the CPU path it
    changes nothing (its GPU behaviour: tests/gpu/test_own_segments_gpu.py)."""
    from tierkv.storage.gpu import own_segments

    with own_segments("cpu") as segments:
        t = torch.zeros(4)
    assert segments is None and t.device.type == "cpu"
