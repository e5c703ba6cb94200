"""A CPU stand-in for one vLLM 0.26 engine running tierkv's hot window (exact policy), for
`profile_prefix_host.py`: vLLM's own config classes, KV cache manager and scheduler outputs, tierkv's
scheduler-side and worker-side connectors, and the calls vLLM's scheduler and model runner make, in
vLLM's order. Nothing runs on a GPU; the model's maths is left out except the far attention of
tiny tensors (the connector's far path needs its chunks read).

Primitives: `Shape`, `PrefixEngine` (`run_request`, `next_step_finishes`, `close`), `Phases`.

One engine step of one request, as vLLM calls the connector:

    scheduler process                                  worker (model runner)
    get_num_new_matched_tokens (waiting request only)  bind_connector_metadata (pickled meta)
    KVCacheManager.allocate_slots                      start_load_kv
    update_state_after_alloc (waiting request only)    per layer: wait_for_layer_load, attention
    build_connector_meta                                 (the backend's far part: attend_into),
                                                         save_kv_layer
                                                       wait_for_save, clear_connector_metadata
"""
from __future__ import annotations

import json
import pickle
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

BYTES_8B_PER_TOKEN_LAYER = 2 * 8 * 128 * 2  # K and V, 8 KV heads x 128 dims, bf16: what the real run's byte sizes mean


