"""Sparse decode of sequences shorter than the GPU front region (sinks + far cache) and of sequences that
grow past it, for every predictor, on CPU through the PyTorch reference.

A sequence of fewer blocks than the front region has no far block: its decode steps select from an
empty candidate set. Each case below runs a prompt of every length from 1 token to past the front
region and the window, then decodes one token at a time across block boundaries and the end of the
front region, layer by layer through `SequenceKV` with random K, V and queries; every attention
output is compared with a float64 reference computed here from the step's own block arithmetic:

    prefill (exact)          dense causal attention over every token
    decode, budget >= far    dense attention (sparse equals exact)
    decode, smaller budget   dense attention over every token but the far blocks outside the
                             k = budget / T with the largest key bound (the Quest bound, computed
                             here from the keys), i.e. the reference computation of the same selection

Shapes vary the block size, sinks, window and far-cache blocks; variants cover predictors 'none',
'previous' (with staging for its prefetch, and too little: on-demand fetches), 'query' (with and
without the previous selection), 'cache' (one kept selection; two with a prefetch margin) and an int8
CPU tier (far blocks compared at int8's rounding). A model-level test runs the transformers adapter
on short prompts against transformers' DynamicCache.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tierkv.config import load_config
from tierkv.engine.runtime import KVRuntime
from tierkv.scheduler import step_blocks
from tierkv.sparse.summaries import BlockSummaries, check_candidates, select_far_blocks, select_far_blocks_on_device
from tierkv.storage.gpu import ResidencyPlan

LAYERS, KV_HEADS, HEADS, DIM = 2, 2, 4, 16
SCALE = DIM**-0.5
LARGE_BUDGET_BLOCKS = 24  # more far blocks than any case below holds: sparse must equal exact


@dataclass(frozen=True)
class Shape:
    block_tokens: int
    sink_tokens: int
    window_tokens: int
    far_cache_blocks: int  # front slots past the sinks

    @property
    def front_blocks(self) -> int:
        return -(-self.sink_tokens // self.block_tokens) + self.far_cache_blocks

    @property
    def window_blocks(self) -> int:
        return -(-self.window_tokens // self.block_tokens) + 1

    @property
    def longest_prompt(self) -> int:
        """Two blocks past the front region and the window."""
        return (self.front_blocks + self.window_blocks + 2) * self.block_tokens

    def prompt_lengths(self) -> list[int]:
        """Every length from 1 token to one block past the front region, then the lengths at each block
        boundary (a full last block, one token into the next) up to `longest_prompt`."""
        T = self.block_tokens
        short = range(1, (self.front_blocks + 1) * T + 2)
        edges = (n for b in range(self.front_blocks + 2, self.longest_prompt // T + 1) for n in (b * T, b * T + 1))
        return sorted({*short, *(n for n in edges if n <= self.longest_prompt)})


SHAPES = [
    Shape(4, 4, 8, 1),   # P = 2 blocks, W = 3
    Shape(2, 6, 1, 0),   # sinks only in the front: P = 3, W = 2
    Shape(1, 0, 2, 2),   # one token per block, no sinks: P = 2, W = 3
    Shape(8, 5, 0, 1),   # a sink block not full of sinks, a window of the partial block only: P = 2, W = 1
]


@dataclass(frozen=True)
class Variant:
    predictor: str
    budget_blocks: int              # sparse_token_budget / block_tokens
    staging_blocks: int = 64
    storage_dtype: str = "auto"
    predict_with_previous: bool = True
    selections: int = 1
    margin: int = 0
    bound_weight: float = 1.0       # scheduler.sparse_bound_weight (the shipped default: Quest's bound)
    far_reads: str = "staged"  # scheduler.cpu_far_reads: the staging path a GPU takes, or "direct" (in place)

    def __str__(self) -> str:
        return (f"{self.predictor}-k{self.budget_blocks}-staging{self.staging_blocks}-{self.storage_dtype}"
                f"-prev{int(self.predict_with_previous)}-sel{self.selections}-m{self.margin}-w{self.bound_weight}"
                f"-{self.far_reads}")


VARIANTS = [
    Variant("none", 1), Variant("none", LARGE_BUDGET_BLOCKS),
    Variant("previous", 2), Variant("previous", 2, staging_blocks=4),  # 4 < (layers + 1) x k: no prefetch
    Variant("previous", LARGE_BUDGET_BLOCKS, staging_blocks=4 * LARGE_BUDGET_BLOCKS),
    Variant("query", 2), Variant("query", 1, predict_with_previous=False),
    Variant("query", LARGE_BUDGET_BLOCKS, staging_blocks=4 * LARGE_BUDGET_BLOCKS),
    Variant("cache", 2), Variant("cache", 2, selections=2, margin=1),
    Variant("cache", LARGE_BUDGET_BLOCKS, staging_blocks=4 * LARGE_BUDGET_BLOCKS),
    Variant("none", 2, storage_dtype="int8"), Variant("cache", 2, storage_dtype="int8", selections=2, margin=2),
    Variant("none", 1, bound_weight=0.5), Variant("previous", 2, bound_weight=0.0), Variant("cache", 2, bound_weight=0.5),
    Variant("query", 2, bound_weight=0.25),
    # a CPU device's default: far blocks (and, with a plain tier, the resident ones) read in the CPU tier's slab
    Variant("none", 1, far_reads="direct"), Variant("none", LARGE_BUDGET_BLOCKS, far_reads="direct"),
    Variant("none", 2, storage_dtype="int8", far_reads="direct"), Variant("none", 2, far_reads="direct", bound_weight=0.5),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def runtime_for(shape: Shape, variant: Variant) -> KVRuntime:
    T = shape.block_tokens
    block_bytes = 2 * KV_HEADS * T * DIM * 4
    slots = shape.front_blocks + shape.window_blocks
    config = load_config({
        "cache": {"block_tokens": T, "gpu_budget_bytes": slots * LAYERS * block_bytes,
                  "sink_tokens": shape.sink_tokens, "window_tokens": shape.window_tokens},
        "tiers": [{"kind": "cpu", "capacity_bytes": 4096 * block_bytes, "storage_dtype": variant.storage_dtype}],
        "scheduler": {"policy": "sparse", "predictor": variant.predictor, "lookahead_layers": 1,
                      "sparse_token_budget": variant.budget_blocks * T,
                      "staging_bytes": variant.staging_blocks * block_bytes,
                      "predict_with_previous": variant.predict_with_previous,
                      "sparse_cache_selections": variant.selections, "sparse_prefetch_margin": variant.margin,
                      "prefill_chunk_tokens": 64, "sparse_bound_weight": variant.bound_weight,
                      "cpu_far_reads": variant.far_reads},
    }, env={})
    runtime = KVRuntime(config, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32,
                        device="cpu", model_id="short-sequences")
    assert (runtime.residency.num_front_blocks, runtime.residency.num_window_blocks) == (
        shape.front_blocks, shape.window_blocks)
    runtime.query_projector = lambda layer, hidden, position: hidden.view(HEADS, DIM)  # predicts layer 0's query
    return runtime


def block_score(q: torch.Tensor, keys: torch.Tensor, weight: float) -> float:
    """q [H, D], keys [T, H_kv, D] of one block -> max over heads of w x sum_d max(q kmax, q kmin) (Quest's
    bound) + (1 - w) x q . (kmax + kmin) / 2 (the midpoint key's score), float64."""
    kmax, kmin = keys.amax(0).double().unsqueeze(1), keys.amin(0).double().unsqueeze(1)  # [H_kv, 1, D]
    group = HEADS // KV_HEADS
    qg = q.double().view(KV_HEADS, group, DIM)
    bound = torch.maximum(qg * kmax, qg * kmin).sum(-1)
    mid = (qg * (kmax + kmin) / 2).sum(-1)
    return float((weight * bound + (1 - weight) * mid).max())


def attended_positions(shape: Shape, k: int, t: int, q: torch.Tensor, keys: torch.Tensor,
                       weight: float) -> tuple[list[int], bool]:
    """Positions a decode step at t (one token) attends, worked out from the block arithmetic: every
    position <= t but those of far blocks (past the front, before the window, full) outside the top-k
    by the score of bound weight `weight`; and whether the selection was a real choice (more far blocks than k)."""
    T, P, W = shape.block_tokens, shape.front_blocks, shape.window_blocks
    first, blocks_after = t // T, t // T + 1
    window_start = max(P, blocks_after - W)
    far = list(range(P, min(first, window_start)))
    dropped: set[int] = set()
    if len(far) > k:
        ranked = sorted(far, key=lambda b: block_score(q, keys[b * T : (b + 1) * T], weight), reverse=True)
        dropped = set(ranked[k:])
    return [p for p in range(t + 1) if p // T not in dropped], len(far) > k


def dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """q [H, D] over keys, values [n, H_kv, D] at `positions`: float64 [H, D]."""
    index = torch.tensor(positions)
    k = keys.index_select(0, index).double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [m, H, D]
    v = values.index_select(0, index).double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    weights = torch.softmax(torch.einsum("hd,mhd->hm", q.double(), k) * SCALE, dim=-1)
    return torch.einsum("hm,mhd->hd", weights, v)


def run_case(shape: Shape, variant: Variant, prompt_len: int, num_decode: int, seed: int) -> int:
    """Prefill `prompt_len` random tokens, decode `num_decode` more; every layer's output of every step
    equals the reference. Returns the decode steps whose selection was a real choice."""
    gen = torch.Generator().manual_seed(seed)
    total = prompt_len + num_decode
    keys, values = (torch.randn(LAYERS, total, KV_HEADS, DIM, generator=gen) for _ in range(2))
    queries = torch.randn(LAYERS, total, HEADS, DIM, generator=gen)
    k = variant.budget_blocks
    # int8 far blocks: the CPU tier's rounding (per-block scales) on the far part only
    rtol, atol = (1e-4, 1e-5) if variant.storage_dtype == "auto" else (0.0, 0.08)
    runtime = runtime_for(shape, variant)
    choices = 0
    try:
        seq = runtime.new_sequence()
        for start, stop in [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, total)]:
            for layer in range(LAYERS):
                seq.observe_layer_input(layer, queries[0, start].flatten(), None)
                seq.append(layer, keys[layer, start:stop], values[layer, start:stop])
                got = seq.attend(layer, queries[layer, start:stop], SCALE)
                assert got.shape == (stop - start, HEADS, DIM) and torch.isfinite(got).all()
                for t in range(start, stop):
                    q = queries[layer, t]
                    if stop - start == 1:  # a sparse decode step (a one-token prompt's too)
                        positions, choice = attended_positions(shape, k, t, q, keys[layer], variant.bound_weight)
                        choices += choice
                    else:
                        positions = list(range(t + 1))
                    want = dense(q, keys[layer], values[layer], positions).float()
                    torch.testing.assert_close(got[t - start], want, rtol=rtol, atol=atol, msg=lambda m: (
                        f"{shape} {variant} prompt {prompt_len} position {t} layer {layer}: {m}"))
        seq.finish()
    finally:
        runtime.close()
    return choices // LAYERS


def shape_id(shape: Shape) -> str:
    return (f"T{shape.block_tokens}-sinks{shape.sink_tokens}-window{shape.window_tokens}"
            f"-farcache{shape.far_cache_blocks}")


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_every_prompt_length_and_a_decode_across_the_front_region(shape: Shape, variant: Variant):
    """Prompts of every length up to one block past the front region, and at the block boundaries up to
    two blocks past front + window, each decoded across the next block boundary; the one-token prompt
    decoded until it is three blocks past the front region and the window (its far set grows from
    empty, one block at a time)."""
    T = shape.block_tokens
    choices = 0
    for i, prompt_len in enumerate(shape.prompt_lengths()):
        num_decode = shape.longest_prompt + T if prompt_len == 1 else T + 1
        choices += run_case(shape, variant, prompt_len, num_decode, seed=1000 * i + 7)
    if variant.budget_blocks < LARGE_BUDGET_BLOCKS:
        assert choices > 0, "some step must select fewer far blocks than it has"
    else:
        assert choices == 0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(front=st.integers(0, 6), window=st.integers(1, 5), block_tokens=st.integers(1, 9),
       t0=st.integers(0, 120), num_new=st.integers(1, 40))
def test_step_blocks_partition_the_old_blocks_with_a_forward_far_range(front, window, block_tokens, t0, num_new):
    """For any front region, window, block size and step (a sequence shorter than the front region
    included): the far range starts at the front's end and never runs backwards, and resident plus far
    blocks are exactly the old full blocks, once each, the resident ones on the GPU."""
    residency = ResidencyPlan(num_front_blocks=front, num_window_blocks=window)
    resident, far = step_blocks(residency, block_tokens, t0, num_new)
    check_candidates(far)  # step 1, 0 <= start <= stop
    assert far.start == front
    first_block = t0 // block_tokens
    assert sorted(resident + list(far)) == list(range(first_block))
    blocks_after = -(-(t0 + num_new) // block_tokens)
    assert all(residency.is_resident(b, blocks_after) for b in resident)
    assert not any(residency.is_resident(b, blocks_after) for b in far)
    assert list(far) == [b for b in residency.streamed_range(blocks_after) if b < first_block]


def test_step_blocks_refuses_a_step_that_cannot_happen():
    residency = ResidencyPlan(2, 3)
    for args in ((-1, 1), (0, 0)):
        with pytest.raises(ValueError, match="step_blocks"):
            step_blocks(residency, 4, *args)


def test_selection_over_an_empty_far_set_is_empty_and_a_backward_range_is_refused():
    summaries = BlockSummaries(1, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    summaries.update(0, 0, torch.randn(3, 2, KV_HEADS, 4, DIM))
    q = torch.randn(HEADS, DIM)
    for k in (0, 1, 5):
        assert select_far_blocks(summaries, 0, q, range(2, 2), k) == []
        got = select_far_blocks_on_device(summaries, 0, q, range(2, 2), k)
        assert got.dtype == torch.int64 and got.shape == (0,)
    assert summaries.upper_bounds(0, q, range(3, 3)).shape == (0,)
    for bad in (range(2, 1), range(0, 3, 2), range(-1, 2)):
        with pytest.raises(ValueError, match="far-block candidates"):
            select_far_blocks_on_device(summaries, 0, q, bad, 1)
        with pytest.raises(ValueError, match="far-block candidates"):
            select_far_blocks(summaries, 0, q, bad, 1)
        with pytest.raises(ValueError, match="far-block candidates"):
            summaries.upper_bounds(0, q, bad)


@pytest.mark.parametrize("prompt_len", [1, 7])
def test_short_prompts_through_the_transformers_adapter(prompt_len):
    """A small random-weight Llama through `TieredCache` (block 4, front region 2 blocks, window 3): a
    prompt shorter than the front region decoded 22 tokens, past the front region and the window into
    far blocks. With a budget covering every far block each predictor's greedy tokens and logits equal
    transformers' DynamicCache; with a one-block budget each predictor's equal predictor 'none''s."""
    from tests.models import build, reference_greedy
    from tests.sparse.test_query_predictor import run_greedy

    torch.manual_seed(prompt_len)
    model, reference = build("llama", num_heads=4, num_kv_heads=2, num_layers=2)
    ids = torch.randint(0, 512, (prompt_len,)).tolist()
    num_new = 22
    expected, ref_logits = reference_greedy(reference, ids, num_new)
    for predictor in ("none", "previous", "query", "cache"):
        tokens, logits, *_ = run_greedy(model, predictor, ids, num_new, num_layers=2, budget_tokens=64)
        assert tokens == expected, predictor
        for step, (got, want) in enumerate(zip(logits, ref_logits)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{predictor} step {step}: {m}")
    none_tokens, none_logits, *_ = run_greedy(model, "none", ids, num_new, num_layers=2, budget_tokens=4)
    for predictor in ("previous", "query", "cache"):
        tokens, logits, *_ = run_greedy(model, predictor, ids, num_new, num_layers=2, budget_tokens=4)
        assert tokens == none_tokens, predictor
        for got, want in zip(logits, none_logits):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
