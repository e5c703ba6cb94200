"""What a forward over a TieredCache is checked for before it runs: a pre-hook on the model's decoder, the module
that runs the decoder layers (`model_layers.decoder_and_layers`), which `model(...)`, `model.model(...)` and a
CausalLM calling its nested decoder directly (OPT's `self.model.decoder`) all pass through.

Primitives: `install_guard`, `tiered_forward_running`, `ATTN_NAME`.

    the model's attention is tierkv's     under another one (restore_attention, set_attn_implementation) a
                                          TieredCache's past would not be read: only the new tokens attended
    the cache's runtime is this model's   a cache of another model's runtime is another model's KV
    no encoder_hidden_states              they would run a decoder's cross-attention (Bart-family ForCausalLM)
                                          over keys tierkv does not hold
    (under torch.compile these checks, the cache's update and tierkv's attention run eagerly: graph breaks)
    the fed ids and positions             the cache's `token_ids` (its blocks' addresses in the shared tiers) and
                                          the positions after its tokens: other tokens' or positions' KV filed
                                          under them would be served to every later prompt sharing them

No hook work for a forward without a TieredCache, except noting that (`tiered_forward_running`): the model's
own cache then gets transformers' stock mask (`hf._tierkv_mask`).
"""
from __future__ import annotations

import threading
import weakref

import torch

ATTN_NAME = "tierkv"
_STATE = threading.local()


def tiered_forward_running() -> bool:
    """Whether this thread's current forward passes a TieredCache."""
    return getattr(_STATE, "tiered", False)


def install_guard(decoder: torch.nn.Module, runtime, config) -> None:
    """Bind `runtime` to `decoder`, the module every forward of the model runs its decoder layers in, and hook
    that (once per module); `config`, the model's, says the attention implementation where `decoder` has none."""
    runtime.base_model_ref = weakref.ref(decoder)
    if getattr(decoder, "config", None) is None:
        decoder._tierkv_config = config
    if not getattr(decoder, "_tierkv_guard_hooks", None):
        decoder._tierkv_guard_hooks = (decoder.register_forward_pre_hook(_before, with_kwargs=True),
                                       decoder.register_forward_hook(_after, with_kwargs=True, always_call=True))


@torch.compiler.disable  # host checks: eager under torch.compile
def _before(module, args, kwargs) -> None:
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    _STATE.tiered = tiered = bool(getattr(cache, "is_tierkv_cache", False))
    if not tiered:
        return None
    if kwargs.get("encoder_hidden_states") is not None:
        raise ValueError("TieredCache: a forward given encoder_hidden_states would run the decoder's cross-attention "
                         "over them, whose keys tierkv does not hold; a TieredCache serves decoder-only generation")
    config = getattr(module, "config", None) or module._tierkv_config
    implementation = config._attn_implementation
    if implementation != ATTN_NAME:
        raise ValueError(f"TieredCache: the model's attention is {implementation!r}, which reads only the new tokens "
                         f"from it; set it back with runtime_for_model (it was changed since: restore_attention or "
                         f"set_attn_implementation)")
    owner = getattr(cache.seq.rt, "base_model_ref", None)
    if owner is not None and owner() is not module:
        raise ValueError("TieredCache: its runtime was made by runtime_for_model for another model; its KV is that "
                         "model's")
    if cache.check_fed_ids:
        _check_fed_ids(cache, args, kwargs)
        _check_positions(cache, kwargs)
    return None


def _after(module, args, kwargs, output) -> None:
    _STATE.tiered = False
    return None


def _check_fed_ids(cache, args, kwargs) -> None:
    """The tokens fed for the positions whose ids the cache was given: ValueError naming the first difference;
    positions past the known ids are not checked."""
    seq = cache.seq
    start = seq.num_tokens[0]
    known = seq.token_ids[start:]
    if not known:
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise ValueError("TieredCache: given token_ids, the model must be fed input_ids (its blocks are addressed by "
                         "them; inputs_embeds cannot be checked against them): pass token_ids=None for embeddings")
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():  # a decode graph's capture: no host reads
        return
    fed = ids[0, : len(known)].tolist()
    if fed != known[: len(fed)]:
        at = next(i for i, (a, b) in enumerate(zip(fed, known)) if a != b)
        raise ValueError(f"TieredCache: the model was fed token {fed[at]} at position {start + at} where the cache's "
                         f"token_ids hold {known[at]}: its KV would be filed under the other tokens' block addresses; "
                         f"give TieredCache the ids the model is fed")


def _check_positions(cache, kwargs) -> None:
    """Explicit position_ids / cache_position must be the positions after the cache's tokens: KV computed at
    others is not the KV its blocks' addresses stand for."""
    start = cache.seq.num_tokens[0]
    for name in ("position_ids", "cache_position"):
        positions = kwargs.get(name)
        if positions is None or not isinstance(positions, torch.Tensor) or positions.numel() == 0:
            continue
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            continue
        given = (positions[0] if positions.dim() > 1 else positions).reshape(-1).cpu()
        expected = torch.arange(start, start + given.numel(), dtype=given.dtype)
        if not torch.equal(given, expected):
            raise ValueError(f"TieredCache: {name} {given[:4].tolist()}... where the cache's next positions are "
                             f"{start}..{start + given.numel() - 1}: KV at other positions would be filed under its "
                             f"blocks' addresses")
