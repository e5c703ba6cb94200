"""GPU: exact tiered attention equals all-in-GPU attention in bf16 at 32k, Llama-3.1-8B layer shapes."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from benchmarks.models import kv_bytes_per_token, llama_8b_shaped  # noqa: E402
from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model  # noqa: E402
from tierkv.config import load_config  # noqa: E402


@torch.no_grad()
def run(model, cache, ids, num_new, chunk):
    kwargs = forward_kwargs(model, cache)
    logits = None
    for pos in range(0, len(ids), chunk):
        logits = model(torch.tensor([ids[pos : pos + chunk]], device="cuda"), logits_to_keep=1, **kwargs).logits[0, -1]
    all_logits, tokens = [logits.float()], []
    for _ in range(num_new):
        token = int(torch.argmax(logits))
        tokens.append(token)
        if hasattr(cache, "seq"):
            cache.seq.token_ids.append(token)
        logits = model(torch.tensor([[token]], device="cuda"), logits_to_keep=1, **kwargs).logits[0, -1]
        all_logits.append(logits.float())
    return tokens, all_logits


def test_exact_tiered_equals_dynamic_cache_bf16_32k():
    from transformers import DynamicCache

    model = llama_8b_shaped(num_layers=2)
    for p in model.parameters():  # sharper logits than std 0.02, so greedy tokens are not near-ties
        p.data.normal_(0, 0.05)
    context = 32768
    ids = torch.randint(0, model.config.vocab_size, (context - 5,)).tolist()  # not a multiple of the block size
    ref_tokens, ref_logits = run(model, DynamicCache(config=model.config), ids, 4, chunk=len(ids))

    full_kv = kv_bytes_per_token(model) * context
    config = load_config({
        "cache": {"block_tokens": 64, "gpu_budget_bytes": full_kv // 8, "sink_tokens": 64, "window_tokens": 1024},
        "tiers": [{"kind": "cpu", "capacity_bytes": full_kv * 2}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": full_kv // 16, "prefill_chunk_tokens": 8192},
    }, env={})
    runtime = runtime_for_model(model, config, model_id="gpu-test")
    try:
        tokens, logits = run(model, TieredCache(runtime, ids), ids, 4, chunk=8192)
        stats = runtime.stats()
    finally:
        runtime.close()
        model.set_attn_implementation("sdpa")
    assert stats["scheduler"]["chunks_streamed"] > 0
    for got, want in zip(logits, ref_logits):
        assert torch.isfinite(got).all()
        rel = (got - want).norm() / want.norm()
        assert rel < 2e-2, f"relative logit error {rel:.3e}"
    assert tokens == ref_tokens
