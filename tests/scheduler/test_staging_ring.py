"""ChunkRing, the host-side order of a step's streamed chunks through the staging ring: every
layer's streamed blocks are cut into region-sized chunks, in order, and a chunk's copy is offered
only once its layer is due and its region's previous chunk was consumed."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.scheduler import ChunkRing


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 40), length=st.integers(0, 60), num_layers=st.integers(1, 5),
       num_regions=st.integers(1, 5), region_blocks=st.integers(1, 9))
def test_chunks_cover_each_layer_in_order_and_take_regions_round_robin(start, length, num_layers, num_regions,
                                                                        region_blocks):
    ring = ChunkRing(num_regions, region_blocks)
    streamed = range(start, start + length)
    ring.lay_out(streamed, num_layers)
    per_layer = -(-length // region_blocks)
    assert ring.chunks_per_layer == per_layer and len(ring.chunks) == per_layer * num_layers
    assert [b for r in ring.block_ranges for b in r] == list(streamed)
    for layer in range(num_layers):
        pieces = [ring.chunks[ring.chunk_index(layer, c)] for c in range(per_layer)]
        assert all(chunk_layer == layer for chunk_layer, _ in pieces)
        assert [i for _, blocks in pieces for i in blocks] == list(range(length))  # indices into the layer's blocks
        assert all(1 <= len(blocks) <= region_blocks for _, blocks in pieces)
    assert [ring.region_of(g) for g in range(len(ring.chunks))] == [g % num_regions for g in range(len(ring.chunks))]


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 40), num_layers=st.integers(1, 4), num_regions=st.integers(1, 4),
       region_blocks=st.integers(1, 6), lookahead=st.integers(0, 3))
def test_a_copy_is_offered_only_when_its_layer_is_due_and_its_region_is_free(length, num_layers, num_regions,
                                                                            region_blocks, lookahead):
    """Drive the ring as the streamer does (issue what is offered, then consume layer by layer) and
    check every offer: in order, of a due layer, at most R chunks issued and not consumed."""
    ring = ChunkRing(num_regions, region_blocks)
    ring.lay_out(range(3, 3 + length), num_layers)

    def issue(through_layer: int) -> None:
        while (g := ring.next_to_issue(through_layer)) is not None:
            assert g == ring.num_issued and ring.chunks[g][0] <= through_layer
            assert g - ring.num_consumed < num_regions  # its region's previous chunk was consumed
            ring.num_issued += 1

    issue(lookahead)
    for layer in range(num_layers):
        for c in range(ring.chunks_per_layer):
            g = ring.chunk_index(layer, c)
            issue(layer)  # a chunk not issued ahead is issued when its layer needs it
            assert g < ring.num_issued
            ring.num_consumed += 1
            issue(layer + lookahead)
    assert ring.num_issued == ring.num_consumed == len(ring.chunks)
    assert ring.next_to_issue(num_layers) is None


def test_clear_forgets_the_plan_and_bad_sizes_are_refused():
    ring = ChunkRing(2, 4)
    ring.lay_out(range(0, 10), 2)
    ring.num_issued = ring.num_consumed = 1
    ring.clear()
    assert (ring.chunks, ring.block_ranges, ring.num_issued, ring.num_consumed, ring.chunks_per_layer) == ([], [], 0, 0, 0)
    assert ring.next_to_issue(10) is None
    with pytest.raises(ValueError, match="num_regions 0"):
        ChunkRing(0, 4)
    with pytest.raises(ValueError, match="region_blocks 0"):
        ChunkRing(2, 0)
