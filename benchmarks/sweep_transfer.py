#!/usr/bin/env python
"""Which copy_slots kernel shape and grid, or the copy engines, come closest to PCIe's ceiling? (needs CUDA)

For 16, 64 and 256 KiB blocks, 1 GiB moved per measurement between random scattered slots of a
pinned CPU slab and a GPU slot pool (bench_transfer.py's slab, pool and slots), both directions:

    kernel wW tT cC   TransferEngine backend "cupy", KernelShape(words_per_thread=W,
                      threads_per_cta=T), max_ctas=C; W in 4 8 16, T in 128 256 512,
                      C in 1, 2 and 4 times the SM count (1 x SMs is the engine's default)
    memcpy_batch      TransferEngine backend "memcpy_batch": cudaMemcpyBatchAsync, copy engines
    ceiling           one contiguous pinned copy of the same bytes, same block size and direction

Slot indices start on the CPU, as the scheduler's plan() produces them; a measurement includes
the engine's host-side enqueue, as in bench_transfer.py. A variant that fails (compile error,
missing symbol, CUDA error) is recorded with its error and the sweep goes on. After timing, each
variant's copy is checked byte for byte on a sample of blocks (first, last and random ones) whose
destination was cleared first. Timing: CUDA events on the copy stream, median of --reps. Variants
still to run once --budget-s has passed are recorded as skipped, so the run ends in time.

--contended repeats every measurement (ceiling included) while bf16 matmuls keep the SMs busy
on another stream, as a decode step's compute does: the copy kernel needs SMs, the copy engines
do not.

    python benchmarks/sweep_transfer.py --out benchmarks/results/sweep_transfer.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from _common import write_results  # noqa: E402
from bench_transfer import (  # noqa: E402
    KIB,
    MIB,
    allocate_slab_and_pool,
    as_blocks,
    ceiling_seconds,
    median_seconds,
    sample_matches,
    scattered_operands,
)

from tierkv.transfer import TransferEngine  # noqa: E402
from tierkv.transfer.kernels import THREADS_PER_CTA, WORDS_PER_THREAD, KernelShape  # noqa: E402

DIRECTIONS = ("h2d", "d2h")


@dataclass(frozen=True)
class Variant:
    """One way to run the copy: a kernel shape and grid bound, or the batched memcpy."""

    name: str
    backend: str  # "cupy" or "memcpy_batch"
    words_per_thread: int | None = None
    threads_per_cta: int | None = None
    max_ctas: int | None = None
    is_default: bool = False  # the engine's behaviour without arguments

    def make_engine(self) -> TransferEngine:
        if self.backend != "cupy":
            return TransferEngine("cuda", backend=self.backend)
        shape = KernelShape(self.words_per_thread, self.threads_per_cta)
        return TransferEngine("cuda", backend="cupy", max_ctas=self.max_ctas, kernel_shape=shape)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sweep_transfer.json"))
    parser.add_argument("--block-kib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes moved per measurement")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--words-per-thread", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument(
        "--cta-multiples", type=int, nargs="+", default=[1, 2, 4], help="max_ctas = multiple x SMs"
    )
    parser.add_argument("--no-memcpy-batch", action="store_true", help="leave out cudaMemcpyBatchAsync")
    parser.add_argument("--contended", action="store_true",
                        help="measure while matmuls on another stream keep the SMs busy (ceiling too)")
    parser.add_argument("--num-checked", type=int, default=64, help="blocks compared per variant")
    parser.add_argument("--budget-s", type=float, default=160.0, help="skip variants after this")
    args = parser.parse_args(argv)
    for name in ("reps", "total_mib", "num_checked"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    return args


def build_variants(args: argparse.Namespace, num_sms: int) -> list[Variant]:
    """Every kernel (words, threads, max_ctas) combination, then the batched memcpy."""
    variants = []
    for words in args.words_per_thread:
        for threads in args.threads:
            for multiple in args.cta_multiples:
                max_ctas = multiple * num_sms
                is_default = (words, threads, multiple) == (WORDS_PER_THREAD, THREADS_PER_CTA, 1)
                name = f"kernel w{words} t{threads} c{max_ctas}" + (" (today)" if is_default else "")
                variants.append(Variant(name, "cupy", words, threads, max_ctas, is_default))
    if not args.no_memcpy_batch:
        variants.append(Variant("memcpy_batch", "memcpy_batch"))
    return variants


def checked_pairs(num_pairs: int, num_checked: int, seed: int) -> torch.Tensor:
    """int64 indices of the pairs compared: the first, the last and random others."""
    generator = torch.Generator().manual_seed(seed)
    random_pairs = torch.randperm(num_pairs, generator=generator)[: max(num_checked - 2, 0)]
    return torch.unique(torch.cat([torch.tensor([0, num_pairs - 1]), random_pairs]))


def copy_is_exact(run, src, src_slots, dst, dst_slots, picked: torch.Tensor) -> bool:
    """Clear the picked destination blocks, copy the whole batch once, compare the picked blocks."""
    dst[dst_slots[picked].to(dst.device)] = 0
    torch.cuda.synchronize()  # copy streams do not wait for the clearing on the current stream
    run(src, src_slots, dst, dst_slots).synchronize()
    return sample_matches(src, src_slots, dst, dst_slots, picked)


class Contention:
    """bf16 matmuls enqueued on a side stream for about `seconds`, started before a measurement."""

    def __init__(self, size: int = 8192) -> None:
        self.stream = torch.cuda.Stream()
        self.a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
        self.b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
        with torch.cuda.stream(self.stream):
            torch.mm(self.a, self.b)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        with torch.cuda.stream(self.stream):
            for _ in range(4):
                torch.mm(self.a, self.b)
        end.record(self.stream)
        end.synchronize()
        self.matmul_s = start.elapsed_time(end) / 4e3

    def start(self, seconds: float) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(max(1, int(seconds / self.matmul_s) + 1)):
                torch.mm(self.a, self.b)

    def finish(self) -> None:
        self.stream.synchronize()


class Sweep:
    """Runs variants one measurement at a time; engines are built once and reused."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.budget_s
        self._engines: dict[str, TransferEngine | Exception] = {}
        self.contention = Contention() if args.contended else None

    def engine(self, variant: Variant) -> TransferEngine:
        """The variant's engine; a construction error is kept and raised again on each use."""
        if variant.name not in self._engines:
            try:
                self._engines[variant.name] = variant.make_engine()
            except Exception as exc:  # recorded in every row of this variant
                self._engines[variant.name] = exc
        engine = self._engines[variant.name]
        if isinstance(engine, Exception):
            raise engine
        return engine

    def measure(self, variant: Variant, direction: str, operands, num_bytes: int, ceiling_s: float) -> dict:
        """One row: throughput, ratio to the ceiling and exactness of one variant, or its error."""
        row = {"variant": variant.name, "backend": variant.backend, "words_per_thread": variant.words_per_thread,
               "threads_per_cta": variant.threads_per_cta, "max_ctas": variant.max_ctas,
               "is_default": variant.is_default, "gb_s": None, "over_ceiling": None,
               "is_exact": None, "error": None}
        if time.monotonic() > self.deadline:
            row["error"] = f"skipped: the {self.args.budget_s:.0f} s budget was spent"
            return row
        try:
            engine = self.engine(variant)
            run = engine.gather_h2d if direction == "h2d" else engine.scatter_d2h
            if self.contention is not None:  # long enough to cover every rep at half the ceiling's speed
                self.contention.start(2 * ceiling_s * (self.args.reps + self.args.warmup) + 0.05)
            seconds = median_seconds(
                engine.stream(direction), lambda: run(*operands), self.args.reps, self.args.warmup
            )
            if self.contention is not None:
                self.contention.finish()
            picked = checked_pairs(operands[1].numel(), self.args.num_checked, seed=num_bytes)
            row["is_exact"] = copy_is_exact(run, *operands, picked)
            row["gb_s"] = num_bytes / seconds / 1e9
            row["over_ceiling"] = ceiling_s / seconds
        except Exception as exc:  # one failing variant must not end the sweep; recorded in the row
            row["error"] = f"{type(exc).__name__}: {exc}"
        return row


