"""What a checkpoint's `model.generation_config` asks of greedy decoding, and the logits rules tierkv
applies for it.

transformers' `model.generate(do_sample=False)` runs the generation config's logits processors, and
tierkv's greedy tokens must equal it. So the config is read at every generate() call:
`repetition_penalty`, `min_new_tokens` and `min_length` become the defaults of a request's
`SamplingParams.repetition_penalty` / `min_tokens` (explicit values win); any other setting that
would change the greedy tokens is refused by name (ValueError), never dropped. Sampling settings
(`do_sample`, `temperature`, `top_k`, `top_p`, ...) are not applied: tierkv's default stays greedy.

Primitives: `GenerationDefaults` (`of_model`, `rules`), `LogitsRules` (`apply`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.sampling import SamplingParams, check_int, check_real

TRANSFORMERS_DEFAULT_TOP_K = 50  # the top_k transformers assumes when generation_config.top_k is None


def _given(value, _config) -> bool:
    """Any value but None or an empty list / dict."""
    return value is not None and not (isinstance(value, (list, tuple, dict)) and not value)


def _above(limit):
    return lambda value, _config: value is not None and value > limit


def _not(neutral):
    return lambda value, _config: value is not None and value != neutral


def _contrastive(value, config) -> bool:
    """penalty_alpha > 0 with top_k > 1 turns greedy decoding into contrastive search."""
    top_k = getattr(config, "top_k", None)
    return value is not None and value > 0 and (TRANSFORMERS_DEFAULT_TOP_K if top_k is None else top_k) > 1


# generation_config fields tierkv does not implement that change what generate(do_sample=False) returns:
# field -> (is this value in effect?, the value that turns it off). Sources: transformers'
# GenerationConfig.get_generation_mode, GenerationMixin._get_logits_processor and its stopping criteria.
# Not here, as they leave greedy tokens as they are in transformers 5: num_beam_groups and diversity_penalty
# (group beam search only, which left the library), max_time (a wall-clock stop, not a token rule).
_UNSUPPORTED = {
    "num_beams": (_above(1), 1),                          # beam search
    "constraints": (_given, None),                        # constrained beam search
    "force_words_ids": (_given, None),
    "penalty_alpha": (_contrastive, None),                # contrastive search
    "dola_layers": (_given, None),                        # DoLa decoding
    "guidance_scale": (_not(1), None),                    # classifier-free guidance
    "sequence_bias": (_given, None),
    "encoder_repetition_penalty": (_not(1), 1.0),         # a decoder-only model's prompt is its "encoder" input
    "no_repeat_ngram_size": (_above(0), 0),
    "encoder_no_repeat_ngram_size": (_above(0), 0),
    "bad_words_ids": (_given, None),
    "forced_bos_token_id": (_given, None),
    "forced_eos_token_id": (_given, None),
    "exponential_decay_length_penalty": (_given, None),
    "suppress_tokens": (_given, None),
    "begin_suppress_tokens": (_given, None),
    "watermarking_config": (_given, None),
    "stop_strings": (_given, None),
    "token_healing": (_not(False), False),
    "cache_implementation": (lambda value, config: value == "quantized", None),  # quantized KV: other logits
}


def refuse_unsupported(config) -> None:
    """Raise ValueError naming the first `generation_config.<field>` that transformers' greedy decoding
    would apply and tierkv does not (its tokens would differ without a word)."""
    for name, (in_effect, off) in _UNSUPPORTED.items():
        value = getattr(config, name, None)  # a field this transformers version lacks is not in effect
        try:
            active = in_effect(value, config)
        except TypeError:  # e.g. a string where transformers expects a number
            active = True
        if active:
            raise ValueError(f"generation_config.{name}: got {value!r:.200}; model.generate(do_sample=False) "
                             f"applies it and tierkv does not implement it: set model.generation_config.{name} = "
                             f"{off!r} to run without it")


@dataclass(frozen=True)
class GenerationDefaults:
    """The settings of `model.generation_config` that tierkv applies, read at one generate() call."""
    repetition_penalty: float = 1.0  # 1.0 = off
    min_new_tokens: int | None = None  # given (0 too), it wins over min_length, as in transformers
    min_length: int = 0              # prompt and new tokens together, as transformers counts it

    @classmethod
    def of_model(cls, model) -> "GenerationDefaults":
        """`model.generation_config` as it is now; an unsupported or bad setting raises, naming it."""
        config = getattr(model, "generation_config", None)
        if config is None:
            return cls()
        refuse_unsupported(config)
        penalty, min_new, min_length = (getattr(config, name, None)
                                        for name in ("repetition_penalty", "min_new_tokens", "min_length"))
        check_real("generation_config.repetition_penalty", penalty,
                    "must be a finite number > 0 (1.0 = off) or None", lambda v: v > 0)
        check_int("generation_config.min_new_tokens", min_new, minimum=0)
        check_int("generation_config.min_length", min_length, minimum=0)
        return cls(float(1.0 if penalty is None else penalty), None if min_new is None else int(min_new),
                   int(min_length or 0))

    def rules(self, sampling: SamplingParams, prompt_ids: list[int], eos_ids: list[int]) -> "LogitsRules":
        """One request's rules: its own settings where given, else these defaults. min_tokens masks the EOS
        ids (even with ignore_eos, as transformers and vLLM do) and the request's stop ids."""
        penalty = self.repetition_penalty if sampling.repetition_penalty is None else sampling.repetition_penalty
        if sampling.min_tokens is not None:
            min_tokens = sampling.min_tokens
        elif self.min_new_tokens is not None:  # transformers then ignores min_length ("takes precedence")
            min_tokens = self.min_new_tokens
        else:
            min_tokens = max(0, self.min_length - len(prompt_ids))
        return LogitsRules(float(penalty), min_tokens, prompt_ids, set(eos_ids) | set(sampling.stop_token_ids or ()))


