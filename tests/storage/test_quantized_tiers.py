"""Quantized disk and Redis tiers (int8, fp8 e4m3): packed codes with their scales, within the
format's bound, about half the bytes of bf16, never misread as another format, and spilled to and
promoted from the chain without loss beyond the first quantization."""
from __future__ import annotations

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.config import load_config
from tierkv.quant import QUANT_FORMATS, max_abs_error

FORMATS = list(QUANT_FORMATS)


def quantized_lower_tier(kind: str, fmt: str, layout: BlockLayout, capacity_blocks: int, tmp_path, request):
    """A disk or Redis tier built from config with storage_dtype `fmt`, as a user gets it."""
    from tierkv.storage import build_tier

    section = {"kind": kind, "storage_dtype": fmt, "capacity_bytes": capacity_blocks * layout.num_bytes, "trusted": True}
    if kind == "disk":
        section["path"] = str(tmp_path / "disk")
    else:
        server = request.getfixturevalue("redis_server")
        section.update(url=server.url, namespace=f"quant-{request.node.name}")
    config = load_config({"tiers": [{"kind": "cpu"}, section]}, env={})
    return build_tier(1, config.tiers[1], layout)


LOWER_KINDS = ["disk", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.mark.parametrize("kind", LOWER_KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_disk_and_redis_tiers_round_trip_within_the_bound_in_half_the_bytes(kind, fmt, tmp_path, request):
    layout = BlockLayout(2, 16, 32, torch.bfloat16)
    tier = quantized_lower_tier(kind, fmt, layout, 8, tmp_path, request)
    try:
        assert tier.quant_format == fmt and tier.inner.layout.dtype != layout.dtype
        blocks = (torch.randn(12, *layout.shape) * torch.rand(12, 2, 2, 1, 1) * 5).to(layout.dtype)
        keys = [f"{i:064x}/L0" for i in range(12)]
        assert all(r.ok for r in tier.put_many(keys, list(blocks)))
        # Packed blocks are (T + 1) / T codes of one byte against two bytes of bf16: 8 blocks of
        # bf16 capacity hold 15 quantized ones, so none of the 12 was evicted.
        assert tier.inner.max_blocks == (8 * layout.num_bytes) // tier.inner.layout.num_bytes == 15
        got = tier.get_many(keys)
        assert all(g is not None and g.dtype == layout.dtype and g.shape == layout.shape for g in got)
        error = (torch.stack(got).float() - blocks.float()).abs().amax(dim=(-2, -1))
        bf16_rounding = blocks.float().abs().amax(dim=(-2, -1)) * 2.0**-8  # the dequantized value is rounded to bf16
        assert (error <= max_abs_error(blocks, fmt) + bf16_rounding).all()
        assert tier.counters.snapshot()["bytes_read"] == 12 * tier.inner.layout.num_bytes
    finally:
        tier.close()


def test_a_quantized_disk_reopened_as_another_format_misses_instead_of_misreading(tmp_path, request):
    layout = BlockLayout(2, 16, 32, torch.bfloat16)
    block = torch.randn(*layout.shape).to(layout.dtype)
    int8_tier = quantized_lower_tier("disk", "int8", layout, 4, tmp_path, request)
    assert int8_tier.put("ab" * 32 + "/L0", block).ok
    int8_tier.close()
    fp8_tier = quantized_lower_tier("disk", "float8_e4m3fn", layout, 4, tmp_path, request)
    try:
        assert fp8_tier.get("ab" * 32 + "/L0") is None  # int8 codes are never read as fp8 codes
    finally:
        fp8_tier.close()
    bf16_tier = quantized_lower_tier("disk", "auto", layout, 4, tmp_path, request)
    try:
        assert bf16_tier.get("ab" * 32 + "/L0") is None
    finally:
        bf16_tier.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_chain_spills_into_a_quantized_disk_and_promotes_back(fmt, tmp_path):
    """CPU tier (same format) -> quantized disk -> back: requantizing dequantized codes is lossless,
    so a block that went down and up again equals what the CPU tier returned the first time."""
    from tierkv.storage import build_tiers

    layout = BlockLayout(2, 16, 32, torch.bfloat16)
    config = load_config({"tiers": [
        {"kind": "cpu", "capacity_bytes": 4 * layout.num_bytes, "storage_dtype": fmt},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity_bytes": 64 * layout.num_bytes, "storage_dtype": fmt, "trusted": True},
    ]}, env={})
    chain = build_tiers(config.tiers, layout, pin_memory=False)
    try:
        blocks = (torch.randn(16, *layout.shape) * 3).to(layout.dtype)
        keys = [f"{i:064x}/L1" for i in range(16)]
        first_reads = []
        for key, block in zip(keys, blocks):
            assert chain.put_many([key], [block])[0].ok
            first_reads.append(chain.tiers[0].get(key))
        chain.flush()
        assert chain.locate_many(keys[:8]) == [1] * 8  # pushed out of the 8-block CPU tier onto disk
        again = chain.get_many(keys)
        for first, back in zip(first_reads, again):
            assert back is not None and torch.equal(first, back)
        assert chain.snapshot()["chain"]["dropped"] == 0
    finally:
        chain.close()


def test_blocks_that_passed_a_quantized_cpu_tier_are_never_an_exact_chains(tmp_path):
    """A CPU tier storing fp8 writes its (lossy) blocks through to an 'auto' disk tier: an engine whose
    CPU tier keeps blocks exact must not reuse them (its addresses differ: addresses.lossy_path), while
    another fp8 engine on the same directory does."""
    from tests.models import build
    from tierkv.config import load_config
    from tierkv.llm import TieredLLM

    block = 2 * 2 * 4 * 16 * 4

    def config(disk, cpu_dtype):
        return load_config({"model": {"name": "lossy-path"},
                            "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * block, "sink_tokens": 4,
                                      "window_tokens": 8},
                            "tiers": [{"kind": "cpu", "capacity_bytes": 4096 * block, "storage_dtype": cpu_dtype},
                                      {"kind": "disk", "path": str(disk), "capacity_bytes": "64MiB", "trusted": True}],
                            "scheduler": {"lookahead_layers": 1, "staging_bytes": 8 * block,
                                          "prefill_chunk_tokens": 64}}, env={})

    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=1)
    prompt = torch.randint(0, 512, (257,), generator=torch.Generator().manual_seed(3)).tolist()
    shared, fresh = tmp_path / "shared", tmp_path / "fresh"
    with TieredLLM(model, config(shared, "float8_e4m3fn"), show_progress=False) as lossy:
        lossy.generate([prompt], max_new_tokens=4)
    with TieredLLM(model, config(fresh, "auto"), show_progress=False) as exact:
        want = exact.generate([prompt], max_new_tokens=4)[0].token_ids
    with TieredLLM(model, config(shared, "auto"), show_progress=False) as exact:
        got = exact.generate([prompt], max_new_tokens=4)[0]
    assert got.stats["prefix_tokens"] == 0 and got.token_ids == want
    with TieredLLM(model, config(shared, "float8_e4m3fn"), show_progress=False) as lossy:
        assert lossy.generate([prompt], max_new_tokens=4)[0].stats["prefix_tokens"] == 256


