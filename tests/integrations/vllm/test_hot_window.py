"""The hot-window pool on CPU: far attention read back from the tiers equals dense attention over
the freed blocks, the near/far split matches what vLLM 0.26 frees, the plugin turns full-attention
layers into a sliding-window spec sized for the window, and the connector sends the worker what it
needs. The FlashAttention half runs on the GPU (benchmarks/vllm_check.py hotwindow)."""
from __future__ import annotations

import collections
import json
import math
import os
import pickle
import random
import tempfile
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI installs vLLM (.ci/run): a missing vLLM fails here, never skips
else:
    pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the hot-window tests")

import vllm.config  # noqa: E402,F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

from tierkv.blocks import BlockLayout  # noqa: E402
from tierkv.config import load_config  # noqa: E402
from tierkv.integrations.vllm import hot_window  # noqa: E402
from tierkv.integrations.vllm.connector import TierKVConnector  # noqa: E402
from tierkv.integrations.vllm.connector_scheduler import TierKVMetadata  # noqa: E402
from tierkv.integrations.vllm.far_rows import FarKV  # noqa: E402
from tierkv.integrations.vllm.far_step import far_blocks  # noqa: E402
from tierkv.integrations.vllm.store import BlockSpan, VllmKVStore  # noqa: E402

from tests.vllm_engine_fake import FakeEngineBase  # noqa: E402
from tests.integrations.vllm.test_connector import BS, D, H, LAYERS, NAMES, NUM_BLOCKS  # noqa: E402
from tests.integrations.vllm.test_connector import make_request, schedule  # noqa: E402
from tests.integrations.vllm.test_connector import vllm_config as connector_vllm_config  # noqa: E402

HQ = 4  # query heads: GQA group of 2


def vllm_config(config_file: str, **extra):
    """vLLM's config of an engine running tierkv's hot window (attention backend CUSTOM)."""
    return connector_vllm_config(config_file, hot_window=True, **extra)


def write_config(tmp_path, *, window: int, staging_blocks: int, cpu_blocks: int = 2000, sparse_tokens: int = 0,
                 sparse_graphs: bool = False, storage_dtype: str = "auto", cache_selections: int = 1,
                 scheduler_lines: tuple[str, ...] = ()) -> str:
    block_bytes = 2 * H * BS * D * 4
    path = tmp_path / "hot.yaml"
    sparse = ["  policy: sparse", f"  sparse_token_budget: {sparse_tokens}"] if sparse_tokens else []
    sparse += ["  sparse_cuda_graphs: true", f"  sparse_cache_selections: {cache_selections}"] if sparse_graphs else []
    path.write_text("\n".join([
        "cache:", f"  block_tokens: {BS}", f"  window_tokens: {window}",
        "tiers:", "  - kind: cpu", f"    capacity_bytes: {cpu_blocks * block_bytes}", f"    storage_dtype: {storage_dtype}",
        "  - kind: disk", f"    path: {tmp_path / 'disk'}", f"    capacity_bytes: {4096 * block_bytes}", "    trusted: true",
        "scheduler:", "  lookahead_layers: 1", f"  staging_bytes: {staging_blocks * block_bytes}", *sparse,
        *(f"  {line}" for line in scheduler_lines),
    ]) + "\n")
    return str(path)


