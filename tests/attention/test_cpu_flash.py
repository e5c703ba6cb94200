"""The CPU flash path (`tierkv.attention.cpu_flash`) against the float32 reference and a float64 oracle.

Shapes: GQA ratios 1, 3, 7; head_dim 64 and 128; one query (decode), chunk-sized and odd query
counts; key sets that are empty, all before the queries, a prefill chunk's own diagonal with
older tokens in front (the partial block), and arbitrary positions (rows that see nothing).
Hypothesis draws the shape space; a grid pins the named cases. End to end: greedy tokens of a
small random model through the transformers adapter equal transformers' sdpa, with the CPU
flash kernel doing the attention.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierkv.attention as attention
from tierkv.attention import cpu_flash, reference
from tests.attention.test_reference import assert_matches, dense_attention, dense_contiguous, make_case

@pytest.fixture
def gen() -> torch.Generator:
    seed = random.SystemRandom().randrange(2**63)
    print(f"cpu flash test seed={seed}")
    return torch.Generator().manual_seed(seed)


def test_kernel_is_available_in_this_torch():
    assert cpu_flash.is_available(), "torch 2.13 CPU has _scaled_dot_product_flash_attention_for_cpu"


def both_match(q, k, v, scale, q_positions, k_positions, gen, *, atol=2e-5, rtol=1e-5):
    """cpu_flash == reference == float64 oracle on contiguous K/V."""
    got = cpu_flash.contiguous_partial_attention(q, k, v, scale=scale, q_positions=q_positions, k_positions=k_positions)
    ref = reference.contiguous_partial_attention(q, k, v, scale=scale, q_positions=q_positions, k_positions=k_positions)
    oracle_pos = torch.arange(k.shape[0]) if k_positions is None else k_positions
    assert_matches(got, ref, gen, atol=atol, rtol=rtol)
    assert_matches(got, dense_contiguous(q, k, v, scale, q_positions, oracle_pos), gen, atol=atol, rtol=rtol)


def qkv(gen, num_q, num_k, num_kv_heads, group, head_dim, dtype=torch.float32):
    q = torch.randn(num_q, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_k, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_k, num_kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_q", [1, 16, 37])
def test_paged_prefill_chunk_and_decode(gen, group, head_dim, num_q):
    """Queries are the last num_q positions; blocks shuffled in a NaN pool, the last one partly filled."""
    case = make_case(gen, num_q=num_q, num_kv_heads=2, group=group, head_dim=head_dim, block_tokens=16, num_blocks=5)
    got = case.run(fn=cpu_flash.paged_partial_attention)
    assert_matches(got, case.run(), gen)
    assert_matches(got, dense_attention(case), gen)


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_new,num_old", [(1, 0), (1, 9), (16, 0), (16, 5), (33, 15), (64, 1)])
def test_fresh_tokens_with_a_causal_offset(gen, group, head_dim, num_new, num_old):
    """The adapter's fresh part: a partial block's num_old older tokens, then the chunk's own
    tokens; queries at t0..t0+num_new-1 against keys t0-num_old..t0+num_new-1."""
    t0 = 100 + num_old
    q, k, v = qkv(gen, num_new, num_old + num_new, 2, group, head_dim)
    both_match(q, k, v, head_dim**-0.5, torch.arange(t0, t0 + num_new), torch.arange(t0 - num_old, t0 + num_new), gen)


@pytest.mark.parametrize("group", [1, 3, 7])
def test_arbitrary_positions_and_rows_that_see_nothing(gen, group):
    q, k, v = qkv(gen, 6, 37, 2, group, 64)
    k_positions = torch.randperm(37, generator=gen) + 100
    q_positions = torch.tensor([0, 100, 110, 120, 136, 200])  # row 0 sees no key
    both_match(q, k, v, 0.2, q_positions, k_positions, gen)
    out, lse = cpu_flash.contiguous_partial_attention(q, k, v, scale=0.2, q_positions=q_positions,
                                                      k_positions=k_positions)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()


def test_empty_key_and_query_sets(gen):
    q, k, v = qkv(gen, 4, 0, 2, 3, 64)
    for q_positions in (None, torch.arange(4)):
        out, lse = cpu_flash.contiguous_partial_attention(q, k, v, scale=1.0, q_positions=q_positions)
        assert out.shape == q.shape and (out == 0).all() and torch.isneginf(lse).all()
    case = make_case(gen, num_q=3, group=3, head_dim=64)
    out, lse = case.run(fn=cpu_flash.paged_partial_attention, blocks=slice(0, 0))
    assert out.shape == case.q.shape and (out == 0).all() and torch.isneginf(lse).all()
    q0, k1, v1 = qkv(gen, 0, 5, 2, 3, 64)
    out, lse = cpu_flash.contiguous_partial_attention(q0, k1, v1, scale=1.0, q_positions=torch.arange(0))
    assert out.shape == (0, 6, 64) and lse.shape == (0, 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_match_the_float32_reference(gen, dtype):
    """bf16/fp16 K/V: the kernel keeps its output in the input dtype, so the tolerance is that dtype's."""
    case = make_case(gen, num_q=20, num_kv_heads=2, group=3, head_dim=64, num_blocks=4, dtype=dtype)
    got = case.run(fn=cpu_flash.paged_partial_attention)
    assert_matches(got, case.run(), gen, atol=2e-2, rtol=2e-2)
    q, k, v = qkv(gen, 16, 21, 2, 7, 64, dtype)
    got = cpu_flash.contiguous_partial_attention(q, k, v, scale=0.125, q_positions=torch.arange(5, 21))
    ref = reference.contiguous_partial_attention(q, k, v, scale=0.125, q_positions=torch.arange(5, 21))
    assert_matches(got, ref, gen, atol=2e-2, rtol=2e-2)


