"""The hot window's sparse decode path alone (tierkv.integrations.vllm.far_rows, no vLLM): host and GPU time per layer.

    python benchmarks/bench_far_sparse.py [--far-tokens 65536] [--layers 4] [--rows 1 4] [--steps 20]
        [--budget-tokens 2048] [--block-tokens 16 [64]] [--graphs] [--out PATH]

What vLLM's CUSTOM backend calls for each layer of a decode step under `scheduler.policy:
sparse` — `FarKV.attend_into` (selection from the key summaries, fetch of the selected blocks
from the pinned CPU tier, attention over them, the merge with the near part) — on blocks saved through the
same store, with the 8B model's KV shape (8 KV heads, head_dim 128, bf16, blocks of each `--block-tokens`) and
32 query heads. Per row count: wall ms per layer with the GPU synchronized once per step (the
host-bound cost vLLM's eager forward pays), GPU ms per layer (events), the copy ceiling of the
selected bytes, and a cProfile of a few steps (top functions by own time) in OUT. `--graphs` adds,
per row count, the same steps with `scheduler.sparse_cuda_graphs` (each row's layer replayed
from a CUDA graph) and the ratio to the eager path of the same run.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import write_results  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128


def build(far_tokens: int, layers: int, rows: int, budget_tokens: int, device: torch.device, tmp: Path,
          graphs: bool = False, BS: int = 16):
    from tierkv.blocks import BlockLayout
    from tierkv.config import load_config
    from tierkv.integrations.vllm.far_rows import FarKV
    from tierkv.integrations.vllm.store import BlockSpan, VllmKVStore

    blocks = far_tokens // BS + 8  # the window's blocks past the far ones
    block_bytes = 2 * KV_HEADS * BS * DIM * 2
    config = load_config({
        "cache": {"block_tokens": BS, "window_tokens": 8 * BS},
        "tiers": [{"kind": "cpu", "capacity_bytes": (rows * blocks * layers + 64) * block_bytes},
                  {"kind": "disk", "path": str(tmp / "disk"), "capacity_bytes": 64 * block_bytes, "trusted": True}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 4096 * block_bytes, "policy": "sparse",
                      "sparse_token_budget": budget_tokens, "sparse_cuda_graphs": graphs},
    }, env={})
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    store = VllmKVStore(config, BlockLayout(KV_HEADS, BS, DIM, torch.bfloat16), names, "bench-far", device)
    caches = {n: torch.randn(blocks, KV_HEADS, BS, 2 * DIM, device=device, dtype=torch.bfloat16) for n in names}
    store.register(caches)
    far = FarKV(store, 8 * BS, max_rows=rows)
    for r in range(rows):
        req = f"r{r}"
        hashes = store.extend_hashes([], [random.randrange(1 << 16) for _ in range(blocks * BS)], blocks)
        far.add_hashes(req, 0, hashes)
        for name in names:
            spans = [BlockSpan(req, list(range(blocks)), hashes)]
            saved = store.save_layer(store.layer_index[name], caches[name], spans)
            far.summarize(store.layer_index[name], spans, saved)
        store.poll(wait=True)
    return store, far, blocks


def run_steps(far, store, rows: int, blocks: int, layers: int, steps: int, device) -> tuple[float, float]:
    """(wall ms per layer, GPU ms per layer) over `steps` decode steps, one sync per step."""
    BS = far.block_tokens
    is_cuda = device.type == "cuda"
    q = torch.randn(rows, HEADS, DIM, device=device, dtype=torch.bfloat16)
    near_out = torch.zeros(rows, HEADS, DIM, device=device, dtype=torch.bfloat16)
    near_lse = torch.zeros(rows, HEADS, device=device)
    output = torch.empty_like(near_out)
    wall = gpu = 0.0
    for _ in range(steps):
        q.normal_()  # a fresh query per step, as a random-weight model gives
        if is_cuda:
            torch.cuda.synchronize()
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
        start = time.perf_counter()
        far.begin_step([(f"r{r}", blocks * BS, 1) for r in range(rows)])
        for layer in range(layers):
            far.attend_into(output, layer, q, near_out, near_lse, DIM ** -0.5)
        far.end_step()
        if is_cuda:
            end_event.record()
            torch.cuda.synchronize()
            gpu += start_event.elapsed_time(end_event)
        wall += 1e3 * (time.perf_counter() - start)
    return wall / steps / layers, gpu / steps / layers


def measure(args, rows: int, graphs: bool, device: torch.device, tmp: Path, block_tokens: int = 16) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    store, far, blocks = build(args.far_tokens, args.layers, rows, args.budget_tokens, device, tmp, graphs, block_tokens)
    try:
        run_steps(far, store, rows, blocks, args.layers, 3, device)  # warm-up: kernels built, graphs captured
        wall_ms, gpu_ms = run_steps(far, store, rows, blocks, args.layers, args.steps, device)
        profiler = cProfile.Profile()
        profiler.enable()
        run_steps(far, store, rows, blocks, args.layers, 5, device)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        used = (far.graphs.counts["graph_replays"] > 0) if far.graphs is not None else False
        return {"rows": rows, "block_tokens": block_tokens, "graphs": graphs, "graphs_used": used, "wall_ms_per_layer": wall_ms, "gpu_ms_per_layer": gpu_ms,
                "selected_bytes_per_layer": rows * args.budget_tokens * 2 * KV_HEADS * DIM * 2,
                "far_stats": far.stats(), "cprofile_5_steps": text.getvalue()}
    finally:
        far.close()
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--far-tokens", type=int, default=65536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--budget-tokens", type=int, default=2048)
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[16], help="block sizes to run, one store each")
    parser.add_argument("--graphs", action="store_true", help="also run each row count with sparse_cuda_graphs")
    parser.add_argument("--out", default="benchmarks/results/far-sparse.json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    results = []
    for rows, bs in [(r, b) for b in args.block_tokens for r in args.rows]:
        for graphs in (False, True) if args.graphs else (False,):
            with tempfile.TemporaryDirectory(prefix="far-sparse-") as tmp:  # the store's disk tier, removed after
                results.append(measure(args, rows, graphs, device, Path(tmp), bs))
            r = results[-1]
            print(f"{bs}-token blocks, rows {rows}{' graphs' if graphs else ''}{'' if r['graphs_used'] == graphs else ' (not used)'}: wall {r['wall_ms_per_layer']:.3f} ms/layer, "
                  f"GPU {r['gpu_ms_per_layer']:.3f} ms/layer, {r['selected_bytes_per_layer'] / 2**20:.0f} MiB selected "
                  "per layer", flush=True)
    write_results(out, {"far_tokens": args.far_tokens, "layers": args.layers, "budget_tokens": args.budget_tokens,
                        "rows": results})
    print(f"{'block':>5} {'rows':>5} {'graphs used':>11} {'wall ms/layer':>14} {'GPU ms/layer':>13} {'x eager':>8}")
    eager = {(r["block_tokens"], r["rows"]): r["wall_ms_per_layer"] for r in results if not r["graphs"]}
    for r in results:
        ratio = r["wall_ms_per_layer"] / eager[r["block_tokens"], r["rows"]]
        print(f"{r['block_tokens']:>5} {r['rows']:>5} {str(r['graphs_used']):>11} {r['wall_ms_per_layer']:>14.3f} "
              f"{r['gpu_ms_per_layer']:>13.3f} {ratio:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