def best_variants(rows: list[dict]) -> dict[int, dict[str, str]]:
    """{block_kib: {direction: variant}}: the fastest exact variant without error."""
    best: dict[int, dict[str, dict]] = {}
    for row in rows:
        if row["error"] or not row["is_exact"]:
            continue
        current = best.setdefault(row["block_kib"], {}).get(row["direction"])
        if current is None or row["over_ceiling"] > current["over_ceiling"]:
            best[row["block_kib"]][row["direction"]] = row
    return {kib: {d: r["variant"] for d, r in by_direction.items()} for kib, by_direction in best.items()}


def print_table(rows: list[dict], ceilings: list[dict]) -> None:
    """Per block size: today's kernel, the best kernel per direction and memcpy_batch (* = best)."""
    best = best_variants(rows)
    by_key = {(r["block_kib"], r["direction"], r["variant"]): r for r in rows}
    print(f"{'block':>7}  {'variant':<28} {'h2d GB/s':>9} {'/ceil':>6}  {'d2h GB/s':>9} {'/ceil':>6}  exact")
    for block_kib in sorted({r["block_kib"] for r in rows}):
        ceiling = {c["direction"]: c["ceiling_gb_s"] for c in ceilings if c["block_kib"] == block_kib}
        print(f"{block_kib:>4} KiB  {'ceiling':<28} {ceiling.get('h2d', 0):>9.1f} {'':>6}  "
              f"{ceiling.get('d2h', 0):>9.1f}")
        names = [r["variant"] for r in rows if r["block_kib"] == block_kib and r["is_default"]]
        names += [best.get(block_kib, {}).get(d) for d in DIRECTIONS] + ["memcpy_batch"]
        for name in dict.fromkeys(n for n in names if n):
            cells, exact = [], []
            for direction in DIRECTIONS:
                row = by_key.get((block_kib, direction, name))
                if row is None or row["error"]:
                    cells.append(f"{'error' if row else '-':>9} {'':>6}")
                    continue
                mark = "*" if best.get(block_kib, {}).get(direction) == name else " "
                cells.append(f"{row['gb_s']:>9.1f} {row['over_ceiling']:>5.2f}{mark}")
                exact.append(row["is_exact"])
            is_exact = "yes" if exact and all(exact) else "NO" if exact else "-"
            print(f"{'':>7}  {name:<28} {cells[0]}  {cells[1]}  {is_exact}")


