"""Sparse mode on the GPU: decode speed and GPU hit rate at 128k against all-in-GPU dense decode.

    python benchmarks/bench_sparse.py [--context 131072] [--new-tokens 32] [--budget-tokens 2048]
        [--predictor previous|none|query|cache] [--lookahead 1] [--cache-selections 4] [--prefetch-margin 0]
        [--qk-bias-std 0] [--out PATH]

Same Llama-3.1-8B-shaped model (random bf16 weights) and prompt for both paths, in one run:
all-in-GPU DynamicCache (sdpa) and tierkv sparse mode with a GPU KV budget of one eighth of
the full KV (resident slots + staging + block summaries). A second all-in-GPU baseline is a
preallocated StaticCache (DynamicCache copies every layer's K/V into a larger tensor each step; a
StaticCache is written in place; `--no-static-baseline` leaves it out).
All prefill, then their decode steps take turns (every cache on the GPU at once), so a host that
slows down for a while, as the shared GPU machine's does, slows every run alike; ratios are given by
the medians and step by step, and each run's allocator calls during decode are counted
(`--sequential`: one request after the other, DynamicCache only). Reports decode ms per token and the
ratio (target: tierkv at least 0.9x all-in-GPU tokens/s), the GPU hit rate of the selected far
blocks after the first decode step (target >= 95%), stalls per step, prefetch precision and
recall, and greedy-token agreement (sparse attention reads a subset, so tokens may differ; the
count is reported, not asserted). With `--predictor query` the staging memory holds a far-block
cache of `--cache-selections` selections per layer (LRU, kept across steps) plus a miss area,
and the next `--lookahead` layers are predicted from each layer's input hidden state. With
`--predictor cache` the staging memory holds `--cache-selections` selections per layer, and
`--prefetch-margin` m copies in, per layer and step, the m blocks ranked just below the selection for
the next step (the GPU hit rate per decode step is reported too).

This is the transformers engine. Under vLLM, the serving engine, the same targets are measured
against plain vLLM in the same device call: by `bench_vllm.py` at batch 1 (`vllm-ab` in
run_gpu.py), and by `bench_vllm_batch.py` for the largest batch at 60 GiB of GPU KV
(`benchmarks/RESULTS.md`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import write_results  # noqa: E402
from benchmarks.bench_exact import run_request, warm_up  # noqa: E402
from benchmarks.models import kv_bytes_per_token, llama_8b_shaped  # noqa: E402


@torch.no_grad()
def decode_in_turns(model, runs: list[tuple], ids: list[int], num_new: int, gpu_time: bool = False) -> dict[str, dict]:
    """runs: (name, cache, prefill chunk, on_token or None, attention implementation, whether its decode
    steps go through a `tierkv.engine.decode_graph.DecodeStep`: replayed from a CUDA graph). Prefill every
    run's cache with `ids`, then decode `num_new` greedy tokens, one step of each run in turn (round
    robin: each run's step always follows the same other run's), each step timed alone: a host or GPU
    that slows down for a while slows every run's steps alike. Per run: prefill_s, decode_ms_per_token
    (the median step after the first), per-step ms, tokens, top-2 margins, on CUDA what its decode
    steps asked of the caching allocator (`allocator`: cudaMalloc and cudaFree calls, retries after a
    failed allocation, which free the cache and synchronize), and the prefill's last logits (float32,
    on the device; `prefill_logits`, not for the JSON). gpu_time: after the timed steps, one more step
    of each run under the profiler, its kernels' device time summed (`gpu_busy_ms`: the step's GPU
    work, whatever the host adds)."""
    from tierkv.integrations.hf import forward_kwargs
    from tierkv.engine.decode_graph import DecodeStep

    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    state = {}
    counted = ("num_device_alloc", "num_device_free", "num_alloc_retries")

    def allocator() -> list[int]:
        stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
        return [stats.get(key, 0) for key in counted]

    def attention(name: str) -> None:  # the run's attention function, set outside the timings
        if model.config._attn_implementation != state[name]["attn"]:
            model.set_attn_implementation(state[name]["attn"])

    for name, cache, chunk, on_token, attn, graphed in runs:
        state[name] = {"attn": attn}
        attention(name)
        kwargs = forward_kwargs(model, cache)
        sync()
        start = time.perf_counter()
        for pos in range(0, len(ids), chunk):
            logits = model(torch.tensor([ids[pos : pos + chunk]], device=device), logits_to_keep=1, **kwargs).logits[0, -1]
        sync()
        state[name].update(kwargs=kwargs, logits=logits, on_token=on_token, prefill_s=time.perf_counter() - start,
                           decode=DecodeStep(model, cache) if graphed else None,
                           tokens=[], top2_margins=[], step_ms=[], prefill_logits=logits.float().clone(),
                           allocator=[0] * len(counted))
    for step in range(num_new):
        for name, *_ in runs:
            run = state[name]
            top2 = torch.topk(run["logits"].float(), 2).values
            run["top2_margins"].append(float(top2[0] - top2[1]))  # a small margin is a near-tie
            token = int(torch.argmax(run["logits"]))
            run["tokens"].append(token)
            if run["on_token"] is not None:
                run["on_token"](token)
            attention(name)
            before = allocator()
            start = time.perf_counter()
            run["logits"] = (run["decode"](token) if run["decode"] is not None else
                             model(torch.tensor([[token]], device=device), logits_to_keep=1, **run["kwargs"]).logits[0, -1])
            sync()
            run["step_ms"].append(1e3 * (time.perf_counter() - start))
            run["allocator"] = [total + after - b for total, after, b in zip(run["allocator"], allocator(), before)]
    for name, *_ in runs if gpu_time else ():
        attention(name)
        state[name]["gpu_busy_ms"] = step_gpu_ms(lambda run=state[name]: (
            run["decode"](int(torch.argmax(run["logits"]))) if run["decode"] is not None else
            model(torch.argmax(run["logits"]).view(1, 1), logits_to_keep=1, **run["kwargs"])))
    rows = {}
    for name, run in state.items():
        later = run["step_ms"][1:] or run["step_ms"]
        rows[name] = {"prefill_s": run["prefill_s"], "decode_ms_per_token": statistics.median(later),
                      "step_ms": run["step_ms"], "tokens": run["tokens"], "top2_margins": run["top2_margins"],
                      "allocator": dict(zip(("device_mallocs", "device_frees", "alloc_retries"), run["allocator"])),
                      "prefill_logits": run["prefill_logits"], "gpu_busy_ms": run.get("gpu_busy_ms")}
    return rows


def step_gpu_ms(step) -> float:
    """The device time of the kernels `step()` runs (torch.profiler, CUDA activity), summed, in ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 1e3


