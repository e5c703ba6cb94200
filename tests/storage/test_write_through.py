"""Write-through: a persistent tier holds every content-addressed block, so a new process reuses prefixes."""
from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.models import build
from tierkv.config import load_config
from tierkv.llm import TieredLLM

BLOCK_BYTES = 2 * 2 * 4 * 16 * 4


def config_for(tmp_path, *, write_through: bool = True, cpu_blocks: int = 4096):
    return load_config({
        "model": {"name": "write-through-llama"},
        "storage": {"secret": "write-through-test-secret-0123"},  # a sealed disk tier, as shipped
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": cpu_blocks * BLOCK_BYTES},
                  {"kind": "disk", "path": str(tmp_path / "disk"), "capacity_bytes": "64MiB",
                   "write_through": write_through}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
    }, env={})


@pytest.mark.parametrize("write_through", [True, False])
def test_a_new_runtime_reuses_a_prefix_only_with_write_through(tmp_path, write_through):
    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=3)
    twin = copy.deepcopy(model)  # the second "process": same weights, its own runtime and CPU tier
    prompt = torch.randint(0, 512, (203,)).tolist()
    with TieredLLM(model, config_for(tmp_path, write_through=write_through), show_progress=False) as first:
        (a,) = first.generate([prompt], max_new_tokens=4)
        first.runtime.chain.flush()
        written = first.stats()["chain"]["written_through"]
    with TieredLLM(twin, config_for(tmp_path, write_through=write_through), show_progress=False) as second:
        (b,) = second.generate([prompt], max_new_tokens=4)
    assert b.token_ids == a.token_ids
    if write_through:
        # 206 tokens have KV (203 + 3 fed back): 51 full blocks x 2 layers, none evicted from the CPU tier
        assert written == 2 * 51
        assert b.stats["prefix_tokens"] == 200 and b.stats["prefix_blocks_by_tier"] == {"disk": 2 * 50}
    else:
        assert written == 0 and b.stats["prefix_tokens"] == 0


def test_a_failing_write_through_tier_is_counted_and_the_request_goes_on(tmp_path, monkeypatch):
    from tierkv.storage.disk import DiskTier
    from tierkv.storage.base import PutResult

    monkeypatch.setattr(DiskTier, "put_many", lambda self, keys, blocks: [PutResult(ok=False, error="disk full")
                                                                        for _ in keys])
    model, reference = build("llama", num_heads=8, num_kv_heads=2, seed=4)
    prompt = torch.randint(0, 512, (77,)).tolist()
    with TieredLLM(model, config_for(tmp_path), show_progress=False) as llm:
        (out,) = llm.generate([prompt], max_new_tokens=4)
        llm.runtime.chain.flush()
        chain = llm.stats()["chain"]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):]
    assert out.token_ids == expected.tolist()
    assert chain["written_through"] == 0 and chain["write_through_failed"] == 2 * 20


def test_a_second_process_reuses_the_first_ones_prefix(tmp_path):
    """Two real processes, one disk directory: the second serves its prefix from disk."""
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {repr(str(__import__('pathlib').Path(__file__).resolve().parents[2]))})
        from tests.models import build
        from tests.storage.test_write_through import config_for
        from tierkv.llm import TieredLLM
        import pathlib
        model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=5)
        torch.manual_seed(0)
        prompt = torch.randint(0, 512, (150,)).tolist()
        with TieredLLM(model, config_for(pathlib.Path({str(tmp_path)!r})), show_progress=False) as llm:
            (out,) = llm.generate([prompt], max_new_tokens=3)
        print(json.dumps({{"tokens": out.token_ids, "prefix": out.stats["prefix_tokens"]}}))
    """)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    import json
    first, second = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert first["prefix"] == 0 and second["prefix"] == 148
    assert second["tokens"] == first["tokens"]


def test_blocks_a_down_tier_missed_are_written_when_it_is_back_and_counted_when_it_never_is(tmp_path, monkeypatch,
                                                                                            caplog):
    """While the write-through tier is down its blocks are deferred (counted), written at the first
    write-through after it is back, so a new runtime reuses that prefix; still down at close: counted
    as failed, and a warning names the tier."""
    from tierkv.storage.disk import DiskTier

    up = {"disk": True}
    monkeypatch.setattr(DiskTier, "is_healthy", property(lambda self: up["disk"]))
    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=6)
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    a, c = (torch.randint(0, 512, (203,), generator=gen).tolist() for _ in range(2))
    with TieredLLM(model, config_for(tmp_path), show_progress=False) as llm:
        up["disk"] = False
        (first,) = llm.generate([a], max_new_tokens=4)
        llm.runtime.chain.flush()
        chain = llm.stats()["chain"]
        assert chain["written_through"] == 0 and chain["write_through_deferred"] == 2 * 51
        assert chain["write_through_backlog"] == 2 * 51
        up["disk"] = True
        llm.generate([c], max_new_tokens=4)  # its write-through takes the backlog along
        llm.runtime.chain.flush()
        chain = llm.stats()["chain"]
        assert chain["written_through"] == 2 * 2 * 51 and chain["write_through_backlog"] == 0
        assert chain["write_through_failed"] == 0
    with TieredLLM(twin, config_for(tmp_path), show_progress=False) as second:
        (again,) = second.generate([a], max_new_tokens=4)
    assert again.token_ids == first.token_ids and again.stats["prefix_tokens"] == 200

    (tmp_path / "down").mkdir()
    llm = TieredLLM(copy.deepcopy(twin), config_for(tmp_path / "down"), show_progress=False)
    up["disk"] = False
    llm.generate([c], max_new_tokens=4)
    chain_obj = llm.runtime.chain
    with caplog.at_level("WARNING", logger="tierkv.storage.chain"):
        llm.close()
    assert chain_obj.snapshot()["chain"]["write_through_failed"] == 2 * 51
    assert any("never reached" in r.getMessage() and "disk" in r.getMessage() for r in caplog.records)
