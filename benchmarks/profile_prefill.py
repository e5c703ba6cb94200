"""Where does tierkv's prefill time go? Profiles one 32k prefill chunk at 64k context (8B shape).

    python benchmarks/profile_prefill.py [--layers 32] [--out PATH]

Runs chunk 1 (tokens 0..32k) unprofiled, then profiles chunk 2 (32k..64k) with torch.profiler
and prints the top kernels by device time and the wall time, against the same chunk through
all-in-GPU DynamicCache in the same run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.models import kv_bytes_per_token, llama_8b_shaped  # noqa: E402


@torch.no_grad()
def two_chunks(model, cache, ids, chunk, profile: bool):
    from tierkv.integrations.hf import forward_kwargs

    kwargs = forward_kwargs(model, cache)
    model(torch.tensor([ids[:chunk]], device="cuda"), logits_to_keep=1, **kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(torch.tensor([ids[chunk:]], device="cuda"), logits_to_keep=1, **kwargs)
            torch.cuda.synchronize()
    else:
        model(torch.tensor([ids[chunk:]], device="cuda"), logits_to_keep=1, **kwargs)
        torch.cuda.synchronize()
        prof = None
    return time.perf_counter() - start, prof


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/profile-prefill.txt")
    args = parser.parse_args()
    from transformers import DynamicCache

    from tierkv.integrations.hf import TieredCache, runtime_for_model
    from tierkv.config import load_config

    model = llama_8b_shaped(num_layers=args.layers)
    context, chunk = 65536, 32768
    ids = torch.randint(0, model.config.vocab_size, (context,)).tolist()
    base_s, _ = two_chunks(model, DynamicCache(config=model.config), ids, chunk, profile=False)
    full_kv = kv_bytes_per_token(model) * context
    config = load_config({
        "cache": {"block_tokens": 64, "gpu_budget_bytes": full_kv // 8, "sink_tokens": 64, "window_tokens": 1024},
        "tiers": [{"kind": "cpu", "capacity_bytes": int(full_kv * 1.1)}],
        "scheduler": {"lookahead_layers": 3, "staging_bytes": 512 << 20},
    }, env={})
    runtime = runtime_for_model(model, config)
    cache = TieredCache(runtime, ids)
    ours_s, _ = two_chunks(model, cache, ids, chunk, profile=False)
    cache.finish()
    cache = TieredCache(runtime, ids[:-1] + [ids[-1] ^ 1])  # fresh keys: no prefix reuse
    prof_s, prof = two_chunks(model, cache, ids, chunk, profile=True)
    cache.finish()
    runtime.close()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60)
    report = (f"chunk 2 of 64k (32k tokens): all-in-GPU {base_s:.3f} s, tierkv {ours_s:.3f} s "
              f"({ours_s / base_s:.2f}x), profiled tierkv {prof_s:.3f} s\n\n{table}\n\n{cpu_table}\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    print(report[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
