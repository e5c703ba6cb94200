"""TransferEngine: exact block moves both ways, argument checks, stream ordering, no host sync."""

from __future__ import annotations

import gc

import pytest
import torch

from tierkv.transfer import EventPool, TransferEngine, TransferHandle, pin_if_cuda
from tierkv.transfer.kernels import KernelShape, contiguous_runs, copy_slots_loop, vector_width

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KIB = 1024
# About 0.1 s of GPU time at H200 clocks: far longer than one gather call takes on the host.
SLEEP_CYCLES = 200_000_000


def random_blocks(num_slots: int, block_shape: tuple[int, ...], dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_slots, *block_shape), generator=generator).to(dtype)


def random_slot_pairs(num_src: int, num_dst: int, n: int, seed: int):
    """Distinct random src and dst slots, int64 [n] each, in random order."""
    generator = torch.Generator().manual_seed(seed)
    src_slots = torch.randperm(num_src, generator=generator)[:n]
    dst_slots = torch.randperm(num_dst, generator=generator)[:n]
    return src_slots, dst_slots


def moved(dst_before: torch.Tensor, src, src_slots, dst_slots) -> torch.Tensor:
    """What dst must hold after dst[dst_slots] = src[src_slots]; all on the CPU."""
    expected = dst_before.clone()
    expected[dst_slots] = src[src_slots]
    return expected


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual.cpu().view(torch.uint8), expected.cpu().view(torch.uint8))


# --------------------------------------------------------------------------- CPU path


@pytest.fixture
def cpu_engine() -> TransferEngine:
    return TransferEngine("cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_gather_moves_random_blocks_exactly(cpu_engine, dtype):
    slab = random_blocks(32, (2, 4, 8), dtype, seed=1)
    pool = random_blocks(20, (2, 4, 8), dtype, seed=2)
    src_slots, dst_slots = random_slot_pairs(32, 20, 13, seed=3)
    expected = moved(pool, slab, src_slots, dst_slots)

    handle = cpu_engine.gather_h2d(slab, src_slots, pool, dst_slots)

    assert_same_bits(pool, expected)
    assert handle.num_bytes == 13 * 2 * 4 * 8 * slab.element_size()
    assert handle.event is None and handle.is_done()


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_scatter_moves_random_blocks_exactly(cpu_engine, dtype):
    pool = random_blocks(20, (3, 16), dtype, seed=4)
    slab = random_blocks(40, (3, 16), dtype, seed=5)
    src_slots, dst_slots = random_slot_pairs(20, 40, 20, seed=6)
    expected = moved(slab, pool, src_slots, dst_slots)

    handle = cpu_engine.scatter_d2h(pool, src_slots, slab, dst_slots)

    assert_same_bits(slab, expected)
    assert handle.num_bytes == 20 * 3 * 16 * pool.element_size()


def test_cpu_round_trip_restores_the_slab(cpu_engine):
    slab = random_blocks(16, (8,), torch.bfloat16, seed=7)
    pool = torch.zeros((16, 8), dtype=torch.bfloat16)
    back = torch.zeros_like(slab)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(8))
    identity = torch.arange(16)

    cpu_engine.gather_h2d(slab, order, pool, identity)
    cpu_engine.scatter_d2h(pool, identity, back, order)

    assert_same_bits(back, slab)
    assert cpu_engine.num_bytes_moved == {"h2d": 16 * 16, "d2h": 16 * 16}


def test_cpu_empty_batch_changes_nothing(cpu_engine):
    slab = random_blocks(4, (8,), torch.float16, seed=9)
    pool = random_blocks(4, (8,), torch.float16, seed=10)
    before = pool.clone()
    empty = torch.empty(0, dtype=torch.int64)

    handle = cpu_engine.gather_h2d(slab, empty, pool, empty)

    assert handle.num_bytes == 0 and handle.is_done()
    handle.wait_on_current_stream()
    handle.synchronize()
    assert_same_bits(pool, before)


def test_cpu_engine_has_no_events_or_streams(cpu_engine):
    assert cpu_engine.backend == "torch_cpu"
    assert cpu_engine.record_compute_event() is None
    cpu_engine.release_event(None)
    cpu_engine.synchronize()
    assert cpu_engine.count_invalid_slots_sync() == 0
    with pytest.raises(ValueError, match="device"):
        cpu_engine.stream("h2d")


