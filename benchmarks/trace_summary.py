"""Where one profiled engine step's time went, from torch.profiler's chrome trace.

    python benchmarks/trace_summary.py TRACE.json[.gz]

Prints the step's span, the GPU's busy time (kernels and copies, overlaps counted once) and its
idle gaps, the host's CUDA runtime and driver calls by total time (a call that waits for the
GPU, such as a stream synchronize or a blocking copy, shows as a long one), the host ranges of
tierkv and vLLM attention per call, and, when the trace holds Python function events
(`with_stack`), the Python functions of tierkv and vLLM by inclusive time.
"""
from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
HOST_RANGES = ("vllm::unified_attention_with_output", "tierkv.far", "_vllm_fa3_C::fwd", "cudaGraphLaunch")


def _complete(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _busy(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Union length of [start, end) intervals and the gaps between them."""
    busy, gaps, end = 0.0, [], None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                gaps.append((end, a))
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy, gaps


def _table(rows: dict[str, list[float]], limit: int) -> list[str]:
    lines = [f"  {'name':<64} {'calls':>6} {'total ms':>9} {'mean us':>8} {'max us':>8}"]
    for name, durs in sorted(rows.items(), key=lambda kv: -sum(kv[1]))[:limit]:
        lines.append(f"  {name[:64]:<64} {len(durs):>6} {sum(durs) / 1e3:>9.2f} {sum(durs) / len(durs):>8.1f} "
                     f"{max(durs):>8.1f}")
    return lines


def _h2d_line(copies: list[dict], start: float, end: float) -> list[str]:
    """The copy engine's timeline of host-to-device copies: a step bound by PCIe takes the span of its
    copies plus what comes before the first and after the last, plus the engine's idle gaps between them."""
    if not copies:
        return []
    busy, gaps = _busy([(e["ts"], e["ts"] + e["dur"]) for e in copies])
    first, last = min(e["ts"] for e in copies), max(e["ts"] + e["dur"] for e in copies)
    lengths = sorted((b - a for a, b in gaps), reverse=True)
    where = sorted(((b - a, a - start) for a, b in gaps), reverse=True)[:5]
    return [f"host-to-device copies: {len(copies)}, busy {busy / 1e3:.2f} ms; before the first "
            f"{(first - start) / 1e3:.2f} ms, after the last {(end - last) / 1e3:.2f} ms; idle between them "
            f"{sum(lengths) / 1e3:.2f} ms in {len(lengths)} gaps (largest "
            + ", ".join(f"{g / 1e3:.2f} ms at {t / 1e3:.1f} ms" for g, t in where) + ")"]


def summarize(trace: dict, python_limit: int = 40) -> str:
    events = _complete(trace)
    if not events:
        return "trace: no events"
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS]
    busy, gaps = _busy(gpu)
    gaps = [b - a for a, b in gaps]
    out = [f"trace span {(end - start) / 1e3:.2f} ms; GPU busy {busy / 1e3:.2f} ms in {len(gpu)} kernels/copies; "
           f"GPU idle gaps: {sum(g for g in gaps if g >= 50) / 1e3:.2f} ms in {sum(g >= 50 for g in gaps)} gaps "
           f">= 50 us, {sum(g for g in gaps if g < 50) / 1e3:.2f} ms in shorter ones"]
    out += _h2d_line([e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")], start, end)
    runtime: dict[str, list[float]] = defaultdict(list)
    ranges: dict[str, list[float]] = defaultdict(list)
    python: dict[str, list[float]] = defaultdict(list)
    for e in events:
        cat, name = e.get("cat"), e.get("name", "")
        if cat in RUNTIME_CATS:
            runtime[name].append(e["dur"])
        elif cat in ("cpu_op", "user_annotation") and name in HOST_RANGES:
            ranges[name].append(e["dur"])
        elif cat == "python_function" and ("tierkv" in name or "vllm" in name):
            python[name].append(e["dur"])
    out.append("host CUDA runtime/driver calls:")
    out += _table(runtime, 15)
    out.append("host ranges:")
    out += _table(ranges, len(HOST_RANGES))
    if python:
        out.append("Python functions of tierkv and vLLM (inclusive):")
        out += _table(python, python_limit)
    return "\n".join(out)


def main(argv: list[str]) -> None:
    for path in argv:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            print(f"=== {path}\n{summarize(json.load(f))}")


if __name__ == "__main__":
    main(sys.argv[1:])
