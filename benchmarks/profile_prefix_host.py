"""Where does the host time of a repeated prefix go under vLLM's hot window? A CPU profile of
everything tierkv does for it, with vLLM's calls driven in vLLM's order (`prefix_host_engine`).

    python benchmarks/profile_prefix_host.py [--tokens 100000] [--block-tokens 64] [--layers 32]
        [--kv-heads 8] [--head-dim 128] [--query-heads 32] [--cpu-tokens 393216] [--repeats 2] [--out PATH]

    python benchmarks/profile_prefix_host.py --kv-heads 1 --head-dim 8 --block-tokens 16   # the H200 run's blocks

A first request of `--tokens` prefix tokens plus one is prefilled in chunks (its saves fill the CPU
tier); then the same prefix with another last token is run `--repeats` times, timed per phase
(the connector's scheduler-side and worker-side hooks, the backend's far part, vLLM's own
allocation and the metadata's pickling), and once more under cProfile. Each repeat's first step
also carries the previous request's finish, as in `bench_vllm.py`'s repeated-prefix rows. The
block counts are the 8B run's; `--kv-heads 1 --head-dim 8` keeps the tensors (and memory) small
without changing them (the 8B shape's CPU tier would take some 48 GiB: the script refuses a shape
the host's memory cannot hold). The phase times are this CPU's, not the H200 host's: read the shares and
what grows with the blocks, not the seconds.

Writes JSON (benchmarks/_common.write_results): the shape, per-run phase seconds, the calls,
seconds and items of the tierkv functions on the path (`meters`), the counts of blocks and keys
touched, and the cProfile listing; prints the phase table.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import write_results  # noqa: E402
from benchmarks.prefix_host_engine import Phases, PrefixEngine, Shape  # noqa: E402


# the far part's maths (the GPU's kernels there, the CPU reference here) and the block copies (DMA on the GPU,
# memcpy here): the wall less these is the host work of the path
MATHS = ("far_attention.chunk_partial (maths; blocks)", "far_attention.merge_with_near (maths)")
COPIES = ("TransferEngine.gather_h2d (copy; blocks)", "TransferEngine.scatter_d2h (copy; blocks)")


class Meter:
    """Calls, seconds and items of methods wrapped on live objects (items: by default the length of
    the first argument, the keys or hashes a batched call takes), and when the first call began."""

    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}  # label -> [calls, seconds, items, first call's start]
        self._since = time.perf_counter()

    def wrap(self, owner, attr: str, label: str, items=None) -> None:
        original = getattr(owner, attr)
        row = self.rows.setdefault(label, [0, 0.0, 0, None])

        def wrapped(*args, **kwargs):
            started = time.perf_counter()
            result = original(*args, **kwargs)
            if row[3] is None:
                row[3] = started
            row[0] += 1
            row[1] += time.perf_counter() - started
            row[2] += items(args, result) if items else (len(args[0]) if args and hasattr(args[0], "__len__") else 0)
            return result

        setattr(owner, attr, wrapped)

    def take(self) -> dict[str, dict]:
        """The rows since the last take (first_s: when the first call began, after that take), then zeroed."""
        out = {k: {"calls": int(c), "s": round(s, 6), "items": int(n), "first_s": round(first - self._since, 6)}
               for k, (c, s, n, first) in self.rows.items() if c}
        for row in self.rows.values():
            row[:] = [0, 0.0, 0, None]
        self._since = time.perf_counter()
        return out


def instrument(engine: PrefixEngine) -> Meter:
    """Meters on the tierkv functions of the repeated prefix's path."""
    from tierkv.integrations.vllm import eager_rows, far_rows, store as store_module

    meter, store, far = Meter(), engine.store, engine.worker._far
    meter.wrap(store_module, "chain_block_hashes", "blocks.chain_block_hashes (hashes made)", lambda a, r: len(r))
    meter.wrap(store, "present_prefix", "VllmKVStore.present_prefix (hashes)")
    meter.wrap(store, "stored_mask", "VllmKVStore.stored_mask (hashes)")
    meter.wrap(store, "keys", "VllmKVStore.keys (keys built)")
    meter.wrap(store, "begin_loads", "VllmKVStore.begin_loads (spans)")
    meter.wrap(store, "finish_layer_load", "VllmKVStore.finish_layer_load", lambda a, r: 0)
    meter.wrap(store, "poll", "VllmKVStore.poll", lambda a, r: 0)
    meter.wrap(store.cpu, "held_prefix", "CpuTier.held_prefix (hashes)")
    meter.wrap(store.chain, "locate_many", "StorageChain.locate_many (keys)")
    meter.wrap(store.chain, "acquire_many", "StorageChain.acquire_many (keys pinned)")
    meter.wrap(store.cpu, "release", "CpuTier.release (keys unpinned)")
    meter.wrap(store.cpu, "acquire_blocks", "CpuTier.acquire_blocks (blocks pinned whole)")
    meter.wrap(store.cpu, "release_blocks", "CpuTier.release_blocks (blocks unpinned)")
    meter.wrap(store.saves, "take_pins", "LayerSaves.take_pins (keys)")
    meter.wrap(store.saves, "release_pins", "LayerSaves.release_pins (keys)")
    meter.wrap(far, "finish", "FarKV.finish (requests)", lambda a, r: 1)
    meter.wrap(far, "add_hashes", "FarKV.add_hashes (hashes)", lambda a, r: len(a[2]))
    meter.wrap(far, "begin_step", "FarKV.begin_step (rows)")
    meter.wrap(far.pins, "pin", "FarPins.pin (blocks per layer)", lambda a, r: r)
    meter.wrap(far.streamer, "plan", "LookaheadStreamer.plan (layers)", lambda a, r: len(a[1]))
    meter.wrap(far.streamer, "run", "LookaheadStreamer.run", lambda a, r: 0)
    meter.wrap(far, "prefetch", "FarKV.prefetch", lambda a, r: 0)
    meter.wrap(far, "attend_parts", "FarKV.attend_parts", lambda a, r: 0)
    meter.wrap(store.io.engine, "gather_h2d", COPIES[0], lambda a, r: len(a[1]))
    meter.wrap(store.io.engine, "scatter_d2h", COPIES[1], lambda a, r: len(a[1]))
    meter.wrap(eager_rows, "chunk_partial", MATHS[0], lambda a, r: a[4] - a[3])
    meter.wrap(far_rows, "merge_with_near", MATHS[1], lambda a, r: 0)
    return meter


