"""A KeyboardInterrupt (Ctrl-C) inside TieredLLM.generate leaves the object usable: the same prompt again
gives a fresh object's tokens, not a refusal, and no CPU-tier slot stays taken for a write that never ran."""
from __future__ import annotations

import pytest
import torch

from tests.models import build
from tests.test_llm import BLOCK_BYTES
from tierkv.config import load_config
from tierkv.llm import TieredLLM
from tierkv.storage import CpuTier
from tests.storage.test_cpu_slots import LAYOUT


def make_llm(disk_path, cpu_blocks: int = 4096) -> TieredLLM:
    """tests.test_llm's setup on a model of fixed weights: two of them give the same tokens."""
    model, _ = build("llama", num_heads=8, num_kv_heads=2, seed=0)
    config = load_config({
        "model": {"name": "test-llama"},
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": cpu_blocks * BLOCK_BYTES},
                  {"kind": "disk", "path": str(disk_path), "capacity_bytes": "64MiB", "trusted": True}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
    }, env={})
    return TieredLLM(model, config, show_progress=False)


class Interrupt:
    """Wraps `fn`; raises KeyboardInterrupt (as a SIGINT between bytecodes would) at its `nth` call."""

    def __init__(self, fn, nth: int):
        self.fn, self.nth, self.calls = fn, nth, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.nth:
            raise KeyboardInterrupt
        return self.fn(*args, **kwargs)


def interrupted_then_again(tmp_path, monkeypatch, prompts, interrupt, cpu_blocks: int = 4096, before=()):
    """Each of `prompts` on a fresh object (5 tokens), then on another that first ran `before` (2 tokens each),
    had `interrupt(runtime)` patched in (its monkeypatch.setattr) and raised KeyboardInterrupt on prompts[0]:
    (the fresh results, the results after the interrupt). No CPU-tier slot stays pending after it or them."""
    fresh = make_llm(tmp_path / "fresh")
    with fresh:
        expected = [fresh.generate([p], max_new_tokens=5)[0] for p in prompts]
    llm = make_llm(tmp_path / "interrupted", cpu_blocks=cpu_blocks)
    rt = llm.runtime
    with llm:
        for p in before:
            llm.generate([p], max_new_tokens=2)
        rt.chain.flush()
        interrupt(rt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([prompts[0]], max_new_tokens=5)
        monkeypatch.undo()
        assert not rt.cpu._pending
        again = [llm.generate([p], max_new_tokens=5)[0] for p in prompts]
        assert not rt.cpu._pending
    return expected, again


@pytest.mark.parametrize("where", ["scatter", "allocate"])
def test_generate_after_an_interrupted_write_back_gives_a_fresh_objects_tokens(tmp_path, monkeypatch, where):
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (203,)).tolist()
    other = torch.randint(0, 512, (150,)).tolist()

    def interrupt(rt):
        if where == "scatter":  # after prepare_put took the slots, before the copy was recorded
            monkeypatch.setattr(rt.io, "scatter", Interrupt(rt.io.scatter, 3))
        else:  # part-way through prepare_put's keys
            monkeypatch.setattr(rt.cpu, "_allocate", Interrupt(rt.cpu._allocate, 5))

    # a CPU tier full of another request's blocks: the slow per-key path of prepare_put (evicting as it goes)
    expected, again = interrupted_then_again(tmp_path, monkeypatch, [prompt, prompt[:120] + other[:60]], interrupt,
                                             cpu_blocks=120, before=[other])
    assert [r.token_ids for r in again] == [r.token_ids for r in expected]


def test_prepare_put_interrupted_part_way_takes_no_slot():
    tier = CpuTier("cpu", LAYOUT, 3 * LAYOUT.num_bytes)
    tier.put_many(["a", "b", "c"], [torch.zeros(LAYOUT.shape)] * 3)  # full: keys are placed one by one, evicting
    tier._allocate = Interrupt(tier._allocate, 2)
    with pytest.raises(KeyboardInterrupt):
        tier.prepare_put(["x", "y"])
    del tier._allocate
    assert not tier._pending and not tier._pins
    slots, _ = tier.prepare_put(["x", "y", "z"])  # every slot free or evictable again
    assert None not in slots


def test_generate_after_an_interrupted_prefix_promotion_gives_a_fresh_objects_tokens(tmp_path, monkeypatch):
    """Ctrl-C while generate copies a prefix found in a lower tier (disk here; Redis takes the same path,
    TierChain._acquire_lower) into the CPU tier: its prepared slots go back, and the prompt is not refused."""
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (203,)).tolist()
    other = torch.randint(0, 512, (150,)).tolist()
    expected, (again,) = interrupted_then_again(  # the prompt's blocks spill to disk under the other's
        tmp_path, monkeypatch, [prompt],
        lambda rt: monkeypatch.setattr(rt.cpu, "write_slots", Interrupt(rt.cpu.write_slots, 1)),
        cpu_blocks=120, before=[prompt, other])
    assert again.token_ids == expected[0].token_ids
    assert again.stats["prefix_tokens"] > 0


def test_interrupt_after_a_write_back_completed_is_not_completed_twice(tmp_path, monkeypatch):
    """Ctrl-C in the write-through hand-off just after a finished D2H copy was made visible (complete_put):
    generate raises the KeyboardInterrupt (not a KeyError from completing the copy again at finish), and the
    prompt then gives a fresh object's tokens."""
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (203,)).tolist()
    expected, (again,) = interrupted_then_again(
        tmp_path, monkeypatch, [prompt],
        lambda rt: monkeypatch.setattr(rt.chain, "write_through", Interrupt(rt.chain.write_through, 2)))
    assert again.token_ids == expected[0].token_ids
