"""benchmarks/profile_prefix_host.py, small: a repeated prefix driven through vLLM's classes and
tierkv's connector on CPU touches exactly the blocks and keys the prefix implies, and every phase
of vLLM's calls shows in the profile."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI installs vLLM (.ci/run): a missing vLLM fails here, never skips
else:
    pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the hot-window tests")

from benchmarks.prefix_host_engine import Shape  # noqa: E402
from benchmarks.profile_prefix_host import expected_counts, profile  # noqa: E402

REPEAT_PHASES = {
    "scheduler: get_num_new_matched_tokens", "vLLM: allocate_slots", "scheduler: update_state_after_alloc",
    "scheduler: build_connector_meta", "IPC: metadata pickled and unpickled", "worker: start_load_kv",
    "worker: wait_for_layer_load", "backend: far part (attend_into)", "worker: save_kv_layer", "worker: wait_for_save",
    "scheduler: request_finished",
}


@pytest.mark.parametrize("tokens, block_tokens, window", [(4096, 64, 1024), (4000, 16, 1000)])
def test_a_repeated_prefix_touches_the_blocks_its_length_implies(tokens, block_tokens, window):
    layers = 4
    shape = Shape(layers=layers, block_tokens=block_tokens, kv_heads=1, head_dim=8, query_heads=2,
                  window_tokens=window, chunk_tokens=1024, staging_bytes_8b=(8 << 20) * block_tokens // 64)
    result = profile(shape, tokens, repeats=1)
    prefix_blocks = tokens // block_tokens
    far = (prefix_blocks * block_tokens - window + 1) // block_tokens  # what vLLM's sliding window frees
    assert result["expected"] == expected_counts(shape, tokens)
    assert result["expected"]["far_blocks"] == far > 0

    first = result["first"]
    assert first["matched_tokens"] == 0
    assert first["counts"]["blocks_saved"] == prefix_blocks * layers  # every full block of every layer saved
    for run in [*result["repeats"], result["profiled"]]:
        assert run["matched_tokens"] == prefix_blocks * block_tokens
        assert set(run["phases_s"]) == REPEAT_PHASES and all(s >= 0 for s in run["phases_s"].values())
        counts, meters = run["counts"], run["meters"]
        assert counts["blocks_saved"] == 0
        assert counts["lookup_hit_blocks"] == prefix_blocks
        assert counts["blocks_loaded"] == prefix_blocks - far  # the window's blocks, into vLLM's pool
        assert counts["blocks_pinned"] == far * layers
        assert counts["far_blocks_read"] == far * layers
        region = shape.staging_blocks // max(2, shape.lookahead_layers + 1)
        chunks = -(-far // region)
        ahead = min(3, chunks * layers) if tokens % block_tokens == 0 else 0  # one new token: a decode step
        assert (chunks, ahead) == (result["expected"]["chunks_per_layer"], result["expected"]["chunks_copied_for_next_step"])
        # the step before, if of one token too, copied its plan's first chunks ahead: the same blocks in the same
        # CPU slots, so this step uses them
        assert counts["chunks_adopted"] in (0, ahead)
        assert counts["chunks_streamed"] == chunks * layers - counts["chunks_adopted"] + ahead
        # the lookup: one probe per block in the CPU tier, which holds every layer of the prefix; no key by key
        assert meters["CpuTier.held_prefix (hashes)"]["items"] == prefix_blocks
        assert "StorageChain.locate_many (keys)" not in meters
        assert meters["FarPins.pin (blocks per layer)"]["items"] == far
        # the far blocks are pinned whole, one count per block for every layer, not key by key
        assert meters["CpuTier.acquire_blocks (blocks pinned whole)"]["items"] == far
        # key by key only the window's blocks, loaded into vLLM's pool
        assert meters["StorageChain.acquire_many (keys pinned)"]["items"] == (prefix_blocks - far) * layers
        assert meters["FarKV.add_hashes (hashes)"]["items"] == prefix_blocks
        assert meters["far_attention.chunk_partial (maths; blocks)"]["items"] == far * layers
        copied = (far + prefix_blocks - far) * layers + region * (ahead - counts["chunks_adopted"])  # far, window, ahead
        assert meters["TransferEngine.gather_h2d (copy; blocks)"]["items"] == copied
        assert 0 < run["host_s"] <= run["wall_s"]
        assert 0 < run["first_far_copy_s"] < run["wall_s"]  # begin_step's copies, after the lookup and the pins
        assert len(run["metadata_bytes"]) == 1  # one engine step: the prefix's last tokens
    # the profile covered the connector's hooks (by name: their rank in the top-30 listing moves with the load)
    assert result["profiled"]["cprofile"]["hooks_cumulative_s"]["start_load_kv"] > 0
    # the repeat's pins are given back at the next step, with the saves' pins of its blocks never far
    finish = result["last_finish"]["meters"]
    assert finish["FarKV.finish (requests)"]["items"] == 1
    assert finish["CpuTier.release_blocks (blocks unpinned)"]["items"] == far


@pytest.mark.parametrize("late", [0, 1, 4])
def test_saves_landing_after_their_step_leave_the_first_request_pinned_whole(late):
    """On a GPU a step's last layers' saves land after it: the blocks turning far at the next step are
    pinned whole once they land, not key by key (the next request then gave back every key's pin)."""
    shape = Shape(layers=4, block_tokens=16, kv_heads=1, head_dim=8, query_heads=2, window_tokens=1000,
                  chunk_tokens=1024, staging_bytes_8b=(8 << 20) * 16 // 64, late_save_layers=late)
    result = profile(shape, 4000, repeats=1)
    first = result["first"]["meters"]
    assert first["FarPins.pin (blocks per layer)"]["items"] > 0
    assert first.get("LayerSaves.take_pins (keys)", {"items": 0})["items"] == 0  # no far block pinned key by key
    finish = result["repeats"][0]["meters"]  # the first request's far blocks given back: one count per block
    assert finish["CpuTier.release_blocks (blocks unpinned)"]["items"] == first["FarPins.pin (blocks per layer)"]["items"]


def test_the_script_writes_json_and_prints_the_phase_table(tmp_path):
    out = tmp_path / "prefix.json"
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "benchmarks/profile_prefix_host.py", "--tokens", "2048", "--layers", "2", "--kv-heads", "1",
         "--head-dim", "8", "--window-tokens", "512", "--chunk-tokens", "1024", "--repeats", "1", "--out", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["results"]["repeats"][0]["counts"]["blocks_pinned"] == record["results"]["expected"]["pinned_keys"]
    assert "worker: start_load_kv" in done.stdout and "cProfile" in done.stdout
    bad = subprocess.run([sys.executable, "benchmarks/profile_prefix_host.py", "--tokens", "512", "--window-tokens", "512"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--window-tokens 512" in bad.stderr
    huge = subprocess.run([sys.executable, "benchmarks/profile_prefix_host.py", "--head-dim", "1000000"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert huge.returncode != 0 and "lower --kv-heads or --head-dim" in huge.stderr
