"""vLLM at 128k: plain vLLM, vLLM's OffloadingConnector and vLLM with the tierkv connector, side by side.

    python benchmarks/bench_vllm.py model DIR [--layers 32]        build an 8B-shaped random checkpoint
    python benchmarks/bench_vllm.py run MODE DIR OUT [--context N]  MODE: plain | offloading | lmcache | tierkv |
                                                                     tierkv-sparse | tierkv-sparse-graphs |
                                                                     tierkv-sparse-full (--compiled: the sparse step
                                                                     inside vLLM's full decode graph)
    python benchmarks/bench_vllm.py table OUT                       the rows, from OUT/bench-vllm-*.json

One engine per process (run each MODE in its own call of this script). Rows per mode: GPU memory
vLLM reserved for KV at max_model_len=131072, time to the first token of a 128k prompt (prefill),
decode ms per token (the engine stepped token by token, the same request),
and time to first token of a repeated 100k-token prefix (vLLM's own prefix cache off, so the
repeat measures the connector; repeated twice, the second without the first's one-off costs). Targets (issue 5): tierkv KV reservation at most 2 GiB against
at least 16 GiB for plain vLLM, prefill at most 1.15x plain, repeated-prefix TTFT at most 0.2x the
first. tierkv runs the hot window (`HOT_WINDOW`): its reservation is vLLM's pool plus tierkv's
staging ring; a repeated prefix loads the window's blocks and reads the rest as far blocks.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import gzip
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import CpuUse, H2DProbe, h2d_ceiling_gbps  # noqa: E402
from benchmarks.models import LLAMA_8B, draw_qk_biases  # noqa: E402
from tierkv.integrations.vllm.far_step import far_blocks  # noqa: E402


def build_model(path: str, layers: int, qk_bias_std: float = 0.0) -> None:
    """The Llama-3.1-8B shape with `layers` layers and random weights (std 0.02), saved to `path`.

    qk_bias_std > 0: q and k projections get biases drawn N(0, qk_bias_std^2) (attention_bias, as
    Qwen2 has; v and o biases zero). Random weights alone give every decode step an unrelated query,
    so consecutive sparse selections barely overlap (about 3%): no cache can hit. A fixed bias
    dominating each head's query keeps its direction from token to token, as heads with stable
    attention patterns do in trained models, so consecutive selections overlap; how much is a
    property of the draw, measured by every sparse row (`selection_overlap`), not assumed.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if qk_bias_std < 0:
        raise ValueError(f"qk_bias_std: got {qk_bias_std}; a standard deviation is at least 0")
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_8B, num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         attention_bias=qk_bias_std > 0)
    config.architectures = ["LlamaForCausalLM"]
    config.tierkv_qk_bias_std = qk_bias_std  # kept in config.json: each row says which model it ran
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        if qk_bias_std > 0:
            draw_qk_biases(model, qk_bias_std)
    model.save_pretrained(path)
    print(f"model {path}: {layers} layers" + (f", q/k biases N(0, {qk_bias_std}^2)" if qk_bias_std else ""))


def file_mode(mode: str) -> str:
    """A row's name in file names: the device returns only plain names ('@' becomes '_')."""
    return mode.replace("@", "_")


def kv_bytes_per_token(layers: int) -> int:
    return 2 * layers * LLAMA_8B["num_key_value_heads"] * LLAMA_8B["head_dim"] * 2


MODES = ("plain", "offloading", "lmcache", "tierkv", "tierkv-sparse", "tierkv-sparse-graphs", "tierkv-sparse-full",
         "tierkv-shipped")
SHIPPED_SPARSE = Path(__file__).resolve().parents[1] / "configs" / "vllm-128k-sparse.yaml"
# the exact rows (mode tierkv) keep 16-token blocks, as every earlier row of the table; configs/vllm-128k.yaml
# ships 64 since b00c9b0: its rows are tierkv@b64 (--block-tokens 64)
HOT_WINDOW = {"cache": {"block_tokens": 16, "window_tokens": 2048, "gpu_budget_bytes": "2GiB"},
              "scheduler": {"lookahead_layers": 2, "staging_bytes": "512MiB", "prefill_chunk_tokens": 8192}}
# sparse: the same 2 GiB (one eighth of a 128k request's 16 GiB) now also holds the key summaries
# (TieredLLM reserves them for max_num_seqs requests of max_model_len): 64-token blocks make them
# 256 MiB per request (1 GiB at 16), and a 384 MiB staging ring leaves vLLM the 1.375 GiB pool its
# 2048-token window and 8192-token prefill chunks need (1.26 GiB)
SPARSE_HOT_WINDOW = {"cache": {**HOT_WINDOW["cache"], "block_tokens": 64},
                     "scheduler": {**HOT_WINDOW["scheduler"], "staging_bytes": "384MiB", "policy": "sparse",
                                   "sparse_token_budget": 2048}}


def margin_staging_bytes(model_dir: str) -> int:
    """scheduler.staging_bytes for one request's far-block cache of two selections per layer (what
    `--prefetch-margin` needs) with the eager regions, plus 64 MiB: TieredLLM's batch sizing for one row
    (`tierkv.integrations.vllm.batch_sizing.graphed_staging_need`, from the checkpoint's shape)."""
    from tierkv.config import load_config
    from tierkv.integrations.vllm.batch_sizing import graphed_staging_need

    config = load_config({"cache": SPARSE_HOT_WINDOW["cache"],
                          "scheduler": {**SPARSE_HOT_WINDOW["scheduler"], "sparse_cache_selections": 2}}, env={})
    return graphed_staging_need(model_dir, config, 1, {})


def shipped_sparse_config(tier: dict, sets: dict | None = None) -> dict:
    """configs/vllm-128k-sparse.yaml as shipped, with `tier` as its only tier and `sets` ("section.key":
    value) over its keys."""
    import yaml

    config = {**yaml.safe_load(SHIPPED_SPARSE.read_text()), "tiers": [tier]}
    for key, value in (sets or {}).items():
        section, name = key.split(".")
        config[section] = {**config[section], name: value}
    return config


