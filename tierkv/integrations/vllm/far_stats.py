"""The hot window's far-path counters of what moved: through the staging ring, the eager sparse
fetches' regions and the graphed rows' far-block caches. Reads only.

Primitives: `cache_stats`, `streaming_stats`. No vLLM import.
"""
from __future__ import annotations

from tierkv.transfer.lookahead import LookaheadStreamer
from tierkv.sparse.row_caches import RowCaches

_NO_CACHES = {"cache_hits": 0, "cache_misses": 0, "cache_stalled_rows": 0, "cache_sets": 0, "cache_bytes": 0,
              "cache_copied_bytes": 0}  # fmt: skip


def cache_stats(row_caches: RowCaches | None, slot_bytes: int, prefetched: int = 0) -> dict:
    """The far-block caches' counters (one device sync; zeros without caches), and the H2D bytes
    their copies moved: slot_bytes per block (the block, or a quantized tier's codes and scales).
    prefetched: the blocks the next-step prefetch copied into the caches (its `prefetch_copied`)."""
    if row_caches is None:
        return dict(_NO_CACHES)
    stats = row_caches.stats()
    # the next-step prefetch's copies (scheduler.sparse_prefetch_margin) cross PCIe into the same caches
    stats["cache_copied_bytes"] = (stats["cache_misses"] + prefetched) * slot_bytes
    return stats


def streaming_stats(streamer: LookaheadStreamer, sparse_streamer: LookaheadStreamer | None, cache: dict,
                    packed_bytes: int) -> dict:  # fmt: skip
    """Chunks and bytes streamed (the main ring's and the eager fetches', plus the caches' copies),
    stalls, carried and discarded chunks, and the device bytes of all the far path's staging.

    cache: `cache_stats`' counters; packed_bytes: a quantized tier's codes and scales buffers."""
    streamers = [streamer] + ([sparse_streamer] if sparse_streamer is not None else [])

    def total(counter: str) -> int:
        return sum(getattr(s, counter) for s in streamers)

    return {"chunks_streamed": total("num_chunks_streamed"),
            "bytes_streamed": total("bytes_streamed") + cache["cache_copied_bytes"],
            # a stall: a sparse row that waits for a fetch at selection (graphed: one that missed its cache)
            "stalls": total("num_stalls") + cache["cache_stalled_rows"],
            "chunks_carried": streamer.num_chunks_carried,
            "chunks_discarded": streamer.num_chunks_discarded,
            "staging_bytes": sum(s.pool.staging_bytes for s in streamers) + cache["cache_bytes"] + packed_bytes}