def logits_gap(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """How far one prefill's last logits lie from another's: largest absolute difference, relative L2
    difference, and whether their greedy tokens agree."""
    return {"max_abs_diff": float((logits - reference).abs().max()),
            "relative_l2": float((logits - reference).norm() / reference.norm()),
            "same_greedy_token": bool(int(torch.argmax(logits)) == int(torch.argmax(reference)))}


def query_hit_rate(steps: list[dict]) -> float | None:
    """Selected far blocks found in the far-block cache over all selected, summed over `steps`."""
    needed = sum(s["needed"] for s in steps)
    return sum(s["hits"] for s in steps) / needed if needed else None


BLOCK_TOKENS = 64


def sparse_settings(args: argparse.Namespace, full_kv: int) -> tuple[dict, int]:
    """tierkv's config for the run (one eighth of the full KV on the GPU: resident slots + staging + the
    key summaries), and the summaries' bytes."""
    budget_blocks = args.budget_tokens // BLOCK_TOKENS
    block_bytes = full_kv // args.context // args.layers * BLOCK_TOKENS
    if args.predictor == "query":  # [ layer 0: C | ... | layer L-1: C | miss area: k ], C = selections x k
        staging = (args.layers * args.cache_selections + 1) * budget_blocks * block_bytes
    elif args.predictor == "cache":  # [ layer 0: C | ... | layer L-1: C ]
        staging = args.layers * args.cache_selections * budget_blocks * block_bytes
    else:
        staging = (args.layers + 1) * budget_blocks * block_bytes
    summaries = 2 * 8 * 128 * 2 * (args.context // BLOCK_TOKENS) * args.layers
    return {
        "cache": {"block_tokens": BLOCK_TOKENS, "gpu_budget_bytes": full_kv // 8 - staging - summaries,
                  "sink_tokens": 64, "window_tokens": 1024},
        "tiers": [{"kind": "cpu", "capacity_bytes": int(full_kv * 1.1)}],
        "scheduler": {"policy": "sparse", "predictor": args.predictor, "sparse_token_budget": args.budget_tokens,
                      "staging_bytes": staging, "prefill_chunk_tokens": 32768, "lookahead_layers": args.lookahead,
                      "predict_with_previous": not args.no_previous,
                      **({"sparse_cache_selections": args.cache_selections,
                          "sparse_prefetch_margin": args.prefetch_margin} if args.predictor == "cache" else {})},
    }, summaries


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget-tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--predictor", choices=["previous", "none", "query", "cache"], default="previous",
                        help="previous: prefetch each layer's last selection; none: fetch the selection at once, "
                             "the slot list staying on the device (no host sync per layer); query: predict the "
                             "next layers' selection from the hidden state into an LRU far-block cache; cache: "
                             "the vLLM backend's far-block caches and sparse step, one CUDA graph per layer")
    parser.add_argument("--lookahead", type=int, default=1, help="layers predicted ahead (predictor query)")
    parser.add_argument("--cache-selections", type=int, default=4,
                        help="far-block cache slots per layer, in selections of --budget-tokens (predictors query "
                             "and cache)")
    parser.add_argument("--prefetch-margin", type=int, default=0,
                        help="predictor cache: blocks ranked just below each layer's selection, copied in for the next "
                             "step (scheduler.sparse_prefetch_margin; at most (cache selections - 1) x the selection)")
    parser.add_argument("--profile", action="store_true",
                        help="profile tierkv's last two decode steps (torch.profiler): the ops by device and host time "
                             "into --out with .txt for .json, their top rows printed")
    parser.add_argument("--sequential", action="store_true",
                        help="decode all-in-GPU's tokens first, then tierkv's (default: their steps in turn, so that "
                             "host or GPU slowdowns fall on both alike; --profile implies it)")
    parser.add_argument("--no-static-baseline", action="store_true",
                        help="steps in turn: leave out the second all-in-GPU baseline, a preallocated StaticCache "
                             "(DynamicCache grows every layer's K/V by a copy each step; a StaticCache writes in place)")
    parser.add_argument("--prefill-control", action="store_true",
                        help="steps in turn: a third run, all-in-GPU prefilled in tierkv's 32768-token chunks, to show how "
                             "far the prefill's rounding alone moves the logits and tokens on this random model")
    parser.add_argument("--gpu-time", action="store_true",
                        help="steps in turn: one more step of each run after the timed ones, under the profiler: its "
                             "kernels' device time (how much of a step is GPU work)")
    parser.add_argument("--no-decode-graph", action="store_true",
                        help="steps in turn: run tierkv's decode steps eagerly through the model, not replayed from one "
                             "CUDA graph per step (tierkv.engine.decode_graph; predictor cache only; --sequential never uses it)")
    parser.add_argument("--no-previous", action="store_true",
                        help="predictor query: do not also prefetch each layer's previous selection")
    parser.add_argument("--qk-bias-std", type=float, default=0.0,
                        help="q/k projection biases N(0, std^2) in both models: queries that keep their direction, so "
                             "consecutive selections overlap (the vLLM benchmarks' 'bias 16' model; 0: random weights)")
    parser.add_argument("--out", default="benchmarks/results/sparse-h200.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_sparse.py needs CUDA: run it on the GPU machine", file=sys.stderr)
        return 2
    from transformers import DynamicCache, StaticCache

    from tierkv.integrations.hf import ATTN_NAME, TieredCache, runtime_for_model
    from tierkv.config import load_config

    model = llama_8b_shaped(num_layers=args.layers, qk_bias_std=args.qk_bias_std)
    warm_up(model)
    ids = torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
    full_kv = kv_bytes_per_token(model) * args.context
    sequential = args.sequential or args.profile
    control = static = None  # --prefill-control: all-in-GPU prefilled in tierkv's chunks; the StaticCache baseline
    dense_cache = DynamicCache(config=model.config)
    if sequential:
        base = run_request(model, dense_cache, ids, args.new_tokens, chunk=args.context)
        dense_cache = None
        torch.cuda.empty_cache()

    settings, summaries = sparse_settings(args, full_kv)
    budget_blocks = args.budget_tokens // BLOCK_TOKENS
    config = load_config(settings, env={})
    runtime = runtime_for_model(model, config)
    try:
        cache = TieredCache(runtime, ids)
        # predictor cache: the caches' hits and misses so far, before each decode step (outside its timing)
        counts = []
        profiler = None
        if args.profile:  # before each decode step a profiler step: the last two steps recorded
            from torch.profiler import ProfilerActivity, profile, schedule

            profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                               schedule=schedule(wait=max(0, args.new_tokens - 3), warmup=1, active=2, repeat=1))
            profiler.start()

        def on_token(token: int) -> None:
            cache.seq.token_ids.append(token)
            if runtime.cached_sparse is not None:
                counts.append(runtime.cached_sparse.caches.counters[:2].tolist())
            if profiler is not None:
                profiler.step()

        if sequential:
            row = run_request(model, cache, ids, args.new_tokens, chunk=32768, on_token=on_token)
        else:  # the dense cache stays on the GPU beside tierkv's: the two runs' steps alternate
            runs = [("all_in_gpu", dense_cache, args.context, None, "sdpa", False),
                    ("tierkv_sparse", cache, 32768, on_token, ATTN_NAME, not args.no_decode_graph)]
            if not args.no_static_baseline:  # prefilled in chunks: its mask spans the whole preallocated length
                static_cache = StaticCache(config=model.config, max_cache_len=args.context + args.new_tokens + 1)  # + --gpu-time's step
                runs.insert(1, ("all_in_gpu_static", static_cache, 32768, None, "sdpa", False))
            if args.prefill_control:
                runs.append(("all_in_gpu_chunked", DynamicCache(config=model.config), 32768, None, "sdpa", False))
            rows = decode_in_turns(model, runs, ids, args.new_tokens, gpu_time=args.gpu_time)
            base, row = rows["all_in_gpu"], rows["tierkv_sparse"]
            control, static = rows.get("all_in_gpu_chunked"), rows.get("all_in_gpu_static")
            dense_cache = None
        if profiler is not None:
            profiler.stop()
            averages = profiler.key_averages()
            tables = [averages.table(sort_by=key, row_limit=25) for key in ("self_cuda_time_total", "self_cpu_time_total")]
            Path(args.out).with_suffix(".txt").write_text("\n\n".join(tables))
            print(averages.table(sort_by="self_cuda_time_total", row_limit=12))
        predictor = cache.seq.predictor  # tierkv.engine.predictors: one policy object per predictor
        prefetcher, query = getattr(predictor, "prefetcher", None), getattr(predictor, "query", None)
        read_stats = cache.seq.read_stats()  # waits for the query predictor's device counters
        cached = runtime.cached_sparse.stats() if runtime.cached_sparse is not None else None
        stats = runtime.stats()
        cache.finish()
    finally:
        runtime.close()
        model.set_attn_implementation("sdpa")
    steps = args.new_tokens
    hits, misses = ((prefetcher.num_hits, prefetcher.num_misses) if prefetcher
                    else (cached["cache_hits"], cached["cache_misses"]) if cached else (0, 0))
    first_step_misses = budget_blocks * args.layers  # nothing to prefetch before the first decode step
    row.update({
        "gpu_kv_bytes": runtime.pool.resident_bytes + runtime.pool.staging_bytes + summaries,
        "budget_bytes": full_kv // 8,
        "decode_tokens_per_s_ratio": base["decode_ms_per_token"] / row["decode_ms_per_token"],
        # decoded in turns: the median over steps of (dense step ms / tierkv step ms), neighbours in time
        "decode_tokens_per_s_ratio_paired": (statistics.median(d / t for d, t in zip(base["step_ms"][1:], row["step_ms"][1:]))
                                             if "step_ms" in row else None),
        "decoded_in_turns": not sequential,
        # with a predictor: its hits over its lookups after step 1; without: attention's resident reads
        "gpu_hit_rate_after_first_step": (hits / max(1, hits + misses - first_step_misses) if prefetcher or cached
                                          else query_hit_rate(query.step_totals[1:]) if query
                                          else read_stats["gpu_hit_rate"]),
        # predictor cache: a layer whose selection missed its cache waited for the copy (one stall, counted there)
        "stalls_per_step": stats["scheduler"]["stalls"] / steps,
        # predictor cache: the bytes its caches' misses and prefetch brought across PCIe, per decode step
        "far_bytes_copied_per_step": stats["scheduler"]["far_cache_copied_bytes"] / steps,
        "prefetch": stats["prefetch"],
        "decode_graph": stats["decode_graph"],  # steps replayed from a CUDA graph, eager steps, captures
        "tokens_agreeing_with_all_in_gpu": sum(a == b for a, b in zip(row["tokens"], base["tokens"])),
    })
    if not sequential:  # the prefills' last logits against all-in-GPU's (its chunking alone: the control's)
        reference = base.pop("prefill_logits")
        row["prefill_logits_vs_all_in_gpu"] = logits_gap(row.pop("prefill_logits"), reference)
        for other in (control, static):
            if other is not None:
                other["prefill_logits_vs_all_in_gpu"] = logits_gap(other.pop("prefill_logits"), reference)
                other["tokens_agreeing_with_all_in_gpu"] = sum(a == b for a, b in zip(other["tokens"], base["tokens"]))
        if static is not None:  # tierkv against the preallocated baseline too
            row["decode_tokens_per_s_ratio_vs_static"] = static["decode_ms_per_token"] / row["decode_ms_per_token"]
            row["decode_tokens_per_s_ratio_vs_static_paired"] = statistics.median(
                d / t for d, t in zip(static["step_ms"][1:], row["step_ms"][1:]))
    row["predictor"] = args.predictor
    if cached is not None:
        row["cached_predictor"] = cached
        counts.append([cached["cache_hits"], cached["cache_misses"]])
        # per decode step: its selections' hits over its lookups (step 1 finds the caches empty)
        row["gpu_hit_rate_per_step"] = [(h1 - h0) / max(1, (h1 - h0) + (m1 - m0))
                                        for (h0, m0), (h1, m1) in zip(counts, counts[1:])]
    row["model_qk_bias_std"] = args.qk_bias_std
    if query is not None:
        row["query_predictor"] = {"lookahead_layers": args.lookahead, "cache_slots_per_layer": query.cache.slots_per_layer,
                                  "predict_with_previous": not args.no_previous, "totals": query.totals(),
                                  "per_step": query.step_totals, "per_layer": query.layer_totals}
    results = {"context": args.context, "full_kv_bytes": full_kv, "all_in_gpu": base, "tierkv_sparse": row,
               **({"all_in_gpu_static": static} if static is not None else {}),
               **({"all_in_gpu_chunked": control} if control is not None else {})}
    write_results(args.out, results)
    print_summary(results, args.new_tokens, stats, sequential)
    return 0


