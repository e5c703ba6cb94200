"""Sampling settings and request results shared by every backend.

Primitives: `SamplingParams` (checked on construction: a bad field raises TypeError or ValueError
naming it), `sampling_from_kwargs`, `RequestOutput`, `sample_next`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np
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
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1, optional=False)
        _check_real("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)",
                    lambda v: v >= 0, optional=False)
        _check_int("top_k", self.top_k, minimum=1)
        _check_real("top_p", self.top_p, "must be in (0, 1] or None", lambda v: 0 < v <= 1)
        _check_int("seed", self.seed, minimum=0)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError(f"stop_token_ids: got {self.stop_token_ids!r}; a list of token ids or None")
            for i, token in enumerate(self.stop_token_ids):
                _check_int(f"stop_token_ids[{i}]", token, minimum=0, optional=False)
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise TypeError(f"ignore_eos: got {self.ignore_eos!r}; must be True or False")


def sampling_from_kwargs(kwargs: dict) -> SamplingParams:
    """SamplingParams(**kwargs), an unknown keyword named with the allowed ones."""
    allowed = [f.name for f in fields(SamplingParams)]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"unknown sampling setting(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return SamplingParams(**kwargs)


def _check_int(name: str, value, *, minimum: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); must be an int"
                        + (" or None" if optional else ""))
    if value < minimum:
        raise ValueError(f"{name}: got {value}; must be >= {minimum}" + (" or None" if optional else ""))


def _check_real(name: str, value, allowed: str, ok, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); {allowed}")
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}: got {value}; {allowed}")


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
