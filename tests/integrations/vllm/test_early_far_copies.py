"""A lone request's first far copies started when the scheduler builds its step (`far_early`): the worker's
step adopts every one of them (none discarded), pins nothing more, and attends exactly as without them; a step of
two requests, a decode step, or chunks carried already start nothing; a plan the worker lays out otherwise
discards them and still reads the right blocks. Driven through vLLM's KV cache manager and both connector roles
of one in-process engine on CPU (benchmarks/prefix_host_engine)."""
from __future__ import annotations

import os
import random

import pytest
import torch

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI installs vLLM (.ci/run): a missing vLLM fails here, never skips
else:
    pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the hot-window tests")

from benchmarks.prefix_host_engine import Phases, PrefixEngine, Shape  # noqa: E402
from tierkv.integrations.vllm.far_early import start_far_copies  # noqa: E402

SHAPE = Shape(layers=4, block_tokens=16, kv_heads=1, head_dim=8, query_heads=2, window_tokens=256,
              chunk_tokens=512, staging_bytes_8b=(8 << 20) // 4, dtype=torch.float32)


def repeat_outputs(tmp_path, early: bool, tokens: int = 1500, tail: int = 7):
    """(per-layer outputs of the repeat's step, the far path's counts, its streamer) with early copies on or off."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 1000) for _ in range(tokens)]
    tmp_path.mkdir(exist_ok=True)
    torch.manual_seed(0)  # vLLM's pool starts random: the KV the first request saves
    engine = PrefixEngine(SHAPE, tmp_path)
    engine.scheduler._scheduler.early_copies = early
    try:
        engine.run_request("first", prefix + [11], Phases())
        torch.manual_seed(5)
        matched = engine.run_request("repeat", prefix + list(range(20, 20 + tail)), Phases())
        far = engine.store.hot_window
        return [o.clone() for o in engine.outputs], dict(far.counts), far.streamer, matched
    finally:
        engine.close()


@pytest.mark.parametrize("tail", [1, 7, 40])
def test_early_copies_are_adopted_and_change_nothing(tmp_path, tail):
    plain, plain_counts, plain_streamer, matched = repeat_outputs(tmp_path / "a", early=False, tail=tail)
    early, counts, streamer, matched_early = repeat_outputs(tmp_path / "b", early=True, tail=tail)
    assert matched == matched_early > 0
    assert len(plain) == len(early) == SHAPE.layers
    for a, b in zip(plain, early):
        assert torch.equal(a, b)
    assert counts["early_chunks"] > 0 and plain_counts["early_chunks"] == 0
    assert counts["blocks_pinned"] == plain_counts["blocks_pinned"]  # the worker pinned nothing more
    assert streamer.num_chunks_discarded == 0
    assert streamer.num_chunks_carried - plain_streamer.num_chunks_carried == counts["early_chunks"]
    assert streamer.num_chunks_streamed == plain_streamer.num_chunks_streamed  # no chunk crossed twice


def test_nothing_starts_for_two_requests_a_decode_step_or_carried_chunks(tmp_path):
    engine = PrefixEngine(SHAPE, tmp_path)
    try:
        engine.run_request("first", [random.Random(1).randrange(3, 1000) for _ in range(1200)] + [11], Phases())
        far = engine.store.hot_window
        hashes = [("r", 0, far.requests["first"].hashes)] if "first" in far.requests else []
        two = {"r": (1100, 5), "s": (10, 5)}
        assert start_far_copies(far, two, hashes, [], ["r", "s"], {}) == 0
        assert start_far_copies(far, {"r": (1100, 1)}, hashes, [], [], {}) == 0  # a decoding row: not a prompt step
        assert start_far_copies(far, {"r": (1100, 5)}, hashes, [], ["r"], {"r": 3}) == 0  # a recompute's far floor
        assert far.counts["early_chunks"] == 0
    finally:
        engine.close()


@pytest.mark.parametrize("ghost_tokens, adopted", [(336, False), (1200, True)])
def test_copies_for_a_step_that_never_ran_are_adopted_or_discarded_and_read_right(tmp_path, ghost_tokens, adopted):
    """Early copies for a request that is then dropped unscheduled, before a repeat whose far part is longer: a
    chunk of other blocks (the dropped one's far part shorter than a staging region) is discarded, one of the same
    blocks from the same CPU slots serves the repeat; either way it attends as a fresh engine does."""
    rng = random.Random(2)
    prefix = [rng.randrange(3, 1000) for _ in range(1500)]
    torch.manual_seed(0)
    engine = PrefixEngine(SHAPE, tmp_path)
    engine.scheduler._scheduler.early_copies = True
    try:
        engine.run_request("first", prefix + [11], Phases())
        far = engine.store.hot_window
        streamer = far.streamer
        before = (streamer.num_chunks_carried, streamer.num_chunks_discarded, far.counts["early_chunks"])
        hashes = list(far.requests["first"].hashes[: ghost_tokens // SHAPE.block_tokens])
        copied = start_far_copies(far, {"ghost": (ghost_tokens, 4)}, [("ghost", 0, hashes)], [], ["ghost"], {})
        assert copied > 0 and streamer.has_carried
        far.finish("ghost")
        torch.manual_seed(5)
        engine.run_request("repeat", prefix + [12], Phases())
        carried, discarded = streamer.num_chunks_carried - before[0], streamer.num_chunks_discarded - before[1]
        assert (carried, discarded) == ((copied, 0) if adopted else (0, copied))
        assert far.counts["early_chunks"] - before[2] == copied  # the repeat started none: chunks were carried
        outputs = [o.clone() for o in engine.outputs]
    finally:
        engine.close()
    (tmp_path / "fresh").mkdir()
    torch.manual_seed(0)
    fresh = PrefixEngine(SHAPE, tmp_path / "fresh")
    try:
        fresh.run_request("first", prefix + [11], Phases())
        torch.manual_seed(5)
        fresh.run_request("repeat", prefix + [12], Phases())
        assert len(outputs) == len(fresh.outputs) == SHAPE.layers
        for a, b in zip(outputs, fresh.outputs):
            assert torch.equal(a, b)
    finally:
        fresh.close()


def test_off_under_async_scheduling(tmp_path):
    """vLLM's async scheduling builds the next step while one runs: the scheduler side starts no copies then."""
    engine = PrefixEngine(SHAPE, tmp_path)  # vLLM resolves async scheduling on for this config
    try:
        assert engine.scheduler._vllm_config.scheduler_config.async_scheduling is True
        assert engine.scheduler._scheduler.early_copies is False
    finally:
        engine.close()
