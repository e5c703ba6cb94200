"""benchmarks/bench_sealed_path.py on a toy model: every mode serves the prefix from the disk tier
through its sealer and gives the first engine's tokens (the benchmark's own exit code says so)."""
from __future__ import annotations

import json

from benchmarks.bench_sealed_path import MODES, main


def test_every_mode_serves_the_prefix_from_disk_with_the_same_tokens(tmp_path):
    out = tmp_path / "sealed.json"
    assert main(["--tiny", "--device", "cpu", "--context", "512", "--repeats", "1", "--new-tokens", "3",
                 "--disk-path", str(tmp_path), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["rows"]
    assert [r["mode"] for r in rows] == list(MODES)
    for row in rows:
        # 512 tokens in 64-token blocks: all but the last block come back, every one from disk, 2 layers each
        assert row["prefix_tokens"] == 448 and row["prefix_blocks_by_tier"] == {"disk": 14}
        assert row["tokens_identical"] and row["prefix_load_s"] > 0
    assert rows[0]["x_plain"] == 1.0
