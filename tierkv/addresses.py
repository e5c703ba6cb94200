"""What a config adds to its engine's block addresses: the fields beside the model in `blocks.model_fingerprint`
that keep KV bytes differing from exact KV (quantized tiers, sparse attention) off exact engines' addresses.

Primitives: `kv_path` (all of them, from a TierKVConfig), `lossy_path`, `sparse_path`.
"""
from __future__ import annotations

from typing import Sequence

from tierkv.quant import QUANT_FORMATS


def lossy_path(tiers: Sequence[tuple[str, str]]) -> dict:
    """The fingerprint's extra fields for a chain whose tiers ((kind, storage_dtype) in chain order) store blocks
    quantized anywhere (`quant.QUANT_FORMATS`; "auto" or the KV dtype spelled out keeps them bit-exact): every
    block that passed a quantized tier is lossy in each tier below it too (spills and write-through copy the
    dequantized values), and the engine itself reads its blocks back from there; an engine whose tiers keep blocks
    exact must never take them for its own (a quantized disk under an exact CPU tier put lossy blocks into a shared
    Redis under exact addresses). {} when every tier keeps them exact (the addresses of exact chains stay as they
    were); a quantized first tier alone keeps the field it always had. Otherwise every tier's kind and format, so
    that two chains sharing addresses store a shared tier's blocks in one layout."""
    formats = [(kind, dtype if dtype in QUANT_FORMATS else "auto") for kind, dtype in tiers]
    if all(dtype == "auto" for _, dtype in formats):
        return {}
    if all(dtype == "auto" for _, dtype in formats[1:]):
        return {"first_tier_storage": formats[0][1]}
    return {"tier_storage": [f"{kind}:{dtype}" for kind, dtype in formats]}


def sparse_path(config) -> dict:
    """The fingerprint's extra fields for an engine of the sparse policy (a TierKVConfig): the KV of the tokens it
    decodes comes from layers that attended a selection of the far blocks, so it differs from exact KV, and from
    another selection's; an exact engine (or one selecting otherwise) must never take those blocks for its own
    (a follow-up turn of the same conversation reused them). The transformers engine goes further and never
    publishes a block holding a decoded token (`SequenceKV._key`: its resident front blocks, which the GPU
    budget sizes, are read too); under vLLM the selection reads the window and the top blocks by these settings.
    {} under the exact policy (its addresses stay as they were)."""
    scheduler, cache = config.scheduler, config.cache
    if scheduler.policy == "exact":
        return {}
    return {"attention": {"policy": scheduler.policy, "token_budget": scheduler.sparse_token_budget,
                          "selection": scheduler.sparse_selection, "bound_weight": scheduler.sparse_bound_weight,
                          "sink_tokens": cache.sink_tokens, "window_tokens": cache.window_tokens}}


def kv_path(config) -> dict:
    """Everything of a TierKVConfig that makes its engine's KV bytes differ from exact KV of the same model:
    `lossy_path` and `sparse_path` together, the fingerprint's extra fields."""
    return {**lossy_path([(t.kind, t.storage_dtype) for t in config.tiers]), **sparse_path(config)}
