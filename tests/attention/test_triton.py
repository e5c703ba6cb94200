"""Tests of the Triton partial-attention kernels against the PyTorch reference.

Two groups:
  - interpreter tests (``test_interp_*``): run on CPU through the Triton interpreter;
    skipped, with the reason, when triton is not installed. Where this process cannot
    interpret (see ``_no_interpreter_reason``), ``test_interpreter_in_subprocess`` runs
    them in a fresh process instead.
    float32 and float16 only: the interpreter's ``tl.dot`` multiplies bfloat16 operands
    as raw uint16 bits (triton 3.9), so bfloat16 is covered by the GPU tests.
  - ``@pytest.mark.gpu`` tests: bfloat16 on CUDA with Llama-3.1-8B layer shapes
    (32 query heads, 8 kv heads, head_dim 128) at 32k context, compared to the
    reference in float32; skipped without CUDA.

Every test draws fresh random inputs; the seed is printed and put in assertion messages.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from types import ModuleType

import pytest
import torch

import tierkv.attention as attention
from tests.interpreter import run_interpreter_tests
from tierkv.attention import reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
needs_gpu = pytest.mark.skipif(
    not (HAS_CUDA and HAS_TRITON) or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device, triton, and TRITON_INTERPRET unset",
)


@pytest.fixture
def gen() -> torch.Generator:
    seed = random.SystemRandom().randrange(2**63)
    print(f"attention test seed={seed}")
    return torch.Generator().manual_seed(seed)  # gen.initial_seed() gives the seed back


def _triton_imported_compiled() -> bool:
    """True when triton is already imported without the interpreter in this process."""
    if "triton" not in sys.modules:
        return False
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(standard.sum, InterpretedFunction)


def _no_interpreter_reason() -> str | None:
    """Why this process cannot run the interpreter tests, or None when it can.

    triton picks interpreter or compiler per ``@triton.jit`` function at import time, its
    own library functions included, and reads ``TRITON_INTERPRET`` again while running,
    so one process cannot mix the two. Where this one cannot interpret (CUDA present, or
    triton already imported compiled by an earlier test), ``test_interpreter_in_subprocess``
    runs the interpreter tests in a fresh process.
    """
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    if HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        return "CUDA present, triton runs compiled here; test_interpreter_in_subprocess runs these"
    if _triton_imported_compiled():
        return "triton was imported compiled earlier in this process; test_interpreter_in_subprocess runs these"
    return None


@pytest.fixture
def interp(monkeypatch) -> ModuleType:
    """``triton_paged`` with its kernels running in the Triton interpreter on CPU tensors."""
    reason = _no_interpreter_reason()
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tierkv.attention import triton_paged

    return triton_paged


@pytest.fixture
def poisoned_empty(monkeypatch) -> None:
    """Make every ``torch.empty`` in the test return NaN, so unwritten outputs show up."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", nan_empty)


