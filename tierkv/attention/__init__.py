"""Partial attention over paged KV blocks, returning ``(out, lse)``, and the exact merge.

Primitives:
  - ``paged_partial_attention``: attend to a set of blocks of a paged KV pool.
  - ``paged_rows_attention``: each query over blocks of its own (one launch on CUDA).
  - ``contiguous_partial_attention``: attend to plain ``[num_k, kv_heads, dim]`` K/V
    (the recent window held as tensors).
  - ``merge_partials``: flash-decoding LSE merge of ``(out, lse)`` pairs.
  - ``merge_two_into``: the merge of two parts written into an existing output (any dtype).

All three return float32 ``out [num_q, num_heads, head_dim]`` and ``lse [num_q, num_heads]``
(natural log; ``-inf`` and ``out = 0`` for a row that saw no key). They dispatch to the
Triton kernels in ``triton_paged`` for CUDA tensors when ``triton`` is installed, to
``cpu_flash`` (PyTorch's fused CPU flash kernel) for CPU tensors of float32/bfloat16/float16
when this torch has that kernel, and to ``reference`` (PyTorch, float32 einsum) otherwise.
``triton`` is imported only when a CUDA tensor arrives.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from types import ModuleType

import torch

from tierkv.attention import cpu_flash, reference

__all__ = ["contiguous_partial_attention", "merge_partials", "merge_two_into", "paged_partial_attention",
           "paged_rows_attention", "reference", "triton_installed"]


@functools.lru_cache(maxsize=1)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _backend(t: torch.Tensor) -> ModuleType:
    """``triton_paged`` for CUDA tensors when triton is installed, ``cpu_flash`` for CPU tensors it
    serves, else ``reference``."""
    if t.is_cuda and triton_installed():
        from tierkv.attention import triton_paged
        return triton_paged
    if cpu_flash.serves(t):
        return cpu_flash
    return reference


def paged_partial_attention(
    q: torch.Tensor,                # [num_q, num_heads, head_dim], any float dtype, device D
    kv_pool: torch.Tensor,          # [num_slots, 2, num_kv_heads, block_tokens, head_dim]; 0 = K, 1 = V
    block_slots: torch.Tensor,      # int32/int64 [num_blocks], slot of each block
    block_start_pos: torch.Tensor,  # int32/int64 [num_blocks], position of each block's first token
    block_num_tokens: torch.Tensor, # int32/int64 [num_blocks], valid tokens (1..block_tokens)
    *,
    scale: float,
    q_positions: torch.Tensor | None = None,  # int [num_q]; None = no causal mask
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the listed blocks; float32 ``(out, lse)``.

    The key at position ``p`` is visible to query ``i`` iff ``p <= q_positions[i]``.
    GQA: head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.
    """
    return _backend(q).paged_partial_attention(
        q, kv_pool, block_slots, block_start_pos, block_num_tokens, scale=scale, q_positions=q_positions
    )


def paged_rows_attention(
    q: torch.Tensor,                # [num_q, num_heads, head_dim]
    kv_pool: torch.Tensor,          # [num_slots, 2, num_kv_heads, block_tokens, head_dim]
    block_slots: torch.Tensor,      # int [num_q, num_blocks]: query i reads the blocks of row i
    block_start_pos: torch.Tensor,  # int [num_q, num_blocks]
    block_num_tokens: torch.Tensor, # int [num_q, num_blocks], 1..block_tokens
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over blocks of its own, without a causal mask (the decoding rows of
    several requests, each over its selected blocks); float32 ``(out, lse)``, as row-by-row
    ``paged_partial_attention`` gives them."""
    return _backend(q).paged_rows_attention(q, kv_pool, block_slots, block_start_pos, block_num_tokens, scale=scale)


def contiguous_partial_attention(
    q: torch.Tensor,                          # [num_q, num_heads, head_dim]
    k: torch.Tensor,                          # [num_k, num_kv_heads, head_dim], q's dtype and device
    v: torch.Tensor,                          # [num_k, num_kv_heads, head_dim]
    *,
    scale: float,
    q_positions: torch.Tensor | None = None,  # int [num_q]; None = no causal mask
    k_positions: torch.Tensor | None = None,  # int [num_k]; None = arange(num_k)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over plain K/V tensors; same mask rule and outputs as the paged form."""
    return _backend(q).contiguous_partial_attention(
        q, k, v, scale=scale, q_positions=q_positions, k_positions=k_positions
    )


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LSE merge of ``(out, lse)`` pairs of identical shapes; float32 result.

    Rows whose lse is ``-inf`` in every part give ``out = 0, lse = -inf``.
    """
    if len(parts) == 0:
        raise ValueError("merge_partials needs at least one (out, lse) part, got none")
    return _backend(parts[0][0]).merge_partials(parts)


def merge_two_into(output: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
                   second: tuple[torch.Tensor, torch.Tensor]) -> None:
    """output [n, H, D] (any float dtype, written in place) = the exact LSE merge of two (out [n, H, D],
    lse [n, H]) parts of any float dtypes and strides (head dims contiguous): one launch on CUDA."""
    _backend(output).merge_two_into(output, first, second)