@dataclass(frozen=True)
class Shape:
    """The engine: block counts as the 8B run's, tensors as small as asked."""

    layers: int = 32
    block_tokens: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    query_heads: int = 32
    dtype: torch.dtype = torch.bfloat16
    window_tokens: int = 2048
    chunk_tokens: int = 8192          # scheduler.prefill_chunk_tokens (vLLM's max_num_batched_tokens)
    lookahead_layers: int = 2
    staging_bytes_8b: int = 512 << 20  # the staging ring in the 8B shape's bytes: sets the chunk count per layer
    cpu_tokens: int = 3 * 131072      # the CPU tier's capacity, in tokens of every layer
    late_save_layers: int = 0         # the last layers whose saves land after their step (a GPU's late D2H)

    @property
    def block_bytes(self) -> int:
        return 2 * self.kv_heads * self.block_tokens * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def staging_blocks(self) -> int:
        """Blocks of the staging ring: as many as the 8B shape's staging_bytes_8b holds."""
        return self.staging_bytes_8b // (BYTES_8B_PER_TOKEN_LAYER * self.block_tokens)

    @property
    def pool_blocks(self) -> int:
        """vLLM's pool under the hot window: the window and one prefill chunk, and a few more."""
        return -(-(self.window_tokens + self.chunk_tokens) // self.block_tokens) + 8

    def tierkv_config(self) -> dict:
        cpu_blocks = self.cpu_tokens // self.block_tokens * self.layers
        return {
            "cache": {"block_tokens": self.block_tokens, "window_tokens": self.window_tokens},
            "tiers": [{"kind": "cpu", "capacity_bytes": cpu_blocks * self.block_bytes}],
            "scheduler": {"lookahead_layers": self.lookahead_layers,
                          "staging_bytes": self.staging_blocks * self.block_bytes,
                          "prefill_chunk_tokens": self.chunk_tokens},
        }


class Phases:
    """Wall seconds per named phase, summed over the calls inside `phase(name)`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


class _Runner:  # what the hot window reads of vLLM's model runner: the batch's request order
    def __init__(self, req_ids: list[str]):
        self.input_batch = SimpleNamespace(req_ids=list(req_ids), num_reqs=len(req_ids))


class PrefixEngine:
    """Both connector roles of one in-process engine over `shape`, with vLLM's KV cache manager;
    `workdir` holds the tierkv config file."""

    def __init__(self, shape: Shape, workdir: Path):
        import vllm.config  # noqa: F401  vllm's own import order
        from vllm.config import AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec

        from tierkv.integrations.vllm import kv_transfer_config
        from tierkv.integrations.vllm.connector import TierKVConnector

        self.shape = shape
        config_file = workdir / "tierkv.yaml"
        config_file.write_text(json.dumps(shape.tierkv_config()))  # JSON is YAML
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
        spec = SlidingWindowSpec(block_size=shape.block_tokens, num_kv_heads=shape.kv_heads, head_size=shape.head_dim,
                                 dtype=shape.dtype, sliding_window=shape.window_tokens)
        tensors = [KVCacheTensor(size=shape.pool_blocks * spec.page_size_bytes, shared_by=[n]) for n in self.names]
        kv_config = KVCacheConfig(num_blocks=shape.pool_blocks, kv_cache_tensors=tensors,
                                  kv_cache_groups=[KVCacheGroupSpec(layer_names=self.names, kv_cache_spec=spec)])
        engine = VllmConfig(kv_transfer_config=KVTransferConfig(**kv_transfer_config(config_file, model_id="prefix-host")),
                            cache_config=CacheConfig(block_size=shape.block_tokens), device_config=DeviceConfig(device="cpu"),
                            attention_config=AttentionConfig(backend="CUSTOM"))  # the hot window's backend
        self.worker = TierKVConnector(engine, KVConnectorRole.WORKER, kv_config)
        self.scheduler = TierKVConnector(engine, KVConnectorRole.SCHEDULER, kv_config)
        # vLLM's paged pool of each layer, FlashAttention's logical layout [num_blocks, H, T, 2 * D]
        self.caches = {n: torch.randn(shape.pool_blocks, shape.kv_heads, shape.block_tokens, 2 * shape.head_dim,
                                      dtype=shape.dtype) for n in self.names}
        self.worker.register_kv_caches(self.caches)
        self.manager = KVCacheManager(kv_config, max_model_len=1 << 20, scheduler_block_size=shape.block_tokens,
                                      hash_block_size=shape.block_tokens, max_in_flight_tokens=shape.chunk_tokens,
                                      enable_caching=False)
        self._late: list[_LateHandle] = []  # saves of the last step's late layers, still in flight
        self.finished: set[str] = set()  # finished since the last scheduled step (vLLM's finished_req_ids)
        self.meta_bytes: list[int] = []  # pickled metadata per step

    @property
    def store(self):
        return self.worker.store

    def run_request(self, req_id: str, prompt: list[int], phases: Phases) -> int:
        """Prefill `prompt` chunk by chunk and finish it (one output token); returns the tokens the
        connector found in the tiers. Every call is timed into `phases` by what vLLM calls it."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        req = Request(req_id, prompt, SamplingParams(max_tokens=1), None)
        with phases.phase("scheduler: get_num_new_matched_tokens"):
            matched, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
        first = True
        while req.num_computed_tokens + (matched if first else 0) < len(prompt):
            computed = req.num_computed_tokens + (matched if first else 0)
            num_new = min(self.shape.chunk_tokens, len(prompt) - computed)
            with phases.phase("vLLM: allocate_slots"):
                new_blocks = self.manager.allocate_slots(req, num_new, num_external_computed_tokens=matched if first else 0)
            if new_blocks is None:
                raise RuntimeError(f"vLLM's pool of {self.shape.pool_blocks} blocks could not hold a step of {num_new} tokens")
            if first:
                with phases.phase("scheduler: update_state_after_alloc"):
                    self.scheduler.update_state_after_alloc(req, self.manager.get_blocks(req_id), matched)
            output = self._scheduler_output(req, computed, num_new, new_blocks, first)
            with phases.phase("scheduler: build_connector_meta"):
                meta = self.scheduler.build_connector_meta(output)
            self._forward(req_id, meta, computed, num_new, phases)
            req.num_computed_tokens = computed + num_new
            first = False
        with phases.phase("scheduler: request_finished"):
            self.scheduler.request_finished(req, [])
        self.manager.free(req)
        self.finished.add(req_id)
        return matched

    def next_step_finishes(self, phases: Phases) -> None:
        """The next engine step with no request scheduled: the worker hears of the finished requests
        (and unpins their far blocks) in its start_load_kv."""
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

        output = SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={},
            total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0], finished_req_ids=set(self.finished), free_encoder_mm_hashes=[])
        self.finished.clear()
        with phases.phase("scheduler: build_connector_meta"):
            meta = self.scheduler.build_connector_meta(output)
        self._bind(meta, [], phases)
        with phases.phase("worker: start_load_kv"):
            self.worker.start_load_kv(None)
        with phases.phase("worker: wait_for_save"):
            self.worker.wait_for_save()
        self.worker.clear_connector_metadata()

    def close(self) -> None:
        from tierkv.integrations.vllm import hot_window

        hot_window._STATE["runner"] = None
        self.worker.shutdown()
        self.scheduler.shutdown()

    # -- one step ------------------------------------------------------------------------------------
    def _scheduler_output(self, req, computed: int, num_new: int, new_blocks, first: bool):
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        if first:
            new = NewRequestData.from_request(req, self.manager.get_blocks(req.request_id).get_block_ids())
            new.num_computed_tokens = computed
            new_reqs, cached = [new], CachedRequestData.make_empty()
        else:
            new_reqs = []
            cached = CachedRequestData(req_ids=[req.request_id], resumed_req_ids=set(), new_token_ids=[[]],
                                       all_token_ids={}, new_block_ids=[new_blocks.get_block_ids()],
                                       num_computed_tokens=[computed], num_output_tokens=[0])
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached, num_scheduled_tokens={req.request_id: num_new},
            total_num_scheduled_tokens=num_new, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0], finished_req_ids=set(self.finished), free_encoder_mm_hashes=[])
        self.finished.clear()
        return output

    def _bind(self, meta, req_ids: list[str], phases: Phases) -> None:
        from tierkv.integrations.vllm import hot_window

        with phases.phase("IPC: metadata pickled and unpickled"):
            blob = pickle.dumps(meta)  # crosses from the engine core to the workers
            self.meta_bytes.append(len(blob))
            meta = pickle.loads(blob)
        self._runner = _Runner(req_ids)
        hot_window._STATE["runner"] = weakref.ref(self._runner)
        self.worker.bind_connector_metadata(meta)

    def _forward(self, req_id: str, meta, computed: int, num_new: int, phases: Phases) -> None:
        """The model runner's step: the connector's hooks around each layer, and the backend's far part
        (`FarKV.attend_into`) of tiny tensors: a prefill chunk's far chunks go through a stand-in for
        vLLM's FlashAttention (zeros: its maths is the GPU's), a few queries through the PyTorch
        reference (the repeat's last chunk)."""
        from tierkv.integrations.vllm import hot_window

        self._bind(meta, [req_id], phases)
        with phases.phase("worker: start_load_kv"):
            self.worker.start_load_kv(None)
        for handle in self._late:  # the step before has ended on the device by now
            handle.released = True
        self._late.clear()
        step = hot_window.current_step()
        shape = self.shape
        q = torch.randn(num_new, shape.query_heads, shape.head_dim, dtype=shape.dtype)
        near_out, near_lse = torch.zeros_like(q), torch.zeros(num_new, shape.query_heads)
        for layer, name in enumerate(self.names):
            with phases.phase("worker: wait_for_layer_load"):
                self.worker.wait_for_layer_load(name)
            if step is not None and step.has_far:
                with phases.phase("backend: far part (attend_into)"):
                    step.far.attend_into(torch.empty_like(q), step.layer_index[name], q, near_out, near_lse,
                                         shape.head_dim ** -0.5, dense=_flash_stand_in)
            pending = self.store.saves._pending
            started = len(pending)
            with phases.phase("worker: save_kv_layer"):
                self.worker.save_kv_layer(name, self.caches[name], None)
            if layer >= shape.layers - shape.late_save_layers:
                for i in range(started, len(pending)):
                    handle, *rest = pending[i]
                    pending[i] = (_LateHandle(handle), *rest)
                    self._late.append(pending[i][0])
        with phases.phase("worker: wait_for_save"):
            self.worker.wait_for_save()
        self.worker.clear_connector_metadata()


class _LateHandle:
    """A save's copy that lands after its step, as a GPU's D2H of the last layers does: done once the next
    step has begun (and the copy itself is), or when waited for."""

    def __init__(self, handle):
        self.handle, self.released = handle, False

    def is_done(self) -> bool:
        return self.released and self.handle.is_done()

    def synchronize(self) -> None:
        self.handle.synchronize()
        self.released = True


def _flash_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """What the backend's `_dense` (vLLM's FlashAttention over a staging chunk) returns, without its
    maths: (out [n, H, D], lse [n, H]) float32."""
    return torch.zeros(q.shape, dtype=torch.float32), torch.zeros(q.shape[:2], dtype=torch.float32)
