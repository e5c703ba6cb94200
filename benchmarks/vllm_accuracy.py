"""Accuracy of a real trained model (SmolLM2-135M-Instruct) under vLLM: plain vLLM, tierkv's exact hot
window and tierkv's sparse hot window on bench_accuracy's retrieval prompts; does tierkv keep the answers,
and does exact mode keep plain vLLM's tokens?

On the GPU machine (vLLM 0.26, transformers, the `gguf` package; no internet), one engine per process:

    G=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf O=/tmp/vacc
    python benchmarks/vllm_accuracy.py convert $G $O/model
    python benchmarks/vllm_accuracy.py run plain $O/model $O
    python benchmarks/vllm_accuracy.py run tierkv-exact $O/model $O
    python benchmarks/vllm_accuracy.py run tierkv-sparse $O/model $O
    python benchmarks/vllm_accuracy.py table $O
  (`;` between the runs, not `&&`: a mode that fails exits 1 and the next should still run), or all five,
  each step in its own process killed at --timeout-s (a failing or hanging step loses only itself; at most
  five times the limit in all):
    python benchmarks/vllm_accuracy.py all $G $O [--smoke] [--timeout-s 150]
  A first check: the same with --smoke on run, table and all (two prompts at 1024 tokens).
Expected time on the H200: convert about 20 s, each run the engine's start (under a minute) and well under
a minute of generation (48 prompts, about 240k prompt tokens; the tierkv modes one request at a time).

convert  GGUF -> a folder vLLM loads (benchmarks/vllm_accuracy_convert.py: both names of the tied embedding).
run      MODE (plain | tierkv-exact | tierkv-sparse; benchmarks/vllm_accuracy_engines.py says how each is built)
         over pass-key and multi-key prompts (tierkv.longdoc, as bench_accuracy builds them) at 2048, 4096,
         6144 and 8000 document tokens, depths 0.1/0.5/0.9, seeds 0 and 1 (48 prompts, max_model_len 8192),
         greedy, 16 new tokens, one vLLM generate call per context length. --smoke: two prompts at 1024 tokens
         (files vllm-acc-smoke-MODE.json). Writes OUTDIR/vllm-acc-MODE.json (command, git commit, date, device)
         before the engine starts and before and after every length, its `stage` naming how far it got, so a
         crash or a kill keeps what was done; a length whose generate call raises records the error in its
         prompts and the next length still runs; per prompt:
         task, tokens, depth, seed, expected answer, text, token ids, top-2 logprobs, correct. Exit 1 when
         anything failed (the error is in the JSON), else 0.
         --contexts 2048,4096: only those lengths; --tag T: the file is vllm-acc-MODE-T.json (the table's row
         MODE-T); --sparse-token-budget and --sparse-block-tokens (16; the tierkv-sparse config's block).
table    accuracy per run x length x task; per tierkv run, prompts whose token ids equal plain's (exit 0).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402
from benchmarks.vllm_accuracy_engines import (MAX_MODEL_LEN, MODES, NEW_TOKENS, SPARSE_BLOCK_TOKENS,  # noqa: E402
                                              SPARSE_TOKEN_BUDGET, KvShape, engine_kwargs, sparse_args_problem, start_engine,
                                              tierkv_config)
from benchmarks.vllm_accuracy_prompts import FULL, SMOKE, Grid, build_prompts, score  # noqa: E402
from benchmarks.vllm_accuracy_table import format_table, load_runs, run_file  # noqa: E402

SCRIPT = Path(__file__).resolve()
STALL_DUMP_S = 120  # a generate call running this long prints every thread's stack (then again each period)


def run(mode: str, model_dir: str, out_dir: str, smoke: bool = False, sparse_token_budget: int = SPARSE_TOKEN_BUDGET,
        sparse_block_tokens: int = SPARSE_BLOCK_TOKENS, contexts: tuple[int, ...] = (), tag: str = "") -> int:
    grid = SMOKE if smoke else FULL
    if contexts and not tag:
        raise ValueError("contexts: a run of some lengths needs a tag (it would replace the full run's file)")
    if contexts:  # a subset of the grid's lengths (each length its own sparse budget: run_gpu.py's vllm-accuracy-sparse)
        grid = Grid(tuple(c for c in grid.context_tokens if c in contexts), grid.depths, grid.seeds, grid.tasks)
    out = run_file(out_dir, mode, smoke, tag)
    results = {"mode": mode, "model_dir": os.path.abspath(model_dir), "max_model_len": MAX_MODEL_LEN,
               "new_tokens": NEW_TOKENS, "grid": asdict(grid), "engine_kwargs": engine_kwargs(mode), "config": None,
               "stage": "start", "error": None, "groups": [], "prompts": []}
    print(f"[{mode}] {out}", flush=True)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = build_prompts(tokenizer, grid, MAX_MODEL_LEN - NEW_TOKENS)
        results["prompts"] = [dict(p.row) for p in prompts]
        if mode != "plain":
            shape = KvShape.of_checkpoint(model_dir)
            results["config"] = tierkv_config(mode, shape, sparse_token_budget, sparse_block_tokens)
            results["gpu_budget_of_request_kv"] = results["config"]["cache"]["gpu_budget_bytes"] / shape.request_kv_bytes
        write_results(out, results)  # a start that hangs and is killed still leaves the prompts and the stage
        print(f"[{mode}] {len(prompts)} prompts; starting the engine", flush=True)
        engine = start_engine(mode, model_dir, results["config"])
    except Exception as exc:
        return _failed(results, out, mode, "start", exc)
    failed = 0
    for context in grid.context_tokens:
        group = [i for i, p in enumerate(prompts) if p.row["context_tokens"] == context and "error" not in p.row]
        results["stage"] = f"generate {context}"
        write_results(out, results)
        start = time.perf_counter()
        # a group that stalls shows where: each thread's stack on stderr every STALL_DUMP_S while it runs
        faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)
        try:
            error = _generate_group(engine, tokenizer, prompts, group, results["prompts"])
        finally:
            faulthandler.cancel_dump_traceback_later()
        failed += error is not None
        wall_s = round(time.perf_counter() - start, 2)
        correct = sum(bool(results["prompts"][i].get("correct")) for i in group)
        results["groups"].append({"context_tokens": context, "prompts": len(group), "wall_s": wall_s})
        results["engine_stats"] = _stats(engine)
        write_results(out, results)
        print(f"[{mode}] {context} tokens: {correct}/{len(group)} correct, {wall_s} s"
              + (f", FAILED: {error}" if error else ""), flush=True)
    results["stage"] = "done"
    write_results(out, results)
    return 1 if failed else 0


def _generate_group(engine, tokenizer, prompts: list, group: list[int], rows: list[dict]) -> str | None:
    """One generate call over prompts[i] for i in `group`; each rows[i] gets its completion and score,
    or the call's error (returned too, None when it worked)."""
    if not group:
        return None
    try:
        completions = engine.generate([prompts[i].ids for i in group])
        if len(completions) != len(group):
            raise RuntimeError(f"{len(completions)} completions for {len(group)} prompts")
    except Exception as exc:
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
        for i in group:
            rows[i]["error"] = error
        return error
    for i, completion in zip(group, completions):
        decoded = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        rows[i].update(token_ids=completion.token_ids, text=completion.text, decoded=decoded,
                       correct=score(prompts[i].row["answer"], decoded), top2_logprobs=completion.top2_logprobs)
    return None


