"""`tierkv bench`: list the benchmark scripts (benchmarks/bench_*.py) or run one, or all.

    tierkv bench                         list them, with the question each answers
    tierkv bench exact --contexts 32768  run benchmarks/bench_exact.py with these arguments
    tierkv bench all                     run every one in turn, with no arguments
    tierkv bench exact --report out.html ...   also record metrics and write the dashboard

The exit code is the script's (the first failing one's for `all`). --report sets
TIERKV_METRICS__JSONL_PATH for the script, so a TieredLLM built from a config read with the
environment records snapshots; a script that records nothing gets no report (exit 1).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def default_dir() -> Path:
    """benchmarks/ of this checkout, else of the current directory."""
    checkout = Path(__file__).resolve().parents[2] / "benchmarks"
    return checkout if checkout.is_dir() else Path.cwd() / "benchmarks"


def add_parser(commands) -> None:
    p = commands.add_parser("bench", help="list or run the benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, help="folder of bench_*.py scripts (default: the checkout's benchmarks/)")
    p.add_argument("--report", metavar="HTML", help="record metrics and write the dashboard of the run as HTML")
    p.add_argument("name", nargs="?", help="a benchmark (exact, bench_exact, bench_exact.py) or 'all'")
    p.add_argument("args", nargs="...", help="arguments passed to the script")
    p.set_defaults(handler=run_bench)


def find_benchmarks(folder: Path) -> dict[str, Path]:
    return {path.stem[len("bench_"):]: path for path in sorted(folder.glob("bench_*.py"))}


def describe(path: Path) -> str:
    """First line of the script's docstring, read without running it."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, OSError, ValueError):
        doc = None
    return doc.strip().splitlines()[0] if doc else ""


def run_bench(args) -> int:
    from tierkv.cli.errors import UsageError

    folder = args.dir or default_dir()
    if not folder.is_dir():
        raise UsageError(f"no benchmarks folder at {folder}: run from a checkout or pass --dir")
    found = find_benchmarks(folder)
    if not found:
        raise UsageError(f"no benchmarks in {folder}: expected scripts named bench_*.py there")
    if args.name is None:
        for name, path in found.items():
            print(f"{name:<12} {describe(path)}")
        return 0
    name = args.name.removesuffix(".py").removeprefix("bench_")
    if name != "all" and name not in found:
        raise UsageError(f"no benchmark {args.name!r} in {folder}; available: {', '.join(found) or 'none'}, all")
    if name == "all" and args.args:
        raise UsageError("'all' runs every benchmark with its defaults; pass arguments to one benchmark at a time")
    targets = list(found.values()) if name == "all" else [found[name]]
    env = dict(os.environ)
    jsonl = None
    if args.report:
        jsonl = Path(tempfile.mkdtemp(prefix="tierkv-bench-")) / "metrics.jsonl"
        env["TIERKV_METRICS__JSONL_PATH"] = str(jsonl)
    code = 0
    for path in targets:
        print(f"tierkv bench: {path.name} {' '.join(args.args)}".rstrip(), file=sys.stderr, flush=True)
        result = subprocess.run([sys.executable, str(path), *args.args], cwd=folder.parent, env=env, check=False)
        code = code or result.returncode
    if args.report:
        code = code or _write_report(jsonl, args.report)
    return code


def _write_report(jsonl: Path, out: str) -> int:
    from tierkv.dashboard import write_report

    if not jsonl.is_file() or jsonl.stat().st_size == 0:
        print("tierkv bench: error: the benchmark recorded no metrics (it builds no TieredLLM from an environment-aware"
              " config), so there is no report", file=sys.stderr)
        return 1
    num_lines = write_report(jsonl, out)
    print(f"tierkv bench: report of {num_lines} snapshots written to {out} (data: {jsonl})", file=sys.stderr)
    return 0
