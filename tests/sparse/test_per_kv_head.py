"""`scheduler.sparse_selection: per_kv_head`: each KV head reads its own k far blocks.

Selection (`select_far_blocks_per_kv_head`): each row is its KV head's top k by the max of its query
heads' scores, in block order, within the candidates; every candidate where k covers them.
Reads (`InPlaceFarReads.attend` with [Hkv, k] blocks): KV head h attends exactly its row's blocks and
the fresh tokens (float64 reference per head), plain and int8 tiers. Sequence: sparse decode steps
equal a per-head dense reference built from the block arithmetic. Refused where it is not built: a
staged runtime (the GPU's path) and vLLM's far path."""
from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.attention.cpu_far import InPlaceFarReads
from tierkv.blocks import BlockLayout
from tierkv.config import ConfigError, load_config
from tierkv.engine.runtime import KVRuntime
from tierkv.sparse import BlockSummaries, select_far_blocks_per_kv_head
from tierkv.storage.cpu import CpuTier


@settings(max_examples=50, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 3), blocks=st.integers(0, 12), start=st.integers(0, 3),
       k=st.integers(0, 14), weight=st.sampled_from([1.0, 0.5, 0.0]), seed=st.integers(0, 2**31))
def test_each_row_is_its_kv_heads_top_k(kv_heads, group, blocks, start, k, weight, seed):
    gen = torch.Generator().manual_seed(seed)
    dim = 8
    summaries = BlockSummaries(1, kv_heads, dim, torch.float32, torch.device("cpu"), bound_weight=weight)
    summaries.update(0, 0, torch.randn(start + blocks, 2, kv_heads, 4, dim, generator=gen))
    q = torch.randn(kv_heads * group, dim, generator=gen)
    candidates = range(start, start + blocks)
    got = select_far_blocks_per_kv_head(summaries, 0, q, candidates, k)
    width = blocks if k >= blocks else max(k, 0)
    assert got.shape == (kv_heads, width)
    scores = summaries.head_bounds(0, q, candidates).view(kv_heads, group, blocks).amax(1) if blocks else None
    for h in range(kv_heads):
        row = got[h].tolist()
        assert row == sorted(row) and len(set(row)) == width and set(row) <= set(candidates)
        if 0 < k < blocks:  # the k best of this head (ties aside: random data)
            best = set((torch.topk(scores[h], k).indices + start).tolist())
            assert set(row) == best


@pytest.mark.parametrize("quant_format", [None, "int8"])
def test_in_place_reads_give_each_kv_head_its_own_blocks(quant_format):
    gen = torch.Generator().manual_seed(3)
    layout = BlockLayout(2, 4, 8, torch.float32)
    tier = CpuTier("cpu", layout, 12 * layout.num_bytes, pin_memory=False, quant_format=quant_format)
    tier.write_slots(range(tier.num_slots), torch.randn(tier.num_slots, *layout.shape, generator=gen))
    reads = InPlaceFarReads(tier)
    layer_slots = torch.randperm(tier.num_slots, generator=gen)
    blocks = torch.tensor([[0, 3, 5], [1, 3, 9]])                          # KV head 0 and 1: their own blocks
    q = torch.randn(1, 6, 8, generator=gen)                                 # 3 query heads per KV head
    fresh = torch.randn(2, 3, 2, 8, generator=gen)                          # 3 fresh tokens
    out, lse = reads.attend(q, layer_slots, blocks, scale=0.3, fresh=fresh)
    stored = tier.read_slots(layer_slots.tolist())                         # [n, 2, Hkv, T, D] as the tier returns it
    for h in range(2):
        k = torch.cat([stored[blocks[h], 0, h].reshape(-1, 8), fresh[0, :, h]]).double()
        v = torch.cat([stored[blocks[h], 1, h].reshape(-1, 8), fresh[1, :, h]]).double()
        logits = q[0, 3 * h : 3 * h + 3].double() @ k.T * 0.3              # [3, m]
        torch.testing.assert_close(out[0, 3 * h : 3 * h + 3].double(), torch.softmax(logits, -1) @ v,
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[0, 3 * h : 3 * h + 3].double(), torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)
    assert reads.num_blocks_read == 3  # 2 KV heads x 3 slices: the bytes of 3 whole blocks


