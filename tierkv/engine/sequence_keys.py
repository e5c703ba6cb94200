"""The CPU-tier key of each (block, layer) of one sequence.

Primitives: `SequenceKeys` (key).

    block b's tokens all known      block_key(hash_b, layer): content-addressed, the same for every request
                                    with these tokens (hash_b chains the hashes of blocks 0..b)
    otherwise, or a block past      anon-<seq_id>-<b>/L<layer>: the sequence's own, never published
    the prompt in a sparse run
"""
from __future__ import annotations

from typing import Sequence

from tierkv.blocks import block_key, chain_block_hashes


class SequenceKeys:
    def __init__(self, seq_id: str, block_tokens: int, fingerprint: str, private_after_tokens: int | None):
        """private_after_tokens: a block holding a token past it gets the sequence's own key (a sparse run's
        decode tokens: their KV above layer 0 depends on what that step read, the GPU budget's resident blocks
        included); None: every block whose tokens are known gets its content key."""
        self.seq_id, self.block_tokens, self.fingerprint = seq_id, block_tokens, fingerprint
        self.private_after_tokens = private_after_tokens
        self.hashes: list[str] = []  # chained hashes of the leading full blocks, extended as keys ask for more

    def key(self, token_ids: Sequence[int], block_index: int, layer: int) -> str:
        """The key of block `block_index` in `layer`; token_ids: the sequence's tokens known so far."""
        T = self.block_tokens
        end = (block_index + 1) * T
        is_private = self.private_after_tokens is not None and end > self.private_after_tokens
        if is_private or len(token_ids) < end:
            return f"anon-{self.seq_id}-{block_index}/L{layer}"
        if len(self.hashes) <= block_index:  # extend the chain over every full block known now
            start, stop = len(self.hashes) * T, len(token_ids) // T * T
            parent = self.hashes[-1] if self.hashes else None
            self.hashes += chain_block_hashes(token_ids[start:stop], T, self.fingerprint, parent)
        return block_key(self.hashes[block_index], layer)
