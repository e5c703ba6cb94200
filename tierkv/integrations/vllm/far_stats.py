"""The hot window's far-path counters: what moved through the staging ring, the eager sparse
fetches' regions and the graphed rows' far-block caches, and `FarKV.stats` as a whole. Reads only.

Primitives: `far_kv_stats`, `cache_stats`, `streaming_stats`. No vLLM import.
"""
from __future__ import annotations

from tierkv.optional_kernel import fallbacks as kernel_fallbacks
from tierkv.transfer.lookahead import LookaheadStreamer
from tierkv.sparse.row_caches import RowCaches

_NO_CACHES = {"cache_hits": 0, "cache_misses": 0, "cache_stalled_rows": 0, "cache_sets": 0, "cache_bytes": 0,
              "cache_copied_bytes": 0}  # fmt: skip


def cache_stats(row_caches: RowCaches | None, slot_bytes: int, prefetched: int = 0,
                retired: list[int] | None = None) -> dict:
    """The far-block caches' counters (one device sync; zeros without caches), and the H2D bytes
    their copies moved: slot_bytes per block (the block, or a quantized tier's codes and scales).
    prefetched: the blocks the next-step prefetch copied into the caches (its `prefetch_copied`).
    retired: the hits, misses and stalled rows of caches a run-time resize dropped (`FarKV.use_staging`)."""
    stats = dict(_NO_CACHES) if row_caches is None else row_caches.stats()
    for name, count in zip(("cache_hits", "cache_misses", "cache_stalled_rows"), retired or ()):
        stats[name] += count
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


def far_kv_stats(far) -> dict:
    """`FarKV.stats`: a far-block reader's counters (`far`: a `far_rows.FarKV`)."""
    prefetch = far.recorder.snapshot()
    full = far.full.stats() if far.full is not None else None  # one read of the prefetch's counters
    cache = far.cache_stats((full or {}).get("prefetch_copied", 0))
    counts = far.counts
    reads = counts["sparse_resident_reads"] + counts["sparse_selected_reads"]
    return {"window_tokens": far.window_tokens, **counts, "requests": len(far.requests),
            "sparse_fetched_reads": counts["sparse_selected_reads"] - cache["cache_hits"], **cache,
            **streaming_stats(far.streamer, far.sparse_streamer, cache,
                              far.graphs.packed_bytes if far.graphs is not None else 0),
            "policy": "sparse" if far.sparse_blocks else "exact",
            "selection_overlap": far.overlap.value(),
            # GPU hit rate at attention time of sparse decode rows: reads of resident blocks (vLLM's pool)
            # and of far blocks their cache held, over all reads
            "gpu_hit_rate": (counts["sparse_resident_reads"] + cache["cache_hits"]) / reads if reads else None,
            "cuda_graphs": far.graphs.stats() if far.graphs is not None else None,
            "full_decode_graphs": full,
            "summary_bytes": sum(r.summaries.num_bytes for r in far.requests.values() if r.summaries is not None)
            + far.key_summaries.spare_bytes,  # held for the next requests too
            **far.host.stats(),  # decode_host_us_per_layer, step_host_ms
            "whole_check_max_abs": (far.graphed.whole_check.item() if far.graphed.whole_check is not None
                                    else None),
            "wait_s": sum(prefetch.get("layers", {}).get("wait_s", [])), "prefetch": prefetch,
            # kernels that failed to build or launch and fell back to PyTorch (same output, slower)
            "kernel_fallbacks": kernel_fallbacks()}
