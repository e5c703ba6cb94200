"""Per block, how many layers a tier's visible keys hold and in which slots: one dict probe answers
"is this block held for every layer" (and gives its slots) instead of one probe per layer.

Primitives: `BlockLayers` (add_many, remove, clear, held_prefix, slot_rows), `block_group`, `split_key`.

    key  <hash>/L<layer><suffix>      (`tierkv.blocks.block_key` + an optional "/R<rank>of<size>")
    group <hash><suffix>              counts[group] = how many of layers [0, num_layers) are held
                                      rows[group]   = their slots by layer (int64, -1 where not held)

A key counts only when it is exactly what `block_keys` builds for a layer in [0, num_layers):
a hash without "/", the layer in canonical decimal. So for a hash without "/",
counts[hash + suffix] == num_layers holds exactly when every layer's key is held. Other keys
are not indexed (they are never counted as a layer of any block).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def split_key(key: str) -> tuple[str, str]:
    """(group, layer name) of a key `<hash>/L<layer><suffix>`: (`<hash><suffix>`, `L<layer>`), the name
    not checked (a key without "/" gives ("key", ""))."""
    head, _, rest = key.partition("/")
    name, slash, suffix = rest.partition("/")
    return head + slash + suffix, name


def block_group(key: str) -> str:
    """The block a key `<hash>/L<layer><suffix>` is one layer of: `<hash><suffix>` (the layer not checked)."""
    return split_key(key)[0]


class BlockLayers:
    def __init__(self, num_layers: int):
        if num_layers < 1:
            raise ValueError(f"num_layers: got {num_layers}; must be at least 1")
        self.num_layers = num_layers
        self._layer_of = {f"L{layer}": layer for layer in range(num_layers)}  # canonical names, in range
        self.counts: dict[str, int] = {}  # group -> layers held
        self.rows: dict[str, np.ndarray] = {}  # group -> slot of each layer, -1 where not held

    def group(self, key: str) -> str | None:
        """The block a key is one layer of (hash + suffix), None for a key not in block-key form."""
        where = self.locate(key)
        return None if where is None else where[0]

    def locate(self, key: str) -> tuple[str, int] | None:
        """(block, layer) of a key, None for a key not in block-key form."""
        group, name = split_key(key)
        layer = self._layer_of.get(name)
        return None if layer is None else (group, layer)

    def add_many(self, items: Iterable[tuple[str, int]]) -> None:
        """(key, slot) of keys that became visible (each one not visible before). `group` inlined: a
        long prefix's first request saves some 200k keys."""
        counts, rows, layer_of, n = self.counts, self.rows, self._layer_of, self.num_layers
        for key, slot in items:
            head, _, rest = key.partition("/")
            name, slash, suffix = rest.partition("/")
            layer = layer_of.get(name)
            if layer is not None:  # no "/" in the key: name is "", in no layer
                group = head + slash + suffix
                count = counts.get(group, 0)
                if not count:
                    rows[group] = np.full(n, -1, dtype=np.int64)
                counts[group] = count + 1
                rows[group][layer] = slot

    def remove(self, key: str) -> None:
        """A visible key that is no longer; one not counted (an interrupt between the tier indexing it and
        counting it, or a drop interrupted after this call) is left alone."""
        group, name = split_key(key)
        layer = self._layer_of.get(name)
        row = None if layer is None else self.rows.get(group)
        if row is None or row[layer] < 0:
            return
        count = self.counts[group] - 1
        if count:
            self.counts[group] = count
            self.rows[group][layer] = -1
        else:
            del self.counts[group], self.rows[group]

    def clear(self) -> None:
        self.counts.clear()
        self.rows.clear()

    def slot_rows(self, groups: Sequence[str]) -> np.ndarray | None:
        """[len(groups), num_layers] slots of blocks held for every layer, a fresh array; None when
        some block is not (a miss: the caller takes the per-key path)."""
        counts, rows, n = self.counts, self.rows, self.num_layers
        if any(counts.get(g) != n for g in groups):
            return None
        return np.stack([rows[g] for g in groups]) if groups else np.empty((0, n), dtype=np.int64)

    def held_prefix(self, hashes: Sequence[str], suffix: str = "") -> int:
        """How many leading `hashes` are held for every layer (keys `block_keys(hashes, layer, suffix)`)."""
        counts, n = self.counts, self.num_layers
        for i, h in enumerate(hashes):
            if "/" in h or counts.get(h + suffix) != n:
                return i
        return len(hashes)
