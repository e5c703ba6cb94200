"""The GPU session: named steps, each a GPU test run or a benchmark, bounded in time, output under --out.

    python3 benchmarks/run_gpu.py --list
    python3 benchmarks/run_gpu.py tests exact                        # one device call, two steps
    python3 benchmarks/run_gpu.py remeasure                          # a group: the rows to check after a move
    python3 benchmarks/run_gpu.py sparse --sparse-predictor cache --extra "--cache-selections 2"
    python3 benchmarks/run_gpu.py vllm-model8b vllm-ab --repeats 2 --vllm-args "--compiled"

Every step writes its log under --out and prints the log's tail; the session ends with one line per step
(exit code, seconds). With more than 8 files under --out they are packed into one results.tar.gz (the
device returns few files; --no-pack keeps them). The vLLM steps need vLLM installed and the 8B-shaped
model of `vllm-model8b` (--model-dir).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

PY = sys.executable
GRAPH_TESTS = ["tests/gpu/test_far_graphs_gpu.py", "tests/gpu/test_decode_graph_gpu.py", "tests/integrations/vllm/test_far_cache.py",
               "tests/gpu/test_save_gpu.py", "tests/gpu/test_planted_needle_gpu.py", "tests/sparse/test_bounds_kernel.py",
               "tests/attention/test_triton.py::test_gpu_rows_of_ten_decoding_requests"]
NOISE = ("INFO", "WARNING", "(EngineCore", "DEBUG", "[rank")


class Session:
    def __init__(self, args: argparse.Namespace):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.pin = ["taskset", "-c", args.pin_cores] if args.pin_cores else []

    def run(self, cmd: list[str], log: str, timeout_s: int, tail: int = 15, keep: str | tuple[str, ...] | None = None,
            env: dict | None = None) -> int:
        """Run `cmd` (killed after timeout_s), its output to --out/log; print the last `tail` lines
        (only those starting with `keep` when given, vLLM's log noise left out)."""
        path = self.out / log
        with open(path, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        lines = [ln.rstrip("\n") for ln in open(path, errors="replace") if not ln.startswith(NOISE)]
        if keep is not None:
            lines = [ln[:300] for ln in lines if ln.startswith(keep)]
        print("\n".join(lines[-tail:]), flush=True)
        return rc

    def pytest(self, targets: list[str], log: str, timeout_s: int, *extra: str) -> int:
        return self.run([PY, "-m", "pytest", "-m", "gpu", *targets, "-q", "-p", "no:cacheprovider", "-rs", *extra],
                        log, timeout_s)

    def bench(self, script: str, *args: str, log: str, timeout_s: int, **kw) -> int:
        return self.run([*self.pin, PY, f"benchmarks/{script}", *args], log, timeout_s, **kw)


def _split(text: str) -> list[str]:
    return shlex.split(text or "")


# -- steps: each takes the session, returns an exit code ---------------------------------------------
def tests(s): return s.pytest(["tests"], "gpu-tests.log", 540)
def quant_tests(s): return s.pytest(["tests/gpu/test_quant_gpu.py"], "gpu-tests-quant.log", 200, "-s")
def graph_tests(s): return s.pytest(GRAPH_TESTS, "gpu-tests-graphs.log", 330)
def sparse_tests(s): return s.pytest(["tests/gpu/test_sparse_query_gpu.py"], "gpu-tests-sparse.log", 200, "-s")


def isolated_tests(s):
    """Each graph test in its own process with CUDA_LAUNCH_BLOCKING=1: a device fault names its test."""
    listing = subprocess.run([PY, "-m", "pytest", "-m", "gpu", *GRAPH_TESTS, "--collect-only", "-q", "-p", "no:cacheprovider"],
                             capture_output=True, text=True).stdout
    worst = 0
    for i, test_id in enumerate([ln for ln in listing.splitlines() if "::" in ln], 1):
        print(f"== {i} {test_id}")
        rc = s.run([PY, "-m", "pytest", test_id, "-q", "-p", "no:cacheprovider", "--tb=short", "-W", "ignore"],
                   f"isolated-{i}.log", 120, tail=25, env={"CUDA_LAUNCH_BLOCKING": "1"})
        worst = max(worst, rc)
    return worst


def quant(s): return s.bench("bench_quant.py", "--out", f"{s.out}/quant-h200.json", log="quant.log", timeout_s=240)
def bounds(s):
    return s.bench("bench_bounds.py", "--rows", "1", "10", "--out", f"{s.out}/bounds-h200.json", log="bounds.log",
                   timeout_s=120, tail=32)


def exact(s):
    return s.bench("bench_exact.py", "--contexts", "131072", "--new-tokens", "6", "--no-offloaded", "--prefill-chunks",
                   s.args.prefill_chunks, "--transfer-backends", *_split(s.args.transfer_backends),
                   "--out", f"{s.out}/exact-128k-h200.json", log="exact.log", timeout_s=300)


def sweep(s):
    return s.bench("sweep_transfer.py", *_split(s.args.extra), "--out", f"{s.out}/sweep-transfer-h200.json",
                   log="sweep-transfer.log", timeout_s=200)


def far_sparse(s):
    return s.bench("bench_far_sparse.py", "--far-tokens", "126976", "--layers", "4", "--rows", *_split(s.args.far_rows),
                   "--graphs", "--out", f"{s.out}/far-sparse-h200.json", log="far-sparse.log", timeout_s=200, tail=8)


def save_step(s):
    return s.bench("bench_save_step.py", "--storage-dtype", s.args.storage_dtype or "float8_e4m3fn", "--gpu-busy-ms", "200",
                   "--out", f"{s.out}/save-step-h200.json", log="save-step.log", timeout_s=120, tail=4)


def accuracy(s):
    """bench_accuracy.py on the real model (SmolLM2-135M GGUF) on cuda: exact, retrieval and real text,
    the grid of --accuracy-args, no new case after --accuracy-limit-s."""
    return s.bench("bench_accuracy.py", "--device", "cuda", "--time-limit-s", str(s.args.accuracy_limit_s),
                   *_split(s.args.accuracy_args), "--out", f"{s.out}/accuracy-h200.json", log="accuracy.log",
                   timeout_s=int(s.args.accuracy_limit_s) + 240, tail=60,
                   keep=("summary", "exact", "time limit", "Traceback", "Error"))


def sealed(s):
    return s.bench("bench_sealed_path.py", "--device", "cuda", "--layers", "8", "--context", "32768",
                   "--out", f"{s.out}/sealed-path-h200.json", log="sealed-path.log", timeout_s=240, tail=6)


def sparse(s):
    p = s.args.sparse_predictor
    return s.bench("bench_sparse.py", "--predictor", p, *_split(s.args.extra), "--out", f"{s.out}/sparse-{p}-h200.json",
                   log=f"sparse-{p}.log", timeout_s=240)


def sparse_runs(s):
    """bench_sparse.py once per --sparse-runs entry (predictor:cache selections:prefetch margin), bias-16 model."""
    worst = 0
    for entry in _split(s.args.sparse_runs):
        predictor, selections, margin = entry.split(":")
        extra = ["--cache-selections", selections, "--prefetch-margin", margin] if predictor == "cache" else []
        name = f"sparse-{predictor}-s{selections}-m{margin}"
        print(f"== {entry}")
        worst = max(worst, s.bench("bench_sparse.py", "--predictor", predictor, "--qk-bias-std", "16", *extra,
                                   *_split(s.args.extra), "--out", f"{s.out}/{name}-h200.json", log=f"{name}.log",
                                   timeout_s=200, tail=6))
    return worst


# -- vLLM steps -----------------------------------------------------------------------------------------
def vllm_model8b(s):
    return s.bench("bench_vllm.py", "model", s.args.model_dir, "--layers", str(s.args.model_layers), "--qk-bias-std", s.args.qk_bias_std,
                   log="model8b.log", timeout_s=200, tail=1)


def vllm_check(s):
    if not Path("/tmp/m").is_dir():
        s.bench("vllm_check.py", "model", "/tmp/m", log="check-model.log", timeout_s=200, tail=1)
    rc = max(s.bench("vllm_check.py", mode, "/tmp/m", f"{s.out}/vc", log=f"check-{mode}.log", timeout_s=200, tail=6)
             for mode in ("plain", "hotwindow"))
    return max(rc, s.bench("vllm_check.py", "compare", f"{s.out}/vc", "hotwindow", log="check-compare.log",
                           timeout_s=60, tail=12))


def vllm_row(mode: str):
    def step(s, tag: str | None = None, extra: tuple = ()):
        args = ["run", mode, s.args.model_dir, f"{s.out}/bv", *(["--tag", tag] if tag else []), *extra,
                *_split(s.args.vllm_args)]
        return s.bench("bench_vllm.py", *args, log=f"bench-{mode}{'-' + tag if tag else ''}.log", timeout_s=240, keep="{")
    step.__doc__ = f"bench_vllm.py run {mode} (--vllm-args adds flags)"
    return step


def vllm_tierkv_b64(s):
    """bench_vllm.py run tierkv --block-tokens 64: the exact hot window with 64-token blocks (a 100k prefix's keys
    and pins / 4; row tierkv@b64, --vllm-args adds flags, e.g. --vllm-args=--profile-prefix)."""
    return s.bench("bench_vllm.py", "run", "tierkv", s.args.model_dir, f"{s.out}/bv", "--block-tokens", "64",
                   *_split(s.args.vllm_args), log="bench-tierkv-b64.log", timeout_s=240, keep="{")


def vllm_accuracy_convert(s):
    """The SmolLM2 GGUF ($SMOLLM2_GGUF) -> a folder vLLM loads, under --vacc-dir (no vLLM needed)."""
    return s.bench("vllm_accuracy.py", "convert", os.environ.get("SMOLLM2_GGUF", ""), f"{s.args.vacc_dir}/model",
                   log="vacc-convert.log", timeout_s=200, tail=5)


def vllm_accuracy(s):
    """vllm_accuracy.py run plain and tierkv-exact on the converted folder, then its table (one device call:
    two engine starts, at most 400 s; --vacc-modes picks)."""
    rc = 0
    for mode in _split(s.args.vacc_modes):
        rc = max(rc, s.bench("vllm_accuracy.py", "run", mode, f"{s.args.vacc_dir}/model", str(s.out),
                             log=f"vacc-{mode}.log", timeout_s=170, tail=4))
    return max(rc, s.bench("vllm_accuracy.py", "table", str(s.out), log="vacc-table.log", timeout_s=60, tail=40))


def vllm_accuracy_sparse(s):
    """vllm_accuracy.py run tierkv-sparse once per length with 1/4 of it as its budget (16-token blocks; rows
    tierkv-sparse-q2048, ...), then the table (its own device call: four engine starts, at most 620 s; the
    table compares with plain when vllm-accuracy wrote to the same --out; --vacc-contexts picks lengths)."""
    rc, block = 0, 16
    for context in (int(c) for c in _split(s.args.vacc_contexts)):
        budget = context // 4 // block * block
        rc = max(rc, s.bench("vllm_accuracy.py", "run", "tierkv-sparse", f"{s.args.vacc_dir}/model", str(s.out),
                             "--contexts", str(context), "--sparse-token-budget", str(budget),
                             "--sparse-block-tokens", str(block), "--tag", f"q{context}",
                             log=f"vacc-tierkv-sparse-q{context}.log", timeout_s=140, tail=4))
    return max(rc, s.bench("vllm_accuracy.py", "table", str(s.out), log="vacc-table.log", timeout_s=60, tail=40))


def vllm_table(s): return s.bench("bench_vllm.py", "table", f"{s.out}/bv", log="vllm-table.log", timeout_s=60, tail=60)


def vllm_ab(s):
    """plain and --sparse-mode rows alternating, --repeats pairs (rows -r1, -r2, ...), then the table."""
    for r in range(1, s.args.repeats + 1):
        vllm_row("plain")(s, f"r{r}")
        vllm_row(s.args.sparse_mode)(s, f"r{r}", ("--storage-dtype", s.args.storage_dtype or "auto",
                                                   *_split(s.args.sparse_vllm_args)))
    return vllm_table(s)


def vllm_compiled_quant(s):
    """plain --compiled, then the sparse graphs --compiled over int8 and fp8 CPU tiers, --repeats runs each."""
    vllm_row("plain")(s, None, ("--compiled",))
    for dtype in ("int8", "float8_e4m3fn"):
        for r in range(1, s.args.repeats + 1):
            vllm_row("tierkv-sparse-graphs")(s, f"r{r}", ("--compiled", "--storage-dtype", dtype))
    return vllm_table(s)


def vllm_sparse_check(s):
    """The whole step graphs against the split path, numerically (64 layer calls, 8 decode tokens)."""
    s.run([PY, "benchmarks/bench_vllm.py", "run", "tierkv-sparse-graphs", s.args.model_dir, f"{s.out}/check",
           "--context", "130880", "--decode-tokens", "8", "--no-prefix"], "check-whole.log", 150,
          env={"CHECK_WHOLE_GRAPHS": "64"})
    return s.bench("bench_vllm.py", "table", f"{s.out}/check", log="check-table.log", timeout_s=60, tail=20)


def batch_row(mode: str, *fixed: str):
    def step(s, tag: str | None = None, extra: tuple = ()):
        args = ["run", mode, s.args.model_dir, f"{s.out}/bb", *fixed, *(["--tag", tag] if tag else []), *extra,
                *_split(s.args.batch_args)]
        return s.bench("bench_vllm_batch.py", *args, log=f"batch-{mode}{'-' + tag if tag else ''}.log", timeout_s=500, keep="{")
    step.__doc__ = f"bench_vllm_batch.py run {mode} {' '.join(fixed)} (--batch-args adds flags)"
    return step


def vllm_batch_table(s): return s.bench("bench_vllm_batch.py", "table", f"{s.out}/bb", log="batch-table.log", timeout_s=60, tail=40)


def vllm_batch_ab(s):
    """--repeats pairs: plain --compiled, then --batch-mode over an fp8 CPU tier (10 requests; --batch-args,
    default --compiled), each against the plain row of its pair; then the table."""
    return _batch_pairs(s, s.args.batch_mode, (), _split(s.args.batch_args or "--compiled"), plain_timeout_s=200)


def vllm_batch_shipped(s):
    """plain --compiled, then configs/vllm-128k-sparse.yaml as shipped (tierkv-shipped: compiled by the config,
    rows sized by TieredLLM) over an fp8 CPU tier, 10 requests, --repeats pairs (--batch-args, to both rows: e.g.
    --kv-gib 48 where 60 GiB of KV and the weights do not fit the card); then the table."""
    both = _split(s.args.batch_args)
    return _batch_pairs(s, "tierkv-shipped", both, both, plain_timeout_s=240)


def _batch_pairs(s, mode: str, plain_args, tierkv_args, plain_timeout_s: int) -> int:
    """--repeats pairs of bench_vllm_batch.py rows (plain --compiled, then `mode` over an fp8 CPU tier with 10
    requests), tagged r1, r2, ...; then the table."""
    bb = f"{s.out}/bb"
    for r in range(1, s.args.repeats + 1):
        s.bench("bench_vllm_batch.py", "run", "plain", s.args.model_dir, bb, "--compiled", "--tag", f"r{r}",
                *plain_args, log=f"batch-plain-r{r}.log", timeout_s=plain_timeout_s, keep="{")
        s.bench("bench_vllm_batch.py", "run", mode, s.args.model_dir, bb, "--storage-dtype", "float8_e4m3fn",
                "--requests", "10", "--tag", f"r{r}", *tierkv_args, log=f"batch-{mode}-r{r}.log", timeout_s=500, keep="{")
    return vllm_batch_table(s)


def vllm_shipped(s):
    """Batch 1 at 128k: plain --compiled, then configs/vllm-128k-sparse.yaml as shipped (tierkv-shipped), --repeats
    pairs, 160 decoded tokens, no prefix run; then the table."""
    for r in range(1, s.args.repeats + 1):
        for mode, extra in (("plain", ("--compiled",)), ("tierkv-shipped", ())):
            vllm_row(mode)(s, f"r{r}", (*extra, "--decode-tokens", "160", "--context", "130880", "--no-prefix"))
    return vllm_table(s)


def vllm_prefill_chunks(s):
    """Issue 35's prefill options against plain --compiled at 128k (no prefix run, 32 decoded tokens): the shipped
    sparse config, the same without async scheduling at 5632-token chunks (what its pool holds beside the window), and with 8192-token chunks in a 3.5 GiB
    budget; then the table."""
    common = ("--decode-tokens", "32", "--context", "130880", "--no-prefix")
    rc = vllm_row("plain")(s, None, ("--compiled", *common))
    for variant in ((), ("--shipped-set", "scheduler.vllm_async_scheduling=false", "scheduler.prefill_chunk_tokens=5632"),
                    ("--shipped-set", "cache.gpu_budget_bytes=3.5GiB", "scheduler.prefill_chunk_tokens=8192")):
        rc = max(rc, s.bench("bench_vllm.py", "run", "tierkv-shipped", s.args.model_dir, f"{s.out}/bv", *common, *variant,
                             log=f"bench-shipped-{len(variant)}-{variant[-1].split('=')[-1] if variant else 'file'}.log",
                             timeout_s=240, keep="{"))
    return max(rc, vllm_table(s))


def vllm_prefill_exact(s):
    """Issue 35's exact rows at 32k, all compiled, no prefix run, 32 decoded tokens: plain, the exact hot window with
    16- and 64-token blocks, then the 16-token one again with its prefill chunks 2 and 3 profiled; then the table
    (four engine starts: about 70 s each at 32k on the H100, one device call)."""
    common = ("--compiled", "--decode-tokens", "32", "--context", "32000", "--no-prefix")
    rc = vllm_row("plain")(s, "c32k", common)
    for tag, extra in (("c32k", ()), ("c32kb64", ("--block-tokens", "64")), ("c32kprof", ("--profile-steps", "2", "3"))):
        rc = max(rc, vllm_row("tierkv")(s, tag, (*common, *extra)))
    return max(rc, vllm_table(s))


# the shrunk budget and decoded tokens per policy: at 130k tokens on 32 layers the sparse key summaries take 254 MiB
# (0.5 GiB cannot hold its window: refused, H100 b00c9b0); exact decode reads the whole far KV per token (0.32 s at
# 128k), and 64 tokens in each of its eleven runs did not finish in 200 s
RESIZE_RUNS = {"exact": ("--small", "0.5GiB", "--decode-tokens", "16"), "sparse": ("--small", "0.75GiB")}


def vllm_resize(s):
    """The vLLM pool resized 2 GiB -> small -> 2 GiB between and during requests at 128k (exact to 0.5 GiB, sparse to
    0.75), and its GPU test (--resize-tests adds paths; --resize-tests-off skips it; --resize-policies picks)."""
    rc = 0 if s.args.resize_tests_off else s.run(
        [PY, "-m", "pytest", "-q", "-m", "gpu", "-rs", "tests/gpu/test_own_segments_gpu.py", "tests/gpu/test_vllm_resize_gpu.py",
         *_split(s.args.resize_tests)],
        "resize-tests.log", 300)
    for policy in _split(s.args.resize_policies):
        rc = max(rc, s.bench("bench_vllm_resize.py", "run", s.args.model_dir, f"{s.out}/resize", "--policy", policy,
                             *RESIZE_RUNS[policy], log=f"resize-{policy}.log", timeout_s=s.args.resize_limit_s, tail=30))
    s.bench("bench_vllm_resize.py", "table", f"{s.out}/resize", log="resize-table.log", timeout_s=60, tail=20)
    return rc


for _step, _doc in [(tests, "every GPU test"), (quant_tests, "the quantized tiers' GPU tests"),
                    (graph_tests, "GPU tests of graphs, far-block caches, bound kernel, rows attention, save, needles"),
                    (sparse_tests, "the query predictor's GPU tests"), (quant, "bench_quant.py"),
                    (bounds, "bench_bounds.py: the key bound kernel, 1 and 10 rows"),
                    (sealed, "bench_sealed_path.py: a prefix from a plain, sealed and encrypted disk tier to the GPU"),
                    (exact, "bench_exact.py at 128k (--transfer-backends: rows per backend)"),
                    (sweep, "sweep_transfer.py (--extra adds flags, e.g. --contended)"),
                    (far_sparse, "bench_far_sparse.py: the hot window's sparse far path alone, eager and graphed"),
                    (save_step, "bench_save_step.py: host time of the block-completing step"),
                    (sparse, "bench_sparse.py with --sparse-predictor (--extra adds flags)"),
                    (vllm_model8b, "build the 8B-shaped model of the vLLM steps (--model-dir, --qk-bias-std)"),
                    (vllm_check, "8-layer model: plain vs hot window, tokens and logprobs"),
                    (vllm_table, "bench_vllm.py table of the rows so far"),
                    (vllm_batch_table, "bench_vllm_batch.py table of the rows so far")]:
    _step.__doc__ = _doc

STEPS = {
    "tests": tests, "quant-tests": quant_tests, "graph-tests": graph_tests, "sparse-tests": sparse_tests,
    "isolated-tests": isolated_tests, "quant": quant, "bounds": bounds, "exact": exact, "sweep": sweep,
    "far-sparse": far_sparse, "accuracy": accuracy, "sealed": sealed, "save-step": save_step, "sparse": sparse, "sparse-runs": sparse_runs,
    "vllm-model8b": vllm_model8b, "vllm-check": vllm_check, "vllm-table": vllm_table, "vllm-ab": vllm_ab,
    "vllm-compiled-quant": vllm_compiled_quant, "vllm-sparse-check": vllm_sparse_check,
    **{f"vllm-{m}": vllm_row(f"tierkv-{m}" if m.startswith("sparse") else m)
       for m in ("plain", "tierkv", "sparse", "sparse-graphs", "offloading", "lmcache")},
    **{f"vllm-batch-{m}": batch_row(m if m == "plain" else f"tierkv-{m}") for m in ("plain", "sparse", "sparse-graphs")},
    "vllm-batch-sparse-graphs-fp8": batch_row("tierkv-sparse-graphs", "--storage-dtype", "float8_e4m3fn", "--requests", "10"),
    "vllm-batch-ab": vllm_batch_ab, "vllm-batch-table": vllm_batch_table, "vllm-batch-shipped": vllm_batch_shipped,
    "vllm-shipped": vllm_shipped, "vllm-tierkv-b64": vllm_tierkv_b64, "vllm-prefill-chunks": vllm_prefill_chunks,
    "vllm-prefill-exact": vllm_prefill_exact,
    "vllm-resize": vllm_resize, "vllm-accuracy-convert": vllm_accuracy_convert, "vllm-accuracy": vllm_accuracy,
    "vllm-accuracy-sparse": vllm_accuracy_sparse,
}
GROUPS = {  # the rows issue 33 asks to re-measure after a restructuring, against RESULTS.md
    "default": ["tests", "quant", "sparse", "exact"],
    # exact 128k; the vLLM hot window (exact) against plain; the sparse batch against plain with the tuned flags
    "remeasure": ["tests", "exact", "vllm-model8b", "vllm-plain", "vllm-tierkv", "vllm-table", "vllm-batch-ab"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("steps", nargs="*", help="steps or groups, in order (default: the group 'default')")
    p.add_argument("--list", action="store_true", help="list the steps and groups, then exit")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/tierkv-gpu-out"), help="where logs and rows go ($OUT)")
    p.add_argument("--no-pack", action="store_true", help="leave more than 8 result files unpacked")
    p.add_argument("--model-dir", default="/tmp/m8", help="the vLLM steps' model (built by vllm-model8b)")
    p.add_argument("--resize-tests", default="", help="vllm-resize: more test paths run with its GPU test")
    p.add_argument("--resize-limit-s", type=int, default=300, help="vllm-resize: each policy's benchmark")
    p.add_argument("--resize-tests-off", action="store_true", help="vllm-resize: the benchmarks only")
    p.add_argument("--resize-policies", default="exact sparse", help="vllm-resize: the policies benchmarked")
    p.add_argument("--vacc-dir", default="/tmp/vacc", help="vllm-accuracy: where the converted model lives")
    p.add_argument("--vacc-modes", default="plain tierkv-exact", help="vllm-accuracy: the modes run")
    p.add_argument("--vacc-contexts", default="2048 4096 6144 8000", help="vllm-accuracy-sparse: the lengths run")
    p.add_argument("--model-layers", type=int, default=32, help="vllm-model8b: layers of the 8B-shaped model")
    p.add_argument("--qk-bias-std", default="0", help="vllm-model8b: 16 gives the queries a stable direction")
    p.add_argument("--sparse-predictor", default="previous", choices=("previous", "none", "query", "cache"))
    p.add_argument("--sparse-runs", default="cache:3:32 cache:4:32 none:1:0", help="sparse-runs: predictor:selections:margin ...")
    p.add_argument("--extra", default="", help="flags added to bench_sparse.py (sparse, sparse-runs) or sweep_transfer.py")
    p.add_argument("--prefill-chunks", default="32768")
    p.add_argument("--accuracy-args", default="", help="flags added to bench_accuracy.py (accuracy)")
    p.add_argument("--accuracy-limit-s", type=float, default=300, help="accuracy: no new case after this")
    p.add_argument("--transfer-backends", default="auto", help="exact: rows per transfer backend, e.g. 'auto memcpy_batch'")
    p.add_argument("--far-rows", default="1 4")
    p.add_argument("--storage-dtype", default=None, help="save-step / vllm-ab sparse rows: the CPU tier's storage dtype")
    p.add_argument("--vllm-args", default="", help="flags added to bench_vllm.py runs, e.g. '--compiled'")
    p.add_argument("--sparse-mode", default="tierkv-sparse-graphs", help="vllm-ab: the tierkv mode against plain")
    p.add_argument("--sparse-vllm-args", default="", help="vllm-ab: flags for the tierkv rows only, e.g. --async-scheduling")
    p.add_argument("--batch-args", default="", help="flags added to bench_vllm_batch.py runs")
    p.add_argument("--batch-mode", default="tierkv-sparse-full", help="vllm-batch-ab: the tierkv mode against plain")
    p.add_argument("--repeats", type=int, default=2, help="vllm-ab, vllm-batch-ab, vllm-compiled-quant: pairs / runs")
    p.add_argument("--pin-cores", default=None, help="run the benchmarks on these cores only (taskset -c)")
    args = p.parse_args(argv)
    names = [n for step in (args.steps or ["default"]) for n in GROUPS.get(step, [step])]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}; groups: {', '.join(GROUPS)}")
    bad = [x for x in _split(args.resize_policies) if x not in RESIZE_RUNS]
    if bad:
        p.error(f"--resize-policies: unknown {', '.join(bad)}; policies: {', '.join(RESIZE_RUNS)}")
    args.names = names
    return args


def pack(out: Path) -> None:
    files = [f for f in out.rglob("*") if f.is_file()]
    if len(files) > 8:
        archive = out.parent / f"{out.name}-results.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(out)))
        for f in files:
            f.unlink()
        archive.rename(out / "results.tar.gz")
        print("more than 8 files: packed into results.tar.gz (tar -xzf results.tar.gz)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, step in STEPS.items():
            print(f"{name:30s} {(step.__doc__ or '').splitlines()[0] if step.__doc__ else ''}")
        for name, members in GROUPS.items():
            print(f"{name:30s} group: {' '.join(members)}")
        return 0
    session = Session(args)
    topology = subprocess.run("nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nvidia-smi topo -m; "
                              "lscpu | grep -i -E 'numa|model name|^cpu\\(s\\)'", shell=True, capture_output=True, text=True)
    (session.out / "topology.txt").write_text(topology.stdout + topology.stderr)
    summary = []
    for name in args.names:
        print(f"=== {name}", flush=True)
        start = time.monotonic()
        rc = STEPS[name](session)
        summary.append(f"{name} rc={rc} {time.monotonic() - start:.0f}s")
    print("=== summary\n" + "\n".join(summary))
    if not args.no_pack:
        pack(session.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
