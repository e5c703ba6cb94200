"""How one transfer engine copies slot pairs: the backend chosen at construction and what it runs.

Primitives:
    CopyBackend      the chosen backend (`name`), its resources (the cupy kernel and its grid, the
                     batched memcpy) and `launch`: one transfer's copy on the current stream
    mean_run_bytes   bytes per run of consecutive slot pairs ("adaptive"'s rule)
    CUDA_BACKENDS, OPT_IN_BACKENDS, CPU_BACKEND, COPY_ENGINE_RUN_BYTES

Backends, fastest first: "adaptive" (below), "cupy" (the copy_slots kernel), "torch_uva" (torch
index ops on pinned memory seen through its device address), "copy_loop" (one copy_ per run of
consecutive slots; it reads slot tensors on the host, so device slots cost a host sync). The
first to pass a bit-exact self-test at construction is used; `errors` says why others
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
without a sync: the cupy kernel skips such pairs and counts them in `invalid_counter`.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from tierkv.transfer import checks, kernels, memcpy_batch
from tierkv.transfer.device import pin_if_cuda

logger = logging.getLogger(__name__)

CUDA_BACKENDS = ("adaptive", "cupy", "torch_uva", "copy_loop")  # tried in this order by default
OPT_IN_BACKENDS = ("memcpy_batch",)  # used only when named in `backend`
COPY_ENGINE_RUN_BYTES = 1 << 20  # "adaptive": mean bytes per run of consecutive slots to use the copy engines
CPU_BACKEND = "torch_cpu"

# transfer(direction, src, src_slots, dst, dst_slots) -> a handle with synchronize(): the engine's
# whole path (copy stream, slot staging, launch), which a backend's self-test runs through
Transfer = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], object]


class CopyBackend:
    """One engine's copy backend: `name` (None until `select` proves one on CUDA), the kernel grid
    (`max_ctas`, default one CTA per SM; 0 on CPU) and shape, why other backends were skipped
    (`errors`) and which path each "adaptive" transfer took (`num_launches`)."""

    def __init__(self, device: torch.device, *, max_ctas: int | None = None,
                 kernel_shape: kernels.KernelShape | None = None) -> None:
        self.device = device
        self.kernel_shape = kernel_shape or kernels.KernelShape()
        self.errors: dict[str, str] = {}
        self.num_launches = {"kernel": 0, "copy_engines": 0}
        self._cupy_kernel: kernels.CupySlotKernel | None = None
        self._memcpy_batch: memcpy_batch.MemcpyBatch | None = None
        if device.type == "cpu":
            self.name: str | None = CPU_BACKEND
            self.max_ctas = 0
            self.invalid_counter: torch.Tensor | None = None
            return
        self.name = None
        self.max_ctas = max_ctas or torch.cuda.get_device_properties(device).multi_processor_count
        self.invalid_counter = torch.zeros(1, dtype=torch.int64, device=device)  # int64 [1]: pairs skipped
        torch.cuda.synchronize(device)  # the zero-fill lands before any copy stream reads it

    def select(self, requested: str | Sequence[str] | None, transfer: Transfer) -> str:
        """The first backend of `requested` that loads and passes its self-test through `transfer`
        (init only; syncs). One name forces it (RuntimeError if it fails); a sequence is tried in
        order; None tries CUDA_BACKENDS."""
        is_forced = isinstance(requested, str)
        names = CUDA_BACKENDS if requested is None else (requested,) if is_forced else tuple(requested)
        known = CUDA_BACKENDS + OPT_IN_BACKENDS
        if not names or any(name not in known for name in names):
            raise ValueError(f"backend: {requested!r} is not one of {known} or a sequence of them")
        for name in names:
            try:
                self._prepare(name, transfer)
                return name
            except Exception as exc:  # kept in errors and logged; a forced backend re-raises
                reason = self.errors[name] = f"{type(exc).__name__}: {exc}"
                if is_forced:
                    raise RuntimeError(f"backend: {name!r} is unavailable: {reason}") from exc
                logger.warning("transfer backend %r unavailable, trying the next: %s", name, reason)
        raise RuntimeError(f"no transfer backend works on {self.device}: {self.errors}")

    def _prepare(self, name: str, transfer: Transfer) -> None:
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
            self._prepare("memcpy_batch", transfer)
            self._prepare("cupy", transfer)
            self.name = name
            return
        self.name = name
        order = torch.randperm(8, generator=generator)
        identity = torch.arange(8)
        pool = torch.zeros(slab.shape, dtype=slab.dtype, device=self.device)
        back = pin_if_cuda(torch.zeros_like(slab))
        torch.cuda.synchronize(self.device)  # the zero-fill is on the current stream, not `after`
        transfer("h2d", slab, order, pool, identity).synchronize()
        transfer("d2h", pool, identity, back, order).synchronize()
        if not torch.equal(pool.cpu(), slab[order]) or not torch.equal(back, slab):
            raise RuntimeError(f"self-test of backend {name!r} copied wrong bytes")

    def launch(self, direction: str, src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor,
               dst_slots: torch.Tensor, block_bytes: int) -> tuple:
        """Enqueue dst[dst_slots[i]] = src[src_slots[i]] on the current (copy) stream (arguments as
        `TransferEngine.gather_h2d`'s, checked); returns what to keep alive until it ends."""
        if self.name == "memcpy_batch":
            return self._launch_memcpy_batch(src, src_slots, dst, dst_slots, block_bytes)
        if self.name == "adaptive":
            if (not src_slots.is_cuda and not dst_slots.is_cuda
                    and mean_run_bytes(src_slots, dst_slots, block_bytes) >= COPY_ENGINE_RUN_BYTES):
                self.num_launches["copy_engines"] += 1
                return self._launch_memcpy_batch(src, src_slots, dst, dst_slots, block_bytes)
            self.num_launches["kernel"] += 1
        if self.name == "copy_loop":
            src_list, dst_list = src_slots.tolist(), dst_slots.tolist()  # host sync for device slots
            checks.check_slot_list("src_slots", src_list, src.shape[0])
            checks.check_slot_list("dst_slots", dst_list, dst.shape[0])
            kernels.copy_slots_loop(src, src_list, dst, dst_list)
            return ()
        src_slots, dst_slots = self._slots_on_device(src_slots, dst_slots)
        if self.name in ("cupy", "adaptive"):
            self.launch_kernel(src, src_slots, dst, dst_slots, block_bytes)
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

    def launch_kernel(self, src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor,
                      block_bytes: int) -> None:
        """The copy kernel on the current stream; slot tensors (int64 [n]) on the device. A pair out
        of range is skipped and counted in `invalid_counter`."""
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
        stream = torch.cuda.current_stream(self.device)
        self._cupy_kernel.launch(copy, stream, self.invalid_counter.data_ptr(), self.max_ctas)

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


def mean_run_bytes(src_slots: torch.Tensor, dst_slots: torch.Tensor, block_bytes: int) -> float:
    """Bytes per run of consecutive slot pairs (`memcpy_batch.run_starts`: what one batched memcpy
    moves); CPU slot tensors."""
    n = src_slots.numel()
    if n == 0:
        return 0.0
    runs = memcpy_batch.run_starts(src_slots.reshape(-1).numpy(), dst_slots.reshape(-1).numpy()).size
    return n * block_bytes / runs
