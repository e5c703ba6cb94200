"""vLLM hot-window pool resized at run time: 2 GiB -> 0.5 GiB -> tight -> 2 GiB between and during requests.

    python benchmarks/bench_vllm.py model DIR                     the 8B-shaped random checkpoint (32 layers)
    python benchmarks/bench_vllm_resize.py run DIR OUT [--context 130000] [--decode-tokens 64] [--policy exact|sparse]
                                                           [--small 0.5GiB]

One engine (TieredLLM backend="vllm", max_num_seqs 1, eager). Per phase: the budget, the seconds
`set_gpu_budget` took, the bytes another process sees freed or taken (torch.cuda.mem_get_info in a
second process, before and right after the call) against the pool bytes the change should free,
vLLM's own block count, decode ms per token (the same prompt with N and with 1 new token, the
prefix served by the tiers), and whether the greedy tokens equal the first 2 GiB run's. "during":
the change is made from a second thread while a request decodes (policy step_boundary: a grow
applies at the next step, a shrink once the dropped block ids are free). Targets (issue 36): at
least 95% of a shrink visible as free within 1 s; tokens identical. JSON to OUT/bench-vllm-resize-<policy>.json,
written after every phase (a run cut short keeps the phases it finished). --small: the shrunk budget (the sparse
policy's key summaries alone take 254 MiB at 130k tokens on 32 layers, so 0.5 GiB cannot hold its window there).
"tight": every row's window and half the staging, so the staging ring is re-made with fewer regions.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402
from tierkv.units import parse_bytes  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
BIG, SMALL = 2 * GiB, GiB // 2
STAGING = 128 * MiB


def resize_config(out: str, policy: str, kv_bytes_per_token: int, context: int) -> dict:
    """A hot window that fits 0.5 GiB: 1024-token window and prefill chunks, 128 MiB staging."""
    config = {"cache": {"block_tokens": 16 if policy == "exact" else 64, "window_tokens": 1024, "gpu_budget_bytes": BIG},
              "tiers": [{"kind": "cpu", "capacity_bytes": kv_bytes_per_token * (2 * context + 4096)}],
              "scheduler": {"lookahead_layers": 2, "staging_bytes": STAGING, "prefill_chunk_tokens": 1024}}
    if policy == "sparse":
        config["scheduler"].update(policy="sparse", sparse_token_budget=1024)
    return config


def tight_budget(llm) -> int:
    """A budget that holds every row's window beside half the start-up staging: the ring is re-made with
    fewer regions of its start-up size (far_staging.ChunkGrid), which must change no token either."""
    return llm.resizer.rows_pool_bytes + llm.summary_reserved_bytes + llm.full_graph_reserved_bytes + STAGING // 2


def free_elsewhere() -> int:
    """Free device bytes as a second process sees them."""
    code = "import torch; print(torch.cuda.mem_get_info()[0])"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def timed_resize(llm, budget: int) -> dict:
    before_stats, before_free, before_held = llm.stats(), free_elsewhere(), allocator_bytes()
    started = time.perf_counter()
    llm.set_gpu_budget(budget)
    seconds = time.perf_counter() - started
    after_free, after_stats, after_held = free_elsewhere(), llm.stats(), allocator_bytes()
    after = after_stats["gpu"]
    staging = [s.get("hot_window", {}).get("staging_bytes", 0) for s in (before_stats, after_stats)]
    # the pool's bytes and the staging's (the ring; sparse: its eager regions and far-block caches too)
    expected = before_stats["gpu"]["pool_bytes"] - after["pool_bytes"] + staging[0] - staging[1]
    return {"budget_bytes": budget, "resize_s": seconds, "pool_blocks": after["pool_blocks"],
            "changed": after["pool_blocks"] != before_stats["gpu"]["pool_blocks"] or staging[0] != staging[1],
            "staging_bytes": staging[1],
            "vllm_num_gpu_blocks": llm.engine.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "expected_freed_bytes": expected, "freed_elsewhere_bytes": after_free - before_free,
            "freed_fraction": (after_free - before_free) / expected if expected else None,
            # this process's caching allocator (the engine runs in-process): tensors dropped, segments released
            "allocated_freed_bytes": before_held[0] - after_held[0], "reserved_freed_bytes": before_held[1] - after_held[1]}


def allocator_bytes() -> tuple[int, int]:
    """(allocated, reserved) bytes of this process's CUDA caching allocator."""
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def decode_row(llm, prompt: list[int], tokens: int, reference: list[int] | None) -> dict:
    """The prompt with 1 and with `tokens` new tokens, both served the prefix by the tiers (the prompt
    ran before): their difference over tokens - 1 is the decode time per token."""
    one = llm.generate([prompt], max_new_tokens=1, ignore_eos=True)[0]
    full = llm.generate([prompt], max_new_tokens=tokens, ignore_eos=True)[0]
    decode_ms = 1e3 * (full.stats["batch_wall_s"] - one.stats["batch_wall_s"]) / max(1, tokens - 1)
    return {"decode_ms_per_token": decode_ms, "tokens": full.token_ids, "margins": full.stats.get("top2_margins"),
            **compare(full, reference)}