def _failed(results: dict, out: Path, mode: str, stage: str, exc: BaseException) -> int:
    traceback.print_exc()
    results["error"] = f"{stage}: {type(exc).__name__}: {exc}"
    write_results(out, results)
    print(f"[{mode}] FAILED: {results['error']}", flush=True)
    return 1


def _stats(engine) -> dict:
    """The engine's stats as JSON values (non-JSON values as text); an error is a value too."""
    try:
        return json.loads(json.dumps(engine.stats(), default=str))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def table(out_dir: str, smoke: bool = False) -> int:
    runs = load_runs(out_dir, MODES, smoke)
    print(format_table(runs) if runs else f"no vllm-acc{'-smoke' if smoke else ''}-*.json in {out_dir}", flush=True)
    return 0


def run_steps(steps: list[tuple[list[str], float]]) -> list[dict]:
    """Each (argv, timeout in s) as a process of its own session, one after another; a step that fails
    or runs past its timeout (its whole process group killed) is recorded and the next one runs."""
    done = []
    for argv, timeout_s in steps:
        print(f"== {' '.join(argv)} (limit {timeout_s:.0f} s)", flush=True)
        start = time.perf_counter()
        proc = subprocess.Popen(argv, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
        done.append({"argv": argv, "rc": rc, "wall_s": round(time.perf_counter() - start, 1)})
        print(f"== rc {rc} after {done[-1]['wall_s']} s", flush=True)
    return done


def run_all(gguf: str, out_dir: str, smoke: bool, timeout_s: float, sparse_token_budget: int,
            sparse_block_tokens: int = SPARSE_BLOCK_TOKENS) -> int:
    model_dir = str(Path(out_dir) / "model")
    me = [sys.executable, str(SCRIPT)]
    steps = [(me + ["convert", gguf, model_dir], timeout_s)]
    for mode in MODES:
        extra = (["--smoke"] if smoke else []) + ["--sparse-token-budget", str(sparse_token_budget),
                                                  "--sparse-block-tokens", str(sparse_block_tokens)]
        steps.append((me + ["run", mode, model_dir, out_dir] + extra, timeout_s))
    for step in run_steps(steps):
        print("step", step, flush=True)
    return table(out_dir, smoke)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="GGUF file -> a folder vLLM loads")
    c.add_argument("gguf")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    r = sub.add_parser("run", help="one engine over the prompts")
    r.add_argument("mode", choices=MODES)
    r.add_argument("model_dir")
    r.add_argument("out_dir")
    t = sub.add_parser("table", help="the summary of OUTDIR's runs")
    t.add_argument("out_dir")
    a = sub.add_parser("all", help="convert, the three runs and the table, each step in its own process")
    a.add_argument("gguf")
    a.add_argument("out_dir")
    a.add_argument("--timeout-s", type=float, default=150.0, help="per step (default 150)")
    for parser in (r, t, a):
        parser.add_argument("--smoke", action="store_true", help="two prompts at 1024 tokens")
    for parser in (r, a):
        parser.add_argument("--sparse-token-budget", type=int, default=SPARSE_TOKEN_BUDGET,
                            help=f"tierkv-sparse: far tokens attended per decode step (default {SPARSE_TOKEN_BUDGET})")
        parser.add_argument("--sparse-block-tokens", type=int, default=SPARSE_BLOCK_TOKENS,
                            help=f"tierkv-sparse: tokens per block, vLLM's block_size (default {SPARSE_BLOCK_TOKENS})")
    r.add_argument("--contexts", type=_lengths, default=(), help="only these of the grid's lengths, e.g. 2048,4096")
    r.add_argument("--tag", default="", help="the run's file is vllm-acc-MODE-TAG.json (the table lists it as MODE-TAG)")
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; comma-separated token counts, e.g. 2048,4096") from None
    return lengths


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.command in ("convert", "all") and not (os.path.isfile(args.gguf) and args.gguf.endswith(".gguf")):
        p.error(f"GGUF: got {args.gguf!r}; expected an existing .gguf file")
    if args.command == "run" and not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        p.error(f"MODELDIR: got {args.model_dir!r}; no config.json there (make it with: convert GGUF MODELDIR)")
    if args.command == "table" and not os.path.isdir(args.out_dir):
        p.error(f"OUTDIR: got {args.out_dir!r}; not a directory")
    problem = sparse_args_problem(getattr(args, "sparse_token_budget", SPARSE_TOKEN_BUDGET),
                                  getattr(args, "sparse_block_tokens", SPARSE_BLOCK_TOKENS))
    if problem:
        p.error(problem)
    grid_lengths = (SMOKE if getattr(args, "smoke", False) else FULL).context_tokens
    unknown = [c for c in getattr(args, "contexts", ()) if c not in grid_lengths]
    if unknown:
        p.error(f"--contexts: got {unknown}; the grid's lengths are {list(grid_lengths)}")
    if getattr(args, "contexts", ()) and not args.tag:
        p.error("--contexts: needs --tag (a run of some lengths in the full run's file would replace it)")
    if getattr(args, "tag", "") and not all(ch.isalnum() or ch in "-_." for ch in args.tag):
        p.error(f"--tag: got {args.tag!r}; letters, digits, '-', '_' and '.' only (it names a file)")
    if args.command == "all" and args.timeout_s <= 0:
        p.error(f"--timeout-s: got {args.timeout_s}; must be positive")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "convert":
        from benchmarks.vllm_accuracy_convert import convert

        start = time.perf_counter()
        convert(args.gguf, args.out_dir, args.dtype)
        print(f"converted {args.gguf} -> {args.out_dir} in {time.perf_counter() - start:.1f} s", flush=True)
        return 0
    if args.command == "run":
        return run(args.mode, args.model_dir, args.out_dir, args.smoke, args.sparse_token_budget,
                   args.sparse_block_tokens, args.contexts, args.tag)
    if args.command == "table":
        return table(args.out_dir, args.smoke)
    return run_all(args.gguf, args.out_dir, args.smoke, args.timeout_s, args.sparse_token_budget, args.sparse_block_tokens)


if __name__ == "__main__":
    sys.exit(main())
