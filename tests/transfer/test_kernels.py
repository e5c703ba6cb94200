"""copy_slots kernel source: renders for every word width and shape, and copies exactly when the
very same source is compiled as host C++ and launched thread by thread on the CPU."""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess

import numpy as np
import pytest

from tierkv.transfer.kernels import (
    THREADS_PER_CTA,
    WORDS_PER_THREAD,
    KernelShape,
    kernel_source,
    num_launch_ctas,
)

WORD_BYTES = [16, 8, 4, 2, 1]
WORDS_PER_THREAD_CHOICES = [4, 8, 16]
THREADS_CHOICES = [128, 256, 512]
COMBINATIONS = list(itertools.product(WORD_BYTES, WORDS_PER_THREAD_CHOICES, THREADS_CHOICES))


def test_default_shape_is_todays_kernel():
    assert KernelShape() == KernelShape(WORDS_PER_THREAD, THREADS_PER_CTA) == KernelShape(4, 256)
    assert KernelShape().words_per_chunk == 1024  # 16 KiB of 16-byte words


@pytest.mark.parametrize(
    ("words_per_thread", "threads_per_cta", "message"),
    [(0, 256, "words_per_thread: 0"), (65, 256, "words_per_thread: 65"), (4, 100, "threads_per_cta: 100"),
     (4, 2048, "threads_per_cta: 2048"), (4, 0, "threads_per_cta: 0")],
)
def test_shape_rejects_values_naming_them(words_per_thread, threads_per_cta, message):
    with pytest.raises(ValueError, match=message):
        KernelShape(words_per_thread, threads_per_cta)


@pytest.mark.parametrize(("word_bytes", "words_per_thread", "threads"), COMBINATIONS)
def test_source_renders_every_combination(word_bytes, words_per_thread, threads):
    source = kernel_source(word_bytes, KernelShape(words_per_thread, threads))
    word_type = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
    assert f"typedef {word_type[word_bytes]} word_t;" in source
    assert f"#define WORDS_PER_THREAD {words_per_thread}\n" in source
    assert f"#define THREADS_PER_CTA {threads}\n" in source
    assert "__launch_bounds__(THREADS_PER_CTA) copy_slots(" in source
    assert "blockDim" not in source  # the CTA width is the compile-time one the launch uses
    assert source.count("{") == source.count("}")


def test_source_rejects_unknown_word_width():
    with pytest.raises(ValueError, match="word_bytes: 3"):
        kernel_source(3, KernelShape())


@pytest.mark.parametrize(
    ("num_pairs", "words_per_block", "shape", "max_ctas", "expected"),
    [
        (10, 4096, KernelShape(4, 256), 132, 40),  # 4 chunks per 64 KiB block
        (100, 4096, KernelShape(4, 256), 132, 132),
        (10, 4096, KernelShape(16, 512), 132, 10),  # one chunk covers a block
        (3, 1, KernelShape(8, 128), 528, 3),
        (0, 4096, KernelShape(), 132, 0),
    ],
)
def test_grid_is_one_cta_per_chunk_up_to_max_ctas(num_pairs, words_per_block, shape, max_ctas, expected):
    assert num_launch_ctas(num_pairs, words_per_block, shape, max_ctas) == expected


# --------------------------------------------------------------------------- host C++ run

_HOST_PRELUDE = r"""
#include <cstdint>
struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct Index { unsigned int x; };
static Index blockIdx, threadIdx, gridDim;
#define __global__
#define __launch_bounds__(n)
static unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    unsigned long long old = *p; *p += v; return old;
}
"""

# One launch: every CTA, every thread, one after another. copy_slots has no shared memory and
# no barriers, and each thread stores only what it loaded, so this order is a valid schedule.
_HOST_LAUNCH = r"""
extern "C" void launch_{tag}(long long grid, const void* src, const long long* src_slots,
    long long num_src_slots, void* dst, const long long* dst_slots, long long num_dst_slots,
    long long num_pairs, long long words_per_block, unsigned long long* num_invalid) {{
    gridDim.x = (unsigned int)grid;
    for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x)
        for (threadIdx.x = 0; threadIdx.x < THREADS_PER_CTA; ++threadIdx.x)
            copy_slots_{tag}((const word_t*)src, src_slots, num_src_slots, (word_t*)dst, dst_slots,
                             num_dst_slots, num_pairs, words_per_block, num_invalid);
}}
"""