def dense(q: torch.Tensor, blocks: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, HQ, D] over blocks [m, 2, H, BS, D] without a mask: float64 (out, lse)."""
    k = blocks[:, 0].permute(0, 2, 1, 3).reshape(-1, H, D).double().repeat_interleave(HQ // H, dim=1)
    v = blocks[:, 1].permute(0, 2, 1, 3).reshape(-1, H, D).double().repeat_interleave(HQ // H, dim=1)
    scores = torch.einsum("nhd,khd->nhk", q.double(), k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("nhk,khd->nhd", torch.softmax(scores, dim=-1), v), lse


def assert_rows_equal_dense(out, lse, rows, q, read, cache, ids, scale) -> None:
    """Each row's far (out, lse) equals dense attention over its far blocks (`read(cache, block ids)`)."""
    for row in rows:
        blocks = read(cache, torch.tensor(ids[row.req_id][: row.num_far_blocks]))
        want_out, want_lse = dense(q[row.q_start : row.q_end], blocks, scale)
        torch.testing.assert_close(out[row.q_start : row.q_end].double(), want_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[row.q_start : row.q_end].double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("staging_blocks", [4, 6, 400])
def test_far_attention_equals_dense_attention_over_the_blocks_vllm_freed(tmp_path, staging_blocks):
    """Two requests (one decoding, one in a prefill chunk) whose far blocks straddle staging chunks:
    each row's (out, lse) equals dense attention over exactly its first far_blocks(...) blocks, for
    every layer; rows before the window get lse -inf; pins are dropped when requests finish."""
    window = random.choice([BS, 3 * BS + 5, 5 * BS])
    config = load_config(write_config(tmp_path, window=window, staging_blocks=staging_blocks), env={})
    layout = BlockLayout(H, BS, D, torch.float32)
    store = VllmKVStore(config, layout, NAMES, "hot-model", "cpu")
    caches = {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}
    store.register(caches)
    far = FarKV(store, window)
    lengths = {"a": 30 * BS + 3, "b": 17 * BS, "c": 2}     # tokens before this step
    new_tokens = {"a": 1, "b": 5, "c": 3}
    ids = {"a": list(range(0, 31)), "b": list(range(31, 48)), "c": [48]}
    try:
        for req, n in lengths.items():
            prompt = [random.randrange(1000) for _ in range(n)]
            hashes = store.extend_hashes([], prompt, n // BS)
            if hashes:
                for name in NAMES:
                    store.save_layer(store.layer_index[name], caches[name], [BlockSpan(req, ids[req][: len(hashes)], hashes)])
            far.add_hashes(req, 0, hashes)
        store.poll(wait=True)
        rows = far.begin_step([(r, lengths[r], new_tokens[r]) for r in ("b", "a", "c")])
        assert [r.num_far_blocks for r in rows] == [far_blocks(lengths[r], window, BS) for r in ("b", "a", "c")]
        assert rows[2].num_far_blocks == 0
        q = torch.randn(sum(new_tokens.values()), HQ, D)
        scale = 1 / math.sqrt(D)
        for name in NAMES:
            layer = store.layer_index[name]
            far.prefetch(layer)
            out, lse = far.attend(layer, q, scale)
            assert torch.isfinite(out).all()
            for row in rows:
                q_row = slice(row.q_start, row.q_end)
                if row.num_far_blocks == 0:
                    assert torch.isneginf(lse[q_row]).all() and not out[q_row].any()
                    continue
                block_ids = torch.tensor(ids[row.req_id][: row.num_far_blocks])
                blocks = store.paged.read(caches[name], block_ids)
                want_out, want_lse = dense(q[q_row], blocks, scale)
                torch.testing.assert_close(out[q_row].double(), want_out, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(lse[q_row].double(), want_lse, rtol=1e-5, atol=1e-5)
        far.end_step()
        assert sum(store.cpu._pins.values()) > 0  # the window's landed saves
        # the far blocks, saved by this request, are pinned whole: their saves' per-key pins were given back
        assert len(store.cpu._pin_state.blocks.pins) == sum(r.num_far_blocks for r in rows)
        assert not any(k in store.saves._pins for r in rows for layer in range(LAYERS)
                       for k in store.keys(far.requests[r.req_id].hashes[:r.num_far_blocks], layer))
        for req in lengths:
            far.finish(req)
        store.poll(wait=True)
        assert sum(store.cpu._pins.values()) == 0
        # far blocks are pinned whole (their saves' per-key pins given back then): none left either
        assert store.cpu._pin_state.blocks is not None and not store.cpu._pin_state.blocks.pins
        stats = far.stats()
        assert stats["far_blocks_read"] == LAYERS * sum(r.num_far_blocks for r in rows)
        per_layer = -(-sum(r.num_far_blocks for r in rows) // far.pool.region_blocks)
        assert stats["prefetch"]["layers"]["chunks"] == [per_layer] * LAYERS  # every chunk reported to the recorder
    finally:
        far.close()
        store.close()


def far_with_saved_requests(tmp_path, window: int, staging_blocks: int, lengths: dict[str, int],
                            ids: dict[str, list[int]], sparse_tokens: int = 0):
    """(store, vLLM caches, FarKV) with each request's full blocks of `lengths[req]` random tokens
    saved from vLLM block ids `ids[req]` on every layer (and summarized, as the connector does
    under the sparse policy), its hashes sent, the saves landed."""
    config = load_config(write_config(tmp_path, window=window, staging_blocks=staging_blocks,
                                      sparse_tokens=sparse_tokens), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    caches = {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}
    store.register(caches)
    far = FarKV(store, window)
    for req, n in lengths.items():
        hashes = store.extend_hashes([], [random.randrange(1000) for _ in range(n)], n // BS)
        far.add_hashes(req, 0, hashes)
        for name in NAMES:
            spans = [BlockSpan(req, ids[req][: len(hashes)], hashes)]
            far.summarize(store.layer_index[name], spans, store.save_layer(store.layer_index[name], caches[name], spans))
    store.poll(wait=True)
    return store, caches, far


def test_prefill_rows_attend_each_staging_chunk_with_the_given_dense_kernel(tmp_path):
    """A prefill row of at least MIN_QUERIES queries goes through `dense` (the vLLM backend passes
    vLLM's FlashAttention) over each staging chunk gathered into contiguous K, V; a decoding row
    of the same step does not. The merged result is dense attention over the row's far blocks."""
    from tierkv.attention.flash import MIN_QUERIES

    lengths, new_tokens = {"p": 20 * BS + 7, "d": 12 * BS}, {"p": MIN_QUERIES + random.randrange(9), "d": 1}
    ids = {"p": list(range(0, 21)), "d": list(range(21, 33))}
    store, caches, far = far_with_saved_requests(tmp_path, 2 * BS, 10, lengths, ids)
    calls = []

    def dense_kernel(q, k, v, scale):
        calls.append((q.shape[0], k.shape[0]))
        k = k.double().repeat_interleave(HQ // H, dim=1)
        v = v.double().repeat_interleave(HQ // H, dim=1)
        scores = torch.einsum("nhd,khd->nhk", q.double(), k) * scale
        return torch.einsum("nhk,khd->nhd", torch.softmax(scores, dim=-1), v).float(), torch.logsumexp(scores, -1).float()

    try:
        rows = far.begin_step([(r, lengths[r], new_tokens[r]) for r in ("d", "p")])
        q = torch.randn(sum(new_tokens.values()), HQ, D)
        for name in NAMES:
            layer = store.layer_index[name]
            far.prefetch(layer)
            calls.clear()
            out, lse = far.attend(layer, q, 0.3, dense=dense_kernel)
            prefill = rows[1]
            assert calls and all(nq == new_tokens["p"] for nq, _ in calls)           # the decoding row never
            assert sum(nk for _, nk in calls) == prefill.num_far_blocks * BS          # every far key once
            region, first = far.pool.region_blocks, rows[0].num_far_blocks
            assert len(calls) == -(-(first + prefill.num_far_blocks) // region) - first // region  # one per chunk it spans
            assert_rows_equal_dense(out, lse, rows, q, store.paged.read, caches[name], ids, 0.3)
        far.end_step()
    finally:
        far.close()
        store.close()


@pytest.mark.parametrize("rows", [["p"], ["d", "p"]])
def test_merge_with_near_equals_merging_the_assembled_far_part(tmp_path, rows):
    """The backend's merge (`far_attention.merge_with_near`): one pass over near and every far chunk when the step is
    one row, the assembled far part otherwise; both equal the two-stage merge of near with `attend`."""
    from tierkv.attention import merge_partials
    from tierkv.integrations.vllm.far_attention import assemble_rows, merge_with_near

    lengths = {r: n for r, n in {"p": 20 * BS + 7, "d": 12 * BS}.items() if r in rows}
    new_tokens = {"p": 9, "d": 1}
    ids = {"p": list(range(0, 21)), "d": list(range(21, 33))}
    store, _, far = far_with_saved_requests(tmp_path, 2 * BS, 6, lengths, ids)
    try:
        far.begin_step([(r, lengths[r], new_tokens[r]) for r in rows])
        n = sum(new_tokens[r] for r in rows)
        q = torch.randn(n, HQ, D)
        near = (torch.randn(n, HQ, D), torch.randn(n, HQ))
        for name in NAMES:
            layer = store.layer_index[name]
            far.prefetch(layer)
            parts = far.attend_parts(layer, q, 0.3)
            assert sorted(parts) == list(range(len(rows))) and max(len(p) for p in parts.values()) > 1  # chunks to merge
            got = torch.full((n, HQ, D), float("nan"), dtype=torch.bfloat16)
            merge_with_near(got, *near, far.rows, parts)
            want = merge_partials([near, assemble_rows(far.rows, parts, q.shape, q.device)])[0]
            torch.testing.assert_close(got, want.to(torch.bfloat16))
        far.end_step()
    finally:
        far.close()
        store.close()


@pytest.mark.parametrize("rows", [["p"], ["d", "p"], ["d", "s"]])
def test_attend_into_writes_the_merge_of_near_and_far(tmp_path, rows):
    """What the backend calls (`attend_into`) writes, for every row, the merge of its near part with
    its far blocks; a row without far blocks ("s", shorter than the window) gets its near part."""
    from tierkv.attention import merge_partials
    from tierkv.integrations.vllm.far_attention import assemble_rows, merge_with_near

    lengths = {r: n for r, n in {"p": 20 * BS + 7, "d": 12 * BS, "s": BS}.items() if r in rows}
    new_tokens = {"p": 9, "d": 1, "s": 1}
    ids = {"p": list(range(0, 21)), "d": list(range(21, 33)), "s": list(range(33, 34))}
    store, _, far = far_with_saved_requests(tmp_path, 2 * BS, 6, lengths, ids)
    try:
        n = sum(new_tokens[r] for r in rows)
        q = torch.randn(n, HQ, D)
        near = (torch.randn(n, HQ, D), torch.randn(n, HQ))
        got, want = {}, {}
        for into in (True, False):  # the same step twice: attend_into, then the far part alone
            far.begin_step([(r, lengths[r], new_tokens[r]) for r in rows])
            for name in NAMES:
                layer = store.layer_index[name]
                far.prefetch(layer)
                if into:
                    got[name] = torch.full((n, HQ, D), float("nan"), dtype=torch.bfloat16)
                    far.attend_into(got[name], layer, q, *near, 0.3)
                else:
                    want[name] = merge_partials([near, far.attend(layer, q, 0.3)])[0].to(torch.bfloat16)
            far.end_step()
        for name in NAMES:
            torch.testing.assert_close(got[name], want[name])
            if "s" in rows:
                torch.testing.assert_close(got[name][-1:], near[0][-1:].to(torch.bfloat16))
    finally:
        far.close()
        store.close()


def test_the_far_split_is_what_vllm_frees_under_a_sliding_window():
    """vLLM frees blocks [0, skipped // block_size) of a sliding-window layer (skipped computed by its
    own SlidingWindowManager); tierkv reads exactly those from the tiers and everything after from vLLM."""
    for _ in range(200):
        window, bs, computed = random.randint(1, 300), random.choice([1, 16, 64]), random.randint(0, 5000)
        skipped = SlidingWindowManager.get_num_skipped_tokens(SimpleNamespace(sliding_window=window), computed)
        assert far_blocks(computed, window, bs) == skipped // bs


def test_missing_hashes_and_a_mismatched_batch_are_clear_errors(tmp_path):
    config = load_config(write_config(tmp_path, window=BS, staging_blocks=8), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    far = FarKV(store, BS)
    try:
        with pytest.raises(RuntimeError, match="no block hashes were sent"):
            far.begin_step([("x", 10 * BS, 1)])
        far.add_hashes("y", 0, ["h0"])
        with pytest.raises(RuntimeError, match="hashes of only 1"):
            far.begin_step([("y", 10 * BS, 1)])
        with pytest.raises(ValueError, match="only 1 are known"):
            far.add_hashes("y", 3, ["h3"])
        with pytest.raises(RuntimeError, match="4 of 4 are in no tier"):  # hashes known, blocks never saved
            far.add_hashes("z", 0, [f"h{i}" for i in range(4)])
            far.begin_step([("z", 4 * BS + BS, 1)])
        with pytest.raises(RuntimeError, match="differ"):
            hot_window.rows_in_order(["a", "b"], {"a": (0, 1)})
    finally:
        far.close()
        store.close()


def test_near_tables_start_each_row_past_its_far_blocks(tmp_path):
    config = load_config(write_config(tmp_path, window=2 * BS, staging_blocks=8), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    far = FarKV(store, 2 * BS)
    try:
        from tierkv.integrations.vllm.far_step import FarRow

        rows = [FarRow("a", 0, 1, 10 * BS, 8), FarRow("b", 1, 4, BS, 0)]
        table = torch.arange(2 * 12, dtype=torch.int32).view(2, 12)
        meta = SimpleNamespace(block_table=table, seq_lens=torch.tensor([10 * BS + 1, BS + 3], dtype=torch.int32),
                               num_actual_tokens=4, max_seq_len=10 * BS + 1)
        step = hot_window.HotWindowStep(far, rows, store.layer_index)
        near_table, seqused_k, max_k = step.near(meta)
        assert near_table[0, :3].tolist() == [8, 9, 10] and near_table[1, :3].tolist() == [12, 13, 14]
        assert seqused_k.tolist() == [2 * BS + 1, BS + 3] and max_k == 2 * BS + 1
        assert step.near(meta)[0] is near_table  # built once per step
        # the next step, same far parts: the kept column index serves it; a grown far part rebuilds it
        kept = far.near_index
        meta2 = SimpleNamespace(**{**vars(meta), "seq_lens": meta.seq_lens + 1, "max_seq_len": 10 * BS + 2})
        rows2 = [FarRow("a", 0, 1, 10 * BS + 1, 8), FarRow("b", 1, 4, BS + 1, 0)]
        near2, seqused2, _ = hot_window.HotWindowStep(far, rows2, store.layer_index).near(meta2)
        assert far.near_index is kept and seqused2.tolist() == [2 * BS + 2, BS + 4]
        assert torch.equal(near2, near_table)
        rows3 = [FarRow("a", 0, 1, 11 * BS, 9), FarRow("b", 1, 4, BS + 1, 0)]
        meta3 = SimpleNamespace(**{**vars(meta), "seq_lens": torch.tensor([11 * BS + 1, BS + 4], dtype=torch.int32),
                                   "max_seq_len": 11 * BS + 1})
        near3, seqused3, max3 = hot_window.HotWindowStep(far, rows3, store.layer_index).near(meta3)
        assert far.near_index is not kept
        assert near3[0, :3].tolist() == [9, 10, 11] and near3[1, :3].tolist() == [12, 13, 14]
        assert seqused3.tolist() == [2 * BS + 1, BS + 4] and max3 == 2 * BS + 1
        with pytest.raises(RuntimeError, match="does not match"):
            hot_window.HotWindowStep(far, rows, store.layer_index).near(SimpleNamespace(**{**vars(meta), "num_actual_tokens": 5}))
    finally:
        far.close()
        store.close()


def test_plugin_turns_full_attention_into_the_hot_window_spec_and_shrinks_the_pool(tmp_path):
    """With the tierkv connector and backend CUSTOM a layer declares SlidingWindowSpec(window); vLLM's
    per-request admission at max_model_len 131072 then needs the window plus one prefill chunk."""
    hot_window.register()
    hot_window.register()  # idempotent
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CUSTOM.get_path() == hot_window.BACKEND_PATH
    backend = AttentionBackendEnum.CUSTOM.get_class()
    from tierkv.integrations.vllm.backend import HotWindowBackend

    assert backend.get_name() == "CUSTOM" and backend is HotWindowBackend
    assert f"{backend.__module__}.{backend.__qualname__}" == hot_window.BACKEND_PATH  # vLLM resolves it by this path
    window = 4096
    config_file = write_config(tmp_path, window=window, staging_blocks=8)
    layer = SimpleNamespace(attn_type="decoder", kv_cache_dtype="auto", sliding_window=None, num_kv_heads=8,
                            head_size=128, head_size_v=128, kv_cache_torch_dtype=torch.bfloat16, attn_backend=backend)
    spec = Attention.get_kv_cache_spec(layer, vllm_config(config_file))
    assert type(spec) is SlidingWindowSpec and spec.sliding_window == window and spec.block_size == BS
    full = FullAttentionSpec(block_size=BS, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    hot_blocks = spec.max_admission_blocks_per_request(8192, 131072)
    full_blocks = -(-131072 // BS)
    assert hot_blocks * spec.page_size_bytes * 32 < 2 * 1024**3 <= 16 * 1024**3 <= full_blocks * full.page_size_bytes * 32
    plain = SimpleNamespace(**{**vars(layer), "attn_backend": SimpleNamespace(get_name=lambda: "FLASH_ATTN")})
    assert type(Attention.get_kv_cache_spec(plain, vllm_config(config_file))) is FullAttentionSpec
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    no_tierkv = VllmConfig(cache_config=CacheConfig(block_size=BS), device_config=DeviceConfig(device="cpu"))
    with pytest.raises(RuntimeError, match="must name kv_connector"):
        Attention.get_kv_cache_spec(layer, no_tierkv)


def test_tensor_parallel_needs_the_installed_plugin():
    """Under tensor parallelism vLLM's workers load the backend only through the entry point."""
    from tierkv.integrations.vllm.engine_args import PLUGIN_ENTRY_POINT, require_plugin_installed

    require_plugin_installed([SimpleNamespace(value=PLUGIN_ENTRY_POINT)])
    with pytest.raises(RuntimeError, match="tensor_parallel_size > 1"):
        require_plugin_installed([SimpleNamespace(value="other.plugin:register")])
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["vllm.general_plugins"]["tierkv_hot_window"] == PLUGIN_ENTRY_POINT


def hot_kv_cache_config(window: int) -> KVCacheConfig:
    spec = SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32, sliding_window=window)
    tensors = [KVCacheTensor(size=NUM_BLOCKS * spec.page_size_bytes, shared_by=[n]) for n in NAMES]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=NAMES, kv_cache_spec=spec)])


def test_connector_sends_positions_hashes_and_finished_requests_under_the_hot_window(tmp_path):
    window = 2 * BS
    config_file = write_config(tmp_path, window=window, staging_blocks=8)
    connector = TierKVConnector(vllm_config(config_file), KVConnectorRole.SCHEDULER, hot_kv_cache_config(window))
    try:
        assert connector.hot_window == window
        prompt = [random.randrange(1000) for _ in range(5 * BS + 3)]
        req = make_request("r1", prompt)
        assert connector.get_num_new_matched_tokens(req, 0) == (0, False)  # nothing in the tiers yet
        out = schedule(req, list(range(6)), 0)
        meta = pickle.loads(pickle.dumps(connector.build_connector_meta(out)))
        assert isinstance(meta, TierKVMetadata)
        assert meta.scheduled == {"r1": (0, 5 * BS + 3)} and meta.finished == []
        assert meta.prompt_steps == ["r1"]  # the prompt's prefill: exact under any policy
        assert [len(s.block_ids) for s in meta.saves] == [5]
        assert meta.hashes == [("r1", 0, meta.saves[0].hashes)]  # the blocks this step fills, sent once
        req.num_computed_tokens = 5 * BS + 3
        req.append_output_token_ids(7)
        cached = CachedRequestData.make_empty()
        cached.req_ids, cached.num_computed_tokens, cached.new_block_ids = ["r1"], [5 * BS + 3], [None]
        out2 = schedule(req, [], 0)
        out2.scheduled_new_reqs, out2.scheduled_cached_reqs = [], cached
        out2.num_scheduled_tokens, out2.finished_req_ids = {"r1": 1}, {"r0"}
        meta2 = connector.build_connector_meta(out2)
        assert meta2.scheduled == {"r1": (5 * BS + 3, 1)} and meta2.finished == ["r0"] and meta2.hashes == []
        assert meta2.prompt_steps == []  # a generated token: decode
    finally:
        connector.shutdown()


def test_tieredllm_engine_arguments_of_the_hot_window(tmp_path):
    """The pool vLLM is given is the GPU budget minus the staging ring; a budget that leaves no pool
    is a config error naming the key."""
    from tierkv.config import ConfigError
    from tierkv.integrations.vllm.engine_args import hot_window_engine_args

    config = load_config({"cache": {"block_tokens": BS, "gpu_budget_bytes": "2GiB", "window_tokens": 4096},
                          "scheduler": {"staging_bytes": "256MiB", "prefill_chunk_tokens": 8192}}, env={})
    args = hot_window_engine_args(config)
    assert args["attention_config"] == {"backend": "CUSTOM"} and args["kv_cache_memory_bytes"] == (2048 - 256) << 20
    assert args["max_num_batched_tokens"] == 8192 and args["enable_prefix_caching"] is False
    assert args["async_scheduling"] is False  # vLLM's async scheduling only when the config asks
    asked = load_config({"cache": {"block_tokens": BS, "gpu_budget_bytes": "2GiB", "window_tokens": 4096},
                         "scheduler": {"staging_bytes": "256MiB", "vllm_async_scheduling": True}}, env={})
    assert hot_window_engine_args(asked)["async_scheduling"] is True
    tight = load_config({"cache": {"gpu_budget_bytes": "256MiB"}, "scheduler": {"staging_bytes": "256MiB"}}, env={})
    with pytest.raises(ConfigError, match="cache.gpu_budget_bytes"):
        hot_window_engine_args(tight)
    # the sparse policy's key summaries come out of the same budget
    assert hot_window_engine_args(config, 256 << 20)["kv_cache_memory_bytes"] == (2048 - 256 - 256) << 20
    with pytest.raises(ConfigError, match=r"cache.gpu_budget_bytes.*sparse key summaries \(1.75 GiB\)"):
        hot_window_engine_args(config, 1792 << 20)


def _checkpoint(tmp_path, **fields) -> str:
    shape = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
             "max_position_embeddings": 131072, **fields}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in shape.items() if v is not None}))
    return str(tmp_path)


def fake_vllm_llm(monkeypatch) -> dict:
    """vllm.LLM replaced by a stand-in with what VllmTieredLLM reads of vLLM's engine; returns the dict
    its constructor's keyword arguments go into. TieredLLM's environment variables restored after."""
    import vllm

    given = {}

    class FakeLLM(FakeEngineBase):
        def __init__(self, **kwargs):
            given.update(kwargs)
            super().__init__(**kwargs)

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):  # the start-up warm-up's forwards
            given.setdefault("rpc", []).append((method, args))
            return super().collective_rpc(method, timeout, args, kwargs)

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER"):  # set by TieredLLM: restored after
        monkeypatch.setenv(name, "0")
    return given


def test_tieredllm_sparse_engine_reserves_summaries_at_the_length_vllm_runs_with(tmp_path, monkeypatch):
    """TieredLLM(backend="vllm") under the sparse policy: vLLM's pool is the budget minus staging and
    the summaries of max_num_seqs requests, and without max_model_len vLLM is given the checkpoint's
    max_position_embeddings, the length the summaries were reserved for."""
    from tierkv.integrations.vllm.llm import VllmTieredLLM

    given = fake_vllm_llm(monkeypatch)
    model = _checkpoint(tmp_path, max_position_embeddings=32768)
    config = {"cache": {"block_tokens": 64, "gpu_budget_bytes": "2GiB"},
              "scheduler": {"policy": "sparse", "staging_bytes": "256MiB"}}
    llm = VllmTieredLLM(model, config, max_num_seqs=2)
    try:
        per_request = 32768 // 64 * 32 * 2 * 8 * 128 * 2  # 64 MiB
        assert llm.summary_reserved_bytes == 2 * per_request and given["max_model_len"] == 32768
        assert given["kv_cache_memory_bytes"] == (2048 - 256) * 2**20 - 2 * per_request
        assert llm.stats()["summary_reserved_bytes"] == 2 * per_request
    finally:
        llm.close()
    written = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(ValueError, match="max_num_seqs: got None"):
        VllmTieredLLM(model, config)
    assert not {f for f in set(os.listdir(tempfile.gettempdir())) - written if f.startswith("tierkv-vllm-")}


def test_sparse_key_summaries_are_sized_from_the_checkpoint_and_max_num_seqs(tmp_path):
    """An 8B Llama shape at 131072 tokens in 64-token blocks: 2048 blocks x 32 layers x (min, max)
    x 8 KV heads x 128 x 2 bytes = 256 MiB per request; per GPU, the KV heads split over tensor
    parallelism; max_num_seqs and a readable config.json are required."""
    from tierkv.integrations.vllm.pool_sizing import sparse_summary_bytes

    config = load_config({"cache": {"block_tokens": 64}, "scheduler": {"policy": "sparse"}}, env={})
    model = _checkpoint(tmp_path)
    assert sparse_summary_bytes(model, config, 131072, {"max_num_seqs": 3}) == 3 * (256 << 20)
    assert sparse_summary_bytes(model, config, None, {"max_num_seqs": 1, "tensor_parallel_size": 2}) == 128 << 20
    assert sparse_summary_bytes(model, config, 32768, {"max_num_seqs": 1, "dtype": "float32"}) == 128 << 20
    with pytest.raises(ValueError, match="max_num_seqs: got None"):
        sparse_summary_bytes(model, config, 131072, {})
    with pytest.raises(ValueError, match="num_hidden_layers=None"):
        sparse_summary_bytes(_checkpoint(tmp_path, num_hidden_layers=None), config, 131072, {"max_num_seqs": 1})
    with pytest.raises(ValueError, match="max_model_len: not given"):
        sparse_summary_bytes(_checkpoint(tmp_path, max_position_embeddings=None), config, None, {"max_num_seqs": 1})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json cannot be read as JSON"):
        sparse_summary_bytes(model, config, 131072, {"max_num_seqs": 1})


class _Runner:  # what the backend reads of vLLM's model runner: the batch's request order
    def __init__(self, req_ids):
        self.input_batch = SimpleNamespace(req_ids=list(req_ids), num_reqs=len(req_ids))


def test_a_repeated_prefix_loads_only_the_window_and_reads_the_rest_from_the_tiers(tmp_path):
    """vLLM's own KV cache manager with the hot-window spec gives a prefix found in the tiers null
    blocks before the window; the connector loads only the window's blocks into vLLM's pool, and
    the far part of the same step reads the blocks before it from the tiers, bit-exactly."""
    import weakref

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    window = 4 * BS
    # one engine: its scheduler side sees the worker's CPU tier
    worker, scheduler, caches = hot_connectors(tmp_path, window=window, staging_blocks=5)
    kv_config = hot_kv_cache_config(window)
    store = worker.store
    prompt = [random.randrange(1000) for _ in range(10 * BS + 3)]
    hashes = store.extend_hashes([], prompt, 10)
    saved_ids = list(range(40, 50))
    try:
        for name in NAMES:  # an earlier request computed the prompt's 10 full blocks
            store.save_layer(store.layer_index[name], caches[name], [BlockSpan("earlier", saved_ids, hashes)])
        store.poll(wait=True)
        original = {n: store.paged.read(caches[n], torch.tensor(saved_ids)) for n in NAMES}
        req = make_request("again", prompt)
        matched, _ = scheduler.get_num_new_matched_tokens(req, 0)
        assert matched == 10 * BS
        manager = KVCacheManager(kv_config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                                 max_in_flight_tokens=256, enable_caching=False)
        assert manager.allocate_slots(req, len(prompt) - matched, num_external_computed_tokens=matched) is not None
        row = manager.get_blocks(req.request_id)
        scheduler.update_state_after_alloc(req, row, matched)
        out = schedule(req, row.get_block_ids()[0], matched)
        meta = pickle.loads(pickle.dumps(scheduler.build_connector_meta(out)))
        first_resident = far_blocks(matched, window, BS)
        (load,) = meta.loads
        assert load.hashes == hashes[first_resident:10] and 0 not in load.block_ids
        assert meta.scheduled == {"again": (matched, len(prompt) - matched)} and meta.prompt_steps == ["again"]
        runner = _Runner(["again"])
        hot_window._STATE["runner"] = weakref.ref(runner)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        step = hot_window.current_step()
        assert [r.num_far_blocks for r in step.rows] == [first_resident]
        q = torch.randn(len(prompt) - matched, HQ, D)
        for name in NAMES:
            worker.wait_for_layer_load(name)
            loaded = store.paged.read(caches[name], torch.tensor(load.block_ids))
            assert torch.equal(loaded, original[name][first_resident:])
            out_far, lse_far = step.far.attend(store.layer_index[name], q, 0.3)
            want_out, want_lse = dense(q, original[name][:first_resident], 0.3)
            torch.testing.assert_close(out_far.double(), want_out, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(lse_far.double(), want_lse, rtol=1e-5, atol=1e-5)
        worker.wait_for_save()
        assert hot_window.current_step() is None
    finally:
        hot_window._STATE["runner"] = None
        worker.shutdown()
        scheduler.shutdown()


def _sparse_setup(tmp_path, sparse_tokens: int, window: int, num_blocks: int, plant=None, summarize_all=True,
                  sparse_graphs=False, max_model_len=None, storage_dtype="auto"):
    """A store, a sparse FarKV and one request of `num_blocks` saved blocks (keys near zero but for
    the `plant` blocks, whose keys align with +q); returns (far, store, caches, ids, q)."""
    config = load_config(write_config(tmp_path, window=window, staging_blocks=6, sparse_tokens=sparse_tokens,
                                      sparse_graphs=sparse_graphs, storage_dtype=storage_dtype), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    caches = {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) * 0.1 for n in NAMES}
    q = torch.randn(1, H, D)
    q = (3 * q / q.norm(dim=-1, keepdim=True)).repeat_interleave(HQ // H, dim=1)  # |q| = 3; a KV group's heads agree
    ids = list(range(num_blocks))
    for b in plant or []:
        for name in NAMES:  # K = 10 q of its group, V random: these blocks carry nearly all the attention
            caches[name][b, :, :, :D] = 10 * q[0, :: HQ // H].unsqueeze(1)
    store.register(caches)
    far = FarKV(store, window, max_model_len=max_model_len)
    hashes = store.extend_hashes([], [random.randrange(1000) for _ in range(num_blocks * BS)], num_blocks)
    far.add_hashes("r", 0, hashes)
    for name in NAMES:
        spans = [BlockSpan("r", ids, hashes)]
        blocks = store.save_layer(store.layer_index[name], caches[name], spans)
        if summarize_all:
            far.summarize(store.layer_index[name], spans, blocks)
    store.poll(wait=True)
    return far, store, caches, ids, q


def test_sparse_with_a_budget_covering_the_context_equals_exact(tmp_path):
    window = 2 * BS
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=64 * BS, window=window, num_blocks=30)
    try:
        (row,) = far.begin_step([("r", 30 * BS, 1)])
        assert far.sparse_rows == [0] and row.num_far_blocks == far_blocks(30 * BS, window, BS)
        for name in NAMES:
            out, lse = far.attend(store.layer_index[name], q, 0.3)
            want_out, want_lse = dense(q, store.paged.read(caches[name], torch.tensor(ids[: row.num_far_blocks])), 0.3)
            torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
        assert far.stats()["sparse_selections"] == LAYERS
    finally:
        far.close()
        store.close()


def test_a_prompts_last_token_is_prefill_exact_under_the_sparse_policy(tmp_path):
    """A one-token step within the prompt (its last token after a cached prefix, a one-token last chunk) is
    prefill: with the request in the step's prompt_steps it streams every far block exactly, where the same
    step as decode reads only the selection."""
    window = 2 * BS
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=2 * BS, window=window, num_blocks=30)
    try:
        (row,) = far.begin_step([("r", 30 * BS, 1)], prompt_steps={"r"})
        assert far.sparse_rows == [] and row.num_far_blocks == far_blocks(30 * BS, window, BS)
        for name in NAMES:
            out, lse = far.attend(store.layer_index[name], q, 0.3)
            want_out, want_lse = dense(q, store.paged.read(caches[name], torch.tensor(ids[: row.num_far_blocks])), 0.3)
            torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
        far.end_step()
        far.begin_step([("r", 30 * BS, 1)])  # the same step as a generated token: sparse
        assert far.sparse_rows == [0]
    finally:
        far.close()
        store.close()


def test_key_summaries_stay_within_the_bytes_reserved_for_a_request_of_max_model_len(tmp_path):
    """The summary tables grow by doubling, but never past the blocks of the engine's longest
    request: what `summary_bytes_per_request` reserves in the GPU budget is what they take."""
    from tierkv.sparse.request_summaries import summary_bytes_per_request

    for max_model_len, table_blocks in ((42 * BS, 42), (None, 64)):  # one update of 42 blocks: 64 rows uncapped
        far, store, *_ = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=2 * BS, num_blocks=42,
                                       max_model_len=max_model_len)
        try:
            tables = far.requests["r"].summaries.summaries.tables
            assert [t.shape[0] for t in tables] == [table_blocks] * LAYERS
            if max_model_len is not None:
                assert far.stats()["summary_bytes"] == summary_bytes_per_request(max_model_len, BS, LAYERS, H, D, 4)
        finally:
            far.close()
            store.close()


def test_sparse_selection_finds_planted_blocks_and_reads_only_the_budget(tmp_path):
    """A 4-block budget over 40 far blocks: the selection holds the 3 planted blocks, and the output
    is within 1e-2 of dense attention over all far blocks; sinks + nothing else would not be."""
    window = 2 * BS
    plant = random.sample(range(1, 38), 3)
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=window, num_blocks=42, plant=plant)
    try:
        (row,) = far.begin_step([("r", 42 * BS, 1)])
        assert row.num_far_blocks == 40
        for name in NAMES:
            layer = store.layer_index[name]
            selected = far.key_summaries.select(far.requests["r"], layer, q[0], row.num_far_blocks).tolist()
            assert len(selected) == 4 and set(plant) <= set(selected)
            before = far.counts["far_blocks_read"]
            out, _ = far.attend(layer, q, 0.3)
            assert far.counts["far_blocks_read"] - before == 4
            want, _ = dense(q, store.paged.read(caches[name], torch.tensor(ids[:40])), 0.3)
            err = (out.double() - want).norm() / want.norm()
            assert err < 1e-2, f"relative error {err:.2e} with the planted blocks selected"
    finally:
        far.close()
        store.close()


def test_the_selection_never_drops_a_block_it_has_no_summary_of(tmp_path):
    """Blocks served by the tiers without being computed here (a loaded prefix) have no key summary:
    the selection itself keeps them beside the budget, never dropped on a guess (`FarKV` streams
    such a row exactly, which gives them summaries, before it selects: the next tests)."""
    window = 2 * BS
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=2 * BS, window=window, num_blocks=20,
                                               summarize_all=False)
    try:
        (row,) = far.begin_step([("r", 20 * BS, 1)])
        layer = 0
        assert far.key_summaries.select(far.requests["r"], layer, q[0], row.num_far_blocks).tolist() == list(range(row.num_far_blocks))
        spans = [BlockSpan("r", ids[:10], far.requests["r"].hashes[:10])]
        far.summarize(layer, spans, store.paged.read(caches[NAMES[0]], torch.tensor(ids[:10])))
        selected = far.key_summaries.select(far.requests["r"], layer, q[0], row.num_far_blocks).tolist()
        assert set(range(10, row.num_far_blocks)) <= set(selected) and len(selected) == row.num_far_blocks - 10 + 2
    finally:
        far.close()
        store.close()


def test_a_prefix_without_summaries_is_streamed_exactly_once_then_selected_like_the_rest(tmp_path):
    """A request whose far blocks the tiers served (no summaries): its first decode step streams
    every far block through the lookahead ring, as prefill does, so its output is exact and the
    streamed chunks leave the summaries (equal to those the connector makes from saved blocks);
    the next step attends only the budget, planted blocks found, with no stall beyond its fetch."""
    window = 2 * BS
    plant = random.sample(range(1, 38), 3)
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=window, num_blocks=42, plant=plant,
                                               summarize_all=False)
    try:
        assert far.requests["r"].summaries is None
        for step in range(2):
            (row,) = far.begin_step([("r", 42 * BS + step, 1)])
            assert row.num_far_blocks == 40 and far.sparse_rows == ([] if step == 0 else [0])
            for name in NAMES:
                layer = store.layer_index[name]
                far.prefetch(layer)
                read, stalls = far.counts["far_blocks_read"], far.sparse_streamer.num_stalls
                out, _ = far.attend(layer, q, 0.3)
                assert far.counts["far_blocks_read"] - read == (40 if step == 0 else 4)
                region = far.sparse_streamer.pool.region_blocks
                assert far.sparse_streamer.num_stalls - stalls == (0 if step == 0 else -(-4 // region))
                summaries = far.requests["r"].summaries
                assert summaries.prefix[layer] == 40 and summaries.is_summarized[layer][:40].all()
                want, _ = dense(q, store.paged.read(caches[name], torch.tensor(ids[:40])), 0.3)
                err = (out.double() - want).norm() / want.norm()
                assert err < (1e-5 if step == 0 else 1e-2), f"step {step}: relative error {err:.2e}"
                if step == 1:
                    selected = far.key_summaries.select(far.requests["r"], layer, q[0], row.num_far_blocks).tolist()
                    assert len(selected) == 4 and set(plant) <= set(selected)
                # the summaries equal those the connector makes from the saved blocks
                want_table = type(summaries.summaries)(LAYERS, H, D, torch.float32, torch.device("cpu"))
                want_table.update(layer, 0, store.paged.read(caches[name], torch.tensor(ids[:40])).view(40, *store.layout.shape))
                torch.testing.assert_close(summaries.summaries.tables[layer][:40], want_table.tables[layer][:40])
            far.end_step()
    finally:
        far.close()
        store.close()


def test_a_few_far_blocks_without_summaries_are_fetched_and_summarized_before_selecting(tmp_path):
    """Blocks vLLM loaded into its window from the tiers have no summary when they become far: a
    row missing at most a selection's worth fetches and summarizes just those, then selects (no
    exact stream); the planted blocks, among the missing ones, are found."""
    window = 2 * BS
    plant = [37, 38, 39]
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=window, num_blocks=42, plant=plant,
                                               summarize_all=False)
    try:
        hashes = far.requests["r"].hashes
        for name in NAMES:  # all but the last 4 far blocks were computed here
            spans = [BlockSpan("r", ids[:36], hashes[:36])]
            far.summarize(store.layer_index[name], spans, store.paged.read(caches[name], torch.tensor(ids[:36])))
        for step in range(2):
            (row,) = far.begin_step([("r", 42 * BS + step, 1)])
            assert row.num_far_blocks == 40 and far.sparse_rows == [0] and not far._pieces
            for name in NAMES:
                layer = store.layer_index[name]
                stalls = far.sparse_streamer.num_stalls
                out, _ = far.attend(layer, q, 0.3)
                region = far.sparse_streamer.pool.region_blocks
                fetched = (-(-4 // region) if step == 0 else 0) + -(-4 // region)  # the 4 missing, then the selection
                assert far.sparse_streamer.num_stalls - stalls == fetched
                assert far.requests["r"].summaries.prefix[layer] == 40
                assert set(plant) <= set(far.key_summaries.select(far.requests["r"], layer, q[0], 40).tolist())
                want, _ = dense(q, store.paged.read(caches[name], torch.tensor(ids[:40])), 0.3)
                assert (out.double() - want).norm() / want.norm() < 1e-2
            far.end_step()
    finally:
        far.close()
        store.close()


def test_a_prefill_streaming_unsummarized_far_blocks_summarizes_them(tmp_path):
    """A prefill row after a served prefix streams every far block exactly; it leaves their
    summaries behind, so the request's decode selects without fetching them again."""
    window = 2 * BS
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=window, num_blocks=42,
                                               summarize_all=False)
    try:
        (row,) = far.begin_step([("r", 42 * BS, 9)])  # a prefill chunk: exact, streamed
        assert row.num_far_blocks == 40 and far.sparse_rows == []
        for name in NAMES:
            layer = store.layer_index[name]
            far.prefetch(layer)
            far.attend(layer, torch.randn(9, HQ, D), 0.3)
            assert far.requests["r"].summaries.prefix[layer] == 40
        far.end_step()
        (row,) = far.begin_step([("r", 42 * BS + 9, 1)])
        stalls = far.sparse_streamer.num_stalls
        for name in NAMES:
            far.attend(store.layer_index[name], q, 0.3)
        region = far.sparse_streamer.pool.region_blocks
        assert far.sparse_streamer.num_stalls - stalls == LAYERS * -(-4 // region)  # the 4 selected, per layer
        far.end_step()
    finally:
        far.close()
        store.close()


def hot_connectors(tmp_path, *, window: int, staging_blocks: int, **config):
    """A worker and a scheduler connector of one engine under the hot window (`write_config`'s other
    settings in `config`), and the worker's vLLM pools: (worker, scheduler, caches). Shut both down after."""
    engine = vllm_config(write_config(tmp_path, window=window, staging_blocks=staging_blocks, **config))
    kv_config = hot_kv_cache_config(window)
    worker = TierKVConnector(engine, KVConnectorRole.WORKER, kv_config)
    scheduler = TierKVConnector(engine, KVConnectorRole.SCHEDULER, kv_config)
    caches = {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}
    worker.register_kv_caches(caches)
    return worker, scheduler, caches


def sparse_connectors(tmp_path):
    """A worker and a scheduler connector under the sparse policy (a 2-block window), and the worker's
    vLLM pools: (worker, scheduler, caches). Shut both down after."""
    return hot_connectors(tmp_path, window=2 * BS, staging_blocks=6, sparse_tokens=2 * BS)


def step_one_request(worker, scheduler, caches, hooks: bool) -> None:
    """Request "s" (6 full blocks and a token) through one step whose 6 blocks are saved: by the
    per-layer hooks, or (hooks False: a full decode graph's replay runs none) by wait_for_save."""
    import weakref

    runner = _Runner(["s"])
    req = make_request("s", [random.randrange(1000) for _ in range(6 * BS + 1)])
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = scheduler.build_connector_meta(schedule(req, list(range(7)), 0))
    hot_window._STATE["runner"] = weakref.ref(runner)
    try:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for name in NAMES if hooks else ():
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, caches[name], None)
        worker.wait_for_save()
    finally:
        hot_window._STATE["runner"] = None


def assert_six_blocks_summarized(worker, caches) -> None:
    """Request "s"'s blocks 0..5 of every layer have summaries equal to their keys' min and max."""
    summaries = worker._far.requests["s"].summaries
    for name in NAMES:
        layer = worker.store.layer_index[name]
        keys = worker.store.paged.read(caches[name], torch.arange(6))[:, 0]
        torch.testing.assert_close(summaries.summaries.kmin[layer][:6], keys.amin(dim=2))
        torch.testing.assert_close(summaries.summaries.kmax[layer][:6], keys.amax(dim=2))
        assert summaries.prefix[layer] == 6
        assert summaries.is_summarized[layer][:6].all() and summaries.is_summarized_dev[layer][:6].all()


def test_connector_summarizes_the_blocks_it_saves_under_the_sparse_policy(tmp_path):
    worker, scheduler, caches = sparse_connectors(tmp_path)
    try:
        step_one_request(worker, scheduler, caches, hooks=True)
        assert_six_blocks_summarized(worker, caches)
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_the_vllm_backends_stats_become_metrics_lines(tmp_path):
    """What VllmTieredLLM hands its metrics service (store, tiers and hot-window counters) flattens
    into the JSONL lines the dashboard reads."""
    import json

    from tierkv.config import MetricsConfig
    from tierkv.metrics import MetricsService

    config = load_config(write_config(tmp_path, window=BS, staging_blocks=6), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    caches = {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}
    store.register(caches)
    far = FarKV(store, BS)
    hashes = store.extend_hashes([], list(range(6 * BS)), 6)
    far.add_hashes("m", 0, hashes)
    for name in NAMES:
        store.save_layer(store.layer_index[name], caches[name], [BlockSpan("m", list(range(6)), hashes)])
    store.poll(wait=True)
    far.begin_step([("m", 6 * BS, 1)])
    for name in NAMES:
        far.attend(store.layer_index[name], torch.randn(1, HQ, D), 0.3)
    far.end_step()
    path = tmp_path / "m.jsonl"
    service = MetricsService.from_config(MetricsConfig(jsonl_path=str(path)), lambda: {"backend": "vllm", **store.stats()})
    try:
        service.record_request({"prompt_tokens": 6 * BS, "generated_tokens": 1})
    finally:
        service.close()
        far.close()
        store.close()
    last = json.loads(path.read_text().splitlines()[-1])
    figures = json.dumps(last)
    assert "hot_window.far_blocks_read" in figures and "tier.cpu" in figures
    assert "counts.blocks_saved" in figures


def test_sparse_reports_how_much_of_a_selection_the_step_before_selected(tmp_path):
    """The selection overlap between consecutive steps (what a GPU cache of the last selection would
    hit), sampled every OVERLAP_EVERY steps: the same query selects the same blocks, overlap 1."""
    from tierkv.sparse.request_summaries import OVERLAP_EVERY

    window = 2 * BS
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=window, num_blocks=30)
    try:
        assert far.stats()["selection_overlap"] is None
        for _ in range(OVERLAP_EVERY):
            far.begin_step([("r", 30 * BS, 1)])
            for name in NAMES:
                far.attend(store.layer_index[name], q, 0.3)
            far.end_step()
        assert far.counts["steps"] % OVERLAP_EVERY == 0 and far.stats()["selection_overlap"] == 1.0
    finally:
        far.close()
        store.close()


@pytest.mark.parametrize("staging_blocks", [4, 6])
def test_sparse_fetches_leave_the_prefill_rows_streamed_chunks_alone(tmp_path, staging_blocks):
    """A step with a prefill chunk (far blocks streamed ahead through the staging regions) and a
    sparse decode row (its selection fetched when selected): the fetch must not overwrite chunks
    copied ahead for the next layers. With a budget covering every far block both rows equal
    dense attention over their far blocks on every layer."""
    window = 2 * BS
    lengths, ids = {"a": 30 * BS + 3, "b": 17 * BS}, {"a": list(range(0, 31)), "b": list(range(31, 48))}
    store, caches, far = far_with_saved_requests(tmp_path, window, staging_blocks, lengths, ids, sparse_tokens=64 * BS)
    try:
        rows = far.begin_step([("b", lengths["b"], 5), ("a", lengths["a"], 1)])
        assert far.sparse_rows == [1] and far._pieces  # b streamed, a selected
        q = torch.randn(6, HQ, D)
        for name in NAMES:
            layer = store.layer_index[name]
            far.prefetch(layer)
            out, lse = far.attend(layer, q, 0.3)
            assert_rows_equal_dense(out, lse, rows, q, store.paged.read, caches[name], ids, 0.3)
        far.end_step()
    finally:
        far.close()
        store.close()


def cpu_row_caches(far, req):
    """Far-block caches on CPU for one request (the engine makes them only with its CUDA graphs)."""
    from tierkv.sparse.row_caches import RowCaches

    row_caches = RowCaches(1, far.store.num_layers, far.sparse_blocks, far.store.layout.shape,
                           far.store.layout.dtype, torch.device("cpu"))
    req.cache = row_caches.take()
    return row_caches


def counting_inline_copies(monkeypatch, engine) -> list[int]:
    """The blocks each `gather_h2d_inline` call of `engine` copies (pairs with a source slot), in order."""
    copied, inline = [], engine.gather_h2d_inline

    def counted(src, src_slots, dst, dst_slots):
        copied.append(int((src_slots >= 0).sum()))
        inline(src, src_slots, dst, dst_slots)

    monkeypatch.setattr(engine, "gather_h2d_inline", counted)
    return copied


def test_the_graph_body_of_a_sparse_row_equals_the_eager_fetch_path(tmp_path, monkeypatch):
    """What a CUDA graph captures for a decoding row (sparse_rows_body: selection, the copy kernel's
    inline copy of the blocks its far-block cache lacks, attention) gives the eager path's (out,
    lse), and again with nothing copied when the same selection repeats; on CPU the graphs
    themselves are off (they need CUDA and the copy kernel) and `sparse_cuda_graphs` leaves the
    eager path alone."""
    from tierkv.attention import merge_partials, merge_two_into
    from tierkv.sparse.step import sparse_rows_body

    window = 2 * BS
    plant = random.sample(range(1, 38), 3)
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=window, num_blocks=42, plant=plant,
                                               sparse_graphs=True)
    try:
        assert store.config.scheduler.sparse_cuda_graphs
        assert not far.source.graphs_usable() and far.graphs is None and far.stats()["cuda_graphs"] is None
        (row,) = far.begin_step([("r", 42 * BS, 1)])
        k = far.sparse_blocks
        row_caches = cpu_row_caches(far, far.requests["r"])
        copied = counting_inline_copies(monkeypatch, store.io.engine)
        for name in NAMES:
            layer = store.layer_index[name]
            want_out, want_lse = far.attend(layer, q, 0.3)
            for run in range(2):  # the second finds the whole selection in the cache: no copy
                out, lse, selected = sparse_rows_body(far.source, [far.requests["r"]], layer, q,
                                                      torch.tensor([row.num_far_blocks]), row_caches, 0.3)
                assert copied.pop() == (k if run == 0 else 0)
                assert selected.shape == (1, k) and set(plant) <= set(selected[0].tolist())
                torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
            # under vLLM attend_into merges the graph's far part with the row's near part in one launch
            near = (torch.randn(1, HQ, D), torch.randn(1, HQ))
            merged = torch.full((1, HQ, D), float("nan"), dtype=torch.bfloat16)
            merge_two_into(merged, near, (out, lse))
            torch.testing.assert_close(merged, merge_partials([near, (want_out, want_lse)])[0].bfloat16())
        far.end_step()
    finally:
        far.close()
        store.close()


def test_the_graph_body_reads_every_far_block_of_a_row_with_fewer_than_a_selection(tmp_path, monkeypatch):
    """A decoding row with fewer far blocks than k (a short request beside long ones): the graph body
    reads all of them and no other block (ids -1 for the rest, none copied or placed in its cache),
    as the eager path does, and a row of the same batch with more far blocks selects as before. The
    graphs serve such rows now (`servable`)."""
    from tierkv.sparse.step import sparse_rows_body

    window = 2 * BS
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=window, num_blocks=42,
                                               plant=random.sample(range(1, 38), 3), sparse_graphs=True)
    try:
        k = far.sparse_blocks
        short = window + 3 * BS - 1  # tokens before the step: 3 far blocks, k = 4
        (row,) = far.begin_step([("r", short, 1)])
        assert row.num_far_blocks == 3 < k
        row_caches = cpu_row_caches(far, far.requests["r"])
        copied = counting_inline_copies(monkeypatch, store.io.engine)
        for name in NAMES:
            layer = store.layer_index[name]
            want_out, want_lse = far.attend(layer, q, 0.3)
            for run in range(2):
                out, lse, selected = sparse_rows_body(far.source, [far.requests["r"]], layer, q, torch.tensor([3]),
                                                      row_caches, 0.3)
                assert selected.tolist() == [[0, 1, 2, -1]]
                assert copied.pop() == (3 if run == 0 else 0)
                torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
            assert sorted(row_caches.held[far.requests["r"].cache.index, layer].tolist()) == [-1, 0, 1, 2]
        far.end_step()
        assert far.graphs is None  # CPU: the eager path serves; `servable` is the graphs' own check
    finally:
        far.close()
        store.close()


@pytest.mark.parametrize("storage_dtype", ["float8_e4m3fn", "int8"])
def test_sparse_rows_over_a_quantized_cpu_tier(tmp_path, storage_dtype, monkeypatch):
    """A quantized CPU tier (half the bytes per selected block): the selection still holds the planted
    blocks (summaries come from the unquantized blocks the connector saved), the output stays within
    1e-2 of dense attention over the far blocks as the tier holds them (quantized and back: the
    tier's own error is tests/storage/test_quantized_tiers.py's), and the graph body (codes and
    scales of the blocks its cache lacks copied into their buffers and dequantized into the cache, the
    held blocks' stale codes skipped) gives the eager path's result, the first time and when the
    selection repeats and nothing is copied."""
    from tierkv.quant import dequantize_blocks, quantize_blocks
    from tierkv.sparse.step import packed_buffers, sparse_rows_body

    window = 2 * BS
    plant = random.sample(range(1, 38), 3)
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=window, num_blocks=42,
                                               plant=plant, storage_dtype=storage_dtype)
    try:
        assert store.cpu.quant_format == storage_dtype
        (row,) = far.begin_step([("r", 42 * BS, 1)])
        k = far.sparse_blocks
        packed = packed_buffers(far.source, torch.device("cpu"))
        assert packed[0].dtype == torch.uint8 and packed[0].shape[0] == k and packed[1].shape == (k, 2, H)
        assert packed_buffers(far.source, torch.device("cpu"), 3)[0].shape[0] == 3 * k
        row_caches = cpu_row_caches(far, far.requests["r"])
        copied = counting_inline_copies(monkeypatch, store.io.engine)
        for name in NAMES:
            layer = store.layer_index[name]
            out, lse = far.attend(layer, q, 0.3)
            held = store.paged.read(caches[name], torch.tensor(ids[:40]))
            held = dequantize_blocks(*quantize_blocks(held, storage_dtype), storage_dtype, held.dtype)
            want, _ = dense(q, held, 0.3)
            err = (out.double() - want).norm() / want.norm()
            assert err < 1e-2, f"relative error {err:.2e} against dense attention over the {storage_dtype} tier's blocks"
            for run in range(2):  # codes and scales of the selection, then of nothing
                g_out, g_lse, selected = sparse_rows_body(far.source, [far.requests["r"]], layer, q,
                                                          torch.tensor([row.num_far_blocks]), row_caches, 0.3, packed)
                assert copied[-2:] == [k if run == 0 else 0] * 2
                assert set(plant) <= set(selected[0].tolist())
                torch.testing.assert_close(g_out, out, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(g_lse, lse, rtol=1e-5, atol=1e-6)
        far.end_step()
    finally:
        far.close()
        store.close()


class _BodyGraphs:
    """`SparseStepGraphs`' interface, each 'replay' running the graph body eagerly (CUDA graphs need a
    GPU; tests/gpu/test_far_graphs_gpu.py replays real ones): how `FarKV.attend_into` gathers a
    step's decoding rows into one graph call and merges its far parts back, on CPU."""

    def __init__(self, far, max_rows: int):
        from tierkv.sparse.row_caches import RowCaches
        from tierkv.sparse.step import packed_buffers

        self.far, self.max_rows, self.calls = far, max_rows, []
        k = far.sparse_blocks
        self.caches = RowCaches(max_rows, far.store.num_layers, k, far.store.layout.shape, far.store.layout.dtype,
                                torch.device("cpu"))
        self.packed = packed_buffers(far.source, torch.device("cpu"), max_rows)
        self.counts = {"graph_captures": 0, "graph_replays": 0, "graph_rows": 0, "graph_capture_errors": 0}
        self.packed_bytes = 0

    def servable(self, req, num_far):
        if not (req.summaries is not None and 0 < num_far <= min(req.summaries.prefix)):
            return False
        req.cache = req.cache or self.caches.take()
        return req.cache is not None

    def key(self, layer, rows, scale):
        return layer, tuple(req_id for req_id, _, _ in rows), scale

    def near_buffer(self, layer, key):
        return None

    def attend(self, layer, rows, q, near_out, near_lse, out_dtype, scale, key=None):
        from tierkv.attention import merge_two_into
        from tierkv.sparse.step import sparse_rows_body

        self.calls.append([req_id for req_id, _, _ in rows])
        far_out, far_lse, ids = sparse_rows_body(self.far.source, [req for _, req, _ in rows], layer, q,
                                                 torch.tensor([n for _, _, n in rows]), self.caches, scale, self.packed)
        self.counts["graph_replays"] += 1
        self.counts["graph_rows"] += len(rows)
        out = torch.empty(near_out.shape, dtype=out_dtype)
        merge_two_into(out, (near_out, near_lse), (far_out, far_lse))
        return out, ids

    def forget(self, req_id):
        pass

    def stats(self):
        return dict(self.counts)


def computed_far(tmp_path, reqs, max_rows: int, staging_blocks: int = 64, sparse_graphs: bool = True,
                 window: int = 2 * BS, blocks: int = 30, max_model_len: int | None = None, caches=None,
                 cache_selections: int = 1, scheduler_lines: tuple[str, ...] = ()):
    """A sparse-policy FarKV over a CPU store whose requests `reqs` each have `blocks` computed blocks
    per layer (saved and summarized, from vLLM pools `caches`, random when not given): (store, caches, far)."""
    config = load_config(write_config(tmp_path, window=window, staging_blocks=staging_blocks, sparse_tokens=4 * BS,
                                      sparse_graphs=sparse_graphs, cache_selections=cache_selections,
                                      scheduler_lines=scheduler_lines), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    caches = caches if caches is not None else {n: torch.randn(NUM_BLOCKS, H, BS, 2 * D) for n in NAMES}
    store.register(caches)
    far = FarKV(store, window, max_model_len=max_model_len, max_rows=max_rows)
    for req in reqs:
        add_computed(store, far, caches, req, blocks)
    return store, caches, far


def add_computed(store, far, caches, req: str, blocks: int) -> None:
    """Request `req` with `blocks` computed blocks per layer in vLLM pools `caches`, saved and summarized."""
    hashes = store.extend_hashes([], [random.randrange(1000) for _ in range(blocks * BS)], blocks)
    far.add_hashes(req, 0, hashes)
    for name in NAMES:
        spans = [BlockSpan(req, list(range(blocks)), hashes)]
        far.summarize(store.layer_index[name], spans, store.save_layer(store.layer_index[name], caches[name], spans))
    store.poll(wait=True)


def test_one_graph_call_serves_every_decoding_row_of_a_step(tmp_path):
    """Three decoding rows with far blocks and, between them, a short prefill row without any: the
    graphs get the decoding rows in one call per layer (at most max_rows: the rest go eager), and
    the merged output equals the eager path's for every row."""
    from tierkv.attention import merge_partials

    blocks = 30
    store, _, far = computed_far(tmp_path, ("a", "b", "c"), max_rows=2, staging_blocks=32, sparse_graphs=False,
                                 blocks=blocks)
    try:
        rows = [("a", blocks * BS, 1), ("p", 5, 3), ("b", blocks * BS - 3, 1), ("c", blocks * BS - 7, 1)]
        far.begin_step(rows)
        q = torch.randn(6, HQ, D)
        near = (torch.randn(6, HQ, D), torch.randn(6, HQ))
        wants = [merge_partials([near, far.attend(store.layer_index[n], q, 0.3)])[0] for n in NAMES]
        far.graphs = _BodyGraphs(far, max_rows=2)
        before = dict(far.counts)
        for name, want in zip(NAMES, wants):
            got = torch.full((6, HQ, D), float("nan"))
            far.attend_into(got, store.layer_index[name], q, *near, 0.3)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert far.graphs.calls == [["a", "b"]] * LAYERS  # rows 0 and 4 of the step, in one call; "c" eager
        # block reads at attention time, graphed and eager rows alike: each decoding row reads its
        # window (2 blocks, a third while the window straddles a block edge) from vLLM's pool and
        # its 4 selected far blocks (fetched: the graphed rows' caches were empty); the prefill row "p"
        # has no far blocks and counts nothing
        selected = far.counts["sparse_selected_reads"] - before["sparse_selected_reads"]
        resident = far.counts["sparse_resident_reads"] - before["sparse_resident_reads"]
        assert selected == 3 * 4 * LAYERS
        assert far.graphs.caches.stats()["cache_misses"] == 2 * 4 * LAYERS
        assert 3 * 2 * LAYERS <= resident <= 3 * 3 * LAYERS
        total = far.counts["sparse_resident_reads"] + far.counts["sparse_selected_reads"]
        assert far.stats()["gpu_hit_rate"] == far.counts["sparse_resident_reads"] / total
        assert far.graphs.counts["graph_rows"] == 2 * LAYERS
        assert far.stats()["decode_host_us_per_layer"] > 0  # each attend_into of this decode step timed
        far.end_step()
        begin_ms, attend_ms = far.stats()["step_host_ms"][-1]  # and the step's host time, ours
        assert 0 < begin_ms and LAYERS * far.stats()["decode_host_us_per_layer"] / 1e3 <= 2 * attend_ms
    finally:
        far.graphs = None
        far.close()
        store.close()


class _FakeGraph:
    """A captured graph's stand-in on CPU: a 'replay' runs the body eagerly into the static outputs."""

    def __init__(self, run, outputs):
        self.run, self.outputs = run, outputs

    def replay(self):
        for output, result in zip(self.outputs, self.run()):
            output.copy_(result)


def fake_graphs(monkeypatch, fail_whole: bool = False):
    """SparseStepGraphs on CPU, its recording replaced by `_FakeGraph` (real captures:
    tests/gpu/test_far_graphs_gpu.py); fail_whole: recording a graph with the window part fails."""
    from tierkv.sparse import step_graphs as far_graphs
    from tierkv.sparse.far_source import FarSource

    def record(self, body, whole=False):
        if whole and fail_whole:  # as _record does when a capture raises
            self.whole_enabled = False
            self.counts["whole_capture_errors"] += 1
            return None
        ids = body().clone()
        self.counts["graph_captures"] += 1
        return _FakeGraph(lambda: [body()], [ids]), ids

    monkeypatch.setattr(FarSource, "graphs_usable", lambda self: True)
    monkeypatch.setattr(far_graphs.SparseStepGraphs, "_record", record)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)


def test_step_graphs_keep_a_graph_per_set_of_rows_and_forget_finished_requests(tmp_path, monkeypatch):
    """SparseStepGraphs' bookkeeping on CPU, its capture replaced by one whose 'replay' runs the graph
    body eagerly (real captures: tests/gpu/test_far_graphs_gpu.py): a set of rows captures once per
    layer and replays while far counts grow, a second set is captured beside it, the first replays
    again, the least recently used set goes past GRAPHS_PER_LAYER, a finished request's graphs are
    dropped; every step's output equals the eager path's."""
    from tierkv.attention import merge_partials
    from tierkv.sparse import step_graphs as far_graphs

    fake_graphs(monkeypatch)
    blocks = 30
    reqs = [f"r{i}" for i in range(6)]
    # five far-block cache sets: each of r0..r4 holds one while it runs
    store, _, graphed = computed_far(tmp_path, reqs, max_rows=5, blocks=blocks, staging_blocks=128)
    try:
        assert graphed.graphs is not None and graphed.graphs.max_rows == 5
        position = {req: (blocks - 3) * BS - 4 for req in reqs}

        def step(names):
            rows = [(req, position[req], 1) for req in names]
            graphed.begin_step(rows)
            q = torch.randn(len(rows), HQ, D)
            near = (torch.randn(len(rows), HQ, D), torch.randn(len(rows), HQ))
            for name in NAMES:
                layer = store.layer_index[name]
                saved, graphed.graphs = graphed.graphs, None  # the eager path, same FarKV and selections
                want = merge_partials([near, graphed.attend(layer, q, 0.3)])[0]
                graphed.graphs = saved
                got = torch.full_like(want, float("nan"))
                # as the vLLM backend: the near part written where the layer's kept graph reads it, if any
                buffer = graphed.near_out_buffer(layer, len(rows), 0.3)
                handed_out[tuple(names)].append(buffer is not None)
                near_out = near[0] if buffer is None else buffer.copy_(near[0])
                graphed.attend_into(got, layer, q, near_out, near[1], 0.3)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            graphed.end_step()
            for req in names:
                position[req] += 1

        handed_out = collections.defaultdict(list)

        counts = graphed.graphs.counts
        for _ in range(BS + 2):  # far counts grow by a block on the way: the same graphs replay
            step(["r0", "r1"])
        assert counts["graph_captures"] == LAYERS and counts["graph_replays"] == LAYERS * (BS + 2)
        # the first step had no kept graph to write into; every later one wrote the near part in place
        assert handed_out[("r0", "r1")] == [False] * LAYERS + [True] * LAYERS * (BS + 1)
        step(["r0"])  # a second set of rows, captured beside the first
        step(["r0", "r1"])  # the first set's graphs were kept
        assert counts["graph_captures"] == 2 * LAYERS and graphed.stats()["cuda_graphs"]["graphs"] == 2 * LAYERS
        # kept, least recently used first: ("r0",), ("r0", "r1"); then three more sets: past
        # GRAPHS_PER_LAYER (4) the least recently used, ("r0",), goes
        for names in (["r2"], ["r3"], ["r4"]):
            step(names)
        assert counts["graph_captures"] == 5 * LAYERS
        assert graphed.stats()["cuda_graphs"]["graphs"] == far_graphs.GRAPHS_PER_LAYER * LAYERS
        step(["r0"])  # ("r0",) was evicted: captured again, evicting ("r0", "r1")
        step(["r2"])  # still kept: replayed
        assert counts["graph_captures"] == 6 * LAYERS
        graphed.finish("r0")  # its graph goes; ("r2",), ("r3",), ("r4",) stay
        assert graphed.stats()["cuda_graphs"]["graphs"] == 3 * LAYERS
        assert counts["graph_capture_errors"] == 0
    finally:
        graphed.close()
        store.close()


class _Window:
    """The window part as `FarKV.attend_whole` runs it inside a graph, on CPU: `_torch_flash_attn` over
    a layer's vLLM pool [blocks, H, BS, 2D] (the backend's is vLLM's FlashAttention), each call's key
    counts and bound recorded."""

    def __init__(self, pool):
        self.key = ("window", pool.data_ptr())
        self.key_cache, self.value_cache = pool.transpose(1, 2).split(D, dim=-1)  # as the backend's views
        self.bounds = []

    def __call__(self, q, table, seqused_k, cu_seqlens_q, max_seqlen_k):
        self.bounds += [(int(n), max_seqlen_k) for n in seqused_k]
        out, lse = _torch_flash_attn(q, self.key_cache, self.value_cache, cu_seqlens_q, 1, seqused_k, max_seqlen_k,
                                     0.3, True, table, return_softmax_lse=True)
        return out, lse.transpose(0, 1)


def test_whole_step_graphs_run_the_window_part_and_equal_the_split_path(tmp_path, monkeypatch):
    """When the graphs serve every row of a decode step, one graph per layer runs the window part
    too, reading a block table and key counts written once per step: its output equals the window
    part run outside plus the eager far path, step after step while positions and far counts grow
    (one capture per layer); a check run beside it finds no difference; a window longer than
    window + one block, or a step with a row the graphs do not serve, goes the split way; a failed
    capture turns only these graphs off."""
    from tierkv.attention import merge_partials

    fake_graphs(monkeypatch)
    window, blocks = 2 * BS, 30
    store, caches, far = computed_far(tmp_path, ("a", "b", "c"), max_rows=2, window=window, blocks=blocks)
    windows = {store.layer_index[n]: _Window(caches[n]) for n in NAMES}
    try:
        position = {"a": (blocks - 3) * BS - 4, "b": (blocks - 4) * BS - 1}

        def step(names, extra_keys=0, checked=True):
            """One decode step; True when attend_whole served its layers."""
            rows = far.begin_step([(req, position[req], 1) for req in names])
            q = torch.randn(len(rows), HQ, D)
            seqused = torch.tensor([r.num_computed + 1 - r.num_far_blocks * BS for r in rows], dtype=torch.int32)
            seqused[0] += extra_keys
            table = torch.randint(0, NUM_BLOCKS, (len(rows), 8), dtype=torch.int32)
            cu = torch.arange(len(rows) + 1, dtype=torch.int32)
            served = []
            for layer, win in windows.items():
                near = win(q, table, seqused, cu, int(seqused.max()))
                saved, far.graphs = far.graphs, None  # the eager path, same FarKV and selections
                want = merge_partials([near, far.attend(layer, q, 0.3)])[0]
                far.graphs = saved
                got = torch.full_like(want, float("nan"))
                whole = far.attend_whole(got, layer, q, 0.3, win, (table, seqused, int(seqused.max())),
                                         check=lambda: win(q, table, seqused, cu, int(seqused.max())) if checked else None)
                if not whole:
                    far.attend_into(got, layer, q, *near, 0.3)
                served.append(whole)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            far.end_step()
            for req in names:
                position[req] += 1
            assert len(set(served)) == 1  # the step's layers all go one way
            return served[0]

        counts = far.graphs.counts
        assert step(["a", "b"], checked=False)  # a check that is not due (None) checks nothing
        assert far.stats()["whole_check_max_abs"] is None and counts["graph_captures"] == LAYERS
        assert all(step(["a", "b"]) for _ in range(BS + 1))  # far counts grow on the way
        assert counts["whole_graph_replays"] == LAYERS * (BS + 2)
        # one whole graph per layer, and its split twin the check captured
        assert counts["graph_captures"] == 2 * LAYERS
        assert far.stats()["whole_check_max_abs"] == 0.0
        # the graphs ran the window part with window + one block as the bound of its key counts
        graphed = [(n, bound) for win in windows.values() for n, bound in win.bounds if bound == window + BS]
        assert graphed and all(n <= bound for n, bound in graphed)
        assert not step(["a", "b"], extra_keys=window)  # a longer window than the bound: split
        position["c"] = position["a"]
        assert not step(["a", "b", "c"])  # a row past the graphs' max_rows: the step goes the split way
        # the window inputs are one set per row count and table shape, written every step: a finished
        # request leaves them to the next steps; its graphs go (this engine has no max_model_len, so
        # its buffers pass to no other request)
        kept = far.graphs.stats()["graphs"]
        far.finish("a")
        assert len(far.graphs.near_inputs) == 1 and far.graphs.stats()["graphs"] < kept
    finally:
        far.close()
        store.close()


def test_a_finished_requests_buffers_and_graphs_serve_the_next_request(tmp_path, monkeypatch):
    """With max_model_len known, a finished request's summary tables and device slot lists pass to the
    next request at the same addresses, so the whole graphs captured for the first replay for the
    second with no capture. Its outputs equal those of an engine that never served the first (its
    KV differs from the first's: a stale summary would change the selection)."""
    fake_graphs(monkeypatch)
    window, blocks = 2 * BS, 30
    max_len = (blocks + 8) * BS
    for sub in ("reused", "fresh"):
        (tmp_path / sub).mkdir()
    store, caches, far = computed_far(tmp_path / "reused", ("a",), max_rows=1, window=window, blocks=blocks,
                                      max_model_len=max_len)
    fresh_store = fresh = None
    try:
        assert far.reuses_buffers
        position = (blocks - 3) * BS - 4

        def decode(engine, req, steps, whole=True):
            """Decode steps of `req` (attend_whole, or the eager path): each layer's output, per step."""
            outs = []
            for step in range(steps):
                rows = engine.begin_step([(req, position + step, 1)])
                q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(step))
                seqused = torch.tensor([rows[0].num_computed + 1 - rows[0].num_far_blocks * BS], dtype=torch.int32)
                table = torch.arange(8, dtype=torch.int32).unsqueeze(0)
                for name in NAMES:
                    layer, win = store.layer_index[name], _Window(caches[name])
                    if whole:
                        got = torch.full((1, HQ, D), float("nan"))
                        assert engine.attend_whole(got, layer, q, 0.3, win, (table, seqused, int(seqused.max())))
                    else:
                        near = win(q, table, seqused, torch.arange(2, dtype=torch.int32), int(seqused.max()))
                        got = merge_partials([near, engine.attend(layer, q, 0.3)])[0]
                    outs.append(got)
                engine.end_step()
            return outs

        from tierkv.attention import merge_partials

        decode(far, "a", 3)
        counts = far.graphs.counts
        assert counts["graph_captures"] == LAYERS
        tables = far.requests["a"].summaries.summaries.tables
        slot_lists = far.requests["a"].pinned_slots_dev
        far.finish("a")
        for cache in caches.values():  # the next request's KV is another one
            cache.copy_(torch.randn_like(cache))
        add_computed(store, far, caches, "b", blocks)
        assert far.requests["b"].summaries.summaries.tables is tables
        got = decode(far, "b", 3)
        assert far.requests["b"].pinned_slots_dev is slot_lists  # taken when its first blocks were pinned
        assert counts["graph_captures"] == LAYERS and counts["whole_graph_replays"] == 6 * LAYERS  # no capture for "b"
        fresh_store, _, fresh = computed_far(tmp_path / "fresh", ("b",), max_rows=1, window=window, blocks=blocks,
                                             sparse_graphs=False, caches=caches)
        want = decode(fresh, "b", 3, whole=False)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    finally:
        for engine, engine_store in ((far, store), (fresh, fresh_store)):
            if engine is not None:
                engine.close()
                engine_store.close()