def print_summary(results: dict, steps: int, stats: dict, sequential: bool) -> None:
    """The run's figures against the targets, a line each."""
    base, row, full_kv = results["all_in_gpu"], results["tierkv_sparse"], results["full_kv_bytes"]
    static, control = results.get("all_in_gpu_static"), results.get("all_in_gpu_chunked")
    cached = row.get("cached_predictor")
    print(f"decode ms/token: all-in-GPU {base['decode_ms_per_token']:.1f}, tierkv sparse {row['decode_ms_per_token']:.1f} "
          f"(tokens/s ratio {row['decode_tokens_per_s_ratio']:.2f}, target 0.90"
          + (f"; step by step {row['decode_tokens_per_s_ratio_paired']:.2f}, steps in turn)" if not sequential else ")"))
    print(f"GPU hit rate after the first step {row['gpu_hit_rate_after_first_step']:.3f} (target 0.95), "
          f"stalls per step {row['stalls_per_step']:.1f}"
          + (f", {row['far_bytes_copied_per_step'] / 2**20:.1f} MiB copied per step" if cached else "")
          + f", GPU KV {row['gpu_kv_bytes'] / 2**30:.2f} GiB "
          f"vs {full_kv / 2**30:.2f} GiB, tokens agreeing {row['tokens_agreeing_with_all_in_gpu']}/{steps}")
    if static is not None:
        print(f"against a preallocated StaticCache: all-in-GPU {static['decode_ms_per_token']:.1f} ms/token, tokens/s "
              f"ratio {row['decode_tokens_per_s_ratio_vs_static']:.2f} (step by step "
              f"{row['decode_tokens_per_s_ratio_vs_static_paired']:.2f})")
    busy = {name: r.get("gpu_busy_ms") for name, r in (("all_in_gpu", base), ("static", static), ("tierkv", row))
            if r is not None and r.get("gpu_busy_ms") is not None}
    if busy:
        print("GPU work of one step (profiled, kernels' device time): "
              + ", ".join(f"{name} {ms:.1f} ms" for name, ms in busy.items()))
    if row.get("decode_graph", {}).get("graph_steps"):
        graph = row["decode_graph"]
        print(f"tierkv decode steps: {graph['replays']} replayed from a CUDA graph, {graph['eager_steps']} eager, "
              f"{graph['captures']} captures ({graph['capture_s']:.2f} s), mean step after the first "
              f"{statistics.mean(row['step_ms'][1:]):.1f} ms")
    allocator = {name: r["allocator"] for name, r in (("all_in_gpu", base), ("tierkv", row), ("static", static),
                                                      ("chunked", control)) if r is not None and "allocator" in r}
    if allocator:
        print("caching allocator during decode (cudaMalloc, cudaFree, retries): " + ", ".join(
            f"{name} {a['device_mallocs']}/{a['device_frees']}/{a['alloc_retries']}" for name, a in allocator.items()))
    if "prefill_logits_vs_all_in_gpu" in row:
        gap = row["prefill_logits_vs_all_in_gpu"]
        print(f"prefill logits vs all-in-GPU: tierkv max |diff| {gap['max_abs_diff']:.3f}, relative "
              f"{gap['relative_l2']:.2e}, same first token {gap['same_greedy_token']}"
              + (f"; all-in-GPU in 32768-token chunks max |diff| {control['prefill_logits_vs_all_in_gpu']['max_abs_diff']:.3f}, "
                 f"relative {control['prefill_logits_vs_all_in_gpu']['relative_l2']:.2e}, same first token "
                 f"{control['prefill_logits_vs_all_in_gpu']['same_greedy_token']}, tokens agreeing "
                 f"{control['tokens_agreeing_with_all_in_gpu']}/{steps}" if control is not None else ""))
    if row.get("gpu_hit_rate_per_step"):
        late = row["gpu_hit_rate_per_step"][len(row["gpu_hit_rate_per_step"]) // 2:]
        print(f"GPU hit rate per step, second half of the steps: min {min(late):.3f}, mean {sum(late) / len(late):.3f}; "
              f"prefetch precision {stats['prefetch']['precision']}, recall {stats['prefetch']['recall']}")


if __name__ == "__main__":
    sys.exit(main())
