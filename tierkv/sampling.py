"""Sampling settings and request results shared by every backend.

Primitives: `SamplingParams`, `RequestOutput`, `sample_next`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0           # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # None = the model's EOS ids
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: got {self.max_new_tokens}; must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature: got {self.temperature}; must be >= 0 (0 = greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k: got {self.top_k}; must be >= 1 or None")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: got {self.top_p}; must be in (0, 1] or None")


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str                 # "length" or "stop"
    stats: dict = field(default_factory=dict)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] float -> one token id."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k is not None:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