def compare(out, reference: dict | None) -> dict:
    """Whether `out`'s greedy tokens equal the reference run's; where they part, the step and both runs' top-2
    logprob margins there (a margin within bf16 rounding is a near tie that any change of summation order flips)."""
    if reference is None:
        return {"tokens_identical": None}
    row = {"tokens_identical": out.token_ids == reference["tokens"]}
    if not row["tokens_identical"]:
        step = next((i for i, (a, b) in enumerate(zip(out.token_ids, reference["tokens"])) if a != b),
                    min(len(out.token_ids), len(reference["tokens"])))
        margin = lambda margins: margins[step] if margins and step < len(margins) else None
        row.update(first_difference_step=step, reference_margin_there=margin(reference["margins"]),
                   margin_there=margin(out.stats.get("top2_margins")))
    if reference["margins"]:
        row["reference_smallest_margin"] = min((m for m in reference["margins"] if m is not None), default=None)
    return row


def during(llm, prompt: list[int], tokens: int, budget: int, reference: dict) -> dict:
    """`budget` set from a second thread once the request runs; the request's tokens and when it applied."""
    core = llm.resizer.core
    result: dict = {"budget_bytes": budget, "pool_blocks_before": llm.stats()["gpu"]["pool_blocks"]}

    def change():
        while not core.scheduler.has_unfinished_requests():
            time.sleep(0.001)
        time.sleep(0.5)  # well into the request
        started = time.perf_counter()
        try:
            llm.set_gpu_budget(budget, timeout_s=900)
        except Exception as exc:  # a refusal or failure is the row's result
            result["error"] = f"{type(exc).__name__}: {exc}"
            return
        result["applied_after_s"] = time.perf_counter() - started
        result["applied_during_request"] = core.scheduler.has_unfinished_requests()

    thread = threading.Thread(target=change)
    thread.start()
    out = llm.generate([prompt], max_new_tokens=tokens, ignore_eos=True)[0]
    thread.join()
    result.update(**compare(out, reference), pool_blocks=llm.stats()["gpu"]["pool_blocks"])
    return result


