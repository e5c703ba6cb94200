"""The runtime one model uses: tiers, GPU pool, transfer engine, scheduler, counters.

Primitives: `KVRuntime` (`new_sequence`, `check_fits`, `stats`, `close`).

One sequence runs at a time per runtime: it owns the GPU hot window while it runs.
"""
from __future__ import annotations

import logging
import threading

import torch

from tierkv.addresses import kv_path
from tierkv.blocks import BlockLayout, dtype_name, model_fingerprint
from tierkv.attention.cpu_far import InPlaceFarReads, reads_in_place
from tierkv.config import ConfigError, TierKVConfig
from tierkv.block_io import BlockIO
from tierkv.budget_change import BudgetChange, BudgetRefused, HotWindowLost, check_fits_device, parse_budget
from tierkv.engine.elastic import resize_hot_window
from tierkv.metrics.prefetch import PrefetchRecorder
from tierkv.model_identity import ModelIdentity
from tierkv.transfer.lookahead import LookaheadStreamer
from tierkv.engine.sequence import CapacityError, SequenceKV
from tierkv.sparse.block_cache import cache_slots_per_layer
from tierkv.storage import build_tiers
from tierkv.storage.cpu import CpuTier
from tierkv.storage.gpu import GpuBlockPool, ResidencyPlan, plan_residency
from tierkv.transfer import configured_engine
from tierkv.units import format_bytes

logger = logging.getLogger(__name__)

