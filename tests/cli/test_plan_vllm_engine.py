"""`tierkv plan --backend vllm` against the engine it describes, on drawn model shapes and configs:
where `TieredLLM(backend="vllm")` would start (`size_rows_for_batch`, then `tiered_engine_args`) the plan
says it fits with the same pool, staging and reservations; where the engine refuses, the plan never
says it fits; and it never fails with an unexpected error."""
from __future__ import annotations

import json
import tempfile

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

import torch  # noqa: E402

from tierkv.blocks import BlockLayout  # noqa: E402
from tierkv.cli.plan import format_plan, load_shape, make_plan  # noqa: E402
from tierkv.config import ConfigError, load_config  # noqa: E402
from tierkv.integrations.vllm.batch_sizing import size_rows_for_batch  # noqa: E402
from tierkv.integrations.vllm.engine_args import tiered_engine_args  # noqa: E402
from tierkv.integrations.vllm.far_staging import carve_staging  # noqa: E402
from tierkv.storage.cpu_slab import slot_num_bytes  # noqa: E402
from tierkv.storage.gpu import staging_region_blocks  # noqa: E402

MiB = 1 << 20

shapes = st.fixed_dictionaries({
    "num_hidden_layers": st.integers(1, 40), "num_key_value_heads": st.sampled_from([1, 2, 4, 8]),
    "head_dim": st.sampled_from([32, 64, 128]), "torch_dtype": st.sampled_from(["bfloat16", "float16", "float32"]),
    "max_position_embeddings": st.sampled_from([4096, 32768, 131072]),
    "sliding_window": st.one_of(st.none(), st.sampled_from([256, 4096])),
})
configs = st.fixed_dictionaries({
    "block_tokens": st.sampled_from([16, 32, 64]), "window_tokens": st.sampled_from([64, 512, 2048, 8192]),
    "sink_tokens": st.sampled_from([0, 64, 100_000]), "budget_mib": st.sampled_from([1, 64, 512, 2048, 8192, 61440]),
    "staging_mib": st.sampled_from([1, 64, 512, 768]), "chunk": st.sampled_from([256, 2048, 8192]),
    "policy": st.sampled_from(["exact", "sparse"]), "token_budget": st.sampled_from([64, 512, 2048]),
    "graphs": st.booleans(), "full_graphs": st.booleans(), "async": st.booleans(), "rows_from_batch": st.booleans(),
    "storage_dtype": st.sampled_from(["auto", "int8", "float8_e4m3fn"]),
})


def _checkpoint(shape: dict) -> str:
    directory = tempfile.mkdtemp(prefix="tierkv-plan-shape-")
    heads = shape["num_key_value_heads"] * 4
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": heads,
              "hidden_size": heads * shape["head_dim"], **{k: v for k, v in shape.items() if v is not None}}
    with open(f"{directory}/config.json", "w") as f:
        json.dump(config, f)
    return directory


def _config(c: dict):
    full = c["full_graphs"] and c["graphs"]
    return load_config({
        "cache": {"block_tokens": c["block_tokens"], "window_tokens": c["window_tokens"],
                  "sink_tokens": c["sink_tokens"], "gpu_budget_bytes": c["budget_mib"] * MiB},
        "tiers": [{"kind": "cpu", "capacity_bytes": 1 << 40, "storage_dtype": c["storage_dtype"]}],
        "scheduler": {"policy": c["policy"], "staging_bytes": c["staging_mib"] * MiB, "prefill_chunk_tokens": c["chunk"],
                      "sparse_token_budget": c["token_budget"], "sparse_cuda_graphs": c["graphs"],
                      "sparse_full_graphs": full, "vllm_async_scheduling": c["async"] and full,
                      "vllm_rows_from_batch": c["rows_from_batch"]},
        "metrics": {"enabled": False}})


