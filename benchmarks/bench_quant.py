"""Quantized CPU tier on the GPU: exact-mode decode time with int8 and fp8 storage against bf16.

    python benchmarks/bench_quant.py [--context 131072] [--new-tokens 6] [--out PATH]

One run, one Llama-3.1-8B-shaped model (random bf16 weights) and prompt, GPU KV budget one
eighth of the full KV, CPU tier in bf16, int8 and float8_e4m3fn. Reports decode ms per token
and its ratio to bf16 storage (target: at most 0.55x, the PCIe bytes halve), H2D bytes per
step, and greedy-token agreement with bf16 storage. Not yet run on the GPU machine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import write_results  # noqa: E402
from benchmarks.bench_exact import run_request, warm_up  # noqa: E402
from benchmarks.models import kv_bytes_per_token, llama_8b_shaped  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/quant-h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant.py needs CUDA: run it on the GPU machine", file=sys.stderr)
        return 2
    from tierkv.integrations.hf import TieredCache, runtime_for_model
    from tierkv.config import load_config

    model = llama_8b_shaped(num_layers=args.layers)
    warm_up(model)
    ids = torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
    full_kv = kv_bytes_per_token(model) * args.context
    rows = {}
    for storage in ("bfloat16", "int8", "float8_e4m3fn"):
        config = load_config({
            "cache": {"block_tokens": 64, "gpu_budget_bytes": full_kv // 8, "sink_tokens": 64, "window_tokens": 1024},
            "tiers": [{"kind": "cpu", "capacity_bytes": int(full_kv * 1.1), "storage_dtype": storage}],
            "scheduler": {"lookahead_layers": 3, "staging_bytes": 512 << 20, "prefill_chunk_tokens": 32768},
        }, env={})
        runtime = runtime_for_model(model, config, model_id="bench-quant")
        try:
            cache = TieredCache(runtime, ids)
            before = runtime.engine.num_bytes_moved["h2d"]
            row = run_request(model, cache, ids, args.new_tokens, chunk=32768, on_token=cache.seq.token_ids.append)
            row["h2d_bytes"] = runtime.engine.num_bytes_moved["h2d"] - before
            cache.finish()
        finally:
            runtime.close()
            model.set_attn_implementation("sdpa")
        rows[storage] = row
    base = rows["bfloat16"]
    for storage in ("int8", "float8_e4m3fn"):
        rows[storage]["decode_ratio_vs_bf16"] = rows[storage]["decode_ms_per_token"] / base["decode_ms_per_token"]
        rows[storage]["tokens_agreeing_with_bf16"] = sum(a == b for a, b in zip(rows[storage]["tokens"], base["tokens"]))
    write_results(args.out, {"context": args.context, "full_kv_bytes": full_kv, "rows": rows})
    print(f"{'storage':<14} {'decode ms':>10} {'x bf16':>7} {'H2D GiB':>8} {'tokens = bf16':>14}")
    for storage, row in rows.items():
        print(f"{storage:<14} {row['decode_ms_per_token']:10.1f} {row.get('decode_ratio_vs_bf16', 1.0):7.2f} "
              f"{row['h2d_bytes'] / 2**30:8.1f} {row.get('tokens_agreeing_with_bf16', len(row['tokens'])):>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
