"""Batched memcpy path: pointer/size arrays, slot range checks, the ctypes call's two signatures."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tierkv.transfer.checks import check_slot_range
from tierkv.transfer.kernels import contiguous_runs
from tierkv.transfer.memcpy_batch import (
    MemcpyBatch,
    MemcpyBatchUnavailable,
    _MemcpyAttributes,
    batch_copy_arrays,
    loaded_cudart_path,
)

SRC, DST = 0x7F00_0000_0000, 0x7E00_0000_1000  # bases as large as real pinned and device addresses


def reference_arrays(src_address, src_slots, dst_address, dst_slots, block_bytes):
    """The same arrays built one run at a time from contiguous_runs (a Python loop)."""
    runs = contiguous_runs(list(src_slots), list(dst_slots))
    dsts = [dst_address + d * block_bytes for _, d, _ in runs]
    srcs = [src_address + s * block_bytes for s, _, _ in runs]
    sizes = [n * block_bytes for _, _, n in runs]
    return [np.array(a, dtype=np.uint64) for a in (dsts, srcs, sizes)]


def apply_copies(memory: np.ndarray, base: int, dsts, srcs, sizes) -> np.ndarray:
    """Run the copies on one flat byte array addressed from `base` (what the copy engines do)."""
    out = memory.copy()
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        out[d - base : d - base + n] = memory[s - base : s - base + n]
    return out


def test_arrays_merge_lockstep_runs():
    dsts, srcs, sizes = batch_copy_arrays(1000, np.array([4, 5, 6, 9]), 0, np.array([0, 1, 2, 7]), 10)
    assert dsts.tolist() == [0, 70]
    assert srcs.tolist() == [1040, 1090]
    assert sizes.tolist() == [30, 10]
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("block_bytes", [6, 16 * 1024, 256 * 1024])
def test_arrays_match_the_run_by_run_reference(seed, block_bytes):
    rng = np.random.default_rng(seed)
    # Random slots with some consecutive stretches, as a scheduler's plan produces them.
    src_slots = np.concatenate([rng.permutation(50)[:10], np.arange(60, 70), rng.permutation(40)[:5] + 100])
    dst_slots = np.concatenate([rng.permutation(30)[:10], np.arange(30, 40), [41, 43, 44, 45, 47]])
    actual = batch_copy_arrays(SRC, src_slots, DST, dst_slots, block_bytes)
    expected = reference_arrays(SRC, src_slots, DST, dst_slots, block_bytes)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)
    assert int(actual[2].sum()) == src_slots.size * block_bytes


def test_arrays_perform_the_slot_copy():
    block_bytes, rng = 8, np.random.default_rng(7)
    memory = rng.integers(0, 256, 64 * block_bytes, dtype=np.uint8)  # src slab: slots 0..31, dst: 32..63
    src_slots = np.array([3, 4, 5, 20, 0, 1])
    dst_slots = np.array([10, 11, 12, 2, 31, 30])
    dst_base = 32 * block_bytes
    dsts, srcs, sizes = batch_copy_arrays(0, src_slots, dst_base, dst_slots, block_bytes)
    out = apply_copies(memory, 0, dsts, srcs, sizes).reshape(64, block_bytes)
    expected = memory.reshape(64, block_bytes).copy()
    expected[32 + dst_slots] = expected[src_slots]
    np.testing.assert_array_equal(out, expected)


def test_arrays_of_an_empty_batch_are_empty():
    arrays = batch_copy_arrays(SRC, np.array([], dtype=np.int64), DST, np.array([], dtype=np.int64), 64)
    assert [a.size for a in arrays] == [0, 0, 0]
    assert all(a.dtype == np.uint64 for a in arrays)


def test_arrays_accept_torch_cpu_slots_and_reject_mismatched_lengths():
    dsts, _, sizes = batch_copy_arrays(SRC, torch.tensor([1, 2]).numpy(), DST, torch.tensor([5, 6]).numpy(), 4)
    assert dsts.tolist() == [DST + 20] and sizes.tolist() == [8]
    with pytest.raises(ValueError, match="dst_slots: 3 slots but src_slots has 2"):
        batch_copy_arrays(SRC, np.array([1, 2]), DST, np.array([1, 2, 3]), 4)


def test_slot_range_check_names_the_argument():
    check_slot_range("src_slots", np.array([0, 3, 7]), 8)
    check_slot_range("src_slots", np.array([], dtype=np.int64), 0)
    with pytest.raises(ValueError, match=r"dst_slots: slot 8 is out of range \[0, 8\)"):
        check_slot_range("dst_slots", np.array([0, 8]), 8)
    with pytest.raises(ValueError, match=r"src_slots: slot -1 is out of range \[0, 8\)"):
        check_slot_range("src_slots", np.array([-1, 9]), 8)


# --------------------------------------------------------------------------- ctypes call


class FakeFunction:
    """Stands in for a ctypes function: records argtypes and calls, returns `status`."""

    def __init__(self, status: int = 0):
        self.status, self.calls = status, []
        self.argtypes = self.restype = None

    def __call__(self, *args):
        self.calls.append(args)
        return self.status


class FakeRuntime:
    def __init__(self, *, has_batch: bool = True, status: int = 0):
        if has_batch:
            self.cudaMemcpyBatchAsync = FakeFunction(status)
        self.cudaGetErrorString = lambda status: b"invalid argument"


class FakeStream:
    cuda_stream = 0x1234


def three_arrays():
    return batch_copy_arrays(SRC, np.array([1, 2, 9]), DST, np.array([4, 5, 0]), 1024)


@pytest.mark.parametrize(("version", "num_args"), [(13000, 8), (13020, 8), (12080, 9), (12090, 9)])
def test_call_uses_the_signature_of_the_runtime_version(version, num_args):
    runtime = FakeRuntime()
    batch = MemcpyBatch(runtime, "libcudart.so.x", version)
    dsts, srcs, sizes = three_arrays()

    batch.enqueue(dsts, srcs, sizes, FakeStream())

    function = runtime.cudaMemcpyBatchAsync
    assert len(function.argtypes) == num_args and function.restype is ctypes.c_int
    (args,) = function.calls
    assert len(args) == num_args
    for address, array in zip(args[:3], (dsts, srcs, sizes)):  # host arrays, in this order
        assert list((ctypes.c_uint64 * 2).from_address(address)) == array.tolist()
    assert args[3] == 2  # count: two runs
    assert args[6] == 1  # one attribute entry for the whole batch
    attributes = _MemcpyAttributes.from_address(args[4])
    assert attributes.srcAccessOrder == 1  # cudaMemcpySrcAccessOrderStream
    assert ctypes.c_size_t.from_address(args[5]).value == 0  # it applies from copy 0
    assert args[-1].value == FakeStream.cuda_stream  # the stream is always last


def test_attributes_struct_has_the_c_layout():
    assert ctypes.sizeof(_MemcpyAttributes) == 24  # int + two 8-byte cudaMemLocation + unsigned int
    assert _MemcpyAttributes.flags.offset == 20


def test_call_failure_raises_with_cudas_message():
    batch = MemcpyBatch(FakeRuntime(status=1), "libcudart.so.13", 13000)
    with pytest.raises(RuntimeError, match="cudaMemcpyBatchAsync of 2 copies failed: error 1, invalid argument"):
        batch.enqueue(*three_arrays(), FakeStream())


def test_empty_batch_makes_no_call_and_bad_arrays_are_rejected():
    runtime = FakeRuntime()
    batch = MemcpyBatch(runtime, "libcudart.so.13", 13000)
    empty = np.empty(0, dtype=np.uint64)
    batch.enqueue(empty, empty, empty, FakeStream())
    assert runtime.cudaMemcpyBatchAsync.calls == []
    dsts, srcs, sizes = three_arrays()
    with pytest.raises(ValueError, match="uint64 arrays of one length"):
        batch.enqueue(dsts.astype(np.int64), srcs, sizes, FakeStream())


def test_old_runtime_or_missing_symbol_is_unavailable():
    with pytest.raises(MemcpyBatchUnavailable, match=r"needs CUDA runtime 12.8\+, libcudart.so.12 is CUDA 12.4"):
        MemcpyBatch(FakeRuntime(), "libcudart.so.12", 12040)
    with pytest.raises(MemcpyBatchUnavailable, match="has no cudaMemcpyBatchAsync"):
        MemcpyBatch(FakeRuntime(has_batch=False), "libcudart.so.12", 12080)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_load_without_cuda_is_unavailable():
    with pytest.raises(MemcpyBatchUnavailable, match="CUDA is not available"):
        MemcpyBatch.load()
    assert loaded_cudart_path() is None or "libcudart" in loaded_cudart_path()