def counters(engine: PrefixEngine) -> dict[str, int]:
    far = engine.worker._far
    return {"blocks_saved": engine.store.counts["blocks_saved"], "blocks_loaded": engine.store.counts["blocks_loaded"],
            "lookup_hit_blocks": engine.store.counts["lookup_hit_blocks"], "blocks_pinned": far.counts["blocks_pinned"],
            "far_blocks_read": far.counts["far_blocks_read"], "chunks_streamed": far.streamer.num_chunks_streamed,
            # chunks the step before copied ahead (a step of one token) that this step's plan used
            "chunks_adopted": far.streamer.num_chunks_carried}


def measured_run(engine: PrefixEngine, meter: Meter, req_id: str, prompt: list[int], profile: bool = False) -> dict:
    """One request through the engine: its phases, meters, counter deltas and pickled metadata bytes."""
    phases, before, num_meta = Phases(), counters(engine), len(engine.meta_bytes)
    meter.take()
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    matched = engine.run_request(req_id, prompt, phases)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - started
    after, meters = counters(engine), meter.take()
    device_s = sum(meters[name]["s"] for name in MATHS + COPIES if name in meters)
    streamed = meters.get("LookaheadStreamer.run")
    run = {"req_id": req_id, "matched_tokens": matched, "wall_s": round(wall, 6),
           # host time before the far part's first copy could start (the copies queue behind it on the GPU)
           "first_far_copy_s": streamed["first_s"] if streamed else None,
           "host_s": round(wall - device_s, 6),  # the wall less the far part's maths and the block copies
           "phases_s": {k: round(v, 6) for k, v in phases.seconds.items()}, "meters": meters,
           "counts": {k: after[k] - before[k] for k in after}, "metadata_bytes": engine.meta_bytes[num_meta:]}
    if profiler is not None:
        run["cprofile"] = {order: _listing(profiler, order) for order in ("tottime", "cumulative")}
        run["cprofile"]["hooks_cumulative_s"] = _cumulative(profiler, HOOKS)
    return run


HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_num_new_matched_tokens",
         "build_connector_meta")  # the connector's entry points vLLM calls


def _cumulative(profiler: cProfile.Profile, names: tuple[str, ...]) -> dict[str, float]:
    """Cumulative seconds of the functions named `names` (summed over files), whatever their rank in the listing."""
    totals: dict[str, float] = {}
    for (_, _, name), (_, _, _, cumulative, _) in pstats.Stats(profiler).stats.items():
        if name in names:
            totals[name] = totals.get(name, 0.0) + cumulative
    return totals


def _listing(profiler: cProfile.Profile, order: str, top: int = 30) -> str:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(order).print_stats(top)
    return text.getvalue()


def expected_counts(shape: Shape, tokens: int) -> dict[str, int]:
    """What a repeat of a `tokens`-token prefix (plus one token) must touch: the prefix's full blocks
    held, the window's loaded into vLLM's pool, the rest pinned and streamed in every layer."""
    from tierkv.integrations.vllm.far_step import far_blocks

    prefix_blocks = tokens // shape.block_tokens
    far = far_blocks(prefix_blocks * shape.block_tokens, shape.window_tokens, shape.block_tokens)
    regions = max(2, shape.lookahead_layers + 1)
    chunks = -(-far // (shape.staging_blocks // regions))
    # a step of one new token counts as decode: after its last layer the streamer copies the first chunk of each
    # staging region again for the next step (LookaheadStreamer._carry_into_next_step), which a finished request
    # never reads
    is_decode = tokens + 1 - prefix_blocks * shape.block_tokens == 1
    return {"prefix_blocks": prefix_blocks, "far_blocks": far, "window_blocks_loaded": prefix_blocks - far,
            "lookup_keys": prefix_blocks * shape.layers, "pinned_keys": far * shape.layers,
            "chunks_per_layer": chunks, "chunks_copied_for_next_step": min(regions, chunks * shape.layers) if is_decode else 0}


def profile(shape: Shape, tokens: int, repeats: int) -> dict:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 128000) for _ in range(tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        engine = PrefixEngine(shape, Path(tmp))
        try:
            meter = instrument(engine)
            first = measured_run(engine, meter, "first", prefix + [11])
            runs = [measured_run(engine, meter, f"repeat-{i}", prefix + [12 + i]) for i in range(repeats)]
            profiled = measured_run(engine, meter, "repeat-profiled", prefix + [12 + repeats], profile=True)
            meter.take()
            after = Phases()
            engine.next_step_finishes(after)
            finish = {"phases_s": {k: round(v, 6) for k, v in after.seconds.items()}, "meters": meter.take()}
        finally:
            engine.close()
    return {"shape": {**{k: getattr(shape, k) for k in Shape.__dataclass_fields__ if k != "dtype"},
                      "dtype": str(shape.dtype), "tokens": tokens, "block_bytes": shape.block_bytes,
                      "staging_blocks": shape.staging_blocks, "pool_blocks": shape.pool_blocks},
            "expected": expected_counts(shape, tokens), "first": first, "repeats": runs, "profiled": profiled,
            "last_finish": finish}


def table(result: dict) -> str:
    """The phases of the first run and of the repeats, in seconds, with the keys touched."""
    runs = [result["first"], *result["repeats"]]
    names = list(dict.fromkeys(name for run in runs for name in run["phases_s"]))
    lines = [f"{'phase':<40}" + "".join(f"{run['req_id']:>12}" for run in runs)]
    for name in names:
        lines.append(f"{name:<40}" + "".join(f"{run['phases_s'].get(name, 0.0):12.4f}" for run in runs))
    lines.append(f"{'wall':<40}" + "".join(f"{run['wall_s']:12.4f}" for run in runs))
    lines.append(f"{'wall less far maths and copies (host)':<40}" + "".join(f"{run['host_s']:12.4f}" for run in runs))
    lines.append(f"{'first far copy issued after':<40}" + "".join(
        f"{run['first_far_copy_s']:12.4f}" if run["first_far_copy_s"] is not None else f"{'-':>12}" for run in runs))
    last = result["repeats"][-1] if result["repeats"] else result["profiled"]
    lines.append("\nlast repeat, tierkv functions (calls, s, items):")
    for name, row in sorted(last["meters"].items(), key=lambda item: -item[1]["s"]):
        lines.append(f"  {name:<48}{row['calls']:>7}{row['s']:10.4f}{row['items']:>10}")
    lines.append(f"\ncounts of the last repeat: {last['counts']}; expected: {result['expected']}")
    lines.append(f"metadata bytes per step: {last['metadata_bytes']}")
    return "\n".join(lines)


def host_bytes(shape: Shape) -> int:
    """Host bytes the run allocates: the CPU tier's slab, vLLM's pool of every layer, the staging ring."""
    return (shape.cpu_tokens // shape.block_tokens * shape.layers + shape.pool_blocks * shape.layers
            + shape.staging_blocks) * shape.block_bytes


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="prefix tokens (the prompt has one more)")
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--query-heads", type=int, default=None, help="default 4 per KV head (the 8B model's GQA)")
    parser.add_argument("--window-tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=8192)
    parser.add_argument("--cpu-tokens", type=int, default=3 * 131072,
                        help="the CPU tier's capacity in tokens of every layer (bench_vllm's: 3 x 128k)")
    parser.add_argument("--late-save-layers", type=int, default=0,
                        help="the last N layers' saves land after their step, as a GPU's D2H does (0: at once)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/profile-prefix-host.json")
    args = parser.parse_args()
    for name in ("tokens", "block_tokens", "layers", "kv_heads", "head_dim", "window_tokens", "chunk_tokens",
                 "cpu_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}; must be at least 1")
    if args.tokens <= args.window_tokens:
        parser.error(f"--tokens {args.tokens} must exceed --window-tokens {args.window_tokens}: else nothing is far")
    shape = Shape(layers=args.layers, block_tokens=args.block_tokens, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  query_heads=args.query_heads or 4 * args.kv_heads, window_tokens=args.window_tokens,
                  chunk_tokens=args.chunk_tokens, cpu_tokens=args.cpu_tokens, late_save_layers=args.late_save_layers)
    if not 0 <= args.late_save_layers <= args.layers:
        parser.error(f"--late-save-layers {args.late_save_layers}: from 0 to --layers {args.layers}")
    if args.cpu_tokens < args.tokens + 1:
        parser.error(f"--cpu-tokens {args.cpu_tokens} must hold the prompt's {args.tokens + 1} tokens: the repeat pins them all")
    needed, available = host_bytes(shape), _available_bytes()
    if available is not None and needed > 0.8 * available:
        parser.error(f"this shape allocates about {needed / 2**30:.1f} GiB of KV on the host ({available / 2**30:.1f} GiB "
                     "available): lower --kv-heads or --head-dim (--kv-heads 1 --head-dim 8 keeps the block counts), "
                     "or --cpu-tokens")
    result = profile(shape, args.tokens, max(0, args.repeats))
    write_results(args.out, result)
    print(table(result))
    print(f"\ncProfile of one more repeat, by own time (top 30):\n{result['profiled']['cprofile']['tottime']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
