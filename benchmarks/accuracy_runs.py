"""bench_accuracy's model runs: greedy decoding and teacher-forced logits through tierkv's TieredCache, the
same through transformers' SDPA, and the comparison of two runs' logits.

Primitives: `PREFILL_CHUNK`, `tiered_greedy`, `tiered_teacher_forced`, `dense_teacher_forced`, `compare_logits`.
"""
from __future__ import annotations

import torch

from tierkv.longdoc import greedy_continue

PREFILL_CHUNK = 512  # tokens per prefill forward (and scheduler.prefill_chunk_tokens of the tierkv runs)


@torch.no_grad()
def tiered_greedy(model, config, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]):
    """Greedy tokens and each step's logits [vocab] (float32, CPU) through tierkv's TieredCache."""
    from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model

    runtime = runtime_for_model(model, config, "smollm2-135m")
    device = runtime.device
    cache = TieredCache(runtime, list(prompt_ids))
    try:
        kwargs = forward_kwargs(model, cache)
        logits = _prefill(model, kwargs, prompt_ids, device)
        tokens, all_logits = greedy_continue(model, kwargs, logits, max_new_tokens, stop_ids,
                                             on_token=cache.seq.token_ids.append)
        return tokens, all_logits, cache.seq.read_stats()
    finally:
        cache.finish()
        runtime.close()


def _prefill(model, kwargs: dict, prompt_ids: list[int], device) -> torch.Tensor:
    for pos in range(0, len(prompt_ids), PREFILL_CHUNK):
        piece = torch.tensor([prompt_ids[pos : pos + PREFILL_CHUNK]], device=device)
        logits = model(input_ids=piece, logits_to_keep=1, **kwargs).logits[0, -1]
    return logits


@torch.no_grad()
def tiered_teacher_forced(model, config, prompt_ids: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits [len(continuation), vocab] (float32, CPU): row i predicts continuation[i], the earlier
    continuation tokens fed one per decode step through tierkv (where the sparse policy selects)."""
    from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model

    runtime = runtime_for_model(model, config, "smollm2-135m")
    cache = TieredCache(runtime, list(prompt_ids))
    try:
        kwargs = forward_kwargs(model, cache)
        rows = [_prefill(model, kwargs, prompt_ids, runtime.device).float().cpu()]
        for token in continuation[:-1]:
            cache.seq.token_ids.append(token)
            piece = torch.tensor([[token]], device=runtime.device)
            rows.append(model(input_ids=piece, **kwargs).logits[0, -1].float().cpu())
        return torch.stack(rows)
    finally:
        cache.finish()
        runtime.close()


@torch.no_grad()
def dense_teacher_forced(model, prompt_ids: list[int], continuation: list[int]) -> torch.Tensor:
    """The same rows from one SDPA forward over prompt + continuation (no cache)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([prompt_ids + continuation[:-1]], device=device)
        return model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 :].float().cpu()
    finally:
        model.set_attn_implementation(previous)


def compare_logits(test: torch.Tensor, reference: torch.Tensor, targets: list[int]) -> dict:
    """top-1 agreement, mean KL(reference || test) in nats, perplexity of `targets` under each and their ratio."""
    target = torch.tensor(targets)
    log_t, log_r = test.log_softmax(-1), reference.log_softmax(-1)
    kl = (log_r.exp() * (log_r - log_t)).sum(-1)
    nll_t = -log_t.gather(1, target[:, None]).mean()
    nll_r = -log_r.gather(1, target[:, None]).mean()
    return {"top1_agreement": float((test.argmax(-1) == reference.argmax(-1)).float().mean()),
            "mean_kl": float(kl.mean()), "perplexity": float(nll_t.exp()), "dense_perplexity": float(nll_r.exp()),
            "perplexity_ratio": float((nll_t - nll_r).exp())}
