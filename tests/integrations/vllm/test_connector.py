"""The tierkv vLLM connector against vLLM 0.26's own classes, on CPU.

Constructed with both roles from a real VllmConfig and KVCacheConfig; metadata pickled; a prompt
saved layer by layer from a paged cache in vLLM's FlashAttention layout, found again by the
scheduler side across the CPU and disk tiers, and loaded back bit-exactly into other blocks.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI installs vLLM (.ci/run): a missing vLLM fails here, never skips
else:
    pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the connector tests")

from vllm.config import AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tierkv.config import ConfigError  # noqa: E402
from tierkv.integrations.vllm import kv_transfer_config  # noqa: E402
from tierkv.integrations.vllm.connector import TierKVConnector  # noqa: E402
from tierkv.integrations.vllm.connector_scheduler import TierKVMetadata  # noqa: E402
from tierkv.integrations.vllm.store import BlockSpan, PagedLayout  # noqa: E402
from tierkv.llm_totals import RequestTotals  # noqa: E402

BS, H, D, LAYERS, NUM_BLOCKS = 16, 2, 8, 3, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def write_config(tmp_path, cpu_blocks: int = 1000, disk: bool = True) -> str:
    block_bytes = 2 * H * BS * D * 4
    lines = ["cache:", f"  block_tokens: {BS}", "tiers:", "  - kind: cpu", f"    capacity_bytes: {cpu_blocks * block_bytes}"]
    if disk:
        lines += ["  - kind: disk", f"    path: {tmp_path / 'disk'}", f"    capacity_bytes: {4096 * block_bytes}", "    trusted: true"]
    lines += ["scheduler:", "  lookahead_layers: 1", f"  staging_bytes: {64 * block_bytes}"]
    path = tmp_path / "tierkv.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def vllm_config(config_file: str, *, hot_window: bool = False, **extra) -> VllmConfig:
    """vLLM's config of an engine running tierkv's connector; hot_window: with tierkv's hot window (attention
    backend CUSTOM, as `vllm_engine_args` sets it)."""
    transfer = KVTransferConfig(**kv_transfer_config(config_file, model_id="test-llama", **extra))
    attention = AttentionConfig(backend="CUSTOM") if hot_window else AttentionConfig()
    return VllmConfig(kv_transfer_config=transfer, cache_config=CacheConfig(block_size=BS),
                      device_config=DeviceConfig(device="cpu"), attention_config=attention)


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    tensors = [KVCacheTensor(size=NUM_BLOCKS * spec.page_size_bytes, shared_by=[n]) for n in NAMES]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=NAMES, kv_cache_spec=spec)])


def paged_caches() -> dict[str, torch.Tensor]:
    return {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}  # FlashAttention's logical layout


def make_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=4), None)


def schedule(req: Request, block_ids: list[int], num_computed: int) -> SchedulerOutput:
    new = NewRequestData.from_request(req, (block_ids,))
    new.num_computed_tokens = num_computed
    scheduled = len(req.prompt_token_ids) - num_computed
    return SchedulerOutput(
        scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: scheduled}, total_num_scheduled_tokens=scheduled,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )


def run_forward(worker: TierKVConnector, caches: dict[str, torch.Tensor], meta: TierKVMetadata) -> None:
    """What vLLM's model runner does around one forward, per the connector contract."""
    worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))  # crosses a process boundary in vLLM
    worker.start_load_kv(None)
    for name in NAMES:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, caches[name], None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


@pytest.fixture
def engine(tmp_path):
    def make(cpu_blocks=1000, disk=True, worker=True):
        config = vllm_config(write_config(tmp_path, cpu_blocks, disk))
        made = []
        if worker:
            w = TierKVConnector(config, KVConnectorRole.WORKER, kv_cache_config())
            caches = paged_caches()
            w.register_kv_caches(caches)
            made.append(w)
        else:
            w, caches = None, None
        s = TierKVConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
        made.append(s)
        connectors.extend(made)
        return s, w, caches

    connectors: list[TierKVConnector] = []
    yield make
    for c in connectors:
        c.shutdown()