def make_paged(
    gen: torch.Generator, *, num_q: int, num_kv_heads: int, group: int, head_dim: int, block_tokens: int,
    num_blocks: int, dtype: torch.dtype, device: str = "cpu", causal: bool = True, shuffle: bool = True,
) -> dict:
    """Kwargs for ``paged_partial_attention``: a shuffled sequence of blocks, last one partly
    filled, in a pool whose unused slots and unfilled tokens are NaN; queries are the last
    ``num_q`` positions of the sequence."""
    num_slots = num_blocks + 2
    last_fill = int(torch.randint(1, block_tokens + 1, (1,), generator=gen))
    counts = torch.tensor([block_tokens] * (num_blocks - 1) + [last_fill])
    seq_len = int(counts.sum())
    pool = torch.full((num_slots, 2, num_kv_heads, block_tokens, head_dim), float("nan"), dtype=dtype)
    slots = torch.randperm(num_slots, generator=gen)[:num_blocks]
    for slot, n in zip(slots.tolist(), counts.tolist()):
        pool[slot, :, :, :n] = torch.randn(2, num_kv_heads, n, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    q = torch.randn(num_q, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    q_positions = torch.arange(seq_len - num_q, seq_len).clamp(min=0) if causal else None
    kwargs = dict(
        q=q, kv_pool=pool, block_slots=slots[order].int(),
        block_start_pos=(torch.arange(num_blocks) * block_tokens)[order], block_num_tokens=counts[order],
        q_positions=q_positions,
    )
    kwargs = {k: None if v is None else v.to(device) for k, v in kwargs.items()}
    return dict(kwargs, scale=head_dim**-0.5)


def check(actual, expected, gen, *, atol=1e-5, rtol=1e-5) -> None:
    out, lse = actual
    ref_out, ref_lse = (t.float() for t in expected)
    seed = gen.initial_seed()
    assert out.dtype == torch.float32 and lse.dtype == torch.float32, f"seed={seed}"
    assert torch.isfinite(out).all(), f"non-finite out, seed={seed}"
    assert not torch.isnan(lse).any(), f"NaN lse, seed={seed}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"-inf rows differ, seed={seed}"
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol, msg=lambda m: f"out, seed={seed}: {m}")
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=atol, rtol=rtol,
                               msg=lambda m: f"lse, seed={seed}: {m}")


# ---------------------------------------------------------------- interpreter (CPU)


