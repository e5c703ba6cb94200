"""Partial attention on CPU through PyTorch's fused flash kernel, which returns the log-sum-exp.

Primitives (the signatures and outputs of ``reference``; float32 ``(out, lse)``):
  - ``paged_partial_attention``, ``paged_rows_attention``, ``contiguous_partial_attention``.
  - ``is_available``: the kernel exists in this torch build and runs (probed once).
  - ``SUPPORTED_DTYPES``: the query dtypes it serves (others go to ``reference``).

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout, is_causal,
attn_mask=, scale=)`` takes ``[B, H, L, D]`` tensors, reads kv head ``h // (H // Hkv)`` for query
head ``h`` when K/V have fewer heads, and returns ``(out [B, H, L, D], lse [B, H, L] float32)``,
natural log. Its causal mask is top-left aligned (query i sees keys 0..i) and it crashes on zero
keys, so the keys are split by position before it is called::

    keys (by position)   | far: p < min(q_pos)           | near: p >= min(q_pos)          |
    every query sees     | all of them -> no mask         | its own part -> causal or mask |

  far:  one call without a mask; the query heads of one KV group fold into the query axis
        (q [n, H, D] -> [1, Hkv, g*n, D]), so decode's single query is g rows of one call.
  near: when its positions equal the queries' (a prefill chunk attending to itself) the kernel's
        causal mask is exact; otherwise an additive -inf mask [n, m_near] built from positions,
        and rows that see no near key get lse = -inf, out = 0 (the kernel gives lse 0 there).
The parts are merged with ``reference.merge_partials``.

Where the op differs from the reference, ``_attend`` corrects it: a head dim that is not unit-stride
is copied, scale <= 0 is folded into q, query rows holding NaN/inf come out NaN, and a near part
with a non-finite key goes to the reference (the op's additive mask would spread the NaN).
"""
from __future__ import annotations

import functools
import math

import torch

