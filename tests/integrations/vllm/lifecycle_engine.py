"""A whole request lifecycle on CPU: vLLM 0.26's own scheduler (`Scheduler` and its KV cache manager) with
tierkv's connector on both sides (the scheduler's inside vLLM's, one worker's called in the model runner's
order), and a stand-in model whose KV per token is a deterministic function of (layer, token prefix).

Each `Engine.step()` writes the step's KV into vLLM's pool, layer by layer, and records as problems:

    KV that vLLM counts computed, in blocks the request holds, that is not the model's KV and that the worker
    did not report as a failed load (a request that read wrong KV writes wrong KV from the next layer on)
    a near part (the hot window) that reads vLLM's null block
    far attention (`HotWindowStep.far.attend`) that is not dense attention over the model's far blocks

After a run: `check_tiers` (every block a tier holds is the model's KV, bit for bit), `pinned` (no pin left),
`leftovers` (no FarKV row, no scheduler-side request state). `lifecycle_fuzz.fuzz_run` drives a seeded random workload
(shared prefixes, duplicates, aborts, blocks lost from the tiers between the lookup and the load).
"""
from __future__ import annotations

import json
import pickle
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.config import (AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tierkv.integrations.vllm import hot_window, kv_transfer_config
from tierkv.integrations.vllm.connector import TierKVConnector

BS, H, HQ, D = 4, 2, 4, 8  # tokens per block, KV heads, query heads, head dim
MAX_MODEL_LEN = 128
BLOCK_BYTES = 2 * H * BS * D * 4  # float32


class _Runner:
    """vLLM's model runner as the hot window reads it (the batch order); a class: it is held by weak reference."""

    def __init__(self, order: list[str]):
        self.input_batch = SimpleNamespace(req_ids=order, num_reqs=len(order))


@dataclass
class Shape:
    """An engine's sizes. window: the sliding window's tokens (None: full attention); hot_window: it is tierkv's hot
    window (attention backend CUSTOM), else the model's own sliding window under tierkv's plain connector."""

    cpu_blocks: int
    layers: int = 2
    pool: int = 40
    window: int | None = None
    max_seqs: int = 4
    batched: int = 32
    disk: bool = False
    prefix_caching: bool = False
    hot_window: bool = True


class KVModel:
    """KV of position p at layer l: a random [H, 2D] vector seeded by (l, tokens[:p + 1]), so any two requests
    sharing a prefix share its KV, and KV read from anywhere else shows."""

    def __init__(self):
        self.memo: dict[tuple, torch.Tensor] = {}

    def kv(self, layer: int, prefix: tuple[int, ...]) -> torch.Tensor:
        key = (layer, prefix)  # ints only: hash() is the same in every process
        if key not in self.memo:
            self.memo[key] = torch.randn(H, 2 * D, generator=torch.Generator().manual_seed(hash(key) & 0x7FFFFFFF))
        return self.memo[key]

    def block(self, layer: int, tokens: list[int], b: int) -> torch.Tensor:
        """Block b in tierkv's layout: [2, H, BS, D]."""
        rows = torch.stack([self.kv(layer, tuple(tokens[: p + 1])) for p in range(b * BS, (b + 1) * BS)], 1)  # H, BS, 2D
        return torch.stack([rows[..., :D], rows[..., D:]], 0)


def dense_attention(q: torch.Tensor, blocks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, HQ, D] over blocks [m, 2, H, BS, D], no mask: out [n, HQ, D] float64."""
    k, v = (blocks[:, i].permute(0, 2, 1, 3).reshape(-1, H, D).double().repeat_interleave(HQ // H, 1) for i in (0, 1))
    return torch.einsum("nhk,khd->nhd", torch.softmax(torch.einsum("nhd,khd->nhk", q.double(), k) * scale, -1), v)


def _vllm_config(root: Path, shape: Shape) -> VllmConfig:
    """A tiny Llama's config and tierkv's YAML under root, and vLLM's config naming both."""
    tiers = [{"kind": "cpu", "capacity_bytes": shape.cpu_blocks * BLOCK_BYTES}]
    if shape.disk:
        tiers.append({"kind": "disk", "path": str(root / "disk"), "capacity_bytes": 4096 * BLOCK_BYTES, "trusted": True})
    hot = shape.window is not None and shape.hot_window
    window = {"window_tokens": shape.window} if hot else {}
    (root / "t.yaml").write_text(json.dumps({
        "cache": {"block_tokens": BS, **window}, "tiers": tiers, "metrics": {"enabled": False},
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 64 * BLOCK_BYTES}}))
    (root / "m").mkdir(exist_ok=True)
    (root / "m/config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": HQ, "num_key_value_heads": H, "num_hidden_layers": shape.layers, "head_dim": D,
        "max_position_embeddings": 512, "vocab_size": 1000, "torch_dtype": "float32"}))
    return VllmConfig(
        model_config=ModelConfig(model=str(root / "m"), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
                                 enforce_eager=True, dtype="float32"),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=shape.prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=shape.max_seqs, max_num_batched_tokens=shape.batched,
                                         max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False, async_scheduling=False),
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(str(root / "t.yaml"), model_id="m")),
        device_config=DeviceConfig(device="cpu"), attention_config=AttentionConfig(backend="CUSTOM" if hot else None))


