"""The summary of benchmarks/vllm_accuracy.py's runs: accuracy per mode x context length x task, and
whether each tierkv mode generated plain vLLM's tokens.

Primitives: `load_runs`, `accuracy_rows`, `token_match`, `format_table`.

A prompt is keyed by (task, context_tokens, depth, seed). `token_match` compares a mode's token ids with
plain's on the prompts both generated; at the first prompt that differs it names the step and plain's
top-2 logprob margin there (a near tie explains a rounding-level difference).
"""
from __future__ import annotations

import json
from pathlib import Path

KEY = ("task", "context_tokens", "depth", "seed")


def run_file(out_dir: str | Path, mode: str, smoke: bool = False, tag: str = "") -> Path:
    name = f"{mode}-{tag}" if tag else mode
    return Path(out_dir) / (f"vllm-acc-smoke-{name}.json" if smoke else f"vllm-acc-{name}.json")


def load_runs(out_dir: str | Path, modes, smoke: bool = False) -> dict[str, dict]:
    """run name (the mode, and its tag after a "-") -> its record's results, for the runs whose file exists
    (a missing file is a mode not run), each mode's untagged run first."""
    runs = {}
    for mode in modes:
        path = run_file(out_dir, mode, smoke)
        tagged = sorted(path.parent.glob(path.name.removesuffix(".json") + "-*.json"))
        for found in ([path] if path.is_file() else []) + tagged:
            name = found.name.removesuffix(".json").removeprefix("vllm-acc-smoke-" if smoke else "vllm-acc-")
            runs[name] = json.loads(found.read_text())["results"]
    return runs


def accuracy_rows(results: dict) -> list[dict]:
    """One row per (context_tokens, task): cases, correct, errors (prompts without a completion)."""
    groups: dict[tuple, list[dict]] = {}
    for prompt in results.get("prompts", []):
        groups.setdefault((prompt["context_tokens"], prompt["task"]), []).append(prompt)
    rows = []
    for (context, task), members in sorted(groups.items()):
        scored = [p for p in members if "correct" in p]
        rows.append({"context_tokens": context, "task": task, "cases": len(members),
                     "correct": sum(bool(p["correct"]) for p in scored), "errors": len(members) - len(scored)})
    return rows


def token_match(plain: dict, other: dict) -> dict:
    """identical / compared over the prompts both runs completed, in `other`'s order, and the first
    prompt that differs (its key, the first differing step, plain's top-2 margin there) or None."""
    reference = {tuple(p[k] for k in KEY): p for p in plain.get("prompts", []) if "token_ids" in p}
    compared = identical = 0
    first = None
    for prompt in other.get("prompts", []):
        key = tuple(prompt[k] for k in KEY)
        if "token_ids" not in prompt or key not in reference:
            continue
        compared += 1
        mine, theirs = prompt["token_ids"], reference[key]["token_ids"]
        if mine == theirs:
            identical += 1
        elif first is None:
            step = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            top2 = reference[key].get("top2_logprobs") or []
            margin = top2[step][0] - top2[step][1] if step < len(top2) and len(top2[step]) > 1 else None
            first = {**dict(zip(KEY, key)), "step": step, "plain_top2_margin": margin}
    return {"identical": identical, "compared": compared, "first_difference": first}


def format_table(runs: dict[str, dict]) -> str:
    """The accuracy table and, for every tierkv mode, its token match with plain (when plain ran)."""
    width = max([14, *map(len, runs)])
    lines = [f"{'mode':<{width}} {'context':>7} {'task':<9} {'correct':>9} {'errors':>6}"]
    for mode, results in runs.items():
        if results.get("error"):
            lines.append(f"{mode:<{width}} engine error: {results['error']}")
        elif results.get("stage", "done") != "done":
            lines.append(f"{mode:<{width}} stopped at stage: {results['stage']} (killed or timed out)")
        for row in accuracy_rows(results):
            scored = row["cases"] - row["errors"]
            lines.append(f"{mode:<{width}} {row['context_tokens']:>7} {row['task']:<9} "
                         f"{row['correct']:>4}/{scored:<4} {row['errors']:>6}")
    if "plain" in runs:
        for mode in [m for m in runs if m != "plain"]:
            match = token_match(runs["plain"], runs[mode])
            first = match["first_difference"]
            where = "none" if first is None else (
                f"{first['task']} {first['context_tokens']} depth {first['depth']} seed {first['seed']}, "
                f"step {first['step']}, plain top-2 margin {_round(first['plain_top2_margin'])}")
            lines.append(f"{mode} token ids equal to plain: {match['identical']}/{match['compared']} prompts; "
                         f"first difference: {where}")
    return "\n".join(lines)


def _round(value):
    return None if value is None else round(value, 4)