from tierkv.attention import contract, reference

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def is_available() -> bool:
    """True when this torch has the CPU flash kernel and it runs on a tiny input."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return False
    try:
        x = torch.zeros(1, 1, 1, 8)
        out, lse = op(x, x, x, 0.0, False, scale=1.0)
    except (RuntimeError, NotImplementedError):
        return False
    return out.shape == x.shape and lse.shape == (1, 1, 1)


def serves(q: torch.Tensor) -> bool:
    """Whether this module (not ``reference``) computes attention for query ``q``."""
    return q.device.type == "cpu" and q.dtype in SUPPORTED_DTYPES and is_available()


def _kernel(q, k, v, scale: float, causal: bool = False, mask: torch.Tensor | None = None):
    """q [1, H, n, D]; k, v [1, Hkv, m, D] (m >= 1) -> (out [1, H, n, D] q.dtype, lse [1, H, n] float32)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # the op reads the head dim as if it were unit-stride (wrong values otherwise); it honours the other
    # strides, so the usual inputs (heads-first views of token-major K/V) go in without a copy
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return op(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def _positive_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """(q', scale' > 0) with q' k * scale' = q k * scale: the op scales its causal mask's -inf too, which
    is NaN for scale 0 and +inf for scale < 0. Negating q is exact in every dtype."""
    if scale > 0:
        return q, scale
    if scale < 0:
        return -q, -scale
    return torch.zeros_like(q), 1.0  # every score 0: each visible key weighs the same


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of t is finite. NaN and inf survive a sum, so a finite sum proves it; the sum
    is ~50x faster than torch.isfinite (measured: 17 us against 940 us on [512, 9, 64] float32, 3 us on [1, 9, 64]), and a sum
    that overflows only costs the exact scan."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def _nan_rows_of_nonfinite_queries(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]; out [n, H, D], lse [n, H] float32, written in place. The op gives a query row holding
    NaN a finite result (out 0, lse 0) that an lse merge would mix in silently; the reference gives NaN.
    Rows that saw no key keep (0, -inf), as in the reference."""
    if _all_finite(q):
        return out, lse
    bad = ~torch.isfinite(q).all(dim=-1) & (lse != float("-inf"))  # [n, H]
    if bool(bad.any()):
        out[bad] = float("nan")
        lse[bad] = float("nan")
    return out, lse


def _unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]; k, v [Hkv, m, D], m >= 1 -> float32 out [n, H, D], lse [n, H]; every key visible."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    qf = q.reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * n, head_dim)
    out, lse = _kernel(qf, k.unsqueeze(0), v.unsqueeze(0), scale)
    out = out[0].view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    lse = lse[0].view(num_kv_heads, group, n).permute(2, 0, 1).reshape(n, num_heads)
    return out.float(), lse.float()


def _near(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_positions: torch.Tensor,
          k_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]; k, v [Hkv, m, D], m >= 1; positions int64 [n], [m] -> float32 (out, lse), masked
    by position (key j visible to query i iff k_positions[j] <= q_positions[i])."""
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if k_positions.shape == q_positions.shape and bool((k_positions == q_positions).all()) and (
            q_positions.numel() < 2 or bool((q_positions[1:] > q_positions[:-1]).all())):
        out, lse = _kernel(qh, k.unsqueeze(0), v.unsqueeze(0), scale, causal=True)  # the diagonal: top-left causal
        return out[0].transpose(0, 1).float(), lse[0].transpose(0, 1)
    if not _all_finite(k):
        # the op adds the -inf mask to a NaN score and gets NaN, so a NaN key would reach rows that cannot
        # see it; the reference masks scores instead (rare: only non-finite keys take this way)
        return reference.contiguous_partial_attention(q, k.transpose(0, 1), v.transpose(0, 1), scale=scale,
                                                      q_positions=q_positions, k_positions=k_positions)
    visible = k_positions[None, :] <= q_positions[:, None]  # [n, m]
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
    out, lse = _kernel(qh, k.unsqueeze(0), v.unsqueeze(0), scale, mask=mask)
    out, lse = out[0].transpose(0, 1).float(), lse[0].transpose(0, 1).clone()  # [n, H, D], [n, H]
    blind = ~visible.any(dim=1)  # [n]: rows that see no key of this part
    if bool(blind.any()):
        lse[blind] = float("-inf")
        out[blind] = 0.0
    return out, lse


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_positions: torch.Tensor | None,
            k_positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]; k, v [Hkv, m, D] (heads first); positions int [n], [m] (None: no mask / arange(m))."""
    n, num_heads, head_dim = q.shape
    if n == 0 or k.shape[1] == 0:
        return contract.empty_result(n, num_heads, head_dim, q.device)
    q_scaled, scale = _positive_scale(q, scale)
    out, lse = _attend_by_position(q_scaled, k, v, scale, q_positions, k_positions)
    return _nan_rows_of_nonfinite_queries(q, out, lse)


def _attend_by_position(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        q_positions: torch.Tensor | None, k_positions: torch.Tensor | None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_attend`` for n, m >= 1 and scale > 0: the keys split into far (no mask) and near parts."""
    m = k.shape[1]
    if q_positions is None:
        return _unmasked(q, k, v, scale)
    q_positions = q_positions.long()
    k_positions = torch.arange(m) if k_positions is None else k_positions.long()
    q_min = int(q_positions.min())
    if int(k_positions.max()) <= q_min:  # decode, and blocks before a prefill chunk: no mask
        return _unmasked(q, k, v, scale)
    is_far = k_positions < q_min
    num_far = int(is_far.sum())
    if num_far == 0:
        return _near(q, k, v, scale, q_positions, k_positions)
    if bool(is_far[:num_far].all()):  # positions ascending: the far keys are a prefix, sliced without a copy
        far_kv, near_kv, near_pos = (k[:, :num_far], v[:, :num_far]), (k[:, num_far:], v[:, num_far:]), k_positions[num_far:]
    else:
        is_near = ~is_far
        far_kv, near_kv, near_pos = (k[:, is_far], v[:, is_far]), (k[:, is_near], v[:, is_near]), k_positions[is_near]
    far = _unmasked(q, *far_kv, scale)
    near = _near(q, *near_kv, scale, q_positions, near_pos)
    return reference.merge_partials([far, near])


