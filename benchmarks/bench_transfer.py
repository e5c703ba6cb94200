#!/usr/bin/env python
"""How close do batched scattered-block copies come to PCIe's ceiling? (needs CUDA)

For 16, 64 and 256 KiB blocks, about 1 GiB moved per measurement between random scattered
slots of a pinned CPU slab and a GPU slot pool, both directions, side by side in one run:

    engine      TransferEngine.gather_h2d / scatter_d2h: one kernel launch per batch
                (slot indices start on the CPU, as the scheduler's plan() produces them)
    per_block   one copy_ per block: what a Python loop of copies gets
    ceiling     one contiguous pinned copy of the same number of bytes

Target: engine >= 90% of ceiling at 64 KiB blocks, in both directions.
Timing: CUDA events on the stream doing the work, warm-up first, median of --reps.

    python benchmarks/bench_transfer.py --out benchmarks/results/transfer.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from _common import write_results  # noqa: E402

from tierkv.transfer import TransferEngine  # noqa: E402

TARGET_BLOCK_KIB = 64
TARGET_RATIO = 0.90
KIB, MIB = 1024, 1024 * 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_transfer.json"))
    parser.add_argument("--block-kib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes moved per measurement")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--per-block-reps", type=int, default=3, help="the slow baseline")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default=None, help="force a TransferEngine backend")
    parser.add_argument("--max-ctas", type=int, default=None, help="kernel grid bound")
    return parser.parse_args()


def median_seconds(
    stream: torch.cuda.Stream, enqueue: Callable[[], object], reps: int, warmup: int
) -> float:
    """Median time between events recorded on `stream` around `enqueue()` (work on `stream`)."""
    for _ in range(warmup):
        enqueue()
    stream.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        enqueue()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def per_block_copies(src, src_slots: list[int], dst, dst_slots: list[int]) -> None:
    for s, d in zip(src_slots, dst_slots):
        dst[d].copy_(src[s], non_blocking=True)


def allocate_slab_and_pool(total_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random uint8 [2 * total_bytes] pinned CPU slab and GPU pool, different contents.

    Twice the bytes moved, so the chosen slots are scattered over a larger slab and pool.
    """
    slab_bytes = 2 * total_bytes
    slab = torch.empty(slab_bytes, dtype=torch.uint8, pin_memory=True)
    pool = torch.randint(0, 256, (slab_bytes,), dtype=torch.uint8, device="cuda")
    slab.copy_(pool)
    pool.random_(0, 256)
    return slab, pool


