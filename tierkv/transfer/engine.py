r"""Batched block transfers between a pinned CPU slab and a GPU slot pool.

Primitives:
    TransferEngine   gather_h2d / scatter_d2h: one launch per batch on a copy stream, no host sync
    TransferHandle   one enqueued transfer: wait_on_current_stream, is_done, synchronize
    pin_if_cuda      a pinned copy of a CPU tensor when CUDA is available

Ordering. Each direction has its own copy stream, so gathers and scatters overlap on PCIe.

 scatter (D2H) of blocks compute just wrote:
    compute  --[write pool]--(E = record_compute_event())---------------------------->
                                  \
    "d2h"                          '--[wait E]--[slots up]--[copy_slots]--(handle.event)

 gather (H2D) of blocks compute will read:
    "h2d"    --[wait after]--[slots up]--[copy_slots]--(handle.event)
                                                              \
    compute  ------------------------------[handle.wait_on_current_stream()]--[read pool]-->

The engine adds no order between its streams beyond `after` and one rule: slot tensors
given on the device are read after the work already enqueued on the current stream. A gather
that reads slab slots which a scatter may still be writing must pass `after=scatter_handle`.
Tensors used by a transfer are kept alive by the engine until its event completes.

Backends, fastest first: "adaptive" (below), "cupy" (the copy_slots kernel), "torch_uva" (torch
index ops on pinned memory seen through its device address), "copy_loop" (one copy_ per run of
consecutive slots; it reads slot tensors on the host, so device slots cost a host sync). The
first to pass a bit-exact self-test at construction is used; `backend_errors` says why others
were skipped. "adaptive" = "memcpy_batch" for a transfer whose host slot lists form runs of
consecutive slots of at least `COPY_ENGINE_RUN_BYTES` on average (the copy engines then move
few large pieces at the contiguous ceiling, as for far blocks saved chunk by chunk), the cupy
kernel for everything else (scattered blocks, device slots); on the H200 it took exact decode
at 128k from 1.12x to 1.00x the PCIe floor and prefill from 1.13x to 1.04x all-in-GPU
(benchmarks/results/exact-128k-backends-h200-9b5c996.json). Opt-in: "memcpy_batch" alone
(cudaMemcpyBatchAsync on the copy engines, no SMs; CUDA 12.8+; slot tensors are read on the
host like copy_loop, and it cannot be captured in a CUDA graph). Pass a
sequence such as ("memcpy_batch", "cupy") to fall back in order when a backend is unavailable.
A "cpu" engine uses "torch_cpu": index_select + index_copy_, synchronous, no streams.
Invalid slots: CPU slot tensors are checked (ValueError); device slot tensors cannot be checked
without a sync: the cupy kernel skips such pairs and counts them (`count_invalid_slots_sync`).
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Sequence, Union

import torch

from tierkv.transfer import checks, kernels, memcpy_batch
from tierkv.transfer.streams import HIGH_PRIORITY, EventPool, StreamPool

logger = logging.getLogger(__name__)

CUDA_BACKENDS = ("adaptive", "cupy", "torch_uva", "copy_loop")  # tried in this order by default
OPT_IN_BACKENDS = ("memcpy_batch",)  # used only when named in `backend`
COPY_ENGINE_RUN_BYTES = 1 << 20  # "adaptive": mean bytes per run of consecutive slots to use the copy engines
CPU_BACKEND = "torch_cpu"
DIRECTIONS = ("h2d", "d2h")


def pin_if_cuda(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned memory when CUDA is available (a copy unless already pinned), else `t`."""
    if t.device.type != "cpu":
        raise ValueError(f"t: expected a CPU tensor, got one on {t.device}")
    if torch.cuda.is_available() and not t.is_pinned():
        return t.pin_memory()
    return t


class TransferHandle:
    """One enqueued transfer.

    `event` is recorded on the copy stream after the copy (None on a CPU engine). It belongs
    to the handle and goes back to the engine's pool when the handle is garbage-collected:
    use it through the handle, do not keep it longer.
    """

    def __init__(self, event: torch.cuda.Event | None, num_bytes: int, device: torch.device):
        self.event = event
        self.num_bytes = num_bytes
        self.device = device

    def wait_on_current_stream(self) -> None:
        """Make the current stream wait for the copy (no host sync)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def is_done(self) -> bool:
        """True once the copy has completed (polls, never blocks)."""
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Host wait until the copy has completed."""
        if self.event is not None:
            self.event.synchronize()