def test_both_roles_share_one_store_and_metadata_pickles(engine):
    scheduler, worker, _ = engine()
    assert scheduler.role == KVConnectorRole.SCHEDULER and worker.role == KVConnectorRole.WORKER
    assert scheduler.store is worker.store and not scheduler.store.lookup_only
    assert scheduler.layout.shape == (2, H, BS, D) and scheduler.store.layer_index[NAMES[2]] == 2
    meta = TierKVMetadata(loads=[BlockSpan("a", [1, 2], ["x", "y"])], saves=[BlockSpan("b", [3], ["z"])])
    again = pickle.loads(pickle.dumps(meta))
    assert again == meta and isinstance(again, TierKVMetadata)


def test_prefix_saved_by_one_request_is_found_across_tiers_and_loaded_bit_exactly(engine):
    # 8 CPU-tier blocks for 3 layers x 6 blocks: most of the prefix spills to disk.
    scheduler, worker, caches = engine(cpu_blocks=8)
    prompt = torch.randint(0, 1000, (100,)).tolist()            # 6 full blocks + 4 tokens
    first = make_request("first", prompt)
    assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
    first_blocks = list(range(10, 17))
    scheduler.update_state_after_alloc(first, KVCacheBlocks((tuple(KVCacheBlock(b) for b in first_blocks),)), 0)
    meta = scheduler.build_connector_meta(schedule(first, first_blocks, 0))
    assert not meta.loads and [len(s.block_ids) for s in meta.saves] == [6]
    run_forward(worker, caches, meta)
    scheduler.request_finished(first, first_blocks)
    saved = {n: caches[n][first_blocks[:6]].clone() for n in NAMES}
    store = scheduler.store
    store.chain.flush()
    where = store.chain.locate_many([k for layer in range(LAYERS) for k in store.keys(meta.saves[0].hashes, layer)])
    assert set(where) == {0, 1}  # some in the CPU tier, the rest spilled to disk

    second = make_request("second", prompt[:96] + [7, 8, 9, 10, 11])
    matched, is_async = scheduler.get_num_new_matched_tokens(second, 0)
    assert (matched, is_async) == (96, False)
    second_blocks = list(range(30, 37))
    for n in NAMES:
        caches[n][second_blocks] = 0
    scheduler.update_state_after_alloc(second, KVCacheBlocks((tuple(KVCacheBlock(b) for b in second_blocks),)), 96)
    meta = scheduler.build_connector_meta(schedule(second, second_blocks, 96))
    assert [s.block_ids for s in meta.loads] == [second_blocks[:6]] and not meta.saves
    run_forward(worker, caches, meta)
    for n in NAMES:
        assert torch.equal(caches[n][second_blocks[:6]], saved[n])
    assert worker.get_block_ids_with_load_errors() == set()
    stats = scheduler.stats()
    assert stats["counts"]["blocks_loaded"] == 6 and stats["counts"]["blocks_saved"] == 18
    # per forward, the worker hooks' host ms (start_load_kv, save_kv_layer, wait_for_save): the first saved
    # 6 blocks per layer, the second saved none (its save_kv_layer calls return at once: 0.0)
    (load1, save1, wait1), (load2, save2, wait2) = stats["step_connector_ms"]
    assert min(load1, save1, wait1, load2, wait2) >= 0 and save1 > 0 and save2 == 0.0


def test_vllm_prefix_cache_hit_is_not_loaded_again(engine):
    scheduler, worker, caches = engine()
    prompt = torch.randint(0, 1000, (80,)).tolist()
    req = make_request("a", prompt)
    scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, KVCacheBlocks((tuple(KVCacheBlock(b) for b in range(5)),)), 0)
    run_forward(worker, caches, scheduler.build_connector_meta(schedule(req, list(range(5)), 0)))
    again = make_request("b", prompt)
    # vLLM's own prefix cache already holds 3 blocks: only blocks 3 and 4 come from tierkv, and
    # the last block holds the last prompt token, which vLLM must compute: block 4 is not offered.
    assert scheduler.get_num_new_matched_tokens(again, 48) == (16, False)


