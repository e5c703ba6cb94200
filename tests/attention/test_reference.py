"""CPU tests of the PyTorch partial-attention reference against a dense float64 oracle.

Every test draws fresh random inputs; the seed is printed (shown by pytest on failure)
and included in assertion messages.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

import tierkv.attention as attention
from tierkv.attention import reference

NEG_INF = float("-inf")


@pytest.fixture
def gen() -> torch.Generator:
    seed = random.SystemRandom().randrange(2**63)
    print(f"attention test seed={seed}")
    return torch.Generator().manual_seed(seed)  # gen.initial_seed() gives the seed back


@dataclass
class PagedCase:
    q: torch.Tensor                 # [num_q, num_heads, head_dim]
    kv_pool: torch.Tensor           # [num_slots, 2, num_kv_heads, block_tokens, head_dim]
    block_slots: torch.Tensor       # int [num_blocks]
    block_start_pos: torch.Tensor   # int [num_blocks]
    block_num_tokens: torch.Tensor  # int [num_blocks]
    q_positions: torch.Tensor | None
    scale: float

    def run(self, fn=reference.paged_partial_attention, blocks: slice = slice(None)):
        return fn(self.q, self.kv_pool, self.block_slots[blocks], self.block_start_pos[blocks],
                  self.block_num_tokens[blocks], scale=self.scale, q_positions=self.q_positions)


def make_case(
    gen: torch.Generator, *, num_q: int = 3, num_kv_heads: int = 2, group: int = 4, head_dim: int = 16,
    block_tokens: int = 16, num_blocks: int = 5, causal: bool = True, shuffle: bool = True,
    dtype: torch.dtype = torch.float32, index_dtype: torch.dtype = torch.int64,
) -> PagedCase:
    """A sequence of ``num_blocks`` blocks (last one partly filled) scattered over a NaN pool.

    Queries are the last ``num_q`` positions of the sequence (chunked prefill / decode).
    """
    num_heads = num_kv_heads * group
    num_slots = num_blocks + 3
    last_fill = int(torch.randint(1, block_tokens + 1, (1,), generator=gen)) if block_tokens > 1 else 1
    num_tokens = [block_tokens] * (num_blocks - 1) + [last_fill]
    seq_len = sum(num_tokens)
    pool = torch.full((num_slots, 2, num_kv_heads, block_tokens, head_dim), float("nan"))
    slots = torch.randperm(num_slots, generator=gen)[:num_blocks]
    for slot, n in zip(slots.tolist(), num_tokens):
        pool[slot, :, :, :n] = torch.randn(2, num_kv_heads, n, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    q = torch.randn(num_q, num_heads, head_dim, generator=gen)
    q_positions = torch.arange(seq_len - num_q, seq_len).clamp(min=0) if causal else None
    return PagedCase(
        q=q.to(dtype), kv_pool=pool.to(dtype),
        block_slots=slots[order].to(index_dtype),
        block_start_pos=(torch.arange(num_blocks) * block_tokens)[order].to(index_dtype),
        block_num_tokens=torch.tensor(num_tokens)[order].to(index_dtype),
        q_positions=None if q_positions is None else q_positions.to(index_dtype),
        scale=head_dim**-0.5,
    )


def dense_attention(case: PagedCase, blocks: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 oracle: materialize the valid tokens of the chosen blocks, masked softmax per head."""
    slots, starts, counts = (t[blocks].tolist() for t in
                             (case.block_slots, case.block_start_pos, case.block_num_tokens))
    num_q, num_heads, head_dim = case.q.shape
    num_kv_heads = case.kv_pool.shape[2]
    ks = [case.kv_pool[s, 0, :, :n].transpose(0, 1) for s, n in zip(slots, counts)]
    vs = [case.kv_pool[s, 1, :, :n].transpose(0, 1) for s, n in zip(slots, counts)]
    k = torch.cat(ks).double() if ks else torch.zeros(0, num_kv_heads, head_dim, dtype=torch.float64)
    v = torch.cat(vs).double() if vs else torch.zeros(0, num_kv_heads, head_dim, dtype=torch.float64)
    k_pos = torch.tensor([p + i for p, n in zip(starts, counts) for i in range(n)], dtype=torch.int64)
    return dense_contiguous(case.q, k, v, case.scale, case.q_positions, k_pos)


def dense_contiguous(q, k, v, scale, q_positions, k_positions) -> tuple[torch.Tensor, torch.Tensor]:
    num_q, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)       # [num_k, num_heads, dim]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.ones(num_q, k.shape[0], dtype=torch.bool)
    if q_positions is not None:
        visible = k_positions[None, :].long() <= q_positions[:, None].long()
    scores = scores.masked_fill(~visible, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)                 # [num_heads, num_q]; -inf if nothing seen
    probs = torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out.float(), lse.transpose(0, 1).float()


