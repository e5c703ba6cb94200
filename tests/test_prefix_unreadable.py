"""Prefix reuse when a block the tiers list turns out unreadable (a corrupt disk record, a tier gone
between the lookup and the read): the prefix is reused up to that block and the rest recomputed, with
tokens identical to a run without the fault (`engine.prefix.load_prefix`, `StorageChain.acquire_available`)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.models import build
from tierkv.blocks import chain_block_hashes
from tierkv.config import load_config
from tierkv.llm import TieredLLM
from tierkv.storage import disk_segments as seg

BLOCK_TOKENS = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build("llama", num_heads=8, num_kv_heads=2, seed=1)[0]


def make_llm(model, disk_path, cpu_blocks: int):
    block_bytes = 2 * 2 * BLOCK_TOKENS * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32
    config = {"model": {"name": "test-llama"},
              "cache": {"block_tokens": BLOCK_TOKENS, "gpu_budget_bytes": 12 * block_bytes, "sink_tokens": 4,
                        "window_tokens": 8},
              "tiers": [{"kind": "cpu", "capacity_bytes": cpu_blocks * block_bytes},
                        {"kind": "disk", "path": str(disk_path), "capacity_bytes": "64MiB", "trusted": True}],
              "scheduler": {"lookahead_layers": 1, "staging_bytes": 8 * block_bytes, "prefill_chunk_tokens": 64},
              "metrics": {"enabled": False}}
    return TieredLLM(model, load_config(config, env={}), show_progress=False)


def corrupt_record(root, key: str) -> None:
    """Flip one payload byte of `key`'s record in the disk tier's segments."""
    for name in sorted(os.listdir(root)):
        if not name.endswith(".seg"):
            continue
        fd = os.open(os.path.join(root, name), os.O_RDWR)
        try:
            records, _, _ = seg.scan_segment(fd, os.fstat(fd).st_size)
            hit = [o + h.header_num_bytes for o, h in records if h.key == key]
            if hit:
                byte = os.pread(fd, 1, hit[-1] + 7)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), hit[-1] + 7)
                return
        finally:
            os.close(fd)
    raise AssertionError(f"{key} is not on disk")


@pytest.mark.parametrize("which,layer", [("first", 0), ("middle", 1), ("last", 1)])
def test_a_corrupt_block_cuts_the_prefix_there_and_tokens_stay(model, tmp_path, which, layer):
    """A's blocks pushed to the disk tier by C; one of them (the first, a middle or the last of those the
    CPU tier no longer holds, of one layer) corrupted on disk: the repeat of A reuses the blocks before it."""
    gen = torch.Generator().manual_seed(5)
    a, c = (torch.randint(0, 512, (203,), generator=gen).tolist() for _ in range(2))
    reference = make_llm(model, tmp_path / "ref", cpu_blocks=4096)
    want = reference.generate([a], max_new_tokens=8)[0].token_ids
    reference.close()
    llm = make_llm(model, tmp_path / "disk", cpu_blocks=120)  # C pushes A's blocks out of the CPU tier
    try:
        assert llm.generate([a], max_new_tokens=8)[0].token_ids == want
        llm.generate([c], max_new_tokens=8)
        llm.runtime.chain.flush()
        hashes = chain_block_hashes(a[:200], BLOCK_TOKENS, llm.runtime.fingerprint)
        cpu = llm.runtime.chain.tiers[0]
        on_disk_only = [b for b, h in enumerate(hashes) if not cpu.contains(f"{h}/L{layer}")]
        assert len(on_disk_only) >= 3
        bad_block = {"first": on_disk_only[0], "middle": on_disk_only[len(on_disk_only) // 2],
                     "last": on_disk_only[-1]}[which]
        corrupt_record(tmp_path / "disk", f"{hashes[bad_block]}/L{layer}")
        again = llm.generate([a], max_new_tokens=8)[0]
        assert again.token_ids == want
        assert again.stats["prefix_tokens"] == bad_block * BLOCK_TOKENS  # the blocks before the bad one
        disk = next(t for t in llm.stats()["tiers"] if t["tier"] == "disk")
        assert disk["corrupt_blocks"] == 1
        assert not +cpu._pins  # the blocks pinned past the cut were given back, and the request's at its end
        # the recomputed blocks were saved again: a third run reuses the whole prefix
        assert llm.generate([a], max_new_tokens=8)[0].stats["prefix_tokens"] == 200
    finally:
        llm.close()


def test_under_the_sparse_policy_a_prompts_last_token_is_prefill(model, tmp_path):
    """A prompt's last token run alone (after a reused prefix, or as a one-token last chunk) is prefill,
    exact: the same prompt twice gives the same tokens, the second time from the tiers, and the first
    token equals exact mode's."""
    import dataclasses

    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 512, (65,), generator=gen).tolist()  # 64-token chunks: the last chunk is one token
    exact = make_llm(model, tmp_path / "exact", cpu_blocks=4096)
    want_first = exact.generate([prompt], max_new_tokens=1)[0].token_ids
    exact.close()
    probe = make_llm(model, tmp_path / "probe", cpu_blocks=4096)
    config = probe.config
    probe.close()
    sparse_config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, policy="sparse", sparse_token_budget=8, predictor="none"))
    with TieredLLM(model, sparse_config, show_progress=False) as llm:
        first = llm.generate([prompt], max_new_tokens=6)[0]
        again = llm.generate([prompt], max_new_tokens=6)[0]
    assert first.token_ids[:1] == want_first
    assert again.stats["prefix_tokens"] == 64 and again.token_ids == first.token_ids