T, KV_HEADS, HEADS, DIM, LAYERS = 4, 2, 4, 8, 2
BLOCK_BYTES = 2 * KV_HEADS * T * DIM * 4


def runtime_for(cpu_far_reads: str = "direct", **scheduler) -> KVRuntime:
    config = load_config({
        "cache": {"block_tokens": T, "gpu_budget_bytes": 6 * LAYERS * BLOCK_BYTES, "sink_tokens": T,
                  "window_tokens": 2 * T},
        "tiers": [{"kind": "cpu", "capacity_bytes": 64 * LAYERS * BLOCK_BYTES}],
        "scheduler": {"policy": "sparse", "sparse_token_budget": 2 * T, "predictor": "none",
                      "sparse_selection": "per_kv_head", "cpu_far_reads": cpu_far_reads, **scheduler},
    }, env={})
    return KVRuntime(config, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32,
                     device="cpu", model_id="per-kv-head")


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_sparse_decode_reads_each_kv_heads_selection(weight):
    """Prompt of 24 blocks, decode steps: every layer's output equals attention over, per KV head, the
    front blocks, that head's top k far blocks (by the block score of the same summaries) and the rest."""
    gen = torch.Generator().manual_seed(5)
    n, steps = 24 * T, 6
    keys, values = torch.randn(LAYERS, n + steps, KV_HEADS, DIM, generator=gen), torch.randn(
        LAYERS, n + steps, KV_HEADS, DIM, generator=gen)
    queries = torch.randn(LAYERS, n + steps, HEADS, DIM, generator=gen)
    runtime = runtime_for(sparse_bound_weight=weight)
    P, W = runtime.residency.num_front_blocks, runtime.residency.num_window_blocks
    reference = BlockSummaries(LAYERS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), bound_weight=weight)
    try:
        seq = runtime.new_sequence()
        for layer in range(LAYERS):
            seq.append(layer, keys[layer, :n], values[layer, :n])
            seq.attend(layer, queries[layer, :n], DIM**-0.5)
        choices = 0
        for t in range(n, n + steps):
            for layer in range(LAYERS):
                seq.append(layer, keys[layer, t : t + 1], values[layer, t : t + 1])
                got = seq.attend(layer, queries[layer, t : t + 1], DIM**-0.5)[0]
                full = t // T  # full blocks before the step's block
                reference.update(layer, 0, keys[layer, : full * T].view(full, T, KV_HEADS, DIM).transpose(1, 2)
                                 .unsqueeze(1).expand(-1, 2, -1, -1, -1))
                far = range(P, max(P, min(full, t // T + 1 - W)))
                picked = select_far_blocks_per_kv_head(reference, layer, queries[layer, t], far, 2)
                choices += len(far) > 2
                for h in range(KV_HEADS):
                    dropped = set(far) - set(picked[h].tolist())
                    pos = torch.tensor([p for p in range(t + 1) if p // T not in dropped])
                    k = keys[layer, pos, h].double()
                    v = values[layer, pos, h].double()
                    qh = queries[layer, t, 2 * h : 2 * h + 2].double()
                    want = torch.softmax(qh @ k.T * DIM**-0.5, -1) @ v
                    torch.testing.assert_close(got[2 * h : 2 * h + 2].double(), want, rtol=1e-4, atol=1e-5)
        assert choices > 0
        seq.finish()
    finally:
        runtime.close()


def test_refused_where_far_blocks_are_copied():
    with pytest.raises(ConfigError, match="sparse_selection.*per_kv_head is built only where far blocks are read in place"):
        runtime_for("staged")


def test_refused_under_vllm():
    from tierkv.integrations.vllm.far_staging import split_staging

    config = load_config({"scheduler": {"policy": "sparse", "sparse_selection": "per_kv_head"}}, env={})
    store = types.SimpleNamespace(config=config, layout=BlockLayout(2, 16, 8, torch.bfloat16))
    with pytest.raises(ConfigError, match="under vLLM only 'per_layer' is built"):
        split_staging(store, max_rows=4)