def _connector_ring(shape: dict, sized, max_num_seqs: int) -> None:
    """The connector's main ring at start, as `far_staging.split_staging` carves the staging on a GPU
    (the step graphs usable): raises ConfigError where it cannot be made."""
    sched = sized.scheduler
    layout = BlockLayout(shape["num_key_value_heads"], sized.cache.block_tokens, shape["head_dim"], torch.bfloat16)
    quant = sized.tiers[0].storage_dtype in ("int8", "float8_e4m3fn")
    slot_bytes = slot_num_bytes(layout, sized.tiers[0].storage_dtype) if quant else 0
    k = max(1, sched.sparse_token_budget // layout.block_tokens) if sched.policy == "sparse" else None
    rows = max(1, min(max_num_seqs, sched.sparse_graph_rows)) if sched.sparse_cuda_graphs else 0
    shares = carve_staging(sched.staging_bytes, layout.num_bytes, shape["num_hidden_layers"], k, rows,
                           sched.sparse_cache_selections, slot_bytes)
    staging_region_blocks(layout, shares.ring_bytes, max(2, sched.lookahead_layers + 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, c=configs, context=st.sampled_from([1, 100, 4096, 32768, 131072]),
       max_num_seqs=st.sampled_from([1, 4, 10]))
def test_the_plan_agrees_with_the_engine_start(shape, c, context, max_num_seqs):
    _plan_against_engine(shape, c, context, max_num_seqs)


def test_a_sparse_staging_whose_ring_the_eager_regions_leave_too_small_is_refused():
    """1 MiB of staging holds four 256 KiB blocks: enough for the exact policy's ring, but the sparse
    policy's eager regions take two of them first and its ring needs one block per region."""
    shape = {"num_hidden_layers": 4, "num_key_value_heads": 8, "head_dim": 128, "torch_dtype": "bfloat16",
             "max_position_embeddings": 32768, "sliding_window": None}
    c = {"block_tokens": 64, "window_tokens": 512, "sink_tokens": 64, "budget_mib": 2048, "staging_mib": 1,
         "chunk": 2048, "policy": "sparse", "token_budget": 2048, "graphs": False, "full_graphs": False,
         "async": False, "rows_from_batch": False, "storage_dtype": "auto"}
    plan = _plan_against_engine(shape, c, 32768, 1)
    assert plan["gpu"]["fits"] is False and "main ring" in plan["gpu"]["refusal"]
    exact = _plan_against_engine(shape, {**c, "policy": "exact"}, 32768, 1)
    assert exact["gpu"]["fits"] is True


def _plan_against_engine(shape: dict, c: dict, context: int, max_num_seqs: int) -> dict:
    try:
        config = _config(c)
    except ConfigError:
        assume(False)  # a config the loader refuses never reaches either
    model = _checkpoint(shape)
    plan = make_plan(load_shape(model), context, config, backend="vllm", max_num_seqs=max_num_seqs)
    format_plan(plan)  # the text renders for every plan
    g = plan["gpu"]
    try:
        sized = size_rows_for_batch(model, config, {"max_num_seqs": max_num_seqs})
        engine = tiered_engine_args(model, sized, "unused.yaml", {"max_num_seqs": max_num_seqs}, hot_window=True,
                                    max_model_len=context, gpu_memory_utilization=0.9, enable_prefix_caching=False)
        _connector_ring(shape, sized, max_num_seqs)
    except (ConfigError, ValueError):
        assert g["fits"] is False and g["refusal"]
        return plan
    assert g["pool_bytes"] == engine.kwargs["kv_cache_memory_bytes"]
    assert (g["staging_bytes"], g["summary_bytes"], g["full_graph_bytes"]) == (
        sized.scheduler.staging_bytes, engine.summary_reserved_bytes, engine.full_graph_reserved_bytes)
    if context > shape["max_position_embeddings"]:  # vLLM's own refusal, past tierkv's arguments
        assert g["fits"] is False and "max_position_embeddings" in g["refusal"]
    else:
        assert g["fits"] is True and g["refusal"] is None
    d = plan["decode_step"]
    assert 0 <= d["streamed_blocks_per_layer"] <= plan["blocks_per_layer"] and d["streamed_bytes"] >= 0
    return plan