def _tag(word_bytes: int, words_per_thread: int, threads: int) -> str:
    return f"{word_bytes}_{words_per_thread}_{threads}"


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory) -> ctypes.CDLL:
    """Every combination's kernel_source compiled by g++ into one library (namespaced)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++ to compile the kernel source for the CPU")
    parts = [_HOST_PRELUDE]
    for word_bytes, words_per_thread, threads in COMBINATIONS:
        tag = _tag(word_bytes, words_per_thread, threads)
        parts += [
            f"namespace v{tag} {{",
            f"#define copy_slots copy_slots_{tag}",
            kernel_source(word_bytes, KernelShape(words_per_thread, threads)),
            "#undef copy_slots",
            _HOST_LAUNCH.format(tag=tag),
            "#undef WORDS_PER_THREAD",
            "#undef THREADS_PER_CTA",
            "}",
        ]
    folder = tmp_path_factory.mktemp("copy_slots_host")
    source, library = folder / "copy_slots_host.cpp", folder / "copy_slots_host.so"
    source.write_text("\n".join(parts))
    subprocess.run(
        [compiler, "-O1", "-shared", "-fPIC", "-Wno-unknown-pragmas", "-o", str(library), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    return ctypes.CDLL(str(library))


def run_on_host(library, shape_tag, word_bytes, src, src_slots, dst, dst_slots, grid) -> int:
    """dst[dst_slots] = src[src_slots] through the host-compiled kernel; returns num_invalid."""
    launch = getattr(library, f"launch_{shape_tag}")
    num_invalid = np.zeros(1, dtype=np.uint64)
    pointer = ctypes.c_void_p
    launch.argtypes = [ctypes.c_longlong, pointer, pointer, ctypes.c_longlong, pointer, pointer,
                       ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong, pointer]
    launch(grid, src.ctypes.data, src_slots.ctypes.data, src.shape[0], dst.ctypes.data,
           dst_slots.ctypes.data, dst.shape[0], src_slots.size, src.shape[1] // word_bytes,
           num_invalid.ctypes.data)
    return int(num_invalid[0])


@pytest.mark.parametrize(("word_bytes", "words_per_thread", "threads"), COMBINATIONS)
def test_host_compiled_kernel_copies_exactly(host_kernels, word_bytes, words_per_thread, threads):
    shape = KernelShape(words_per_thread, threads)
    rng = np.random.default_rng(word_bytes * 1000 + words_per_thread * 10 + threads)
    # One word, a chunk less one word, and two chunks and a bit: partial chunks and multi-chunk blocks.
    for words_per_block in (1, shape.words_per_chunk - 1, 2 * shape.words_per_chunk + 3):
        block_bytes = words_per_block * word_bytes
        src = rng.integers(0, 256, (9, block_bytes), dtype=np.uint8)
        src_slots = rng.permutation(9)[:6].astype(np.int64)
        dst_slots = rng.permutation(7)[:6].astype(np.int64)
        for max_ctas in (1, 3, 10_000):  # grid-stride loops, then one CTA per chunk
            dst = rng.integers(0, 256, (7, block_bytes), dtype=np.uint8)
            expected = dst.copy()
            expected[dst_slots] = src[src_slots]
            grid = num_launch_ctas(src_slots.size, words_per_block, shape, max_ctas)
            tag = _tag(word_bytes, words_per_thread, threads)
            assert run_on_host(host_kernels, tag, word_bytes, src, src_slots, dst, dst_slots, grid) == 0
            np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize(("words_per_thread", "threads"), [(4, 256), (16, 128), (8, 512)])
def test_host_compiled_kernel_skips_and_counts_invalid_pairs(host_kernels, words_per_thread, threads):
    shape = KernelShape(words_per_thread, threads)
    words_per_block = 3 * shape.words_per_chunk  # several chunks: each invalid pair counted once
    src = np.arange(4 * words_per_block * 16, dtype=np.uint64).view(np.uint8).reshape(4, -1)[:, : words_per_block * 16]
    src = np.ascontiguousarray(src)
    dst = np.zeros((4, words_per_block * 16), dtype=np.uint8)
    src_slots = np.array([0, 99, 2, -1], dtype=np.int64)
    dst_slots = np.array([1, 2, 4, 0], dtype=np.int64)  # 4 is out of range too
    grid = num_launch_ctas(4, words_per_block, shape, 5)
    tag = _tag(16, words_per_thread, threads)
    assert run_on_host(host_kernels, tag, 16, src, src_slots, dst, dst_slots, grid) == 3
    expected = np.zeros_like(dst)
    expected[1] = src[0]
    np.testing.assert_array_equal(dst, expected)