def as_blocks(flat: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """bf16 [num_slots, block_bytes // 2] view of a flat uint8 slab or pool."""
    num_slots = flat.numel() // block_bytes
    return flat[: num_slots * block_bytes].view(torch.bfloat16).view(num_slots, block_bytes // 2)


def scattered_operands(direction: str, slab, pool, num_blocks: int, seed: int):
    """(src, src_slots, dst, dst_slots) of `num_blocks` random distinct slots, int64 CPU slots."""
    generator = torch.Generator().manual_seed(seed)
    cpu_slots = torch.randperm(slab.shape[0], generator=generator)[:num_blocks]
    gpu_slots = torch.randperm(pool.shape[0], generator=generator)[:num_blocks]
    if direction == "h2d":
        return slab, cpu_slots, pool, gpu_slots
    return pool, gpu_slots, slab, cpu_slots


def ceiling_seconds(src, dst, num_bytes: int, reps: int, warmup: int) -> float:
    """Median time of one contiguous copy of `num_bytes` from src to dst (on a side stream)."""
    side_stream = torch.cuda.Stream()
    src_flat, dst_flat = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    with torch.cuda.stream(side_stream):
        return median_seconds(
            side_stream,
            lambda: dst_flat[:num_bytes].copy_(src_flat[:num_bytes], non_blocking=True),
            reps,
            warmup,
        )


def measure_direction(engine, direction, slab, pool, block_bytes, num_blocks, args) -> dict:
    """One row: engine, per-block and ceiling throughput of one direction and block size."""
    seed = block_bytes + len(direction)
    src, src_slots, dst, dst_slots = scattered_operands(direction, slab, pool, num_blocks, seed)
    run_engine = engine.gather_h2d if direction == "h2d" else engine.scatter_d2h
    num_bytes = num_blocks * block_bytes
    copy_stream = engine.stream(direction)
    engine_s = median_seconds(
        copy_stream, lambda: run_engine(src, src_slots, dst, dst_slots), args.reps, args.warmup
    )
    check_sample(src, src_slots, dst, dst_slots)

    side_stream = torch.cuda.Stream()
    src_list, dst_list = src_slots.tolist(), dst_slots.tolist()
    with torch.cuda.stream(side_stream):
        per_block_s = median_seconds(
            side_stream,
            lambda: per_block_copies(src, src_list, dst, dst_list),
            args.per_block_reps,
            1,
        )
    ceiling_s = ceiling_seconds(src, dst, num_bytes, args.reps, args.warmup)
    row = {
        "block_kib": block_bytes // KIB,
        "direction": direction,
        "num_blocks": num_blocks,
        "num_bytes": num_bytes,
        "engine_gb_s": num_bytes / engine_s / 1e9,
        "per_block_gb_s": num_bytes / per_block_s / 1e9,
        "ceiling_gb_s": num_bytes / ceiling_s / 1e9,
    }
    row["engine_over_ceiling"] = row["engine_gb_s"] / row["ceiling_gb_s"]
    return row


def check_sample(src, src_slots, dst, dst_slots, num_checked: int = 64) -> None:
    """The engine's last copy moved the right bytes (a sample of blocks; host sync)."""
    if not sample_matches(src, src_slots, dst, dst_slots, torch.randperm(src_slots.numel())[:num_checked]):
        raise SystemExit("bench_transfer.py: the engine copied wrong bytes")


def sample_matches(src, src_slots, dst, dst_slots, picked: torch.Tensor) -> bool:
    """dst[dst_slots[picked]] equals src[src_slots[picked]] byte for byte (host sync)."""
    torch.cuda.synchronize()
    moved = dst[dst_slots[picked].to(dst.device)].cpu()
    expected = src[src_slots[picked].to(src.device)].cpu()
    return torch.equal(moved.view(torch.uint8), expected.view(torch.uint8))


def print_table(rows: list[dict]) -> None:
    print(f"{'block':>8} {'dir':>4} {'engine':>10} {'per_block':>10} {'ceiling':>10} "
          f"{'engine/ceiling':>15}")
    for r in rows:
        print(
            f"{r['block_kib']:>4} KiB {r['direction']:>4} {r['engine_gb_s']:>5.1f} GB/s"
            f" {r['per_block_gb_s']:>5.1f} GB/s {r['ceiling_gb_s']:>5.1f} GB/s"
            f" {r['engine_over_ceiling']:>15.2f}"
        )


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_transfer.py needs CUDA: run it on the GPU machine.", file=sys.stderr)
        return 2
    engine = TransferEngine("cuda", backend=args.backend, max_ctas=args.max_ctas)
    total_bytes = args.total_mib * MIB
    slab, pool = allocate_slab_and_pool(total_bytes)
    rows = []
    for block_kib in args.block_kib:
        block_bytes = block_kib * KIB
        slab_blocks, pool_blocks = as_blocks(slab, block_bytes), as_blocks(pool, block_bytes)
        num_blocks = total_bytes // block_bytes
        for direction in ("h2d", "d2h"):
            row = measure_direction(
                engine, direction, slab_blocks, pool_blocks, block_bytes, num_blocks, args
            )
            rows.append(row)
    print(f"TransferEngine backend={engine.backend} max_ctas={engine.max_ctas}, "
          f"{args.total_mib} MiB per measurement")
    print_table(rows)
    target_rows = [r for r in rows if r["block_kib"] == TARGET_BLOCK_KIB]
    met = {r["direction"]: r["engine_over_ceiling"] >= TARGET_RATIO for r in target_rows}
    for direction, ok in met.items():
        print(f"target engine >= {TARGET_RATIO:.0%} of ceiling at {TARGET_BLOCK_KIB} KiB, "
              f"{direction}: {'met' if ok else 'MISSED'}")
    results = {
        "backend": engine.backend,
        "backend_errors": engine.backend_errors,
        "max_ctas": engine.max_ctas,
        "total_bytes": total_bytes,
        "reps": args.reps,
        "rows": rows,
        "target": {"block_kib": TARGET_BLOCK_KIB, "min_engine_over_ceiling": TARGET_RATIO, "met": met},
    }
    write_results(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
