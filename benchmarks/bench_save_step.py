"""The host time of the step that completes blocks, under the sparse policy (no vLLM): saving each
request's new block of every layer to the CPU tier and summarizing its keys.

    python benchmarks/bench_save_step.py [--requests 10] [--layers 32] [--repeats 20] [--storage-dtype auto]
        [--gpu-busy-ms 0] [--out PATH]

In a batch of decoding requests every 16th engine step completes a block per request. A step replayed
from vLLM's full decode graph runs no per-layer hook, so the connector's `wait_for_save` saves that
step's blocks of every layer from vLLM's pool and summarizes them. Two ways side by side, in the same
run, on the 8B model's KV shape (8 KV heads, head_dim 128, bf16, 16-token blocks):

  per layer   `VllmKVStore.save_layer` + `FarKV.summarize(layer, ...)` once per layer;
  all layers  `VllmKVStore.save_layers` + `FarKV.summarize(range(layers), ...)` once (what the connector does).

Per way: host ms per save (the calls return without waiting for the device, as in the engine; the
copies are waited for between saves, outside the timing), and the torch calls of one save (profiled).

In the engine the save is called while the GPU still runs the step (and, under async scheduling, the
step after it), so a call that waits for the device costs that much host time; with the device idle
the same call looks fast. `--gpu-busy-ms N` (CUDA) queues N ms of device work before each timed save
and counts the saves after which that work had already finished (`waited_for_device`): any such save
waited for the device somewhere inside.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import write_results  # noqa: E402

KV_HEADS, DIM, BS = 8, 128, 16


def build(requests: int, layers: int, saves: int, storage_dtype: str, device: torch.device, tmp: Path):
    from tierkv.blocks import BlockLayout
    from tierkv.config import load_config
    from tierkv.integrations.vllm.far_rows import FarKV
    from tierkv.integrations.vllm.store import VllmKVStore

    blocks = saves + 2  # per request: one new block per save, in a pool of this many
    block_bytes = 2 * KV_HEADS * BS * DIM * 2
    config = load_config({
        "cache": {"block_tokens": BS, "window_tokens": 8 * BS},
        "tiers": [{"kind": "cpu", "capacity_bytes": (requests * blocks * layers + 64) * block_bytes,
                   "storage_dtype": storage_dtype},
                  {"kind": "disk", "path": str(tmp / "disk"), "capacity_bytes": 64 * block_bytes, "trusted": True}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 256 * block_bytes, "policy": "sparse",
                      "sparse_token_budget": 2048, "sparse_cuda_graphs": False},  # the save needs no decode graphs
    }, env={})
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    store = VllmKVStore(config, BlockLayout(KV_HEADS, BS, DIM, torch.bfloat16), names, "bench-save", device)
    caches = {n: torch.randn(requests * blocks, KV_HEADS, BS, 2 * DIM, device=device, dtype=torch.bfloat16)
              for n in names}
    store.register(caches)
    far = FarKV(store, 8 * BS, max_model_len=blocks * BS)
    hashes = {}
    for r in range(requests):
        hashes[r] = store.extend_hashes([], [random.randrange(1 << 16) for _ in range(blocks * BS)], blocks)
        far.add_hashes(f"r{r}", 0, hashes[r])
    return store, far, caches, names, hashes, blocks


def one_save(store, far, caches, names, spans, at_once: bool) -> None:
    if at_once:
        layers = [store.layer_index[n] for n in names]
        far.summarize(range(len(layers)), spans, store.save_layers(layers, [caches[n] for n in names], spans))
    else:
        for name in names:
            layer = store.layer_index[name]
            far.summarize(layer, spans, store.save_layer(layer, caches[name], spans))


def sleep_cycles_per_ms() -> float:
    """The GPU's `torch.cuda._sleep` cycles per millisecond, timed by CUDA events."""
    torch.cuda._sleep(1_000_000)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / max(start.elapsed_time(end), 1e-3)


def measure(args, at_once: bool, device: torch.device, tmp: Path) -> dict:
    from tierkv.integrations.vllm.store import BlockSpan

    tmp.mkdir(parents=True, exist_ok=True)
    saves = args.repeats + 2  # a warm-up save and a profiled one
    store, far, caches, names, hashes, blocks = build(args.requests, args.layers, saves, args.storage_dtype, device,
                                                      tmp)

    def spans(i: int) -> list:  # save i: block i of every request (a new block each time)
        return [BlockSpan(f"r{r}", [r * blocks + i], [hashes[r][i]]) for r in range(args.requests)]

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        store.poll(wait=True)

    try:
        one_save(store, far, caches, names, spans(0), at_once)  # warm-up
        wait()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            one_save(store, far, caches, names, spans(1), at_once)
        torch_calls = sum(1 for e in prof.events() if e.name.startswith("aten::") and
                          (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
        wait()
        busy = int(args.gpu_busy_ms * sleep_cycles_per_ms()) if args.gpu_busy_ms and device.type == "cuda" else 0
        host, waited = [], 0
        for i in range(2, saves):
            if busy:
                torch.cuda._sleep(busy)  # the step the engine's GPU is still running
            start = time.perf_counter()
            one_save(store, far, caches, names, spans(i), at_once)
            host.append(1e3 * (time.perf_counter() - start))
            waited += bool(busy) and torch.cuda.current_stream(device).query()
            wait()
        host.sort()
        return {"way": "all layers" if at_once else "per layer", "host_ms_median": host[len(host) // 2],
                "host_ms_min": host[0], "host_ms": host, "torch_calls": torch_calls,
                "blocks_saved": store.counts["blocks_saved"], "gpu_busy_ms": args.gpu_busy_ms if busy else 0,
                "waited_for_device": waited if busy else None}
    finally:
        far.close()
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--storage-dtype", default="auto", help="the CPU tier's storage_dtype (auto, int8, float8_e4m3fn)")
    parser.add_argument("--gpu-busy-ms", type=float, default=0.0,
                        help="CUDA: device work queued before each timed save; counts the saves that waited for it")
    parser.add_argument("--out", default="benchmarks/results/save-step.json")
    args = parser.parse_args()
    for name in ("requests", "layers", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be at least 1")
    if args.gpu_busy_ms < 0:
        parser.error("--gpu-busy-ms: must be at least 0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for at_once in (False, True):
        with tempfile.TemporaryDirectory(prefix="save-step-") as tmp:  # the store's disk tier, removed after
            rows.append(measure(args, at_once, device, Path(tmp)))
    write_results(args.out, {"requests": args.requests, "layers": args.layers, "storage_dtype": args.storage_dtype,
                             "gpu_busy_ms": rows[0]["gpu_busy_ms"], "rows": rows})
    base = rows[0]["host_ms_median"]
    busy = rows[0]["gpu_busy_ms"]
    print(f"{args.requests} requests x {args.layers} layers, one new block each, CPU tier {args.storage_dtype}, on {device}"
          + (f", {busy:g} ms of device work queued before each save" if busy else ", the device idle before each save"))
    print(f"{'way':>10} {'host ms (median)':>17} {'min':>8} {'torch calls':>12} {'x per layer':>12}"
          + (f" {'waited for device':>18}" if busy else ""))
    for r in rows:
        print(f"{r['way']:>10} {r['host_ms_median']:>17.2f} {r['host_ms_min']:>8.2f} {r['torch_calls']:>12} "
              f"{r['host_ms_median'] / base:>12.2f}"
              + (f" {r['waited_for_device']:>10} of {len(r['host_ms']):<4}" if busy else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
