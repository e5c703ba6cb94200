"""The key bound of the sparse selection: per block and head, max over the block's keys of q . k is
at most the bound, and the two-matmul form equals the elementwise definition (tierkv.sparse)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.sparse.summaries import BlockSummaries

HEADS, KV_HEADS, DIM, T, BLOCKS = 8, 2, 32, 16, 40


def elementwise_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """sum_d max(q_d kmin_d, q_d kmax_d), max over heads: q [HEADS, DIM], kmin/kmax [m, KV_HEADS, DIM]."""
    group = HEADS // KV_HEADS
    qg = q.double().view(KV_HEADS, group, 1, DIM)
    lo, hi = kmin.double().transpose(0, 1).unsqueeze(1), kmax.double().transpose(0, 1).unsqueeze(1)  # [KV, 1, m, D]
    return torch.maximum(qg * lo, qg * hi).sum(-1).amax(dim=(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_covers_every_key_and_equals_the_elementwise_definition(dtype):
    summaries = BlockSummaries(2, KV_HEADS, DIM, dtype, torch.device("cpu"))
    blocks = torch.randn(BLOCKS, 2, KV_HEADS, T, DIM).to(dtype)
    summaries.update(1, 0, blocks[:25])
    summaries.update(1, 25, blocks[25:])
    q = torch.randn(HEADS, DIM)
    ids = torch.tensor([3, 0, 39, 17])
    by_range = summaries.upper_bounds(1, q, range(BLOCKS))
    torch.testing.assert_close(summaries.upper_bounds(1, q, ids), by_range[ids])
    want = elementwise_bound(q, summaries.kmin[1][:BLOCKS], summaries.kmax[1][:BLOCKS])
    torch.testing.assert_close(by_range.double(), want, rtol=1e-5, atol=1e-4)
    # every key's score, per block the best over heads (head h reads KV head h // group)
    keys = blocks[:, 0].double().repeat_interleave(HEADS // KV_HEADS, dim=1)      # [m, HEADS, T, D]
    best = torch.einsum("hd,mhtd->mht", q.double(), keys).amax(dim=(1, 2))
    assert (by_range.double() >= best - 1e-4).all()


def test_request_selection_with_gaps_reads_unsummarized_blocks_and_the_top_k():
    """Under vLLM's hot window: blocks without a summary (a prefix served by the tiers) are always
    attended, also past the end of the summary tables; the fast path (every far block summarized)
    picks the same top k as the general one."""
    from tierkv.sparse.request_summaries import RequestSummaries

    req = RequestSummaries(1, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    blocks = torch.randn(BLOCKS, 2, KV_HEADS, T, DIM)
    q = torch.randn(HEADS, DIM)
    req.update(0, 0, blocks[:10])
    req.update(0, 20, blocks[20:30])
    assert req.prefix[0] == 10
    scores = req.summaries.upper_bounds(0, q, range(BLOCKS))
    top_of = lambda ids, k: set(torch.tensor(ids)[torch.topk(scores[ids], k).indices].tolist())  # noqa: E731
    assert set(req.select(0, q, 10, 3).tolist()) == top_of(list(range(10)), 3)  # fast path
    num_far = 200  # past the tables' capacity (64 blocks)
    selected = req.select(0, q, num_far, 3).tolist()
    missing = set(range(10, 20)) | set(range(30, num_far))
    assert selected == sorted(selected) and len(selected) == 3 + len(missing)
    assert missing <= set(selected) and set(selected) - missing == top_of(list(range(10)) + list(range(20, 30)), 3)
    req.update(0, 10, blocks[10:20])  # the gap filled: the prefix runs on to the next gap
    assert req.prefix[0] == 30


def test_masked_selection_over_the_whole_table_equals_the_selection_of_the_far_blocks():
    """What a CUDA graph replays (the far count a device scalar, the bound over the whole table,
    blocks past the count masked, the top blocks of that row) selects what `select` selects over the
    far blocks alone."""
    from tierkv.sparse.summaries import top_blocks
    from tierkv.sparse.request_summaries import RequestSummaries

    req = RequestSummaries(1, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    req.update(0, 0, torch.randn(BLOCKS, 2, KV_HEADS, T, DIM))
    for num_far in (5, 23, BLOCKS):
        q = torch.randn(HEADS, DIM)
        scores = req.summaries.masked_bounds(0, q, torch.tensor(num_far)).unsqueeze(0)
        assert torch.equal(top_blocks(scores, 4)[0], req.select(0, q, num_far, 4))


def test_reset_summaries_vouch_for_no_block_until_summarized_again():
    """A request's summaries passed to another request (`RequestSummaries.reset`): the tables keep
    their memory and address, but no block counts as summarized until the new request's blocks are,
    so its unsummarized blocks are all read and its top k comes from its own summaries only."""
    from tierkv.sparse.request_summaries import RequestSummaries

    req = RequestSummaries(1, KV_HEADS, DIM, torch.float32, torch.device("cpu"), max_blocks=BLOCKS)
    req.update(0, 0, torch.randn(BLOCKS, 2, KV_HEADS, T, DIM))
    table = req.summaries.tables[0]
    assert req.prefix[0] == BLOCKS
    req.reset()
    assert req.prefix[0] == 0 and req.unsummarized(0, BLOCKS).tolist() == list(range(BLOCKS))
    assert req.summaries.tables[0] is table  # same memory: a CUDA graph reading it stays valid
    q = torch.randn(HEADS, DIM)
    new = torch.randn(10, 2, KV_HEADS, T, DIM)
    req.update(0, 0, new)  # the new request's first 10 blocks; 10..19 not summarized
    fresh = RequestSummaries(1, KV_HEADS, DIM, torch.float32, torch.device("cpu"), max_blocks=BLOCKS)
    fresh.update(0, 0, new)
    selected = req.select(0, q, 20, 3).tolist()
    assert selected == fresh.select(0, q, 20, 3).tolist()
    assert set(range(10, 20)) <= set(selected) and len(selected) == 13


def test_selection_overlap_counts_only_blocks_a_row_has():
    """SelectionOverlap: a sampled step's selected blocks that the step before selected too, over the
    selected blocks; a graphed row with fewer far blocks than its ids (-1: no block) counts only its
    blocks, so two rows of -1 do not overlap."""
    from tierkv.sparse.request_summaries import OVERLAP_EVERY, SelectionOverlap

    overlap = SelectionOverlap(torch.device("cpu"))
    previous: dict[int, torch.Tensor] = {}
    before = torch.tensor([[4, 7, 9, 12], [0, 1, -1, -1]])
    now = torch.tensor([[4, 8, 9, 13], [0, 2, -1, -1]])
    for row, num_far in ((0, None), (1, 2)):
        prev_row: dict[int, torch.Tensor] = {}
        overlap.note(OVERLAP_EVERY - 1, prev_row, 0, before, row, num_far)
        overlap.note(OVERLAP_EVERY, prev_row, 0, now, row, num_far)
        previous.update(prev_row)
    assert not previous  # each sampled step consumed its copy
    assert overlap.value() == (2 + 1) / (4 + 2)


def mixed_score(q: torch.Tensor, blocks: torch.Tensor, weight: float) -> torch.Tensor:
    """The selection score from its definition, per query head: w x (sum_d max(q_d kmin_d, q_d kmax_d))
    + (1 - w) x q . (kmax + kmin) / 2. q [H, D], blocks [m, 2, H_kv, T, D] -> float64 [H, m]."""
    group = q.shape[0] // blocks.shape[2]
    keys = blocks[:, 0].double().repeat_interleave(group, dim=1)                   # [m, H, T, D]
    kmax, kmin = keys.amax(dim=2), keys.amin(dim=2)                                 # [m, H, D]
    qd = q.double()[None]
    bound = torch.maximum(qd * kmax, qd * kmin).sum(-1)
    mid = (qd * (kmax + kmin) / 2).sum(-1)
    return (weight * bound + (1 - weight) * mid).T


@settings(max_examples=40, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 3), dim=st.integers(1, 24), blocks=st.integers(1, 9),
       weight=st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0)), seed=st.integers(0, 2**31))
def test_the_selection_score_is_its_definition_between_the_midpoint_and_the_bound(kv_heads, group, dim, blocks,
                                                                                  weight, seed):
    """Every bound weight, GQA grouping and head size: head_bounds is the mixed score of its definition,
    upper_bounds its max over heads; the score lies between the midpoint key's score and Quest's bound,
    and at weight 1 it bounds every key's score (the selection then never ranks below any key it holds)."""
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    summaries = BlockSummaries(1, kv_heads, dim, torch.float32, torch.device("cpu"), bound_weight=weight)
    data = torch.randn(blocks, 2, kv_heads, 4, dim, generator=gen)
    summaries.update(0, 0, data)
    q = torch.randn(heads, dim, generator=gen)
    per_head = summaries.head_bounds(0, q, range(blocks)).double()
    torch.testing.assert_close(per_head, mixed_score(q, data, weight), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(summaries.upper_bounds(0, q, range(blocks)).double(), per_head.amax(0))
    low, high = mixed_score(q, data, 0.0), mixed_score(q, data, 1.0)
    assert (per_head >= low - 1e-4).all() and (per_head <= high + 1e-4).all()
    if weight == 1.0:
        keys = data[:, 0].double().repeat_interleave(group, dim=1)                  # [m, H, T, D]
        assert (per_head.T[..., None] >= torch.einsum("hd,mhtd->mht", q.double(), keys) - 1e-4).all()


@pytest.mark.parametrize("bad", [-0.01, 1.5, float("nan"), float("inf")])
def test_a_bound_weight_outside_0_to_1_is_refused(bad):
    with pytest.raises(ValueError, match="sparse bound weight"):
        BlockSummaries(1, KV_HEADS, DIM, torch.float32, torch.device("cpu"), bound_weight=bad)
