"""Edge cases of the CPU flash path (`tierkv.attention.cpu_flash`) that a tester found wrong.

Each case is checked against the float32 reference (which defines the behaviour on non-finite
inputs) and, where every value is finite, a float64 oracle:
  - a head dim that is not unit-stride (the fused op reads it as if it were);
  - a query row holding NaN or inf (the op returns a finite out = 0, lse = 0 for it);
  - a query with zero heads (SIGFPE inside the op, so it runs in a child process);
  - scale <= 0 with a mask (-inf mask times the scale is NaN);
  - a NaN key that some rows cannot see, on the additive-mask path;
  - the block-list checks: 2-D block_slots, block fills above the block size.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierkv.attention as attention
from tierkv.attention import cpu_flash, reference
from tests.attention.test_reference import assert_matches, dense_contiguous, make_case

# query/key positions per layout; each reaches a different branch of cpu_flash._attend:
#   unmasked: no q_positions; decode: one query after every key (no mask);
#   self: queries are the keys (the op's causal mask); far_near: old keys + the chunk (split and merge);
#   shuffled: the chunk's keys out of order (additive mask); random: arbitrary positions (rows that see nothing)
LAYOUTS = ["unmasked", "decode", "self", "far_near", "shuffled", "random"]


def layout_case(layout: str, gen: torch.Generator, num_q: int, num_k: int, num_kv_heads: int = 2, group: int = 3,
                head_dim: int = 16, dtype: torch.dtype = torch.float32):
    """(q [num_q, H, D], k, v [num_k, Hkv, D], q_positions, k_positions) for one layout of LAYOUTS."""
    if layout in ("self", "shuffled"):
        num_k = num_q
    if layout == "decode":
        num_q = 1
    q = torch.randn(num_q, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_k, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_k, num_kv_heads, head_dim, generator=gen).to(dtype)
    q_positions = k_positions = None
    if layout == "decode":
        q_positions = torch.tensor([num_k + 2])
    elif layout == "self":
        q_positions = k_positions = torch.arange(7, 7 + num_q)
    elif layout == "far_near":
        q_positions = torch.arange(num_k - num_q, num_k)
    elif layout == "shuffled":
        q_positions = torch.arange(7, 7 + num_q)
        k_positions = q_positions[torch.randperm(num_q, generator=gen)]
    elif layout == "random":
        q_positions = torch.randint(0, 2 * num_k + 2, (num_q,), generator=gen)
        k_positions = torch.randint(0, 2 * num_k + 2, (num_k,), generator=gen)
    return q, k, v, q_positions, k_positions


def run_both(q, k, v, scale, q_positions, k_positions):
    """(cpu_flash result, reference result) of the same contiguous call."""
    kwargs = dict(scale=scale, q_positions=q_positions, k_positions=k_positions)
    return (cpu_flash.contiguous_partial_attention(q, k, v, **kwargs),
            reference.contiguous_partial_attention(q, k, v, **kwargs))


def oracle(q, k, v, scale, q_positions, k_positions):
    k_positions = torch.arange(k.shape[0]) if k_positions is None else k_positions
    return dense_contiguous(q, k, v, scale, q_positions, k_positions)


def assert_same_non_finite(got, expected, *, atol=2e-5, rtol=1e-5) -> None:
    """NaN where the reference has NaN, -inf where it has -inf; the finite entries close."""
    for name, a, b in (("out", got[0], expected[0]), ("lse", got[1], expected[1])):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{name}: NaN entries differ from the reference"
        assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"{name}: -inf entries differ from the reference"
        both = torch.isfinite(a) & torch.isfinite(b)
        torch.testing.assert_close(a[both], b[both], atol=atol, rtol=rtol)


def strided_head_dim(t: torch.Tensor, how: str) -> torch.Tensor:
    """The values of ``t`` [n, H, D] with stride(-1) != 1: every other element, or D-major memory."""
    if how == "step2":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        out = wide[..., ::2]
    else:
        out = t.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert out.stride(-1) != 1 and torch.equal(out, t)
    return out


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), which=st.sets(st.sampled_from("qkv"), min_size=1),
       how=st.sampled_from(["step2", "dmajor"]), num_q=st.integers(1, 9), num_k=st.integers(1, 20),
       seed=st.integers(0, 2**31))
def test_head_dim_that_is_not_unit_stride_matches_the_oracle(layout, which, how, num_q, num_k, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, q_positions, k_positions = layout_case(layout, gen, num_q, num_k)
    expected = oracle(q, k, v, 0.3, q_positions, k_positions)
    strided = {name: strided_head_dim(t, how) if name in which else t for name, t in zip("qkv", (q, k, v))}
    got = cpu_flash.contiguous_partial_attention(strided["q"], strided["k"], strided["v"], scale=0.3,
                                                 q_positions=q_positions, k_positions=k_positions)
    assert_matches(got, expected, gen)


def test_paged_pool_with_a_strided_head_dim_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    case = make_case(gen, num_q=4, head_dim=16)
    pool = case.kv_pool.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, head dim stride 16
    args = (case.block_slots, case.block_start_pos, case.block_num_tokens)
    got = cpu_flash.paged_partial_attention(case.q, pool, *args, scale=case.scale, q_positions=case.q_positions)
    expected = reference.paged_partial_attention(case.q, case.kv_pool, *args, scale=case.scale,
                                                 q_positions=case.q_positions)
    assert_matches(got, expected, gen)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_query_row_comes_out_nan_like_the_reference(layout, bad):
    gen = torch.Generator().manual_seed(1)
    q, k, v, q_positions, k_positions = layout_case(layout, gen, num_q=6, num_k=11)
    q[0, 1, 2] = bad
    q[-1, 4, 0] = bad
    got, expected = run_both(q, k, v, 0.3, q_positions, k_positions)
    poisoned = ~torch.isfinite(q).all(-1) & ~torch.isneginf(expected[1])  # [n, H]: a bad query that sees a key
    assert poisoned.any()
    assert torch.isnan(got[0][poisoned]).all() and torch.isnan(got[1][poisoned]).all(), \
        "a non-finite query row must not come out finite"
    if bad != bad:  # NaN: exactly the reference's result
        assert_same_non_finite(got, expected)
    # inf: the reference gives lse inf or NaN (or -inf where every score is -inf); the finite rows must agree
    finite_rows = torch.isfinite(q).all(-1)
    assert_same_non_finite((got[0][finite_rows], got[1][finite_rows]), (expected[0][finite_rows], expected[1][finite_rows]))


def test_a_nan_query_poisons_the_lse_merge_instead_of_mixing_in_zeros():
    gen = torch.Generator().manual_seed(2)
    q, k, v, _, _ = layout_case("unmasked", gen, num_q=1, num_k=8)
    q[0, 0, 0] = float("nan")
    halves = [cpu_flash.contiguous_partial_attention(q, k[s], v[s], scale=0.3) for s in (slice(0, 4), slice(4, 8))]
    out, lse = attention.merge_partials(halves)
    assert torch.isnan(out[0, 0]).all() and torch.isnan(lse[0, 0])
    assert torch.isfinite(out[0, 1:]).all()


_ZERO_HEADS = """
import torch
from tierkv.attention import contract, cpu_flash
q = torch.randn(2, 0, 64)
k = torch.randn(3, 2, 64)
pool = torch.randn(4, 2, 2, 8, 64)
idx = torch.tensor([0, 1])
calls = [lambda: cpu_flash.contiguous_partial_attention(q, k, k, scale=1.0),
         lambda: cpu_flash.paged_partial_attention(q, pool, idx, idx * 8, idx + 1, scale=1.0)]
