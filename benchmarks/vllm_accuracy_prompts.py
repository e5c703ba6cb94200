"""The retrieval prompts of benchmarks/vllm_accuracy.py: bench_accuracy's own (tierkv.longdoc's pass-key
and multi-key cases, the chat template, the forced answer start), on a grid that fits vLLM's max_model_len.

Primitives: `Grid`, `FULL`, `SMOKE`, `build_prompts`, `score`.

    prompts = build_prompts(tokenizer, FULL, max_prompt_tokens=8192 - 16)
    prompts[0].ids, prompts[0].row   # token ids for vLLM; {task, context_tokens, prompt_tokens, depth, seed, answer}
"""
from __future__ import annotations

from dataclasses import dataclass, field

TASKS = ("passkey", "multikey")


@dataclass(frozen=True)
class Grid:
    """Which cases: every task x context length x depth x seed, in that order."""

    context_tokens: tuple[int, ...]  # the document's tokens (the prompt adds the chat template, question, answer start)
    depths: tuple[float, ...]
    seeds: tuple[int, ...]
    tasks: tuple[str, ...] = TASKS


# 8000, not 8192: the 8k document plus the chat template, the question and the answer start
# (about 60 tokens) and the generated tokens stay within max_model_len 8192
FULL = Grid(context_tokens=(2048, 4096, 6144, 8000), depths=(0.1, 0.5, 0.9), seeds=(0, 1))
SMOKE = Grid(context_tokens=(1024,), depths=(0.5,), seeds=(0,))


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # what vLLM is given (prompt_token_ids)
    row: dict = field(hash=False)  # task, context_tokens, prompt_tokens, depth, seed, answer, source


def build_prompts(tokenizer, grid: Grid, max_prompt_tokens: int) -> list[Prompt]:
    """One prompt per case of `grid`, built as bench_accuracy.run_retrieval builds them (same makers,
    same `prompt_with_prefix`). A prompt longer than `max_prompt_tokens` (max_model_len less the
    generated tokens) has an "error" in its row, naming its length, and is not to be run (the others
    are). ValueError for an unknown task."""
    from tierkv.longdoc import multikey_case, passkey_case

    makers = {"passkey": passkey_case, "multikey": multikey_case}
    unknown = [t for t in grid.tasks if t not in makers]
    if unknown:
        raise ValueError(f"tasks: got {unknown}; allowed: {', '.join(makers)}")
    prompts = []
    for task in grid.tasks:
        for num_tokens in grid.context_tokens:
            for depth in grid.depths:
                for seed in grid.seeds:
                    case = makers[task](tokenizer, num_tokens, depth, seed)
                    ids = case.prompt_with_prefix(tokenizer)
                    row = {"task": task, "context_tokens": num_tokens, "prompt_tokens": len(ids), "depth": depth,
                           "seed": seed, "answer": case.answer, "source": case.source}
                    if len(ids) > max_prompt_tokens:
                        row["error"] = (f"the prompt has {len(ids)} tokens, over the {max_prompt_tokens} that leave "
                                        "room for the answer within max_model_len")
                    prompts.append(Prompt(ids, row))
    return prompts


def score(answer: str, text: str) -> bool:
    """bench_accuracy's rule: the answer's digits appear in the generated text, spaces removed."""
    return answer in text.replace(" ", "")
