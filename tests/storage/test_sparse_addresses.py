"""Blocks a sparse-policy engine wrote are never an exact engine's, nor another selection's: the KV of the
tokens it decodes comes from layers that attended a selection of the far blocks (`addresses.sparse_path` in the
fingerprint; the transformers engine never publishes a block holding a decoded token, `SequenceKV._key`). A follow-up turn (the prompt plus the first turn's answer) on a shared disk tier reused that KV
and gave other tokens than transformers (found by a shared-tier probe)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models import build, reference_greedy
from tierkv.addresses import kv_path
from tierkv.blocks import BlockLayout, model_fingerprint
from tierkv.config import load_config
from tierkv.llm import TieredLLM

T = 4
BLOCK = 2 * 2 * T * 16 * 4


def config(disk, policy: str = "exact", **sparse):
    scheduler = {"lookahead_layers": 1, "staging_bytes": 16 * BLOCK, "prefill_chunk_tokens": 64, "policy": policy}
    if policy == "sparse":
        scheduler.update({"sparse_token_budget": T, "predictor": "none", **sparse})
    return load_config({"model": {"name": "sparse-path"},
                        "cache": {"block_tokens": T, "gpu_budget_bytes": 12 * BLOCK, "sink_tokens": T,
                                  "window_tokens": 2 * T},
                        "tiers": [{"kind": "cpu", "capacity_bytes": 400 * BLOCK},
                                  {"kind": "disk", "path": str(disk), "capacity_bytes": "64MiB", "trusted": True}],
                        "scheduler": scheduler}, env={})


@pytest.mark.parametrize("seed", [0, 2])
def test_a_follow_up_turn_never_reuses_a_sparse_engines_decoded_kv(tmp_path, seed):
    model, reference = build("llama", seed=seed)
    prompt = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(seed + 10)).tolist()
    shared = tmp_path / "shared"
    with TieredLLM(model, config(shared, "sparse"), show_progress=False) as sparse:
        answer = sparse.generate([prompt], max_new_tokens=40)[0].token_ids
    follow_up = prompt + list(answer)
    want, _ = reference_greedy(reference, follow_up, 8)
    with TieredLLM(model, config(shared), show_progress=False) as exact:
        got = exact.generate([follow_up], max_new_tokens=8)[0]
    assert got.stats["prefix_tokens"] == 0 and list(got.token_ids) == want
    # the same sparse settings share the prompt's (exact) blocks, never the decoded ones: those depend on what each
    # decode step read, the GPU budget's resident blocks too (another budget, same address, gave other tokens)
    with TieredLLM(model, config(shared, "sparse"), show_progress=False) as same:
        assert same.generate([follow_up], max_new_tokens=1)[0].stats["prefix_tokens"] == len(prompt)
    second = tmp_path / "second"  # (the follow-up's own prefill above published all of it, exactly)
    bigger = config(second, "sparse")
    bigger = dataclasses.replace(bigger, cache=dataclasses.replace(bigger.cache, gpu_budget_bytes=40 * BLOCK))
    with TieredLLM(model, bigger, show_progress=False) as other_budget:
        follow_big = prompt + list(other_budget.generate([prompt], max_new_tokens=40)[0].token_ids)
    with TieredLLM(model, config(tmp_path / "alone", "sparse"), show_progress=False) as alone:
        want_sparse = alone.generate([follow_big], max_new_tokens=8)[0].token_ids
    with TieredLLM(model, config(second, "sparse"), show_progress=False) as again:
        got = again.generate([follow_big], max_new_tokens=8)[0]
    assert got.stats["prefix_tokens"] == len(prompt) and got.token_ids == want_sparse
    with TieredLLM(model, config(shared, "sparse", sparse_token_budget=2 * T), show_progress=False) as other:
        assert other.generate([follow_up], max_new_tokens=1)[0].stats["prefix_tokens"] == 0


def test_every_setting_that_changes_what_decode_attends_changes_the_address(tmp_path):
    layout = BlockLayout(2, T, 16, torch.float32)
    base = config(tmp_path, "sparse")

    def address(cfg):
        return model_fingerprint("m", 2, layout, kv_path(cfg))

    def changed(section, **fields):
        return dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **fields)})

    seen = {address(base), address(config(tmp_path))}
    for section, fields in [("scheduler", {"sparse_token_budget": 2 * T}), ("scheduler", {"sparse_selection": "per_kv_head"}),
                            ("scheduler", {"sparse_bound_weight": 0.5}), ("cache", {"sink_tokens": 0}),
                            ("cache", {"window_tokens": 4 * T})]:
        seen.add(address(changed(section, **fields)))
    assert len(seen) == 7
    # what only moves copies (prefetch) keeps the address; the exact policy's addresses are as before
    assert address(changed("scheduler", predictor="previous", lookahead_layers=2)) == address(base)
    assert address(config(tmp_path)) == model_fingerprint("m", 2, layout)