class LogitsRules:
    """One request's logits rules, applied before sampling (so before temperature, top-k and top-p), as
    transformers' RepetitionPenaltyLogitsProcessor and MinNewTokensLengthLogitsProcessor and vLLM do:

    - repetition penalty: each distinct token of the prompt and of the output so far scores
      score / penalty where score >= 0, score * penalty where below (so a penalty > 1 makes it less likely);
    - min tokens: the masked ids (EOS and stop ids) score -inf while fewer tokens were generated.

    Keeps a [vocab] bool mask of the tokens seen on the logits' device, updated with each new token.
    """

    def __init__(self, repetition_penalty: float, min_tokens: int, prompt_ids: list[int], masked_ids: set[int]):
        self.repetition_penalty, self.min_tokens = repetition_penalty, min_tokens
        self._masked_ids = sorted(masked_ids)
        self._unmarked_prompt_ids: list[int] | None = prompt_ids
        self._num_marked_generated = 0
        self._seen: torch.Tensor | None = None  # [vocab] bool, made at the first penalised step

    def apply(self, logits: torch.Tensor, generated_ids: list[int]) -> torch.Tensor:
        """logits: [vocab] -> [vocab], the next token's scores after `generated_ids`: float32 where a rule
        changed them (transformers scores in float32), the same tensor where none applies."""
        if self.repetition_penalty != 1.0:
            logits = self._penalize(logits, generated_ids)
        if len(generated_ids) < self.min_tokens:
            masked = [t for t in self._masked_ids if t < logits.numel()]
            if masked:
                logits = logits.index_fill(0, torch.tensor(masked, device=logits.device), float("-inf"))
        return logits

    def _penalize(self, logits: torch.Tensor, generated_ids: list[int]) -> torch.Tensor:
        if self._seen is None:
            self._seen = torch.zeros(logits.numel(), dtype=torch.bool, device=logits.device)
            self._mark(self._unmarked_prompt_ids)
            self._unmarked_prompt_ids = None
        self._mark(generated_ids[self._num_marked_generated:])
        self._num_marked_generated = len(generated_ids)
        scores = logits.float()
        penalized = torch.where(scores < 0, scores * self.repetition_penalty, scores / self.repetition_penalty)
        return torch.where(self._seen, penalized, scores)

    def _mark(self, token_ids: list[int]) -> None:
        """Mark tokens as seen; ids past the logits' vocabulary (an embedding larger than the head) cannot be
        generated and are skipped, as transformers does."""
        ids = [t for t in token_ids if t < self._seen.numel()]
        if ids:
            self._seen.index_fill_(0, torch.tensor(ids, device=self._seen.device), True)