def test_a_failed_whole_graph_capture_leaves_the_split_graphs_serving(tmp_path, monkeypatch):
    """A whole graph whose capture fails: those graphs turn off (counted), the split graphs serve on."""
    fake_graphs(monkeypatch, fail_whole=True)
    blocks = 30
    store, caches, far = computed_far(tmp_path, ("a",), max_rows=1, blocks=blocks)
    try:
        for _ in range(2):
            rows = far.begin_step([("a", (blocks - 3) * BS, 1)])
            q, near = torch.randn(1, HQ, D), (torch.randn(1, HQ, D), torch.randn(1, HQ))
            tables = (torch.zeros(1, 8, dtype=torch.int32), torch.tensor([rows[0].near_blocks(BS) * BS], dtype=torch.int32),
                      rows[0].near_blocks(BS) * BS)
            for name in NAMES:
                layer = store.layer_index[name]
                got = torch.empty(1, HQ, D)
                assert not far.attend_whole(got, layer, q, 0.3, _Window(caches[name]), tables)
                far.attend_into(got, layer, q, *near, 0.3)
            far.end_step()
        stats = far.stats()["cuda_graphs"]
        assert stats["whole_capture_errors"] == 1 and not stats["whole_graphs_enabled"]
        assert stats["graphs_enabled"] and stats["graph_replays"] == 2 * LAYERS and stats["whole_graph_replays"] == 0
    finally:
        far.close()
        store.close()