@needs_triton
@pytest.mark.parametrize("group,block_tokens", [(1, 16), (4, 1), (4, 16), (8, 64), (2, 12)])
def test_interp_paged_matches_reference(interp, gen, poisoned_empty, group, block_tokens):
    num_blocks = max(2, 96 // block_tokens)
    case = make_paged(gen, num_q=2, num_kv_heads=2, group=group, head_dim=16, block_tokens=block_tokens,
                      num_blocks=num_blocks, dtype=torch.float32)
    check(interp.paged_partial_attention(**case), reference.paged_partial_attention(**case), gen)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_interp_split_k(interp, gen, poisoned_empty, num_splits):
    case = make_paged(gen, num_q=1, num_kv_heads=1, group=4, head_dim=16, block_tokens=16, num_blocks=20,
                      dtype=torch.float32, causal=False)
    check(interp.paged_partial_attention(**case, num_splits=num_splits),
          reference.paged_partial_attention(**case), gen)


@needs_triton
@pytest.mark.parametrize("shuffle", [False, True])
def test_interp_prefill_from_scratch_skips_future_tiles(interp, gen, poisoned_empty, shuffle):
    # 256 queries at positions 1..256 over keys 0..255: 4 query tiles x 4 key tiles. In order,
    # query tile i (positions 64i+1..64i+64) must keep key tile i+1 (its first key is 64i+64)
    # and skip the rest; shuffled, every key tile mixes positions
    case = make_paged(gen, num_q=256, num_kv_heads=1, group=1, head_dim=16, block_tokens=16, num_blocks=16,
                      dtype=torch.float32, shuffle=shuffle)
    case["q_positions"] = torch.arange(1, 257)
    check(interp.paged_partial_attention(**case), reference.paged_partial_attention(**case), gen)


@needs_triton
def test_interp_chunked_prefill_grouped(interp, gen, poisoned_empty):
    # 40 queries x group 4 = 160 rows -> 3 query tiles of 16 queries
    case = make_paged(gen, num_q=40, num_kv_heads=2, group=4, head_dim=16, block_tokens=8, num_blocks=24,
                      dtype=torch.float32)
    check(interp.paged_partial_attention(**case), reference.paged_partial_attention(**case), gen)


@needs_triton
@pytest.mark.parametrize("head_dim", [8, 24])
def test_interp_small_odd_head_dim_and_rows_that_see_nothing(interp, gen, poisoned_empty, head_dim):
    case = make_paged(gen, num_q=4, num_kv_heads=2, group=2, head_dim=head_dim, block_tokens=16, num_blocks=4,
                      dtype=torch.float32)
    case["block_start_pos"] = case["block_start_pos"] + 10
    case["q_positions"] = torch.tensor([0, 9, 10, 100])   # rows 0 and 1 see no key
    out, lse = interp.paged_partial_attention(**case)
    assert torch.isneginf(lse[:2]).all() and (out[:2] == 0).all(), f"seed={gen.initial_seed()}"
    check((out, lse), reference.paged_partial_attention(**case), gen)


@needs_triton
def test_interp_float16(interp, gen, poisoned_empty):
    case = make_paged(gen, num_q=3, num_kv_heads=2, group=4, head_dim=32, block_tokens=16, num_blocks=6,
                      dtype=torch.float16)
    check(interp.paged_partial_attention(**case), reference.paged_partial_attention(**case), gen,
          atol=2e-3, rtol=2e-3)  # probabilities are rounded to float16 before the P @ V dot


@needs_triton
def test_interp_empty_block_set_and_merge(interp, gen, poisoned_empty):
    case = make_paged(gen, num_q=2, num_kv_heads=2, group=4, head_dim=16, block_tokens=16, num_blocks=3,
                      dtype=torch.float32)
    empty = dict(case, block_slots=case["block_slots"][:0], block_start_pos=case["block_start_pos"][:0],
                 block_num_tokens=case["block_num_tokens"][:0])
    out, lse = interp.paged_partial_attention(**empty)
    assert (out == 0).all() and torch.isneginf(lse).all(), f"seed={gen.initial_seed()}"
    real = interp.paged_partial_attention(**case)
    merged = interp.merge_partials([(out, lse), real, (out, lse)])
    check(merged, real, gen, atol=0, rtol=0)


@needs_triton
def test_interp_merge_matches_reference(interp, gen, poisoned_empty):
    parts = [(torch.randn(3, 4, 20, generator=gen), torch.randn(3, 4, generator=gen) * 5) for _ in range(3)]
    parts[1][1][0] = float("-inf")
    parts[1][0][0] = 0.0
    for out, lse in parts:  # row 2, head 1 sees nothing anywhere
        out[2, 1], lse[2, 1] = 0.0, float("-inf")
    check(interp.merge_partials(parts), reference.merge_partials(parts), gen)


@needs_triton
@pytest.mark.parametrize("explicit_positions", [False, True])
def test_interp_contiguous_matches_reference(interp, gen, poisoned_empty, explicit_positions):
    num_k, num_kv_heads, group, head_dim = 150, 2, 4, 16
    kv = torch.randn(num_k, 2, num_kv_heads, head_dim, generator=gen)  # k, v are strided views
    q = torch.randn(5, num_kv_heads * group, head_dim, generator=gen)
    k_positions = torch.randperm(num_k, generator=gen) + 1000 if explicit_positions else None
    q_positions = torch.tensor([999, 1000, 1070, 1149, 2000])
    q_positions = q_positions if explicit_positions else torch.arange(145, 150)
    kwargs = dict(scale=0.25, q_positions=q_positions, k_positions=k_positions)
    check(interp.contiguous_partial_attention(q, kv[:, 0], kv[:, 1], **kwargs, num_splits=2),
          reference.contiguous_partial_attention(q, kv[:, 0], kv[:, 1], **kwargs), gen)


def make_rows(gen: torch.Generator, *, num_q: int, num_kv_heads: int, group: int, head_dim: int, block_tokens: int,
              num_blocks: int, dtype: torch.dtype, device: str = "cpu") -> dict:
    """Kwargs for ``paged_rows_attention``: each query reads num_blocks slots of its own choosing
    (drawn with repeats across queries) from a pool whose unread slots are NaN, with its own fills."""
    num_slots = num_q * num_blocks + 3
    pool = torch.full((num_slots, 2, num_kv_heads, block_tokens, head_dim), float("nan"), dtype=dtype)
    slots = torch.stack([torch.randperm(num_slots - 1, generator=gen)[:num_blocks] for _ in range(num_q)])
    fills = torch.randint(1, block_tokens + 1, (num_q, num_blocks), generator=gen)
    for slot in slots.unique().tolist():
        pool[slot] = torch.randn(2, num_kv_heads, block_tokens, head_dim, generator=gen).to(dtype)
    kwargs = dict(q=torch.randn(num_q, num_kv_heads * group, head_dim, generator=gen).to(dtype), kv_pool=pool,
                  block_slots=slots, block_start_pos=torch.randint(0, 1 << 20, (num_q, num_blocks), generator=gen),
                  block_num_tokens=fills)
    return dict({k: v.to(device) for k, v in kwargs.items()}, scale=head_dim**-0.5)


@needs_triton
@pytest.mark.parametrize("num_q,num_splits", [(1, None), (3, 1), (5, 3)])
def test_interp_rows_match_one_query_at_a_time(interp, gen, poisoned_empty, num_q, num_splits):
    """Each query over its own blocks in one launch equals the reference row by row (so no query reads
    another's blocks: the pool's other slots are NaN)."""
    case = make_rows(gen, num_q=num_q, num_kv_heads=2, group=4, head_dim=16, block_tokens=16, num_blocks=6,
                     dtype=torch.float32)
    want = [reference.paged_partial_attention(case["q"][i : i + 1], case["kv_pool"], case["block_slots"][i],
                                              case["block_start_pos"][i], case["block_num_tokens"][i],
                                              scale=case["scale"]) for i in range(num_q)]
    check(interp.paged_rows_attention(**case, num_splits=num_splits),
          (torch.cat([w[0] for w in want]), torch.cat([w[1] for w in want])), gen)


def test_interp_merge_two_into_equals_the_reference(interp, gen):
    """Two parts of mixed dtypes and strides (an lse transposed as the vLLM backend passes it), rows
    where one part saw no key, merged into a float16 output in one launch."""
    n, heads, dim = 3, 4, 40
    first = (torch.randn(n, heads, dim, generator=gen).half(), torch.randn(heads, n, generator=gen).t())
    second = (torch.randn(n, heads, dim, generator=gen), torch.randn(n, heads, generator=gen))
    second[1][1, 2] = float("-inf")
    second[0][1, 2] = 0.0
    first[1][0, 1] = float("-inf")
    first[0][0, 1] = 0.0
    want = torch.empty(n, heads, dim, dtype=torch.float16)
    reference.merge_two_into(want, first, second)
    got = torch.full((n, heads, dim), float("nan"), dtype=torch.float16)
    interp.merge_two_into(got, first, second)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3, msg=f"seed={gen.initial_seed()}")


