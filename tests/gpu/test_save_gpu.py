"""GPU: the save of a block-completing step (every layer at once, as the connector's wait_for_save
does after a full decode graph's replay) returns while the device still runs the work queued before
it, and what it saved is right once the device is done. In the engine that work is the step itself
(and, under async scheduling, the next one), so a save that waited for the device would cost the
host that much time. No vLLM needed (tierkv.integrations.vllm.store and far alone)."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from benchmarks.bench_save_step import build, one_save, sleep_cycles_per_ms  # noqa: E402
from tierkv.integrations.vllm.store import BlockSpan  # noqa: E402


@pytest.mark.parametrize("storage", ["auto", "float8_e4m3fn"])
def test_the_save_of_every_layer_returns_while_the_device_is_busy(tmp_path, storage):
    random.seed(3)
    requests, layers, saves = 4, 6, 3
    store, far, caches, names, hashes, blocks = build(requests, layers, saves, storage, torch.device("cuda"), tmp_path)
    busy = int(500 * sleep_cycles_per_ms())  # half a second of device work: far longer than the save's host calls

    def spans(i: int) -> list:
        return [BlockSpan(f"r{r}", [r * blocks + i], [hashes[r][i]]) for r in range(requests)]

    try:
        one_save(store, far, caches, names, spans(0), at_once=True)  # warm-up: first allocations, first kernels
        torch.cuda.synchronize()
        store.poll(wait=True)
        for i in (1, 2):
            torch.cuda._sleep(busy)
            torch.cuda.set_sync_debug_mode("error")
            try:
                one_save(store, far, caches, names, spans(i), at_once=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert not torch.cuda.current_stream().query(), (
                f"save {i}: the device had finished the work queued before the save when it returned; "
                "the save waited for the device")
            torch.cuda.synchronize()
            store.poll(wait=True)
        # what landed: every saved block of every layer in the CPU tier, equal to vLLM's pool (within the
        # format's rounding), and its key summary marked
        exact = storage == "auto"
        for layer, name in enumerate(names):
            for r in range(requests):
                got = store.cpu.get_many(store.keys(hashes[r][:3], layer))
                for i, block in enumerate(got):
                    assert block is not None, f"layer {layer}, request {r}, block {i}: not in the CPU tier"
                    want = caches[name][r * blocks + i].unflatten(-1, (2, -1)).permute(2, 0, 1, 3)  # [2, H, T, D]
                    torch.testing.assert_close(block.float(), want.float().cpu(), rtol=0 if exact else 0.07,
                                               atol=0 if exact else 0.02)
                assert far.requests[f"r{r}"].summaries.is_summarized[layer][:3].all()
    finally:
        far.close()
        store.close()