def test_a_block_gone_between_lookup_and_load_is_reported_for_recompute(engine):
    scheduler, worker, caches = engine(disk=False)
    prompt = torch.randint(0, 1000, (70,)).tolist()
    req = make_request("a", prompt)
    scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, KVCacheBlocks((tuple(KVCacheBlock(b) for b in range(5)),)), 0)
    meta = scheduler.build_connector_meta(schedule(req, list(range(5)), 0))
    run_forward(worker, caches, meta)
    again = make_request("b", prompt)
    assert scheduler.get_num_new_matched_tokens(again, 0) == (64, False)
    scheduler.update_state_after_alloc(again, KVCacheBlocks((tuple(KVCacheBlock(b) for b in range(20, 25)),)), 64)
    meta = scheduler.build_connector_meta(schedule(again, list(range(20, 25)), 64))
    scheduler.store.chain.remove_many(scheduler.store.keys(meta.loads[0].hashes[2:3], 1))
    run_forward(worker, caches, meta)
    assert worker.get_block_ids_with_load_errors() == {22}  # the other blocks loaded; vLLM recomputes from 22


def test_a_scheduler_without_its_worker_in_process_looks_up_the_shared_tiers_only(engine, tmp_path):
    scheduler, _, _ = engine(worker=False)
    assert scheduler.store.lookup_only and [t.kind for t in scheduler.store.chain.tiers] == ["disk"]
    assert scheduler.get_num_new_matched_tokens(make_request("x", list(range(64))), 0) == (0, False)


@pytest.mark.parametrize("layout", ["BHT2D", "2BTHD", "B2THD"])
def test_paged_layouts_read_and_write_the_same_blocks(layout):
    from tierkv.blocks import BlockLayout

    paged = PagedLayout(BlockLayout(H, BS, D, torch.float32))
    shapes = {"BHT2D": (NUM_BLOCKS, H, BS, 2 * D), "2BTHD": (2, NUM_BLOCKS, BS, H, D), "B2THD": (NUM_BLOCKS, 2, BS, H, D)}
    kv = torch.randn(shapes[layout])
    assert paged.kind(kv) == layout
    ids = torch.tensor([5, 1, 9])
    blocks = paged.read(kv, ids)
    assert blocks.shape == (3, 2, H, BS, D)
    if layout == "2BTHD":  # K of block 1, head 0, token 3 is kv[0, 1, 3, 0]
        assert torch.equal(blocks[1, 0, 0, 3], kv[0, 1, 3, 0])
    other = torch.zeros_like(kv)
    paged.write(other, ids, blocks)
    assert torch.equal(paged.read(other, ids), blocks)
    with pytest.raises(ValueError, match="not a layout tierkv reads"):
        paged.kind(torch.zeros(NUM_BLOCKS, H, BS, D))


def test_config_errors_name_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("TIERKV_CONFIG_FILE", raising=False)
    from tierkv.integrations.vllm.config import config_from_kv_transfer

    with pytest.raises(ConfigError, match="kv_connector_extra_config.config_file"):
        config_from_kv_transfer({}, block_size=BS, env={})
    with pytest.raises(ConfigError, match="did you mean 'config_file'"):
        config_from_kv_transfer({"config_fle": "x.yaml"}, block_size=BS, env={})
    with pytest.raises(ConfigError, match="existing tierkv YAML file"):
        config_from_kv_transfer({"config_file": str(tmp_path / "missing.yaml")}, block_size=BS, env={})
    path = write_config(tmp_path)
    with pytest.raises(ConfigError, match="cache.block_tokens.*vLLM's block_size \\(32\\)"):
        config_from_kv_transfer({"config_file": path}, block_size=32, env={})
    assert config_from_kv_transfer({}, block_size=BS, env={"TIERKV_CONFIG_FILE": path}).cache.block_tokens == BS