@needs_triton
@pytest.mark.skipif(os.environ.get("TIERKV_ATTENTION_CHILD") == "1", reason="already the child process")
def test_interpreter_in_subprocess():
    """Run the ``test_interp_*`` tests in a fresh CPU-only process when this one cannot."""
    reason = _no_interpreter_reason()
    if reason is None:
        pytest.skip("the interpreter tests run in this process")
    print(f"interpreter tests in a child process: {run_interpreter_tests(__file__, 'TIERKV_ATTENTION_CHILD')}")


# ---------------------------------------------------------------- CUDA, Llama-3.1-8B layer shapes

LLAMA_8B = dict(num_kv_heads=8, group=4, head_dim=128)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_bf16(actual, expected, gen) -> None:
    out, lse = actual
    ref_out, ref_lse = expected
    seed = gen.initial_seed()
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), f"seed={seed}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"seed={seed}"
    assert rel_err(out, ref_out) < 2e-2, f"out rel err {rel_err(out, ref_out):.3g}, seed={seed}"
    seen = torch.isfinite(ref_lse)
    lse_err = float((lse[seen] - ref_lse[seen]).abs().max()) if seen.any() else 0.0
    assert lse_err < 2e-3, f"lse max abs err {lse_err:.3g}, seed={seed}"


