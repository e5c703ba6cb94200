"""Sparse retrieval in the vLLM backend's far path (`tierkv.integrations.vllm.far_rows.FarKV`, what
TieredLLM(backend="vllm") and the benchmarks run): planted needles in a 128k request are found.

Fresh random draws every run. One layer of random KV in vLLM's paged layout, every full block saved
to the CPU tier and summarized as the connector does, and a few far blocks whose keys align with the
decode query. The far part with a 2048-token budget, merged with the window part (the tokens after
the far blocks, and the new one), is compared with dense attention over all 128k tokens, and the
window alone (what a StreamingLLM-style cache keeps, without sinks) shows what is lost. A budget
that covers every far block equals dense attention. On CPU the far path runs its eager PyTorch
reference; `tests/gpu/test_planted_needle_gpu.py` runs the same case on CUDA, the CUDA graphs
included. No vLLM needed."""
from __future__ import annotations

import random

import torch

from tierkv.attention import merge_partials
from tierkv.attention import reference
from tierkv.blocks import BlockLayout
from tierkv.config import load_config
from tierkv.integrations.vllm.far_rows import FarKV
from tierkv.integrations.vllm.store import BlockSpan, VllmKVStore

CONTEXT = 128 * 1024
NAME = "model.layers.0.self_attn.attn"