def test_a_connector_config_file_beside_the_variable_loads_without_a_warning(tmp_path, caplog):
    """TieredLLM(backend='vllm') hands the connector a file it wrote; with TIERKV_CONFIG_FILE set every vLLM
    process logged that the variable's file was not read (a review found it): the named file is the file."""
    import logging

    from tierkv.integrations.vllm.config import config_from_kv_transfer

    path = write_config(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text("cache:\n  block_tokens: 64\n")
    with caplog.at_level(logging.WARNING, logger="tierkv.config"):
        config = config_from_kv_transfer({"config_file": path}, block_size=BS, env={"TIERKV_CONFIG_FILE": str(other)})
    assert config.cache.block_tokens == BS and not [r for r in caplog.records if "not read" in r.getMessage()]
    with pytest.raises(ConfigError, match="kv_connector_extra_config.config_file"):
        TierKVConnector(vllm_config(str(tmp_path / "nope.yaml")), KVConnectorRole.SCHEDULER, kv_cache_config())


def test_tiered_llm_vllm_backend_checks_its_inputs_before_starting_an_engine(tmp_path):
    from tierkv import TieredLLM
    from tierkv.integrations.vllm.llm import _config_file

    with pytest.raises(ValueError, match="needs a local checkpoint directory"):
        TieredLLM(str(tmp_path / "no-such-model"), None, backend="vllm")
    with pytest.raises(ConfigError, match="tiers"):
        TieredLLM(str(tmp_path), {"tiers": []}, backend="vllm")
    # A config given as data reaches the connector as a YAML file that loads back the same.
    config, path, owned = _config_file({"cache": {"block_tokens": 32}, "tiers": [{"kind": "cpu", "capacity_bytes": "1GiB"}]})
    try:
        from tierkv.config import load_config

        assert owned == path and load_config(path) == config and config.cache.block_tokens == 32
    finally:
        os.unlink(path)


def test_tensor_parallel_ranks_keep_their_own_heads_and_a_prefix_counts_only_when_every_rank_holds_it(tmp_path):
    """Each rank stores its own KV heads under rank-named keys; the scheduler's lookup store finds a
    block only if all ranks hold it; a rank loads back its own heads, never another rank's."""
    from tierkv.blocks import BlockLayout
    from tierkv.config import load_config
    from tierkv.integrations.vllm.store import VllmKVStore

    layout = BlockLayout(H, BS, D, torch.float32)
    config = load_config(write_config(tmp_path, cpu_blocks=2), env={})  # tiny CPU tiers: blocks spill to disk
    ranks = [VllmKVStore(config, layout, NAMES, "tp-model", "cpu", tp_rank=r, tp_size=2) for r in range(2)]
    caches = [paged_caches() for _ in ranks]
    prompt = torch.randint(0, 1000, (64,)).tolist()
    hashes = ranks[0].extend_hashes([], prompt, 4)
    assert hashes == ranks[1].extend_hashes([], prompt, 4)  # same tokens, same chain on every rank
    assert ranks[0].keys(hashes, 0) != ranks[1].keys(hashes, 0)
    try:
        for store, kv, num_blocks in ((ranks[0], caches[0], 4), (ranks[1], caches[1], 3)):  # rank 1 saved 3 blocks
            store.register(kv)
            span = BlockSpan("r", list(range(num_blocks)), hashes[:num_blocks])
            # another prompt's blocks after it push the last ones out of the 2-block CPU tier to disk,
            # the tier a scheduler in another process can see
            filler = BlockSpan("f", [20, 21], store.extend_hashes([], [7] * 32, 2))
            for spans in ([span], [filler]):
                for name in NAMES:
                    store.save_layer(store.layer_index[name], kv[name], spans)
                store.poll(wait=True)
            store.chain.flush()
        scheduler = VllmKVStore(config, layout, NAMES, "tp-model", "cpu", lookup_only=True, tp_size=2)
        try:
            assert scheduler.present_prefix(hashes) == 3  # block 3 exists for rank 0 only
        finally:
            scheduler.close()
        for name in NAMES:
            caches[1][name][[10, 11, 12]] = 0
        ranks[1].begin_loads([BlockSpan("r2", [10, 11, 12], hashes[:3])])
        for name in NAMES:
            ranks[1].finish_layer_load(ranks[1].layer_index[name])
        for name in NAMES:
            assert torch.equal(caches[1][name][[10, 11, 12]], caches[1][name][[0, 1, 2]])
            assert not torch.equal(caches[1][name][[10, 11, 12]], caches[0][name][[0, 1, 2]])
        assert ranks[1].take_load_errors() == set()
    finally:
        for store in ranks:
            store.close()


def test_tensor_parallel_stats_name_each_ranks_tiers_in_the_metrics(tmp_path):
    """Under tensor parallelism `TieredLLM.stats()` gathers every rank's store from the workers
    (vLLM's collective_rpc) and names each rank's tiers `<tier>@rank<k>`: the metrics lines and the
    Prometheus endpoint then carry a tier per rank with that rank's own counts."""
    from types import SimpleNamespace

    from tierkv.blocks import BlockLayout
    from tierkv.config import load_config
    from tierkv.metrics.recorder import MetricsRecorder
    from tierkv.integrations.vllm.llm import VllmTieredLLM
    from tierkv.integrations.vllm.store import VllmKVStore
    from tierkv.integrations.vllm.store_registry import merge_rank_stats, release_store, shared_store, worker_stats

    layout = BlockLayout(H, BS, D, torch.float32)
    config = load_config(write_config(tmp_path, cpu_blocks=64), env={})
    engine_id = "tp-stats-engine"
    ranks = [shared_store(f"{engine_id}/rank{r}", lambda r=r: VllmKVStore(config, layout, NAMES, "tp-model", "cpu",
                                                                           tp_rank=r, tp_size=2)) for r in range(2)]
    try:
        saved = {0: 4, 1: 3}  # blocks each rank saves: the ranks' counts must stay apart
        for store in ranks:
            kv = paged_caches()
            store.register(kv)
            hashes = store.extend_hashes([], list(range(64)), saved[store.tp_rank])
            for name in NAMES:
                store.save_layer(store.layer_index[name], kv[name], [BlockSpan("r", list(range(len(hashes))), hashes)])
            store.poll(wait=True)
        # two worker processes: each answers for the rank it holds
        answers = [[s for s in worker_stats(None, engine_id) if s["tp_rank"] == r] for r in (1, 0)]
        assert [len(a) for a in answers] == [1, 1]
        llm = object.__new__(VllmTieredLLM)
        llm.engine_id, llm.totals = engine_id, RequestTotals(())
        llm.engine = SimpleNamespace(
            llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2))),
            collective_rpc=lambda fn, args: answers)
        stats = llm.stats()
        assert stats["tensor_parallel_size"] == 2 and sorted(stats["ranks"]) == ["rank0", "rank1"]
        assert [t["tier"] for t in stats["tiers"]] == ["cpu@rank0", "disk@rank0", "cpu@rank1", "disk@rank1"]
        for r in (0, 1):
            assert stats["ranks"][f"rank{r}"]["counts"]["blocks_saved"] == saved[r] * LAYERS
        recorder = MetricsRecorder(llm.stats)
        try:
            figures = recorder.snapshot("start")["figures"]
        finally:
            recorder.close()
        assert figures["ranks.rank0.counts.blocks_saved"] == 4 * LAYERS
        assert figures["ranks.rank1.counts.blocks_saved"] == 3 * LAYERS
        assert figures["tier.cpu@rank0.bytes_written"] > figures["tier.cpu@rank1.bytes_written"] > 0
        from prometheus_client import generate_latest  # a dev dependency, installed by .ci/run

        from tierkv.metrics.prometheus import TierKVCollector, new_registry

        text = generate_latest(new_registry(TierKVCollector(recorder.measure))).decode()
        assert 'tier="cpu@rank1"' in text and 'tier="disk@rank0"' in text
        with pytest.raises(ValueError, match="different tensor-parallel sizes"):
            merge_rank_stats([{"tp_rank": 0, "tp_size": 2}, {"tp_rank": 1, "tp_size": 4}])
    finally:
        for r in range(2):
            release_store(f"{engine_id}/rank{r}")


