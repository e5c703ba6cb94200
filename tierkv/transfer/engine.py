r"""Batched block transfers between a pinned CPU slab and a GPU slot pool: the queueing side.

Primitives:
    TransferEngine     gather_h2d / scatter_d2h: one launch per batch on a copy stream, no host sync
    configured_engine  the engine `scheduler.transfer_backend` asks for

How a transfer copies (the backend chosen at construction: cupy kernel, batched memcpy, torch
index ops) is `tierkv.transfer.copy_backend.CopyBackend`; the engine owns the copy streams, the
events, the order between them and the tensors kept alive until a copy ends.

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
"""

from __future__ import annotations

import math
import weakref
from typing import Sequence

import torch

from tierkv.transfer import checks, kernels
from tierkv.transfer.copy_backend import CPU_BACKEND, CopyBackend
from tierkv.transfer.handle import After, TransferHandle, events_of
from tierkv.transfer.streams import HIGH_PRIORITY, EventPool, StreamPool

DIRECTIONS = ("h2d", "d2h")


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
        self.num_bytes_moved = {direction: 0 for direction in DIRECTIONS}
        self._inflight: list[tuple[torch.cuda.Event, tuple]] = []
        self._streams: StreamPool | None = None
        self._events: EventPool | None = None
        if self.device.type == "cpu" and backend not in (None, CPU_BACKEND):
            raise ValueError(f"backend: {backend!r} needs CUDA; a cpu engine uses {CPU_BACKEND!r}")
        if self.device.type != "cpu":
            self._streams = StreamPool(self.device)
            self._events = EventPool()
        self._copy = CopyBackend(self.device, max_ctas=max_ctas, kernel_shape=kernel_shape)
        if self.device.type != "cpu":
            self._copy.select(backend, lambda direction, *tensors: self._transfer(direction, *tensors, None))

    @property
    def backend(self) -> str:
        """The backend the engine copies with (CUDA_BACKENDS, OPT_IN_BACKENDS or CPU_BACKEND)."""
        return self._copy.name

    @property
    def backend_errors(self) -> dict[str, str]:
        """Why each backend tried before the chosen one was skipped."""
        return self._copy.errors

    @property
    def num_launches(self) -> dict[str, int]:
        """"adaptive": how many transfers took the copy kernel ("kernel") or the copy engines."""
        return self._copy.num_launches

    @property
    def max_ctas(self) -> int:
        """The copy kernel's grid bound (0 on a cpu engine)."""
        return self._copy.max_ctas

    @property
    def kernel_shape(self) -> kernels.KernelShape:
        return self._copy.kernel_shape

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
        self._copy.launch_kernel(src, src_slots, dst, dst_slots, math.prod(src.shape[1:]) * src.element_size())

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
        return int(self._copy.invalid_counter.item())

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
            for event in events_of(after):
                stream.wait_event(event)
            if src_slots.is_cuda or dst_slots.is_cuda:
                stream.wait_stream(current)
            if num_bytes:
                keepalive += self._copy.launch(direction, src, src_slots, dst, dst_slots, block_bytes)
            event = self._events.record(stream)
        self._inflight.append((event, keepalive))
        handle = TransferHandle(event, num_bytes, self.device)
        weakref.finalize(handle, self._events.release, event).atexit = False
        return handle

    def _reap(self) -> None:
        """Drop the references held for transfers whose event has completed."""
        self._inflight = [job for job in self._inflight if not job[0].query()]


def _normalize_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device: {device} is neither cpu nor cuda")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {device} requested but CUDA is not available")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def configured_engine(device: torch.device | str, transfer_backend: str) -> TransferEngine:
    """The engine `scheduler.transfer_backend` asks for: 'auto' tries CUDA_BACKENDS in order, a
    name forces that backend on CUDA; a CPU device always copies with torch."""
    device = _normalize_device(device)
    backend = None if transfer_backend == "auto" or device.type == "cpu" else transfer_backend
    return TransferEngine(device, backend=backend)
