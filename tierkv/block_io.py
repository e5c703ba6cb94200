"""Block moves between the CPU tier and device pools, in the tier's storage form.

Primitives: `BlockIO` (`gather`, `scatter`), `allocating_on_copy_stream`.

A plain CPU tier moves blocks as they are. A quantized one (int8 / fp8) moves codes and
scales, so PCIe carries about half the bytes of bf16:

    scatter: blocks --quantize (device)--> codes + scales --D2H--> slab + scale slab
    gather:  slab + scale slab --H2D--> codes + scales --dequantize (device, on wait)--> pool slots
             (on CUDA one fused Triton kernel writes the pool slots: `tierkv.quant_kernels`)

Handles behave like `TransferHandle`s; a quantized gather's dequantization runs on the
stream that calls `wait_on_current_stream`, right after the copies it waits for.

Stream ownership of the temporary code buffers (CUDA caching allocator): a gather's codes are
allocated on the H2D stream, which writes them, and marked as read by the stream that
dequantizes them, so the allocator cannot hand their memory to the next gather's copy while a
dequantization still reads it. A scatter's codes are made on the compute stream and marked as
read by the D2H stream.
"""
from __future__ import annotations

import contextlib

import torch

from tierkv.optional_kernel import OptionalKernel
from tierkv.quant import dequantize_blocks, quantize_blocks
from tierkv.transfer.device import to_device_no_sync


class _Handles:
    """Several transfers as one, with an optional step to run once they have landed."""

    def __init__(self, handles: list, on_wait=None):
        self.handles = handles
        self.num_bytes = sum(h.num_bytes for h in handles)
        self._on_wait = on_wait

    def wait_on_current_stream(self) -> None:
        for handle in self.handles:
            handle.wait_on_current_stream()
        if self._on_wait is not None:
            on_wait, self._on_wait = self._on_wait, None
            on_wait()

    def is_done(self) -> bool:
        return all(h.is_done() for h in self.handles)

    def synchronize(self) -> None:
        for handle in self.handles:
            handle.synchronize()

    @property
    def event(self):  # for `after=` lists: the last copy's event
        return self.handles[-1].event


_FUSED = OptionalKernel("dequantize_into_slots")


def _fused_dequantize(codes, scales, fmt, dst, slots) -> bool:
    """The fused Triton dequantization (`tierkv.quant_kernels`); False (and the PyTorch form from
    then on, the reason in `_FUSED.error`) where it cannot run, e.g. no triton."""
    def launch() -> None:
        from tierkv.quant_kernels import dequantize_into_slots

        dequantize_into_slots(codes, scales, fmt, dst, slots)

    return _FUSED.run(launch, on_cuda=dst.is_cuda)[0]


def allocating_on_copy_stream(engine, direction: str):
    """Context in which allocations belong to the engine's copy stream (a no-op on a CPU engine)."""
    if engine.device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(engine.stream(direction))


def dequantize_into(codes: torch.Tensor, scales: torch.Tensor, fmt: str, dst: torch.Tensor,
                    dst_slots: torch.Tensor) -> None:
    """dst[dst_slots[i]] = block i dequantized (codes uint8 [n, 2, H, T, D], scales float32 [n, 2, H],
    dst_slots int64 [n] on dst's device; a negative slot skips its block), on the current stream
    without a host wait: one fused kernel on CUDA, PyTorch elsewhere (or where the kernel cannot
    build; skipped blocks then cost a host wait on CUDA)."""
    if not (dst.is_cuda and _fused_dequantize(codes, scales, fmt, dst, dst_slots)):
        written = dst_slots >= 0
        if not bool(written.all()):
            codes, scales, dst_slots = codes[written], scales[written], dst_slots[written]
        dst.index_copy_(0, dst_slots, dequantize_blocks(codes, scales, fmt, dst.dtype))


class BlockIO:
    def __init__(self, engine, cpu_tier):
        self.engine = engine
        self.cpu = cpu_tier

    def gather(self, cpu_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor, *, after=None):
        """dst[dst_slots[i]] = block in CPU slot cpu_slots[i]; cpu_slots, dst_slots: int64 CPU tensors."""
        cpu = self.cpu
        if cpu.quant_format is None:
            return self.engine.gather_h2d(cpu.slab, cpu_slots, dst, dst_slots, after=after)
        n = cpu_slots.numel()
        with allocating_on_copy_stream(self.engine, "h2d"):  # written there; see the module docstring
            codes = torch.empty((n, *cpu.slab.shape[1:]), dtype=torch.uint8, device=dst.device)
            scales = torch.empty((n, *cpu.scales.shape[1:]), dtype=torch.float32, device=dst.device)
        order = torch.arange(n, dtype=torch.int64)
        handles = [self.engine.gather_h2d(cpu.slab, cpu_slots, codes, order, after=after),
                   self.engine.gather_h2d(cpu.scales, cpu_slots, scales, order, after=after)]
        dst_on_device = to_device_no_sync(dst_slots, dst.device)

        def dequantize() -> None:
            dequantize_into(codes, scales, cpu.quant_format, dst, dst_on_device)
            if codes.is_cuda:
                stream = torch.cuda.current_stream(codes.device)
                codes.record_stream(stream)
                scales.record_stream(stream)

        return _Handles(handles, on_wait=dequantize)

    def scatter(self, blocks: torch.Tensor, cpu_slots: torch.Tensor):
        """CPU slots cpu_slots[i] = blocks[i] (device [n, 2, H, T, D]); waits for the compute that wrote them."""
        cpu = self.cpu
        order = torch.arange(blocks.shape[0], dtype=torch.int64)
        if cpu.quant_format is None:
            return self.engine.scatter_d2h(blocks, order, cpu.slab, cpu_slots, after=self.engine.record_compute_event())
        codes, scales = quantize_blocks(blocks, cpu.quant_format)
        written = self.engine.record_compute_event()  # after the quantization
        if codes.is_cuda:
            codes.record_stream(self.engine.stream("d2h"))
            scales.record_stream(self.engine.stream("d2h"))
        return _Handles([self.engine.scatter_d2h(codes, order, cpu.slab, cpu_slots, after=written),
                         self.engine.scatter_d2h(scales, order, cpu.scales, cpu_slots, after=written)])
