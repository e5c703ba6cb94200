"""What TieredLLM checks before any work, for every backend: its arguments (config, device, tokenizer, model
or checkpoint) and generate()'s (prompts and sampling settings), and a request's length against the model.

Primitives: `config_of`, `generate_inputs`, `check_device_and_tokenizer`, `load_model`, `warn_past_positions`.
"""
from __future__ import annotations

import copy
import functools
import logging
import os

import torch

from tierkv.config import TierKVConfig, load_config
from tierkv.model_shape import check_configured_shape, pins_shape, text_config
from tierkv.prompts import normalize_prompts
from tierkv.sampling import SamplingParams, sampling_from_kwargs

logger = logging.getLogger("tierkv.llm")


def warn_past_positions(model, request: int, positions: int) -> None:
    """Log a warning when a request runs the model at more `positions` (its prompt and the new tokens fed back:
    prompt + max_new_tokens - 1) than the model's max_position_embeddings (positions it was not trained on: the
    model runs, as under transformers, but its output may degrade)."""
    config = text_config(model.config)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and positions > limit:
        scaling = getattr(config, "rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        advice = (f"the model's rope scaling ({kind}) may or may not carry it there" if kind not in (None, "default")
                  else "or use a checkpoint with rope scaling")
        logger.warning("request %d runs the model at %d positions (the prompt and the new tokens fed back), past "
                       "its max_position_embeddings=%d: positions beyond it may not have been trained on, and the "
                       "output may degrade (shorten the prompt or max_tokens; %s)", request, positions, limit, advice)


def generate_inputs(prompts, sampling: SamplingParams | None, sampling_kwargs: dict, *, vocab_size: int | None,
                    text_error: str | None = None) -> tuple[SamplingParams, list[str | list[int]]]:
    """`generate()`'s arguments as (sampling settings, one entry per request: text or checked token
    ids), for every backend: prompts in any form `tierkv.prompts.normalize_prompts` accepts;
    settings as SamplingParams or keywords, not both. Raises before any work."""
    if sampling is None:
        sampling = sampling_from_kwargs(sampling_kwargs)
    elif sampling_kwargs:
        raise ValueError("pass either sampling=SamplingParams(...) or keyword settings, not both")
    sampling = SamplingParams.coerce(sampling)  # tierkv's or vLLM's SamplingParams; TypeError otherwise
    for i, token in enumerate(sampling.stop_token_ids or ()):
        if vocab_size is not None and token >= vocab_size:
            raise ValueError(f"stop_token_ids[{i}]: got {token}; the model's vocabulary has {vocab_size} ids "
                             f"(0..{vocab_size - 1})")
    return sampling, normalize_prompts(prompts, vocab_size=vocab_size, text_error=text_error)


def config_of(config) -> TierKVConfig:
    """The `config` argument of a TieredLLM, loaded: a TierKVConfig, a YAML path, a dict or None."""
    if isinstance(config, TierKVConfig):  # a copy: the caller's object, edited later or given to another
        return copy.deepcopy(config)        # TieredLLM, must not change (or report) this one's budget
    if config is not None and not isinstance(config, (str, os.PathLike, dict)):
        raise TypeError(f"config: got {type(config).__name__}; expected a TierKVConfig, a YAML path, a dict or None")
    return load_config(config)


def check_device_and_tokenizer(device, tokenizer) -> None:
    if device is not None:
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device: got {device!r}; expected e.g. 'cpu', 'cuda' or 'cuda:1'") from None
        if parsed.type == "cuda":  # before loading anything
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise ValueError(f"device: got {device!r}; this machine has no CUDA device (torch "
                                 f"{torch.__version__}{'' if torch.version.cuda else ', built without CUDA'})")
            if parsed.index is not None and parsed.index >= count:
                raise ValueError(f"device: got {device!r}; this machine has {count} CUDA device(s)")
    if tokenizer is not None and not callable(tokenizer):
        raise TypeError(f"tokenizer: got {type(tokenizer).__name__}; expected a transformers tokenizer (callable)")


def load_model(model, tokenizer, device: str | None, gguf_file: str | None = None, config: TierKVConfig | None = None):
    """A loaded model, or a checkpoint (directory, .gguf file, shortcut: tierkv.model_loading) loaded on
    `device` (CUDA when present). `config`: a checkpoint's shape (a directory's config.json, a GGUF file's
    header) is checked against its model keys before the weights load (`model_shape.check_configured_shape`)."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        for name, value in (("device", device), ("gguf_file", gguf_file)):
            if value is not None:  # a loaded model stays where it is: say so rather than ignore the argument
                raise ValueError(f"{name}: got {value!r} with a loaded model; {name} applies only when TieredLLM "
                                 f"loads a checkpoint (move the model with model.to(...) before passing it)"
                                 if name == "device" else f"{name}: got {value!r} with a loaded model; it names the "
                                 "file to load from a checkpoint directory")
        return model.eval(), tokenizer, getattr(model.config, "_name_or_path", "") or type(model).__name__
    from tierkv.model_loading import load_checkpoint

    # nothing pinned, nothing to check: no GGUF header or config.json is read for it
    pinned = config is not None and pins_shape(config.model)
    precheck = functools.partial(check_configured_shape, config.model) if pinned else None
    return load_checkpoint(model, tokenizer, device, gguf_file, precheck)
