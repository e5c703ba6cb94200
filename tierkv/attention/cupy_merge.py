"""The LSE merge of two attention parts into an output, as one CUDA kernel launched through cupy.

Primitives: `supports`, `merge_two_into`.

`tierkv.attention.merge_two_into` runs once per layer of every sparse decode step under vLLM
(the far part of a step's graph rows merged with vLLM's near part, straight into vLLM's output).
The Triton twin (`triton_paged.merge_two_into`) is the same arithmetic, but a Triton launch from
Python binds and specializes its arguments on every call: 80-109 us of host time per layer on
the GPU machine (results/bench-vllm-sparse-graphs-h200-afe43c8.json), more than the rest of the
far path's host work. A cupy RawKernel launch passes a tuple of scalars to the driver.

Covered: outputs and parts in float32 or bfloat16 (bfloat16 converted by bit arithmetic, round
to nearest even; no CUDA headers needed), LSEs in float32, any strides over contiguous head
dims. Others go to the Triton kernel (`supports` says which).

    per (query, head):  m = max(lse_a, lse_b)     (0 when both are -inf)
                        w = exp(lse - m) per part  (a part with lse -inf weighs 0)
                        out = (w_a out_a + w_b out_b) / (w_a + w_b)   (0 when both weigh 0)
"""
from __future__ import annotations

import functools
import importlib.util

import numpy as np
import torch

_TYPES = {torch.float32: "float", torch.bfloat16: "unsigned short"}

_SOURCE = r"""
__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_bf16(const unsigned short* p) { return __uint_as_float(((unsigned int)*p) << 16); }
__device__ __forceinline__ void store_float(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_bf16(unsigned short* p, float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) { *p = (unsigned short)((u >> 16) | 0x40u); return; }  // NaN stays NaN
    *p = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void merge_two(
    OUT_T* out, const A_T* a, const float* a_lse, const B_T* b, const float* b_lse,
    long long num_heads, long long head_dim,
    long long s_out_q, long long s_out_h, long long s_a_q, long long s_a_h, long long s_al_q, long long s_al_h,
    long long s_b_q, long long s_b_h, long long s_bl_q, long long s_bl_h)
{
    const long long row = blockIdx.x;
    const long long q = row / num_heads, h = row % num_heads;
    const float la = a_lse[q * s_al_q + h * s_al_h], lb = b_lse[q * s_bl_q + h * s_bl_h];
    const float m = fmaxf(la, lb);
    const float m_safe = (m == __int_as_float(0xff800000)) ? 0.0f : m;
    const float wa = expf(la - m_safe), wb = expf(lb - m_safe);
    const float total = wa + wb;
    const float denom = total > 0.0f ? total : 1.0f;
    for (long long d = threadIdx.x; d < head_dim; d += blockDim.x) {
        const float oa = LOAD_A(a + q * s_a_q + h * s_a_h + d);
        const float ob = LOAD_B(b + q * s_b_q + h * s_b_h + d);
        const float acc = (wa > 0.0f ? wa * oa : 0.0f) + (wb > 0.0f ? wb * ob : 0.0f);
        STORE_OUT(out + q * s_out_q + h * s_out_h + d, acc / denom);
    }
}
"""


@functools.lru_cache(maxsize=1)
def cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None


def _name(dtype: torch.dtype) -> str:
    return "float" if dtype == torch.float32 else "bf16"


def supports(output: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
             second: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether this kernel takes the merge: CUDA, cupy installed, float32/bfloat16 outputs, float32 LSEs."""
    return (output.is_cuda and cupy_installed() and all(t.dtype in _TYPES for t in (output, first[0], second[0]))
            and first[1].dtype == torch.float32 and second[1].dtype == torch.float32)


@functools.lru_cache(maxsize=None)
def _kernel(out_dtype: torch.dtype, a_dtype: torch.dtype, b_dtype: torch.dtype):
    import cupy  # optional dependency (extra "gpu")

    defines = (f"#define OUT_T {_TYPES[out_dtype]}\n#define A_T {_TYPES[a_dtype]}\n#define B_T {_TYPES[b_dtype]}\n"
               f"#define LOAD_A load_{_name(a_dtype)}\n#define LOAD_B load_{_name(b_dtype)}\n"
               f"#define STORE_OUT store_{_name(out_dtype)}\n")
    return cupy.RawKernel(defines + _SOURCE, "merge_two")


_STREAMS: dict[int, object] = {}


def _cupy_stream(stream: torch.cuda.Stream):
    import cupy

    found = _STREAMS.get(stream.cuda_stream)
    if found is None:
        found = _STREAMS[stream.cuda_stream] = cupy.cuda.ExternalStream(stream.cuda_stream)
    return found


def merge_two_into(output: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
                   second: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Like ``reference.merge_two_into``, one launch on the current stream; the caller checked
    `supports` and the shapes (``reference.check_merge_two_args``)."""
    import cupy

    num_q, num_heads, head_dim = output.shape
    (a, a_lse), (b, b_lse) = first, second
    if num_q * num_heads == 0:
        return
    args = (np.uint64(output.data_ptr()), np.uint64(a.data_ptr()), np.uint64(a_lse.data_ptr()),
            np.uint64(b.data_ptr()), np.uint64(b_lse.data_ptr()), np.int64(num_heads), np.int64(head_dim),
            *(np.int64(s) for s in (output.stride(0), output.stride(1), a.stride(0), a.stride(1),
                                    a_lse.stride(0), a_lse.stride(1), b.stride(0), b.stride(1),
                                    b_lse.stride(0), b_lse.stride(1))))
    threads = min(256, 32 * -(-head_dim // 32))
    with cupy.cuda.Device(output.device.index):
        _kernel(output.dtype, a.dtype, b.dtype)((num_q * num_heads,), (threads,), args,
                                                  stream=_cupy_stream(torch.cuda.current_stream(output.device)))
