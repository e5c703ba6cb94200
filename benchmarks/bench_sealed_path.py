"""What sealing costs on the device path: a prefix served from the disk tier into the model, plain
(`trusted: true`) against authenticated (HMAC-SHA256) and authenticated + encrypted (AES-256-GCM).

    python benchmarks/bench_sealed_path.py [--device cuda] [--layers 8] [--context 32768] [--out FILE]

Per mode, in one process and on one model: engine A (CPU tier + disk tier, write-through) runs the
prompt and closes (its blocks are on disk); engine B, with an empty CPU tier over the same disk
directory, runs the same prompt: its prefix comes from disk through the sealer, so B's time to
first token is the sealed read path (disk read, open/decrypt, copy to the device, the last block's
prefill). Each mode's row gives that time against the plain mode's (the baseline, measured in the
same run), the full prefill without a prefix (same model, another prompt), the blocks served by the
disk tier and whether B's greedy tokens equal A's. The disk files sit in the page cache after A's
writes, so this is the cost of the codec and sealer, not of the medium.

Model: Llama-3.1-8B layer shapes with --layers layers, random bf16 weights on cuda (float32 on cpu).
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

from benchmarks._common import describe_device, write_results  # noqa: E402
from benchmarks.models import kv_bytes_per_token  # noqa: E402

MODES = {"plain": dict(trusted=True), "mac": dict(), "mac+encrypt": dict(encrypt=True)}
SECRET = "bench-sealed-path-secret-0123456789"


def engine_config(disk_dir: str, mode: str, kv_per_token: int, context: int, block_tokens: int) -> dict:
    return {"cache": {"block_tokens": block_tokens, "gpu_budget_bytes": max(kv_per_token * context // 8, 64 << 20)},
            "tiers": [{"kind": "cpu", "capacity_bytes": kv_per_token * (context + 4 * block_tokens)},
                      {"kind": "disk", "path": disk_dir, "capacity_bytes": 4 * kv_per_token * context, **MODES[mode]}],
            "storage": {"secret": SECRET}, "metrics": {"enabled": False}}


def one_request(model, config: dict, ids: list[int], new_tokens: int) -> dict:
    from tierkv.llm import TieredLLM

    with TieredLLM(model, config, show_progress=False) as llm:
        out = llm.generate([ids], max_new_tokens=new_tokens, ignore_eos=True)[0]
    return {"prefill_s": out.stats["prefill_s"], "prefix_tokens": out.stats["prefix_tokens"],
            "prefix_blocks_by_tier": out.stats["prefix_blocks_by_tier"], "tokens": out.token_ids}


def run_mode(model, mode: str, ids: list[int], other: list[int], args, kv_per_token: int) -> dict:
    with tempfile.TemporaryDirectory(dir=args.disk_path) as disk_dir:
        config = engine_config(disk_dir, mode, kv_per_token, len(ids), args.block_tokens)
        first = one_request(model, config, ids, args.new_tokens)       # writes the blocks through to disk
        cold = one_request(model, config, other, args.new_tokens)      # no prefix anywhere: a full prefill
        served = [one_request(model, config, ids, args.new_tokens) for _ in range(args.repeats)]
    times = sorted(r["prefill_s"] for r in served)
    return {"mode": mode, "prefix_load_s": times[len(times) // 2], "prefix_load_s_all": times,
            "full_prefill_s": cold["prefill_s"], "prefix_tokens": served[0]["prefix_tokens"],
            "prefix_blocks_by_tier": served[0]["prefix_blocks_by_tier"],
            "tokens_identical": all(r["tokens"] == first["tokens"] for r in served)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=8, help="layers of the 8B-shaped model (cuda)")
    p.add_argument("--tiny", action="store_true", help="the demo's random model with 2 layers (CPU tests)")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="engines B per mode (the median is the row)")
    p.add_argument("--disk-path", default=None, help="parent of the disk tier's temp dirs")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        from tierkv.demo import tiny_llama  # the main job's random fallback model, 2 layers
        model = tiny_llama(num_layers=2).to(args.device)
    else:
        from benchmarks.models import llama_8b_shaped
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = llama_8b_shaped(args.layers, device=args.device, dtype=dtype)
    kv_per_token = kv_bytes_per_token(model)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    ids, other = ([rng.randrange(3, vocab) for _ in range(args.context)] for _ in range(2))
    rows = []
    for mode in MODES:
        started = time.perf_counter()
        rows.append(run_mode(model, mode, ids, other, args, kv_per_token))
        print(f"{mode}: {rows[-1]['prefix_load_s']:.3f} s ({time.perf_counter() - started:.0f} s wall)", flush=True)
    base = rows[0]["prefix_load_s"]
    prefix_bytes = rows[0]["prefix_tokens"] * kv_per_token
    for row in rows:
        row["x_plain"] = row["prefix_load_s"] / base
        row["prefix_gb_per_s"] = prefix_bytes / row["prefix_load_s"] / 1e9
    results = {"device": describe_device(), "context": args.context, "kv_bytes_per_token": kv_per_token,
               "layers": model.config.num_hidden_layers, "rows": rows}
    print(f"\n{'mode':12s} {'TTFT from disk':>15s} {'x plain':>8s} {'GB/s':>6s} {'full prefill':>13s} tokens  prefix served")
    for r in rows:
        print(f"{r['mode']:12s} {r['prefix_load_s']:14.3f}s {r['x_plain']:8.2f} {r['prefix_gb_per_s']:6.2f} "
              f"{r['full_prefill_s']:12.3f}s {'identical' if r['tokens_identical'] else 'DIFFER   '} "
              f"{r['prefix_tokens'] if r['prefix_tokens'] else 'NONE (not a disk read: see the log)'}")
    if args.out:
        write_results(args.out, results, command=" ".join(sys.argv))
    # a mode that served no prefix timed a full prefill, not a read through its sealer
    return 0 if all(r["tokens_identical"] and r["prefix_tokens"] == rows[0]["prefix_tokens"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
