"""Prefix reuse: find the longest run of a prompt's blocks held in any tier, load it.

Primitives: `load_prefix(seq, token_ids) -> num_tokens_loaded`.

    prompt blocks:  [b0][b1][b2][b3][b4]..[partial]
    found in tiers:  cpu cpu disk redis  -     -> m = 4 blocks (every layer must be found)
    lower-tier hits are promoted into the CPU tier, all m*L blocks pinned for the sequence,
    and the resident ones (front and window) gathered to the GPU in one batch. A block found but
    unreadable (corrupt, its tier gone since) cuts the prefix there: the blocks before it are used.

At least one prompt token is always left to compute, so the model yields logits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierkv.blocks import block_keys, chain_block_hashes

if TYPE_CHECKING:
    from tierkv.engine.sequence import SequenceKV


def load_prefix(seq: "SequenceKV", token_ids: list[int]) -> int:
    rt = seq.rt
    T = rt.layout.block_tokens
    num_layers = rt.num_layers
    usable = (len(token_ids) - 1) // T
    if usable <= 0 or seq.seq_length:
        return 0
    hashes = chain_block_hashes(token_ids[: usable * T], T, rt.fingerprint)
    keys = [block_keys(hashes, layer) for layer in range(num_layers)]
    where = rt.chain.locate_many([k for layer_keys in keys for k in layer_keys])
    where_by_layer = [where[layer * usable : (layer + 1) * usable] for layer in range(num_layers)]
    m = next((b for b in range(usable) if any(w[b] is None for w in where_by_layer)), usable)
    if m == 0:
        return 0
    flat = [keys[layer][b] for layer in range(num_layers) for b in range(m)]
    got = rt.chain.acquire_available(flat)  # a block found above may still be unreadable (corrupt, tier down)
    by_layer = [got[layer * m : (layer + 1) * m] for layer in range(num_layers)]
    kept = next((b for b in range(m) if any(layer_slots[b] is None for layer_slots in by_layer)), m)
    unused = [flat[j] for j, s in enumerate(got) if s is not None and j % m >= kept]  # pinned past the cut
    if unused:
        rt.chain.tiers[0].release(unused)
    if kept == 0:
        return 0
    m = kept  # the prefix up to the first block some layer could not read; the rest is recomputed
    slots = [s for layer_slots in by_layer for s in layer_slots[:m]]
    _install(seq, keys, slots, m)
    seq.token_ids = list(token_ids)
    for layer in range(num_layers):
        for b in range(m):
            tier = rt.chain.tiers[where_by_layer[layer][b]].name
            seq.prefix_blocks_by_tier[tier] = seq.prefix_blocks_by_tier.get(tier, 0) + 1
    return m * T


def _install(seq: "SequenceKV", keys: list[list[str]], slots: list[int], m: int) -> None:
    """Record the blocks as the sequence's own and gather the resident ones to the GPU."""
    rt = seq.rt
    residency = rt.residency
    per_layer_slots = residency.slots_per_layer
    src, dst = [], []
    for layer in range(rt.num_layers):
        layer_slots = slots[layer * m : (layer + 1) * m]
        seq.cpu_slots[layer] = list(layer_slots)
        seq.block_keys[layer] = list(keys[layer][:m])
        seq.num_tokens[layer] = m * rt.layout.block_tokens
        if seq.summaries is not None:
            seq.summaries.update(layer, 0, rt.cpu.read_slots(layer_slots))
        for b in range(m):
            if residency.is_resident(b, m):
                src.append(layer_slots[b])
                dst.append(layer * per_layer_slots + residency.slot_of(b))
    flat_pool = rt.pool.resident.view(-1, *rt.layout.shape)
    handle = rt.io.gather(torch.tensor(src, dtype=torch.int64), flat_pool,
                                  torch.tensor(dst, dtype=torch.int64))
    handle.wait_on_current_stream()
