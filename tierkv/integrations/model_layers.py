"""Where a transformers causal LM's decoder layers are, and which layers tierkv's cache cannot stand in for,
checked when a runtime is made for the model (`hf.runtime_for_model`).

Primitives: `decoder_and_layers`, `check_decoder_layers` (`check_layer_kinds`, `check_layer_count`),
`check_query_predictor`, `SERVED_LAYER_TYPES`.

    the decoder (the module running the layers)  where every forward passes with the ids and the cache: the
                                                  guard's place (a CausalLM may call model.decoder directly: OPT)
    layer types other than attention             refused, naming them: mamba / linear attention / conv layers
                                                  (Jamba, Bamba, Lfm2, Qwen3-Next) keep recurrent state, not KV
    layers reusing another layer's KV            refused (Gemma 3n's num_kv_shared_layers)
    decoder layers other than num_hidden_layers  refused (Bart-family decoder_layers != encoder_layers)
    the query predictor                          needs a q_proj, a pre-attention norm (input_layernorm) and a
                                                  per-head q_norm (if any); refused by name otherwise
"""
from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from tierkv.model_shape import text_config

SERVED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # KV per token, one per layer
_LAYER_LIST_NAMES = ("layers", "h", "layer", "blocks")


def decoder_and_layers(model: PreTrainedModel) -> tuple[torch.nn.Module, torch.nn.ModuleList | None]:
    """(decoder, layers): the module that runs the model's decoder layers, given the input ids and the cache, and
    its ModuleList of layers (None where none is found). Looked for in transformers' `get_decoder()` (the base
    model for Llama, `model.decoder` for OPT, the language model of a vision-language model, not its vision
    tower), then the base model and the model: the first module holding num_hidden_layers layers that takes
    input_ids, else a list named layers / h / layer / blocks of such a module itself."""
    num_layers = getattr(text_config(model.config), "num_hidden_layers", None)
    candidates = _decoder_candidates(model)
    for candidate in candidates:
        for module in candidate.modules():  # the candidate first, then its descendants
            layers = _layer_list(module, lambda name, child: len(child) == num_layers)
            if layers is not None:
                takes_ids = "input_ids" in inspect.signature(module.forward).parameters
                return (module if module is candidate or takes_ids else candidate), layers
    for candidate in candidates:
        layers = _layer_list(candidate, lambda name, child: name in _LAYER_LIST_NAMES)
        if layers is not None:
            return candidate, layers
    return model.base_model, None


def _decoder_candidates(model: PreTrainedModel) -> list[torch.nn.Module]:
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):  # no decoder to name: the base model
        decoder = None
    found = [decoder] if isinstance(decoder, torch.nn.Module) else []
    return found + [model.base_model, model]


def _layer_list(module: torch.nn.Module, fits) -> torch.nn.ModuleList | None:
    """The ModuleList child of `module` that `fits(name, child)`, one named layers / h / layer / blocks first."""
    lists = [(name, child) for name, child in module.named_children()
             if isinstance(child, torch.nn.ModuleList) and fits(name, child)]
    lists.sort(key=lambda item: item[0] not in _LAYER_LIST_NAMES)
    return lists[0][1] if lists else None


def check_decoder_layers(model: PreTrainedModel) -> None:
    """`check_layer_kinds` and `check_layer_count`: every layer of the decoder is one the runtime holds KV for."""
    check_layer_kinds(model)
    check_layer_count(model)


def check_layer_count(model: PreTrainedModel) -> None:
    """ValueError when the decoder's attention reaches past the config's num_hidden_layers, which shapes the
    runtime's layers (a Bart-family ForCausalLM whose decoder_layers exceed its encoder_layers)."""
    decoder = decoder_and_layers(model)[0]
    num_layers = getattr(text_config(model.config), "num_hidden_layers", None)
    indices = [m.layer_idx for m in decoder.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    if indices and isinstance(num_layers, int) and max(indices) >= num_layers:
        raise ValueError(f"model: {type(model).__name__}'s decoder has attention at layer_idx {max(indices)} where its "
                         f"config's num_hidden_layers, which tierkv's runtime is shaped by, is {num_layers}")


def _layer_types(text) -> list[str] | None:
    """Each layer's cache type as transformers' own caches see it ("dummy" for a layer reusing another's KV or
    having no attention), or the config's layer_types where this transformers has no such function."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(text)[0])
    except (ImportError, AttributeError, TypeError, ValueError):  # an older transformers: the config's word
        types = getattr(text, "layer_types", None)
        return list(types) if isinstance(types, (list, tuple)) else None


def check_layer_kinds(model: PreTrainedModel) -> None:
    """ValueError naming the model and the layers when some of its layers are not attention with a KV of their
    own, which TieredLayer stands in for: KV shared from another layer (Gemma 3n's num_kv_shared_layers), or
    mamba / linear-attention / convolution layers, whose recurrent state transformers keeps in the cache
    (Jamba, Bamba, FalconH1, GraniteMoeHybrid, Qwen3-Next, Lfm2)."""
    name = type(model).__name__
    text = text_config(model.config)
    shared = getattr(text, "num_kv_shared_layers", None)
    modes = getattr(text, "kv_sharing_modes", None) or []
    if (isinstance(shared, int) and shared > 0) or "reuse" in modes:
        setting = f"num_kv_shared_layers={shared}" if shared else "kv_sharing_modes 'reuse'"
        raise ValueError(f"model: {name} has layers that reuse another layer's keys and values ({setting}), which "
                         f"tierkv's cache, one KV per layer, does not serve")
    types = _layer_types(text) or []
    declared = getattr(text, "layers_block_type", None) or getattr(text, "layer_types", None) or types
    other = [(i, declared[i] if i < len(declared) else kind) for i, kind in enumerate(types)
             if kind not in SERVED_LAYER_TYPES]
    if other:
        kinds = sorted({kind for _, kind in other})
        raise ValueError(f"model: {name} is a hybrid model: its layers {[i for i, _ in other][:8]} are "
                         f"{', '.join(map(repr, kinds))} layers, whose state is not (only) a KV cache of their own "
                         f"(recurrent or convolution state, or no attention); tierkv serves models whose layers are "
                         f"all attention ({', '.join(SERVED_LAYER_TYPES)})")


def check_query_predictor(model: PreTrainedModel, layers: torch.nn.ModuleList | None, head_dim: int) -> str | None:
    """Why the `query` predictor cannot project `model`'s queries (None when it can): it applies each layer's
    input_layernorm, q_proj and a per-head q_norm to the layer's input, which a post-norm layer (Olmo 2,
    EXAONE 4: no norm before the attention) or a q_norm over the whole projection (Olmo 2's) does not compute."""
    name = type(model).__name__
    if layers is None:
        return f"{name} has no decoder layers list to read hidden states from"
    for index, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if not hasattr(attn, "q_proj"):
            return (f"the query predictor projects queries with each attention's q_proj, which "
                    f"{type(attn).__name__} lacks (q, k and v fused, or no self_attn)")
        if not isinstance(getattr(layer, "input_layernorm", None), torch.nn.Module):
            return (f"the query predictor normalises a layer's input as its attention does (input_layernorm), "
                    f"which {name}'s {type(layer).__name__} (layer {index}) lacks: its norms follow the attention")
        weight = getattr(getattr(attn, "q_norm", None), "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.shape[0] != head_dim:
            return (f"the query predictor normalises each head's query (q_norm over head_dim {head_dim}), where "
                    f"{name}'s {type(attn).__name__}.q_norm spans {weight.shape[0]} features (the whole projection)")
    return None
