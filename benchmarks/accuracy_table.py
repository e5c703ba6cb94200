"""Markdown tables from bench_accuracy JSON files (as RESULTS.md shows them).

    python benchmarks/accuracy_table.py benchmarks/results/accuracy-cpu-*.json

Primitives: `load_rows`, `combined_table`, `retrieval_table`, `exact_table`, `realtext_table`, `recall_table`,
`layer_table`.
Retrieval accuracy is compared with dense on the same cases (task, context, depth, seed): "vs dense" is
the difference in points, "same text" the share of cases whose generated text equals dense's.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load_rows(paths: list[str]) -> dict[str, list[dict]]:
    """Every part's rows over the files, each row tagged with its file's name and commit."""
    parts: dict[str, list[dict]] = {}
    for path in paths:
        record = json.loads(Path(path).read_text())
        cache = record["results"].get("cache") or DEFAULT_CACHE  # files written before the cache shape was recorded
        tag = {"file": Path(path).name, "commit": (record.get("git_commit") or "")[:7],
               "shape": _shape(cache)}
        for part in ("exact", "retrieval", "realtext", "recall"):
            parts.setdefault(part, []).extend({**row, **tag} for row in record["results"].get(part, []))
    return parts


DEFAULT_CACHE = {"sink_tokens": 16, "window_tokens": 32, "sparse_gpu_fraction": 8}


def combined_table(parts: dict[str, list[dict]]) -> list[str]:
    """Per (cache shape, context, mode, budget, predictor): retrieval accuracy over both tasks against dense
    on the same cases, and the real-text figures where that part ran."""
    dense = {_case(r): r for r in parts.get("retrieval", []) if r["mode"] == "dense" and "correct" in r}
    keys: dict[tuple, dict] = {}
    for r in parts.get("retrieval", []):
        if r["mode"] != "dense" and "correct" in r and _case(r) in dense:
            k = keys.setdefault(_key(r), {"found": 0, "dense": 0, "cases": 0})
            k["found"] += r["correct"]
            k["dense"] += dense[_case(r)]["correct"]
            k["cases"] += 1
    for r in parts.get("realtext", []):
        if "top1_agreement" in r:
            keys.setdefault(_key(r), {}).update(realtext=r)
    out = ["| cache shape | context | mode | token budget | predictor | retrieval found (cases) | dense on the same cases | "
           "top-1 agreement | mean KL (nats) | perplexity ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    default = _shape(DEFAULT_CACHE)
    for (shape, ctx, mode, budget, predictor), k in sorted(keys.items(), key=lambda kv: (kv[0][0] != default, kv[0])):
        rt = k.get("realtext")
        found = f"{k['found']}/{k['cases']}" if k.get("cases") else "-"
        ref = f"{k['dense']}/{k['cases']}" if k.get("cases") else "-"
        text = (f"{_pct(rt['top1_agreement'])} | {rt['mean_kl']:.4f} | {rt['perplexity_ratio']:.4f}" if rt else "- | - | -")
        out.append(f"| {shape} | {ctx} | {mode} | {budget or '-'} | {predictor or '-'} | {found} | {ref} | {text} |")
    return out


def _shape(cache: dict) -> str:
    return f"sinks {cache['sink_tokens']}, window {cache['window_tokens']}, GPU 1/{cache['sparse_gpu_fraction']}"


def _key(row: dict) -> tuple:
    return row["shape"], row["context_tokens"], row["mode"], row["token_budget"] or 0, row["predictor"] or ""


def _case(row: dict) -> tuple:
    return row["task"], row["context_tokens"], row["depth"], row["seed"]


def retrieval_table(rows: list[dict]) -> list[str]:
    dense = {_case(r): r for r in rows if r["mode"] == "dense" and "correct" in r}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["context_tokens"], r["mode"], r["token_budget"] or 0, r["predictor"] or ""), []).append(r)
    out = ["| context | mode | token budget | predictor | cases | errors | accuracy | dense on the same cases | vs dense (points) | same text as dense | missed (task@depth) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (ctx, mode, budget, predictor), members in sorted(groups.items()):
        scored = [m for m in members if "correct" in m and _case(m) in dense]
        acc = sum(m["correct"] for m in scored) / len(scored) if scored else None
        ref = sum(dense[_case(m)]["correct"] for m in scored) / len(scored) if scored else None
        same = sum(m["text"] == dense[_case(m)]["text"] for m in scored) / len(scored) if scored else None
        missed = sorted({f"{m['task']}@{m['depth']:g}" for m in scored if not m["correct"]})
        out.append(f"| {ctx} | {mode} | {budget or '-'} | {predictor or '-'} | {len(members)} | "
                   f"{len(members) - len([m for m in members if 'correct' in m])} | {_pct(acc)} | {_pct(ref)} | "
                   f"{_pts(acc, ref)} | {_pct(same)} | {', '.join(missed) or '-'} |")
    return out


def exact_table(rows: list[dict]) -> list[str]:
    out = ["| prompt tokens | GPU budget | greedy tokens | largest logit difference | GPU hit rate |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['prompt_tokens']} | {r['gpu_budget']} | error: {r['error'][:80]} | | |")
            continue
        out.append(f"| {r['prompt_tokens']} | {r['gpu_budget']} | {'identical' if r['identical'] else 'DIFFER'} "
                   f"({r['num_tokens']}) | {r['max_abs_logit_diff']:.1e} | {_pct(r['gpu_hit_rate'])} |")
    return out


def realtext_table(rows: list[dict]) -> list[str]:
    out = ["| cache shape | context | continuation | mode | token budget | predictor | top-1 agreement | mean KL (nats) | "
           "perplexity ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | {r['context_tokens']} | {r['continuation_tokens']} | {r['mode']} | "
                       f"{r['token_budget'] or '-'} | {r['predictor'] or '-'} | error: {r['error'][:60]} | | |")
            continue
        out.append(f"| {r['shape']} | {r['context_tokens']} | {r['continuation_tokens']} | {r['mode']} | "
                   f"{r['token_budget'] or '-'} | {r['predictor'] or '-'} | {_pct(r['top1_agreement'])} | {r['mean_kl']:.4f} | {r['perplexity_ratio']:.4f} |")
    return out


def recall_table(summary: list[dict]) -> list[str]:
    out = ["| task | context | token budget | cases | mean recall | mean oracle recall | far mass | dropped mass | needle kept | lowest-recall layers |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        out.append(f"| {s['task']} | {s['context_tokens']} | {s['token_budget']} | {s['cases']} | {_pct(s['mean_recall'])} | "
                   f"{_pct(_mean(s['oracle_recall']))} | {_pct(_mean(s['far_mass']))} | {_pct(_mean(s['dropped_mass']))} | "
                   f"{_pct(_mean(s['needle_selected']))} | {', '.join(map(str, s['lowest_recall_layers']))} |")
    return out


def layer_table(summary: list[dict], field: str = "recall") -> list[str]:
    """One row per (context, budget): the per-layer values of `field`, in percent."""
    if not summary:
        return []
    n = len(summary[0][field])
    out = ["| task / context / budget | " + " | ".join(f"L{i}" for i in range(n)) + " |", "|---" * (n + 1) + "|"]
    for s in summary:
        out.append(f"| {s['task']} / {s['context_tokens']} / {s['token_budget']} | " +
                   " | ".join("-" if v is None else f"{100 * v:.0f}" for v in s[field]) + " |")
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _pts(a, b) -> str:
    return "-" if a is None or b is None else f"{100 * (a - b):+.0f}"


def main(paths: list[str]) -> None:
    from benchmarks.accuracy_recall import summarize_recall

    parts = load_rows(paths)
    summary = summarize_recall(parts["recall"])
    for title, lines in (("combined", combined_table(parts)), ("exact", exact_table(parts["exact"])), ("retrieval", retrieval_table(parts["retrieval"])),
                         ("realtext", realtext_table(parts["realtext"])), ("recall", recall_table(summary)),
                         ("recall per layer", layer_table(summary)), ("far mass per layer", layer_table(summary, "far_mass")),
                         ("dropped mass per layer", layer_table(summary, "dropped_mass")),
                         ("needle kept per layer", layer_table(summary, "needle_selected"))):
        print(f"\n### {title}\n")
        print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