class KVRuntime:
    def __init__(self, config: TierKVConfig, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, model_id: str | ModelIdentity):
        """model_id: what names the model in every block address; a `ModelIdentity` (name, source,
        weights digest: `tierkv.model_identity`) or a plain string, taken as it is."""
        if isinstance(model_id, str):
            model_id = ModelIdentity(model_id, model_id, None)
        elif not isinstance(model_id, ModelIdentity):
            raise TypeError(f"model_id: got {type(model_id).__name__}; expected a str or a ModelIdentity")
        self.config = config
        self.identity = model_id
        self.device = torch.device(device)
        self.num_layers = num_layers
        self.layout = BlockLayout(num_kv_heads, config.cache.block_tokens, head_dim, dtype)
        self.fingerprint = model_fingerprint(model_id.key, num_layers, self.layout, kv_path(config))
        residency = plan_residency(self.layout, num_layers, config.cache.gpu_budget_bytes,
                                   config.cache.sink_tokens, config.cache.window_tokens)
        num_regions = max(2, config.scheduler.lookahead_layers + 1)
        _check_lookahead(config.scheduler, num_layers, self.layout)
        self.pool = GpuBlockPool(self.layout, num_layers, residency, config.scheduler.staging_bytes,
                                 num_regions, self.device)
        scheduler = config.scheduler
        if (scheduler.policy == "sparse" and scheduler.sparse_selection != "per_layer"
                and not reads_in_place(scheduler.cpu_far_reads, self.device)):
            raise ConfigError("scheduler.sparse_selection", scheduler.sparse_selection,
                              f"per_kv_head is built only where far blocks are read in place (a CPU device, "
                              f"cpu_far_reads: direct; here device {self.device}, cpu_far_reads "
                              f"{scheduler.cpu_far_reads!r}): use 'per_layer'")
        if scheduler.policy == "sparse" and scheduler.predictor == "query":  # refuse a too small staging now
            cache_slots_per_layer(num_layers, self.pool.staging.shape[0],
                                  scheduler.sparse_token_budget // config.cache.block_tokens, self.layout.num_bytes)
        if scheduler.policy == "sparse" and scheduler.predictor == "cache":  # the same for its caches and margin
            from tierkv.sparse.predict_cache import check_staging
            from tierkv.sparse.prefetch_margin import check_margin

            k = scheduler.sparse_token_budget // config.cache.block_tokens
            selections = max(1, scheduler.sparse_cache_selections)
            check_staging(num_layers, self.pool.staging.shape[0], k, selections, self.layout.num_bytes)
            check_margin(scheduler.sparse_prefetch_margin, k, selections * k, per_layer=True)
        self.chain = build_tiers(config.tiers, self.layout, pin_memory=self.device.type == "cuda",
                                 storage=config.storage)
        self.cpu: CpuTier = self.chain.tiers[0]
        # a CPU device reads far blocks where they lie in the CPU tier (scheduler.cpu_far_reads: direct)
        self.far_in_place = (InPlaceFarReads(self.cpu) if reads_in_place(scheduler.cpu_far_reads, self.device)
                             else None)
        self.engine = configured_engine(self.device, config.scheduler.transfer_backend)
        self.prefetch_metrics = PrefetchRecorder(num_layers)  # the streamer reports every chunk here
        self.io = BlockIO(self.engine, self.cpu)
        self.streamer = LookaheadStreamer(self.io, self.pool, config.scheduler.lookahead_layers,
                                          recorder=self.prefetch_metrics)
        self.active: SequenceKV | None = None
        # predictor `query`: (layer, hidden [hidden_size], position) -> q [num_heads, head_dim]; set by the adapter
        self.query_projector = None
        self.cached_sparse = None  # predictor `cache`: the far-block caches its sequences use (tierkv.sparse.predict_cache)
        # decode steps run by the graphed forward and of those replayed from a CUDA graph, steps run eagerly,
        # graphs captured, captures failed, host seconds spent capturing (tierkv.engine.decode_graph)
        self.decode_graph_counts = {"graph_steps": 0, "replays": 0, "eager_steps": 0, "captures": 0,
                                    "capture_errors": 0, "capture_s": 0.0}
        self._budget_lock = threading.RLock()
        self._pending_budget: tuple[int, object, list[BudgetChange]] | None = None
        self._last_budget_change: BudgetChange | None = None
        self.gpu_bytes_returned = 0
        self.num_budget_changes = 0
        self.num_budget_refusals = 0  # changes refused, at once or when applied (old budget kept)
        self.last_budget_refusal: str | None = None

    @property
    def residency(self) -> ResidencyPlan:
        """Which blocks the GPU pool holds; the pool owns it (a budget change swaps it there)."""
        return self.pool.residency

    def set_gpu_budget(self, budget: int | str) -> BudgetChange:
        """Resize the GPU hot window to `budget` bytes (all layers; an int or a size such as "1GiB").

        Refused at once, changing nothing, with ValueError (not a positive size; sinks + window do
        not fit: ConfigError) or BudgetRefused (the pool cannot fit the device). Otherwise applied
        now when no sequence runs, else when its next forward step starts. The returned change
        resolves when it is applied or refused: a refusal there (the allocation failed) leaves the
        old pool working, is logged and counted (`stats()["gpu"]["budget_refusals"]`), and
        `change.wait()` raises it.
        """
        cache = self.config.cache
        with self._budget_lock:
            try:
                budget_bytes = parse_budget(budget)
                residency = plan_residency(self.layout, self.num_layers, budget_bytes, cache.sink_tokens,
                                           cache.window_tokens)
                check_fits_device(self.device, self.num_layers * residency.slots_per_layer * self.layout.num_bytes,
                                  self.pool.resident_bytes)
            except (ValueError, BudgetRefused) as exc:
                self._record_refusal(exc)
                raise
            change = BudgetChange(budget_bytes)
            replaced = self._pending_budget[2] if self._pending_budget is not None else []
            self._pending_budget = (budget_bytes, residency, replaced + [change])
            self._last_budget_change = change
            if self.active is None or self.active.is_finished:  # idle: nothing can start meanwhile
                self._apply_locked(None)
        return change

    @property
    def pending_budget_bytes(self) -> int | None:
        """The budget a `set_gpu_budget` asked for and not yet applied (it applies at the next step), or None."""
        pending = self._pending_budget
        return pending[0] if pending is not None and pending[2] else None

    def wait_for_budget(self, timeout_s: float | None = None) -> bool:
        """Block until the last `set_gpu_budget` was applied or refused; False on timeout."""
        change = self._last_budget_change
        return True if change is None else change._done.wait(timeout_s)

    def apply_pending_requested(self) -> None:
        """When a sequence ends: apply a change someone asked for after its last forward step (a pool rebuild
        after a lost hot window waits for the next sequence, as before). Never raises: a failure is refused,
        logged and counted as any other."""
        with self._budget_lock:
            if self._pending_budget is None or not self._pending_budget[2]:
                return
            try:
                self._apply_locked(None)
            except HotWindowLost:  # recorded; the next sequence rebuilds the pool
                pass

    def apply_pending_budget(self, seq: SequenceKV | None) -> None:
        """Called between forward steps: swap in a pending hot-window size, if any. A resize that
        fails is refused (the old pool stays, the sequence goes on) unless the old pool is lost."""
        with self._budget_lock:
            self._apply_locked(seq)

    def _apply_locked(self, seq: SequenceKV | None) -> None:
        pending, self._pending_budget = self._pending_budget, None
        if pending is None:
            return
        budget_bytes, residency, changes = pending
        try:
            freed = resize_hot_window(self.pool, self.io, residency, seq)
        except HotWindowLost as exc:  # the sequence ends; the next one rebuilds the pool at the old budget
            self._record_refusal(exc)
            for change in changes:
                change.resolve(exc)
            self._pending_budget = (self.config.cache.gpu_budget_bytes, self.residency, [])
            raise
        except Exception as exc:  # the old pool is back in force: refuse the change, the sequence goes on
            refused = BudgetRefused(budget_bytes, f"{type(exc).__name__}: {exc}; the GPU budget stays "
                                                  f"{format_bytes(self.config.cache.gpu_budget_bytes)}")
            self._record_refusal(refused)
            for change in changes:
                change.resolve(refused)
            return
        self.config.cache.gpu_budget_bytes = budget_bytes
        self.gpu_bytes_returned += max(freed, 0)
        self.num_budget_changes += 1
        for change in changes:
            change.resolve()

    def _record_refusal(self, exc: BaseException) -> None:
        self.num_budget_refusals += 1
        self.last_budget_refusal = str(exc)
        logger.warning("tierkv: GPU budget change refused: %s", exc)

    def check_fits(self, num_tokens: int) -> None:
        """Raise CapacityError, before any work, when `num_tokens` of KV cannot live in the CPU tier."""
        num_blocks = -(-num_tokens // self.layout.block_tokens) * self.num_layers
        if num_blocks > self.cpu.num_slots:
            raise CapacityError(
                f"a request of {num_tokens} tokens needs {num_blocks} KV blocks "
                f"({format_bytes(num_blocks * self.layout.num_bytes)}) in the CPU tier, which holds "
                f"{self.cpu.num_slots} ({format_bytes(self.cpu.capacity_bytes)}): raise tiers[0].capacity_bytes "
                f"or shorten the request (the GPU budget is not the limit: it only holds the hot window)"
            )

    def new_sequence(self, token_ids: list[int] | None = None) -> SequenceKV:
        with self._budget_lock:
            if self.active is not None and not self.active.is_finished:
                raise RuntimeError(f"sequence {self.active.seq_id} is still running; finish it first "
                                   "(TieredCache.finish(), or SequenceKV.finish())")
            self._apply_locked(None)
            self.active = SequenceKV(self, token_ids)
        return self.active

    def stats(self) -> dict:
        """Running totals: tiers, transfers, stalls, GPU bytes."""
        with self._budget_lock:  # not while a resize swaps the pool
            return self._stats_locked()

    def _stats_locked(self) -> dict:
        streamer = self.streamer
        # predictor 'cache': a layer whose selection missed its far-block cache waited for the copy (a stall),
        # and a prefetch margin has its own precision and recall
        cached = self.cached_sparse.totals() if self.cached_sparse is not None else {}
        prefetch = self.prefetch_metrics.snapshot()
        if cached.get("prefetch_copied") is not None:
            prefetch.update(precision=cached["prefetch_precision"], recall=cached["prefetch_recall"],
                            prefetched_blocks=cached["prefetch_copied"], used_blocks=cached["prefetch_used"])
        return {
            "gpu": {
                "resident_bytes": self.pool.resident_bytes,
                "staging_bytes": self.pool.staging_bytes,
                "budget_bytes": self.config.cache.gpu_budget_bytes,
                "resident_blocks_per_layer": self.residency.slots_per_layer,
                "returned_bytes": self.gpu_bytes_returned,
                "budget_changes": self.num_budget_changes,
                "budget_refusals": self.num_budget_refusals,
                "last_budget_refusal": self.last_budget_refusal,
            },
            "transfer": {
                # the engine's copies and the far-block caches' (counted on the device, inside graphs)
                "h2d_bytes": self.engine.num_bytes_moved["h2d"] + cached.get("cache_copied_bytes", 0),
                "d2h_bytes": self.engine.num_bytes_moved["d2h"],
                "backend": self.engine.backend,
            },
            "scheduler": {
                "chunks_streamed": streamer.num_chunks_streamed,
                "bytes_streamed": streamer.bytes_streamed,
                "chunks_carried": streamer.num_chunks_carried,
                "chunks_discarded": streamer.num_chunks_discarded,
                "bytes_discarded": streamer.bytes_discarded,
                "stalls": streamer.num_stalls + cached.get("cache_stalled_rows", 0),
                "far_cache_copied_bytes": cached.get("cache_copied_bytes", 0),
                # a CPU device: far (and resident) blocks attended in the CPU tier's slab, no copy
                "far_reads": "in_place" if self.far_in_place is not None else "staged",
                "blocks_read_in_place": self.far_in_place.num_blocks_read if self.far_in_place is not None else 0,
            },
            "model": {**self.identity.stats(), "block_fingerprint": self.fingerprint},
            "layout": {"block_tokens": self.layout.block_tokens, "block_bytes": self.layout.num_bytes,
                       "kv_dtype": dtype_name(self.layout.dtype)},
            "prefetch": prefetch,
            "decode_graph": dict(self.decode_graph_counts),
            **self.chain.snapshot(),
        }

    def close(self) -> None:
        if self.active is not None:
            self.active.finish()
        self.engine.synchronize()
        self.chain.close()


def _check_lookahead(scheduler, num_layers: int, layout: BlockLayout) -> None:
    """A lookahead past the model's layers whose staging ring cannot be cut into its regions, where a useful one
    could, is refused by its own key (the ring's check would blame staging_bytes); a ring too small for any useful
    lookahead is left to the ring's check, which names staging_bytes."""
    lookahead, useful = scheduler.lookahead_layers, max(1, num_layers - 1)
    fits_useful = scheduler.staging_bytes >= (useful + 1) * layout.num_bytes  # else staging_bytes is what to change
    if lookahead >= num_layers and scheduler.staging_bytes < (lookahead + 1) * layout.num_bytes and fits_useful:
        raise ConfigError("scheduler.lookahead_layers", lookahead,
                          f"the model has {num_layers} layers, so at most {useful} ahead is of use; "
                          f"staging_bytes holds {scheduler.staging_bytes // layout.num_bytes} blocks, and each of the "
                          f"lookahead_layers + 1 staging regions needs one")