for call in calls:
    try:
        call()
    except ValueError as e:
        assert "(2, 0, 64)" in str(e), str(e)
    else:
        raise SystemExit("no ValueError for a query with zero heads")
print("ok")
"""


def test_a_query_without_heads_raises_value_error_naming_the_shape():
    """Run in a child: before the check, the op died of SIGFPE (integer division by zero heads)."""
    repo_root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _ZERO_HEADS], capture_output=True, text=True, timeout=120,
                          cwd=repo_root)
    assert done.returncode == 0 and "ok" in done.stdout, f"rc={done.returncode} {done.stdout} {done.stderr[-2000:]}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scale", [0.0, -0.35])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_not_positive_matches_the_oracle(layout, scale, dtype):
    gen = torch.Generator().manual_seed(4)
    q, k, v, q_positions, k_positions = layout_case(layout, gen, num_q=5, num_k=12, dtype=dtype)
    got, expected = run_both(q, k, v, scale, q_positions, k_positions)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert_matches(got, expected, gen, **tol)
    assert_matches(got, oracle(q, k, v, scale, q_positions, k_positions), gen, **tol)


@pytest.mark.parametrize("layout", ["self", "far_near", "shuffled", "random"])
def test_a_nan_key_reaches_only_the_rows_that_see_it(layout):
    gen = torch.Generator().manual_seed(5)
    q, k, v, q_positions, k_positions = layout_case(layout, gen, num_q=6, num_k=11)
    latest = int(torch.argmax(torch.arange(k.shape[0]) if k_positions is None else k_positions))
    k[latest, 1, 3] = float("nan")  # the newest key: the fewest rows see it
    got, expected = run_both(q, k, v, 0.3, q_positions, k_positions)
    assert not torch.isnan(expected[0]).all(), "the case must have rows that cannot see the NaN key"
    assert_same_non_finite(got, expected)


def test_a_nan_key_in_a_paged_prefill_reaches_only_the_rows_that_see_it():
    gen = torch.Generator().manual_seed(6)
    case = make_case(gen, num_q=9, block_tokens=4, num_blocks=4, shuffle=False)
    slot, fill = int(case.block_slots[-1]), int(case.block_num_tokens[-1])
    case.kv_pool[slot, 0, 0, fill - 1, 0] = float("nan")  # the last token: only the last query sees it
    # newest block first: the chunk's keys arrive out of order, so the additive mask is used
    blocks = [t.flip(0) for t in (case.block_slots, case.block_start_pos, case.block_num_tokens)]
    args = (case.q, case.kv_pool, *blocks)
    got = cpu_flash.paged_partial_attention(*args, scale=case.scale, q_positions=case.q_positions)
    expected = reference.paged_partial_attention(*args, scale=case.scale, q_positions=case.q_positions)
    assert_same_non_finite(got, expected)


def test_two_dimensional_block_slots_name_the_expected_shape():
    case = make_case(torch.Generator().manual_seed(7))
    slots = case.block_slots[None, :]
    with pytest.raises(ValueError, match=r"block_slots must be 1-D") as raised:
        cpu_flash.paged_partial_attention(case.q, case.kv_pool, slots, case.block_start_pos,
                                          case.block_num_tokens, scale=1.0)
    assert "None" not in str(raised.value)


@pytest.mark.parametrize("module", [cpu_flash, reference])
@pytest.mark.parametrize("fill", [17, -1])
def test_block_fill_outside_the_block_size_raises(module, fill):
    case = make_case(torch.Generator().manual_seed(8), block_tokens=16)
    num_tokens = case.block_num_tokens.clone()
    num_tokens[0] = fill
    with pytest.raises(ValueError, match="block_num_tokens"):
        module.paged_partial_attention(case.q, case.kv_pool, case.block_slots, case.block_start_pos, num_tokens,
                                       scale=1.0, q_positions=case.q_positions)
    rows = [t[None, :] for t in (case.block_slots, case.block_start_pos, num_tokens)]
    with pytest.raises(ValueError, match="block_num_tokens"):
        module.paged_rows_attention(case.q[:1], case.kv_pool, *rows, scale=1.0)


def test_empty_blocks_of_padded_rows_are_still_accepted():
    """A fill of 0 is how the sparse step pads a row's block list: it must keep working."""
    case = make_case(torch.Generator().manual_seed(9), block_tokens=16)
    rows = [t[None, :] for t in (case.block_slots, case.block_start_pos, case.block_num_tokens)]
    rows[2] = rows[2].clone()
    rows[2][0, 0] = 0
    got = cpu_flash.paged_rows_attention(case.q[:1], case.kv_pool, *rows, scale=case.scale)
    assert_matches(got, reference.paged_rows_attention(case.q[:1], case.kv_pool, *rows, scale=case.scale),
                   torch.Generator().manual_seed(9))
