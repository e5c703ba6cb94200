"""transformers adapter: a `Cache` whose layers live in tierkv, and the attention that reads them.

Primitives: `TieredCache`, `TieredLayer`, `register` (attention + mask function named "tierkv"),
`runtime_for_model`, `QueryProjector` (the `query` sparse predictor's view of the model). Which models
it serves, and how (a sliding window, a length-dependent rotary embedding): `model_support`.

    model.set_attn_implementation("tierkv")           # after register()
    cache = TieredCache(runtime, token_ids=prompt_ids)
    model.generate(input_ids, past_key_values=cache)   # or model(...) step by step

`TieredLayer.update` stores the new K/V in tierkv and returns the key tensor tagged with the
layer (the attention call receives that same tensor, in every transformers 5 release); the
"tierkv" attention function computes exact attention over
GPU-resident, streamed and fresh blocks (see `tierkv.engine.sequence`). The mask function returns
None: causality comes from token positions. One sequence per cache (batch size 1).

Without a TieredCache (a plain `model.generate()` after `runtime_for_model`), both functions
fall back to transformers' sdpa attention and mask, so the model works as before;
`restore_attention(model)` puts the model's own attention implementation back.

With `scheduler.predictor: query`, a forward pre-hook on every decoder layer hands the layer's
input hidden state of a decode token to the sequence, and `QueryProjector` turns it into
another layer's query (that layer's input norm, q projection, q norm if any, and rotary
embedding at the decode position) for the lookahead prediction.
"""
from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tierkv.blocks import dtype_name
from tierkv.config import ConfigError, TierKVConfig
from tierkv.model_identity import WeightsWatch, model_identity
from tierkv.model_shape import check_configured_shape, model_shape
from tierkv.prompts import token_ids as checked_token_ids
from tierkv.engine.runtime import KVRuntime
from tierkv.engine.sequence import SequenceKV
from tierkv.integrations.hf_guard import ATTN_NAME, install_guard, tiered_forward_running
from tierkv.integrations.model_layers import check_decoder_layers, check_query_predictor, decoder_and_layers
from tierkv.integrations.model_support import (attention_span, check_attention_path, check_kv_projections,
                                               check_kv_states, rotary_unlike_llamas, span_problem)

_LAYER_ATTR = "_tierkv_layer"


class TieredLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, seq: SequenceKV, layer_idx: int):
        super().__init__()
        self.seq = seq
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    @torch.compiler.disable  # the tiers' host work runs eagerly under torch.compile (a graph break)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states: [1, num_kv_heads, n, head_dim] -> returned unchanged."""
        if not tiered_forward_running():  # no guard saw this forward: a model runtime_for_model never prepared
            raise ValueError("TieredCache: its layer ran in no guarded forward (a model not prepared by runtime_for_model, "
                             "or one running its layers outside its decoder): its KV would be filed under the runtime's "
                             "model unchecked; call runtime_for_model(model, ...) and make the cache from that runtime")
        if key_states.shape[0] != 1:
            raise ValueError(
                f"TieredCache holds one sequence; got a batch of {key_states.shape[0]} "
                "(TieredLLM.generate runs a batch of requests one after another)"
            )
        span = getattr(self.seq.rt, "attention_span", None)
        if span is not None and self.seq.num_tokens[self.layer_idx] + key_states.shape[2] > span[0]:
            raise ValueError(f"{span_problem(span)}; this sequence reaches "
                             f"{self.seq.num_tokens[self.layer_idx] + key_states.shape[2]} tokens")
        check_kv_states(self.seq.rt.layout, self.layer_idx, key_states, value_states)
        self.seq.append(self.layer_idx, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        setattr(key_states, _LAYER_ATTR, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seq.num_tokens[self.layer_idx]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("a TieredCache cannot be reset; make a new one per sequence")


class TieredCache(Cache):
    """A transformers Cache backed by one tierkv sequence."""

    is_tierkv_cache = True  # what the forward guard (hf_guard) looks for

    def __init__(self, runtime: KVRuntime, token_ids: list[int] | None = None):
        """token_ids: the prompt's ids (a list, or an integer tensor or array [n]), for prefix reuse and block addresses."""
        if not isinstance(runtime, KVRuntime):
            raise TypeError(f"runtime: got {type(runtime).__name__}; expected a KVRuntime (runtime_for_model)")
        if token_ids is not None:  # none known yet ([]) is allowed here
            token_ids = [] if isinstance(token_ids, (list, tuple)) and not token_ids else checked_token_ids(token_ids)
        watch = getattr(runtime, "weights_watch", None)
        if watch is not None:  # the weights its blocks are addressed by
            watch.check()
        self.seq = runtime.new_sequence(token_ids)
        self.check_fed_ids = True  # hf_guard checks the fed ids and positions; TieredLLM, which feeds its own list, turns it off
        super().__init__(layers=[TieredLayer(self.seq, i) for i in range(runtime.num_layers)])

    @property
    def is_compileable(self) -> bool:
        return False

    def finish(self) -> None:
        self.seq.finish()

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1  # no maximum, as transformers' DynamicCache

    def crop(self, max_length: int):
        raise NotImplementedError("a TieredCache cannot be cropped (its blocks are filed in the tiers as computed); "
                                  "assisted decoding and other rollbacks need transformers' DynamicCache")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("a TieredCache holds one sequence: beam search needs transformers' DynamicCache")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("a TieredCache holds one sequence: num_return_sequences > 1 needs DynamicCache")

    def batch_select_indices(self, indices):
        raise NotImplementedError("a TieredCache holds one sequence: batch selection needs DynamicCache")


@torch.compiler.disable  # eager under torch.compile: the far blocks' reads and copies are host work
def tiered_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query: [1, num_heads, n, head_dim] -> ([1, n, num_heads, head_dim], None)."""
    layer = getattr(key, _LAYER_ATTR, None)
    if layer is None:  # no TieredCache in this forward: the model's cache and stock attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if attention_mask is not None:
        raise ValueError("TieredCache holds one unpadded sequence; got an attention mask with padding "
                         "(run padded batches one request at a time, as TieredLLM.generate does)")
    # a sliding window or an attention chunk is honoured by keeping sequences within it (TieredLayer.update,
    # attention_span): there every earlier token is inside the window, and full attention is the layer's
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError("tierkv attention does not implement logit soft-capping or attention sinks")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = layer.seq.attend(layer.layer_idx, query[0].transpose(0, 1), scale)  # [n, H, D] float32
    return out.to(query.dtype).unsqueeze(0), None


def forward_kwargs(model: PreTrainedModel, cache: Cache) -> dict:
    """The keyword that passes a cache to `model(...)`: `cache` in newer transformers, else `past_key_values`."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def _mask_for_padding_only(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """A forward over a TieredCache: no mask for unpadded input (tierkv takes causality from positions), sdpa's
    mask where the 2-D attention mask pads (refused by `tiered_attention`). Any other forward (the model's own
    cache, or none): transformers' stock sdpa mask, sliding windows and cached prefixes included."""
    if tiered_forward_running() and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register the "tierkv" attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, tiered_attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask_for_padding_only)


def restore_attention(model: PreTrainedModel) -> None:
    """Undo `runtime_for_model`'s switch: the attention implementation the model had before."""
    previous = getattr(model, "_tierkv_previous_attn", None)
    if previous is not None:
        model.set_attn_implementation(previous)


def model_kv_shape(model: PreTrainedModel) -> dict:
    """num_layers, num_kv_heads, head_dim of a Llama/Qwen2/Mistral-architecture model."""
    return model_shape(model.config, f"{type(model).__name__}.config").kv_shape()


class QueryProjector:
    """hidden [hidden_size] -> q [num_heads, head_dim] of decoder layer `layer`, rotary applied at
    `position` = (cos, sin), each [head_dim], of the decode token. Enqueues device work only."""

    def __init__(self, layers: torch.nn.ModuleList, head_dim: int):
        self.layers = layers
        self.head_dim = head_dim

    @torch.no_grad()
    def __call__(self, layer: int, hidden: torch.Tensor, position: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        block = self.layers[layer]
        attn = block.self_attn
        q = attn.q_proj(block.input_layernorm(hidden.unsqueeze(0))).view(-1, self.head_dim)  # [H, D]
        if getattr(attn, "q_norm", None) is not None:
            q = attn.q_norm(q)
        cos, sin = position
        half = self.head_dim // 2
        rotated = torch.cat((-q[:, half:], q[:, :half]), dim=-1)  # rotate_half, as transformers' Llama does
        return q * cos + rotated * sin


def _observe_layer_input(layer_idx: int):
    """A forward pre-hook: a decode token's input hidden state to the sequence of a TieredCache."""

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        position = kwargs.get("position_embeddings")
        if not isinstance(cache, TieredCache) or position is None:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]  # [1, n, hidden_size]
        if hidden.shape[1] == 1:
            cos, sin = position  # [1, 1, head_dim] each
            cache.seq.observe_layer_input(layer_idx, hidden[0, -1], (cos[0, -1], sin[0, -1]))
        return None

    return hook


def check_query_predictor_fits(model: PreTrainedModel, head_dim: int) -> torch.nn.ModuleList:
    """The decoder layers the `query` predictor reads; ConfigError naming the model when it cannot project their
    queries as their attention does (`model_layers.check_query_predictor`, rotary other than Llama's)."""
    layers = decoder_and_layers(model)[1]
    problem = check_query_predictor(model, layers, head_dim)
    rotary = rotary_unlike_llamas(model, layers) if problem is None else None
    if rotary:
        problem = (f"the query predictor rotates queries as Llama does (the whole head, halves swapped), which "
                   f"{type(model).__name__} does not ({rotary})")
    if problem:
        raise ConfigError("scheduler.predictor", "query", f"{problem}: use predictor 'previous', 'cache' or 'none'")
    return layers


def install_query_projector(model: PreTrainedModel, runtime: KVRuntime, layers: torch.nn.ModuleList) -> None:
    """Give `runtime` the model's `QueryProjector` over its decoder `layers` (as `check_query_predictor_fits`
    returned them) and hook those layers (once per model)."""
    runtime.query_projector = QueryProjector(layers, runtime.layout.head_dim)
    if getattr(model, "_tierkv_query_hooks", False):
        return
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(_observe_layer_input(i), with_kwargs=True)
    model._tierkv_query_hooks = True


def runtime_for_model(model: PreTrainedModel, config: TierKVConfig, model_id: str | None = None) -> KVRuntime:
    """A KVRuntime shaped like `model`'s KV cache, on the model's device and dtype.

    Its blocks are addressed by `config.model.name`, `model_id` (where the model came from, e.g. its
    checkpoint path; default: the config's `_name_or_path` or the class name) and a digest of the
    model's weights (`tierkv.model_identity`): blocks of different weights never mix.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model: got {type(model).__name__}; expected a loaded transformers PreTrainedModel")
    if not isinstance(config, TierKVConfig):
        raise TypeError(f"config: got {type(config).__name__}; expected a TierKVConfig (tierkv.config.load_config)")
    check_attention_path(model)
    check_decoder_layers(model)  # hybrids, shared KV, a layer count other than num_hidden_layers
    identity = model_identity(model, config.model.name, model_id)  # checks model_id's type
    shape = model_kv_shape(model)
    check_configured_shape(config.model, shape)
    check_kv_projections(model, shape)
    query = config.scheduler.policy == "sparse" and config.scheduler.predictor == "query"
    # checked before the model's attention is switched
    query_layers = check_query_predictor_fits(model, shape["head_dim"]) if query else None
    param = next(model.parameters())
    if config.model.kv_dtype not in ("auto", dtype_name(param.dtype)):
        raise ConfigError("model.kv_dtype", config.model.kv_dtype, f"the model runs in {dtype_name(param.dtype)}: "
                          "'auto' or that")
    register()
    if model.config._attn_implementation != ATTN_NAME:
        model._tierkv_previous_attn = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    runtime = KVRuntime(config, dtype=param.dtype, device=param.device,
                        model_id=identity, **shape)
    runtime.attention_span = attention_span(model)  # sequences are held within it (TieredLayer.update)
    runtime.weights_watch = WeightsWatch(model)  # TieredCache refuses weights changed since (their KV's addresses)
    # the attention, owner, compile, fed ids and positions of TieredCache forwards, where they all pass
    install_guard(decoder_and_layers(model)[0], runtime, model.config)
    if query_layers is not None:
        install_query_projector(model, runtime, query_layers)
    return runtime