def assert_matches(actual, expected, gen, *, atol=2e-5, rtol=1e-5) -> None:
    out, lse = actual
    ref_out, ref_lse = expected
    seed = gen.initial_seed()
    assert out.dtype == torch.float32 and lse.dtype == torch.float32, f"seed={seed}"
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, f"seed={seed}"
    assert torch.isfinite(out).all(), f"non-finite out, seed={seed}"
    assert not torch.isnan(lse).any(), f"NaN lse, seed={seed}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"-inf rows differ, seed={seed}"
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol, msg=lambda m: f"out, seed={seed}: {m}")
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=atol, rtol=rtol,
                               msg=lambda m: f"lse, seed={seed}: {m}")


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_tokens", [1, 16, 64])
def test_paged_matches_dense_chunked_prefill(gen, group, block_tokens):
    num_blocks = {1: 40, 16: 6, 64: 3}[block_tokens]
    case = make_case(gen, num_q=7, group=group, block_tokens=block_tokens, num_blocks=num_blocks)
    assert_matches(case.run(), dense_attention(case), gen)


@pytest.mark.parametrize("causal", [True, False])
def test_paged_decode(gen, causal):
    case = make_case(gen, num_q=1, num_kv_heads=8, group=4, head_dim=64, block_tokens=16,
                     num_blocks=20, causal=causal)
    assert_matches(case.run(), dense_attention(case), gen)


def test_queries_before_every_key_see_nothing(gen):
    case = make_case(gen, num_q=6, block_tokens=4, num_blocks=4)
    case.block_start_pos += 3                              # keys at positions 3.. ; queries 10..15
    case.q_positions = torch.tensor([0, 1, 2, 3, 9, 50])   # first three rows see nothing
    out, lse = case.run()
    assert torch.isneginf(lse[:3]).all() and (out[:3] == 0).all(), f"seed={gen.initial_seed()}"
    assert_matches((out, lse), dense_attention(case), gen)


def test_index_tensors_int32(gen):
    case = make_case(gen, index_dtype=torch.int32)
    assert_matches(case.run(), dense_attention(case), gen)