def test_sparse_staging_grows_with_the_rows_only_where_the_graphs_run(tmp_path):
    """The sparse fetches' staging holds one selection per region unless CUDA graphs can run (CUDA,
    a copy-kernel backend): then a selection per graph row, within half the staging. On CPU,
    max_rows changes nothing and the main ring keeps the rest."""
    config = load_config(write_config(tmp_path, window=2 * BS, staging_blocks=64, sparse_tokens=4 * BS,
                                      sparse_graphs=True), env={})
    store = VllmKVStore(config, BlockLayout(H, BS, D, torch.float32), NAMES, "hot-model", "cpu")
    try:
        for max_rows in (1, 64):
            far = FarKV(store, 2 * BS, max_rows=max_rows)
            assert far.graphs is None and far.sparse_streamer.pool.region_blocks == far.sparse_blocks == 4
            assert far.pool.region_blocks * far.pool.num_regions + 2 * 4 <= 64
            far.close()
    finally:
        store.close()


def test_pinned_slots_on_the_device_grow_in_place_and_match_the_host(tmp_path):
    """Sparse rows read the far blocks' CPU-tier slots from a device buffer that doubles when full
    (so a CUDA graph's baked-in address rarely moves): after the far part grows step by step, its
    first entries equal the host's pinned slots."""
    from tierkv.transfer.device import append_at

    window = 2 * BS
    far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=2 * BS, window=window, num_blocks=60)
    try:
        addresses = set()
        for n in range(10 * BS, 60 * BS, 7 * BS):
            (row,) = far.begin_step([("r", n, 1)])
            far.end_step()
            req = far.requests["r"]
            for layer in range(LAYERS):
                host = req.pinned_slots[layer]
                assert host.numel() == row.num_far_blocks
                assert torch.equal(req.pinned_slots_dev[layer][: host.numel()], host)
            addresses.add(req.pinned_slots_dev[0].data_ptr())
        assert len(addresses) == 1  # within the first buffer's 256 entries
    finally:
        far.close()
        store.close()
    buffer = append_at(torch.empty(0, dtype=torch.int64), 0, torch.arange(300))
    assert buffer.numel() == 300
    grown = append_at(buffer, 300, torch.arange(300, 310))
    assert grown.numel() == 600 and torch.equal(grown[:310], torch.arange(310))
    assert append_at(grown, 310, torch.arange(5)).data_ptr() == grown.data_ptr()  # room left: in place


