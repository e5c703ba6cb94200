"""The ratios `benchmarks/bench_vllm.py table` prints: each row against the plain row run beside it
(a tagged repeat against the plain row of its tag), and the spread of repeated rows. No vLLM needed."""
from __future__ import annotations

import json

from benchmarks.bench_vllm import baseline, table


def row(mode: str, ms: float, tag: str = "", tokens: int = 5) -> dict:
    """A finished bench_vllm row: a prefill step, then `tokens - 1` decode steps of `ms` each."""
    return {"mode": mode, "tag": tag, "kv_reserved_bytes": 1 << 30, "prefill_s": 1.0, "decode_ms_per_token": ms,
            "prefix_ttft_first_s": float("nan"), "prefix_ttft_repeat_s": float("nan"), "far_wait_s": 0.0,
            "tokens": list(range(tokens)), "step_ms": [500.0] + [ms] * (tokens - 1)}


def test_a_tagged_row_is_compared_with_the_plain_row_of_its_tag(tmp_path, capsys):
    rows = [row("plain", 10.0), row("plain-r1", 20.0, "r1"), row("tierkv-sparse-graphs-r1", 25.0, "r1"),
            row("tierkv-sparse-graphs-r2", 12.5, "r2"), row("plain@compiled", 5.0),
            row("tierkv-sparse-graphs@compiled-r1", 10.0, "r1")]
    for r in rows:
        (tmp_path / f"bench-vllm-{r['mode'].replace('@', '_')}.json").write_text(json.dumps(r))
    by_mode = {r["mode"]: r for r in rows}
    assert baseline(by_mode, by_mode["tierkv-sparse-graphs-r1"])["mode"] == "plain-r1"   # its neighbour
    assert baseline(by_mode, by_mode["tierkv-sparse-graphs-r2"])["mode"] == "plain"      # no plain-r2
    assert baseline(by_mode, by_mode["tierkv-sparse-graphs@compiled-r1"])["mode"] == "plain@compiled"
    table(str(tmp_path))
    printed = capsys.readouterr().out
    assert "decode tokens/s x plain: 0.80 (means), 0.80 (median steps 25.0 / 20.0 ms)" in printed  # r1 vs plain-r1
    assert "decode tokens/s x plain: 0.80 (means), 0.80 (median steps 12.5 / 10.0 ms)" in printed  # r2 vs plain
    # against plain for both, r1 would read 0.40: the spread shows each against its own baseline
    assert "tierkv-sparse-graphs over 2 runs, decode tokens/s x plain: 0.80-0.80 by the means" in printed
    assert "@compiled over" not in printed  # one compiled run: no spread
