"""The CPU tier's slot-level two-phase API used by the GPU transfer engine."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from tierkv.blocks import BlockLayout
from tierkv.storage import CpuTier

LAYOUT = BlockLayout(num_kv_heads=1, block_tokens=4, head_dim=8, dtype=torch.float32)


def test_prepared_blocks_are_invisible_until_complete_and_never_evicted():
    tier = CpuTier("cpu", LAYOUT, 2 * LAYOUT.num_bytes)
    slots, evicted = tier.prepare_put(["a", "b"])
    assert sorted(slots) == [0, 1] and evicted == []
    assert not tier.contains("a")
    tier.slab[slots[0]].fill_(1.0)
    tier.slab[slots[1]].fill_(2.0)
    # Both slots are pinned by the pending write: a third block finds no slot.
    assert not tier.put("c", torch.zeros(LAYOUT.shape)).ok
    tier.complete_put(["a", "b"])
    assert torch.equal(tier.get("b"), torch.full(LAYOUT.shape, 2.0))


def test_acquired_blocks_survive_pressure_until_released():
    tier = CpuTier("cpu", LAYOUT, 2 * LAYOUT.num_bytes)
    tier.put("a", torch.full(LAYOUT.shape, 1.0))
    tier.put("b", torch.full(LAYOUT.shape, 2.0))
    (slot_a,) = tier.acquire(["a"])
    result = tier.put("c", torch.full(LAYOUT.shape, 3.0))
    assert result.ok and [k for k, _ in result.evicted] == ["b"]
    assert torch.equal(tier.slab[slot_a], torch.full(LAYOUT.shape, 1.0))
    assert not tier.remove("a")  # pinned
    tier.release(["a"])
    assert tier.remove("a")
    assert tier.acquire(["missing"]) == [None]


def test_eviction_steps_over_a_long_pinned_run_once_and_keeps_lru_order_among_the_rest():
    """Far blocks of a long request stay pinned at the old end of the LRU order; evictions take the
    least recently used unpinned blocks, in order, and do not rescan the pinned run each time."""
    n = 64
    tier = CpuTier("cpu", LAYOUT, (n + 4) * LAYOUT.num_bytes)
    pinned = [f"far{i}" for i in range(n)]
    tier.put_many(pinned, [torch.zeros(LAYOUT.shape)] * n)
    tier.acquire(pinned)
    tier.put_many(["u0", "u1", "u2", "u3"], [torch.ones(LAYOUT.shape)] * 4)
    # acquire made the pinned run recent; make it the oldest again, as time passing would
    for key in pinned:
        tier._slot_of.move_to_end(key, last=False)
    evicted = []
    for i in range(4):
        result = tier.put(f"new{i}", torch.full(LAYOUT.shape, 2.0))
        assert result.ok
        evicted += [k for k, _ in result.evicted]
    assert evicted == ["u0", "u1", "u2", "u3"]
    assert all(tier.contains(k) for k in pinned)
    assert [k for k, _ in tier.put("one-more", torch.zeros(LAYOUT.shape)).evicted] == ["new0"]
    tier.release(pinned)
    assert [k for k, _ in tier.put("after-release", torch.zeros(LAYOUT.shape)).evicted] == ["new1"]  # LRU order kept


def test_pinned_bytes_is_what_pytorchs_pinned_allocator_locks(monkeypatch):
    """PyTorch's pinned allocator rounds to a power of two unless its settings raise the threshold."""
    from tierkv.storage.pinned_slab import pinned_bytes

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert pinned_bytes(81 << 30) == 128 << 30 and pinned_bytes(64 << 30) == 64 << 30
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_max_round_threshold_mb:1024")
    assert pinned_bytes(81 << 30) == 81 << 30  # above the threshold: exact
    assert pinned_bytes(100 << 20) == 128 << 20  # below it: still rounded


def test_a_large_slab_turns_pinned_rounding_off_for_its_size(monkeypatch, caplog):
    """An 81 GiB slab would lock 128 GiB: the tier lowers PyTorch's pinned rounding threshold just
    below its size first (smaller allocations keep theirs), so it locks what it uses, unlogged."""
    import sys

    from tierkv.storage import pinned_slab

    monkeypatch.setitem(sys.modules, "cupy", None)  # no exact cudaHostAlloc route: PyTorch's allocator
    settings = {"value": ""}
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: settings["value"], raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings",
                        lambda value: settings.update(value=value), raising=False)
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert pinned_slab.unrounded_pinning(81 << 30)
    assert settings["value"] == f"pinned_max_round_threshold_mb:{(81 << 10) - 1}"
    assert pinned_slab.pinned_bytes(81 << 30) == 81 << 30 and pinned_slab.pinned_bytes(100 << 20) == 128 << 20
    assert not pinned_slab.unrounded_pinning(3072)  # below a MiB no threshold can help: left alone
    assert settings["value"] == f"pinned_max_round_threshold_mb:{(81 << 10) - 1}"
    # settings already in effect are passed again (a PyTorch may reset the keys it is not given)
    settings["value"] = "expandable_segments:True,pinned_max_round_threshold_mb:100000"
    assert pinned_slab.unrounded_pinning(50 << 30)  # under the 100000 MiB threshold: still rounded before
    assert settings["value"] == f"expandable_segments:True,pinned_max_round_threshold_mb:{(50 << 10) - 1}"

    empty, asked = torch.empty, []

    def fake_pinned(*args, pin_memory=False, **kwargs):
        asked.append(pin_memory)
        return empty(*args, **kwargs)

    settings["value"] = ""
    monkeypatch.setattr(torch, "empty", fake_pinned)
    layout = BlockLayout(8, 64, 128, torch.bfloat16)  # 256 KiB blocks
    CpuTier("wide", layout, 20 * layout.num_bytes, pin_memory=True)  # 5 MiB: would lock 8 MiB
    assert asked[-1] is True and settings["value"] == "pinned_max_round_threshold_mb:4"
    assert "rounds to a power of two" not in caplog.text