def test_profiler_ranges_are_entered_only_while_a_profiler_runs():
    """The backend names its far part in a profiler's trace, and costs nothing when none runs."""
    import contextlib

    from tierkv.integrations.vllm.far_attention import profiled

    assert isinstance(profiled("tierkv.far"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiled("tierkv.far"):
            torch.ones(4).sum()
    assert [e.name for e in prof.events() if e.name == "tierkv.far"] == ["tierkv.far"]


def test_the_whole_graph_check_counts_only_the_calls_it_runs(monkeypatch):
    """CHECK_WHOLE_GRAPHS=N: the backend hands attend_whole a check for every call, but only the N
    that run (attend_whole runs one only where a whole graph served the layer) use it up; prefill
    calls, where none is run, do not."""
    from tierkv.integrations.vllm import backend as hot_window_backend

    monkeypatch.setenv("CHECK_WHOLE_GRAPHS", "2")
    checks = hot_window_backend._CheckWhole()
    ran = []

    def window(*args):
        ran.append(args)
        return "near"

    for layer in range(5):  # handed out, never run
        assert checks.check(window, layer) is not None
    assert checks.left == 2 and not ran
    run = checks.check(window, "a")
    assert [run(), run(), run()] == ["near", "near", None]
    assert ran == [("a",), ("a",)] and checks.check(window, "b") is None


def _torch_flash_attn(q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                      block_table, return_softmax_lse=False, out=None, **_):
    """vLLM's flash_attn_varlen_func for decoding rows (one query each) over a paged cache, in PyTorch
    on CPU: k, v [blocks, BS, H, D] as the backend's views give them; lse [HQ, m] as FlashAttention's."""
    assert max_seqlen_q == 1 and int(seqused_k.max()) <= max_seqlen_k
    outs, lses = [], []
    for r in range(q.shape[0]):
        n = int(seqused_k[r])
        blocks = block_table[r, : -(-n // BS)].long()
        keys = k[blocks].reshape(-1, H, D)[:n].repeat_interleave(HQ // H, dim=1)
        values = v[blocks].reshape(-1, H, D)[:n].repeat_interleave(HQ // H, dim=1)
        scores = torch.einsum("hd,khd->hk", q[r], keys) * softmax_scale
        outs.append(torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), values))
        lses.append(torch.logsumexp(scores, dim=-1))
    result = torch.stack(outs)
    if out is not None:
        result = out.copy_(result)
    return (result, torch.stack(lses).transpose(0, 1).contiguous()) if return_softmax_lse else result


def test_the_backend_runs_whole_step_graphs_and_their_check_on_decode_steps(tmp_path, monkeypatch):
    """HotWindowImpl.forward under the sparse policy with graphs, FlashAttention replaced by a PyTorch
    paged attention (and graphs by eager bodies): a decode step of graphed rows goes through one
    whole graph per layer, a step with a row past the graphs' max_rows through the split path, and
    both equal the window part plus the eager far path; CHECK_WHOLE_GRAPHS runs the split path
    beside the first calls only and finds no difference."""
    from tierkv.attention import merge_partials
    from tierkv.integrations.vllm import backend
    from tierkv.integrations.vllm.hot_window import HotWindowStep

    fake_graphs(monkeypatch)
    monkeypatch.setattr(backend.fa, "flash_attn_varlen_func", _torch_flash_attn, raising=False)  # CUDA-only import
    monkeypatch.setenv("CHECK_WHOLE_GRAPHS", str(LAYERS))
    monkeypatch.setattr(backend, "_CHECK_WHOLE", backend._CheckWhole())  # one step's layers checked
    window, blocks = 2 * BS, 30
    store, caches, far = computed_far(tmp_path, ("a", "b", "c"), max_rows=2, window=window, blocks=blocks)
    impls = {n: backend.HotWindowImpl(num_heads=HQ, head_size=D, scale=0.3, num_kv_heads=H, alibi_slopes=None,
                                      sliding_window=None, kv_cache_dtype="auto") for n in NAMES}
    layers = {n: SimpleNamespace(layer_name=n, _k_scale=torch.ones(1), _v_scale=torch.ones(1)) for n in NAMES}
    vllm_tables = {req: torch.randint(0, NUM_BLOCKS, (blocks + 4,), dtype=torch.int32) for req in ("a", "b", "c")}
    position = {"a": (blocks - 3) * BS - 4, "b": (blocks - 4) * BS - 1, "c": (blocks - 3) * BS}
    try:
        def step(names):
            rows = far.begin_step([(req, position[req], 1) for req in names])
            m = len(rows)
            seq_lens = torch.tensor([r.num_computed + 1 for r in rows], dtype=torch.int32)
            meta = SimpleNamespace(num_actual_tokens=m, block_table=torch.stack([vllm_tables[r] for r in names]),
                                   seq_lens=seq_lens, max_seq_len=int(seq_lens.max()),
                                   query_start_loc=torch.arange(m + 1, dtype=torch.int32), max_query_len=1,
                                   use_cascade=False)
            hot_window.set_step(HotWindowStep(far, rows, store.layer_index))
            replays = far.graphs.counts["whole_graph_replays"]
            for name in NAMES:
                layer = store.layer_index[name]
                q = torch.randn(m, HQ, D)
                table, seqused_k, max_k = hot_window.current_step().near(meta)
                key_cache, value_cache = impls[name]._kv_views(caches[name])
                near_out, near_lse = _torch_flash_attn(q, key_cache, value_cache, meta.query_start_loc, 1, seqused_k,
                                                       max_k, 0.3, True, table, return_softmax_lse=True)
                saved, far.graphs = far.graphs, None  # the eager path, same FarKV and selections
                want = merge_partials([(near_out, near_lse.transpose(0, 1)), far.attend(layer, q, 0.3)])[0]
                far.graphs = saved
                output = torch.full((m, HQ, D), float("nan"))
                impls[name].forward(layers[name], q, None, None, caches[name], meta, output)
                torch.testing.assert_close(output, want, rtol=1e-5, atol=1e-6)
            hot_window.set_step(None)
            far.end_step()
            for req in names:
                position[req] += 1
            return far.graphs.counts["whole_graph_replays"] - replays

        assert step(["a", "b"]) == LAYERS  # every layer one whole graph; the first step's layers checked
        assert far.stats()["whole_check_max_abs"] == 0.0 and backend._CHECK_WHOLE.left == 0
        assert step(["a", "b"]) == LAYERS
        assert step(["a", "b", "c"]) == 0  # "c" is past max_rows: the split path
    finally:
        hot_window.set_step(None)
        far.close()
        store.close()


def test_full_decode_graphs_capture_max_num_seqs(tmp_path):
    """scheduler.sparse_full_graphs under compiled vLLM: the engine's capture sizes hold max_num_seqs
    (vLLM keeps full decode graphs only up to it, so a full batch of a size off its default list would
    find none and run piecewise); a compilation_config of the user's, an eager engine or the flag off
    leave vLLM's defaults; max_num_seqs is required; the flag alone starts the engine compiled."""
    from tierkv.integrations.vllm.engine_args import tiered_engine_args
    from tierkv.integrations.vllm.pool_sizing import full_decode_capture_sizes

    assert full_decode_capture_sizes(10) == [1, 2, 4, 8, 10, 16]
    assert full_decode_capture_sizes(8) == [1, 2, 4, 8, 16] and full_decode_capture_sizes(1) == [1, 2]
    assert full_decode_capture_sizes(300)[-3:] == [480, 496, 512] and 300 in full_decode_capture_sizes(300)
    with pytest.raises(ValueError, match="max_num_seqs: got None"):
        full_decode_capture_sizes(None)
    model = _checkpoint(tmp_path)

    def engine_kwargs(full: bool, **kwargs):
        config = load_config({"cache": {"block_tokens": 64, "gpu_budget_bytes": "8GiB", "window_tokens": 2048},
                              "scheduler": {"policy": "sparse", "sparse_cuda_graphs": True,
                                            "sparse_full_graphs": full, "staging_bytes": "512MiB"}}, env={})
        return tiered_engine_args(model, config, str(tmp_path / "tierkv.yaml"), kwargs, hot_window=True,
                                  max_model_len=131072, gpu_memory_utilization=0.5, enable_prefix_caching=False).kwargs

    args = engine_kwargs(True, max_num_seqs=10, enforce_eager=False)
    assert args["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4, 8, 10, 16]}
    assert "compilation_config" not in engine_kwargs(False, max_num_seqs=10, enforce_eager=False)
    assert "compilation_config" not in engine_kwargs(True, max_num_seqs=10, enforce_eager=True)  # an eager engine
    # not told, TieredLLM starts compiled for the full decode graph (and eagerly without it)
    assert engine_kwargs(True, max_num_seqs=10)["compilation_config"] == args["compilation_config"]
    assert engine_kwargs(False, max_num_seqs=10)["enforce_eager"] is True
    own = {"cudagraph_capture_sizes": [1, 10]}
    assert engine_kwargs(True, max_num_seqs=10, enforce_eager=False, compilation_config=own)["compilation_config"] is own


def test_full_decode_graph_codes_come_out_of_the_budget(tmp_path):
    """Over a quantized CPU tier the full decode graph keeps a selection's codes and scales for each
    row of the largest captured batch (FullDecodeRows' packed buffers): TieredLLM reserves them inside
    cache.gpu_budget_bytes, as it does the key summaries, at the bytes a CPU tier's block packs to;
    none for a bf16 tier, an eager engine or the flag off; a budget they exhaust is a config error."""
    from tierkv.blocks import BlockLayout
    from tierkv.config import ConfigError
    from tierkv.storage import CpuTier
    from tierkv.integrations.vllm.engine_args import tiered_engine_args
    from tierkv.integrations.vllm.pool_sizing import full_graph_packed_bytes, hot_window_pool_need

    model = _checkpoint(tmp_path)  # 8 KV heads of 128

    def config(full: bool = True, storage: str = "float8_e4m3fn", budget: str = "8GiB", margin: int = 0):
        prefetch = {"sparse_prefetch_margin": margin, "sparse_cache_selections": 2} if margin else {}
        return load_config({"cache": {"block_tokens": 64, "gpu_budget_bytes": budget, "window_tokens": 2048},
                            "tiers": [{"kind": "cpu", "capacity_bytes": "1GiB", "storage_dtype": storage}],
                            "scheduler": {"policy": "sparse", "sparse_cuda_graphs": True, "sparse_full_graphs": full,
                                          "sparse_token_budget": 2048, "staging_bytes": "512MiB", **prefetch}},
                           env={})

    compiled = {"max_num_seqs": 10, "enforce_eager": False}
    tier = CpuTier("cpu", BlockLayout(8, 64, 128, torch.bfloat16), 1 << 24, pin_memory=False,
                   quant_format="float8_e4m3fn")
    per_block = tier.slab[0].numel() * tier.slab.element_size() + tier.scales[0].numel() * tier.scales.element_size()
    rows, k = 16, 2048 // 64  # the largest capture size (vLLM's sizes up to twice max_num_seqs), a selection
    assert full_graph_packed_bytes(model, config(), compiled) == rows * k * per_block
    assert full_graph_packed_bytes(model, config(), {**compiled, "tensor_parallel_size": 2}) == rows * k * (
        per_block // 2)  # each rank packs its 4 KV heads
    assert full_graph_packed_bytes(model, config(), {**compiled, "compilation_config": {
        "cudagraph_capture_sizes": [1, 2, 4, 8, 10, 32]}}) == 32 * k * per_block
    for other, kwargs in ((config(storage="auto"), compiled), (config(full=False), compiled),
                          (config(), {"max_num_seqs": 10})):
        assert full_graph_packed_bytes(model, other, kwargs) == 0
    # the next-step prefetch: its margin's codes and scales, and per layer its int64 sources and targets
    lists = rows * 8 * 32 * 2 * 8  # the checkpoint's 32 layers
    assert full_graph_packed_bytes(model, config(margin=8), compiled) == rows * (k + 8) * per_block + lists
    assert full_graph_packed_bytes(model, config(storage="auto", margin=8), compiled) == lists

    def pool(cfg, **kwargs):
        args = tiered_engine_args(model, cfg, str(tmp_path / "tierkv.yaml"), kwargs, hot_window=True,
                                  max_model_len=131072, gpu_memory_utilization=0.5, enable_prefix_caching=False)
        return args.kwargs["kv_cache_memory_bytes"], args

    with_full, args = pool(config(), **compiled)
    without, _ = pool(config(full=False), **compiled)
    assert args.full_graph_reserved_bytes == rows * k * per_block and without - with_full == rows * k * per_block
    assert args.full_graph_reserved_rows == rows
    # a budget that holds staging and the summaries but not the codes too: the codes are what tips it
    held = 512 * 2**20 + args.summary_reserved_bytes + rows * k * per_block
    # what is left is vLLM's pool, which must hold one request's window and prefill chunk (vLLM's check)
    need = hot_window_pool_need(model, config(), {"max_num_batched_tokens": 2048, "max_model_len": 131072})
    assert pool(config(budget=str(held + need)), **compiled)[0] == need
    with pytest.raises(ConfigError, match="hot-window pool of"):
        pool(config(budget=str(held + need - 1)), **compiled)
    with pytest.raises(ConfigError, match="full decode graph's codes and scales"):
        pool(config(budget=str(held)), **compiled)


def test_saves_wait_for_a_block_whose_last_token_is_still_being_sampled(tmp_path):
    """vLLM's async scheduling: step N+1 is scheduled before step N's sampled token reaches the
    request, so the token step N+1 computes is known only on the GPU. The block it completes is not
    saved at that step (its hash would cover a token the host does not have), but at the next, under
    the hash synchronous scheduling gives it; positions and far counts follow the positions as before."""
    window = 2 * BS
    config_file = write_config(tmp_path, window=window, staging_blocks=8)
    connector = TierKVConnector(vllm_config(config_file), KVConnectorRole.SCHEDULER, hot_kv_cache_config(window))
    try:
        prompt = [random.randrange(1000) for _ in range(6 * BS - 1)]  # block 5 lacks one token
        req = make_request("r1", prompt)
        connector.get_num_new_matched_tokens(req, 0)
        meta1 = connector.build_connector_meta(schedule(req, list(range(7)), 0))
        assert [len(s.block_ids) for s in meta1.saves] == [5]

        def decode_step(num_computed: int):
            cached = CachedRequestData.make_empty()
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids = ["r1"], [num_computed], [None]
            out = schedule(req, [], 0)
            out.scheduled_new_reqs, out.scheduled_cached_reqs = [], cached
            out.num_scheduled_tokens = {"r1": 1}
            return connector.build_connector_meta(out)

        # step 2 computes position 6 BS - 1, the token step 1 sampled, not yet on the request
        meta2 = decode_step(6 * BS - 1)
        assert meta2.scheduled == {"r1": (6 * BS - 1, 1)} and meta2.saves == [] and meta2.hashes == []
        sampled = random.randrange(1000)
        req.append_output_token_ids(sampled)  # step 1's output processed; step 2's token still in flight
        meta3 = decode_step(6 * BS)
        assert [s.block_ids for s in meta3.saves] == [[5]]
        want = connector.store.extend_hashes([], prompt + [sampled], 6)[5]
        assert meta3.saves[0].hashes == [want] and meta3.hashes == [("r1", 5, [want])]
    finally:
        connector.shutdown()


def test_hot_window_pool_check_names_the_keys_and_counts_async_in_flight_tokens(tmp_path):
    """vLLM sizes the hot-window pool for one request's window plus the prefill tokens in flight,
    twice that under its async scheduling; a pool below it is a config error naming the budget (not
    vLLM's max_model_len error), and halving the prefill chunk under async keeps the sync need."""
    from tierkv.config import ConfigError
    from tierkv.integrations.vllm.pool_sizing import check_hot_window_pool, hot_window_pool_need

    model = _checkpoint(tmp_path)
    config = load_config({"cache": {"block_tokens": 64, "window_tokens": 2048, "gpu_budget_bytes": "2GiB"},
                          "scheduler": {"prefill_chunk_tokens": 8192}}, env={})
    page = 2 * 8 * 64 * 128 * 2  # K and V of 8 KV heads of 128 in bf16, 64-token blocks
    sync = {"max_num_batched_tokens": 8192, "max_model_len": 131072}
    assert hot_window_pool_need(model, config, sync) == 32 * (-(-(2047 + 8192) // 64) + 2) * page  # + the bound + the null block
    both = {**sync, "async_scheduling": True}
    assert hot_window_pool_need(model, config, both) == 32 * (-(-(2047 + 16384) // 64) + 2) * page
    assert hot_window_pool_need(model, config, {**both, "max_num_batched_tokens": 4096}) == \
        hot_window_pool_need(model, config, sync)
    pool = 1476395008  # 1.375 GiB: enough for the sync need (1.26 GiB), not for the async one (2.26 GiB)
    check_hot_window_pool(model, config, {**sync, "kv_cache_memory_bytes": pool})
    with pytest.raises(ConfigError, match=r"cache.gpu_budget_bytes.*1.38 GiB.*async_scheduling.*halve"):
        check_hot_window_pool(model, config, {**both, "kv_cache_memory_bytes": pool})
    # max_model_len caps the window's tokens; fp8 KV halves each page
    short = {**both, "max_model_len": 4096, "kv_cache_dtype": "fp8"}
    assert hot_window_pool_need(model, config, short) == 32 * (4096 // 64 + 2) * page // 2
    # a model's own smaller sliding window is what vLLM sizes those layers by; one turned off is not
    (tmp_path / "own").mkdir(), (tmp_path / "off").mkdir()
    own = _checkpoint(tmp_path / "own", sliding_window=1024)
    assert hot_window_pool_need(own, config, sync) == 32 * (-(-(1023 + 8192) // 64) + 2) * page
    off = _checkpoint(tmp_path / "off", sliding_window=1024, use_sliding_window=False)
    assert hot_window_pool_need(off, config, sync) == hot_window_pool_need(model, config, sync)


def test_full_graph_rows_reserved_must_cover_the_rows_vllm_resolves():
    """The full decode graph's codes are reserved before vLLM starts, for the largest capture size
    TieredLLM works out; the connector sizes them from vLLM's resolved one. After the start the two
    are compared, and a resolved batch past the reserved rows is an error naming the remedy."""
    from types import SimpleNamespace

    from tierkv.integrations.vllm.engine_config import graph_rows
    from tierkv.integrations.vllm.pool_sizing import check_full_graph_rows, full_graph_rows

    def vllm(max_num_seqs, captured):
        return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                               compilation_config=SimpleNamespace(max_cudagraph_capture_size=captured))

    # the sizes TieredLLM passes (vLLM's defaults up to twice max_num_seqs, and max_num_seqs): 1, 2, 4, 8, 10, 16
    assert full_graph_rows({"max_num_seqs": 10}) == 16
    assert full_graph_rows({"max_num_seqs": 10, "compilation_config": {"cudagraph_capture_sizes": [1, 2, 16]}}) == 16
    assert full_graph_rows({"max_num_seqs": 10, "compilation_config": {"cudagraph_capture_sizes": [1, 4]}}) == 10
    assert graph_rows(vllm(10, 16)) == 16 and graph_rows(vllm(10, None)) == 20 and graph_rows(vllm(10, 4)) == 10
    check_full_graph_rows(20, vllm(10, 20))
    check_full_graph_rows(16, vllm(10, 12))
    check_full_graph_rows(0, vllm(10, 512))  # nothing reserved (bf16 tier, eager): nothing to cover
    with pytest.raises(RuntimeError, match=r"reserved for 16 rows.*resolved its largest captured batch to 32"):
        check_full_graph_rows(16, vllm(10, 32))


def test_close_outside_inference_mode_resets_buffers_made_inside_it(tmp_path):
    """vLLM runs the model, and so makes tierkv's device buffers (key summaries, slot lists), under
    torch.inference_mode; the engine's shutdown closes the connector outside it. Closing must still
    finish every request (seen on the H200: 'Inplace update to inference tensor outside InferenceMode'
    from the summaries' reset at shutdown)."""
    with torch.inference_mode():
        far, store, caches, ids, q = _sparse_setup(tmp_path, sparse_tokens=4 * BS, window=2 * BS, num_blocks=42,
                                                   plant=[3, 9, 20], max_model_len=64 * BS)
        far.begin_step([("r", 42 * BS, 1)])
        for name in NAMES:
            layer = store.layer_index[name]
            far.prefetch(layer)
            far.attend(layer, q, 0.3)
        far.end_step()
    try:
        assert far.reuses_buffers and torch.is_inference(far.requests["r"].summaries._flags_dev)
        far.close()
        assert not far.requests and far.key_summaries.spare_bytes > 0  # reset and kept, as the engine does
    finally:
        store.close()