def run(model_dir: str, out: str, context: int, decode_tokens: int, policy: str, small: int = SMALL) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tierkv.budget_change import BudgetRefused
    from tierkv.integrations.vllm.pool_sizing import checkpoint_shape
    from tierkv.llm import TieredLLM

    shape = checkpoint_shape(model_dir)
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * shape["dtype_bytes"]
    config = resize_config(out, policy, kv_per_token, context)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(context)] for _ in range(2)]
    llm = TieredLLM(model_dir, config, backend="vllm", max_model_len=context + decode_tokens + 64, max_num_seqs=1,
                    gpu_memory_utilization=0.9, skip_tokenizer_init=True, enable_prefix_caching=False)
    rows: dict = {"policy": policy, "context": context, "decode_tokens": decode_tokens, "phases": []}
    try:
        # every compared run is a repeat, its prefix served by the tiers: a first run computes the whole
        # prompt and attends its last chunk in another order, so its bf16 rounding (and, on a random model,
        # a near tie) can differ; that comparison is a row of its own
        computed = llm.generate([prompts[0]], max_new_tokens=decode_tokens, ignore_eos=True)[0]
        first = decode_row(llm, prompts[0], decode_tokens, None)
        reference = {"tokens": first["tokens"], "margins": first["margins"]}
        rows["first_run_against_repeat"] = compare(computed, reference)
        small_name = f"{small / GiB:g}GiB"
        rows["small_budget_bytes"] = small
        save = lambda: write_results(Path(out, f"bench-vllm-resize-{policy}.json"), _rows_for_file(rows),
                                     command=" ".join(sys.argv))
        rows["phases"].append({"phase": "2GiB start", **first})
        save()
        tight = tight_budget(llm)
        rows["tight_budget_bytes"] = tight
        phases = [(small, f"{small_name} between"), (tight, "tight between (ring cut)"), (BIG, "2GiB between")]
        for budget, name in phases:
            try:
                resize = timed_resize(llm, budget)
            except BudgetRefused as exc:  # (the sparse policy's summaries may leave 0.5 GiB too small: a row)
                rows["phases"].append({"phase": name, "refused": str(exc)})
                save()
                continue
            rows["phases"].append({"phase": name, **resize, **decode_row(llm, prompts[0], decode_tokens, reference)})
            save()
        llm.generate([prompts[1]], max_new_tokens=1, ignore_eos=True)  # its blocks into the tiers
        second_out = llm.generate([prompts[1]], max_new_tokens=decode_tokens, ignore_eos=True)[0]
        second = {"tokens": second_out.token_ids, "margins": second_out.stats.get("top2_margins")}
        rows["phases"].append({"phase": f"{small_name} during", **during(llm, prompts[1], decode_tokens, small, second)})
        save()
        rows["phases"].append({"phase": "2GiB during", **during(llm, prompts[1], decode_tokens, BIG, second)})
        rows["stats"] = llm.stats()["gpu"]
    except Exception:  # the phases so far and the failure go to the JSON: one device call, no second try
        rows["error"] = traceback.format_exc()
        print(rows["error"], file=sys.stderr)
    finally:
        rows = _rows_for_file(rows)
        write_results(Path(out, f"bench-vllm-resize-{policy}.json"), rows, command=" ".join(sys.argv))  # before close
        print(json.dumps(rows, indent=1), flush=True)
        llm.close()
    return rows


def _rows_for_file(rows: dict) -> dict:
    """The rows without the phases' token lists (the file says whether they were identical)."""
    return {**rows, "phases": [{k: v for k, v in phase.items() if k not in ("tokens", "margins")} for phase in rows["phases"]]}


def table(folder: str) -> str:
    """Each phase of the bench-vllm-resize-*.json files under `folder`: the resize's time, the bytes another
    process saw freed over the pool's and staging's change (and this process's allocator: tensors dropped,
    bytes released), decode ms per token, tokens as the reference."""
    mib = lambda b: "" if b is None else f"{b / MiB:.0f}"
    lines = ["policy phase                      resize_ms freed/expected seen_MiB expected_MiB allocated_MiB reserved_MiB "
             "decode_ms same_tokens"]
    for path in sorted(Path(folder).rglob("bench-vllm-resize-*.json")):
        rows = json.loads(path.read_text())["results"]
        for ph in rows["phases"]:
            fraction, ms = ph.get("freed_fraction"), ph.get("resize_s")
            decode = ph.get("decode_ms_per_token")
            lines.append(f"{rows['policy']:<6} {ph['phase']:<26} {'' if ms is None else f'{1e3 * ms:.1f}':>9} "
                         f"{'' if fraction is None else f'{fraction:.3f}':>14} {mib(ph.get('freed_elsewhere_bytes')):>8} "
                         f"{mib(ph.get('expected_freed_bytes')):>12} {mib(ph.get('allocated_freed_bytes')):>13} "
                         f"{mib(ph.get('reserved_freed_bytes')):>12} {'' if decode is None else f'{decode:.1f}':>9} "
                         f"{ph.get('tokens_identical')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("model_dir")
    r.add_argument("out")
    r.add_argument("--context", type=int, default=130000)
    r.add_argument("--decode-tokens", type=int, default=64)
    r.add_argument("--policy", choices=("exact", "sparse"), default="exact")
    r.add_argument("--small", default="0.5GiB", help="the shrunk budget (bytes or a size such as 768MiB)")
    t = sub.add_parser("table", help="one line per phase of the runs' JSON files under a folder")
    t.add_argument("folder")
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(table(args.folder))
        return 0
    try:
        small = parse_bytes(args.small)
    except ValueError as exc:
        p.error(f"--small {args.small}: {exc}")
    if not 0 < small < BIG:
        p.error(f"--small {args.small}: must be above 0 and below the 2 GiB start")
    run(args.model_dir, args.out, args.context, args.decode_tokens, args.policy, small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