def engine(mode: str, model_dir: str, out: str, layers: int, tp: int = 1, transfer_backend: str = "auto",
           storage_dtype: str = "auto", compiled: bool = False, async_scheduling: bool = False,
           prefetch_margin: int = 0, block_tokens: int | None = None, shipped_set: dict | None = None,
           warm_start: bool = False):
    # warm_start: the baselines (vLLM's LLM) also run tierkv's start-up forwards (`warm_start.warm_engine`), which
    # TieredLLM runs for its eager engines: a like-for-like first repeat. compiled: vLLM's torch.compile and CUDA
    # graphs (plain: full graphs for decode; tierkv's connector makes vLLM capture piecewise, its attention runs
    # between the pieces)
    common = dict(max_model_len=131072, gpu_memory_utilization=0.85, enable_prefix_caching=False,
                  enforce_eager=not compiled,
                  tensor_parallel_size=tp,
                  skip_tokenizer_init=True, attention_config={"backend": "FLASH_ATTN"})
    if mode == "tierkv-shipped":  # configs/vllm-128k-sparse.yaml as shipped (it starts vLLM compiled), a CPU tier only
        import yaml

        from tierkv import TieredLLM

        tier = {"kind": "cpu", "capacity_bytes": 3 * kv_bytes_per_token(layers) * 131072, "storage_dtype": storage_dtype}
        # --shipped-set: a variant of the file (issue 35's prefill options)
        config = shipped_sparse_config(tier, {key: yaml.safe_load(value) for key, value in (shipped_set or {}).items()})
        hot = {k: v for k, v in common.items() if k not in ("attention_config", "enable_prefix_caching", "enforce_eager")}
        llm = TieredLLM(model_dir, config, backend="vllm", max_num_seqs=1, **hot)
        return llm.engine, llm
    if mode in ("tierkv", "tierkv-sparse", "tierkv-sparse-graphs", "tierkv-sparse-full"):  # the hot window: 2048 tokens per request in vLLM's pool
        import yaml

        from tierkv import TieredLLM

        sparse = mode.startswith("tierkv-sparse")  # decode attends 2048 far tokens chosen by key bounds; prefill stays exact
        config = {**(SPARSE_HOT_WINDOW if sparse else HOT_WINDOW),
                  "tiers": [{"kind": "cpu", "capacity_bytes": 3 * kv_bytes_per_token(layers) * 131072,
                             "storage_dtype": storage_dtype}]}
        config["scheduler"] = {**config["scheduler"], "transfer_backend": transfer_backend,
                               "vllm_async_scheduling": async_scheduling}
        if block_tokens:  # vLLM's block_size too: fewer, larger blocks (a 100k prefix's keys and pins / 4 at 64)
            config["cache"] = {**config["cache"], "block_tokens": block_tokens}
        for key, value in (shipped_set or {}).items():  # --set: a variant of the mode's config, its own row
            section, name = key.split(".")
            config[section] = {**config[section], name: yaml.safe_load(value)}
        if async_scheduling:  # two batches in flight: half the prefill chunk keeps the same pool
            config["scheduler"]["prefill_chunk_tokens"] //= 2
        if sparse:
            config["scheduler"]["sparse_cuda_graphs"] = mode in ("tierkv-sparse-graphs", "tierkv-sparse-full")
            config["scheduler"]["sparse_full_graphs"] = mode == "tierkv-sparse-full"
        if prefetch_margin:
            # caches of two selections (256 MiB more staging at 32 layers) inside the same 2 GiB: vLLM's pool
            # shrinks to 1 GiB, which holds the window and two 2048-token chunks in flight (async) or one of 4096
            config["scheduler"].update(sparse_cache_selections=2, sparse_prefetch_margin=prefetch_margin,
                                       staging_bytes=margin_staging_bytes(model_dir),
                                       prefill_chunk_tokens=2048 if async_scheduling else 4096)
        hot = {k: v for k, v in common.items() if k not in ("attention_config", "enable_prefix_caching")}
        if sparse:
            hot["max_num_seqs"] = 1  # one request at a time: the budget holds one request's summaries
        llm = TieredLLM(model_dir, config, backend="vllm", **hot)
        return llm.engine, llm
    from vllm import LLM

    if mode == "offloading":
        common["kv_offloading_size"] = 3 * kv_bytes_per_token(layers) * 131072 / 2**30  # GiB of CPU memory
    if mode == "lmcache":  # LMCache's own connector; its CPU size and chunking come from LMCACHE_* variables
        common["kv_transfer_config"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    llm = LLM(model=model_dir, **common)
    if warm_start:
        from tierkv.integrations.vllm.warm_start import warm_engine

        warm_engine(llm)
    return llm, None


def run(mode: str, model_dir: str, out: str, context: int, layers: int, with_prefix: bool = True, tp: int = 1,
        transfer_backend: str = "auto", storage_dtype: str = "auto", compiled: bool = False,
        async_scheduling: bool = False, profile_steps: list[int] | None = None, profile_prefix: bool = False, decode_tokens: int = 32,
        sample_h2d: int = 0, tag: str = "", prefetch_margin: int = 0, block_tokens: int | None = None,
        shipped_set: dict | None = None, prefix_repeats: int = 2, warm_prefix: bool = False,
        profile_prefix_later: bool = False, warm_start: bool = False, prefix_gaps: list[float] | None = None,
        no_warm_start: bool = False) -> None:
    gaps = prefix_gaps or [0.0]
    if no_warm_start:  # TieredLLM's start-up forwards replaced by nothing: the first repeat's A/B (row MODE@nowarm)
        import tierkv.integrations.vllm.llm as tiered_llm

        tiered_llm.warm_engine = lambda llm: []
    import random

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm, tiered = engine(mode, model_dir, out, layers, tp, transfer_backend, storage_dtype, compiled, async_scheduling,
                         prefetch_margin, block_tokens, shipped_set, warm_start)
    for key, value in (shipped_set or {}).items():  # a variant of the shipped file: its own row
        mode = f"{mode}@{key.split('.')[1]}{''.join(c for c in value if c.isalnum())}"
    if block_tokens:
        mode = f"{mode}@b{block_tokens}"  # tierkv's (and vLLM's) block size, its own row
    if prefetch_margin:
        mode = f"{mode}@margin{prefetch_margin}"  # the next-step prefetch, caches of two selections
    if async_scheduling:
        mode = f"{mode}@async"  # tierkv with vLLM's async scheduling (plain vLLM has it on by default)
    if transfer_backend != "auto":
        mode = f"{mode}@{transfer_backend}"  # its own row and file
    if storage_dtype != "auto":
        mode = f"{mode}@{storage_dtype}"
    if compiled or mode.startswith("tierkv-shipped"):
        mode = f"{mode}@compiled"  # the shipped sparse config runs compiled: against plain@compiled
    if warm_prefix:
        mode = f"{mode}@warmprefix"  # the warm-up served a prefix from the tiers once
    if no_warm_start:
        mode = f"{mode}@nowarm"
    if len(gaps) > 1 or gaps[0]:
        mode = f"{mode}@sets{len(gaps)}"  # more prefixes, each with its own first run (and a pause before its repeats)
    if warm_start and not mode.startswith("tierkv"):
        mode = f"{mode}@warmstart"  # a baseline given TieredLLM's start-up forwards
    if tag:
        mode = f"{mode}-{tag}"  # a repeat of the same row, kept beside it
    cache_config = llm.llm_engine.vllm_config.cache_config
    # per GPU: under tensor parallelism each rank's pool holds its 1/tp of the KV heads
    kv_reserved = cache_config.num_gpu_blocks * cache_config.block_size * kv_bytes_per_token(layers) // tp
    rng = random.Random(0)
    prompt = [rng.randrange(3, 128000) for _ in range(context)]
    prefix = [rng.randrange(3, 128000) for _ in range(100_000)]  # its own tokens: never saved by the long prompt
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True, logprobs=2)
    # warm-up, every mode alike: a 24k-token prompt and two tokens run each prefill chunk shape (16k
    # and 8k chunks), the hot window's far path (its copies and kernels), and decode once
    warm = [rng.randrange(3, 128000) for _ in range(24576)]
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    if warm_prefix:  # a short prefix, then again with another last token: served from the tiers (or vLLM's cache)
        short = [rng.randrange(3, 128000) for _ in range(12288)]
        for last in (1, 2):
            llm.generate([{"prompt_token_ids": short + [last]}], one, use_tqdm=False)
    engine_ = llm.llm_engine
    request_ids = iter(range(1 << 30))

    # every sample_h2d engine steps, the H2D bandwidth of a 32 MiB pinned copy: do slow sparse steps come
    # with a contended PCIe link or host memory? (plain reads no host memory in decode)
    probe = H2DProbe() if sample_h2d else None
    h2d_samples: list[tuple[int, float]] = []
    # the host CPU of the last request's decode steps, per thread of ours and machine-wide: host-bound steps
    # that slow down with no more work of ours show there whether another thread or process took the CPU
    cpu_use, decode_cpu = CpuUse(), {}
    add_ms: list[float] = []  # each request's add_request wall ms (its part of the TTFT outside the engine steps)

    def stepped(ids, params, profile: list[int] | None = None, label: str = ""):
        """One request, stepping the engine: (seconds to its first token, ms per later token, tokens,
        top-2 logprobs per token, wall ms of each engine step, the prefill chunks first). Decode is
        timed token by token, so a prefix served from the tiers cannot leak into it. `profile`: engine step numbers to run under torch.profiler (a
        kernel table, the steps' wall time and their summed kernel time go to OUT/profile-MODE.txt)."""
        rid = f"bench-{next(request_ids)}"
        gc_timer.take()
        params = copy.deepcopy(params)
        params.output_kind = RequestOutputKind.CUMULATIVE  # an output every step (LLM.generate sets FINAL_ONLY)
        start = time.perf_counter()
        engine_.add_request(rid, {"prompt_token_ids": ids}, params)
        add_ms.append(round(1e3 * (time.perf_counter() - start), 2))  # vLLM's input processing and block hashing
        first_at = last_at = None
        tokens, logprobs = [], []
        step_number, profiled, step_ms, step_gc = 0, [], [], []
        while engine_.has_unfinished_requests():
            # the last of several profiled steps also records Python calls (slower, but shows where host time goes)
            profiler = (_start_profiler(with_stack=len(profile) > 1 and step_number == profile[-1])
                        if profile and step_number in profile else None)
            # a lone profiled step also runs under cProfile: host time with no torch op in it shows
            # in no trace (the repeated prefix's first step: 1.9 s, 0.46 s of it traced)
            python_calls = cProfile.Profile() if profiler is not None and len(profile) == 1 else None
            step_start = time.perf_counter()
            if python_calls is not None:
                python_calls.enable()
            step_outputs = engine_.step()
            if python_calls is not None:
                python_calls.disable()
            if profiler is not None:
                torch.cuda.synchronize()
                wall_s = time.perf_counter() - step_start
                trace = Path(out) / f"trace-{file_mode(mode)}{'-' + label if label else ''}-step{step_number}.json"
                text = _stop_profiler(profiler, trace)
                if python_calls is not None:
                    listing = io.StringIO()
                    pstats.Stats(python_calls, stream=listing).sort_stats("cumulative").print_stats(45)
                    text += f"\nPython calls of the step (cProfile, by cumulative time):\n{listing.getvalue()}"
                profiled.append((step_number, wall_s, text))
            step_ms.append(round(1e3 * (time.perf_counter() - step_start), 2))
            step_gc.append(gc_timer.take())
            if probe is not None and step_number % sample_h2d == 0:  # between steps: in no step's time
                h2d_samples.append((step_number, round(probe.sample(), 2)))
            step_number += 1
            for output in step_outputs:
                if output.request_id != rid:
                    continue
                now = time.perf_counter()
                tokens, logprobs = list(output.outputs[0].token_ids), output.outputs[0].logprobs or []
                if tokens and first_at is None:
                    first_at = now
                    cpu_use.start()
                last_at = now
        decode_cpu.update(cpu_use.take())
        if profiled:
            _write_profile(Path(out) / f"profile-{file_mode(mode)}{'-' + label if label else ''}.txt", profiled)
        per_token_ms = 1e3 * (last_at - first_at) / (len(tokens) - 1) if len(tokens) > 1 else float("nan")
        if profiled:  # the profiler slows the steps it records: decode is then the mean of the other decode steps
            first_step = len(step_ms) - len(decode_steps(step_ms, tokens))
            kept = [ms for n, ms in enumerate(step_ms) if n >= first_step and n not in profile]
            per_token_ms = sum(kept) / len(kept) if kept else float("nan")
        top2 = [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in logprobs]
        return first_at - start, per_token_ms, tokens, top2, step_ms, step_gc

    def device_allocs() -> list[int]:  # (cudaMalloc calls, syncs of every stream) of the allocator so far
        stats = torch.cuda.memory_stats()
        return [stats.get("num_device_alloc", 0), stats.get("num_sync_all_streams", 0)]

    def tier_stats() -> dict:  # tierkv's stats (one device sync); none for plain vLLM
        return tiered.stats() if tiered is not None else {}

    def far_wait_s(stats: dict | None = None) -> float:  # compute's GPU-timed wait for far copies so far (hot window)
        return (stats if stats is not None else tier_stats()).get("hot_window", {}).get("wait_s", 0.0)

    def hot_counts(stats: dict) -> dict:  # the hot window's read counters so far (sparse rows)
        hot = stats.get("hot_window", {})
        return {k: hot.get(k, 0) for k in ("sparse_resident_reads", "sparse_selected_reads", "cache_hits",
                                           "cache_misses", "stalls")}

    before = tier_stats()
    wait0, reads0 = far_wait_s(before), hot_counts(before)
    gc_timer = GcTimer()
    prefill_s, decode_ms, tokens, top2_decode, step_ms, step_gc = stepped(prompt, decode, profile_steps)
    after = tier_stats()
    wait1 = far_wait_s(after)
    # the timed request's own block reads (its first decode step, whose caches start empty, included)
    reads = {k: v - reads0[k] for k, v in hot_counts(after).items()}
    total_reads = reads["sparse_resident_reads"] + reads["sparse_selected_reads"]
    if total_reads:
        reads["gpu_hit_rate"] = (reads["sparse_resident_reads"] + reads["cache_hits"]) / total_reads
    # per engine step of the timed request, tierkv's host ms: the hot window's (begin_step, attention calls) and
    # the connector hooks' (start_load_kv, save_kv_layer, wait_for_save); each list ends at its last step
    step_parts = {"step_far_host_ms": (after.get("hot_window") or {}).get("step_host_ms") or [],
                  "step_connector_ms": after.get("step_connector_ms") or []}
    step_parts = {k: v[-len(step_ms):] for k, v in step_parts.items() if len(v) >= len(step_ms)}
    staging = tiered.config.scheduler.staging_bytes if tiered is not None else 0
    # the key summaries, and over a quantized tier the full decode graph's codes, come out of the same budget
    summaries = tiered.summary_reserved_bytes if tiered is not None else 0
    full_graph = tiered.full_graph_reserved_bytes if tiered is not None else 0
    floor = {}
    if mode.split("@")[0] == "tierkv":  # exact decode reads every far block each token: the PCIe floor, same run
        cache = tiered.config.cache
        far_tokens = [far_blocks(context + k - 1, cache.window_tokens, cache.block_tokens) * cache.block_tokens
                      for k in range(1, len(tokens))]  # the decode steps after the first token
        ceiling = h2d_ceiling_gbps()
        floor = {"h2d_ceiling_gbps": ceiling,
                 "pcie_floor_ms": 1e3 * kv_bytes_per_token(layers) * sum(far_tokens) / len(far_tokens) / (ceiling * 1e9)}
    row = {"mode": mode, "tag": tag, "context": context, "layers": layers, "tensor_parallel_size": tp,
           "kv_reserved_bytes": kv_reserved + staging + summaries + full_graph,
           "vllm_pool_bytes": kv_reserved, "tierkv_staging_bytes": staging, "summary_reserved_bytes": summaries,
           "full_graph_reserved_bytes": full_graph,
           "prefill_s": prefill_s, "decode_ms_per_token": decode_ms, "tokens": tokens, "top2_logprobs": top2_decode,
           **floor, "far_wait_s": wait1 - wait0, "step_ms": step_ms, "step_gc": step_gc, "prefix_ttft_first_s": float("nan"), "prefix_ttft_repeat_s": float("nan"),
           "connector": after if tiered is not None else None, "h2d_samples": list(h2d_samples),
           "decode_cpu": dict(decode_cpu), "decode_reads": reads, **step_parts,
           "model_qk_bias_std": json.loads((Path(model_dir) / "config.json").read_text()).get("tierkv_qk_bias_std", 0.0)}
    path = Path(out) / f"bench-vllm-{file_mode(mode)}.json"  # plain names travel back from the device
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=1, default=str))  # kept if the prefix rows fail
    if with_prefix:
        try:
            # a second repeat: what the first pays once after the engine starts is gone. With profile_prefix the
            # first repeat runs under the profiler and cProfile (its first step, where the tiers serve the prefix:
            # the one-off shows there; its TTFT is the profiler's), and "repeat" and "repeat_again" are warm
            runs = ([("first", 11)] + ([("repeat_profiled", 14)] if profile_prefix else [])
                    + [("repeat", 12), ("repeat_again", 13)]
                    + [(f"repeat_{n}", 12 + n) for n in range(3, prefix_repeats + 1)]  # last ids 15, 16, ...: distinct
                    + ([("repeat_later_profiled", 13 + prefix_repeats)] if profile_prefix_later else []))
            # --prefix-gaps: more distinct prefixes, each a first run then its repeats (keys set2_first, set2_repeat,
            # set2_repeat_2, ...), with the given pause before each set's first repeat (set 1's is gaps[0]): is a first
            # repeat slow once per engine, or after every new prefix's first run (its saves landing), and does a pause
            # between the first run and the repeat change it?
            pauses = {"repeat": gaps[0]}  # before each prefix's first repeat
            for j in range(2, len(gaps) + 1):
                runs += [(f"set{j}_first", 11), (f"set{j}_repeat", 12)]
                runs += [(f"set{j}_repeat_{n}", 11 + n) for n in range(2, prefix_repeats + 1)]
                pauses[f"set{j}_repeat"] = gaps[j - 1]
            set_prefix = prefix
            for key, last in runs:  # with each run's steps, collections and far waits
                if key.startswith("set") and key.endswith("_first"):  # the next prefix's first run
                    set_prefix = [rng.randrange(3, 128000) for _ in range(100_000)]
                time.sleep(pauses.get(key, 0.0))
                wait_before, allocs_before = far_wait_s(), device_allocs()
                profile = [0] if key.endswith("_profiled") else None
                ttft_s, _, _, _, prefix_step_ms, prefix_step_gc = stepped(set_prefix + [last], one, profile, f"prefix-{key}")
                row[f"prefix_ttft_{key}_s"], row[f"prefix_{key}_far_wait_s"] = ttft_s, far_wait_s() - wait_before
                row[f"prefix_{key}_step_ms"], row[f"prefix_{key}_step_gc"] = prefix_step_ms, prefix_step_gc
                row[f"prefix_{key}_add_ms"] = add_ms[-1]
                # the caching allocator's cudaMalloc calls and all-stream syncs in the run: what a first run pays once
                row[f"prefix_{key}_device_allocs"] = [b - a for a, b in zip(allocs_before, device_allocs())]
                stats = tier_stats()  # tierkv's host ms in the run's steps, as step_far_host_ms / step_connector_ms
                for part, lists in (("far_host_ms", (stats.get("hot_window") or {}).get("step_host_ms") or []),
                                    ("connector_ms", stats.get("step_connector_ms") or [])):
                    if len(lists) >= len(prefix_step_ms):
                        row[f"prefix_{key}_step_{part}"] = lists[-len(prefix_step_ms):]
        except Exception as exc:  # recorded in the row, and the run fails after writing it
            row["prefix_error"] = f"{type(exc).__name__}: {exc}"
        row["connector"] = tiered.stats() if tiered is not None else None
        path.write_text(json.dumps(row, indent=1, default=str))
    print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "connector")}))
    if "prefix_error" in row:
        raise SystemExit(f"repeated-prefix rows failed: {row['prefix_error']}")


