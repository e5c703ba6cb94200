"""Per block, how many layers a tier's visible keys hold: one dict probe answers "is this block
held for every layer" instead of one probe per layer.

Primitives: `BlockLayers` (add_many, remove, clear, held_prefix).

    key  <hash>/L<layer><suffix>      (`tierkv.blocks.block_key` + an optional "/R<rank>of<size>")
    group <hash><suffix>              counts[group] = how many of layers [0, num_layers) are held

A key counts only when it is exactly what `block_keys` builds for a layer in [0, num_layers):
a hash without "/", the layer in canonical decimal. So for a hash without "/",
counts[hash + suffix] == num_layers holds exactly when every layer's key is held. Other keys
are not indexed (they are never counted as a layer of any block).
"""
from __future__ import annotations

from typing import Iterable, Sequence


class BlockLayers:
    def __init__(self, num_layers: int):
        if num_layers < 1:
            raise ValueError(f"num_layers: got {num_layers}; must be at least 1")
        self.num_layers = num_layers
        self._layer_names = frozenset(f"L{layer}" for layer in range(num_layers))  # canonical, in range
        self.counts: dict[str, int] = {}  # group -> layers held

    def group(self, key: str) -> str | None:
        """The block a key is one layer of (hash + suffix), None for a key not in block-key form."""
        head, _, rest = key.partition("/")
        name, slash, suffix = rest.partition("/")
        return head + slash + suffix if name in self._layer_names else None

    def add_many(self, keys: Iterable[str]) -> None:
        """Keys that became visible (each one not visible before). `group` inlined: a long prefix's
        first request saves some 200k keys."""
        counts, names = self.counts, self._layer_names
        for key in keys:
            head, _, rest = key.partition("/")
            name, slash, suffix = rest.partition("/")
            if name in names:  # no "/" in the key: name is "", in no layer
                group = head + slash + suffix
                counts[group] = counts.get(group, 0) + 1

    def remove(self, key: str) -> None:
        """A visible key that is no longer."""
        group = self.group(key)
        if group is not None:
            count = self.counts[group] - 1
            if count:
                self.counts[group] = count
            else:
                del self.counts[group]

    def clear(self) -> None:
        self.counts.clear()

    def held_prefix(self, hashes: Sequence[str], suffix: str = "") -> int:
        """How many leading `hashes` are held for every layer (keys `block_keys(hashes, layer, suffix)`)."""
        counts, n = self.counts, self.num_layers
        for i, h in enumerate(hashes):
            if "/" in h or counts.get(h + suffix) != n:
                return i
        return len(hashes)
