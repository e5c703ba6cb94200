"""A real, small TieredLLM workload on the CPU, recorded to JSONL; shared by the metrics, CLI and
dashboard tests.

Three requests, A then B then A again, with a CPU tier that holds about one request: B's blocks
push A's into the disk tier, so the third request reuses A's prefix partly from disk.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.models import build
from tierkv.config import load_config
from tierkv.llm import TieredLLM
from tierkv.sampling import SamplingParams

BLOCK_TOKENS = 4
BLOCK_BYTES = 2 * 2 * BLOCK_TOKENS * 16 * 4  # K+V, 2 kv heads, 4 tokens, head_dim 16, fp32
NUM_LAYERS = 2
PROMPT_TOKENS = 203
NEW_TOKENS = 4


def make_config(tmp_path: Path, *, cpu_blocks: int = 120, jsonl_path: Path | None = None,
                prometheus_port: int | None = None, snapshot_interval_s: float = 3600.0,
                control_token: str | None = None):
    return load_config({
        "model": {"name": "metrics-test-llama"},
        "cache": {"block_tokens": BLOCK_TOKENS, "gpu_budget_bytes": NUM_LAYERS * 6 * BLOCK_BYTES,
                  "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": cpu_blocks * BLOCK_BYTES},
                  {"kind": "disk", "path": str(tmp_path / "disk"), "capacity_bytes": "64MiB", "trusted": True}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64,
                      "cpu_far_reads": "staged"},  # the staging path a GPU takes, counted
        "metrics": {"jsonl_path": None if jsonl_path is None else str(jsonl_path),
                    "prometheus_port": prometheus_port, "snapshot_interval_s": snapshot_interval_s,
                    "control_enabled": control_token is not None, "control_token": control_token},
    }, env={})


def make_llm(tmp_path: Path, **config_kwargs) -> TieredLLM:
    model, _ = build("llama", num_heads=8, num_kv_heads=2, num_layers=NUM_LAYERS, seed=0)
    return TieredLLM(model, make_config(tmp_path, **config_kwargs), show_progress=False)


def run_workload(llm: TieredLLM) -> list:
    """A, B, A again; returns the three RequestOutputs."""
    gen = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, 512, (PROMPT_TOKENS,), generator=gen).tolist()
    prompt_b = torch.randint(0, 512, (PROMPT_TOKENS,), generator=gen).tolist()
    outputs = []
    for prompt in (prompt_a, prompt_b, prompt_a):
        outputs += llm.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS))
        llm.runtime.chain.flush()  # spills land before the next request: a deterministic split of tiers
    return outputs


def record_jsonl(tmp_path: Path, *, snapshot_interval_s: float = 3600.0) -> tuple[Path, list, dict]:
    """Run the workload with metrics.jsonl_path set; returns (path, outputs, final llm.stats())."""
    path = tmp_path / "metrics.jsonl"
    llm = make_llm(tmp_path, jsonl_path=path, snapshot_interval_s=snapshot_interval_s)
    with llm:
        outputs = run_workload(llm)
        stats = llm.stats()
    return path, outputs, stats


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