@pytest.mark.parametrize("num_parts", [2, 3, 5])
def test_split_blocks_and_merge_equals_full(gen, num_parts):
    case = make_case(gen, num_q=5, block_tokens=8, num_blocks=9)
    full = case.run()
    cuts = sorted(torch.randint(0, 10, (num_parts - 1,), generator=gen).tolist())
    bounds = [0, *cuts, 9]                                 # may contain empty parts
    parts = [case.run(blocks=slice(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    merged = attention.merge_partials(parts)
    assert_matches(merged, full, gen, atol=1e-6, rtol=1e-6)
    assert_matches(merged, dense_attention(case), gen)


def test_empty_block_set(gen):
    case = make_case(gen, num_q=4)
    out, lse = case.run(blocks=slice(0, 0))
    assert out.shape == case.q.shape and (out == 0).all(), f"seed={gen.initial_seed()}"
    assert torch.isneginf(lse).all(), f"seed={gen.initial_seed()}"
    real = case.run()
    for parts in ([(out, lse), real], [real, (out, lse)]):
        merged_out, merged_lse = attention.merge_partials(parts)
        assert torch.equal(merged_out, real[0]), f"seed={gen.initial_seed()}"
        assert torch.equal(merged_lse, real[1]), f"seed={gen.initial_seed()}"


def test_merge_rows_empty_everywhere(gen):
    out = torch.randn(3, 4, 8, generator=gen)
    lse = torch.randn(3, 4, generator=gen)
    empty_row_out, empty_row_lse = out.clone(), lse.clone()
    empty_row_out[1], empty_row_lse[1] = 0.0, NEG_INF
    merged_out, merged_lse = reference.merge_partials([(empty_row_out, empty_row_lse)] * 3)
    assert (merged_out[1] == 0).all() and torch.isneginf(merged_lse[1]).all()
    torch.testing.assert_close(merged_lse[0], lse[0] + math.log(3))
    torch.testing.assert_close(merged_out[0], out[0])


def test_reference_key_chunking(gen, monkeypatch):
    monkeypatch.setattr(reference, "_MAX_SCORE_ELEMENTS", 64)  # forces many key chunks + merge
    case = make_case(gen, num_q=3, block_tokens=4, num_blocks=7)
    assert_matches(case.run(), dense_attention(case), gen)
    k = torch.randn(50, 2, 16, generator=gen)
    v = torch.randn(50, 2, 16, generator=gen)
    q_positions = torch.tensor([5, 20, 49])
    got = reference.contiguous_partial_attention(case.q, k, v, scale=0.3, q_positions=q_positions)
    assert_matches(got, dense_contiguous(case.q, k, v, 0.3, q_positions, torch.arange(50)), gen)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("explicit_positions", [False, True])
def test_contiguous_matches_dense(gen, group, explicit_positions):
    num_k, num_kv_heads = 37, 2
    q = torch.randn(6, num_kv_heads * group, 32, generator=gen)
    k = torch.randn(num_k, num_kv_heads, 32, generator=gen)
    v = torch.randn(num_k, num_kv_heads, 32, generator=gen)
    k_positions = torch.randperm(num_k, generator=gen) + 100 if explicit_positions else None
    q_positions = torch.tensor([0, 100, 110, 120, 136, 200]) if explicit_positions else torch.arange(31, 37)
    got = attention.contiguous_partial_attention(q, k, v, scale=0.2, q_positions=q_positions,
                                                 k_positions=k_positions)
    expected_k_pos = k_positions if explicit_positions else torch.arange(num_k)
    assert_matches(got, dense_contiguous(q, k, v, 0.2, q_positions, expected_k_pos), gen)


def test_contiguous_empty_and_unmasked(gen):
    q = torch.randn(2, 4, 8, generator=gen)
    no_keys = torch.zeros(0, 1, 8)
    out, lse = reference.contiguous_partial_attention(q, no_keys, no_keys, scale=1.0)
    assert (out == 0).all() and torch.isneginf(lse).all()
    k, v = torch.randn(9, 1, 8, generator=gen), torch.randn(9, 1, 8, generator=gen)
    got = reference.contiguous_partial_attention(q, k, v, scale=1.0)
    assert_matches(got, dense_contiguous(q, k, v, 1.0, None, None), gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(gen, dtype):
    case = make_case(gen, num_q=4, group=4, block_tokens=16, num_blocks=4, dtype=dtype)
    assert_matches(case.run(), dense_attention(case), gen)  # oracle sees the same rounded inputs


def test_public_api_on_cpu_without_the_flash_kernel_uses_reference(gen, monkeypatch):
    """(With the kernel, CPU tensors go to `cpu_flash`: tests/attention/test_cpu_flash.py.)"""
    from tierkv.attention import cpu_flash

    monkeypatch.setattr(cpu_flash, "is_available", lambda: False)
    case = make_case(gen)
    got = case.run(fn=attention.paged_partial_attention)
    expected = case.run()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_bad_arguments_raise_value_error(gen):
    case = make_case(gen, num_kv_heads=2, group=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        reference.paged_partial_attention(case.q[:, :3], case.kv_pool, case.block_slots,
                                          case.block_start_pos, case.block_num_tokens, scale=1.0)
    with pytest.raises(ValueError, match="block_num_tokens"):
        reference.paged_partial_attention(case.q, case.kv_pool, case.block_slots, case.block_start_pos,
                                          case.block_num_tokens[:-1], scale=1.0)
    with pytest.raises(ValueError, match="int32 or int64"):
        reference.paged_partial_attention(case.q, case.kv_pool, case.block_slots.float(),
                                          case.block_start_pos, case.block_num_tokens, scale=1.0)
    with pytest.raises(ValueError, match="kv_pool"):
        reference.paged_partial_attention(case.q.double(), case.kv_pool, case.block_slots,
                                          case.block_start_pos, case.block_num_tokens, scale=1.0)
    with pytest.raises(ValueError, match="at least one"):
        attention.merge_partials([])
    with pytest.raises(ValueError, match="part 1"):
        reference.merge_partials([(torch.zeros(2, 3, 4), torch.zeros(2, 3)),
                                  (torch.zeros(2, 4, 4), torch.zeros(2, 4))])


def test_rows_attention_is_each_query_over_its_own_blocks(gen):
    """paged_rows_attention: query i over row i of the block lists, as a dense oracle gives it; a
    mismatched block list is refused by name."""
    q_case, other = make_case(gen, num_q=1, causal=False), make_case(gen, num_q=1, causal=False)
    pool = torch.cat([q_case.kv_pool, other.kv_pool])  # the second query's blocks after the first's
    shift = q_case.kv_pool.shape[0]
    lists = [torch.stack([a, b]) for a, b in ((q_case.block_slots, other.block_slots + shift),
                                              (q_case.block_start_pos, other.block_start_pos),
                                              (q_case.block_num_tokens, other.block_num_tokens))]
    q = torch.cat([q_case.q, other.q])
    out, lse = attention.paged_rows_attention(q, pool, *lists, scale=q_case.scale)
    for i, case in enumerate((q_case, other)):
        want_out, want_lse = case.run()
        torch.testing.assert_close(out[i : i + 1], want_out, msg=f"seed={gen.initial_seed()}")
        torch.testing.assert_close(lse[i : i + 1], want_lse, msg=f"seed={gen.initial_seed()}")
    with pytest.raises(ValueError, match="block_num_tokens must be"):
        attention.paged_rows_attention(q, pool, lists[0], lists[1], lists[2][:, :-1], scale=1.0)
