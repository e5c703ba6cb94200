"""vLLM at a fixed GPU memory for KV: the largest batch of 128k requests and its aggregate decode tokens/s.

    python benchmarks/bench_vllm_batch.py run MODE DIR OUT [--kv-gib 60] [--requests N] [--new-tokens N]
        [--storage-dtype float8_e4m3fn]   (tierkv: the CPU tier's storage, one byte per value: twice the requests)
    python benchmarks/bench_vllm_batch.py table OUT
    MODE: plain | tierkv-sparse | tierkv-sparse-graphs | tierkv-sparse-full (--compiled) | tierkv-shipped
          (DIR: the model of bench_vllm.py model)

tierkv-shipped runs configs/vllm-128k-sparse.yaml as shipped (compiled, its own scheduler settings, sized for the
batch by TieredLLM), only the GPU budget (--kv-gib) and the CPU tier (host-sized, --storage-dtype) set here.

Issue 4's batch target (sparse mode at least 3x all-in-GPU's aggregate tokens/s at the same GPU
memory for KV). One engine per process. Plain vLLM gets a KV pool of exactly `--kv-gib`
(`kv_cache_memory_bytes`) and runs as many 128k requests (prompt + generated tokens = 131072) as that pool holds at once.
tierkv's hot window with the sparse policy gets the same GPU memory (vLLM's pool for the windows,
staging, and the key summaries of every request); its far KV lives in the pinned CPU tier, so its batch is bounded by host memory:
by default the requests 70% of this machine's RAM holds. All requests are added at once, the
engine is stepped to the end; rows: requests, GPU bytes for KV (tierkv: pool + staging + key
summaries), time until every request has its first token, and the aggregate decode rate over
the steps in which every request decoded one token (`full_batch_tokens_per_s`; prefill chunks are
interleaved with the first requests' decode before that, so `--new-tokens` must outlast the
prefills: by default each request's chunked-prefill steps, 131072 / vLLM's max_num_batched_tokens, plus 128). A row without such steps says so in the table. `decode_tokens_per_s` (the tokens after every request's first token,
over the time left) is kept; it mixes in the finishing tail.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_vllm import (  # noqa: E402
    SPARSE_HOT_WINDOW, _start_profiler, _stop_profiler, _write_profile, baseline, connector_lines, file_mode,
    kv_bytes_per_token, overlap_text, shipped_sparse_config)
from benchmarks.models import LLAMA_8B  # noqa: E402

MODES = ("plain", "tierkv-sparse", "tierkv-sparse-graphs", "tierkv-sparse-full", "tierkv-shipped")
MAX_MODEL_LEN = 131072
FULL_BATCH_STEPS = 128  # decode steps of the whole batch the --new-tokens default leaves after the prefills


def default_new_tokens(requests: int, chunk_tokens: int) -> int:
    """New tokens per request that outlast the batch's prefills: the first request decodes one token per
    step while the others prefill (a 128k prompt takes 131072 / chunk_tokens chunked-prefill steps, with
    vLLM's max_num_batched_tokens as the chunk), then FULL_BATCH_STEPS steps in which every request decodes."""
    return -(-MAX_MODEL_LEN // max(1, chunk_tokens)) * requests + FULL_BATCH_STEPS


def host_requests(per_request_bytes: int) -> int:
    """Requests whose far KV 70% of this machine's RAM holds in the pinned CPU tier (one request's
    bytes each, plus 1 GiB), counting what the tier's slab locks (`slab_locked_bytes`: its own
    size when cupy pins it exactly, else PyTorch's power-of-two round-up; an 81 GiB tier for 5
    requests once failed on the GPU machine's 128 GiB)."""
    from tierkv.storage.pinned_slab import slab_locked_bytes

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = max(1, int(0.7 * ram) // per_request_bytes)
    while n > 1 and slab_locked_bytes(n * per_request_bytes + (1 << 30)) > 0.7 * ram:
        n -= 1
    return n


def host_bytes_per_request(layers: int, storage_dtype: str) -> int:
    """CPU-tier bytes of one request of MAX_MODEL_LEN tokens: bf16 blocks, or under a quantized
    storage dtype one byte per value plus a float32 scale per block, K/V and KV head."""
    per_request = kv_bytes_per_token(layers) * MAX_MODEL_LEN
    if storage_dtype in ("auto", "bfloat16"):
        return per_request
    blocks = -(-MAX_MODEL_LEN // SPARSE_HOT_WINDOW["cache"]["block_tokens"]) * layers
    return per_request // 2 + blocks * 2 * LLAMA_8B["num_key_value_heads"] * 4


def graphed_staging_bytes(model_dir: str, requests: int, storage_dtype: str, cache_selections: int = 1) -> int:
    """scheduler.staging_bytes for `requests` graphed rows: SPARSE_HOT_WINDOW's, or more where their
    far-block caches (`cache_selections` selections per layer each; a quantized tier's code buffers
    beside them) with the eager regions need it: what TieredLLM's batch sizing computes
    (`tierkv.integrations.vllm.batch_sizing.graphed_staging_need`, from the checkpoint's shape)."""
    from tierkv.config import load_config
    from tierkv.integrations.vllm.batch_sizing import graphed_staging_need

    config = load_config({"cache": SPARSE_HOT_WINDOW["cache"],
                          "scheduler": {**SPARSE_HOT_WINDOW["scheduler"], "sparse_cache_selections": cache_selections},
                          "tiers": [{"kind": "cpu", "capacity_bytes": "1GiB", "storage_dtype": storage_dtype}]}, env={})
    return max(config.scheduler.staging_bytes, graphed_staging_need(model_dir, config, requests, {}))


def engine(mode: str, model_dir: str, kv_bytes: int, requests: int, layers: int, storage_dtype: str = "auto",
           cache_selections: int = 1, compiled: bool = False, async_scheduling: bool = False, prefetch_margin: int = 0):
    # compiled: vLLM's torch.compile and CUDA graphs (plain: full graphs for decode; tierkv's backend:
    # piecewise graphs around its attention, which replays graphs of its own)
    common = dict(max_model_len=131072, gpu_memory_utilization=0.9, enable_prefix_caching=False,
                  enforce_eager=not compiled,
                  skip_tokenizer_init=True, max_num_seqs=max(requests, 1))
    if mode == "plain":
        from vllm import LLM

        from tierkv.integrations.vllm.pool_sizing import full_decode_capture_sizes

        # compiled, the plain batch gets a full decode graph of its own size too (vLLM's default sizes stop at
        # 2, 4, 8, ... up to max_num_seqs: 3 or 10 rows would otherwise run piecewise); TieredLLM adds it for
        # tierkv-sparse-full
        graphs = {"compilation_config": {"cudagraph_capture_sizes": full_decode_capture_sizes(max(requests, 1))}}
        return LLM(model=model_dir, kv_cache_memory_bytes=kv_bytes, attention_config={"backend": "FLASH_ATTN"},
                   **common, **(graphs if compiled else {})), None
    from tierkv import TieredLLM

    per_request = host_bytes_per_request(layers, storage_dtype)
    cpu_tier = {"kind": "cpu", "capacity_bytes": requests * per_request + (1 << 30), "storage_dtype": storage_dtype}
    if mode == "tierkv-shipped":  # the file's settings; TieredLLM starts vLLM compiled and sizes the rows itself
        config = shipped_sparse_config(cpu_tier, {"cache.gpu_budget_bytes": kv_bytes})
        common = {k: v for k, v in common.items() if k not in ("enable_prefix_caching", "enforce_eager")}
        tiered = TieredLLM(model_dir, config, backend="vllm", **common)
        return tiered.engine, tiered
    # the budget holds vLLM's pool, staging and the key summaries TieredLLM reserves for
    # max_num_seqs = requests (SPARSE_HOT_WINDOW: 64-token blocks, 256 MiB per request)
    config = {"cache": {**SPARSE_HOT_WINDOW["cache"], "gpu_budget_bytes": kv_bytes},
              # one graph per layer serves every request's decoding row, each request's far-block cache in staging
              "scheduler": {**SPARSE_HOT_WINDOW["scheduler"], "sparse_cuda_graphs": mode in ("tierkv-sparse-graphs", "tierkv-sparse-full"),
                            # tierkv-sparse-full: the rows' sparse step inside vLLM's full decode graph
                            "sparse_full_graphs": mode == "tierkv-sparse-full",
                            "sparse_graph_rows": requests,
                            "staging_bytes": graphed_staging_bytes(model_dir, requests, storage_dtype, cache_selections),
                            "sparse_cache_selections": cache_selections,
                            # the blocks ranked below each selection, fetched for the next step on a side stream
                            "sparse_prefetch_margin": prefetch_margin,
                            # async scheduling keeps two batches in flight: each request's pool need grows by a
                            # chunk (2.25 GiB at 8192 tokens), which this pool (tens of GiB) holds for every request,
                            # so the chunk stays whole (halved, each chunk streams the far KV twice as often:
                            # prefill 186 s against 121 s at 27c4110); TieredLLM checks the pool before vLLM starts
                            "vllm_async_scheduling": async_scheduling},
              "tiers": [cpu_tier]}
    common = {k: v for k, v in common.items() if k != "enable_prefix_caching"}
    tiered = TieredLLM(model_dir, config, backend="vllm", **common)
    return tiered.engine, tiered


def run(mode: str, model_dir: str, out: str, kv_gib: float, requests: int | None, new_tokens: int | None, layers: int,
        storage_dtype: str = "auto", cache_selections: int = 1, profile_after: int | None = None,
        compiled: bool = False, async_scheduling: bool = False, prefetch_margin: int = 0, tag: str = "") -> None:
    """profile_after: the step after that many full-batch steps runs under torch.profiler (its kernel
    table and its host calls go to OUT/profile-batch-MODE.txt) and counts in no rate. tag: a repeat's
    name (row MODE-TAG, compared with the plain row of the same tag)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kv_bytes = int(kv_gib * 2**30)
    per_request = kv_bytes_per_token(layers) * MAX_MODEL_LEN
    if mode == "plain":
        requests = requests or kv_bytes // per_request  # what the pool holds at once
    else:
        requests = requests or host_requests(host_bytes_per_request(layers, storage_dtype))
        if storage_dtype != "auto":
            mode = f"{mode}@{storage_dtype}"  # its own row and file
        if cache_selections != 1:
            mode = f"{mode}@cache{cache_selections}"
        if prefetch_margin:
            mode = f"{mode}@margin{prefetch_margin}"
        if async_scheduling:
            mode = f"{mode}@async"  # vLLM's async scheduling (plain vLLM has it on by default)
    if compiled or mode.startswith("tierkv-shipped"):
        mode = f"{mode}@compiled"  # against plain@compiled (the shipped config runs compiled)
    if tag:
        mode = f"{mode}-{tag}"  # a repeat of the same row, kept beside it
    llm, tiered = engine(mode.split("@")[0], model_dir, kv_bytes, requests, layers, storage_dtype, cache_selections,
                         compiled, async_scheduling, prefetch_margin)
    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    new_tokens = new_tokens or default_new_tokens(requests, chunk)
    context = MAX_MODEL_LEN - max(64, new_tokens)  # prompt + generated tokens fit max_model_len
    cache_config = llm.llm_engine.vllm_config.cache_config
    pool_bytes = cache_config.num_gpu_blocks * cache_config.block_size * kv_bytes_per_token(layers)
    rng = random.Random(0)
    warm = [rng.randrange(3, 128000) for _ in range(24576)]
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    params.output_kind = RequestOutputKind.CUMULATIVE
    engine_ = llm.llm_engine
    start = time.perf_counter()
    for r in range(requests):
        engine_.add_request(f"batch-{r}", {"prompt_token_ids": [rng.randrange(3, 128000) for _ in range(context)]},
                            params)
    counts: dict[str, int] = {}
    all_first_at, decode_tokens, summary_bytes, steps = None, 0, 0, 0
    full_steps, full_s = 0, 0.0  # steps in which every request decoded one token (no prefill chunk)
    profiled = None  # (step, wall s, profile text)
    while engine_.has_unfinished_requests():
        profiler = (_start_profiler(with_stack=True)
                    if profile_after is not None and profiled is None and full_steps == profile_after else None)
        step_start = time.perf_counter()
        outputs = engine_.step()
        step_s = time.perf_counter() - step_start
        steps += 1
        if profiler is not None:
            torch.cuda.synchronize()
            profiled = (steps - 1, time.perf_counter() - step_start,
                        _stop_profiler(profiler, Path(out) / f"trace-batch-{file_mode(mode)}.json"))
        new, grew = 0, []
        for output in outputs:
            n = len(output.outputs[0].token_ids)
            grew.append(n - counts.get(output.request_id, 0))
            new += grew[-1]
            counts[output.request_id] = n
        if (profiler is None and len(grew) == requests and all(g == 1 for g in grew)
                and all(n > 1 for n in counts.values())):
            full_steps += 1
            full_s += step_s
        if all_first_at is not None:
            decode_tokens += new
        elif len(counts) == requests and all(n >= 1 for n in counts.values()):
            all_first_at = time.perf_counter()
            if tiered is not None:  # every request alive: its key summaries are on the GPU now
                summary_bytes = tiered.stats().get("hot_window", {}).get("summary_bytes", 0)
    end = time.perf_counter()
    staging = tiered.config.scheduler.staging_bytes if tiered is not None else 0
    reserved = tiered.summary_reserved_bytes if tiered is not None else 0
    full_graph = tiered.full_graph_reserved_bytes if tiered is not None else 0  # the full graph's codes (fp8 tier)
    row = {"mode": mode, "tag": tag, "storage_dtype": storage_dtype, "requests": requests, "context": context, "new_tokens": new_tokens, "kv_gib": kv_gib,
           "gpu_kv_bytes": pool_bytes + staging + max(reserved, summary_bytes) + full_graph, "vllm_pool_bytes": pool_bytes,
           "tierkv_staging_bytes": staging, "summary_reserved_bytes": reserved, "summary_bytes": summary_bytes,
           "full_graph_reserved_bytes": full_graph,
           "steps": steps,
           "all_first_token_s": all_first_at - start if all_first_at else float("nan"),
           "decode_tokens": decode_tokens,
           "decode_tokens_per_s": decode_tokens / (end - all_first_at) if all_first_at and end > all_first_at else 0.0,
           "full_batch_steps": full_steps,
           "full_batch_tokens_per_s": requests * full_steps / full_s if full_s else float("nan"),
           **(selection_bound(tiered, requests, layers, storage_dtype) if tiered is not None else {}),
           "connector": tiered.stats() if tiered is not None else None}
    if profiled is not None:
        _write_profile(Path(out) / f"profile-batch-{file_mode(mode)}.txt", [profiled])
    path = Path(out) / f"bench-vllm-batch-{file_mode(mode)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=1, default=str))
    print(json.dumps({k: v for k, v in row.items() if k != "connector"}))


def selection_bound(tiered, requests: int, layers: int, storage_dtype: str) -> dict:
    """What the PCIe copies of the selections allow, measured against this machine's H2D ceiling:
    without reuse every step copies each request's selected far blocks of every layer, so
    `requests` tokens per step take at least those bytes over PCIe; with the far-block caches only
    the fraction of them the run fetched."""
    from benchmarks._common import h2d_ceiling_gbps

    cache, scheduler = tiered.config.cache, tiered.config.scheduler
    blocks = -(-MAX_MODEL_LEN // cache.block_tokens) * layers
    block_bytes = host_bytes_per_request(layers, storage_dtype) // blocks  # one block of one layer, with its scales
    step_bytes = requests * layers * (scheduler.sparse_token_budget // cache.block_tokens) * block_bytes
    ceiling = h2d_ceiling_gbps()
    # the far-block caches (graphed rows) keep what a selection shares with the step before: only the
    # rest crosses PCIe; the fraction fetched over the whole run
    hot = tiered.stats().get("hot_window", {})
    selected = hot.get("sparse_selected_reads", 0)
    fetched = (selected - hot.get("cache_hits", 0)) / selected if selected else 1.0
    return {"selected_bytes_per_step": step_bytes, "h2d_ceiling_gbps": ceiling,
            "pcie_bound_tokens_per_s": requests * ceiling * 1e9 / step_bytes, "fetched_fraction": fetched,
            "gpu_hit_rate": hot.get("gpu_hit_rate"), "selection_overlap": hot.get("selection_overlap"),
            "pcie_bound_fetched_tokens_per_s": requests * ceiling * 1e9 / (step_bytes * fetched) if fetched else None}


def table(out: str) -> None:
    rows = {r["mode"]: r for r in (json.loads(p.read_text()) for p in sorted(Path(out).glob("bench-vllm-batch-*.json")))}
    print(f"{'mode':<46} {'requests':>8} {'GPU KV GiB':>10} {'first tokens s':>14} {'full-batch steps':>16} "
          f"{'tok/s':>7} {'x plain':>7}")
    for mode, r in rows.items():
        plain = baseline(rows, r)  # run the same way, the same tag's where there is one
        rate = r.get("full_batch_tokens_per_s", float("nan"))  # every request decoding in the step
        base = plain.get("full_batch_tokens_per_s", float("nan")) if plain else float("nan")
        print(f"{mode:<46} {r['requests']:>8} {r['gpu_kv_bytes'] / 2**30:>10.2f} {r['all_first_token_s']:>14.2f} "
              f"{r.get('full_batch_steps', 0):>16} {rate:>7.1f} {rate / base if base else float('nan'):>7.2f}")
        if r.get("pcie_bound_tokens_per_s"):
            bound = r["pcie_bound_tokens_per_s"]
            print(f"{'':<46} the selections' copies alone allow {bound:.0f} tokens/s "
                  f"({bound / base if base else float('nan'):.2f}x plain): {r['selected_bytes_per_step'] / 1e9:.2f} GB "
                  f"per step at {r['h2d_ceiling_gbps']:.1f} GB/s")
        if r.get("pcie_bound_fetched_tokens_per_s"):  # rows recorded with the far-block caches
            bound = r["pcie_bound_fetched_tokens_per_s"]
            print(f"{'':<46} {r['fetched_fraction']:.3f} of the selected blocks fetched (GPU hit rate "
                  f"{r['gpu_hit_rate']:.3f}, selection overlap {overlap_text(r['selection_overlap'])}): the copies then "
                  f"allow {bound:.0f} tokens/s ({bound / base if base else float('nan'):.2f}x plain)")
        for line in connector_lines(r.get("connector")):
            print(f"{'':<46} {line}")
        if not r.get("full_batch_steps"):
            print(f"{'':<46} no step decoded every request: the first ones finished while the last prefilled; "
                  f"rerun with more than --new-tokens {r['new_tokens']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["run", "table"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--kv-gib", type=float, default=60.0, help="GPU memory for KV, both engines")
    parser.add_argument("--requests", type=int, default=None, help="default: what the pool (plain) or host RAM (tierkv) holds")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="per request; enough that the first request still decodes once the last one's prefill is "
                             f"done (default: the prefill steps of a 128k prompt per request + {FULL_BATCH_STEPS})")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--cache-selections", type=int, default=1,
                        help="tierkv graphs: scheduler.sparse_cache_selections, selections each request's far-block cache "
                             "keeps per layer (row MODE@cacheN; staging grows to hold them)")
    parser.add_argument("--storage-dtype", default="auto", choices=["auto", "float8_e4m3fn", "int8"],
                        help="tierkv modes: the CPU tier's storage dtype (quantized: half the host bytes and PCIe bytes)")
    parser.add_argument("--compiled", action="store_true",
                        help="vLLM compiled with CUDA graphs, not eager (row MODE@compiled, against plain@compiled)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="tierkv modes: scheduler.vllm_async_scheduling, vLLM's async scheduling (row MODE@async)")
    parser.add_argument("--prefetch-margin", type=int, default=0,
                        help="tierkv-sparse-full: scheduler.sparse_prefetch_margin, blocks per layer ranked below each "
                             "selection fetched for the next step on a side stream (row MODE@marginN; needs "
                             "--cache-selections 2 or more)")
    parser.add_argument("--profile-after", type=int, default=None,
                        help="profile the step after this many full-batch steps (OUT/profile-batch-MODE.txt)")
    parser.add_argument("--tag", default="", help="a repeat's name: row MODE-TAG, against plain's row of the same tag")
    args = parser.parse_args()
    if args.what == "table":
        table(args.rest[0])
        return 0
    mode, model_dir, out = args.rest
    if mode not in MODES:
        parser.error(f"MODE: got {mode!r}; one of {', '.join(MODES)}")
    if mode == "tierkv-shipped" and (args.cache_selections != 1 or args.async_scheduling or args.prefetch_margin
                                     or args.compiled):
        parser.error("MODE tierkv-shipped: the shipped config's own settings (no --cache-selections, "
                     "--async-scheduling, --prefetch-margin or --compiled)")
    if mode == "tierkv-sparse-full" and not args.compiled:
        parser.error("MODE tierkv-sparse-full: needs --compiled (vLLM's full decode graph)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if mode == "plain" and args.storage_dtype != "auto":
        parser.error("--storage-dtype: plain vLLM has no CPU tier")
    if args.cache_selections < 1 or (mode == "plain" and args.cache_selections != 1):
        parser.error(f"--cache-selections {args.cache_selections}: at least 1, and tierkv modes only")
    if mode == "plain" and args.async_scheduling:
        parser.error("--async-scheduling: tierkv modes only (plain vLLM runs its own default, async on)")
    if args.tag and not args.tag.isalnum():
        parser.error(f"--tag: got {args.tag!r}; letters and digits only (it names a file the device returns)")
    if args.prefetch_margin and (mode != "tierkv-sparse-full" or args.cache_selections < 2):
        parser.error(f"--prefetch-margin {args.prefetch_margin}: MODE tierkv-sparse-full with --cache-selections 2 "
                     "or more")
    run(mode, model_dir, out, args.kv_gib, args.requests, args.new_tokens, args.layers, args.storage_dtype,
        args.cache_selections, args.profile_after, args.compiled, args.async_scheduling, args.prefetch_margin,
        args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