def _valid_args():
    slab = torch.zeros((8, 2, 4), dtype=torch.bfloat16)
    pool = torch.zeros((6, 2, 4), dtype=torch.bfloat16)
    return {"src": slab, "src_slots": torch.tensor([0, 1]), "dst": pool, "dst_slots": torch.tensor([2, 3])}


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("dst", torch.zeros((6, 2, 4), dtype=torch.float16), "dst: dtype"),
        ("dst", torch.zeros((6, 2, 5), dtype=torch.bfloat16), "dst: block shape"),
        ("src", torch.zeros((8, 4, 2), dtype=torch.bfloat16), "dst: block shape"),
        ("src", torch.zeros((8, 4, 2), dtype=torch.bfloat16).transpose(1, 2), "src: must be contiguous"),
        ("src", torch.zeros((), dtype=torch.bfloat16), "src: expected shape"),
        ("src_slots", torch.tensor([0, 1], dtype=torch.int32), "src_slots: expected int64"),
        ("dst_slots", torch.tensor([[2, 3]]), "dst_slots: expected int64"),
        ("dst_slots", torch.tensor([2, 3, 4]), "dst_slots: 3 slots but src_slots has 2"),
        ("src_slots", torch.tensor([0, 8]), r"src_slots: slot 8 is out of range \[0, 8\)"),
        ("dst_slots", torch.tensor([-1, 3]), r"dst_slots: slot -1 is out of range \[0, 6\)"),
        ("src", torch.zeros((8, 2, 4), dtype=torch.bfloat16, device="meta"), "src: expected a tensor on cpu"),
    ],
)
def test_cpu_rejects_mismatched_arguments_naming_them(cpu_engine, name, value, message):
    args = _valid_args()
    args[name] = value
    with pytest.raises(ValueError, match=message):
        cpu_engine.gather_h2d(**args)


def test_non_tensor_slots_are_a_type_error(cpu_engine):
    args = _valid_args()
    args["src_slots"] = [0, 1]
    with pytest.raises(TypeError, match="src_slots"):
        cpu_engine.gather_h2d(**args)


def test_cpu_engine_refuses_cuda_backends():
    with pytest.raises(ValueError, match="backend"):
        TransferEngine("cpu", backend="cupy")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_engine_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        TransferEngine("cuda")


def test_pin_if_cuda_keeps_values_and_rejects_device_tensors():
    t = torch.arange(6, dtype=torch.float32)
    pinned = pin_if_cuda(t)
    assert torch.equal(pinned, t)
    assert pinned.is_pinned() == torch.cuda.is_available()
    with pytest.raises(ValueError, match="t: expected a CPU tensor"):
        pin_if_cuda(torch.empty(2, device="meta"))


def test_contiguous_runs_merge_only_lockstep_pairs():
    assert contiguous_runs([3, 4, 5, 9, 10, 2], [0, 1, 2, 7, 9, 3]) == [
        (3, 0, 3),
        (9, 7, 1),
        (10, 9, 1),
        (2, 3, 1),
    ]
    assert contiguous_runs([], []) == []


def test_copy_slots_loop_matches_indexing():
    src = random_blocks(12, (5,), torch.float32, seed=11)
    dst = torch.zeros((12, 5))
    src_slots, dst_slots = [4, 5, 6, 0, 11], [7, 8, 9, 1, 0]
    expected = moved(dst, src, torch.tensor(src_slots), torch.tensor(dst_slots))
    copy_slots_loop(src, src_slots, dst, dst_slots)
    assert_same_bits(dst, expected)


@pytest.mark.parametrize(
    ("block_bytes", "addresses", "width"),
    [(65536, (4096, 8192), 16), (48, (0, 16), 16), (24, (0, 16), 8), (6, (0, 16), 2), (64, (8, 0), 8), (3, (0,), 1)],
)
def test_vector_width_respects_size_and_alignment(block_bytes, addresses, width):
    assert vector_width(block_bytes, *addresses) == width


