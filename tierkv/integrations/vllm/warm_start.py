"""An eager vLLM engine's first step of each new token count, paid at start-up instead of by a request.

Primitives: `warm_token_counts`, `warm_engine`.

    llm = vllm.LLM(model=path, **vllm_engine_args("vllm-128k"))
    warm_engine(llm)                    # TieredLLM(backend="vllm") calls it for eager engines

A step whose token count the engine has not run before makes every GEMM of the model's first layer
choose its cuBLAS kernels and load them (CUDA loads kernels at their first launch), in the host thread,
before the GPU gets the layer. A repeated 100k-token prefix on the H200 computes 33 tokens (its 1562
loaded blocks cover the rest): layer 0's four GEMMs then took 15 ms of host time more than at the next
repeat, and the whole step 18 ms more (the first repeat's time to first token 0.042x the first run's,
the later ones 0.039x). An eager engine (`enforce_eager`, the exact hot window's default) runs only vLLM's
profile run at start-up, at max_num_batched_tokens. A compiled engine is left as it is: its start-up runs
its CUDA graph capture sizes (by default up to 2 x max_num_seqs, at most 512) and pads steps up to them;
its steps above the largest are not warmed here (not measured). `warm_engine` runs vLLM's own
warm-up forward (`GPUModelRunner._dummy_run`, which its compiled start-up runs for compile_sizes: no
attention metadata, so no KV is read or written and no connector hook runs) once per count of a ladder:
every count up to 64 (cuBLAS's tiles for small M change every few tokens), every 8th to 256, then powers
of two up to max_num_batched_tokens.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


def warm_token_counts(max_tokens: int) -> list[int]:
    """The token counts `warm_engine` runs, ascending, none above `max_tokens` (vLLM's max_num_batched_tokens):
    1..64, 72..256 in steps of 8, the powers of two from 512 below it, and `max_tokens` itself."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens: got {max_tokens!r}; a positive number of tokens (vLLM's max_num_batched_tokens)")
    counts = set(range(1, 65)) | set(range(72, 257, 8))
    power = 512
    while power < max_tokens:
        counts.add(power)
        power *= 2
    return sorted(c for c in counts | {max_tokens} if c <= max_tokens)


def _run_counts(worker, counts: list[int]) -> tuple[int, str]:
    """On a vLLM worker (`collective_rpc`): one warm-up forward per count, in order; returns how many ran and
    the error that stopped them ('' when none did)."""
    import torch

    runner, ran, error = worker.model_runner, 0, ""
    try:
        for count in counts:
            runner._dummy_run(count, skip_eplb=True, remove_lora=False)
            ran += 1
    except Exception as exc:  # noqa: BLE001  reported to warm_engine, which logs it; the engine serves without
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
    finally:  # as vLLM's own warm-up: the dummy LoRA adapters the runs registered (with enable_lora) go, also
        # after a failure, or a request's adapter of the same id would run on their weights
        try:
            runner.maybe_remove_all_loras(runner.lora_config)
        except Exception as exc:  # noqa: BLE001  said beside the forwards' own error, never in its place
            error = "; ".join(filter(None, (error, f"removing the dummy LoRA adapters: {type(exc).__name__}: {exc}")))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return ran, error


def warm_engine(llm) -> list[int]:
    """Run `llm`'s (a `vllm.LLM`'s) forward once at each of `warm_token_counts` on every worker, unless it is
    compiled; returns the counts every worker ran ([] for a compiled engine; after a failure the counts before
    it: logged, and the engine serves without the rest). Takes about a second for an
    8B model; logged with its time."""
    config = llm.llm_engine.vllm_config
    if not config.model_config.enforce_eager:
        return []
    counts = warm_token_counts(int(config.scheduler_config.max_num_batched_tokens))
    started = time.perf_counter()
    try:
        results = llm.collective_rpc(_run_counts, args=(counts,))
    except Exception as exc:  # noqa: BLE001  a speed-up only: the engine serves as it would without it
        results = [(0, f"{type(exc).__name__}: {exc}")]
    ran = min((r[0] for r in results), default=0)  # every worker ran the first `ran` counts
    errors = sorted({r[1] for r in results if r[1]})
    if errors:
        logger.warning("tierkv: vLLM's start-up forwards at new token counts stopped after %d of %d (%s); the "
                       "engine serves without the rest (a request's first step at a new count pays its GEMMs' "
                       "first launch)", ran, len(counts), "; ".join(errors))
        return counts[:ran]
    logger.info("tierkv: vLLM's eager forward run at %d token counts (1..%d) before serving, in %.2f s, so no "
                "request pays its GEMMs' first launch", len(counts), counts[-1], time.perf_counter() - started)
    return counts
