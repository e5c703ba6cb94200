"""Sparse decode: attend the resident blocks plus the k far blocks whose keys can score highest.

Engine-agnostic (no vLLM import); the transformers engine and the vLLM integration both use it.

    summaries          per-block key min/max on the GPU, the upper bound of q . k, top-k selection
    request_summaries  one request's summaries and selection under the hot window (vLLM far rows)
    kernels            Triton kernels of the block bound
    block_cache        per-layer LRU far-block cache in staging slots (predictor `query`)
    row_caches         per-row far-block caches of the graphed step (predictor `cache`, vLLM rows)
    step               the sparse step of many rows: select, fetch, far attention (device work only)
    step_graphs        that step captured in CUDA graphs per layer and set of rows, with the merge
    row_graph          one such graph: what it bakes in (row_key), its static inputs and outputs
    graph_capture      capturing one CUDA graph beside the compute stream (also the decode graph's no_gc)
    prefetch_margin    next-step prefetch of the blocks ranked just below the selection
    predict_previous   predictor `previous`: each layer's last selection, copied ahead
    predict_query      predictor `query`: the next layers' selection from the hidden state
    predict_cache      predictor `cache` in the transformers engine (row caches + the step body)

The selection primitives of `summaries` are re-exported here.
"""
from tierkv.sparse.summaries import (
    BlockSummaries,
    check_candidates,
    key_bounds,
    masked_bounds_rows,
    select_far_blocks,
    select_far_blocks_on_device,
    select_far_blocks_per_kv_head,
    top_blocks,
)

__all__ = ["BlockSummaries", "check_candidates", "key_bounds", "masked_bounds_rows", "select_far_blocks",
           "select_far_blocks_on_device", "select_far_blocks_per_kv_head", "top_blocks"]
