"""Batched block copies between a pinned CPU slab and a GPU slot pool.

Every primitive copies `dst[dst_slots[i]] = src[src_slots[i]]` for all i, where a slot is
one contiguous block of `block_bytes` bytes:

    src slab  [num_src_slots, block]        dst pool  [num_dst_slots, block]
      slot 0  |#########|                     slot 0  |         |
      slot 1  |#########| --.         .-----> slot 1  |#########|
      slot 2  |#########|   '---------+-.     slot 2  |         |
      slot 3  |#########| ------------' '---> slot 3  |#########|
              src_slots = [1, 3]                      dst_slots = [3, 1]

Primitives:
    SlotCopy              one batched copy described by device-visible addresses
    KernelShape           the kernel's compile-time shape: words in flight per thread, CTA width
    kernel_source         the `copy_slots` CUDA source for one word width and shape
    num_launch_ctas       the grid one launch uses
    CupySlotKernel        the `copy_slots` CUDA kernel (cupy RawKernel), one launch per batch;
                          reads or writes pinned host memory through its UVA address
    pinned_as_cuda_rows   a pinned CPU tensor seen as a CUDA uint8 [slots, block_bytes] tensor
    copy_slots_torch      index_select + index_copy_ (CPU engine, and the torch_uva fallback)
    copy_slots_loop       one copy_ per run of consecutive slots (last-resort fallback)
    vector_width          widest load (16/8/4/2/1 bytes) that block size and addresses allow
    contiguous_runs       merge consecutive (src, dst) slot pairs into runs

Pinned memory allocated by CUDA is mapped into the device address space at the same
address as on the host (unified virtual addressing), so a kernel may dereference
`pinned_tensor.data_ptr()`; `CupySlotKernel.check_host_address` verifies this once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

THREADS_PER_CTA = 256  # default CTA width
WORDS_PER_THREAD = 4  # default loads in flight per thread per chunk
MAX_WORDS_PER_THREAD = 64
_WORD_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
_TORCH_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

# Work is split into chunks of THREADS_PER_CTA * WORDS_PER_THREAD words (16 KiB with 16-byte
# words and the default shape); CTAs take chunks grid-stride, so a few large blocks still spread
# over many SMs and the grid (max_ctas) bounds how much of the GPU the copy occupies.
# word_t, WORDS_PER_THREAD and THREADS_PER_CTA are defined by kernel_source() per module.
_KERNEL_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(THREADS_PER_CTA) copy_slots(
    const word_t* __restrict__ src, const long long* __restrict__ src_slots,
    long long num_src_slots,
    word_t* __restrict__ dst, const long long* __restrict__ dst_slots,
    long long num_dst_slots,
    long long num_pairs, long long words_per_block,
    unsigned long long* __restrict__ num_invalid)
{
    const long long words_per_chunk = (long long)THREADS_PER_CTA * WORDS_PER_THREAD;
    const long long chunks_per_block = (words_per_block + words_per_chunk - 1) / words_per_chunk;
    const long long num_chunks = num_pairs * chunks_per_block;
    for (long long chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
        const long long pair = chunk / chunks_per_block;
        const long long chunk_in_block = chunk - pair * chunks_per_block;
        const long long s = src_slots[pair];
        const long long d = dst_slots[pair];
        if (s < 0 || s >= num_src_slots || d < 0 || d >= num_dst_slots) {
            if (threadIdx.x == 0 && chunk_in_block == 0) atomicAdd(num_invalid, 1ULL);
            continue;
        }
        const word_t* from = src + s * words_per_block;
        word_t* to = dst + d * words_per_block;
        const long long first = chunk_in_block * words_per_chunk + threadIdx.x;
        word_t words[WORDS_PER_THREAD];
        #pragma unroll
        for (int u = 0; u < WORDS_PER_THREAD; ++u) {
            const long long i = first + (long long)u * THREADS_PER_CTA;
            if (i < words_per_block) words[u] = from[i];
        }
        #pragma unroll
        for (int u = 0; u < WORDS_PER_THREAD; ++u) {
            const long long i = first + (long long)u * THREADS_PER_CTA;
            if (i < words_per_block) to[i] = words[u];
        }
    }
}
"""


