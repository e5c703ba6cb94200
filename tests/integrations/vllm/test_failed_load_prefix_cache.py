"""A prefix block that failed to load must leave vLLM's prefix cache: under the recompute policy vLLM kept it
cached, so when its request was aborted (or preempted) before the recompute, the next request with the prompt
got the block as a prefix hit, holding whatever the failed load left (found by a connector probe, with vLLM's
own Scheduler and prefix caching on, as `TieredLLM(hot_window=False)` runs it)."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tierkv.integrations.vllm import kv_transfer_config  # noqa: E402
from tierkv.integrations.vllm.connector import TierKVConnector  # noqa: E402

BS, H, D, POOL = 4, 2, 8, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


class Engine:
    """vLLM's Scheduler (prefix caching on) and tierkv's worker connector around a stand-in forward that
    writes random KV for the scheduled tokens."""

    def __init__(self, root):
        from vllm.utils.hashing import sha256

        (root / "m").mkdir()
        (root / "m/config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": H, "num_hidden_layers": len(NAMES), "head_dim": D,
            "max_position_embeddings": 512, "vocab_size": 1000, "torch_dtype": "float32"}))
        (root / "t.yaml").write_text(json.dumps({"cache": {"block_tokens": BS}, "metrics": {"enabled": False},
                                                 "tiers": [{"kind": "cpu", "capacity_bytes": 1 << 20}]}))
        config = VllmConfig(
            model_config=ModelConfig(model=str(root / "m"), skip_tokenizer_init=True, max_model_len=64,
                                     enforce_eager=True, dtype="float32"),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                             is_encoder_decoder=False, async_scheduling=False),
            kv_transfer_config=KVTransferConfig(**kv_transfer_config(str(root / "t.yaml"), model_id="m")),
            device_config=DeviceConfig(device="cpu"))
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=POOL, kv_cache_groups=[KVCacheGroupSpec(layer_names=NAMES, kv_cache_spec=spec)],
                           kv_cache_tensors=[KVCacheTensor(size=POOL * spec.page_size_bytes, shared_by=[n]) for n in NAMES])
        config.cache_config.num_gpu_blocks = POOL
        self.worker = TierKVConnector(config, KVConnectorRole.WORKER, kv)
        self.caches = {n: torch.randn(POOL, H, BS, 2 * D) for n in NAMES}
        self.worker.register_kv_caches(self.caches)
        self.scheduler = Scheduler(config, kv, StructuredOutputManager(config), block_size=BS)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)
        self.before_forward = None

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.scheduler.add_request(Request(req_id, prompt, SamplingParams(max_tokens=3, ignore_eos=True), None,
                                           block_hasher=self.hasher))

    def step(self) -> set[int]:
        """One engine step; returns the block ids the worker reported as failed loads."""
        out = self.scheduler.schedule()
        if self.before_forward is not None:
            self.before_forward(out.kv_connector_metadata)
        order = list(out.num_scheduled_tokens)
        worker = self.worker
        worker.bind_connector_metadata(pickle.loads(pickle.dumps(out.kv_connector_metadata)))
        worker.start_load_kv(None)
        for name in NAMES:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, self.caches[name], None)
        worker.wait_for_save()
        invalid = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        requests = self.scheduler.requests
        sampled = [[5] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in order]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid)))
        return invalid

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.mark.parametrize("lost_block", [0, 1, 2])
def test_a_block_that_failed_to_load_is_no_prefix_hit_after_its_request_is_aborted(tmp_path, lost_block):
    engine = Engine(tmp_path)
    try:
        prompt = list(range(100, 113))  # 3 full blocks and a token
        engine.add("a", prompt)
        for _ in range(4):
            engine.step()
        engine.worker.store.poll(wait=True)
        assert engine.scheduler.kv_cache_manager.reset_prefix_cache()  # vLLM forgets a; the tiers hold it

        def lose(meta):
            store = engine.worker.store
            store.chain.remove_many(store.keys(meta.loads[0].hashes[lost_block:lost_block + 1], 1))
            engine.before_forward = None

        engine.before_forward = lose
        engine.add("b", prompt)
        invalid = engine.step()
        assert len(invalid) == 1
        (bad,) = invalid
        assert engine.scheduler.kv_cache_manager.block_pool.blocks[bad].block_hash is None  # out of the cache
        engine.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)  # gone before its recompute
        blocks, hit_tokens, _ = engine.scheduler.kv_cache_manager.get_computed_blocks(
            Request("c", prompt, SamplingParams(max_tokens=3), None, block_hasher=engine.hasher))
        assert hit_tokens == lost_block * BS and bad not in blocks.get_block_ids()[0]
    finally:
        engine.close()


def test_every_request_holding_a_block_that_failed_to_load_recomputes_it(tmp_path):
    """A duplicate prompt in the step gets the loading request's blocks from vLLM's prefix cache. vLLM moved back
    only the first holder of a failed block: the second kept it counted computed, and when the first was aborted
    before its recompute, nobody recomputed it (the second sampled over it and saved its next blocks with it; its
    own blocks of that step stayed cached for later prompts). Found by a taint-propagating probe."""
    engine = Engine(tmp_path)
    try:
        prompt = list(range(100, 117))  # 4 full blocks and a token
        engine.add("a", prompt)
        for _ in range(4):
            engine.step()
        engine.worker.store.poll(wait=True)
        assert engine.scheduler.kv_cache_manager.reset_prefix_cache()

        def lose(meta):
            store = engine.worker.store
            store.chain.remove_many(store.keys(meta.loads[0].hashes[0:1], 1))  # block 0, layer 1
            engine.before_forward = None

        engine.before_forward = lose
        engine.add("b", prompt)
        engine.add("c", prompt)  # a prefix hit on b's blocks, in the same step
        (bad,) = engine.step()
        manager = engine.scheduler.kv_cache_manager
        for req_id in ("b", "c"):
            assert engine.scheduler.requests[req_id].num_computed_tokens == 0, req_id  # both recompute from block 0
        c_blocks = manager.get_block_ids("c")[0]
        assert bad in c_blocks and all(manager.block_pool.blocks[b].block_hash is None for b in c_blocks)
        engine.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        engine.step()  # c recomputes its blocks
        assert engine.scheduler.requests["c"].num_computed_tokens == len(prompt)
    finally:
        engine.close()
