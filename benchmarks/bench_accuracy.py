"""Accuracy on a real trained model (SmolLM2-135M-Instruct, tierkv.model_loading's `smollm2-135m`):
does tierkv's attention keep the model's answers?

    python benchmarks/bench_accuracy.py --quick                       # CI: a few cases, CPU
    python benchmarks/bench_accuracy.py --device cuda                 # the full grid (GPU)
    python benchmarks/bench_accuracy.py --parts exact --exact-tokens 1024,2048 --budgets 4,8,16
    python benchmarks/bench_accuracy.py --parts retrieval --block-tokens 64 --sink-tokens 0 --window-tokens 128 \
        --sparse-gpu-fraction 0   # vLLM's sparse selection: the window on the GPU, far blocks from block 0

Parts (--parts):
  exact      tierkv's exact policy with a GPU budget of 1/N of the prompt's KV (--budgets N,...) against
             transformers' own attention (SDPA) over a DynamicCache, in the model's dtype (float32 on
             CPU): greedy tokens identical, and the largest logit difference over the generated steps.
  retrieval  a five-digit pass key (task passkey) or one of four named keys (task multikey) planted at
             --depths of a --retrieval-tokens document (the GPL v3 text the OS ships, tierkv.longdoc),
             the answer's start forced ("The secret pass key is"), a few greedy tokens scored by whether
             they hold the key; modes dense (SDPA, DynamicCache), exact (tierkv, budget 1/8), and sparse
             at each --sparse-budgets token budget with each --predictors predictor. Prefill is exact in
             every mode (tierkv's sparse policy selects far blocks in decode only).

  realtext   --realtext-continuation tokens of the same text teacher-forced after --realtext-tokens of it,
             one decode step each through tierkv (exact, and sparse per budget and predictor) against one
             SDPA forward: top-1 agreement, mean KL divergence (dense || tierkv), perplexity ratio.

  recall     with retrieval: per layer, the share of the true attention mass over far blocks that the
             sparse selection holds, at each --sparse-budgets budget, over the dense run's decode steps
             (benchmarks/accuracy_recall.py says exactly what is computed).
Results: JSON under benchmarks/results/ (command, git commit, date, device); a summary on stdout.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402
from benchmarks.accuracy_config import check_cache_args, gpu_budget_bytes, staging_bytes  # noqa: E402
from benchmarks.accuracy_recall import FarLayout, capture_decode, case_recall, needle_positions, summarize_recall  # noqa: E402
from benchmarks.accuracy_runs import (PREFILL_CHUNK, compare_logits, dense_teacher_forced,  # noqa: E402
                                      tiered_greedy, tiered_teacher_forced)
from tierkv.config import load_config  # noqa: E402

BLOCK_TOKENS = 16   # --block-tokens
SINK_TOKENS = 16    # --sink-tokens
WINDOW_TOKENS = 32  # --window-tokens
SPARSE_FRACTION = 8  # --sparse-gpu-fraction: sparse (and retrieval's exact) runs get a GPU budget of 1/8 of the KV (0: window only)
SELECTION = "per_layer"  # --sparse-selection: scheduler.sparse_selection of the sparse runs
BOUND_WEIGHT = 1.0   # --bound-weight: scheduler.sparse_bound_weight of the sparse runs and the recall's selection
QUICK = dict(parts=["exact", "retrieval"], exact_tokens=[512], budgets=[8], retrieval_tokens=[512], depths=[0.5],
             seeds=[0], tasks=["passkey"], sparse_budgets=[128], predictors=["previous"], new_tokens=6)


def tier_config(prompt_kv_bytes: int, fraction: int, num_layers: int, block_bytes: int, disk: str,
                policy: str = "exact", token_budget: int = 2048, predictor: str = "previous"):
    """GPU budget 1/`fraction` of the prompt's KV (0: the sinks and the window only), a CPU tier holding
    it, a disk tier under it. Staging holds the prefetch regions or, for predictor 'cache', one selection per layer."""
    staging = staging_bytes(prompt_kv_bytes, fraction, num_layers, block_bytes, BLOCK_TOKENS, token_budget)
    gpu_budget = gpu_budget_bytes(prompt_kv_bytes, fraction, num_layers, block_bytes, BLOCK_TOKENS,
                                  SINK_TOKENS, WINDOW_TOKENS)
    scheduler = {"policy": policy, "lookahead_layers": 1, "staging_bytes": staging, "prefill_chunk_tokens": PREFILL_CHUNK}
    if policy == "sparse":
        scheduler.update(predictor=predictor, sparse_token_budget=token_budget, decode_cuda_graph=False,
                         sparse_bound_weight=BOUND_WEIGHT, sparse_selection=SELECTION)
    return load_config({
        "model": {"name": "smollm2-135m"},
        "cache": {"block_tokens": BLOCK_TOKENS, "gpu_budget_bytes": gpu_budget,
                  "sink_tokens": SINK_TOKENS, "window_tokens": WINDOW_TOKENS},
        "tiers": [{"kind": "cpu", "capacity_bytes": 2 * prompt_kv_bytes},
                  {"kind": "disk", "path": disk, "capacity_bytes": 4 * prompt_kv_bytes,
                   "trusted": True}],  # the run's own scratch directory: nobody else writes it
        "scheduler": scheduler, "metrics": {"enabled": False},
    }, env={})


def run_realtext(model, tokenizer, args, disk: str, recall_rows: list[dict] | None = None) -> list[dict]:
    """Teacher-forced continuation of the haystack text (plain, no chat template): sparse against dense.
    With `recall_rows`, the selection recall over the continuation's decode steps is appended there."""
    from tierkv.longdoc import haystack_text

    text, source = haystack_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rows = []
    for num_tokens in args.realtext_tokens:
        if _out_of_time("realtext", num_tokens):
            break
        need = num_tokens + args.realtext_continuation
        stream = (ids * (need // len(ids) + 1))[:need]
        prompt, continuation = stream[:num_tokens], stream[num_tokens:]
        reference = dense_teacher_forced(model, prompt, continuation)
        if recall_rows is not None:
            capture = capture_decode(model, prompt, len(continuation), set(), PREFILL_CHUNK, forced=continuation)
            base = {"task": "realtext", "context_tokens": num_tokens, "prompt_tokens": num_tokens, "answer": "",
                    "kv_tokens": need}  # the tierkv runs' GPU budget is a fraction of the KV of `need` tokens
            recall_rows += _recall_rows(model, tokenizer, base, prompt, capture, args, disk)
        for mode, budget, predictor in _tiered_modes(args, num_tokens):
            row = {"source": source, "context_tokens": num_tokens, "continuation_tokens": len(continuation),
                   "mode": mode, "token_budget": budget, "predictor": predictor}
            config = _config(model, _kv_bytes(model, need), SPARSE_FRACTION, disk, mode, budget, predictor)
            try:
                row.update(compare_logits(tiered_teacher_forced(model, config, prompt, continuation), reference, continuation))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            print("realtext", row, flush=True)
            rows.append(row)
    return rows


def run_exact(model, tokenizer, args, disk: str) -> list[dict]:
    from tierkv.longdoc import dense_greedy, passkey_case

    rows, stop = [], _stop_ids(tokenizer)
    for num_tokens in args.exact_tokens:
        if _out_of_time("exact", num_tokens):
            break
        ids = passkey_case(tokenizer, num_tokens, 0.5, seed=0).prompt_ids
        ref_tokens, ref_logits = dense_greedy(model, ids, args.new_tokens, stop, chunk_tokens=PREFILL_CHUNK)
        kv = _kv_bytes(model, len(ids))
        for fraction in args.budgets:
            row = {"prompt_tokens": len(ids), "gpu_budget": f"1/{fraction}", "kv_bytes": kv}
            start = time.perf_counter()
            try:
                tokens, logits, reads = tiered_greedy(model, _config(model, kv, fraction, disk), ids, args.new_tokens, stop)
            except Exception as exc:  # a refused budget is a result too, reported as such
                row.update(error=f"{type(exc).__name__}: {exc}")
            else:
                steps = min(len(logits), len(ref_logits))
                diff = max(float((logits[i] - ref_logits[i]).abs().max()) for i in range(steps))
                row.update(identical=tokens == ref_tokens, num_tokens=len(tokens), max_abs_logit_diff=diff,
                           gpu_hit_rate=reads["gpu_hit_rate"])
            row["seconds"] = round(time.perf_counter() - start, 1)
            print("exact", row, flush=True)
            rows.append(row)
    return rows


def run_retrieval(model, tokenizer, args, disk: str, recall_rows: list[dict] | None = None) -> list[dict]:
    """Retrieval rows; with `recall_rows` the dense run also captures its queries and each case's
    selection recall per budget is appended there."""
    from tierkv.longdoc import dense_greedy, multikey_case, passkey_case

    makers = {"passkey": passkey_case, "multikey": multikey_case}
    rows, stop = [], _stop_ids(tokenizer)
    for task in args.tasks:
        for num_tokens in args.retrieval_tokens:
            for depth in args.depths:
                for seed in args.seeds:
                    if _out_of_time("retrieval", f"{task} {num_tokens} depth {depth} seed {seed}"):
                        return rows
                    case = makers[task](tokenizer, num_tokens, depth, seed)
                    ids = case.prompt_with_prefix(tokenizer)
                    base = {"task": task, "context_tokens": num_tokens, "prompt_tokens": len(ids), "depth": depth,
                            "seed": seed, "answer": case.answer}
                    if recall_rows is None:
                        tokens, _ = dense_greedy(model, ids, args.new_tokens, stop, chunk_tokens=PREFILL_CHUNK)
                    else:
                        capture = capture_decode(model, ids, args.new_tokens, stop, PREFILL_CHUNK)
                        tokens = capture.tokens
                        recall_rows += _recall_rows(model, tokenizer, base, ids, capture, args, disk)
                    rows.append(_scored(base, "dense", None, None, tokenizer, tokens))
                    for mode, budget, predictor in _tiered_modes(args, len(ids)):
                        config = _config(model, _kv_bytes(model, len(ids)), SPARSE_FRACTION, disk, mode, budget, predictor)
                        try:
                            tokens, _, _ = tiered_greedy(model, config, ids, args.new_tokens, stop)
                        except Exception as exc:
                            rows.append({**base, "mode": mode, "token_budget": budget, "predictor": predictor,
                                         "error": f"{type(exc).__name__}: {exc}"})
                            print("retrieval", rows[-1], flush=True)
                            continue
                        rows.append(_scored(base, mode, budget, predictor, tokenizer, tokens))
    return rows


def _recall_rows(model, tokenizer, base: dict, ids: list[int], capture, args, disk: str) -> list[dict]:
    """One row per sparse budget: per-layer recall fields (accuracy_recall.FIELDS) of this case; the
    needle is where the answer's tokens (with or without a leading space) occur in the prompt."""
    cfg = model.config
    config = _config(model, _kv_bytes(model, base.get("kv_tokens", base["prompt_tokens"])), SPARSE_FRACTION, disk, "sparse")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layout = FarLayout.of_config(config, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                                 next(model.parameters()).element_size())
    budgets = [b for b in args.sparse_budgets if b < base["prompt_tokens"]]
    needle = sorted({p for text in (base["answer"], " " + base["answer"]) if base["answer"]
                     for p in needle_positions(ids, tokenizer(text, add_special_tokens=False)["input_ids"])})
    rows = []
    for budget, fields in case_recall(capture, layout, budgets, needle, BOUND_WEIGHT).items():
        rows.append({**base, "token_budget": budget,
                    "front_blocks": layout.num_front_blocks, "window_blocks": layout.num_window_blocks,
                    "block_tokens": layout.block_tokens, "needle_tokens": len(needle), **fields})
    return rows


def _tiered_modes(args, prompt_tokens: int):
    yield "exact", None, None
    for budget in args.sparse_budgets:
        if budget < prompt_tokens:  # a budget at or past the context is dense
            for predictor in args.predictors:
                yield "sparse", budget, predictor


def _scored(base: dict, mode: str, budget, predictor, tokenizer, tokens: list[int]) -> dict:
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    row = {**base, "mode": mode, "token_budget": budget, "predictor": predictor, "text": text,
           "correct": base["answer"] in text.replace(" ", "")}
    print("retrieval", row, flush=True)
    return row


def summarize_retrieval(rows: list[dict]) -> list[dict]:
    """Accuracy per (task, context, mode, token budget, predictor), with the depths it missed."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["context_tokens"], row["mode"], row["token_budget"], row["predictor"]), []).append(row)
    out = []
    for (task, ctx, mode, budget, predictor), members in sorted(groups.items(), key=lambda kv: str(kv[0])):
        scored = [m for m in members if "correct" in m]
        out.append({"task": task, "context_tokens": ctx, "mode": mode, "token_budget": budget, "predictor": predictor,
                    "cases": len(members), "errors": len(members) - len(scored),
                    "accuracy": sum(m["correct"] for m in scored) / len(scored) if scored else None,
                    "missed_depths": sorted({m["depth"] for m in scored if not m["correct"]})})
    return out


def _config(model, kv: int, fraction: int, disk: str, policy="exact", budget=None, predictor=None):
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_key_value_heads * BLOCK_TOKENS * head_dim * next(model.parameters()).element_size()
    return tier_config(kv, fraction, cfg.num_hidden_layers, block_bytes, disk, policy, budget or 2048, predictor or "previous")


def _kv_bytes(model, num_tokens: int) -> int:
    from tierkv.demo_real import kv_bytes_per_token

    return kv_bytes_per_token(model) * num_tokens


STOPPED: list[str] = []  # the cases not started because --time-limit-s ran out
DEADLINE: float | None = None


def _out_of_time(part: str, case) -> bool:
    """True (and the case noted in STOPPED) once --time-limit-s has passed: no new case starts."""
    if DEADLINE is None or time.monotonic() < DEADLINE:
        return False
    STOPPED.append(f"{part} {case}")
    return True


def _stop_ids(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    words = lambda s: s.split(",")  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--quick", action="store_true", help="a few small cases (CI): " + str(QUICK))
    p.add_argument("--parts", type=words, default=["exact", "retrieval", "realtext"])
    p.add_argument("--exact-tokens", type=ints, default=[1024, 2048, 4096, 8000])
    p.add_argument("--budgets", type=ints, default=[4, 8, 16], help="GPU budget = 1/N of the prompt's KV")
    p.add_argument("--retrieval-tokens", type=ints, default=[2048, 4096, 6144, 8000])
    p.add_argument("--depths", type=floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--seeds", type=ints, default=[0, 1, 2])
    p.add_argument("--tasks", type=words, default=["passkey", "multikey"])
    p.add_argument("--sparse-budgets", type=ints, default=[256, 512, 1024, 2048])
    p.add_argument("--predictors", type=words, default=["none", "previous", "query", "cache"])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--realtext-tokens", type=ints, default=[2048, 4096, 7000], help="context of the real-text part")
    p.add_argument("--realtext-continuation", type=int, default=64, help="tokens teacher-forced after it")
    p.add_argument("--no-recall", dest="recall", action="store_false",
                   help="skip the selection recall (computed from the retrieval part's dense runs)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS, help="cache.block_tokens of every tierkv run")
    p.add_argument("--sink-tokens", type=int, default=SINK_TOKENS, help="cache.sink_tokens of every tierkv run")
    p.add_argument("--window-tokens", type=int, default=WINDOW_TOKENS, help="cache.window_tokens of every tierkv run")
    p.add_argument("--sparse-gpu-fraction", type=int, default=SPARSE_FRACTION,
                   help="GPU budget 1/N of the KV for the retrieval and real-text runs (its front blocks, "
                        "all but the window, stay resident: sparse decode reads them besides its selection); "
                        "0: the GPU holds the sinks and the window only, so far blocks start right after the sinks")
    p.add_argument("--bound-weight", type=float, default=BOUND_WEIGHT,
                   help="scheduler.sparse_bound_weight of every sparse run (1: Quest's bound alone)")
    p.add_argument("--sparse-selection", default=SELECTION, choices=("per_layer", "per_kv_head"),
                   help="scheduler.sparse_selection of every sparse run (per_kv_head: a CPU device only)")
    p.add_argument("--disk-path", default="/tmp/tierkv-bench-accuracy")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="start no new case after this many seconds; the JSON lists the first case not run")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/accuracy-<device>.json)")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for part in args.parts:
        if part not in ("exact", "retrieval", "realtext"):
            p.error(f"--parts: got {part!r}; allowed: exact, retrieval, realtext")
    for task in args.tasks:
        if task not in ("passkey", "multikey"):
            p.error(f"--tasks: got {task!r}; allowed: passkey, multikey")
    check_cache_args(p, args)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    global BLOCK_TOKENS, SINK_TOKENS, WINDOW_TOKENS, SPARSE_FRACTION, BOUND_WEIGHT, SELECTION  # one run, one cache shape
    BLOCK_TOKENS, SINK_TOKENS, WINDOW_TOKENS = args.block_tokens, args.sink_tokens, args.window_tokens
    SPARSE_FRACTION = args.sparse_gpu_fraction
    BOUND_WEIGHT, SELECTION = args.bound_weight, args.sparse_selection
    global DEADLINE
    DEADLINE = None if args.time_limit_s is None else time.monotonic() + args.time_limit_s
    STOPPED.clear()
    try:
        return _run(args)
    finally:  # the deadline is this run's: later calls in the process (tests) start without one
        DEADLINE = None


def _run(args) -> dict:
    from tierkv.demo_real import load_real_model

    model, tokenizer, model_id = load_real_model(args.device)
    recall = [] if args.recall else None
    results = {"model": model_id, "dtype": str(next(model.parameters()).dtype), "quick": args.quick,
               "cache": {"block_tokens": BLOCK_TOKENS, "sink_tokens": SINK_TOKENS, "window_tokens": WINDOW_TOKENS,
                         "sparse_gpu_fraction": SPARSE_FRACTION, "sparse_bound_weight": BOUND_WEIGHT,
                         "sparse_selection": SELECTION}}
    if "exact" in args.parts:
        results["exact"] = run_exact(model, tokenizer, args, args.disk_path)
    if "retrieval" in args.parts:
        rows = run_retrieval(model, tokenizer, args, args.disk_path, recall)
        results["retrieval"] = rows
        results["retrieval_summary"] = summarize_retrieval(rows)
        for line in results["retrieval_summary"]:
            print("summary", line)
    if "realtext" in args.parts:
        results["realtext"] = run_realtext(model, tokenizer, args, args.disk_path, recall)
    if recall:
        results["recall"] = recall
        results["recall_summary"] = summarize_recall(recall)
        for line in results["recall_summary"]:
            print("recall", {k: line[k] for k in ("task", "context_tokens", "token_budget", "cases", "mean_recall",
                                                   "lowest_recall_layers")})
    if STOPPED:
        results["stopped_early"] = {"time_limit_s": args.time_limit_s, "first_cases_not_run": list(STOPPED)}
        print("time limit reached; not run:", STOPPED)
    device = next(model.parameters()).device.type
    out = args.out or Path(__file__).resolve().parent / "results" / f"accuracy-{device}{'-quick' if args.quick else ''}.json"
    return write_results(out, results)


if __name__ == "__main__":
    main()
