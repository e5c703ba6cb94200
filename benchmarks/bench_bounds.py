"""The sparse selection's key bound alone, on the GPU: which launch shape reads the summary tables fastest.

    python benchmarks/bench_bounds.py [--rows 1 10] [--blocks 2048] [--iters 200] [--out PATH]

Per row count, the bound of every row over its own layer table (the 8B shape: 8 KV heads of 128, 32
query heads, bf16 key max and min per block; `--blocks` far blocks per row, 2048 at 128k over 64-token
blocks), launched as the full decode graph does (`sparse_kernels.block_bounds_rows`), for each
blocks-per-program and warps-per-program pair; beside it the one-table kernel launched once per row
(what each row's graph ran before the rows kernel). Each shape's output is checked against the default
launch's. Reported: GPU microseconds per launch (CUDA events over `--iters` launches), the tables'
bytes over that time (GB/s) and the ratio to the default launch measured in the same run. In the
profiled 10-row step at b6ba330 the rows kernel took 216 us per layer, before its alignment hint.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import write_results  # noqa: E402

KV_HEADS, GROUP, DIM = 8, 4, 128
SHAPES = [(block, warps) for block in (16, 32, 64, 128) for warps in (None, 2, 8)]  # None: Triton's default (4)


def timed_us(launch, iters: int) -> float:
    """GPU microseconds per call of launch(), after three warm-up calls (the first compiles)."""
    import torch

    for _ in range(3):
        launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        launch()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def run(rows_list: list[int], blocks: int, iters: int) -> dict:
    import torch

    from tierkv.sparse.kernels import BLOCK_B, block_bounds, block_bounds_rows

    device = torch.device("cuda")
    results = {"kv_heads": KV_HEADS, "query_heads": KV_HEADS * GROUP, "head_dim": DIM, "blocks": blocks,
               "default_block": BLOCK_B, "rows": []}
    for m in rows_list:
        tables = [torch.randn(blocks, KV_HEADS, 2 * DIM, device=device, dtype=torch.bfloat16) for _ in range(m)]
        q = torch.randn(m, KV_HEADS * GROUP, DIM, device=device, dtype=torch.bfloat16)
        addresses = torch.tensor([t.data_ptr() for t in tables], dtype=torch.int64, device=device)
        limits = torch.full((m,), blocks, dtype=torch.int64, device=device)
        table_bytes = sum(t.numel() * t.element_size() for t in tables)
        want = torch.empty(m, blocks, device=device)
        block_bounds_rows(addresses, tables[0], q, limits, want)
        rows = []
        for block, warps in SHAPES:
            out = torch.empty(m, blocks, device=device)
            block_bounds_rows(addresses, tables[0], q, limits, out, block=block, num_warps=warps)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
            us = timed_us(lambda: block_bounds_rows(addresses, tables[0], q, limits, out, block=block,
                                                    num_warps=warps), iters)
            rows.append({"kernel": "rows", "block": block, "num_warps": warps or 4, "us": us,
                         "gbps": table_bytes / us / 1e3})
        per_row = torch.empty(m, blocks, device=device)
        limit = torch.tensor(blocks, device=device)

        def one_table_launches():
            for r in range(m):
                block_bounds(tables[r], q[r], 0, blocks, limit, out=per_row[r])

        one_table_launches()
        torch.testing.assert_close(per_row, want, rtol=1e-5, atol=1e-4)
        us = timed_us(one_table_launches, iters)
        rows.append({"kernel": f"one table x {m}", "block": BLOCK_B, "num_warps": 4, "us": us,
                     "gbps": table_bytes / us / 1e3})
        default = next(r["us"] for r in rows if r["kernel"] == "rows" and r["block"] == BLOCK_B and r["num_warps"] == 4)
        for r in rows:
            r["x_default"] = default / r["us"]  # above 1: faster than the default launch
        results["rows"].append({"rows": m, "table_bytes": table_bytes, "shapes": rows})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--blocks", type=int, default=2048, help="far blocks per row (2048: 128k over 64-token blocks)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default=None, help="JSON results path")
    args = parser.parse_args()
    if any(m < 1 for m in args.rows) or args.blocks < 1 or args.iters < 1:
        parser.error(f"--rows {args.rows}, --blocks {args.blocks}, --iters {args.iters}: all must be positive")
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: this measures the Triton kernels compiled for it")
    results = run(args.rows, args.blocks, args.iters)
    if args.out:
        write_results(args.out, results)
    print(f"{'rows':>4} {'kernel':>14} {'block':>5} {'warps':>5} {'us':>8} {'GB/s':>7} {'x default':>9}")
    for entry in results["rows"]:
        for r in entry["shapes"]:
            print(f"{entry['rows']:>4} {r['kernel']:>14} {r['block']:>5} {r['num_warps']:>5} {r['us']:>8.1f} "
                  f"{r['gbps']:>7.0f} {r['x_default']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
