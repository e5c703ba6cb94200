"""Which streamed chunk goes where and when: the order of one step's chunks through the staging
ring (host only: plain Python, no torch, no device).

Primitives: `ChunkRing` (`lay_out`, `clear`, `region_of`, `next_to_issue`, `chunk_index`).

The staging ring has R regions. A layer's streamed blocks are cut into chunks of one region each
(C per layer). Chunks are numbered across layers (g = layer * C + c); chunk g goes to region
g % R once chunk g - R has been consumed:

    copy stream:    [g0][g1][g2][g3] ... each copy waits for the event "region free"
    compute stream:      att(g0)  att(g1)  att(g2) ... each waits for its own copy's event

The copies themselves, their events and the device tensors attention reads are
`tierkv.transfer.lookahead.LookaheadStreamer`'s.
"""
from __future__ import annotations


class ChunkRing:
    """One step's chunks (`chunks[g] = (layer, blocks)`, blocks a range of indices into the layer's
    streamed blocks; `block_ranges`: each chunk of a layer as a range of block numbers) and how far
    their copies were issued (`num_issued`) and their attention consumed them (`num_consumed`)."""

    def __init__(self, num_regions: int, region_blocks: int) -> None:
        if num_regions < 1 or region_blocks < 1:
            raise ValueError(f"ChunkRing: num_regions {num_regions} and region_blocks {region_blocks} must be >= 1")
        self.num_regions = num_regions
        self.region_blocks = region_blocks
        self.clear()

    def clear(self) -> None:
        """No chunks (a step that streams nothing ahead)."""
        self.chunks: list[tuple[int, range]] = []
        self.block_ranges: list[range] = []
        self.num_issued = 0
        self.num_consumed = 0

    def lay_out(self, streamed: range, num_layers: int) -> None:
        """This step's chunks: the streamed block range, the same in every one of `num_layers`
        layers, cut into pieces of `region_blocks` blocks; nothing issued or consumed yet."""
        self.clear()
        region = self.region_blocks
        self.block_ranges = [range(s, min(s + region, streamed.stop)) for s in range(streamed.start, streamed.stop, region)]
        offset = streamed.start
        self.chunks = [(layer, range(r.start - offset, r.stop - offset))
                       for layer in range(num_layers) for r in self.block_ranges]

    @property
    def chunks_per_layer(self) -> int:
        return len(self.block_ranges)

    def chunk_index(self, layer: int, c: int) -> int:
        """g of chunk c of `layer`."""
        return layer * self.chunks_per_layer + c

    def region_of(self, g: int) -> int:
        """The staging region chunk g is copied into."""
        return g % self.num_regions

    def next_to_issue(self, through_layer: int) -> int | None:
        """The next chunk whose copy may be issued now: one of a layer <= through_layer whose region
        is free (its chunk g - R consumed); None when there is none."""
        g = self.num_issued
        if g < len(self.chunks) and self.chunks[g][0] <= through_layer and g < self.num_consumed + self.num_regions:
            return g
        return None
