"""What besides its token ids makes a vLLM request's KV its own: the root of its block-hash chain.

Primitives: `chain_root`. No vLLM import (reads a request's attributes).

Two requests with the same token ids hold different KV when they run another LoRA adapter (its k/v
projections), carry other images or audio (their embeddings sit at the placeholder tokens), belong to
another tenant (`cache_salt`, vLLM's isolation of its own prefix cache), or give embeddings instead of
tokens (vLLM fills their token ids with zeros). Their blocks must never share an address: the chain
of block hashes starts from a root that names these, so even the first block differs.

    plain request             root None: the model's fingerprint (chain_block_hashes' default)
    adapter / salt / media    sha256(fingerprint's root + their names): shared by requests that agree
    prompt embeddings         a root of its own (nothing shared: hashing 100k embeddings costs a second)
"""
from __future__ import annotations

import hashlib
import json
import uuid

from tierkv.blocks import chain_root_digest


def chain_root(request, fingerprint: str) -> str | None:
    """The parent hash of `request`'s first block (None: the model's default root), from its LoRA
    adapter's name, its cache_salt, its multimodal items (identifier and placeholder position) and
    whether it gives prompt embeddings."""
    parts: dict = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts["lora"] = str(getattr(lora, "lora_name", lora))
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts["cache_salt"] = str(salt)
    media = [(str(getattr(f, "identifier", None)), _position(f)) for f in (getattr(request, "mm_features", None) or [])]
    if media:
        parts["media"] = media
    if getattr(request, "prompt_embeds", None) is not None:
        parts["prompt_embeds"] = uuid.uuid4().hex
    if not parts:
        return None
    return hashlib.sha256(chain_root_digest(fingerprint) + json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _position(feature) -> list[int | None]:
    place = getattr(feature, "mm_position", None)
    return [getattr(place, "offset", None), getattr(place, "length", None)]
