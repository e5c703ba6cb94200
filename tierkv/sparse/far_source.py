"""What the sparse step reads of an engine: where its far blocks lie, and what a decoding row holds.

Primitives: `FarSource` (`graphs_usable`), `SparseRow`, `SimpleRow`.

Both engines build these for the engine-agnostic sparse step (`sparse.step.sparse_rows_body`), its
CUDA graphs (`sparse.step_graphs`) and the next-step prefetch (`sparse.prefetch_margin`):

    FarSource   one per engine: the CPU tier holding the far blocks, the transfer engine that copies
                them to the GPU, the device, the layer count, the selection size k, tokens per block
                  vLLM:          FarKV.source (integrations/vllm/far_rows.py), its store's tier and engine
                  transformers:  predictor 'cache' (sparse/predict_cache.py), the runtime's
    SparseRow   one per decoding row: its far-block cache set, its key summaries from its first far
                block on, and per layer the CPU-tier slot of each far block, on the device
                  vLLM:          a request of FarKV (summaries of all its blocks: far blocks start at 0)
                  transformers:  the one sequence, its summaries from the first block past the GPU's
                                 (a `SimpleRow`, as is a padded row of vLLM's full decode graph)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tierkv.sparse.row_caches import CacheSet
    from tierkv.sparse.summaries import BlockSummaries
    from tierkv.storage.cpu import CpuTier
    from tierkv.transfer.engine import TransferEngine


@dataclass(frozen=True)
class FarSource:
    """An engine's far blocks as the sparse step copies them: from `cpu` (its slab, and a quantized
    tier's scales) by `engine` (`gather_h2d_inline`) into far-block caches on `device`; a selection
    is `sparse_blocks` blocks of `block_tokens` tokens, per layer of `num_layers`, ranked by the score
of `bound_weight`."""

    cpu: CpuTier
    engine: TransferEngine
    device: torch.device
    num_layers: int
    sparse_blocks: int
    block_tokens: int
    bound_weight: float = 1.0  # the selection score's mix (scheduler.sparse_bound_weight, summaries.selection_query)

    def graphs_usable(self) -> bool:
        """Whether the sparse step can be captured in CUDA graphs: CUDA and a copy-kernel transfer backend."""
        return self.device.type == "cuda" and self.engine.backend in ("cupy", "adaptive")


class SparseRow(Protocol):
    """One decoding row of the sparse step.

    cache: its far-block cache set (`RowCaches.take`), None until it holds one.
    far_summaries: the key summaries of its far blocks, row i of each layer's table far block i.
    pinned_slots_dev: per layer, int64 [>= far blocks] on the device: the CPU-tier slot of each far block.
    """

    cache: CacheSet | None
    pinned_slots_dev: list[torch.Tensor]

    @property
    def far_summaries(self) -> BlockSummaries | None: ...


@dataclass
class SimpleRow:
    """A `SparseRow` and nothing more."""

    cache: CacheSet | None
    far_summaries: BlockSummaries | None = None
    pinned_slots_dev: list[torch.Tensor] = field(default_factory=list)
