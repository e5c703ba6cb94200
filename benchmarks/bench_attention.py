"""Attention kernels against torch SDPA (flash) on the same shapes: where prefill and decode time goes.

    python benchmarks/bench_attention.py [--out PATH]

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, head_dim 128, bf16), block_tokens 64:
  prefill tile: 16k queries over their own 16k keys (causal) and over 16k earlier keys (paged);
  decode: one query over 32k and 128k keys (paged).
Prints ms per call and the ratio to SDPA over the same keys.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import write_results  # noqa: E402

H, HKV, D, T = 32, 8, 128, 64


def timed_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/attention-h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention.py needs CUDA", file=sys.stderr)
        return 2
    from tierkv.attention import contiguous_partial_attention, paged_partial_attention

    dev, dt = "cuda", torch.bfloat16
    rows = []
    n = 16384
    q = torch.randn(n, H, D, device=dev, dtype=dt)
    k = torch.randn(n, HKV, D, device=dev, dtype=dt)
    v = torch.randn(n, HKV, D, device=dev, dtype=dt)
    pos = torch.arange(n, device=dev) + n
    ours = timed_ms(lambda: contiguous_partial_attention(q, k, v, scale=D**-0.5, q_positions=pos, k_positions=pos))
    qs, ks, vs = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    sdpa = timed_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
    rows.append({"case": "prefill 16k causal (fresh)", "tierkv_ms": ours, "sdpa_ms": sdpa})

    num_blocks = n // T
    pool = torch.randn(num_blocks, 2, HKV, T, D, device=dev, dtype=dt)
    slots = torch.randperm(num_blocks, device=dev)
    starts = torch.arange(num_blocks, device=dev) * T
    ntok = torch.full((num_blocks,), T, device=dev)
    ours = timed_ms(lambda: paged_partial_attention(q, pool, slots, starts, ntok, scale=D**-0.5, q_positions=pos))
    sdpa = timed_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
    rows.append({"case": "prefill 16k over 16k earlier (paged)", "tierkv_ms": ours, "sdpa_ms": sdpa})

    for context in (32768, 131072):
        num_blocks = context // T
        pool = torch.randn(num_blocks, 2, HKV, T, D, device=dev, dtype=dt)
        slots = torch.randperm(num_blocks, device=dev)
        starts = torch.arange(num_blocks, device=dev) * T
        ntok = torch.full((num_blocks,), T, device=dev)
        q1 = torch.randn(1, H, D, device=dev, dtype=dt)
        ours = timed_ms(lambda: paged_partial_attention(q1, pool, slots, starts, ntok, scale=D**-0.5))
        kc = torch.randn(1, HKV, context, D, device=dev, dtype=dt)
        vc = torch.randn(1, HKV, context, D, device=dev, dtype=dt)
        sdpa = timed_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q1.transpose(0, 1)[None], kc, vc, enable_gqa=True))
        rows.append({"case": f"decode 1 query over {context // 1024}k (paged)", "tierkv_ms": ours, "sdpa_ms": sdpa})

    for row in rows:
        row["ratio"] = row["tierkv_ms"] / row["sdpa_ms"]
    write_results(args.out, rows)
    print(f"{'case':<40} {'tierkv ms':>10} {'sdpa ms':>10} {'ratio':>7}")
    for row in rows:
        print(f"{row['case']:<40} {row['tierkv_ms']:10.3f} {row['sdpa_ms']:10.3f} {row['ratio']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