@pytest.mark.gpu
@needs_gpu
def test_gpu_rows_of_ten_decoding_requests(gen, poisoned_empty):
    """Ten queries, each over 128 blocks of 16 tokens of its own (the sparse decode rows of a batch),
    in one launch, against the reference row by row."""
    case = make_rows(gen, num_q=10, **LLAMA_8B, block_tokens=16, num_blocks=128, dtype=torch.bfloat16,
                     device="cuda")
    got = attention.paged_rows_attention(**case)
    want = reference.paged_rows_attention(**case)
    check_bf16(got, want, gen)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("block_tokens", [16, 64])
@pytest.mark.parametrize("num_q", [1, 512])
def test_gpu_paged_32k(gen, poisoned_empty, block_tokens, num_q):
    case = make_paged(gen, num_q=num_q, **LLAMA_8B, block_tokens=block_tokens,
                      num_blocks=32768 // block_tokens, dtype=torch.bfloat16, device="cuda")
    got = attention.paged_partial_attention(**case)
    assert "tierkv.attention.triton_paged" in sys.modules
    check_bf16(got, reference.paged_partial_attention(**case), gen)


@pytest.mark.gpu
@needs_gpu
def test_gpu_split_merge_and_empty(gen, poisoned_empty):
    case = make_paged(gen, num_q=64, **LLAMA_8B, block_tokens=16, num_blocks=2048, dtype=torch.bfloat16,
                      device="cuda")
    full = attention.paged_partial_attention(**case)
    cuts = [0, 0, 700, 1500, 2048]  # first part empty
    parts = [
        attention.paged_partial_attention(**dict(case, block_slots=case["block_slots"][lo:hi],
                                                 block_start_pos=case["block_start_pos"][lo:hi],
                                                 block_num_tokens=case["block_num_tokens"][lo:hi]))
        for lo, hi in zip(cuts, cuts[1:])
    ]
    assert (parts[0][0] == 0).all() and torch.isneginf(parts[0][1]).all()
    check_bf16(attention.merge_partials(parts), full, gen)
    check_bf16(full, reference.paged_partial_attention(**case), gen)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_contiguous_recent_window(gen, poisoned_empty, dtype):
    num_k, num_q = 2048, 512
    k = torch.randn(num_k, 8, 128, generator=gen).to("cuda", dtype)
    v = torch.randn(num_k, 8, 128, generator=gen).to("cuda", dtype)
    q = torch.randn(num_q, 32, 128, generator=gen).to("cuda", dtype)
    k_positions = torch.arange(30720, 30720 + num_k, device="cuda")
    q_positions = k_positions[-num_q:]
    kwargs = dict(scale=128**-0.5, q_positions=q_positions, k_positions=k_positions)
    got = attention.contiguous_partial_attention(q, k, v, **kwargs)
    expected = reference.contiguous_partial_attention(q, k, v, **kwargs)
    if dtype == torch.float32:
        check(got, expected, gen, atol=1e-4, rtol=1e-4)
    else:
        check_bf16(got, expected, gen)


@pytest.mark.gpu
@needs_gpu
def test_gpu_decode_captures_in_cuda_graph(gen):
    case = make_paged(gen, num_q=1, **LLAMA_8B, block_tokens=16, num_blocks=2048, dtype=torch.bfloat16,
                      device="cuda")
    expected = attention.paged_partial_attention(**case)  # also compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention.paged_partial_attention(**case)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], expected[0]) and torch.equal(captured[1], expected[1])


@pytest.mark.gpu
@needs_gpu
def test_gpu_decode_128k_speed_vs_sdpa(gen):
    """Loose guard on the decode target: within 4x of SDPA over the same contiguous KV."""
    num_tokens, block_tokens = 131072, 16
    case = make_paged(gen, num_q=1, **LLAMA_8B, block_tokens=block_tokens,
                      num_blocks=num_tokens // block_tokens, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 8, num_tokens, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = case["q"].view(1, 32, 1, 128)

    def time_ms(fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20

    ours = time_ms(lambda: attention.paged_partial_attention(**case))
    sdpa = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    print(f"decode 128k: tierkv {ours:.3f} ms, sdpa {sdpa:.3f} ms, ratio {ours / sdpa:.2f}")
    assert ours < 4 * sdpa