@dataclass(frozen=True)
class KernelShape:
    """Compile-time shape of `copy_slots`; each shape is its own compiled module.

    A chunk is threads_per_cta * words_per_thread words; every thread keeps words_per_thread
    loads in flight before it stores them.
    """

    words_per_thread: int = WORDS_PER_THREAD  # 1..MAX_WORDS_PER_THREAD
    threads_per_cta: int = THREADS_PER_CTA  # a multiple of 32, at most 1024

    def __post_init__(self) -> None:
        if not 1 <= self.words_per_thread <= MAX_WORDS_PER_THREAD:
            raise ValueError(
                f"words_per_thread: {self.words_per_thread} is not in [1, {MAX_WORDS_PER_THREAD}]"
            )
        if self.threads_per_cta % 32 or not 32 <= self.threads_per_cta <= 1024:
            raise ValueError(
                f"threads_per_cta: {self.threads_per_cta} is not a multiple of 32 in [32, 1024]"
            )

    @property
    def words_per_chunk(self) -> int:
        return self.words_per_thread * self.threads_per_cta


def kernel_source(word_bytes: int, shape: KernelShape) -> str:
    """CUDA source of `copy_slots` for `word_bytes`-byte words (16, 8, 4, 2 or 1) and `shape`."""
    if word_bytes not in _WORD_TYPES:
        raise ValueError(f"word_bytes: {word_bytes} is not one of {sorted(_WORD_TYPES)}")
    defines = (
        f"typedef {_WORD_TYPES[word_bytes]} word_t;\n"
        f"#define WORDS_PER_THREAD {shape.words_per_thread}\n"
        f"#define THREADS_PER_CTA {shape.threads_per_cta}\n"
    )
    return defines + _KERNEL_SOURCE