def test_a_slab_the_host_cannot_pin_is_a_clear_error(monkeypatch, caplog):
    """Pinning failures name the tier, the bytes and what the allocator asked for; a slab that
    rounding would nearly double is logged (no cupy, so PyTorch's allocator pins it)."""
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)
    empty = torch.empty

    def fail_pinned(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return empty(*args, **kwargs)

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch, "empty", fail_pinned)
    layout = BlockLayout(2, 4, 8, torch.float16)  # 256-byte blocks
    with pytest.raises(RuntimeError, match=r"big: could not pin 3072 bytes .* asks for 4096, .* lower capacity_bytes"):
        CpuTier("big", layout, 12 * layout.num_bytes, pin_memory=True)
    assert "big: its" in caplog.text and "rounds to a power of two" in caplog.text


def test_a_slab_rounding_would_bloat_comes_from_cuda_host_alloc_of_its_exact_size(monkeypatch):
    """With cupy present, the slab is cudaHostAlloc'd at its exact bytes (a fake cupy here, backed
    by host memory) and given back with freeHost once the tier's last view of it is gone."""
    import ctypes
    import gc
    import sys
    from types import SimpleNamespace

    buffers, freed = {}, []

    def host_alloc(num_bytes, flags):
        buffer = ctypes.create_string_buffer(num_bytes)
        buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    runtime = SimpleNamespace(hostAlloc=host_alloc, freeHost=freed.append, CUDARuntimeError=RuntimeError)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    layout = BlockLayout(8, 64, 128, torch.bfloat16)  # 256 KiB blocks
    tier = CpuTier("wide", layout, 20 * layout.num_bytes, pin_memory=True)  # 5 MiB: torch would lock 8 MiB
    (pointer,) = buffers
    assert tier.slab.shape == (20, *layout.shape) and tier.slab.dtype == torch.bfloat16
    assert tier.slab.data_ptr() == pointer
    block = torch.randn(layout.shape).to(torch.bfloat16)
    assert tier.put("k", block).ok and torch.equal(tier.get("k"), block)
    assert freed == []
    tier.close()
    del tier
    gc.collect()
    assert freed == [pointer]


def test_slab_locked_bytes_follows_the_route_the_slab_takes(monkeypatch):
    """What a slab locks: PyTorch's round-up, or its own size when rounding would cost more than
    a quarter and cupy pins it exactly."""
    import sys
    from types import SimpleNamespace

    from tierkv.storage.pinned_slab import slab_locked_bytes

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert slab_locked_bytes(81 << 30) == 128 << 30 and slab_locked_bytes(120 << 30) == 128 << 30
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(__spec__=SimpleNamespace(name="cupy")))
    assert slab_locked_bytes(81 << 30) == 81 << 30  # 47 GiB of rounding: pinned exactly
    assert slab_locked_bytes(120 << 30) == 128 << 30  # 8 GiB of rounding: PyTorch's allocator


def test_a_tier_full_of_pinned_blocks_refuses_puts_without_walking_its_keys():
    """Every visible block pinned (the far blocks of running requests) and the pending writes pinned too:
    a put is refused at once, and the LRU order is left as it was (no walk moved a key); once a block is
    released, it is the one evicted."""
    tier = CpuTier("cpu", LAYOUT, 6 * LAYOUT.num_bytes)
    keys = [f"far{i}" for i in range(4)]
    tier.put_many(keys, [torch.zeros(LAYOUT.shape)] * 4)
    tier.acquire(keys)
    tier.prepare_put(["p0", "p1"])  # the last two slots, pending and pinned
    moves = []

    class Index(OrderedDict):  # the tier's LRU index, counting the keys a walk moves
        def move_to_end(self, key, last=True):
            moves.append(key)
            super().move_to_end(key, last)

    tier._slot_of = Index(tier._slot_of)
    result = tier.put("more", torch.zeros(LAYOUT.shape))
    assert not result.ok and "all 6 slots are pinned" in result.error
    assert moves == []
    tier.complete_put(["p0", "p1"])  # now visible and unpinned: the oldest of them goes first
    assert [k for k, _ in tier.put("more", torch.zeros(LAYOUT.shape)).evicted] == ["p0"]
    tier.release(["far2"])
    tier.acquire(["p1", "more"])
    assert [k for k, _ in tier.put("again", torch.zeros(LAYOUT.shape)).evicted] == ["far2"]
