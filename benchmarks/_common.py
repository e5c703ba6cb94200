"""Shared helpers for benchmark scripts: one JSON record per run.

Primitives:
    write_results(path, results, *, command=None)   write {"command", "git_commit", "date",
                                                      "device", "results"} and return it
    git_commit(repo=REPO_ROOT)                       HEAD sha, "-dirty" when tracked files changed
    describe_device()                                GPU name with torch and CUDA versions, or cpu
    h2d_ceiling_gbps(), H2DProbe                     pinned host-to-device copy bandwidth, once or sampled
    CpuUse, host_probe_us()                          where the host CPU went during a run, and how fast it ran

Importing this module imports nothing heavy; torch is imported only where a GPU is measured
(describe_device, H2DProbe).
"""

from __future__ import annotations

import datetime
import os
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def git_commit(repo: Path = REPO_ROOT) -> str | None:
    """HEAD commit of `repo` ("<sha>-dirty" with uncommitted tracked changes).

    $BENCH_GIT_COMMIT, set by whoever sent a copy of the tree to the GPU machine, wins (the
    copy's .git can be older than its files); else the checkout's HEAD; else None.
    """
    if os.environ.get("BENCH_GIT_COMMIT"):  # the sender knows; a copied tree's .git may be stale
        return os.environ["BENCH_GIT_COMMIT"]
    if not (repo / ".git").exists():
        return None
    try:
        sha = _git(repo, "rev-parse", "HEAD")
        dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("BENCH_GIT_COMMIT")
    return f"{sha}-dirty" if dirty else sha


def describe_device() -> str:
    """E.g. "NVIDIA H200 (torch 2.11.0, CUDA 13.0)" or "cpu (torch 2.13.0, no CUDA)"."""
    try:
        import torch
    except ImportError:
        return "cpu (torch not installed)"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return f"{name} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"cpu (torch {torch.__version__}, no CUDA)"


def write_results(path: str | Path, results: Any, *, command: str | None = None) -> dict[str, Any]:
    """Write one benchmark record as JSON to `path` (parents created) and return it.

    `results` must be JSON-serializable; `command` defaults to the command line of this process.
    """
    record = {
        "command": command if command is not None else shlex.join(sys.orig_argv),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": describe_device(),
        "results": results,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # a run killed mid-write leaves the last whole file
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(path)
    return record


def _git(repo: Path, *args: str) -> str:
    completed = subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True, timeout=30
    )
    return completed.stdout.strip()


def h2d_ceiling_gbps(num_bytes: int = 1 << 30) -> float:
    """One contiguous pinned-host to device copy: the median GB/s of five, timed by CUDA events."""
    probe = H2DProbe(num_bytes)
    return sorted(probe.sample() for _ in range(5))[2]


class H2DProbe:
    """A small pinned-host to device copy timed by CUDA events, for sampling the H2D bandwidth while a
    benchmark runs (is the PCIe link or host memory contended?): `sample()` -> GB/s, one copy,
    synchronizing. Buffers allocated once."""

    def __init__(self, num_bytes: int = 32 << 20):
        import torch

        self.host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        self.dev.copy_(self.host, non_blocking=True)
        torch.cuda.synchronize()

    def sample(self) -> float:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.dev.copy_(self.host, non_blocking=True)
        end.record()
        end.synchronize()
        return self.host.numel() / (start.elapsed_time(end) / 1e3) / 1e9


class CpuUse:
    """Where the host's CPU time went between `start()` and `take()` (Linux /proc): per thread of this
    process by name, and the whole machine's busy cores, for reading slow host-bound steps (is another
    thread of ours, or another process, taking the CPU?). Empty on systems without /proc."""

    def __init__(self):
        self._threads: dict[str, float] = {}
        self._machine: tuple[float, float] | None = None
        self._wall = 0.0

    def start(self) -> None:
        self._probe_us = host_probe_us()
        self._threads, self._machine = _thread_cpu_s(), _machine_cpu_s()
        self._wall = time.monotonic()

    def take(self) -> dict:
        """{"wall_s", "threads": {name: CPU seconds}, busiest first, "machine_busy_cores",
        "host_probe_us": [at start, now] (`host_probe_us`), "cpu": the core this thread last ran on}
        since start()."""
        wall = time.monotonic() - self._wall
        now = _thread_cpu_s()
        threads = {name: round(s - self._threads.get(name, 0.0), 3) for name, s in now.items()}
        threads = dict(sorted(((n, s) for n, s in threads.items() if s > 0), key=lambda item: -item[1]))
        machine, busy = _machine_cpu_s(), None
        if machine is not None and self._machine is not None and wall > 0:
            busy = round((machine[0] - self._machine[0]) / wall, 2)
        return {"wall_s": round(wall, 3), "threads": threads, "machine_busy_cores": busy,
                "host_probe_us": [round(self._probe_us, 1), round(host_probe_us(), 1)], "cpu": _current_cpu()}


def host_probe_us(repeats: int = 5) -> float:
    """A fixed piece of Python work (20k loop iterations with a dict and a list), the median of
    `repeats` timings in us: the same machine gives the same figure, so a process whose host runs
    slow (a shared or throttled core) shows a larger one."""
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        table, items = {}, []
        for i in range(20_000):
            table[i & 255] = i
            items.append(table[i & 255] + 1)
        timings.append(time.perf_counter() - start)
    return 1e6 * sorted(timings)[repeats // 2]


def _current_cpu() -> int | None:
    """The core the calling thread last ran on (/proc/thread-self/stat field 39), None without /proc."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
    except OSError:
        return None
    return int(_stat_fields(stat)[36])


def _stat_fields(stat: str) -> list[str]:
    """A /proc .../stat line's fields after the command name (field 3 on): the name, in parentheses,
    may hold spaces."""
    return stat[stat.rindex(")") + 2 :].split()


def _clock_ticks() -> int:
    """The kernel's clock ticks per second, the unit of /proc CPU times."""
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by "name (thread id)": the
    Python thread's name where it has one, else the kernel's."""
    import threading

    ticks = _clock_ticks()
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    totals: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return totals
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        name = python_names.get(int(tid)) or stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = _stat_fields(stat)
        key = f"{name} ({tid})"
        totals[key] = totals.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return totals


def _machine_cpu_s() -> tuple[float, float] | None:
    """(busy, idle) CPU seconds of the whole machine since boot, summed over cores (/proc/stat)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    ticks = _clock_ticks()
    values = [int(v) for v in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values) - idle) / ticks, idle / ticks
