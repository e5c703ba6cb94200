"""Requests arriving at random with shared prefixes, through vLLM's own Scheduler and tierkv's worker connector on
CPU, a CPU tier of 20 blocks (3 layers), windows of 6 tokens in 4-token blocks, lookahead 2; vLLM's pool randomized
every step (a stand-in forward). Each step, every block loaded into vLLM's pool equals the tiers' copy, and no
request's far block is missing from the tiers (a missing one stops the engine: "in no tier").

Seeds 1 and 6 stopped the engine before a request saved the blocks it computed that the tier already held (a hole
in a shared prefix the lookup stopped at): left unpinned, later saves evicted them before they turned far. Seeds 7,
8 and 9 pin more than the 20 blocks at once: saves find no slot, and the error names the CPU tier's capacity."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from tests.integrations.vllm.test_loaded_window_pins import Engine  # noqa: E402


def fuzz(root, seed: int) -> int:
    """Runs the seed's requests to the end; returns the loaded blocks checked against the tiers."""
    rng = random.Random(seed)
    engine = Engine(root, cpu_keys=60, layers=3, window=6, lookahead=2, pool=96)
    store, worker = engine.worker.store, engine.worker
    wait_for_layer_load, start_load_kv = worker.wait_for_layer_load, worker.start_load_kv
    checked = [0]

    def wait_and_check(name):
        wait_for_layer_load(name)
        layer = store.layer_index[name]
        for span in worker._get_connector_metadata().loads:
            held = store.chain.get_many(store.keys(span.hashes, layer), promote=False)
            for block_id, block in zip(span.block_ids, held):
                if block is None or block_id in store.loads.error_block_ids:
                    continue
                assert torch.equal(store.paged.read(engine.caches[name], torch.tensor([block_id]))[0], block)
                checked[0] += 1

    def randomized_start(forward_context, **kwargs):
        for cache in engine.caches.values():
            cache.copy_(torch.randn_like(cache))
        return start_load_kv(forward_context, **kwargs)

    worker.wait_for_layer_load, worker.start_load_kv = wait_and_check, randomized_start
    prefixes = [list(range(100 + 50 * i, 100 + 50 * i + rng.randint(4, 40))) for i in range(3)]
    for n in range(60):
        if rng.random() < 0.35:
            prompt = rng.choice(prefixes)[: rng.randint(1, 40)] + [rng.randint(900, 999) for _ in range(rng.randint(0, 10))]
            engine.add(f"r{n}", (prompt if len(prompt) >= 2 else prompt + [5, 6])[:80], rng.randint(1, 8))
        engine.step()
    engine.run_out(80)
    return checked[0]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5, 6, 10, 11])
def test_shared_prefixes_under_a_small_cpu_tier_keep_every_far_block(tmp_path, seed):
    assert fuzz(tmp_path, seed) > 0


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_a_cpu_tier_too_small_for_the_running_requests_is_named(tmp_path, seed):
    """Every CPU-tier slot pinned by the running requests' blocks: a save finds no slot and no tier below, the
    block is lost, and the step it turns far stops the engine with an error that says why and what to raise."""
    with pytest.raises(RuntimeError, match=r"saves were dropped since start.*raise tiers\[0\].capacity_bytes"):
        fuzz(tmp_path, seed)
