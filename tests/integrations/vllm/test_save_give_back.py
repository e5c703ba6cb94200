"""A save that stops before its copy is in flight (an error from the copy, a Ctrl-C) gives its prepared CPU-tier
slots back (`LayerSaves._start_d2h` through `CpuSlotAccess.prepared_put`); they no longer stay pending for good."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.integrations.vllm.test_store_block_lookup import HASHES, LAYOUT, make_store


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_save_whose_copy_fails_to_start_gives_its_slots_back(monkeypatch, error):
    with tempfile.TemporaryDirectory() as root:
        store = make_store(Path(root), 8, 0, 1)
        try:
            keys = store.keys(HASHES[:4], 0)
            flat = torch.randn(len(keys), *LAYOUT.shape)

            def scatter(*args, **kwargs):
                raise error("the copy could not start")

            monkeypatch.setattr(store.io, "scatter", scatter)
            with pytest.raises(error):
                store.saves._start_d2h(keys, flat)
            monkeypatch.undo()
            assert not store.cpu._pending and not store.cpu._pins and not store.saves._pending
            assert len(store.cpu._free_slots) == store.cpu.num_slots
            store.saves._start_d2h(keys, flat)  # the same save again: every key gets a slot, and lands
            store.poll(wait=True)
            assert store.cpu.contains_many(keys) == [True] * len(keys)
            assert torch.equal(store.cpu.get_many(keys)[0], flat[0])
        finally:
            store.close()
