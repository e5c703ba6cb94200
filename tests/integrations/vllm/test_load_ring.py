"""Under the hot window a step's prefix loads are staged in a ring of lookahead + 1 buffers of one window each,
made once: over many steps and layers (each buffer reused every lookahead + 1 layers) every loaded block lands in
vLLM's cache exactly as the tiers hold it, loads of more than a window per layer are staged apart (the ring's
bytes never grow), and a step whose forward raised before its layers ran leaves the next step's loads exact."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.blocks import BlockLayout
from tierkv.config import load_config
from tierkv.integrations.vllm.paged_layout import BlockSpan
from tierkv.integrations.vllm.store import VllmKVStore

BS, H, D, LAYERS, POOL = 4, 2, 3, 5, 40
WINDOW_TOKENS = 10  # 3 blocks of 4 tokens, so the ring holds 4 blocks per buffer
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LAYOUT = BlockLayout(H, BS, D, torch.float32)
HASHES = [f"{i:04x}cd" for i in range(24)]


def make_store(root, lookahead: int, device: str = "cpu") -> VllmKVStore:
    (root / "tierkv.yaml").write_text("\n".join([
        "cache:", f"  block_tokens: {BS}", f"  window_tokens: {WINDOW_TOKENS}",
        "tiers:", "  - kind: cpu", f"    capacity_bytes: {4 * len(HASHES) * LAYERS * LAYOUT.num_bytes}",
        "scheduler:", f"  lookahead_layers: {lookahead}", f"  staging_bytes: {64 * LAYOUT.num_bytes}",
        "metrics:", "  enabled: false"]) + "\n")
    store = VllmKVStore(load_config(str(root / "tierkv.yaml"), env={}), LAYOUT, NAMES, "m", device)
    store.register({n: torch.zeros(POOL, H, BS, 2 * D, device=device) for n in NAMES})
    return store


def block(h: str, layer: int) -> torch.Tensor:
    seed = int(h[:4], 16) * 31 + layer
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


def fill(store: VllmKVStore) -> None:
    for layer in range(LAYERS):
        keys = store.keys(HASHES, layer)
        store.chain.put_many(keys, [block(h, layer) for h in HASHES])


def run_step(store: VllmKVStore, spans: list[BlockSpan], raise_at: int | None = None, slow=None) -> None:
    """slow(): called before each layer's load is written out (on CUDA: the compute stream kept busy, so copies
    that did not wait for the write before them would overwrite a buffer still to be read)."""
    store.begin_loads(spans)
    for layer in range(LAYERS):
        if layer == raise_at:
            return  # the forward raised: the rest of this step's layers never run
        if slow is not None:
            slow()
        store.finish_layer_load(layer)


def assert_landed(store: VllmKVStore, spans: list[BlockSpan]) -> None:
    for layer in range(LAYERS):
        kv = store.kv_caches[layer]
        for span in spans:
            for block_id, h in zip(span.block_ids, span.hashes):
                got = store.paged.read(kv, torch.tensor([block_id], device=kv.device))[0].cpu()
                assert torch.equal(got, block(h, layer)), (layer, block_id, h)


steps_st = st.lists(st.tuples(
    st.lists(st.tuples(st.integers(0, len(HASHES) - 1), st.integers(1, 6)), min_size=1, max_size=3),  # (first, count) per request
    st.one_of(st.none(), st.integers(0, LAYERS - 1)),  # a layer whose forward raises
), min_size=1, max_size=6)


def check_ring(root, lookahead: int, steps, device: str = "cpu", slow=None) -> None:
    """Each step's requests (first block, count) loaded into a zeroed cache land exactly; the ring, once made,
    holds (lookahead + 1) windows and never grows."""
    store = make_store(root, lookahead, device)
    store.hot_window = SimpleNamespace(window_tokens=WINDOW_TOKENS, block_tokens=BS, stats=dict)
    fill(store)
    capacity = -(-WINDOW_TOKENS // BS) + 1
    made = 0
    for requests, raise_at in steps:
        spans, next_id = [], 0
        for r, (first, count) in enumerate(requests):
            hashes = HASHES[first : first + count]
            spans.append(BlockSpan(f"r{r}", list(range(next_id, next_id + len(hashes))), hashes))
            next_id += len(hashes)
        for kv in store.kv_caches:
            kv.zero_()
        run_step(store, spans, raise_at, slow)
        if raise_at is not None:
            run_step(store, spans, slow=slow)  # the step again, whole
        assert_landed(store, spans)
        if next_id <= capacity:
            made = (lookahead + 1) * capacity * LAYOUT.num_bytes
        assert store.loads.ring_bytes == made  # made at the first load of one window, staged apart beyond
        store.poll(wait=True)


@settings(max_examples=60, deadline=None)
@given(lookahead=st.integers(1, 3), steps=steps_st)
def test_loads_through_the_ring_land_exactly_and_the_ring_never_grows(tmp_path_factory, lookahead, steps):
    check_ring(tmp_path_factory.mktemp("ring"), lookahead, steps)


def test_without_a_hot_window_loads_are_staged_apart(tmp_path):
    store = make_store(tmp_path, 2)
    fill(store)
    spans = [BlockSpan("r", [0, 1], HASHES[:2])]
    run_step(store, spans)
    assert_landed(store, spans)
    assert store.loads.ring_bytes == 0


@pytest.mark.parametrize("count", [1, 4, 5])
def test_the_ring_holds_one_window_per_buffer(tmp_path, count):
    store = make_store(tmp_path, 2)
    store.hot_window = SimpleNamespace(window_tokens=WINDOW_TOKENS, block_tokens=BS, stats=dict)
    fill(store)
    spans = [BlockSpan("r", list(range(count)), HASHES[:count])]
    run_step(store, spans)
    assert_landed(store, spans)
    assert store.loads.ring_bytes == (3 * 4 * LAYOUT.num_bytes if count <= 4 else 0)
