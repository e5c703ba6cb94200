"""tierkv as a vLLM v1 KV connector: every full KV block vLLM computes is saved layer by layer to
the CPU tier (then disk, Redis), and prompt prefixes found in any tier are loaded back layer by
layer instead of being prefilled again.

Primitives: `TierKVConnector` (its scheduler side and `TierKVMetadata`: connector_scheduler).

    scheduler side (one per engine)                       worker side (one per GPU worker)
    get_num_new_matched_tokens: prefix blocks held in     start_load_kv: pin the blocks in the CPU
      every layer by some tier (beyond vLLM's own cache)    tier, H2D of the first layers
    update_state_after_alloc: remember where they go      wait_for_layer_load(L): L's blocks into
    build_connector_meta: loads, and each request's        vLLM's cache; next layer's H2D enqueued
      blocks that become full in this step               save_kv_layer(L): this step's full blocks
                                                           of L copied out, D2H to the CPU tier
                                                         wait_for_save: landed saves become visible

Loads are synchronous from the scheduler's view (the step that needs them waits on the H2D,
layer by layer). A block that left every tier between lookup and load is reported through
`get_block_ids_with_load_errors`, and vLLM recomputes it. Needs vLLM (`pip install
'tierkv-runtime[vllm]'`); the tierkv side (`store.py`) does not.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from tierkv.attention.warmup import warm_far_kernels
from tierkv.config import ConfigError
from tierkv.integrations.vllm import hot_window
from tierkv.integrations.vllm.config import check_hot_window_config, config_from_kv_transfer, unused_under_vllm
from tierkv.integrations.vllm.connector_scheduler import ConnectorScheduler, TierKVMetadata
from tierkv.integrations.vllm.engine_config import (graph_rows, layout_of, max_num_seqs_of, model_identity_of,
                                                   query_heads_of, runs_hot_window, sleep_mode_of, tensor_parallel_rank)
from tierkv.integrations.vllm.far_rows import FarKV
from tierkv.integrations.vllm.full_graph_rows import FullDecodeRows, full_graphs_configured
from tierkv.integrations.vllm.pool_sizing import check_admission
from tierkv.integrations.vllm.store import VllmKVStore
from tierkv.integrations.vllm.store_registry import peek_store, release_store, shared_store

logger = logging.getLogger(__name__)
SAVE_RUN_BYTES = 32 << 20  # the most blocks (in the engine's dtype) that wait_for_save reads out at once

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        role_name = getattr(self._kv_transfer_config, "kv_role", None)
        if role_name not in (None, "kv_both"):  # a producer/consumer split would be run as kv_both without a word
            raise ConfigError("kv_transfer_config.kv_role", role_name,
                              "tierkv's connector saves and loads the same tiers in one engine: kv_both (a shared "
                              "Redis or disk tier gives other engines the blocks; a producer/consumer split is not "
                              "supported)")
        self.block_size = vllm_config.cache_config.block_size
        self.config = config_from_kv_transfer(extra, block_size=self.block_size)
        hot = runs_hot_window(vllm_config)
        if hot:  # without the hot window (a plain pool, or the model's own window) cache.window_tokens is unused
            check_hot_window_config(self.config)
        group = layout_of(kv_cache_config, self.block_size, self.config.cache.window_tokens if hot else None)
        self.layout, self.layer_names = group.layout, group.layer_names
        # hot_window: tierkv's (FarKV, far staging, hot-window rows); own_window: the model's own sliding window,
        # run by the plain path, which skips the blocks vLLM keeps outside it (its null block)
        self.hot_window, self.own_window = group.hot_window, group.own_window
        model_config = getattr(vllm_config, "model_config", None)
        self.model_id = model_identity_of(self.config, extra, model_config,
                                          getattr(getattr(vllm_config, "load_config", None), "download_dir", None))
        self.max_model_len = getattr(model_config, "max_model_len", None)
        # vLLM's sleep mode allocates the KV pool (and what register_kv_caches makes) in its CuMem pool, which
        # sleep() frees: the far path's staging stays there rather than in an allocator pool of its own
        self.sleep_mode = sleep_mode_of(vllm_config)
        self.max_num_seqs = max_num_seqs_of(vllm_config)
        self.max_graph_rows = graph_rows(vllm_config)  # the full decode graph's row buffers cover it
        self.num_heads = query_heads_of(vllm_config)  # this rank's: the far kernels' warm-up is shaped by it
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        self.tp_rank = tensor_parallel_rank() if role == KVConnectorRole.WORKER else 0
        self._store: VllmKVStore | None = None
        self._far: FarKV | None = None
        self._scheduler = ConnectorScheduler(self.block_size, self.hot_window, lambda: self.store, self.own_window)
        self._hook_s = [0.0, 0.0, 0.0]  # this step's seconds in start_load_kv, save_kv_layer, wait_for_save
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._full: FullDecodeRows | None = None  # scheduler.sparse_full_graphs: the full decode graph's row inputs
        self._saved_layers: set[int] = set()  # layers save_kv_layer saved in this step
        self._refused_full = False  # this step was to replay a full decode graph its rows could not use
        if self.hot_window is not None and role == KVConnectorRole.WORKER:
            hot_window.set_window(self.hot_window)
        if self.hot_window is not None and role == KVConnectorRole.SCHEDULER:
            # a pool vLLM admits no request into fails here, not by stepping idle
            check_admission(vllm_config, kv_cache_config, self.config.cache.gpu_budget_bytes)
        unused = unused_under_vllm(self.config, self.hot_window is not None) if role == KVConnectorRole.SCHEDULER else []
        if unused:  # one engine, one scheduler: said once
            logger.warning("tierkv under vLLM does not read these settings of its config: %s", "; ".join(unused))
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning("kv_transfer_config.kv_load_failure_policy is %r: a block the tiers cannot load (corrupt, "
                           "or gone since the lookup) fails its request; 'recompute' (tierkv's kv_transfer_config "
                           "sets it) recomputes it", self._kv_transfer_config.kv_load_failure_policy)

    # -- the engine's store ------------------------------------------------------------------------
    def _make_store(self, device: torch.device, lookup_only: bool) -> VllmKVStore:
        return VllmKVStore(self.config, self.layout, self.layer_names, self.model_id, device, lookup_only=lookup_only,
                           tp_rank=self.tp_rank, tp_size=self.tp_size)

    @property
    def _store_key(self) -> str:
        """One store per engine, per tensor-parallel rank on the worker side; a TP scheduler looks
        up every rank's keys, so it never shares a rank's store."""
        if self.role == KVConnectorRole.WORKER:
            return self.engine_id if self.tp_size == 1 else f"{self.engine_id}/rank{self.tp_rank}"
        return self.engine_id if self.tp_size == 1 else f"{self.engine_id}/scheduler"

    @property
    def store(self) -> VllmKVStore:
        if self._store is None:
            if self.role == KVConnectorRole.WORKER:
                device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
                self._store = shared_store(self._store_key, lambda: self._make_store(device, False))
            else:
                existing = peek_store(self._store_key)
                self._store = shared_store(
                    self._store_key, lambda: existing or self._make_store(torch.device("cpu"), True))
        return self._store

    # -- worker side ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self._store is None and kv_caches:
            device = next(iter(kv_caches.values())).device
            self._store = shared_store(self._store_key, lambda: self._make_store(device, False))
        self.store.register(kv_caches)
        self._kv_caches = dict(kv_caches)
        if self.hot_window is not None and self._far is None:
            self._far = FarKV(self.store, self.hot_window, max_model_len=self.max_model_len, max_rows=self.max_num_seqs,
                              own_pool=not self.sleep_mode)
            if self.num_heads is not None:  # compiled now, not by the first request whose rows read far blocks
                warm_far_kernels(self.num_heads, self.store.layout, self.store.device,
                                 rows=self._far.sparse_blocks is not None)
            if full_graphs_configured(self.config):  # before vLLM captures: its capture reads the row buffers
                self._full = FullDecodeRows(self._far, self.max_graph_rows, self.store.layer_index)
                hot_window.set_full(self._full)

    def prepare_staging(self, staging_bytes: int):
        """Run-time resize of the hot window's staging (the exact policy's ring; the sparse policy's ring,
        eager regions and far-block caches): the new buffers allocated now (an OOM raises, nothing
        changed), bound by the returned callable; None when there is nothing to change (no hot window, or
        the staging already this size). Between engine steps only (`resize_worker`)."""
        staging = self._far.make_staging(staging_bytes) if self._far is not None else None
        return None if staging is None else (lambda: self._far.use_staging(staging, staging_bytes))

    def settle_transfers(self) -> None:
        """Wait for the copy engine's transfers and drop the tensors it keeps alive for them (each copy's
        source and destination): a run-time resize's old KV tensors and staging ring go back at once, not at
        the next copy (`resize_worker`)."""
        engine = getattr(self._store, "engine", None)
        if engine is not None:
            engine.synchronize()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            self._start_load_kv(forward_context)
        finally:
            self._hook_s[0] += time.perf_counter() - started

    def _start_load_kv(self, forward_context: Any = None) -> None:
        self._saved_layers, self._refused_full = set(), False  # (a step without a forward calls no wait_for_save)
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TierKVMetadata)
        self.store.poll()
        self.store.begin_loads(metadata.loads)  # every step: it also drops what a step that raised left planned
        if self._far is not None:
            # the running requests' new hashes first: a finishing request keeps the pins of blocks they hold
            for req_id, start, hashes in metadata.hashes:
                self._far.add_hashes(req_id, start, hashes)
            for req_id in metadata.finished:
                self._far.finish(req_id)
            rows = self._far.begin_step(hot_window.rows_in_order(hot_window.batch_order(), metadata.scheduled),
                                        metadata.prompt_steps, metadata.far_floors)
            hot_window.set_step(hot_window.HotWindowStep(self._far, rows, self.store.layer_index))
            if self._full is not None and _replays_full_graph(forward_context):
                if self._full.write(rows):
                    self._full.counted_step(rows)
                else:  # rows the graph's body cannot serve: this step runs eagerly (vLLM has no sanctioned veto)
                    forward_context.cudagraph_runtime_mode = type(forward_context.cudagraph_runtime_mode).NONE
                    self._refused_full = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self.store.layer_index[layer_name]
        self.store.finish_layer_load(layer)
        if self._far is not None:
            self._far.prefetch(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TierKVMetadata)
        if metadata.saves:
            started = time.perf_counter()
            layer = self.store.layer_index[layer_name]
            self._save_layer(layer, kv_layer, self.store.savable(metadata.saves))
            self._hook_s[1] += time.perf_counter() - started

    def _save_layer(self, layer: int, kv_layer: torch.Tensor, saves) -> None:
        blocks = self.store.save_layer(layer, kv_layer, saves)
        if self._far is not None and blocks is not None:
            self._far.summarize(layer, saves, blocks)
        self._saved_layers.add(layer)

    def _save_unsaved_layers(self, saves) -> float | None:
        """The layers this step's hooks did not save, in runs of consecutive layers: one read per layer,
        one D2H and one summary update per request for the run (per layer and request, 10 requests
        of 32 layers took 60-100 ms of host time on the step that completes their blocks). A run's
        blocks stay within SAVE_RUN_BYTES, so the copies made for it stay small. Returns the key
        summaries' host seconds, None if nothing was saved."""
        todo = sorted((layer, name) for name, layer in self.store.layer_index.items()
                      if layer not in self._saved_layers and name in self._kv_caches)
        num_blocks = sum(len(span.block_ids) for span in saves)
        if not todo or not num_blocks:
            return None
        per_run = max(1, SAVE_RUN_BYTES // (num_blocks * self.store.layout.num_bytes))
        start, summarize_s = 0, 0.0
        self.store.saves.host_s = [0.0, 0.0]
        while start < len(todo):
            stop = start + 1
            while stop < len(todo) and stop - start < per_run and todo[stop][0] == todo[stop - 1][0] + 1:
                stop += 1
            run = todo[start:stop]
            layers = range(run[0][0], run[-1][0] + 1)
            blocks = self.store.save_layers(list(layers), [self._kv_caches[name] for _, name in run], saves)
            if self._far is not None and blocks is not None:
                summarized = time.perf_counter()
                self._far.summarize(layers, saves, blocks)
                summarize_s += time.perf_counter() - summarized
            self._saved_layers.update(layers)
            start = stop
        return summarize_s

    def wait_for_save(self):
        started = time.perf_counter()
        metadata = self._get_connector_metadata()
        step = hot_window.current_step()
        if self._refused_full and step is not None and not step.ran:
            raise RuntimeError("tierkv hot window: a decode step was replayed from vLLM's full graph although its rows "
                               "needed the eager path (the forward context's mode was not honoured); its far blocks "
                               "were not read. Turn scheduler.sparse_full_graphs off")
        summarize_s = None
        if isinstance(metadata, TierKVMetadata) and metadata.saves:
            # a full decode graph's replay runs no per-layer hook: the step's blocks are saved now, from vLLM's pool
            # (they stay there for the window's length), every layer in one save
            summarize_s = self._save_unsaved_layers(self.store.savable(metadata.saves))
        if self._far is not None:
            self._far.end_step()
            hot_window.set_step(None)
        polled = time.perf_counter()
        self.store.poll()
        if summarize_s is not None:  # where the block-completing step's host time goes
            self.store.save_step_ms.append(tuple(round(1e3 * s, 3) for s in (
                *self.store.saves.host_s, summarize_s, time.perf_counter() - polled, time.perf_counter() - started)))
        # the step's host ms in this connector's hooks (start_load_kv, save_kv_layer, wait_for_save): where a
        # slow step's time went, ours or vLLM's (`VllmKVStore.stats`' step_connector_ms)
        self._hook_s[2] = time.perf_counter() - started
        self.store.step_connector_ms.append(tuple(round(1e3 * s, 3) for s in self._hook_s))
        self._hook_s = [0.0, 0.0, 0.0]

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.store.take_load_errors() if self._store is not None else set()

    def shutdown(self):
        if self._full is not None and hot_window.full_rows() is self._full:
            hot_window.set_full(None)
        self._full = None
        if self._far is not None:
            self._far.close()
            self._far = None
        if self._store is not None:
            self._store = None
            release_store(self._store_key)

    # -- scheduler side (connector_scheduler) --------------------------------------------------------
    def on_new_request(self, request: "Request") -> None:
        self._scheduler.state(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        return self.request_finished(request, block_ids[0] if block_ids else [])

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # the per-layer hooks must run outside captured graphs, unless the sparse decode step runs inside vLLM's
        # full decode graph: its saves happen after the step (wait_for_save), its inputs before it (start_load_kv)
        return not full_graphs_configured(config_from_kv_transfer(extra_config, block_size=None))

    def stats(self) -> dict:
        return self.store.stats()


def _replays_full_graph(forward_context: Any) -> bool:
    """Whether vLLM is about to replay this step from its full decode graph."""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", None) == "FULL"