def test_a_step_whose_layer_hooks_did_not_run_is_saved_after_it(engine):
    """A step replayed from vLLM's full decode graph runs no per-layer hook: wait_for_save saves the
    step's blocks of every layer save_kv_layer did not (here two of three), from vLLM's pool, and a
    later request finds the whole prefix."""
    scheduler, worker, caches = engine()
    prompt = torch.randint(0, 1000, (100,)).tolist()            # 6 full blocks + 4 tokens
    first = make_request("first", prompt)
    blocks = list(range(10, 17))
    scheduler.update_state_after_alloc(first, KVCacheBlocks((tuple(KVCacheBlock(b) for b in blocks),)), 0)
    meta = scheduler.build_connector_meta(schedule(first, blocks, 0))
    worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
    worker.start_load_kv(None)
    worker.save_kv_layer(NAMES[1], caches[NAMES[1]], None)  # only the middle layer's hook ran
    worker.wait_for_save()
    worker.clear_connector_metadata()
    scheduler.request_finished(first, blocks)
    assert scheduler.stats()["counts"]["blocks_saved"] == 6 * LAYERS  # each layer once
    second = make_request("second", prompt[:96] + [7, 8, 9, 10, 11])
    assert scheduler.get_num_new_matched_tokens(second, 0) == (96, False)