class GcTimer:
    """Python garbage collections while it is installed: (generation, ms) of each, taken per step."""

    def __init__(self):
        self._current: list[tuple[int, float]] = []
        self._start = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._current.append((info["generation"], round(1e3 * (time.perf_counter() - self._start), 2)))
            self._start = None

    def take(self) -> list[tuple[int, float]]:
        taken, self._current = self._current, []
        return taken


def _start_profiler(with_stack: bool = False):
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack)
    profiler.__enter__()
    return profiler


def _stop_profiler(profiler, trace: Path) -> str:
    """The step's kernel table, its GPU busy time and idle gaps, the host's CUDA runtime calls (a
    synchronizing one shows as a long call), and its chrome trace, gzipped (`trace`.gz)."""
    profiler.__exit__(None, None, None)
    events = profiler.key_averages()
    table = events.table(sort_by="self_device_time_total", row_limit=20)
    host = events.table(sort_by="cpu_time_total", row_limit=30)  # with tierkv's record_function ranges
    trace.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(trace))
    from benchmarks.trace_summary import summarize

    summary = summarize(json.loads(trace.read_text()))
    with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    return f"{summary}\n{table}\nby host time:\n{host}"


def _write_profile(path: Path, profiled: list[tuple[int, float, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for step, wall_s, text in profiled:
            f.write(f"=== engine step {step}: wall {wall_s * 1e3:.1f} ms\n{text}\n")
    print(f"profile of steps {[p[0] for p in profiled]} in {path}")


def decode_steps(step_ms: list[float], tokens: list[int]) -> list[float]:
    """The wall ms of the engine steps after the first token: one per later token, the last steps."""
    return step_ms[len(step_ms) - (len(tokens) - 1):] if len(tokens) > 1 else []


def slowest_decode_steps(row: dict, count: int = 3) -> list[tuple[int, float, list, list]]:
    """The `count` slowest decode steps of a row that recorded its steps' tierkv host parts: (decode
    step index, wall ms, hot window (begin_step, attention) ms, connector hook ms), slowest first."""
    far, conn = row.get("step_far_host_ms"), row.get("step_connector_ms")
    step_ms, tokens = row.get("step_ms", []), row.get("tokens", [])
    if not far or not conn or len(far) != len(step_ms) or len(conn) != len(step_ms):
        return []
    decode = decode_steps(step_ms, tokens)
    first = len(step_ms) - len(decode)
    order = sorted(range(len(decode)), key=lambda i: decode[i], reverse=True)[:count]
    return [(i, decode[i], far[first + i], conn[first + i]) for i in order]


def decode_step_median(row: dict, fraction: float = 0.5) -> float | None:
    """The median wall ms of a row's decode steps: unlike the mean, not moved by one step that
    captures graphs or completes a block. fraction: another quantile (0.1: the fastest tenth, the
    steady state of a quiet stretch of the lease)."""
    decode = sorted(decode_steps(row.get("step_ms", []), row.get("tokens", [])))
    if not decode:
        return None
    return statistics.median(decode) if fraction == 0.5 else decode[int(fraction * (len(decode) - 1))]


def overlap_text(overlap: float | None) -> str:
    """The sampled selection overlap; None when no step was sampled (the full decode graph's steps are
    not: they read no selection on the host)."""
    return "not sampled" if overlap is None else f"{overlap:.3f}"


def connector_lines(connector: dict | None) -> list[str]:
    """What a row's connector stats say of the next-step prefetch (its precision and recall) and of the
    host time of wait_for_save: its median over the recorded steps, and the median of its slowest
    sixteenth (the steps that save the blocks the batch completes)."""
    connector = connector or {}
    lines = []
    full = ((connector.get("hot_window") or {}).get("full_decode_graphs")) or {}
    if full.get("prefetch_used") is not None:
        precision, recall = full.get("prefetch_precision"), full.get("prefetch_recall")
        lines.append(f"next-step prefetch (margin {full['prefetch_margin']}): {full['prefetch_copied']} blocks copied, "
                     f"{full['prefetch_used']} of them read by a later selection (precision "
                     f"{precision if precision is None else round(precision, 3)}, recall "
                     f"{recall if recall is None else round(recall, 3)})")
    waits = sorted(step[2] for step in connector.get("step_connector_ms") or [])
    if waits:
        slowest = waits[-max(1, len(waits) // 16):]
        lines.append(f"wait_for_save host ms: median {waits[len(waits) // 2]:.2f}, slowest sixteenth of the "
                     f"{len(waits)} recorded steps {slowest[len(slowest) // 2]:.1f} (median), {waits[-1]:.1f} (max)")
    saves = connector.get("save_step_ms") or []
    if saves:  # the steps whose wait_for_save saved blocks: its parts, each the median over those steps
        parts = [sorted(step[i] for step in saves)[len(saves) // 2] for i in range(4)]
        rest = sorted(step[4] - sum(step[:4]) for step in saves)[len(saves) // 2]  # the hook's other work
        lines.append(f"the {len(saves)} steps that saved blocks, host ms (medians): reads {parts[0]:.1f}, tier "
                     f"(quantization, slots, D2H) {parts[1]:.1f}, key summaries {parts[2]:.1f}, poll {parts[3]:.1f}, "
                     f"the rest of wait_for_save {rest:.1f}")
    return lines


def baseline(rows: dict, row: dict) -> dict | None:
    """A row's plain vLLM row: run the same way (compiled rows against plain@compiled) and, for a
    tagged repeat, the plain row of the same tag where there is one (run next to it: the same
    host's speed), else the untagged one."""
    name = "plain@compiled" if "@compiled" in row["mode"] else "plain"
    tagged = rows.get(f"{name}-{row['tag']}") if row.get("tag") else None
    return tagged if tagged is not None else rows.get(name)


def table(out: str) -> None:
    rows = {r["mode"]: r for r in (json.loads(p.read_text()) for p in sorted(Path(out).glob("bench-vllm-*.json")))}
    # each row's baseline: plain vLLM run the same way (compiled rows against plain@compiled)
    print(f"{'mode':<11} {'KV reserved GiB':>15} {'prefill s':>9} {'x plain':>7} {'decode ms':>9} "
          f"{'prefix TTFT first/repeat s':>27} {'repeat/first':>12} {'far wait s':>10} {'tokens = plain':>14}")
    for mode, r in rows.items():
        plain = baseline(rows, r)
        ratio = r["prefill_s"] / plain["prefill_s"] if plain else float("nan")
        same = (r["tokens"] == plain["tokens"]) if plain else None
        if plain and not same:  # the first divergent step and plain vLLM's top-2 margin there: a near-tie?
            step = next(i for i, (a, b) in enumerate(zip(r["tokens"], plain["tokens"])) if a != b)
            lp = (plain.get("top2_logprobs") or [])[step:step + 1]
            margin = lp[0][0] - lp[0][1] if lp and len(lp[0]) > 1 else None
            same = f"step {step} (margin {margin:.4f})" if margin is not None else f"step {step}"
        print(f"{mode:<11} {r['kv_reserved_bytes'] / 2**30:15.2f} {r['prefill_s']:9.2f} {ratio:7.2f} "
              f"{r['decode_ms_per_token']:9.1f} {r['prefix_ttft_first_s']:13.2f}/{r['prefix_ttft_repeat_s']:<13.2f} "
              f"{r['prefix_ttft_repeat_s'] / r['prefix_ttft_first_s']:12.2f} {r.get('far_wait_s', float('nan')):10.2f} "
              f"{str(same):>14}")
        median, plain_median = decode_step_median(r), decode_step_median(plain) if plain else None
        if median and plain_median and not mode.startswith("plain"):  # robust to a capture or boundary step
            tenth, plain_tenth = decode_step_median(r, 0.1), decode_step_median(plain, 0.1)
            print(f"{'':<11} decode tokens/s x plain: {plain['decode_ms_per_token'] / r['decode_ms_per_token']:.2f} (means), "
                  f"{plain_median / median:.2f} (median steps {median:.1f} / {plain_median:.1f} ms), "
                  f"{plain_tenth / tenth:.2f} (fastest tenth {tenth:.1f} / {plain_tenth:.1f} ms)")
        if r.get("prefix_ttft_repeat_again_s") is not None:  # absent from rows recorded before it was run
            print(f"{'':<11} repeated prefix TTFT: {r['prefix_ttft_repeat_s']:.2f} s at the first repeat, "
                  f"{r['prefix_ttft_repeat_again_s']:.2f} s at the second "
                  f"({r['prefix_ttft_repeat_again_s'] / r['prefix_ttft_first_s']:.2f}x the first run)")
            named = [k[len("prefix_ttft_"):-len("_s")] for k in r if k.startswith("prefix_ttft_repeat") and k.endswith("_s")]
            runs = ["repeat", "repeat_again", *sorted(set(named) - {"repeat", "repeat_again"})]
            print(f"{'':<11} each repeat's TTFT ms (add_request + engine steps): " + ", ".join(
                f"{1e3 * r[f'prefix_ttft_{k}_s']:.1f} ({r.get(f'prefix_{k}_add_ms', float('nan')):.1f} + "
                f"{sum(r.get(f'prefix_{k}_step_ms') or [float('nan')]):.1f})" for k in runs))
        sets = sorted({int(k.split("_")[2][3:]) for k in r if k.startswith("prefix_ttft_set") and k.endswith("_first_s")})
        for j, key in [(1, ""), *((j, f"set{j}_") for j in sets)]:  # --prefix-gaps: each prefix's first run and repeats
            if not sets or r.get(f"prefix_ttft_{key or ''}first_s") is None:
                continue
            first = r[f"prefix_ttft_{key}first_s"]
            names = [f"{key}repeat", *(f"{key}{'repeat_again' if not key and n == 2 else f'repeat_{n}'}" for n in range(2, 9))]
            ttfts = [r[f"prefix_ttft_{k}_s"] for k in names if r.get(f"prefix_ttft_{k}_s") is not None]
            waits = [r.get(f"prefix_{k}_far_wait_s", float("nan")) for k in names if r.get(f"prefix_ttft_{k}_s") is not None]
            print(f"{'':<11} prefix {j}: first run {first:.2f} s; repeats " + " / ".join(f"{1e3 * t:.1f}" for t in ttfts)
                  + " ms = " + " / ".join(f"{t / first:.3f}" for t in ttfts) + "x; far wait "
                  + " / ".join(f"{1e3 * w:.0f}" for w in waits) + " ms")
        hot = (r.get("connector") or {}).get("hot_window") or {}
        host_us, merge_us = hot.get("decode_host_us_per_layer"), hot.get("merge_host_us_per_layer")
        reads = r.get("decode_reads") or {}
        if reads.get("gpu_hit_rate") is not None:  # issue 4's hit rate, the timed request's decode
            print(f"{'':<11} GPU hit rate at attention time {reads['gpu_hit_rate']:.3f} (blocks read from the window "
                  f"or a far-block cache over all; {reads['sparse_selected_reads'] - reads['cache_hits']} of "
                  f"{reads['sparse_selected_reads']} selected "
                  f"far blocks fetched at selection, {reads['stalls']} stalls), selection overlap with the step before "
                  f"{overlap_text(hot.get('selection_overlap'))}, model q/k bias std {r.get('model_qk_bias_std', 0.0)}")
        elif hot.get("gpu_hit_rate") is not None:  # rows recorded before decode_reads: the whole run's
            print(f"{'':<11} GPU hit rate at attention time {hot['gpu_hit_rate']:.3f} (window blocks resident; "
                  f"{hot.get('sparse_fetched_reads', 0)} selected far blocks each fetched when selected, "
                  f"{hot.get('stalls', 0)} stalls), selection overlap with the step before "
                  f"{overlap_text(hot.get('selection_overlap'))}")
        for line in connector_lines(r.get("connector")):
            print(f"{'':<11} {line}")
        samples = [gbps for _, gbps in r.get("h2d_samples") or []]
        if samples:
            print(f"{'':<11} H2D probe during the run: {min(samples):.1f} / {statistics.median(samples):.1f} / "
                  f"{max(samples):.1f} GB/s (min / median / max of {len(samples)})")
        cpu = r.get("decode_cpu") or {}
        if cpu.get("wall_s"):  # who used the host CPU in decode: the busiest threads of ours, and the machine
            busiest = ", ".join(f"{name} {s / cpu['wall_s']:.2f}" for name, s in list(cpu["threads"].items())[:3])
            probe = cpu.get("host_probe_us") or [None, None]
            print(f"{'':<11} decode host CPU, cores busy: machine {cpu.get('machine_busy_cores')}; ours by thread {busiest}; "
                  f"host probe {probe[0]} / {probe[1]} us at decode start / end, on core {cpu.get('cpu')}")
        graphs = hot.get("cuda_graphs") or {}
        if graphs.get("graph_replays"):  # how many layer calls one graph served with the window part in it
            print(f"{'':<11} step graphs: {graphs['graph_replays']} replays, {graphs.get('whole_graph_replays', 0)} of them "
                  f"with the window part inside, {graphs['graph_captures']} captures"
                  + (f"; whole vs split graphs, largest |difference| {hot['whole_check_max_abs']:.3g}"
                     if hot.get("whole_check_max_abs") is not None else ""))
        slow = slowest_decode_steps(r)
        if slow:  # where the slowest decode steps' time went: tierkv's host parts, the rest vLLM's and the GPU's
            print(f"{'':<11} slowest decode steps (index: wall ms; tierkv host ms: hot window begin/attention, "
                  f"connector load/save/wait): " + "; ".join(
                      f"{i}: {wall:.1f}; {'/'.join(map(str, far))}, {'/'.join(map(str, conn))}" for i, wall, far, conn in slow))
        if host_us:  # the far path's own host time per layer in decode steps: comparable across leases
            print(f"{'':<11} far path host time {host_us:.0f} us per layer call in decode steps"
                  + (f", of which the graph rows' merge {merge_us:.0f} us" if merge_us else ""))
        if r.get("pcie_floor_ms"):
            print(f"{'':<11} decode {r['decode_ms_per_token']:.1f} ms = {r['decode_ms_per_token'] / r['pcie_floor_ms']:.2f}x "
                  f"the PCIe floor {r['pcie_floor_ms']:.1f} ms (H2D ceiling {r['h2d_ceiling_gbps']:.1f} GB/s, this run)")
        if not mode.startswith("plain") and plain and r.get("top2_logprobs") and plain.get("top2_logprobs"):
            agree = next((i for i, (a, b) in enumerate(zip(r["tokens"], plain["tokens"])) if a != b), len(r["tokens"]))
            worst = max((abs(x - y) for i in range(agree) for x, y in zip(r["top2_logprobs"][i], plain["top2_logprobs"][i])),
                        default=0.0)
            print(f"{'':<11} top-2 logprobs |diff| vs plain over the {agree} agreeing steps: {worst:.4f}")
    repeats_summary(rows)


def repeats_summary(rows: dict) -> None:
    """For a row run several times (tagged repeats), the spread of its ratios to plain: one run per
    row says little where a process's host speed varies as much as it does on the lent machine."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in rows.values():
        plain = baseline(rows, r)
        if not r.get("tag") or r["mode"].startswith("plain") or plain is None:
            continue
        median, plain_median = decode_step_median(r), decode_step_median(plain)
        if median and plain_median:
            name = r["mode"][: -len(r["tag"]) - 1]
            groups.setdefault(name, []).append((plain["decode_ms_per_token"] / r["decode_ms_per_token"],
                                                plain_median / median))
    for name, ratios in groups.items():
        if len(ratios) > 1:
            means, medians = sorted(m for m, _ in ratios), sorted(m for _, m in ratios)
            print(f"{name} over {len(ratios)} runs, decode tokens/s x plain: {means[0]:.2f}-{means[-1]:.2f} by the means, "
                  f"{medians[0]:.2f}-{medians[-1]:.2f} by the median steps")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["model", "run", "table"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--qk-bias-std", type=float, default=0.0,
                        help="model: q/k projection biases N(0, STD^2), a query direction stable across steps "
                             "(build_model); 0: none")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (rows are per GPU)")
    parser.add_argument("--transfer-backend", default="auto", help="tierkv modes: scheduler.transfer_backend (row MODE@NAME)")
    parser.add_argument("--storage-dtype", default="auto", choices=["auto", "float8_e4m3fn", "int8"],
                        help="tierkv modes: the CPU tier's storage dtype (row MODE@DTYPE)")
    parser.add_argument("--compiled", action="store_true",
                        help="vLLM compiled with CUDA graphs, not eager (row MODE@compiled; both engines)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="tierkv modes: scheduler.vllm_async_scheduling, vLLM's async scheduling (row MODE@async; "
                             "plain vLLM runs with it on by default)")
    parser.add_argument("--context", type=int, default=131072 - 64)
    parser.add_argument("--decode-tokens", type=int, default=32,
                        help="decode steps measured after the first token (more amortize a first step's graph captures)")
    parser.add_argument("--no-prefix", action="store_true", help="skip the repeated-prefix rows")
    parser.add_argument("--sample-h2d", type=int, default=0, metavar="N",
                        help="every N engine steps, time a 32 MiB pinned H2D copy between steps (row key h2d_samples; "
                             "the per-token mean then includes them, the step times do not)")
    parser.add_argument("--prefix-repeats", type=int, default=2,
                        help="repeats of the prefix after its first run (rows repeat, repeat_again, repeat_3, ...)")
    parser.add_argument("--profile-prefix", action="store_true",
                        help="the first repeat of the prefix runs profiled, its first step under torch.profiler and "
                             "cProfile (what the first repeat after start pays once); the repeat rows are then warm")
    parser.add_argument("--profile-prefix-later", action="store_true",
                        help="one more repeat after the others, its first step profiled as --profile-prefix's (a warm "
                             "repeat's profile, to set beside the first repeat's)")
    parser.add_argument("--prefetch-margin", type=int, default=0,
                        help="tierkv-sparse-full: scheduler.sparse_prefetch_margin, blocks per layer ranked below each "
                             "selection fetched for the next step on a side stream, with caches of two selections "
                             "(row MODE@marginN; the same 2 GiB: smaller prefill chunks)")
    parser.add_argument("--shipped-set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                        help="MODE tierkv-shipped: keys over the shipped file, e.g. scheduler.prefill_chunk_tokens=6144 "
                             "scheduler.vllm_async_scheduling=false (row tierkv-shipped@KEYVALUE...); MODE tierkv: "
                             "keys over its hot-window config, e.g. scheduler.lookahead_layers=5")
    parser.add_argument("--warm-prefix", action="store_true",
                        help="the warm-up also serves a 12k-token prefix from the tiers once (a prefix hit's load path "
                             "runs before the measured first repeat; row MODE@warmprefix)")
    parser.add_argument("--warm-start", action="store_true",
                        help="the baselines (plain, offloading, lmcache) also run the start-up forwards TieredLLM runs "
                             "for an eager engine (tierkv.integrations.vllm.warm_start; row MODE@warmstart)")
    parser.add_argument("--prefix-gaps", type=float, nargs="+", default=None, metavar="S",
                        help="one prefix per value, each a first run then --prefix-repeats repeats after a pause of S "
                             "seconds (the first value: the usual prefix; row MODE@setsN)")
    parser.add_argument("--no-warm-start", action="store_true",
                        help="tierkv modes: TieredLLM's start-up forwards off (row MODE@nowarm)")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="MODE tierkv: cache.block_tokens, vLLM's block_size too (default 16; row tierkv@bN)")
    parser.add_argument("--tag", default="", help="a repeat of a row: row MODE-TAG, its own file (letters and digits)")
    parser.add_argument("--profile-steps", type=int, nargs="*", default=None,
                        help="engine steps of the 128k request to profile (e.g. 8 9 for prefill chunks, 20 21 for decode)")
    args = parser.parse_args()
    if args.what == "model":
        build_model(args.rest[0], args.layers, args.qk_bias_std)
    elif args.what == "run":
        mode, model_dir, out = args.rest
        if mode not in MODES:
            parser.error(f"MODE: got {mode!r}; one of {', '.join(MODES)}")
        if mode == "tierkv-sparse-full" and not args.compiled:
            parser.error("MODE tierkv-sparse-full: needs --compiled (vLLM's full decode graph)")
        shipped_set = dict(item.split("=", 1) for item in args.shipped_set if "=" in item)
        if len(shipped_set) != len(args.shipped_set) or any(
                k.count(".") != 1 or k.split(".")[0] not in ("cache", "scheduler") for k in shipped_set):
            parser.error(f"--shipped-set {args.shipped_set}: SECTION.KEY=VALUE items, SECTION cache or scheduler")
        if shipped_set and mode not in ("tierkv-shipped", "tierkv"):
            parser.error("--shipped-set: MODE tierkv-shipped or tierkv only")
        if args.block_tokens is not None and (mode != "tierkv" or args.block_tokens < 1):
            parser.error(f"--block-tokens {args.block_tokens}: MODE tierkv only (the exact hot window), at least 1")
        if mode == "tierkv-shipped" and (args.compiled or args.async_scheduling or args.prefetch_margin
                                         or args.transfer_backend != "auto"):
            parser.error("MODE tierkv-shipped: the shipped config's own settings (it runs compiled; no --compiled, "
                         "--async-scheduling, --prefetch-margin or --transfer-backend)")
        if args.async_scheduling and not mode.startswith("tierkv"):
            parser.error(f"--async-scheduling: tierkv modes only (MODE {mode} runs vLLM's own default)")
        if args.prefetch_margin and mode != "tierkv-sparse-full":
            parser.error(f"--prefetch-margin {args.prefetch_margin}: MODE tierkv-sparse-full only")
        if args.no_warm_start and not mode.startswith("tierkv"):
            parser.error(f"--no-warm-start: tierkv modes only (MODE {mode} runs no start-up forwards)")
        if args.prefix_gaps is not None and (args.no_prefix or min(args.prefix_gaps) < 0):
            parser.error(f"--prefix-gaps {args.prefix_gaps}: pauses of at least 0 s, and no --no-prefix")
        if args.tag and not args.tag.isalnum():
            parser.error(f"--tag: got {args.tag!r}; letters and digits only (it names a file the device returns)")
        if args.decode_tokens < 1 or args.context + args.decode_tokens + 1 > 131072:
            parser.error(f"--decode-tokens {args.decode_tokens} with --context {args.context}: the prompt, the first "
                         "token and the decoded ones must fit max_model_len 131072, with at least one decoded")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        run(mode, model_dir, out, args.context, args.layers, with_prefix=not args.no_prefix, tp=args.tp,
            transfer_backend=args.transfer_backend, storage_dtype=args.storage_dtype, compiled=args.compiled,
            async_scheduling=args.async_scheduling, profile_steps=args.profile_steps, profile_prefix=args.profile_prefix, decode_tokens=args.decode_tokens, prefix_repeats=args.prefix_repeats,
            profile_prefix_later=args.profile_prefix_later,
            sample_h2d=args.sample_h2d, tag=args.tag, prefetch_margin=args.prefetch_margin,
            block_tokens=args.block_tokens, shipped_set=shipped_set, warm_prefix=args.warm_prefix,
            warm_start=args.warm_start, prefix_gaps=args.prefix_gaps, no_warm_start=args.no_warm_start)
    else:
        table(args.rest[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
