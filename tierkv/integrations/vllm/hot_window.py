"""The hot-window KV pool for vLLM 0.26: vLLM reserves only the recent window of each request;
tierkv's attention backend reads the rest from the tiers.

Primitives: `register` (the `vllm.general_plugins` entry point), `hot_window_tokens`,
`HotWindowStep`, `set_step` / `current_step`, `set_full` / `full_rows`, `full_decode_graphs`,
`batch_order`.

    vLLM, told by the plugin                       tierkv backend, per layer and step
    every full-attention layer declares            near: FlashAttention over vLLM's pool, block
      SlidingWindowSpec(window_tokens): its          table shifted past the far blocks, causal, LSE
      start-up check sizes the pool for the        far:  the blocks vLLM freed, streamed from the
      window, its block manager frees blocks         CPU tier by the lookahead streamer (far.py)
      that leave it                                out = LSE merge of near and far: exact attention

It takes effect only for an engine whose kv_transfer_config names the tierkv connector and whose
attention backend is "CUSTOM" (`attention_config={"backend": "CUSTOM"}`); other engines in the
same process are untouched. `TieredLLM(backend="vllm")` sets both. Where vLLM is attached:
`Attention.get_kv_cache_spec` (the spec of each layer), `GPUModelRunner.execute_model` (to
read the batch's request order, which the attention metadata does not carry) and
`EngineCore.preprocess_add_request` (no block hashing of vLLM's own where nothing reads it:
`needs_vllm_block_hashes`) and `Scheduler._update_requests_with_invalid_blocks` (a block that failed to
load leaves vLLM's prefix cache: `load_failures`); see
docs/vllm-hot-window.md.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tierkv.transfer.device import to_device_no_sync
from tierkv.integrations.vllm.config import CONNECTOR_NAME, check_hot_window_config, config_from_kv_transfer
from tierkv.integrations.vllm.far_rows import FarKV
from tierkv.integrations.vllm.far_step import FarRow
from tierkv.integrations.vllm.full_graph_rows import full_graphs_configured
from tierkv.integrations.vllm.load_failures import patch_scheduler

BACKEND_PATH = "tierkv.integrations.vllm.backend.HotWindowBackend"
_STATE: dict[str, Any] = {"runner": None, "step": None, "window": None, "full": None, "registered": False}


def register() -> None:
    """Register the CUSTOM attention backend and the two attachment points; idempotent. Runs in
    every vLLM process through the `vllm.general_plugins` entry point, and from TieredLLM."""
    if _STATE["registered"]:
        return
    import vllm.config  # noqa: F401  vllm's own import order (its attention modules need the config first)
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum, register_backend

    current = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)
    if current not in (None, BACKEND_PATH):
        raise RuntimeError(f"attention backend CUSTOM is already registered as {current}; "
                           "the tierkv hot window needs it (unset the other plugin or VLLM_PLUGINS)")
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _patch_kv_cache_spec()
    _patch_runner()
    _patch_engine_core()
    patch_scheduler()
    _STATE["registered"] = True


@functools.lru_cache(maxsize=16)
def _config_of(extra: tuple, block_size: int):
    """`extra`: kv_connector_extra_config's items, sorted (hashable, so each config loads once)."""
    return config_from_kv_transfer(dict(extra), block_size=block_size)


def _engine_config(vllm_config):
    """The tierkv config of an engine that runs tierkv's connector, else None."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None or transfer.kv_connector != CONNECTOR_NAME:
        return None
    extra = tuple(sorted((transfer.kv_connector_extra_config or {}).items()))
    return _config_of(extra, vllm_config.cache_config.block_size)


def hot_window_tokens(vllm_config) -> int | None:
    """The hot window of an engine that runs tierkv's connector, else None. ConfigError: a window the hot
    window cannot run (`check_hot_window_config`; asked only where a layer takes the hot-window spec)."""
    config = _engine_config(vllm_config)
    if config is None:
        return None
    check_hot_window_config(config)
    return config.cache.window_tokens


def full_decode_graphs(vllm_config) -> bool:
    """Whether an engine that runs tierkv's connector asks for its sparse decode step inside vLLM's
    full decode graph (`scheduler.sparse_full_graphs`)."""
    config = _engine_config(vllm_config)
    return config is not None and full_graphs_configured(config)


def _patch_kv_cache_spec() -> None:
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    original = Attention.get_kv_cache_spec
    if getattr(original, "_tierkv_hot_window", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if type(spec) is not FullAttentionSpec or not _is_hot_window_backend(self.attn_backend):
            return spec
        window = hot_window_tokens(vllm_config)
        if window is None:
            raise RuntimeError("attention backend CUSTOM is tierkv's hot window: the engine's kv_transfer_config "
                               f"must name kv_connector {CONNECTOR_NAME!r}")
        return SlidingWindowSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                 head_size_v=spec.head_size_v, dtype=spec.dtype, kv_quant_mode=spec.kv_quant_mode,
                                 sliding_window=window)

    get_kv_cache_spec._tierkv_hot_window = True
    Attention.get_kv_cache_spec = get_kv_cache_spec


def _is_hot_window_backend(backend) -> bool:  # backend.HotWindowBackend, without importing it
    return getattr(backend, "_tierkv_hot_window", False)


def _patch_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.execute_model
    if getattr(original, "_tierkv_hot_window", False):
        return

    @functools.wraps(original)
    def execute_model(self, *args, **kwargs):
        _STATE["runner"] = weakref.ref(self)
        return original(self, *args, **kwargs)

    execute_model._tierkv_hot_window = True
    GPUModelRunner.execute_model = execute_model


def needs_vllm_block_hashes(vllm_config) -> bool:
    """Whether an engine's requests need vLLM's own block hashes. vLLM hashes every prompt block of every request
    (sha256 of pickled tokens: 5-6 ms of add_request at 100k tokens) when prefix caching is on or any KV connector
    is configured; tierkv's connector addresses blocks by hashes of its own, so an engine running it with vLLM's
    prefix cache off reads none."""
    return _engine_config(vllm_config) is None or bool(vllm_config.cache_config.enable_prefix_caching)


def drop_unread_block_hasher(core, vllm_config) -> None:
    """An EngineCore (`core`) of an engine whose requests need no vLLM block hashes keeps no hasher (read by its
    add_request only: requests then carry none)."""
    if not needs_vllm_block_hashes(vllm_config):
        core.request_block_hasher = None


def _patch_engine_core() -> None:
    """At an EngineCore's first request: its hasher dropped where nothing reads it. Not at its __init__: vLLM loads
    its plugins (this one) inside the first EngineCore.__init__ of a fresh engine process, which then runs unwrapped."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.preprocess_add_request
    if getattr(original, "_tierkv_hot_window", False):
        return

    @functools.wraps(original)
    def preprocess_add_request(self, request):
        if not getattr(self, "_tierkv_hasher_checked", False):
            drop_unread_block_hasher(self, self.vllm_config)
            self._tierkv_hasher_checked = True
        return original(self, request)

    preprocess_add_request._tierkv_hot_window = True
    EngineCore.preprocess_add_request = preprocess_add_request