def planted_case(heads: int, kv_heads: int, dim: int, block_tokens: int, context: int, num_needles: int = 8,
                 device="cpu"):
    """q [1, heads, dim], keys and values [context + 1, kv_heads, dim] (float32; the last token is the
    decode step's own), and the sorted far blocks (away from the first 4 and the last 12) in each of
    which one token's key aligns with the query of its KV group. The query heads of a group share a
    direction, as the needle keys of that group do."""
    group = heads // kv_heads
    base = torch.randn(kv_heads, 1, dim, device=device).expand(kv_heads, group, dim)
    q = (base + 0.3 * torch.randn(kv_heads, group, dim, device=device)).reshape(1, heads, dim)
    keys = torch.randn(context + 1, kv_heads, dim, device=device)
    values = torch.randn(context + 1, kv_heads, dim, device=device)
    far_blocks = torch.randperm(context // block_tokens - 16)[:num_needles] + 4
    direction = q[0].view(kv_heads, group, dim).mean(1)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    for b in far_blocks.tolist():
        token = b * block_tokens + int(torch.randint(0, block_tokens, ()))
        keys[token] = 6.0 * direction * dim**0.5 + 0.1 * torch.randn(kv_heads, dim, device=device)
    return q, keys, values, sorted(far_blocks.tolist())


def far_request(tmp_path, keys, values, block_tokens: int, budget_tokens: int, dtype, graphs: bool):
    """A FarKV over one layer whose request "r" holds the context's full blocks (saved to the CPU tier
    from a vLLM-layout cache, and summarized), as after its prefill."""
    kv_heads, dim = keys.shape[1], keys.shape[2]
    blocks = (keys.shape[0] - 1) // block_tokens
    device = keys.device
    block_bytes = 2 * kv_heads * block_tokens * dim * torch.empty(0, dtype=dtype).element_size()
    config = load_config({
        "cache": {"block_tokens": block_tokens, "window_tokens": 4 * block_tokens},
        "tiers": [{"kind": "cpu", "capacity_bytes": (blocks + 64) * block_bytes}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 8 * (budget_tokens // block_tokens) * block_bytes,
                      "policy": "sparse", "sparse_token_budget": budget_tokens, "sparse_cuda_graphs": graphs},
    }, env={})
    store = VllmKVStore(config, BlockLayout(kv_heads, block_tokens, dim, dtype), [NAME], "needles", device)
    full = blocks * block_tokens
    # vLLM's paged layout [blocks, kv_heads, block_tokens, 2 * dim]: K then V in the last axis
    cache = torch.cat([keys[:full], values[:full]], dim=-1).to(dtype).view(blocks, block_tokens, kv_heads, 2 * dim)
    cache = cache.transpose(1, 2).contiguous()
    store.register({NAME: cache})
    far = FarKV(store, 4 * block_tokens, max_model_len=full + 8 * block_tokens, max_rows=1)
    hashes = store.extend_hashes([], [random.randrange(1 << 16) for _ in range(full)], blocks)
    far.add_hashes("r", 0, hashes)
    spans = [BlockSpan("r", list(range(blocks)), hashes)]
    far.summarize(0, spans, store.save_layer(0, cache, spans))
    store.poll(wait=True)
    return store, far


def decode_step(far, q, keys, values, block_tokens: int):
    """One decode step of "r" (its token at position len(keys) - 1): the far part merged with the
    window part (the tokens after the far blocks, computed here as the engine's attention would),
    the window part alone, and the far blocks the selection reads. With graphs the far part replays
    them (captured at the first step)."""
    scale = q.shape[-1] ** -0.5
    context = keys.shape[0] - 1
    (row,) = far.begin_step([("r", context, 1)])
    first_near = row.num_far_blocks * block_tokens
    near = reference.contiguous_partial_attention(q.float(), keys[first_near:].float(), values[first_near:].float(),
                                                  scale=scale)
    req = far.requests["r"]
    selected = far.key_summaries.select(req, 0, q[0], row.num_far_blocks).tolist()
    if far.graphs is None:
        out = merge_partials([near, far.attend(0, q, scale)])[0]
    else:
        out = torch.full_like(near[0], float("nan"))
        buffer = far.near_out_buffer(0, 1, scale)
        near_out = near[0] if buffer is None else buffer.copy_(near[0])
        far.attend_into(out, 0, q, near_out, near[1], scale)
    far.end_step()
    return out, near[0], selected, row.num_far_blocks


def check_planted_needles(tmp_path, heads, kv_heads, dim, block_tokens, dtype, device, graphs=False, draws=3):
    """Over `draws` fresh cases: recall of the planted blocks at least 99%, the output within 1e-2 of
    dense attention over all tokens (the same dtype-rounded KV), the window alone off by more than 0.3.
    Returns the largest relative error."""
    recalled = planted = 0
    worst = 0.0
    for draw in range(draws):
        q, keys, values, needles = planted_case(heads, kv_heads, dim, block_tokens, CONTEXT, device=device)
        keys, values = keys.to(dtype).float(), values.to(dtype).float()  # what the tiers hold
        q = q.to(dtype).float()
        dense, _ = reference.contiguous_partial_attention(q, keys, values, scale=dim**-0.5)
        store, far = far_request(tmp_path / f"draw{draw}", keys, values, block_tokens, 2048, dtype, graphs)
        try:
            q_in = q.to(dtype)
            for _ in range(2 if graphs else 1):  # graphs: the first step captures, the second replays
                out, window_only, selected, num_far = decode_step(far, q_in, keys, values, block_tokens)
            if graphs:
                counts = far.stats()["cuda_graphs"]
                assert counts["graph_capture_errors"] == 0 and counts["graph_replays"] >= 1, counts
        finally:
            far.close()
            store.close()
        assert len(selected) == 2048 // block_tokens and max(needles) < num_far
        recalled += len(set(needles) & set(selected))
        planted += len(needles)
        error = ((out.float() - dense).norm() / dense.norm()).item()
        lost = ((window_only.float() - dense).norm() / dense.norm()).item()
        print(f"needles {needles} missed {sorted(set(needles) - set(selected))} error {error:.2e}, "
              f"window alone {lost:.2e}")
        assert error <= 1e-2, f"relative error {error:.2e} at a 2048-token budget of a 128k context"
        assert lost > 0.3, "without retrieval the needles are lost"
        worst = max(worst, error)
    assert recalled / planted >= 0.99, f"recall {recalled}/{planted}"
    return worst


def test_planted_needles_are_retrieved_by_the_far_path_and_match_dense(tmp_path):
    check_planted_needles(tmp_path, heads=8, kv_heads=2, dim=64, block_tokens=64, dtype=torch.float32, device="cpu")


def test_a_budget_covering_every_far_block_equals_dense_attention(tmp_path):
    """With the budget at the whole context the selection is every far block, and the merged output is
    dense attention over all tokens (to float rounding)."""
    block_tokens, context = 64, 16 * 1024
    q, keys, values, _ = planted_case(8, 2, 64, block_tokens, context)
    dense, _ = reference.contiguous_partial_attention(q, keys, values, scale=64**-0.5)
    store, far = far_request(tmp_path, keys, values, block_tokens, context, torch.float32, graphs=False)
    try:
        out, _, selected, num_far = decode_step(far, q, keys, values, block_tokens)
    finally:
        far.close()
        store.close()
    assert selected == list(range(num_far))
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)