# --------------------------------------------------------------------------- GPU path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
class TestOnGpu:
    @pytest.fixture(scope="class")
    def kernel_engine(self):
        pytest.importorskip("cupy", reason="the kernel path is compiled with cupy")
        engine = TransferEngine("cuda", backend="cupy")
        yield engine
        engine.synchronize()

    @staticmethod
    def _slots(slots: torch.Tensor, on: str) -> torch.Tensor:
        return slots.to("cuda") if on == "cuda" else slots

    @pytest.mark.parametrize("block_kib", [16, 64, 256])
    @pytest.mark.parametrize("slots_on", ["cpu", "cuda"])
    def test_kernel_moves_random_blocks_both_ways(self, kernel_engine, block_kib, slots_on):
        block_shape = (2, block_kib * KIB // 4)  # bf16: block_kib KiB per block
        slab = pin_if_cuda(random_blocks(48, block_shape, torch.bfloat16, seed=block_kib))
        pool = random_blocks(40, block_shape, torch.bfloat16, seed=block_kib + 1).cuda()
        pool_before = pool.cpu()  # also waits for the upload: copies do not wait for compute
        src_slots, dst_slots = random_slot_pairs(48, 40, 33, seed=block_kib + 2)

        gathered = kernel_engine.gather_h2d(
            slab, self._slots(src_slots, slots_on), pool, self._slots(dst_slots, slots_on)
        )
        gathered.synchronize()
        assert_same_bits(pool, moved(pool_before, slab, src_slots, dst_slots))
        assert gathered.num_bytes == 33 * block_kib * KIB

        back = pin_if_cuda(torch.zeros_like(slab))
        scattered = kernel_engine.scatter_d2h(
            pool, self._slots(dst_slots, slots_on), back, self._slots(src_slots, slots_on)
        )
        scattered.synchronize()
        assert_same_bits(back, moved(torch.zeros_like(slab), slab, src_slots, src_slots))

    @pytest.mark.parametrize(("words_per_thread", "threads", "max_ctas"), [(8, 512, None), (16, 128, 4), (4, 128, 1000)])
    def test_kernel_shapes_and_grids_move_blocks_both_ways(self, words_per_thread, threads, max_ctas):
        pytest.importorskip("cupy", reason="the kernel path is compiled with cupy")
        shape = KernelShape(words_per_thread, threads)
        engine = TransferEngine("cuda", backend="cupy", max_ctas=max_ctas, kernel_shape=shape)
        for block_shape in ((2, 16 * KIB), (3,)):  # 64 KiB blocks (16-byte words), 6-byte blocks
            self._assert_round_trip(engine, block_shape, seed=words_per_thread + threads)

    def test_memcpy_batch_moves_blocks_both_ways(self):
        engine = self._memcpy_batch_engine()
        for block_shape in ((2, 16 * KIB), (2, 4 * KIB), (3,)):
            self._assert_round_trip(engine, block_shape, seed=21)
        slab = pin_if_cuda(random_blocks(16, (4096,), torch.bfloat16, seed=22))
        pool = torch.zeros((16, 4096), dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        runs = torch.tensor([3, 4, 5, 6, 9, 10, 0])  # consecutive pairs become one copy each
        engine.gather_h2d(slab, runs, pool, runs.cuda()).synchronize()
        assert_same_bits(pool, moved(torch.zeros((16, 4096), dtype=torch.bfloat16), slab, runs, runs))
        with pytest.raises(ValueError, match=r"dst_slots: slot 16 is out of range \[0, 16\)"):
            engine.gather_h2d(slab, runs[:2], pool, torch.tensor([1, 16], device="cuda"))

    def test_adaptive_uses_the_copy_engines_for_long_runs_and_the_kernel_otherwise(self):
        pytest.importorskip("cupy", reason="the kernel path is compiled with cupy")
        self._memcpy_batch_engine()  # skips where the runtime has no batched memcpy
        engine = TransferEngine("cuda", backend="adaptive")
        assert engine.backend == "adaptive"
        self._assert_round_trip(engine, (2, 16 * KIB), seed=31)  # scattered 64 KiB blocks: the kernel
        assert engine.num_launches["copy_engines"] == 0 and engine.num_launches["kernel"] == 4
        block_shape = (2, 16 * KIB)  # 64 KiB: runs of 20 consecutive blocks are 1.25 MiB each
        slab = pin_if_cuda(random_blocks(64, block_shape, torch.bfloat16, seed=32))
        pool = torch.zeros((48, *block_shape), dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        src = torch.cat([torch.arange(30, 50), torch.arange(0, 20)])
        dst = torch.cat([torch.arange(0, 20), torch.arange(25, 45)])
        engine.gather_h2d(slab, src, pool, dst).synchronize()
        assert engine.num_launches["copy_engines"] == 1
        assert_same_bits(pool, moved(torch.zeros((48, *block_shape), dtype=torch.bfloat16), slab, src, dst))
        back = pin_if_cuda(torch.zeros_like(slab))
        engine.scatter_d2h(pool, dst, back, src).synchronize()
        assert engine.num_launches["copy_engines"] == 2
        assert_same_bits(back, moved(torch.zeros_like(slab), slab, src, src))
        engine.gather_h2d(slab, src.cuda(), pool, dst.cuda()).synchronize()  # device slots: never a host read
        assert engine.num_launches["copy_engines"] == 2

    def test_backend_sequence_falls_back_in_order(self):
        engine = TransferEngine("cuda", backend=("memcpy_batch", "torch_uva"))
        assert engine.backend in ("memcpy_batch", "torch_uva")
        assert (engine.backend == "torch_uva") == ("memcpy_batch" in engine.backend_errors)
        with pytest.raises(ValueError, match="backend"):
            TransferEngine("cuda", backend=("memcpy_batch", "no_such_backend"))

    @staticmethod
    def _memcpy_batch_engine() -> TransferEngine:
        """cudaMemcpyBatchAsync must work where torch's CUDA runtime is 12.8 or newer."""
        major, minor = (int(part) for part in torch.version.cuda.split(".")[:2])
        try:
            return TransferEngine("cuda", backend="memcpy_batch")
        except RuntimeError as exc:
            if (major, minor) >= (12, 8):
                raise
            pytest.skip(f"CUDA runtime {torch.version.cuda} has no cudaMemcpyBatchAsync: {exc}")

    def _assert_round_trip(self, engine, block_shape, seed, slots_on=("cpu", "cuda")):
        """Random scattered gather then scatter back, CPU slots then device slots, bit-exact."""
        for on in slots_on:
            slab = pin_if_cuda(random_blocks(48, block_shape, torch.bfloat16, seed=seed))
            pool = random_blocks(40, block_shape, torch.bfloat16, seed=seed + 1).cuda()
            pool_before = pool.cpu()  # also waits for the upload: copies do not wait for compute
            src_slots, dst_slots = random_slot_pairs(48, 40, 33, seed=seed + 2)
            engine.gather_h2d(slab, self._slots(src_slots, on), pool, self._slots(dst_slots, on)).synchronize()
            assert_same_bits(pool, moved(pool_before, slab, src_slots, dst_slots))
            back = pin_if_cuda(torch.zeros_like(slab))
            engine.scatter_d2h(pool, self._slots(dst_slots, on), back, self._slots(src_slots, on)).synchronize()
            assert_same_bits(back, moved(torch.zeros_like(slab), slab, src_slots, src_slots))

    def test_kernel_handles_blocks_not_a_multiple_of_16_bytes(self, kernel_engine):
        slab = pin_if_cuda(random_blocks(10, (3,), torch.float16, seed=12))  # 6-byte blocks
        pool = torch.zeros((7, 3), dtype=torch.float16, device="cuda")
        torch.cuda.synchronize()  # the zero-fill runs on the compute stream; copies do not wait for it
        src_slots, dst_slots = random_slot_pairs(10, 7, 7, seed=13)
        kernel_engine.gather_h2d(slab, src_slots, pool, dst_slots).synchronize()
        assert_same_bits(pool, moved(torch.zeros((7, 3), dtype=torch.float16), slab, src_slots, dst_slots))

    @pytest.mark.parametrize("backend", ["torch_uva", "copy_loop"])
    def test_fallback_backends_move_blocks_both_ways(self, backend):
        engine = TransferEngine("cuda", backend=backend)
        slab = pin_if_cuda(random_blocks(24, (64 * KIB // 4,), torch.float32, seed=14))
        pool = torch.zeros((16, 64 * KIB // 4), device="cuda")
        torch.cuda.synchronize()
        src_slots, dst_slots = random_slot_pairs(24, 16, 16, seed=15)
        engine.gather_h2d(slab, src_slots, pool, dst_slots.cuda()).synchronize()
        assert_same_bits(pool, moved(torch.zeros((16, 64 * KIB // 4)), slab, src_slots, dst_slots))
        back = pin_if_cuda(torch.zeros_like(slab))
        engine.scatter_d2h(pool, dst_slots, back, src_slots).synchronize()
        assert_same_bits(back, moved(torch.zeros_like(slab), slab, src_slots, src_slots))

    def test_kernel_skips_and_counts_invalid_device_slots(self):
        pytest.importorskip("cupy", reason="the kernel path is compiled with cupy")
        engine = TransferEngine("cuda", backend="cupy")
        slab = pin_if_cuda(random_blocks(4, (1024,), torch.float32, seed=16))
        pool = torch.zeros((4, 1024), device="cuda")
        src_slots = torch.tensor([0, 99, 2], device="cuda")  # device slots: ordered after the fill
        dst_slots = torch.tensor([1, 2, 3], device="cuda")
        engine.gather_h2d(slab, src_slots, pool, dst_slots).synchronize()
        assert engine.count_invalid_slots_sync() == 1
        expected = torch.zeros((4, 1024))
        expected[1], expected[3] = slab[0], slab[2]
        assert_same_bits(pool, expected)

    def test_unpinned_slab_is_rejected(self, kernel_engine):
        pool = torch.zeros((4, 8), device="cuda")
        slots = torch.arange(2)
        with pytest.raises(ValueError, match="src: the CPU slab must be in pinned memory"):
            kernel_engine.gather_h2d(torch.zeros((4, 8)), slots, pool, slots)

    def test_scatter_after_compute_event_sees_the_new_data(self, kernel_engine):
        pool = torch.zeros((8, 4096), device="cuda")  # 16 KiB blocks
        slab = pin_if_cuda(torch.zeros((8, 4096)))
        slots = torch.arange(8)
        torch.cuda._sleep(SLEEP_CYCLES)  # the write below lands late on the compute stream
        pool.fill_(7.0)
        written = kernel_engine.record_compute_event()

        handle = kernel_engine.scatter_d2h(pool, slots, slab, slots, after=written)
        handle.synchronize()

        assert bool((slab == 7.0).all())
        kernel_engine.release_event(written)

    @pytest.mark.parametrize("slots_on", ["cpu", "cuda"])
    def test_gather_returns_while_preceding_gpu_work_still_runs(self, kernel_engine, slots_on):
        slab = pin_if_cuda(random_blocks(16, (4096,), torch.float32, seed=17))
        pool = torch.zeros((16, 4096), device="cuda")
        slots = self._slots(torch.randperm(16, generator=torch.Generator().manual_seed(18)), slots_on)
        kernel_engine.gather_h2d(slab, slots, pool, slots).synchronize()  # warm the staging path
        pool.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)
        busy = kernel_engine.record_compute_event()

        handle = kernel_engine.gather_h2d(slab, slots, pool, slots, after=busy)

        assert not busy.query(), "gather_h2d waited for the GPU: the sleep had already finished"
        assert not handle.is_done()
        handle.wait_on_current_stream()
        result = pool.clone()  # on the compute stream, ordered after the copy
        torch.cuda.current_stream().synchronize()
        assert_same_bits(result, slab)
        kernel_engine.release_event(busy)

    def test_handle_events_return_to_the_pool(self, kernel_engine):
        slab = pin_if_cuda(torch.zeros((2, 4096)))
        pool = torch.zeros((2, 4096), device="cuda")
        slots = torch.arange(2)
        handle = kernel_engine.gather_h2d(slab, slots, pool, slots)
        handle.synchronize()
        free_before = kernel_engine._events.num_free
        del handle
        gc.collect()
        assert kernel_engine._events.num_free == free_before + 1

    def test_event_pool_reuses_completed_events(self):
        events = EventPool()
        first = events.record(torch.cuda.current_stream())
        first.synchronize()
        events.release(first)
        assert events.acquire() is first
        assert events.num_created == 1
        assert isinstance(TransferHandle(first, 0, torch.device("cuda")).is_done(), bool)


def test_mean_run_bytes_counts_runs_where_both_slots_advance_by_one():
    from tierkv.transfer.copy_backend import mean_run_bytes

    t = torch.tensor
    assert mean_run_bytes(t([3, 4, 5, 9]), t([0, 1, 2, 3]), 10) == 4 * 10 / 2      # src breaks after 5
    assert mean_run_bytes(t([3, 4, 5, 6]), t([0, 1, 7, 8]), 10) == 4 * 10 / 2      # dst breaks after 1
    assert mean_run_bytes(t([7]), t([2]), 10) == 10
    assert mean_run_bytes(t([], dtype=torch.int64), t([], dtype=torch.int64), 10) == 0
    order = torch.randperm(50)
    assert mean_run_bytes(torch.arange(50), torch.arange(50), 64) == 50 * 64
    assert mean_run_bytes(order, torch.arange(50), 64) <= 50 * 64