def test_blocks_that_passed_a_quantized_lower_tier_are_never_an_exact_chains(tmp_path):
    """A quantized disk tier under an exact CPU tier spills its (dequantized, lossy) blocks into the shared tier
    below it: an engine whose tiers all keep blocks exact must not reuse them (its tokens stay those of an exact
    run), while an engine of the same chain does (addresses.lossy_path covers every tier, not the first only)."""
    from tests.models import build
    from tierkv.config import load_config
    from tierkv.llm import TieredLLM

    block = 2 * 2 * 4 * 16 * 4

    def config(*lower, cpu_blocks=4096):
        return load_config({"model": {"name": "lossy-lower"},
                            "cache": {"block_tokens": 4, "gpu_budget_bytes": 12 * block, "sink_tokens": 4,
                                      "window_tokens": 8},
                            "tiers": [{"kind": "cpu", "capacity_bytes": cpu_blocks * block}, *lower],
                            "scheduler": {"lookahead_layers": 1, "staging_bytes": 8 * block,
                                          "prefill_chunk_tokens": 64}}, env={})

    def disk(path, blocks, **extra):
        return {"kind": "disk", "path": str(path), "capacity_bytes": blocks * block, "trusted": True, **extra}

    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=1)
    for p in model.parameters():
        p.data.mul_(2.5)  # a sharper random model: int8 rounding shows in its tokens
    prompts = [torch.randint(0, 512, (203,), generator=torch.Generator().manual_seed(s)).tolist() for s in (5, 6)]
    with TieredLLM(model, config(), show_progress=False) as exact:
        want = exact.generate([prompts[0]], max_new_tokens=16)[0].token_ids
    quantized = disk(tmp_path / "int8", 8, storage_dtype="int8", write_through=False)  # int8 codes: about 25 blocks
    shared = disk(tmp_path / "shared", 4096, write_through=False)
    with TieredLLM(model, config(quantized, shared, cpu_blocks=120), show_progress=False) as lossy:
        for prompt in prompts:  # the second request pushes the first's blocks down: CPU -> int8 disk -> shared
            lossy.generate([prompt], max_new_tokens=16)
    assert any((tmp_path / "shared").iterdir())
    with TieredLLM(model, config(shared), show_progress=False) as reader:
        got = reader.generate([prompts[0]], max_new_tokens=16)[0]
    assert got.stats["prefix_tokens"] == 0 and got.token_ids == want
    with TieredLLM(model, config(quantized, shared, cpu_blocks=120), show_progress=False) as same:
        assert same.generate([prompts[0]], max_new_tokens=16)[0].stats["prefix_tokens"] > 0


def test_the_fingerprint_names_a_quantized_tier_wherever_it_is():
    from tierkv.addresses import lossy_path

    def path(*dtypes, kinds=("cpu", "disk", "redis")):
        return lossy_path(list(zip(kinds, dtypes)))

    assert path("auto", "auto", "auto") == {} == path("bfloat16", "auto", "float32")  # the KV dtype spelled out is exact
    assert path("int8", "auto") == {"first_tier_storage": "int8"}  # the addresses it always had
    assert path("auto", "int8") != {} and path("auto", "int8") != path("int8", "auto")
    assert path("int8", "int8") != path("int8", "auto")
    assert path("auto", "int8", "auto") != path("auto", "float8_e4m3fn", "auto")
    # a shared Redis tier's blocks have one layout under one address: the kinds count where the formats do
    assert path("auto", "int8", "auto", kinds=("cpu", "redis", "disk")) != path("auto", "int8", "auto")