def num_launch_ctas(num_pairs: int, words_per_block: int, shape: KernelShape, max_ctas: int) -> int:
    """CTAs in one launch: one per chunk, at most `max_ctas` (they then loop grid-stride)."""
    num_chunks = num_pairs * -(-words_per_block // shape.words_per_chunk)
    return min(num_chunks, max_ctas)


def vector_width(block_bytes: int, *addresses: int) -> int:
    """Widest word (16, 8, 4, 2 or 1 bytes) dividing `block_bytes` and every address."""
    for width in (16, 8, 4, 2):
        if block_bytes % width == 0 and all(a % width == 0 for a in addresses):
            return width
    return 1


def contiguous_runs(src_slots: list[int], dst_slots: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both slot lists advance by one together."""
    runs: list[list[int]] = []
    for s, d in zip(src_slots, dst_slots):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


@dataclass(frozen=True)
class SlotCopy:
    """One batched copy; every address is device-visible (device memory or UVA pinned host)."""

    src_address: int  # base of src [num_src_slots, block_bytes]
    num_src_slots: int
    dst_address: int  # base of dst [num_dst_slots, block_bytes]
    num_dst_slots: int
    src_slots_address: int  # int64 [num_pairs], device memory
    dst_slots_address: int  # int64 [num_pairs], device memory
    num_pairs: int
    block_bytes: int


class CupySlotKernel:
    """The `copy_slots` kernel compiled with cupy (NVRTC).

    One module per (word_bytes, words_per_thread, threads_per_cta), built on first use or by
    `compile`. `shape` is the default for `compile` and `launch`. Raises ImportError at
    construction when cupy is not installed. Launches enqueue on a torch stream and never
    synchronize the host. Invalid slot pairs are skipped and counted into an int64 counter in
    device memory (`num_invalid_address`).
    """

    def __init__(self, shape: KernelShape | None = None) -> None:
        import cupy  # optional dependency (extra "gpu"); imported only when this path is used

        self._cupy = cupy
        self.shape = shape or KernelShape()
        self._kernels: dict[tuple[int, int, int], object] = {}
        self._cupy_streams: dict[int, object] = {}

    def compile(self, word_bytes: int, device_index: int, shape: KernelShape | None = None) -> None:
        """Build the kernel for `word_bytes` now (init time), not on the first hot-path call."""
        with self._cupy.cuda.Device(device_index):
            self._kernel(word_bytes, shape or self.shape).kernel  # noqa: B018 - compiles for this device

    def check_host_address(self, host_address: int) -> None:
        """Raise RuntimeError unless pinned memory at `host_address` is mapped at the same device address."""
        attributes = self._cupy.cuda.runtime.pointerGetAttributes(host_address)
        device_pointer = int(attributes.devicePointer)
        if device_pointer != host_address:
            raise RuntimeError(
                f"pinned host memory {host_address:#x} is mapped at device address "
                f"{device_pointer:#x}; the kernel path needs unified virtual addressing"
            )

    def launch(
        self,
        copy: SlotCopy,
        stream: torch.cuda.Stream,
        num_invalid_address: int,
        max_ctas: int,
        shape: KernelShape | None = None,
    ) -> None:
        """Enqueue `copy` on `stream`: one kernel launch, no host sync."""
        if copy.num_pairs == 0 or copy.block_bytes == 0:
            return
        shape = shape or self.shape
        word_bytes = vector_width(copy.block_bytes, copy.src_address, copy.dst_address)
        words_per_block = copy.block_bytes // word_bytes
        args = (
            np.uint64(copy.src_address),
            np.uint64(copy.src_slots_address),
            np.int64(copy.num_src_slots),
            np.uint64(copy.dst_address),
            np.uint64(copy.dst_slots_address),
            np.int64(copy.num_dst_slots),
            np.int64(copy.num_pairs),
            np.int64(words_per_block),
            np.uint64(num_invalid_address),
        )
        grid = (num_launch_ctas(copy.num_pairs, words_per_block, shape, max_ctas),)
        block = (shape.threads_per_cta,)
        with self._cupy.cuda.Device(stream.device.index):
            self._kernel(word_bytes, shape)(grid, block, args, stream=self._cupy_stream(stream))

    def _kernel(self, word_bytes: int, shape: KernelShape):
        key = (word_bytes, shape.words_per_thread, shape.threads_per_cta)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._cupy.RawKernel(kernel_source(word_bytes, shape), "copy_slots")
            self._kernels[key] = kernel
        return kernel

    def _cupy_stream(self, stream: torch.cuda.Stream):
        cupy_stream = self._cupy_streams.get(stream.cuda_stream)
        if cupy_stream is None:
            cupy_stream = self._cupy.cuda.ExternalStream(stream.cuda_stream)
            self._cupy_streams[stream.cuda_stream] = cupy_stream
        return cupy_stream


class _HostRowsInterface:
    """`__cuda_array_interface__` over a pinned CPU tensor; keeps the tensor alive."""

    def __init__(self, host: torch.Tensor, num_rows: int, row_bytes: int) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": (num_rows, row_bytes),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def pinned_as_cuda_rows(host: torch.Tensor, device: torch.device, block_bytes: int) -> torch.Tensor:
    """uint8 [num_slots, block_bytes] CUDA tensor aliasing pinned `host` memory (no copy)."""
    rows = torch.as_tensor(_HostRowsInterface(host, host.shape[0], block_bytes), device=device)
    if rows.device != device or rows.data_ptr() != host.data_ptr():
        raise RuntimeError(f"could not alias pinned memory {host.data_ptr():#x} as a {device} tensor")
    return rows


def as_rows(t: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """uint8 [num_slots, block_bytes] view of a contiguous slot tensor."""
    return t.reshape(t.shape[0], block_bytes // t.element_size()).view(torch.uint8)


def as_word_rows(rows: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """[num_slots, block_bytes // w] view of uint8 rows with the widest torch integer word w <= 8."""
    return rows.view(_TORCH_WORD_DTYPES[min(word_bytes, 8)])


def copy_slots_torch(
    src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """dst[dst_slots] = src[src_slots] along dim 0 with two torch ops; slots on src/dst's device."""
    dst.index_copy_(0, dst_slots, src.index_select(0, src_slots))


def copy_slots_loop(
    src: torch.Tensor, src_slots: list[int], dst: torch.Tensor, dst_slots: list[int]
) -> None:
    """One `copy_` per run of consecutive slots, enqueued on the current stream."""
    for s, d, n in contiguous_runs(src_slots, dst_slots):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