def test_full_decode_graphs_are_asked_of_vllm_only_when_configured(tmp_path):
    """scheduler.sparse_full_graphs: the connector stops forcing vLLM's piecewise mode and the
    backend's metadata builder declares uniform single-token decode support; without it, neither."""
    from vllm.v1.attention.backend import AttentionCGSupport

    from tierkv.integrations.vllm.hot_window import full_decode_graphs

    plain = write_config(tmp_path)
    sparse = tmp_path / "sparse.yaml"
    sparse.write_text(Path(plain).read_text().replace(
        "scheduler:\n", "scheduler:\n  policy: sparse\n  sparse_cuda_graphs: true\n  sparse_full_graphs: true\n"))
    for path, full in ((plain, False), (str(sparse), True)):
        assert TierKVConnector.requires_piecewise_for_cudagraph({"config_file": path}) is not full
        assert full_decode_graphs(vllm_config(path)) is full
    from tierkv.integrations.vllm.backend import HotWindowMetadataBuilder

    assert HotWindowMetadataBuilder.get_cudagraph_support(vllm_config(str(sparse)), None) == \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert HotWindowMetadataBuilder.get_cudagraph_support(vllm_config(plain), None) == AttentionCGSupport.NEVER


def test_block_hashes_never_cover_a_block_whose_tokens_are_not_all_known(tmp_path):
    """A position can run ahead of the token ids the host knows (the token of a step still being
    sampled): extend_hashes stops at the last full block of the ids it is given, and once the
    missing token is known it extends to the same chain as hashing all the tokens at once. A
    partial block's hash, kept as a full block's, would name KV whose last token differs."""
    from tierkv.blocks import BlockLayout
    from tierkv.config import load_config
    from tierkv.integrations.vllm.store import VllmKVStore

    store = VllmKVStore(load_config(write_config(tmp_path), env={}), BlockLayout(H, BS, D, torch.float32), NAMES,
                        "model", "cpu")
    try:
        tokens = torch.randint(0, 1000, (3 * BS,)).tolist()
        hashes = store.extend_hashes([], tokens[: 2 * BS - 1], 2)  # block 1's last token not known yet
        assert len(hashes) == 1 and hashes == store.extend_hashes([], tokens[:BS], 1)
        assert store.extend_hashes(hashes, tokens[: 2 * BS], 2) == store.extend_hashes([], tokens, 2)
        assert len(hashes) == 2  # grown in place
    finally:
        store.close()


def test_block_addresses_name_the_checkpoint_weights(tmp_path):
    """Two checkpoints of one shape under one configured name (and one path, rewritten) never share
    block addresses; the same files give the same address in every process."""
    from types import SimpleNamespace

    from tierkv.config import load_config
    from tierkv.integrations.vllm.engine_config import model_identity_of

    config = load_config(write_config(tmp_path), env={})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"num_hidden_layers": 3}')
    (ckpt / "model.safetensors").write_bytes(os.urandom(1 << 20))
    model_config = SimpleNamespace(model=str(ckpt), revision=None)
    first = model_identity_of(config, {"model_id": "m"}, model_config)
    assert first.weights is not None and first == model_identity_of(config, {"model_id": "m"}, model_config)
    (ckpt / "model.safetensors").write_bytes(os.urandom(1 << 20))  # other weights, same path and size
    second = model_identity_of(config, {"model_id": "m"}, model_config)
    assert second.key != first.key
    assert model_identity_of(config, {"model_id": "m"}, SimpleNamespace(model=str(ckpt), revision="v2")).key != second.key
    config.model.name = "another-name"
    assert model_identity_of(config, {"model_id": "m"}, model_config).key != second.key
    worker = TierKVConnector(vllm_config(write_config(tmp_path)), KVConnectorRole.WORKER, kv_cache_config())
    try:
        worker.register_kv_caches(paged_caches())
        model = worker.store.stats()["model"]
        assert model["block_fingerprint"] == worker.store.fingerprint and model["name"] == "unnamed-model"
    finally:
        worker.shutdown()
