"""Sampling settings and request results shared by every backend, in vLLM's conventions.

Primitives: `SamplingParams` (checked on construction, by `check_int` and `check_real`: a bad field raises TypeError or
ValueError naming it; also spelt with vLLM's `max_tokens`; `SamplingParams.coerce` takes
vLLM's own `SamplingParams`), `sampling_from_kwargs`, `RequestOutput` and `CompletionOutput` (vLLM's shape:
`out.outputs[0].text`, plus tierkv's `stats`), `sample_next`.

Stops follow vLLM: a request stops at the model's EOS ids and its tokenizer's (unless `ignore_eos`)
and at any of `stop_token_ids`. `repetition_penalty` and `min_tokens` left at None take the
checkpoint's `model.generation_config` values (`tierkv.generation_defaults`).
"""
from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field, fields

import numpy as np
import torch

# vLLM settings tierkv does not implement, with the value that means "off" in vLLM
_VLLM_UNSUPPORTED = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                     "min_p": 0.0, "stop": [], "logprobs": None, "prompt_logprobs": None,
                     "logit_bias": None, "allowed_token_ids": None, "bad_words": [], "structured_outputs": None,
                     "skip_special_tokens": True, "include_stop_str_in_output": False,
                     "spaces_between_special_tokens": True, "repetition_detection": None,
                     "thinking_token_budget": None, "extra_args": None, "detokenize": True}


DEFAULT_MAX_NEW_TOKENS = 64


@dataclass
class SamplingParams:
    """One generate() call's settings. The default is greedy decoding, whose tokens equal transformers'
    `model.generate(do_sample=False)`: the checkpoint's generation_config gives the defaults of
    repetition_penalty and min_tokens, but its sampling settings (do_sample=True, temperature, top_k,
    top_p) are not applied; give temperature > 0 here to sample. Under `backend="vllm"` the defaults are
    what vLLM reads of the checkpoint (its repetition_penalty; vLLM applies no min_new_tokens of it)."""
    max_new_tokens: int | None = None  # 64 unless given (here or as max_tokens); a number after construction
    temperature: float = 0.0           # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # stops besides the model's EOS ids
    ignore_eos: bool = False
    repetition_penalty: float | None = None  # > 1 penalises seen tokens; None: generation_config's (or 1.0)
    min_tokens: int | None = None  # EOS and stop ids masked until this many; None: generation_config's (or 0)
    max_tokens: InitVar[int | None] = None   # vLLM's name for max_new_tokens

    def __post_init__(self, max_tokens: int | None) -> None:
        if max_tokens is not None:
            if self.max_new_tokens not in (None, max_tokens):
                raise ValueError(f"max_tokens={max_tokens!r} and max_new_tokens={self.max_new_tokens!r}: give one")
            self.max_new_tokens = max_tokens
        elif self.max_new_tokens is None:
            self.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        self.check("max_new_tokens" if max_tokens is None else "max_tokens")

    def check(self, max_name: str = "max_new_tokens") -> None:
        """Raise TypeError or ValueError naming the first bad field; run on construction and again when a
        request takes the settings (a field set after construction is held to the same rules)."""
        check_int(max_name, self.max_new_tokens, minimum=1, optional=False)
        check_real("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)",
                    lambda v: v >= 0, optional=False)
        check_int("top_k", self.top_k, minimum=1)
        check_real("top_p", self.top_p, "must be in (0, 1] or None", lambda v: 0 < v <= 1)
        check_int("seed", self.seed, minimum=0, maximum=2**64 - 1)  # torch.Generator's seed range
        if self.seed is not None:
            self.seed = int(self.seed)  # a NumPy integer: torch.Generator takes Python ints only
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError(f"stop_token_ids: got {self.stop_token_ids!r}; a list of token ids or None")
            for i, token in enumerate(self.stop_token_ids):
                check_int(f"stop_token_ids[{i}]", token, minimum=0, optional=False)
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise TypeError(f"ignore_eos: got {self.ignore_eos!r}; must be True or False")
        check_real("repetition_penalty", self.repetition_penalty,
                    "must be a finite number > 0 (1 = off) or None (the model's generation_config decides)",
                    lambda v: v > 0)
        check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens: got {self.min_tokens}; must be <= {max_name} ({self.max_new_tokens})")
        if self.repetition_penalty is not None:  # NumPy scalars as Python numbers, as seed above
            self.repetition_penalty = float(self.repetition_penalty)
        if self.min_tokens is not None:
            self.min_tokens = int(self.min_tokens)

    @classmethod
    def coerce(cls, params) -> "SamplingParams":
        """tierkv's SamplingParams as is; vLLM's `SamplingParams` translated (settings tierkv does not
        implement, such as n > 1 or presence and frequency penalties, are refused by name). vLLM's
        repetition_penalty and min_tokens are carried as given, 1.0 and 0 included: like vLLM's own
        LLM.generate with explicit SamplingParams, they override the model's generation_config."""
        if isinstance(params, cls):
            params.check()  # fields may have been set since construction
            return params
        if not hasattr(params, "max_tokens") or not hasattr(params, "temperature"):
            raise TypeError(f"sampling: got {type(params).__name__}; expected tierkv.sampling.SamplingParams "
                            "or vllm.SamplingParams")
        for name, off in _VLLM_UNSUPPORTED.items():
            value = getattr(params, name, off)
            empty = off in (None, []) and isinstance(value, (list, tuple, dict)) and not value  # none given
            if value != off and not empty:
                raise ValueError(f"sampling.{name}: got {value!r}; tierkv supports only {off!r}")
        if params.max_tokens is None:
            raise ValueError("sampling.max_tokens: got None; give the number of tokens to generate")
        top_k = getattr(params, "top_k", None)
        top_p = getattr(params, "top_p", None)
        return cls(max_new_tokens=params.max_tokens, temperature=params.temperature,
                   top_k=top_k if top_k and top_k > 0 else None, top_p=top_p if top_p not in (None, 1.0) else None,
                   seed=params.seed, stop_token_ids=list(params.stop_token_ids or []) or None,
                   ignore_eos=bool(params.ignore_eos), repetition_penalty=params.repetition_penalty,
                   min_tokens=params.min_tokens)



