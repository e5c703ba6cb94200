"""`tierkv plan`'s text: the plan `tierkv.cli.plan.make_plan` returns, as the lines a person reads.

Primitives: `format_plan`.
"""
from __future__ import annotations

import importlib

from tierkv.units import format_bytes as fb

VLLM_PLAN = "tierkv.integrations.vllm.plan_gpu"


def _vllm_plan():
    """The vLLM engine's part of the plan (`tierkv.integrations.vllm.plan_gpu`), reached by name as
    TieredLLM reaches its vLLM backend: nothing outside the integration imports it (no vLLM needed)."""
    return importlib.import_module(VLLM_PLAN)


def format_plan(plan: dict) -> str:
    m, g, d, v = plan["model"], plan["gpu"], plan["decode_step"], plan["vllm"]
    held = _held_bytes(g)
    mode = ("sparse, at most: the selection before the far-block caches' hits" if plan["policy"] == "sparse"
            else "exact mode")
    rows = [
        f"model       {m['name']}: {plan['num_layers']} layers x {m['num_kv_heads']} KV heads x {m['head_dim']} dims,"
        f" {m['kv_dtype']} -> {fb(plan['kv_bytes_per_token'])} of KV per token",
        f"request     {plan['context_tokens']} tokens -> {fb(plan['kv_bytes'])} of KV ({plan['blocks_per_layer']} blocks"
        f" of {plan['block_tokens']} tokens per layer, {fb(plan['block_bytes'])} each)",
    ]
    if m.get("max_context") and plan["context_tokens"] > (m.get("scaled_context") or m["max_context"]):
        rows.append(f"warning     the model's max_position_embeddings is {m['max_context']} (longer needs rope scaling)")
    rows += [f"warning     {w}" for w in plan["warnings"]]
    rows += ["", *_tier_rows(plan), "",
             f"decode step ({mode}) at {plan['context_tokens']} tokens: {g['resident_blocks_per_layer_at_decode']}"
             f" blocks per layer read from the GPU, {d['streamed_blocks_per_layer']} streamed",
             f"  H2D per step  {fb(d['streamed_bytes'])}"]
    floor = d["pcie_floor_s"]
    limit = f" (at most {1 / floor:.1f} tokens/s)" if floor > 0 else " (nothing streamed)"
    rows += [f"  PCIe floor    {1e3 * floor:.1f} ms per token at {d['h2d_gbps']:g} GB/s H2D{limit}", "",
             f"vLLM alone  one {plan['context_tokens']}-token request needs a GPU KV pool of"
             f" {fb(v['kv_pool_needed_bytes'])} ({v['block_tokens']}-token blocks);"
             + (f" {v['requests']} at once {fb(v['batch_pool_needed_bytes'])};" if v["requests"] > 1 else "")
             + (f" tierkv holds {fb(held)} " + _share(held, v["batch_pool_needed_bytes"]) if plan["backend"] != "vllm" or g["fits"]
                else " tierkv would hold none: the engine would not start with this budget (above)")]
    if v["kv_pool_bytes"] is None:
        rows.append("            (pass --vllm-kv-pool SIZE to check a given pool)")
    else:
        verdict = "fits: vLLM alone can hold it" if v["fits"] else "does not fit: vLLM refuses to start with this max_model_len"
        rows.append(f"            with --vllm-kv-pool {fb(v['kv_pool_bytes'])}: {verdict}")
    return "\n".join(rows)


def _tier_rows(plan: dict) -> list[str]:
    g, c, L, B = plan["gpu"], plan["cpu"], plan["num_layers"], plan["block_bytes"]

    def row(tier: str, part: str, count: int, unit: str, num_bytes: int, what: str) -> str:
        return f"  {tier:<5}{part:<11}{count:>7} {unit:<8}{fb(num_bytes):>12}   {what}"

    rows = [f"tier layout (per layer, every layer alike; bytes for all {L} layers)"]
    if plan["backend"] == "vllm":
        rows = [*_vllm_plan().vllm_tier_rows(plan), "", *rows]
    else:
        rows += [
            row("GPU", "sinks", g["sink_blocks"], "blocks", g["sink_blocks"] * B * L, "first tokens, always resident"),
            row("GPU", "far cache", g["far_cache_blocks"], "blocks", g["far_cache_blocks"] * B * L, "the next oldest blocks"),
            row("GPU", "window", g["window_blocks"], "blocks", g["window_blocks"] * B * L,
                "most recent tokens + the block being filled"),
            row("GPU", "staging", g["staging_regions"], "regions", g["staging_bytes"], "ring the streamed blocks pass through")]
    n = plan["vllm"]["requests"]
    of = f" of {n} requests" if n > 1 else ""
    rows += [row("CPU", "all blocks", plan["blocks_per_layer"], "blocks", c["bytes_needed"],
                f"every full block{of} is written back; tier 0 holds {fb(c['capacity_bytes'])}: "
                + ("fits" if c["fits"] else f"DOES NOT FIT, {'requests are' if n > 1 else 'the request is'} refused"
                                             " (raise tiers[0].capacity_bytes)"))]
    for tier in plan["lower_tiers"]:
        rows.append(f"  {tier['kind']:<5}{'spill':<11}{'':>7} {'':<8}"
                    f"{fb(tier['capacity_bytes']) if tier['capacity_bytes'] else 'server policy':>12}"
                    "   blocks of earlier requests, for prefix reuse")
    if plan["backend"] == "vllm" and not g["fits"]:
        rows.append(f"GPU KV: none held, the engine would not start with a budget of {fb(g['budget_bytes'])} (above)")
    elif plan["backend"] == "vllm":
        rows.append(f"GPU KV held {fb(g['held_bytes'])}: the budget, everything above inside it")
    else:
        used = (g["sink_blocks"] + g["far_cache_blocks"] + g["window_blocks"]) * B * L
        of_it = f", the blocks above use {fb(used)} of it" if used < g["resident_bytes"] else ""
        summaries = f" + sparse key summaries {fb(g['summary_bytes'])}" if g.get("summary_bytes") else ""
        rows.append(f"GPU KV held {fb(_held_bytes(g))} = resident {fb(g['resident_bytes'])} (budget"
                    f" {fb(g['budget_bytes'])}{of_it}) + staging {fb(g['staging_bytes'])}{summaries}")
    return rows


def _share(held: int, needed: int) -> str:
    """tierkv's GPU KV against what vLLM alone needs: a percentage, or where tierkv holds more (a budget above a
    short request's whole KV), that it does."""
    if held <= needed:
        return f"({100 * held / needed:.1f}%)"
    return "(more than vLLM alone needs: the budget is reserved whole; a smaller --gpu-budget serves this request)"


def _held_bytes(gpu: dict) -> int:
    """GPU bytes the engine holds: under vLLM the budget (staging inside it), else the resident
    blocks plus the staging ring beside them."""
    if gpu.get("backend") == "vllm":
        return gpu["held_bytes"]
    return gpu["resident_bytes"] + gpu["staging_bytes"] + gpu.get("summary_bytes", 0)