def test_non_contiguous_query_as_the_adapter_passes_it(gen):
    """tiered_attention hands over query[0].transpose(0, 1): a [n, H, D] view of [H, n, D]."""
    q_heads_first = torch.randn(21, 9, 64, generator=gen)  # [H, n, D]
    q = q_heads_first.transpose(0, 1)
    _, k, v = qkv(gen, 9, 30, 3, 7, 64)
    both_match(q, k, v, 0.125, torch.arange(21, 30), None, gen)


def test_rows_attention(gen):
    case, other = make_case(gen, num_q=1, causal=False, group=3), make_case(gen, num_q=1, causal=False, group=3)
    pool = torch.cat([case.kv_pool, other.kv_pool])
    shift = case.kv_pool.shape[0]
    rows = [torch.stack([a, b]) for a, b in ((case.block_slots, other.block_slots + shift),
                                             (case.block_start_pos, other.block_start_pos),
                                             (case.block_num_tokens, other.block_num_tokens))]
    q = torch.cat([case.q, other.q])
    got = cpu_flash.paged_rows_attention(q, pool, *rows, scale=case.scale)
    assert_matches(got, reference.paged_rows_attention(q, pool, *rows, scale=case.scale), gen)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_q=st.integers(0, 40), num_k=st.integers(0, 90), num_kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 2, 3, 7]), head_dim=st.sampled_from([8, 64, 128]),
       layout=st.sampled_from(["unmasked", "chunk", "offset", "random"]), seed=st.integers(0, 2**31))
def test_any_shape_matches_the_reference(num_q, num_k, num_kv_heads, group, head_dim, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = qkv(gen, num_q, num_k, num_kv_heads, group, head_dim)
    q_positions = k_positions = None
    if layout == "chunk":  # queries are the last num_q keys (or past them, when fewer keys)
        q_positions = torch.arange(max(0, num_k - num_q), max(0, num_k - num_q) + num_q)
    elif layout == "offset":  # queries at arbitrary start, keys from somewhere before
        start = int(torch.randint(0, 50, (1,), generator=gen))
        q_positions = torch.arange(start + num_k, start + num_k + num_q) - min(num_q, num_k)
        k_positions = torch.arange(start, start + num_k)
    elif layout == "random":
        q_positions = torch.randint(0, 120, (num_q,), generator=gen)
        k_positions = torch.randint(0, 120, (num_k,), generator=gen)
    both_match(q, k, v, head_dim**-0.5, q_positions, k_positions, gen)


def test_public_api_dispatches_cpu_tensors_to_the_flash_path(gen, monkeypatch):
    """float32/bf16/fp16 CPU queries go to cpu_flash; float64 and a torch without the kernel go to
    the reference, which gives its own results bit for bit."""
    case = make_case(gen, num_q=5, group=3, head_dim=64)
    calls = []
    original = cpu_flash._attend
    monkeypatch.setattr(cpu_flash, "_attend", lambda *a: calls.append(1) or original(*a))
    got = case.run(fn=attention.paged_partial_attention)
    assert calls, "the public API did not use the CPU flash kernel"
    assert_matches(got, case.run(), gen)
    calls.clear()
    q64 = case.q.double()
    attention.contiguous_partial_attention(q64, q64, q64, scale=1.0)
    assert not calls, "float64 must go to the reference"
    monkeypatch.setattr(cpu_flash, "is_available", lambda: False)
    got = case.run(fn=attention.paged_partial_attention)
    expected = case.run()
    assert not calls and torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_bad_arguments_raise_value_error(gen):
    case = make_case(gen, num_kv_heads=2, group=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cpu_flash.paged_partial_attention(case.q[:, :3], case.kv_pool, case.block_slots, case.block_start_pos,
                                          case.block_num_tokens, scale=1.0)
    with pytest.raises(ValueError, match="k_positions"):
        cpu_flash.contiguous_partial_attention(case.q, case.q, case.q, scale=1.0, q_positions=torch.arange(3),
                                               k_positions=torch.arange(2))


@pytest.mark.parametrize("heads,kv_heads,head_dim,prompt_len,chunk", [(6, 2, 64, 300, 64), (7, 1, 64, 203, 50),
                                                                      (4, 4, 128, 150, 150)])
def test_greedy_tokens_equal_transformers_sdpa(heads, kv_heads, head_dim, prompt_len, chunk, monkeypatch):
    """A random Llama through the adapter (GPU budget 8x+ below the KV, far blocks read in place) with
    the CPU flash kernel gives transformers' sdpa greedy tokens and logits."""
    from tests.integrations.hf.test_exact_hf import tiered_greedy, tiny_config
    from tests.models import build, reference_greedy
    from tierkv.integrations.hf import runtime_for_model
    from tierkv.config import load_config

    calls = []
    original = cpu_flash._attend
    monkeypatch.setattr(cpu_flash, "_attend", lambda *a: calls.append(1) or original(*a))
    model, sdpa = build("llama", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    config = load_config(tiny_config(8, 2, chunk, num_layers=2, kv_heads=kv_heads, head_dim=head_dim,
                                     far_reads="direct"), env={})  # a CPU device's default
    runtime = runtime_for_model(model, config, model_id="test-cpu-flash")
    try:
        ids = torch.randint(0, 512, (prompt_len,)).tolist()
        want_tokens, want_logits = reference_greedy(sdpa, ids, 8)
        tokens, logits = tiered_greedy(model, runtime, ids, 8, chunk)
        assert calls, "the CPU flash kernel did not run"
        assert tokens == want_tokens
        for step, (got, want) in enumerate(zip(logits, want_logits)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
        assert runtime.active.far_in_place.num_blocks_read > 0  # far blocks read, in place
    finally:
        runtime.close()