def batch_order() -> list[str]:
    """Request ids of the step being executed, in the order of its attention metadata rows."""
    ref = _STATE["runner"]
    runner = ref() if ref is not None else None
    if runner is None:
        raise RuntimeError("tierkv hot window: no vLLM model runner is executing a step "
                           "(register() must run before the engine is built)")
    batch = runner.input_batch
    return list(batch.req_ids[: batch.num_reqs])


@dataclass
class HotWindowStep:
    """One engine step's far/near split, set by the connector before the forward."""

    far: FarKV
    rows: list[FarRow]
    layer_index: dict[str, int]
    _tables: tuple | None = None   # (attention metadata it was built for, table, seqused_k, max_seqlen_k)
    ran: bool = False              # the backend's forward ran in this step (not a full-graph replay)

    @property
    def has_far(self) -> bool:
        return any(r.num_far_blocks for r in self.rows)

    def near(self, meta) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Block table, key lengths and longest key length of the near part: each row's table and
        length start past its far blocks. Built once per step (all layers share the metadata)."""
        if self._tables is not None and self._tables[0] is meta:
            return self._tables[1:]
        rows = self.rows
        bs = self.far.block_tokens
        num_tokens = rows[-1].q_end if rows else 0
        max_seq = max((r.num_computed + r.q_end - r.q_start for r in rows), default=0)
        if num_tokens != meta.num_actual_tokens or max_seq != meta.max_seq_len:
            raise RuntimeError(
                f"tierkv hot window: the connector's step ({len(rows)} requests, {num_tokens} tokens, longest "
                f"{max_seq}) does not match vLLM's attention metadata ({meta.num_actual_tokens} tokens, longest "
                f"{meta.max_seq_len})")
        n = len(rows)
        table = meta.block_table[:n]
        # the column index and key shift change when a row's far part grows (once per block of
        # decoded tokens) or the batch changes: kept on the FarKV from step to step
        key = (tuple(r.num_far_blocks for r in rows), table.shape[1], table.device, meta.seq_lens.dtype)
        kept = self.far.near_index
        if kept is None or kept[0] != key:
            shift = to_device_no_sync([r.num_far_blocks for r in rows], table.device)
            cols = table.shape[1]
            index = (torch.arange(cols, device=table.device).unsqueeze(0) + shift.unsqueeze(1)).clamp_(max=cols - 1)
            kept = self.far.near_index = (key, index, (shift * bs).to(meta.seq_lens.dtype))
        _, index, key_shift = kept
        table = torch.gather(table, 1, index)
        seqused_k = meta.seq_lens[:n] - key_shift
        max_seqlen_k = max(r.num_computed + r.q_end - r.q_start - r.num_far_blocks * bs for r in rows)
        self._tables = (meta, table, seqused_k, max_seqlen_k)
        return table, seqused_k, max_seqlen_k


def set_step(step: HotWindowStep | None) -> None:
    _STATE["step"] = step


def set_full(full) -> None:
    """The engine's `full_graph_rows.FullDecodeRows` (None: no full decode graphs), told by the worker-side
    connector once its FarKV exists, before vLLM captures."""
    _STATE["full"] = full


def full_rows():
    return _STATE["full"]


def set_window(window_tokens: int) -> None:
    """The engine's hot window, told by the worker-side connector at start-up."""
    _STATE["window"] = window_tokens


def current_step() -> HotWindowStep | None:
    return _STATE["step"]


def rows_in_order(order: Sequence[str], scheduled: dict[str, tuple[int, int]]) -> list[tuple[str, int, int]]:
    """(req_id, tokens before the step, tokens in it) in the batch's order; every request of the
    batch must be in the connector's metadata."""
    missing = [r for r in order if r not in scheduled]
    if missing or len(order) != len(scheduled):
        raise RuntimeError(f"tierkv hot window: vLLM's batch {list(order)[:8]} and the connector's scheduled "
                           f"requests {list(scheduled)[:8]} differ")
    return [(r, *scheduled[r]) for r in order]
