"""A prefix hit's window blocks, loaded into vLLM's pool, stay in the CPU tier until they turn far: a small
CPU tier filled by another request's saves evicted them once their load had landed, and the step where they
turned far stopped the engine ("in no tier"). Driven through vLLM's own Scheduler, with the worker connector
called in the model runner's order and a stand-in model (the pool's KV written as vLLM's forward would not:
only the pins and the far reads are under test). Also: two running requests holding the same window blocks, one
finishing first, the other still reading them as far later. At the end nothing stays pinned."""
from __future__ import annotations

import json
import pickle
import weakref
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from vllm.config import (AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        KVCacheTensor, SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tierkv.integrations.vllm import hot_window, kv_transfer_config  # noqa: E402
from tierkv.integrations.vllm.connector import TierKVConnector  # noqa: E402

BS, H, D, L, WINDOW, POOL = 4, 2, 8, 2, 8, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


class Runner:
    def __init__(self, order: list[str]):
        self.input_batch = SimpleNamespace(req_ids=order, num_reqs=len(order))


class Engine:
    """vLLM's scheduler and one worker connector on the CPU; `step()` is one engine step. window None: full
    attention (no hot window); prefix_caching: vLLM's own prefix cache on (requests carry vLLM's block hashes).
    `before_forward(metadata)`, when set, runs between the schedule and the worker's hooks."""

    def __init__(self, root, cpu_keys: int, layers: int = L, window: int | None = WINDOW, lookahead: int = 1,
                 pool: int = POOL, prefix_caching: bool = False):
        self.names = names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        (root / "t.yaml").write_text(json.dumps({
            "cache": {"block_tokens": BS, **({"window_tokens": window} if window is not None else {})},
            "tiers": [{"kind": "cpu", "capacity_bytes": cpu_keys * 2 * H * BS * D * 4}],
            "scheduler": {"lookahead_layers": lookahead, "staging_bytes": 64 * 2 * H * BS * D * 4},
            "metrics": {"enabled": False}}))
        (root / "m").mkdir()
        (root / "m/config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": H, "num_hidden_layers": layers, "head_dim": D,
            "max_position_embeddings": 512, "vocab_size": 1000, "torch_dtype": "float32"}))
        hot_window.register()
        vc = VllmConfig(model_config=ModelConfig(model=str(root / "m"), skip_tokenizer_init=True, max_model_len=96,
                                                 enforce_eager=True, dtype="float32"),
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
                        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96,
                                                         is_encoder_decoder=False, async_scheduling=False),
                        kv_transfer_config=KVTransferConfig(**kv_transfer_config(str(root / "t.yaml"), model_id="m")),
                        device_config=DeviceConfig(device="cpu"),
                        attention_config=AttentionConfig(backend="CUSTOM" if window is not None else None))
        spec = (FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32) if window is None
                else SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32, sliding_window=window))
        kvc = KVCacheConfig(num_blocks=pool, kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
                            kv_cache_tensors=[KVCacheTensor(size=pool * spec.page_size_bytes, shared_by=[n]) for n in names])
        vc.cache_config.num_gpu_blocks = pool
        self.worker = TierKVConnector(vc, KVConnectorRole.WORKER, kvc)  # the engine core builds the worker first
        self.caches = {n: torch.randn(pool, H, BS, 2 * D, generator=torch.Generator().manual_seed(0)) for n in names}
        self.worker.register_kv_caches(self.caches)
        self.sched = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=BS)
        self.hasher = _vllm_block_hasher() if prefix_caching else None
        self.before_forward = None

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.sched.add_request(self.request(req_id, prompt, max_tokens))

    def request(self, req_id: str, prompt: list[int], max_tokens: int) -> Request:
        return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                       block_hasher=self.hasher)

    def step(self) -> set[int]:
        """One engine step; returns the block ids the worker reported as failed loads."""
        out = self.sched.schedule()
        if self.before_forward is not None:
            self.before_forward(out.kv_connector_metadata)
        order = list(out.num_scheduled_tokens)
        runner = Runner(order)  # the batch order the hot window reads from vLLM's model runner
        hot_window._STATE["runner"] = weakref.ref(runner)
        worker = self.worker
        worker.bind_connector_metadata(pickle.loads(pickle.dumps(out.kv_connector_metadata)))
        worker.start_load_kv(None)
        if order:
            for n in self.names:
                worker.wait_for_layer_load(n)
                worker.save_kv_layer(n, self.caches[n], None)
            worker.wait_for_save()
        invalid = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        reqs = self.sched.requests
        sampled = [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in order]
        self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid)))
        return invalid

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()

    def run_out(self, steps: int = 40) -> None:
        for _ in range(steps):
            self.step()
            if not self.sched.requests:
                break
        self.step()  # the last finish reaches the worker
        self.step()

    def pinned(self) -> dict:
        store = self.worker.store
        cpu, saves = store.cpu, store.saves
        blocks = getattr(cpu._pin_state, "blocks", None)
        return {"keys": sum(cpu._pins.values()), "blocks": dict(blocks.pins) if blocks is not None else {},
                "landed": len(saves._pins), "landed_blocks": dict(saves._pin_blocks)}


NOTHING = {"keys": 0, "blocks": {}, "landed": 0, "landed_blocks": {}}


def _vllm_block_hasher():
    """vLLM's request block hasher (sha256), as its engine core makes it for a prefix-caching engine."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BS, sha256)


@pytest.mark.parametrize("reuse", [True, False])
def test_a_loaded_window_block_stays_in_the_cpu_tier_until_it_turns_far(tmp_path, reuse):
    """B reuses A's prompt (its window blocks loaded, then unpinned once landed before the fix); C's saves fill
    the 8-block CPU tier; B's loaded blocks turn far two decode steps later. reuse=False: the control, where B
    computes its window itself (its own saves stay pinned)."""
    engine = Engine(tmp_path, cpu_keys=16)  # 8 blocks of 2 layers
    prompt = list(range(100, 125))  # 6 full blocks and one token
    engine.add("A", prompt if reuse else list(range(300, 325)), 1)
    engine.run_out()
    engine.add("B", prompt, 5)
    engine.step()  # prefix hit (reuse): blocks 0..3 far, window blocks 4 and 5 loaded into the pool
    engine.add("C", list(range(500, 517)), 1)
    engine.run_out()
    assert engine.worker.store.counts["blocks_loaded"] == (2 if reuse else 0)  # the 2 window blocks (both layers)
    assert engine.pinned() == NOTHING


def test_a_window_block_two_requests_loaded_stays_for_the_one_still_running(tmp_path):
    """B1 and B2 load the same window blocks; B1 finishes first, C's saves fill the tier, and B2 still reads
    them as far blocks later."""
    engine = Engine(tmp_path, cpu_keys=16)
    prompt = list(range(100, 125))
    engine.add("A", prompt, 1)
    engine.run_out()
    engine.add("B1", prompt, 1)
    engine.add("B2", prompt, 6)
    engine.step()
    engine.step()
    engine.add("C", list(range(500, 517)), 1)
    engine.run_out()
    assert engine.pinned() == NOTHING
