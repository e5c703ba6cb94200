"""The ratios `benchmarks/bench_vllm_batch.py table` prints: each row against the plain row run the
same way (compiled rows against plain@compiled), and the PCIe bounds of rows with far-block caches.
No vLLM needed."""
from __future__ import annotations

import json

from benchmarks.bench_vllm_batch import table


def row(mode: str, rate: float, requests: int = 3, **extra) -> dict:
    return {"mode": mode, "requests": requests, "gpu_kv_bytes": 60 << 30, "all_first_token_s": 30.0,
            "full_batch_steps": 200, "full_batch_tokens_per_s": rate, "new_tokens": 224, **extra}


def test_compiled_rows_are_compared_with_compiled_plain(tmp_path, capsys):
    cached = dict(pcie_bound_tokens_per_s=400.0, selected_bytes_per_step=1.34e9, h2d_ceiling_gbps=55.5,
                  pcie_bound_fetched_tokens_per_s=1100.0, fetched_fraction=0.36, gpu_hit_rate=0.82,
                  selection_overlap=0.75)
    rows = [row("plain", 150.0), row("plain@compiled", 175.0),
            row("tierkv-sparse-graphs@float8_e4m3fn", 300.0, 10, **cached),
            row("tierkv-sparse-graphs@float8_e4m3fn@compiled", 350.0, 10, **cached)]
    for r in rows:
        (tmp_path / f"bench-vllm-batch-{r['mode'].replace('@', '_')}.json").write_text(json.dumps(r))
    table(str(tmp_path))
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.split()}
    assert lines["tierkv-sparse-graphs@float8_e4m3fn"][-1] == "2.00"            # 300 / 150, eager against eager
    assert lines["tierkv-sparse-graphs@float8_e4m3fn@compiled"][-1] == "2.00"   # 350 / 175, not 350 / 150
    assert lines["plain@compiled"][-1] == "1.00"


def test_tagged_repeats_are_compared_with_the_plain_row_of_their_pair(tmp_path, capsys):
    """Rows of `benchmarks/run_gpu.py vllm-batch-ab` (MODE-rN, tag rN): each tierkv repeat against the plain
    row run next to it; the prefetch's precision and the slowest waits of wait_for_save are printed."""
    connector = {"hot_window": {"full_decode_graphs": {"prefetch_margin": 8, "prefetch_copied": 200,
                                                       "prefetch_used": 150, "prefetch_precision": 0.75,
                                                       "prefetch_recall": 0.6}},
                 "step_connector_ms": [[0.5, 0.0, 0.02]] * 30 + [[0.5, 0.0, 60.0]] * 2,
                 "save_step_ms": [[1.0, 2.0, 0.5, 0.1, 4.0], [1.2, 30.0, 0.7, 0.1, 33.0], [1.1, 20.0, 0.6, 0.2, 30.1]]}
    rows = [row("plain@compiled-r1", 170.0, tag="r1"), row("plain@compiled-r2", 180.0, tag="r2"),
            row("tierkv-sparse-full@compiled-r1", 510.0, 10, tag="r1", connector=connector),
            row("tierkv-sparse-full@compiled-r2", 540.0, 10, tag="r2")]
    for r in rows:
        (tmp_path / f"bench-vllm-batch-{r['mode'].replace('@', '_')}.json").write_text(json.dumps(r))
    table(str(tmp_path))
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert lines["tierkv-sparse-full@compiled-r1"][-1] == "3.00"   # 510 / 170, its own pair's plain
    assert lines["tierkv-sparse-full@compiled-r2"][-1] == "3.00"   # 540 / 180
    assert "150 of them read by a later selection (precision 0.75, recall 0.6)" in out
    assert "wait_for_save host ms: median 0.02, slowest sixteenth of the 32 recorded steps 60.0" in out
    assert ("the 3 steps that saved blocks, host ms (medians): reads 1.1, tier (quantization, slots, D2H) 20.0, "
            "key summaries 0.6, poll 0.1, the rest of wait_for_save 1.0") in out