def summarize(args, num_sms, total_bytes, variants, ceilings, rows, started) -> dict:
    """The JSON record's results; is_complete is False for a run cut off between block sizes."""
    return {
        "num_sms": num_sms,
        "total_bytes": total_bytes,
        "reps": args.reps,
        "warmup": args.warmup,
        "contended": bool(getattr(args, "contended", False)),
        "variants": [asdict(v) for v in variants],
        "ceilings": ceilings,
        "rows": rows,
        "best": best_variants(rows),
        "is_complete": len(rows) == len(variants) * len(DIRECTIONS) * len(args.block_kib),
        "elapsed_s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_transfer.py needs CUDA: run it on the GPU machine.", file=sys.stderr)
        return 2
    started = time.monotonic()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = build_variants(args, num_sms)
    sweep = Sweep(args)
    total_bytes = args.total_mib * MIB
    slab, pool = allocate_slab_and_pool(total_bytes)
    rows: list[dict] = []
    ceilings: list[dict] = []
    for block_kib in args.block_kib:
        block_bytes = block_kib * KIB
        slab_blocks, pool_blocks = as_blocks(slab, block_bytes), as_blocks(pool, block_bytes)
        num_blocks = total_bytes // block_bytes
        num_bytes = num_blocks * block_bytes
        for direction in DIRECTIONS:
            seed = block_bytes + len(direction)  # the slots bench_transfer.py uses
            operands = scattered_operands(direction, slab_blocks, pool_blocks, num_blocks, seed)
            if sweep.contention is not None:
                sweep.contention.start(2 * (num_bytes / 50e9) * (args.reps + args.warmup) + 0.05)
            ceiling_s = ceiling_seconds(operands[0], operands[2], num_bytes, args.reps, args.warmup)
            if sweep.contention is not None:
                sweep.contention.finish()
            ceilings.append({"block_kib": block_kib, "direction": direction,
                             "ceiling_gb_s": num_bytes / ceiling_s / 1e9})
            for variant in variants:
                row = sweep.measure(variant, direction, operands, num_bytes, ceiling_s)
                rows.append({"block_kib": block_kib, "direction": direction, **row})
        results = summarize(args, num_sms, total_bytes, variants, ceilings, rows, started)
        write_results(args.out, results)  # after every block size: a cut-off run keeps its rows
    failed = sorted({r["variant"] for r in rows if r["error"]})
    inexact = sorted({r["variant"] for r in rows if r["is_exact"] is False})
    print(f"{len(variants)} variants, {args.total_mib} MiB per measurement, {num_sms} SMs, "
          f"{time.monotonic() - started:.0f} s; wrote {args.out}")
    for name in failed:
        first_error = next(r["error"] for r in rows if r["variant"] == name and r["error"])
        print(f"  failed: {name}: {first_error}")
    for name in inexact:
        print(f"  WRONG BYTES: {name}")
    print_table(rows, ceilings)
    return 1 if inexact else 0


if __name__ == "__main__":
    sys.exit(main())
