"""Which attention kernel is fastest for prefill-sized attention with the log-sum-exp on this GPU?

    python benchmarks/probe_attention_backends.py [--out PATH]

Times, for Llama-8B heads (32 query, 8 KV heads, head_dim 128, bf16): SDPA as transformers calls
it (enable_gqa, is_causal; PyTorch picks the kernel), each SDPA backend forced, PyTorch's flash
op returning the LSE (what tierkv used), and the cuDNN op returning the LSE; checks that the
cuDNN LSE equals the flash LSE.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import write_results  # noqa: E402


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/attention-backends-h200.json")
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = {}
    for name, nq, nk, causal in [("causal 32k", 32768, 32768, True), ("causal 128k", 131072, 131072, True),
                                 ("32k queries over 32k earlier keys", 32768, 32768, False)]:
        q = torch.randn(1, 32, nq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, nk, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ke, ve = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        row = {}
        row["sdpa_default_gqa"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    row[f"sdpa_{backend.name.lower()}"] = timed(
                        lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=causal))
            except Exception as exc:
                row[f"sdpa_{backend.name.lower()}"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        flash = lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal, False, scale=128**-0.5)  # noqa: E731
        row["flash_op_with_lse"] = timed(flash)
        try:
            cudnn = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(  # noqa: E731
                q, ke, ve, None, True, 0.0, causal, False, scale=128**-0.5)
            row["cudnn_op_with_lse"] = timed(cudnn)
            f_out, f_lse = flash()[:2]
            c = cudnn()
            c_out, c_lse = c[0], c[1]
            row["cudnn_lse_shape"] = list(c_lse.shape)
            row["cudnn_vs_flash_max_abs_out"] = (c_out.float() - f_out.float()).abs().max().item()
            row["cudnn_vs_flash_max_abs_lse"] = (c_lse.float().reshape(f_lse.shape[0], f_lse.shape[1], -1)[..., :nq]
                                                 - f_lse.float()[..., :nq]).abs().max().item()
        except Exception as exc:
            row["cudnn_op_with_lse"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows[name] = row
        print(name, {k2: (round(v2, 2) if isinstance(v2, float) else v2) for k2, v2 in row.items()})
        del q, k, v, ke, ve
        torch.cuda.empty_cache()
    write_results(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