After = Union[torch.cuda.Event, TransferHandle, Sequence[Union[torch.cuda.Event, TransferHandle]], None]


class TransferEngine:
    """Moves scattered fixed-size blocks between a pinned CPU slab and a device slot pool.

    Not thread-safe: use one engine per thread that enqueues transfers.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        backend: str | Sequence[str] | None = None,
        max_ctas: int | None = None,
        kernel_shape: kernels.KernelShape | None = None,
    ) -> None:
        """`backend`: one name of CUDA_BACKENDS or OPT_IN_BACKENDS forces it (RuntimeError if it
        fails its self-test); a sequence of names is tried in order; None tries CUDA_BACKENDS.
        `max_ctas` bounds the kernel grid (default: one CTA per SM); `kernel_shape` is the cupy
        kernel's words in flight per thread and CTA width (default: KernelShape())."""
        self.device = _normalize_device(device)
        self.backend_errors: dict[str, str] = {}
        self.num_bytes_moved = {direction: 0 for direction in DIRECTIONS}
        self._inflight: list[tuple[torch.cuda.Event, tuple]] = []
        self._streams: StreamPool | None = None
        self._events: EventPool | None = None
        self._cupy_kernel: kernels.CupySlotKernel | None = None
        self._memcpy_batch: memcpy_batch.MemcpyBatch | None = None
        self.num_launches = {"kernel": 0, "copy_engines": 0}  # "adaptive": which path each transfer took
        self.kernel_shape = kernel_shape or kernels.KernelShape()
        if self.device.type == "cpu":
            if backend not in (None, CPU_BACKEND):
                raise ValueError(f"backend: {backend!r} needs CUDA; a cpu engine uses {CPU_BACKEND!r}")
            self.backend = CPU_BACKEND
            self.max_ctas = 0
            return
        self._streams = StreamPool(self.device)
        self._events = EventPool()
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.max_ctas = max_ctas or num_sms
        self._num_invalid = torch.zeros(1, dtype=torch.int64, device=self.device)  # int64 [1]
        torch.cuda.synchronize(self.device)  # the zero-fill lands before any copy stream reads it
        self.backend = self._select_backend(backend)

    def gather_h2d(
        self,
        src: torch.Tensor,
        src_slots: torch.Tensor,
        dst: torch.Tensor,
        dst_slots: torch.Tensor,
        *,
        after: After = None,
    ) -> TransferHandle:
        """Enqueue dst[dst_slots[i]] = src[src_slots[i]] for all i on the "h2d" copy stream.

        src: [num_cpu_slots, *block_shape] CPU, pinned when CUDA; dst: [num_gpu_slots,
        *block_shape] on the engine's device, same dtype; both contiguous. src_slots, dst_slots:
        int64 [n] on the CPU or on the engine's device. The copy starts after `after` (events or
        handles) and nothing else: if compute may still read or write the dst slots, pass
        `after=engine.record_compute_event()`. Returns at once; duplicate dst slots leave an
        unspecified winner.
        """
        return self._transfer("h2d", src, src_slots, dst, dst_slots, after)

    def scatter_d2h(
        self,
        src: torch.Tensor,
        src_slots: torch.Tensor,
        dst: torch.Tensor,
        dst_slots: torch.Tensor,
        *,
        after: After = None,
    ) -> TransferHandle:
        """Enqueue dst[dst_slots[i]] = src[src_slots[i]] on the "d2h" copy stream.

        src: [num_gpu_slots, *block_shape] on the engine's device; dst: [num_cpu_slots,
        *block_shape] CPU, pinned when CUDA. Pass `after=engine.record_compute_event()` when
        compute just wrote src. Otherwise the same contract as gather_h2d.
        """
        return self._transfer("d2h", src, src_slots, dst, dst_slots, after)

    def gather_h2d_inline(self, src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor,
                          dst_slots: torch.Tensor) -> None:
        """dst[dst_slots[i]] = src[src_slots[i]] on the current stream, by the copy kernel: no copy
        stream, event or host wait, so a CUDA graph can capture it. Slot tensors on the engine's
        device (int64 [n]); a "cpu" engine copies at once. Kernel backends only ("cupy",
        "adaptive"). Not counted in `num_bytes_moved` (a graph replays it without calling here):
        the caller counts. The caller keeps the tensors alive until the stream has run the copy.
        A pair whose source slot is negative copies nothing (the kernel skips it and counts it in
        `count_invalid_slots_sync`), so a fixed-size slot list can carry pairs that copy nothing.
        """
        if self.device.type == "cpu":
            keep = src_slots >= 0
            kernels.copy_slots_torch(src, src_slots[keep], dst, dst_slots[keep])
            return
        if self.backend not in ("cupy", "adaptive"):
            raise RuntimeError(f"gather_h2d_inline needs the copy kernel; this engine uses {self.backend!r}")
        if not (src_slots.is_cuda and dst_slots.is_cuda):
            raise ValueError("gather_h2d_inline: src_slots and dst_slots must be on the engine's device")
        self._launch_kernel(src, src_slots, dst, dst_slots, math.prod(src.shape[1:]) * src.element_size())

    def _launch_kernel(self, src, src_slots, dst, dst_slots, block_bytes: int) -> None:
        """The copy kernel on the current stream; slot tensors on the device."""
        copy = kernels.SlotCopy(
            src_address=src.data_ptr(),
            num_src_slots=src.shape[0],
            dst_address=dst.data_ptr(),
            num_dst_slots=dst.shape[0],
            src_slots_address=src_slots.data_ptr(),
            dst_slots_address=dst_slots.data_ptr(),
            num_pairs=src_slots.numel(),
            block_bytes=block_bytes,
        )
        self._cupy_kernel.launch(copy, torch.cuda.current_stream(self.device), self._num_invalid.data_ptr(), self.max_ctas)

    def record_compute_event(self) -> torch.cuda.Event | None:
        """A pooled event recorded on the current (compute) stream now; None on a cpu engine.

        Give it back with `release_event` once nothing will wait on it any more.
        """
        if self._events is None:
            return None
        return self._events.record(torch.cuda.current_stream(self.device))

    def release_event(self, event: torch.cuda.Event | None) -> None:
        """Return an event from `record_compute_event` to the pool."""
        if event is not None and self._events is not None:
            self._events.release(event)

    def stream(self, direction: str) -> torch.cuda.Stream:
        """The copy stream of `direction` ("h2d" or "d2h")."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction: {direction!r} is not one of {DIRECTIONS}")
        if self._streams is None:
            raise ValueError(f"device: a {self.device} engine has no streams")
        return self._streams.get(direction, priority=HIGH_PRIORITY)

    def synchronize(self) -> None:
        """Host wait for every transfer enqueued so far (tests, shutdown; not a hot path)."""
        if self._streams is not None:
            self._streams.synchronize_all()
        self._reap()

    def count_invalid_slots_sync(self) -> int:
        """Slot pairs skipped by the kernel as out of range, since construction (host sync)."""
        if self.device.type == "cpu":
            return 0
        self.synchronize()
        return int(self._num_invalid.item())

    def _transfer(self, direction, src, src_slots, dst, dst_slots, after) -> TransferHandle:
        block_bytes = checks.check_transfer(direction, src, src_slots, dst, dst_slots, self.device)
        num_bytes = src_slots.numel() * block_bytes
        self.num_bytes_moved[direction] += num_bytes
        if self.device.type == "cpu":
            kernels.copy_slots_torch(src, src_slots, dst, dst_slots)
            return TransferHandle(None, num_bytes, self.device)
        self._reap()
        stream = self.stream(direction)
        current = torch.cuda.current_stream(self.device)
        keepalive: tuple = (src, src_slots, dst, dst_slots)
        with torch.cuda.stream(stream):
            for event in _events_of(after):
                stream.wait_event(event)
            if src_slots.is_cuda or dst_slots.is_cuda:
                stream.wait_stream(current)
            if num_bytes:
                keepalive += self._launch(direction, src, src_slots, dst, dst_slots, block_bytes)
            event = self._events.record(stream)
        self._inflight.append((event, keepalive))
        handle = TransferHandle(event, num_bytes, self.device)
        weakref.finalize(handle, self._events.release, event).atexit = False
        return handle

    def _launch(self, direction, src, src_slots, dst, dst_slots, block_bytes) -> tuple:
        """Enqueue the copy on the current (copy) stream; returns what to keep alive until it ends."""
        if self.backend == "memcpy_batch":
            return self._launch_memcpy_batch(src, src_slots, dst, dst_slots, block_bytes)
        if self.backend == "adaptive":
            if (not src_slots.is_cuda and not dst_slots.is_cuda
                    and mean_run_bytes(src_slots, dst_slots, block_bytes) >= COPY_ENGINE_RUN_BYTES):
                self.num_launches["copy_engines"] += 1
                return self._launch_memcpy_batch(src, src_slots, dst, dst_slots, block_bytes)
            self.num_launches["kernel"] += 1
        if self.backend == "copy_loop":
            src_list, dst_list = src_slots.tolist(), dst_slots.tolist()  # host sync for device slots
            checks.check_slot_list("src_slots", src_list, src.shape[0])
            checks.check_slot_list("dst_slots", dst_list, dst.shape[0])
            kernels.copy_slots_loop(src, src_list, dst, dst_list)
            return ()
        src_slots, dst_slots = self._slots_on_device(src_slots, dst_slots)
        if self.backend in ("cupy", "adaptive"):
            self._launch_kernel(src, src_slots, dst, dst_slots, block_bytes)
        else:  # torch_uva
            host_is_src = direction == "h2d"
            src_rows = self._rows(src, block_bytes, is_host=host_is_src)
            dst_rows = self._rows(dst, block_bytes, is_host=not host_is_src)
            word_bytes = kernels.vector_width(block_bytes, src.data_ptr(), dst.data_ptr())
            kernels.copy_slots_torch(
                kernels.as_word_rows(src_rows, word_bytes),
                src_slots,
                kernels.as_word_rows(dst_rows, word_bytes),
                dst_slots,
            )
        return (src_slots, dst_slots)

    def _launch_memcpy_batch(self, src, src_slots, dst, dst_slots, block_bytes) -> tuple:
        """One cudaMemcpyBatchAsync on the current (copy) stream; device slots are read on the host."""
        src_host, dst_host = src_slots.cpu().numpy(), dst_slots.cpu().numpy()  # host sync for device slots
        if src_slots.is_cuda or dst_slots.is_cuda:  # CPU slot tensors were checked already
            checks.check_slot_range("src_slots", src_host, src.shape[0])
            checks.check_slot_range("dst_slots", dst_host, dst.shape[0])
        arrays = memcpy_batch.batch_copy_arrays(src.data_ptr(), src_host, dst.data_ptr(), dst_host, block_bytes)
        self._memcpy_batch.enqueue(*arrays, stream=torch.cuda.current_stream(self.device))
        return arrays

    def _rows(self, t: torch.Tensor, block_bytes: int, *, is_host: bool) -> torch.Tensor:
        if is_host:
            return kernels.pinned_as_cuda_rows(t, self.device, block_bytes)
        return kernels.as_rows(t, block_bytes)

    def _slots_on_device(self, src_slots, dst_slots) -> tuple[torch.Tensor, torch.Tensor]:
        """Device int64 slot tensors; CPU ones go up through pinned staging on the current stream."""
        if not src_slots.is_cuda and not dst_slots.is_cuda:
            both = torch.stack((src_slots, dst_slots)).pin_memory()  # int64 [2, n]
            both = both.to(self.device, non_blocking=True)
            return both[0], both[1]
        return self._slot_tensor_on_device(src_slots), self._slot_tensor_on_device(dst_slots)

    def _slot_tensor_on_device(self, slots: torch.Tensor) -> torch.Tensor:
        if slots.is_cuda:
            return slots.contiguous()
        return slots.pin_memory().to(self.device, non_blocking=True)

    def _reap(self) -> None:
        """Drop the references held for transfers whose event has completed."""
        self._inflight = [job for job in self._inflight if not job[0].query()]

    def _select_backend(self, requested: str | Sequence[str] | None) -> str:
        is_forced = isinstance(requested, str)
        names = CUDA_BACKENDS if requested is None else (requested,) if is_forced else tuple(requested)
        known = CUDA_BACKENDS + OPT_IN_BACKENDS
        if not names or any(name not in known for name in names):
            raise ValueError(f"backend: {requested!r} is not one of {known} or a sequence of them")
        for name in names:
            try:
                self._prepare_backend(name)
                return name
            except Exception as exc:  # kept in backend_errors and logged; a forced backend re-raises
                reason = self.backend_errors[name] = f"{type(exc).__name__}: {exc}"
                if is_forced:
                    raise RuntimeError(f"backend: {name!r} is unavailable: {reason}") from exc
                logger.warning("transfer backend %r unavailable, trying the next: %s", name, reason)
        raise RuntimeError(f"no transfer backend works on {self.device}: {self.backend_errors}")

    def _prepare_backend(self, name: str) -> None:
        """Make `name` the backend and prove it with a bit-exact round trip (init only; syncs)."""
        generator = torch.Generator().manual_seed(0)
        # 8 blocks of 48 bytes: 16-byte words, like real KV blocks.
        slab = torch.randint(-(2**15), 2**15, (8, 3, 8), generator=generator, dtype=torch.int16)
        slab = pin_if_cuda(slab)
        if name == "cupy":
            self._cupy_kernel = kernels.CupySlotKernel(self.kernel_shape)
            self._cupy_kernel.check_host_address(slab.data_ptr())
            self._cupy_kernel.compile(16, self.device.index)
        if name == "memcpy_batch":
            self._memcpy_batch = memcpy_batch.MemcpyBatch.load()
        if name == "adaptive":  # both of its paths, each proven by its own self-test
            self._prepare_backend("memcpy_batch")
            self._prepare_backend("cupy")
            self.backend = name
            return
        self.backend = name
        order = torch.randperm(8, generator=generator)
        identity = torch.arange(8)
        pool = torch.zeros(slab.shape, dtype=slab.dtype, device=self.device)
        back = pin_if_cuda(torch.zeros_like(slab))
        torch.cuda.synchronize(self.device)  # the zero-fill is on the current stream, not `after`
        self.gather_h2d(slab, order, pool, identity).synchronize()
        self.scatter_d2h(pool, identity, back, order).synchronize()
        if not torch.equal(pool.cpu(), slab[order]) or not torch.equal(back, slab):
            raise RuntimeError(f"self-test of backend {name!r} copied wrong bytes")


def mean_run_bytes(src_slots: torch.Tensor, dst_slots: torch.Tensor, block_bytes: int) -> float:
    """Bytes per run of consecutive slot pairs (`memcpy_batch.run_starts`: what one batched memcpy
    moves); CPU slot tensors."""
    n = src_slots.numel()
    if n == 0:
        return 0.0
    runs = memcpy_batch.run_starts(src_slots.reshape(-1).numpy(), dst_slots.reshape(-1).numpy()).size
    return n * block_bytes / runs


def _normalize_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device: {device} is neither cpu nor cuda")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {device} requested but CUDA is not available")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def _events_of(after: After) -> list[torch.cuda.Event]:
    items = after if isinstance(after, (list, tuple)) else (after,)
    events = [getattr(item, "event", item) for item in items]  # handles (anything with .event) or events
    return [event for event in events if event is not None]


def configured_engine(device: torch.device | str, transfer_backend: str) -> TransferEngine:
    """The engine `scheduler.transfer_backend` asks for: 'auto' tries CUDA_BACKENDS in order, a
    name forces that backend on CUDA; a CPU device always copies with torch."""
    device = _normalize_device(device)
    backend = None if transfer_backend == "auto" or device.type == "cpu" else transfer_backend
    return TransferEngine(device, backend=backend)
