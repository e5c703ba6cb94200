"""Quantized CPU tier (int8, fp8 e4m3): round trips within the format's bound, attention error
against full-precision storage reported, and PCIe bytes cut by the code size."""
from __future__ import annotations

import pytest
import torch

from tests.integrations.hf.test_exact_hf import tiered_greedy, tiny_config
from tests.models import build, reference_greedy
from tierkv.integrations.hf import runtime_for_model
from tierkv.attention import reference
from tierkv.blocks import BlockLayout
from tierkv.config import ConfigError, load_config
from tierkv.quant import QUANT_FORMATS, dequantize_blocks, max_abs_error, quantize_blocks
from tierkv.storage import CpuTier

FORMATS = list(QUANT_FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_round_trip_error_is_within_the_format_bound(fmt, dtype):
    blocks = (torch.randn(6, 2, 4, 16, 32) * torch.rand(6, 2, 4, 1, 1) * 10).to(dtype)
    blocks[0, 1, 2] = 0  # an all-zero group must survive (no division by zero)
    codes, scales = quantize_blocks(blocks, fmt)
    assert codes.dtype == torch.uint8 and scales.shape == (6, 2, 4)
    back = dequantize_blocks(codes, scales, fmt, torch.float32)
    error = (back - blocks.float()).abs().amax(dim=(-2, -1))
    slack = blocks.float().abs().amax(dim=(-2, -1)) * 1e-6
    assert torch.isfinite(back).all()
    assert (error <= max_abs_error(blocks, fmt) + slack).all()
    assert torch.equal(back[0, 1, 2], torch.zeros(16, 32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_cpu_tier_holds_twice_the_blocks_and_returns_the_kv_dtype(fmt):
    layout = BlockLayout(2, 16, 32, torch.bfloat16)
    tier = CpuTier("cpu", layout, 8 * layout.num_bytes, quant_format=fmt)
    assert tier.num_slots >= 15  # one byte per value plus a few scales: about twice the bf16 blocks
    block = torch.randn(layout.shape).to(torch.bfloat16)
    assert tier.put("k/L0", block).ok
    got = tier.get("k/L0")
    assert got.dtype == torch.bfloat16 and got.shape == block.shape
    bound = max_abs_error(block.unsqueeze(0), fmt)[0][..., None, None] * 1.01 + 1e-2
    assert ((got.float() - block.float()).abs() <= bound).all()


def test_bad_storage_dtype_names_the_key():
    from tierkv.storage import build_tiers

    config = load_config({"tiers": [{"kind": "cpu", "storage_dtype": "float16"}]}, env={})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.storage_dtype"):
        build_tiers(config.tiers, BlockLayout(2, 16, 32, torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_error_against_full_precision_storage(fmt):
    """Random and planted-needle KV: paged attention over dequantized blocks vs the originals."""
    rows = []
    for case in ("random", "needle"):
        q = torch.randn(1, 8, 64)
        blocks = torch.randn(64, 2, 2, 16, 64)
        if case == "needle":
            blocks[17, 0, :, 3] = 4 * q[0].view(2, 4, 64).mean(1)  # one key that dominates
        codes, scales = quantize_blocks(blocks, fmt)
        stored = dequantize_blocks(codes, scales, fmt, torch.float32)
        args = (torch.arange(64), torch.arange(64) * 16, torch.full((64,), 16))
        exact, _ = reference.paged_partial_attention(q, blocks, *args, scale=64**-0.5)
        approx, _ = reference.paged_partial_attention(q, stored, *args, scale=64**-0.5)
        rel = ((approx - exact).norm() / exact.norm()).item()
        rows.append((case, rel))
        assert rel < (0.02 if fmt == "int8" else 0.1), f"{fmt} {case}: relative error {rel:.3e}"
    print(f"{fmt}: " + ", ".join(f"{case} rel. error {rel:.2e}" for case, rel in rows))


@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_mode_over_a_quantized_cpu_tier_moves_fewer_bytes_and_stays_close(fmt):
    model, reference_model = build("llama", num_heads=8, num_kv_heads=2)
    settings = tiny_config(4, 1, 64, num_layers=2, kv_heads=2, head_dim=16)
    ids = torch.randint(0, 512, (257,)).tolist()
    expected, ref_logits = reference_greedy(reference_model, ids, 6)
    moved = {}
    for storage in ("auto", fmt):
        settings["tiers"] = [{"kind": "cpu", "capacity_bytes": "64MiB", "storage_dtype": storage}]
        runtime = runtime_for_model(model, load_config(settings, env={}), model_id=f"quant-{storage}")
        try:
            tokens, logits = tiered_greedy(model, runtime, ids, 6, 64)
            moved[storage] = runtime.engine.num_bytes_moved["h2d"]
        finally:
            runtime.close()
        # Logits after a greedy divergence follow another token sequence: compare up to it.
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(tokens))
        compared = list(zip(logits, ref_logits))[: diverged + 1]
        rel = max(((got - want).norm() / want.norm()).item() for got, want in compared)
        agree = sum(a == b for a, b in zip(tokens, expected))
        print(f"storage {storage}: max relative logit error {rel:.2e}, greedy tokens agreeing {agree}/6")
        if storage == "auto":
            assert tokens == expected and rel < 1e-4
        else:
            assert rel < 0.1
    # fp32 model: one byte per value instead of four, plus 2 x 2 float32 scales per block
    block_bytes = 2 * 2 * 4 * 16
    assert moved[fmt] == pytest.approx(moved["auto"] * (block_bytes + 16) / (block_bytes * 4), rel=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_group_holding_nan_or_inf_reads_back_non_finite_and_the_others_stay_exact(fmt, bad):
    """Non-finite KV in, non-finite out: never finite stand-ins (int8 hid a NaN as a finite value and zeroed its
    head's other values; an inf made 0 * inf). The other [kv, head] groups keep the format's bound."""
    from tierkv.quant import pack_blocks, unpack_blocks

    blocks = torch.randn(3, 2, 4, 16, 32)
    blocks[1, 0, 2, 5, 7] = bad
    for back in (dequantize_blocks(*quantize_blocks(blocks, fmt), fmt, torch.float32),
                 unpack_blocks(pack_blocks(blocks, fmt), fmt, torch.float32)):
        assert torch.isnan(back[1, 0, 2]).all()
        good = torch.ones(3, 2, 4, dtype=torch.bool)
        good[1, 0, 2] = False
        error = (back - blocks).abs().amax(dim=(-2, -1))[good]
        assert torch.isfinite(back[good]).all()
        clean = blocks.clone()
        clean[1, 0, 2] = 0
        assert (error <= max_abs_error(clean, fmt)[good] * (1 + 1e-5)).all()


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("magnitude", [1e-44, 1e-40, 1.2e-38, torch.finfo(torch.float32).max,
                                       torch.finfo(torch.float32).max / 2])
def test_finite_groups_of_extreme_magnitudes_read_back_finite(fmt, magnitude):
    """A scale that underflowed to 0 (denormals: 0 / 0 gave NaN codes) or whose qmax-fold rounded past float32's
    largest value (read back as inf) made finite values non-finite."""
    from tierkv.quant import dequantize_blocks, quantize_blocks

    x = torch.zeros(2, 2, 2, 4, 8)
    x[0, 0, 0, 0, 0], x[0, 1, 1, 2, 3], x[1, 0, 1, 3, 7] = magnitude, -magnitude, magnitude / 3
    codes, scales = quantize_blocks(x, fmt)
    y = dequantize_blocks(codes, scales, fmt, torch.float32)
    assert torch.isfinite(scales).all() and (scales > 0).all() and torch.isfinite(y).all()
    assert (y - x).abs().max() <= magnitude * (2.0**-4 if fmt != "int8" else 1 / 127)