def _max_tokens(self: SamplingParams) -> int:
    return self.max_new_tokens


def _set_max_tokens(self: SamplingParams, value: int) -> None:
    self.max_new_tokens = value


# vLLM's name reads and sets max_new_tokens (a dataclass InitVar on construction, this property afterwards)
SamplingParams.max_tokens = property(_max_tokens, _set_max_tokens, doc="vLLM's name for max_new_tokens")


def sampling_from_kwargs(kwargs: dict) -> SamplingParams:
    """SamplingParams(**kwargs), an unknown keyword named with the allowed ones."""
    allowed = [f.name for f in fields(SamplingParams)] + ["max_tokens"]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"unknown sampling setting(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return SamplingParams(**kwargs)


def check_int(name: str, value, *, minimum: int, optional: bool = True, maximum: int | None = None) -> None:
    if value is None and optional:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); must be an int"
                        + (" or None" if optional else ""))
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}: got {value}; must be {bound}" + (" or None" if optional else ""))


def check_real(name: str, value, allowed: str, ok, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); {allowed}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past float's range (10**400)
        finite = False
    if not finite or not ok(value):
        raise ValueError(f"{name}: got {value}; {allowed}" if finite or not isinstance(value, int)
                         else f"{name}: got an integer of {len(str(abs(value)))} digits; {allowed}")


@dataclass
class CompletionOutput:
    """One completion of a request, as vLLM's `CompletionOutput`."""
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str                 # "length" or "stop"
    cumulative_logprob: float | None = None
    logprobs: None = None


@dataclass
class RequestOutput:
    """One request's result: vLLM's shape (`outputs[0].text`, `prompt_token_ids`, `finished`) with
    tierkv's per-request `stats`; `text`, `token_ids` and `finish_reason` are the first completion's."""
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str                 # "length" or "stop"
    stats: dict = field(default_factory=dict)
    request_id: str = ""
    prompt: str | None = None
    finished: bool = True

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason)]


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] float, after the request's LogitsRules (repetition penalty, min_tokens; applied by the
    decode loop, tierkv.generation_defaults) -> one token id."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    # shifted by the largest logit first: a near-zero temperature gives 0 for the top and -inf or a large
    # negative number for the rest (a greedy-like choice), never inf - inf = nan
    logits = logits.double()  # a temperature below float32's range (1e-300) stays > 0
    logits = (logits - logits.max()) / params.temperature
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
