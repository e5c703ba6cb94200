"""GPU: the transformers engine's decode step replayed from one CUDA graph (`tierkv.engine.decode_graph`).
Over three blocks' worth of decode steps (the block-completing ones eager), the replayed steps give the
plain eager step's tokens and logits and cache counts, for two architectures in float32, with and
without a prefetch margin; a replayed step asks the host to wait for the device nowhere (CUDA sync debug
mode "error" around each step that follows a replayed one). The CPU suite runs the same graphed forward
without the capture (tests/engine/test_decode_graph.py)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tests.integrations.hf.test_exact_hf import tiny_config  # noqa: E402
from tests.models import build  # noqa: E402
from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model  # noqa: E402
from tierkv.config import load_config  # noqa: E402
from tierkv.engine.decode_graph import DecodeStep  # noqa: E402

T, DIM, PROMPT, STEPS = 16, 64, 613, 48


def settings(margin: int) -> dict:
    config = tiny_config(T, 1, 256, num_layers=2, kv_heads=2, head_dim=DIM)
    config["scheduler"].update(policy="sparse", sparse_token_budget=4 * T, predictor="cache",
                               staging_bytes=64 * 2 * 2 * T * DIM * 4,
                               **({"sparse_cache_selections": 2, "sparse_prefetch_margin": margin} if margin else {}))
    return config


def prefilled(model, runtime, ids: list[int]):
    """A TieredCache of `ids` on CUDA, its forward kwargs and the prompt's last logits."""
    cache = TieredCache(runtime, ids)
    kwargs = forward_kwargs(model, cache)
    for pos in range(0, len(ids), 256):
        logits = model(torch.tensor([ids[pos : pos + 256]], device="cuda"), **kwargs).logits[0, -1]
    return cache, kwargs, logits


@torch.no_grad()
def replayed_greedy(model, runtime, ids: list[int], num_new: int):
    cache, _, logits = prefilled(model, runtime, ids)
    step = DecodeStep(model, cache)
    assert step.capture, "the decode graph needs CUDA and a copy-kernel transfer backend (cupy)"
    tokens, all_logits, previous_replayed = [], [logits], False
    for _ in range(num_new):
        token = int(torch.argmax(logits))
        tokens.append(token)
        cache.seq.token_ids.append(token)
        replays = runtime.decode_graph_counts["replays"]
        if previous_replayed and (cache.seq.seq_length + 1) % T:  # the same graph again: no host wait anywhere
            torch.cuda.set_sync_debug_mode("error")
        try:
            logits = step(token)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        previous_replayed = runtime.decode_graph_counts["replays"] > replays
        all_logits.append(logits)
    cache.finish()
    return tokens, all_logits


@pytest.mark.parametrize("arch,margin", [("llama", 0), ("qwen2", 0), ("llama", 4)])
def test_replayed_decode_steps_equal_the_eager_ones(arch, margin):
    model, _ = build(arch, num_heads=8, num_kv_heads=2, head_dim=DIM, seed=5)
    model = model.cuda()
    ids = torch.randint(0, 512, (PROMPT,)).tolist()
    results = {}
    for name in ("eager", "replayed"):
        runtime = runtime_for_model(model, load_config(settings(margin), env={}), model_id=f"graph-gpu-{arch}")
        try:
            greedy = eager_greedy if name == "eager" else replayed_greedy
            tokens, logits = greedy(model, runtime, ids, STEPS)
            results[name] = tokens, logits, runtime.stats()
        finally:
            runtime.close()
    (tokens, logits, stats), (r_tokens, r_logits, r_stats) = results["eager"], results["replayed"]
    counts = r_stats["decode_graph"]
    print(f"{arch} margin {margin}: {counts}")
    assert counts["capture_errors"] == 0 and counts["captures"] >= 1, counts
    assert counts["eager_steps"] == 3 and counts["replays"] == counts["graph_steps"] == STEPS - 3, counts
    assert r_tokens == tokens
    for got, want in zip(r_logits, logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for section, key in (("scheduler", "stalls"), ("scheduler", "far_cache_copied_bytes")):
        assert r_stats[section][key] == stats[section][key] > 0, (section, key)
    counted = ("precision", "recall", "prefetched_blocks", "used_blocks")  # not the streamer's timings
    assert [r_stats["prefetch"].get(key) for key in counted] == [stats["prefetch"].get(key) for key in counted]


@torch.no_grad()
def eager_greedy(model, runtime, ids: list[int], num_new: int):
    """tiered_greedy on CUDA: the plain step, model(...) each token."""
    cache, kwargs, logits = prefilled(model, runtime, ids)
    tokens, all_logits = [], [logits]
    for _ in range(num_new):
        token = int(torch.argmax(logits))
        tokens.append(token)
        cache.seq.token_ids.append(token)
        logits = model(torch.tensor([[token]], device="cuda"), **kwargs).logits[0, -1]
        all_logits.append(logits)
    cache.finish()
    return tokens, all_logits
