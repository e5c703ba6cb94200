"""The GPU budget and staging size of bench_accuracy's tierkv runs, and the checks of the options
that shape them (--block-tokens, --sparse-gpu-fraction).

Primitives: `WINDOW_ONLY`, `gpu_budget_bytes`, `staging_bytes`, `check_cache_args`.

    --sparse-gpu-fraction N   layer slots: [ front: sinks + far cache, 1/N of the KV less the window | window ]
    --sparse-gpu-fraction 0   layer slots: [ sinks | window ]   far set = every block between them
                              (no sinks: from block 0, as vLLM's sparse selection reads it)
"""
from __future__ import annotations

WINDOW_ONLY = 0  # --sparse-gpu-fraction 0: the GPU holds the sink and window blocks only


def gpu_budget_bytes(prompt_kv_bytes: int, fraction: int, num_layers: int, block_bytes: int,
                     block_tokens: int, sink_tokens: int, window_tokens: int) -> int:
    """cache.gpu_budget_bytes: 1/`fraction` of the prompt's KV; for WINDOW_ONLY, exactly the sink and
    window blocks of every layer (tierkv.storage.gpu.min_resident_blocks), so no front block is kept
    past the sinks and sparse decode selects among all the others."""
    from tierkv.storage.gpu import min_resident_blocks

    if fraction == WINDOW_ONLY:
        return min_resident_blocks(block_tokens, sink_tokens, window_tokens) * num_layers * block_bytes
    return prompt_kv_bytes // fraction


def staging_bytes(prompt_kv_bytes: int, fraction: int, num_layers: int, block_bytes: int,
                  block_tokens: int, token_budget: int) -> int:
    """scheduler.staging_bytes: room for two selections of `token_budget` tokens per layer (predictor
    'cache'), and at least half the GPU budget's share of the KV for exact streaming's prefetch regions."""
    selection = 2 * (num_layers * (token_budget // block_tokens) + 4) * block_bytes
    if fraction == WINDOW_ONLY:
        return selection
    return max(prompt_kv_bytes // (2 * fraction), selection)


def check_cache_args(parser, args) -> None:
    """parser.error naming the option for a --block-tokens below 1 or a negative --sparse-gpu-fraction."""
    if args.block_tokens < 1:
        parser.error(f"--block-tokens: got {args.block_tokens}; tokens per KV block must be at least 1")
    if args.sparse_gpu_fraction < 0:
        parser.error(f"--sparse-gpu-fraction: got {args.sparse_gpu_fraction}; allowed: N >= 1 (GPU budget 1/N "
                     f"of the KV) or {WINDOW_ONLY} (the GPU holds the sinks and the window only)")
