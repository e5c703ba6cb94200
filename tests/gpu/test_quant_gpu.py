"""GPU: exact mode over an int8 / fp8 CPU tier stays close to all-in-GPU attention, many layers
and chunks streaming concurrently (the temporary code buffers cross streams), bytes halved."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from benchmarks.models import kv_bytes_per_token, llama_8b_shaped  # noqa: E402
from tests.gpu.test_exact_gpu import run  # noqa: E402
from tierkv.integrations.hf import TieredCache, runtime_for_model  # noqa: E402
from tierkv.config import load_config  # noqa: E402


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_exact_mode_over_a_quantized_cpu_tier_on_the_gpu(fmt):
    from transformers import DynamicCache

    model = llama_8b_shaped(num_layers=4)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    context = 16384
    ids = torch.randint(0, model.config.vocab_size, (context - 3,)).tolist()
    ref_tokens, ref_logits = run(model, DynamicCache(config=model.config), ids, 4, chunk=len(ids))
    full_kv = kv_bytes_per_token(model) * context
    moved = {}
    for storage in ("auto", fmt):
        config = load_config({
            "cache": {"block_tokens": 64, "gpu_budget_bytes": full_kv // 8, "sink_tokens": 64, "window_tokens": 1024},
            "tiers": [{"kind": "cpu", "capacity_bytes": full_kv * 2, "storage_dtype": storage}],
            "scheduler": {"lookahead_layers": 2, "staging_bytes": full_kv // 32, "prefill_chunk_tokens": 4096},
        }, env={})
        runtime = runtime_for_model(model, config, model_id=f"gpu-quant-{storage}")
        try:
            tokens, logits = run(model, TieredCache(runtime, ids), ids, 4, chunk=4096)
            torch.cuda.synchronize()
            moved[storage] = runtime.engine.num_bytes_moved["h2d"]
            assert runtime.stats()["scheduler"]["chunks_streamed"] > 8
        finally:
            runtime.close()
            model.set_attn_implementation("sdpa")
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        compared = list(zip(logits, ref_logits))[: diverged + 1]  # later logits follow other tokens
        worst = max(((got - want).norm() / want.norm()).item() for got, want in compared)
        print(f"{storage}: worst relative logit error {worst:.2e}, H2D {moved[storage] / 2**20:.0f} MiB")
        assert all(torch.isfinite(g).all() for g in logits)
        assert worst < (2e-2 if storage == "auto" else 0.1)
    assert moved[fmt] < 0.6 * moved["auto"]


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_fused_dequantization_equals_the_pytorch_form_in_bf16(fmt):
    from tierkv import block_io
    from tierkv.quant import dequantize_blocks, quantize_blocks
    from tierkv.quant_kernels import dequantize_into_slots

    blocks = (torch.randn(300, 2, 8, 64, 128, device="cuda") * 2).to(torch.bfloat16)
    codes, scales = quantize_blocks(blocks, fmt)
    slots = torch.randperm(512, device="cuda")[:300]
    dst = torch.zeros(512, 2, 8, 64, 128, device="cuda", dtype=torch.bfloat16)
    dequantize_into_slots(codes, scales, fmt, dst, slots)
    want = torch.zeros_like(dst).index_copy_(0, slots, dequantize_blocks(codes, scales, fmt, torch.bfloat16))
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
    skipped = torch.where(torch.rand(300, device="cuda") < 0.5, slots, -1)  # half the blocks not written
    again = torch.zeros_like(dst)
    dequantize_into_slots(codes, scales, fmt, again, skipped)
    written = torch.zeros(512, dtype=torch.bool, device="cuda")
    written[skipped[skipped >= 0]] = True
    assert torch.equal(again[written].view(torch.int16), want[written].view(torch.int16))
    assert not again[~written].any()
    assert block_io._FUSED.ok, block_io._FUSED.error  # the exact-mode runs above used the kernel