def contiguous_partial_attention(
    q: torch.Tensor,                          # [num_q, num_heads, head_dim], CPU, float32/bfloat16/float16
    k: torch.Tensor,                          # [num_k, num_kv_heads, head_dim], q's dtype
    v: torch.Tensor,                          # [num_k, num_kv_heads, head_dim]
    *,
    scale: float,
    q_positions: torch.Tensor | None = None,  # int [num_q]; None = no causal mask
    k_positions: torch.Tensor | None = None,  # int [num_k]; None = arange(num_k)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.contiguous_partial_attention`` through the flash kernel: float32 out [num_q,
    num_heads, head_dim], lse [num_q, num_heads]."""
    contract.check_contiguous_args(q, k, v, q_positions, k_positions)
    return _attend(q, k.transpose(0, 1), v.transpose(0, 1), scale, q_positions, k_positions)


def paged_partial_attention(
    q: torch.Tensor,                # [num_q, num_heads, head_dim], CPU
    kv_pool: torch.Tensor,          # [num_slots, 2, num_kv_heads, block_tokens, head_dim], q's dtype
    block_slots: torch.Tensor,      # int [num_blocks]
    block_start_pos: torch.Tensor,  # int [num_blocks]
    block_num_tokens: torch.Tensor, # int [num_blocks], 1..block_tokens
    *,
    scale: float,
    q_positions: torch.Tensor | None = None,  # int [num_q]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.paged_partial_attention`` through the flash kernel: the blocks are gathered
    heads-first in one copy (half the time of a gather then a permuting copy), tokens past each
    block's fill are dropped."""
    contract.check_paged_args(q, kv_pool, block_slots, block_start_pos, block_num_tokens, q_positions)
    num_kv_heads, block_tokens, head_dim = kv_pool.shape[2], kv_pool.shape[3], kv_pool.shape[4]
    num_blocks = block_slots.shape[0]
    if num_blocks == 0 or q.shape[0] == 0:
        return contract.empty_result(q.shape[0], q.shape[1], q.shape[2], q.device)
    # one copy, heads first: [2, Hkv, num_slots, T, D] view -> [2, Hkv, nb, T, D] -> [2, Hkv, nb * T, D]
    kv = kv_pool.permute(1, 2, 0, 3, 4).index_select(2, block_slots.long())
    kv = kv.reshape(2, num_kv_heads, num_blocks * block_tokens, head_dim)
    offsets = torch.arange(block_tokens)
    k_positions = (block_start_pos.long()[:, None] + offsets).reshape(-1)  # [nb * T]
    num_tokens = block_num_tokens.long()
    contract.check_block_fills(num_tokens, block_tokens)
    if bool((num_tokens < block_tokens).any()):
        valid = (offsets[None, :] < num_tokens[:, None]).reshape(-1)
        kv, k_positions = kv[:, :, valid], k_positions[valid]
    return _attend(q, kv[0], kv[1], scale, q_positions, k_positions)


def paged_rows_attention(
    q: torch.Tensor,                # [num_q, num_heads, head_dim], CPU
    kv_pool: torch.Tensor,          # [num_slots, 2, num_kv_heads, block_tokens, head_dim]
    block_slots: torch.Tensor,      # int [num_q, num_blocks]: query i reads the blocks of row i
    block_start_pos: torch.Tensor,  # int [num_q, num_blocks]
    block_num_tokens: torch.Tensor, # int [num_q, num_blocks], 1..block_tokens
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query over blocks of its own, no causal mask: ``paged_partial_attention`` row by row."""
    contract.check_rows_args(q, kv_pool, block_slots, block_start_pos, block_num_tokens)
    if q.shape[0] == 0:
        return contract.empty_result(0, q.shape[1], q.shape[2], q.device)
    parts = [paged_partial_attention(q[i : i + 1], kv_pool, block_slots[i], block_start_pos[i], block_num_tokens[i],
                                     scale=scale) for i in range(q.shape[0])]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


merge_partials = reference.merge_partials
merge_two_into = reference.merge_two_into