def _kv_cache_config(names: list[str], shape: Shape) -> KVCacheConfig:
    kw = dict(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    spec = FullAttentionSpec(**kw) if shape.window is None else SlidingWindowSpec(**kw, sliding_window=shape.window)
    return KVCacheConfig(num_blocks=shape.pool, kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
                         kv_cache_tensors=[KVCacheTensor(size=shape.pool * spec.page_size_bytes, shared_by=[n]) for n in names])


class Engine:
    """vLLM's scheduler and one worker connector on CPU; `step()` is one engine step. `before_forward(engine,
    metadata)`, when set, runs between the schedule and the worker's hooks (where a test loses blocks)."""

    def __init__(self, root: Path, shape: Shape):
        self.shape, self.window = shape, shape.window if shape.hot_window else None  # window: the hot window's
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
        hot_window.register()
        vc = _vllm_config(root, shape)
        kvc = _kv_cache_config(self.names, shape)
        vc.cache_config.num_gpu_blocks = shape.pool
        self.worker = TierKVConnector(vc, KVConnectorRole.WORKER, kvc)  # the engine core builds the worker first
        self.caches = {n: torch.full((shape.pool, H, BS, 2 * D), float("nan")) for n in self.names}
        self.worker.register_kv_caches(self.caches)
        self.sched = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=BS)
        if shape.prefix_caching:
            init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256) if shape.prefix_caching else None
        self.model = KVModel()
        self.problems: list[str] = []
        self.token_ids: dict[str, list[int]] = {}  # every request's tokens: vLLM's live list, grows with outputs
        self.before_forward = None
        self.step_no = self.num_reported = 0

    @property
    def store(self):
        return self.worker.store

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                      block_hasher=self.hasher)
        self.sched.add_request(req)
        self.token_ids[req_id] = req.all_token_ids

    def abort(self, req_id: str) -> None:
        self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def step(self) -> set[int]:
        """One engine step; returns the block ids the worker reported as failed loads."""
        self.step_no += 1
        out = self.sched.schedule()
        if self.before_forward is not None:
            self.before_forward(self, out.kv_connector_metadata)
        order = list(out.num_scheduled_tokens)
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        # (tokens, block table, computed before the step, scheduled) before update_from_output moves them
        info = {r: (list(self.token_ids[r]), list(self.sched.kv_cache_manager.get_block_ids(r)[0]), computed[r],
                    out.num_scheduled_tokens[r]) for r in order}
        runner = _Runner(order)
        hot_window._STATE["runner"] = weakref.ref(runner)  # what the plugin's patched model runner records
        self.worker.bind_connector_metadata(pickle.loads(pickle.dumps(out.kv_connector_metadata)))
        self.worker.start_load_kv(None)
        wrong = self._forward(info, out.total_num_scheduled_tokens) if order else set()
        invalid = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        self.num_reported += len(invalid)
        if not {b for _, b in wrong} <= invalid:
            self.problems.append(f"step {self.step_no}: wrong KV in held computed blocks {sorted(wrong)} "
                                 f"not reported (reported {sorted(invalid)})")
        sampled = [[900 + hash(tuple(info[r][0])) % 97] if info[r][2] + info[r][3] >= len(info[r][0]) else []
                   for r in order]
        self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid)))
        return invalid

    def _forward(self, info: dict, num_tokens: int) -> set[tuple[str, int]]:
        """The stand-in forward; returns (request, block id) of the wrong KV it found."""
        step = hot_window.current_step()
        rows = {row.req_id: row for row in step.rows} if step is not None else {}
        wrong: set[tuple[str, int]] = set()
        poisoned: dict[str, int] = {}  # request -> the layer it first read wrong KV at
        for layer, name in enumerate(self.names):
            self.worker.wait_for_layer_load(name)
            for r, (tokens, table, num_computed, num_new) in info.items():  # every write before any check
                for p in range(num_computed, num_computed + num_new):
                    v = self.model.kv(layer, tuple(tokens[: p + 1]))
                    self.caches[name][table[p // BS], :, p % BS] = v + 1000.0 if layer > poisoned.get(r, layer) else v
            for r in info:
                self._check_computed(name, layer, r, info[r], rows[r].num_far_blocks if r in rows else None,
                                     wrong, poisoned)
            if step is not None and step.has_far:
                self._check_far(step, layer, info, num_tokens, poisoned)
            self.worker.save_kv_layer(name, self.caches[name], None)
        self.worker.wait_for_save()
        return wrong

    def _check_computed(self, name: str, layer: int, r: str, info: tuple, num_far: int | None,
                        wrong: set, poisoned: dict[str, int]) -> None:
        """KV vLLM counts computed in r's held near blocks is the model's; the near part holds no null block.
        num_far: r's far blocks under the hot window (None: not a hot-window row)."""
        tokens, table, num_computed, num_new = info
        for p in range(num_computed):
            block_id = table[p // BS]
            if p // BS < (num_far or 0) or block_id == 0:  # a far block, or vLLM's null block: not held
                continue
            if not torch.equal(self.caches[name][block_id, :, p % BS], self.model.kv(layer, tuple(tokens[: p + 1]))):
                wrong.add((r, block_id))
                poisoned.setdefault(r, layer)
        if num_far is not None and self.window is not None and 0 in table[num_far: -(-(num_computed + num_new) // BS)]:
            self.problems.append(f"step {self.step_no} {r}: near part reads the null block: table={table} "
                                 f"far={num_far} computed={num_computed} new={num_new}")

    def _check_far(self, step, layer: int, info: dict, num_tokens: int, poisoned: dict[str, int]) -> None:
        """Each row's far attention equals dense attention over the model's KV of its far blocks."""
        q = torch.randn(num_tokens, HQ, D, generator=torch.Generator().manual_seed(self.step_no * 100 + layer))
        try:
            out, _ = step.far.attend(layer, q, 0.3)
        except Exception as e:  # noqa: BLE001  recorded, the run goes on to find more
            self.problems.append(f"step {self.step_no} far attend raised: {e!r}")
            return
        for row in step.rows:
            if not row.num_far_blocks:
                continue
            tokens = info[row.req_id][0]
            blocks = torch.stack([self.model.block(layer, tokens, b) for b in range(row.num_far_blocks)])
            want = dense_attention(q[row.q_start:row.q_end], blocks, 0.3)
            if not torch.allclose(out[row.q_start:row.q_end].double(), want, atol=1e-4, rtol=1e-3):
                self.problems.append(f"step {self.step_no} {row.req_id}: far part differs at layer {layer} "
                                     f"(far={row.num_far_blocks})")
                poisoned.setdefault(row.req_id, layer)

    def run_out(self, steps: int = 400) -> None:
        """Steps until no request is left, then two more (finished requests' last notices)."""
        for _ in range(steps):
            self.step()
            if not self.sched.requests:
                break
        self.step()
        self.step()

    def held(self, hashes: list[str]) -> list[int]:
        """Per layer, how many of the blocks `hashes` some tier holds (saves landed by now count)."""
        self.store.poll(wait=True)
        return [self.store.num_held(self.store.keys(hashes, layer)) for layer in range(self.shape.layers)]

    def check_tiers(self) -> int:
        """Records a problem for every block a tier holds that is not the model's KV; returns the blocks checked."""
        self.store.poll(wait=True)
        checked = 0
        for tokens in self.token_ids.values():
            hashes = self.store.extend_hashes([], tokens, len(tokens) // BS)
            for layer in range(self.shape.layers):
                got = self.store.chain.get_many(self.store.keys(hashes, layer), promote=False)
                for b, block in enumerate(got):
                    if block is None:
                        continue
                    checked += 1
                    want = self.model.block(layer, tokens, b)
                    if not torch.equal(block.float().reshape(want.shape), want):
                        self.problems.append(f"tier holds wrong KV for block {b} layer {layer} of {tokens[:8]}...")
        return checked

    def pinned(self) -> dict:
        """What stays pinned: the CPU tier's key and whole-block pins, the saves' landed pins. No public view
        counts them, so this reads the tier's and the saves' private fields."""
        cpu, saves = self.store.cpu, self.store.saves
        blocks = getattr(cpu._pin_state, "blocks", None)
        return {"keys": sum(cpu._pins.values()),
                "blocks": {k: v for k, v in blocks.pins.items() if v} if blocks is not None else {},
                "landed": len(saves._pins), "landed_blocks": dict(saves._pin_blocks)}

    def leftovers(self) -> list[str]:
        """After every request ended: pins, FarKV rows and scheduler-side request states still held."""
        found = []
        pins = self.pinned()
        if any(pins.values()):
            found.append(f"pins left: {pins}")
        far = self.store.hot_window
        if far is not None and far.requests:
            found.append(f"FarKV rows left: {list(far.requests)}")
        states = self.sched.connector._scheduler._requests  # no public view of the connector's request states
        if states:
            found.append(f"scheduler-side states left: {list(states)}")
        return found

    def close(self) -> None:
        hot_window._STATE["runner"] = None
        self.worker.shutdown()
        self.sched.shutdown()
