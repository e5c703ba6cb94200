"""What a transformers model's attention must be for tierkv to serve it exactly, checked when a runtime is
made for it (`hf.runtime_for_model`), and the adjustment a length-dependent rotary embedding needs.

Primitives: `check_attention_path`, `attention_span`, `span_problem`, `length_dependent_rotary`,
`RotaryForLength`, `rotary_switch`, `check_kv_projections`, `check_kv_states`, `rotary_unlike_llamas`.

    attention through transformers' attention functions     required (else refused, naming the model)
    multi-head latent attention (kv_lora_rank)               refused
    ALiBi computed by the model (Falcon alibi=True)          refused
    bidirectional attention (is_causal False)                refused (the text decoder's: not a vision tower's,
                                                             nor cross-attention, run only given encoder states)
    attention logit soft-capping, learned attention sinks    refused
    a sliding window / chunked attention (W tokens)          served for sequences of at most W tokens
    rope_type dynamic / longrope                             a chunked prefill rotated as one forward
    a cache recomputed at a rotary switch (Phi-3 longrope)  requests that cross it during decode refused
"""
from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from tierkv.integrations.model_layers import decoder_and_layers
from tierkv.model_shape import text_config


def check_attention_path(model: PreTrainedModel) -> None:
    """ValueError naming the model when tierkv cannot serve its attention: a model that computes attention
    itself instead of through transformers' attention functions (ALL_ATTENTION_FUNCTIONS: Bloom, MPT, GPT-Neo,
    XGLM), whose layers would read only the keys of the current step, or multi-head latent attention
    (kv_lora_rank: DeepSeek V2/V3), whose cached keys and values differ in width."""
    name = type(model).__name__
    sources = _decoder_sources(model)
    if sources and not any("ALL_ATTENTION_FUNCTIONS" in source for source in sources):
        raise ValueError(f"model: {name} computes its attention itself, not through transformers' attention "
                         f"functions, so tierkv cannot serve its KV cache; models whose attention goes through them "
                         f"(Llama, Qwen2, Mistral, Phi-3, GPT-NeoX and most recent ones) are supported")
    text = text_config(model.config)
    if getattr(text, "kv_lora_rank", None):
        raise ValueError(f"model: {name} uses multi-head latent attention (kv_lora_rank={text.kv_lora_rank}): its "
                         f"cached keys and values differ in width, which tierkv's blocks do not hold")
    if getattr(text, "alibi", False):
        raise ValueError(f"model: {name} with alibi=True computes its ALiBi attention itself, over the current step's "
                         f"keys only; tierkv serves it with alibi=False (rotary positions) only")
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"model: {name} soft-caps its attention logits (attn_logit_softcapping={softcap}), which "
                         f"tierkv's attention does not compute; it serves the model with attn_logit_softcapping=None")
    sinks = sorted({type(m).__name__ for m in model.modules() if getattr(m, "sinks", None) is not None})
    if sinks:
        raise ValueError(f"model: {name} adds learned attention sinks ({sinks[0]}.sinks) to its softmax, which "
                         f"tierkv's attention does not compute")
    non_causal = sorted({type(m).__name__ for path, m in _text_decoder_modules(model)
                         if getattr(m, "is_causal", True) is False})
    if non_causal or getattr(text, "use_bidirectional_attention", False):
        raise ValueError(f"model: {name} attends bidirectionally ({', '.join(non_causal) or 'use_bidirectional_attention'}"
                         f"): tierkv's attention is causal, each token reading the tokens before it")


def _decoder_sources(model: PreTrainedModel) -> list[str]:
    """The source of each transformers.models file defining a class of the model's text decoder's modules (a
    vision-language model's language model, not its wrapper's file); [] when some source cannot be read."""
    import sys

    names = {cls.__module__ for _, module in _text_decoder_modules(model) for cls in type(module).__mro__
             if cls.__module__.startswith("transformers.models.")}
    sources = []
    for module_name in sorted(names):
        try:
            sources.append(inspect.getsource(sys.modules[module_name]))
        except (KeyError, OSError, TypeError):  # no source to read: nothing to tell
            return []
    return sources


CROSS_ATTENTION_NAMES = ("encoder_attn", "crossattention", "cross_attn", "cross_attention")


def _text_decoder_modules(model: PreTrainedModel):
    """(path, module) of the modules of the model's text decoder (`model_layers.decoder_and_layers`: not a
    vision tower's, whose attention is bidirectional by design) but its cross-attention over encoder states
    (Bart's encoder_attn), which runs only when a forward is given them (refused then: `hf_guard`)."""
    for path, module in decoder_and_layers(model)[0].named_modules():
        if not any(part in CROSS_ATTENTION_NAMES for part in path.split(".")):
            yield path, module


def attention_span(model: PreTrainedModel) -> tuple[int, str] | None:
    """(tokens, setting) when some layers of `model` attend only part of the context: a sliding window
    (Mistral, Qwen2 with use_sliding_window, Gemma's sliding layers) or chunked attention (Llama 4's
    attention_chunk_size). tierkv attends every earlier token, which is those layers' own attention only
    while a sequence stays within that many tokens; None when every layer attends the whole context."""
    text = text_config(model.config)
    layer_types = getattr(text, "layer_types", None)
    spans = []
    window = getattr(text, "sliding_window", None)
    has_sliding = (any(t == "sliding_attention" for t in layer_types) if layer_types
                   else getattr(text, "use_sliding_window", True) is not False)
    if isinstance(window, int) and window > 0 and has_sliding:
        spans.append((window, f"sliding_window={window}"))
    chunk = getattr(text, "attention_chunk_size", None)
    has_chunked = any(t == "chunked_attention" for t in layer_types) if layer_types else True
    if isinstance(chunk, int) and chunk > 0 and has_chunked:
        spans.append((chunk, f"attention_chunk_size={chunk}"))
    return min(spans) if spans else None


LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # rotary frequencies chosen by the forward's longest position


def length_dependent_rotary(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The rotary-embedding modules of `model` whose frequencies depend on the longest position of the
    forward they run in (rope_type dynamic or longrope): a prompt run in chunks would rotate its first
    chunks' keys for a shorter sequence than one forward over the whole prompt does."""
    found = []
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        if hasattr(module, "inv_freq") and any(t in LENGTH_DEPENDENT_ROPE for t in types):
            found.append(module)
    return found


class RotaryForLength:
    """While active, each of `modules` computes its cos/sin as for one forward over positions
    [0, length) and hands each call its positions' rows: a prompt prefilled in chunks is rotated as
    transformers rotates it in one forward (the decode steps after it need nothing: one token's forward
    sees its whole length, as transformers' own does)."""

    def __init__(self, modules: list[torch.nn.Module], length: int):
        self.modules, self.length = modules, length

    def __enter__(self) -> "RotaryForLength":
        for module in self.modules:
            original = module.forward

            def forward(x, position_ids, *args, _original=original, **kwargs):
                whole = torch.arange(self.length, device=position_ids.device).expand(position_ids.shape[0], -1)
                cos, sin = _original(x, whole, *args, **kwargs)
                index = position_ids.to(torch.int64)
                rows = index.unsqueeze(-1).expand(-1, -1, cos.shape[-1])
                return cos.gather(1, rows), sin.gather(1, rows)

            module.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for module in self.modules:
            del module.forward  # the class's forward again


def span_problem(span: tuple[int, str]) -> str:
    tokens, setting = span
    return (f"the model's {setting}: some of its layers attend only part of the context, tierkv attends all of it, "
            f"which is the same only for sequences of at most {tokens} tokens (the prompt and every new token "
            f"but the last, which is never fed back)")


def rotary_switch(model: PreTrainedModel) -> int | None:
    """The length at which transformers' generation throws a model's cache away and recomputes the whole
    sequence with its long rotary factors (Phi-3 and its kin with rope_type longrope: when the sequence
    first passes original_max_position_embeddings); None for models that keep their cache."""
    generation = getattr(type(model), "prepare_inputs_for_generation", None)
    try:
        source = inspect.getsource(generation) if generation is not None else ""
    except (OSError, TypeError):
        return None
    original = getattr(text_config(model.config), "original_max_position_embeddings", None)
    if "original_max_position_embeddings" in source and isinstance(original, int) and length_dependent_rotary(model):
        return original
    return None


def check_kv_states(layout, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """ValueError when the attention's keys or values are not shaped as the runtime's blocks (a model whose
    attention does not follow its config's num_key_value_heads / head_dim), before anything is stored."""
    expected = (layout.num_kv_heads, layout.head_dim)
    for name, states in (("keys", key_states), ("values", value_states)):
        if states.dim() != 4 or (states.shape[1], states.shape[3]) != expected:
            raise ValueError(f"layer {layer_idx}'s attention gives {name} of shape {tuple(states.shape)}; the runtime "
                             f"holds {expected[0]} KV heads x head_dim {expected[1]} (from the model's config or "
                             "model.num_kv_heads / model.head_dim), which this model's attention does not follow")


def check_kv_projections(model: PreTrainedModel, shape: dict) -> None:
    """ValueError, before any work, when a layer's k_proj / v_proj (where the model has them) give other than
    num_kv_heads x head_dim features: the KV the runtime is shaped for is not what the attention computes."""
    layers = decoder_and_layers(model)[1]
    if layers is None:
        return
    width = shape["num_kv_heads"] * shape["head_dim"]
    for index, layer in enumerate(layers):
        for name in ("k_proj", "v_proj"):
            features = getattr(getattr(getattr(layer, "self_attn", None), name, None), "out_features", None)
            if isinstance(features, int) and features != width:
                raise ValueError(f"model: layer {index}'s self_attn.{name} gives {features} features; the KV cache is "
                                 f"shaped for {shape['num_kv_heads']} KV heads x head_dim {shape['head_dim']} = {width} "
                                 "(the model's config, or model.num_kv_heads / model.head_dim)")


def rotary_unlike_llamas(model: PreTrainedModel, layers: torch.nn.ModuleList) -> str | None:
    """How the model's rotary embedding differs from Llama's, if it does: part of each head rotated
    (partial_rotary_factor, rotary_pct), or interleaved pairs (a rotate_half over x[..., ::2])."""
    import sys

    text = text_config(model.config)
    rope = getattr(text, "rope_parameters", None)
    places = [text, *([rope] if isinstance(rope, dict) else []),
              *(v for v in (rope or {}).values() if isinstance(v, dict))]  # (per layer type, where a model has them)
    for place in places:
        for key in ("partial_rotary_factor", "rotary_pct"):
            factor = place.get(key) if isinstance(place, dict) else getattr(place, key, None)
            if isinstance(factor, (int, float)) and factor != 1:
                return f"{key}={factor}"
    module = sys.modules.get(type(getattr(layers[0], "self_attn", None)).__module__) if len(layers) else None
    rotate_half = getattr(module, "rotate_half", None)
    try:
        source = inspect.getsource(rotate_half) if rotate_half is not None else ""
    except (OSError, TypeError):
        source = ""
    return "interleaved pairs" if "::2" in source else None
