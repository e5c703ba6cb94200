"""The hot window's CPU-tier pins over whole request lifecycles, as a serving engine drives them: 2-7 requests
sharing prefixes (the same block hashes and bytes), prefill chunks and decodes in random batches, saves left in
flight and polled at random points, preemption with recompute and re-save, aborts, a request finishing while
others still read the shared blocks, small CPU tiers (evictions, spills, promotion from disk), a tensor-parallel
rank suffix, the exact and the sparse policy.

After every step: each request's pinned far slots hold the bytes saved for its blocks and are still where the
keys sit (and on the device, under the sparse policy); the landed saves' per-block pin counts agree with their
pins, each a live CPU pin at its slot. Every layer's far attention equals dense attention over the blocks.
At the end nothing stays pinned. A step the tier refuses ("cannot be pinned in the CPU tier") must be one where
the unpinned and free slots really are fewer than the blocks asked for."""
from __future__ import annotations

import hashlib
import math
import random
import re
import tempfile
from collections import Counter
from pathlib import Path

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tierkv.blocks import BlockLayout
from tierkv.config import load_config
from tierkv.integrations.vllm.far_rows import FarKV
from tierkv.integrations.vllm.store import BlockSpan, VllmKVStore
from tierkv.storage.cpu_blocks import block_group

BS, H, D, LAYERS, HQ = 4, 2, 8, 3, 4
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MAX_BLOCKS = 10  # per request
LAYOUT = BlockLayout(H, BS, D, torch.float32)
REFUSED = "cannot be pinned in the CPU tier"


def ref_block(h: str, layer: int) -> torch.Tensor:
    """The KV of block `h` in `layer`: the same for every request that computes it (same tokens, same KV)."""
    g = torch.Generator().manual_seed(int(hashlib.sha1(f"{h}|{layer}".encode()).hexdigest()[:8], 16))
    return torch.randn(2, H, BS, D, generator=g)


def dense(q, blocks, scale):
    k = blocks[:, 0].permute(0, 2, 1, 3).reshape(-1, H, D).double().repeat_interleave(HQ // H, dim=1)
    v = blocks[:, 1].permute(0, 2, 1, 3).reshape(-1, H, D).double().repeat_interleave(HQ // H, dim=1)
    scores = torch.einsum("nhd,khd->nhk", q.double(), k) * scale
    return torch.einsum("nhk,khd->nhd", torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, dim=-1)


def make_store(root: Path, cpu_blocks: int, staging_blocks: int, tp: tuple[int, int], sparse: int) -> VllmKVStore:
    block_bytes = LAYOUT.num_bytes
    sparse_lines = ["  policy: sparse", f"  sparse_token_budget: {sparse}"] if sparse else []
    (root / "c.yaml").write_text("\n".join([
        "cache:", f"  block_tokens: {BS}", "  window_tokens: 8",
        "tiers:", "  - kind: cpu", f"    capacity_bytes: {cpu_blocks * block_bytes}",
        "  - kind: disk", f"    path: {root / 'disk'}", f"    capacity_bytes: {4096 * block_bytes}", "    trusted: true",
        "scheduler:", "  lookahead_layers: 1", f"  staging_bytes: {staging_blocks * block_bytes}", *sparse_lines]) + "\n")
    return VllmKVStore(load_config(str(root / "c.yaml"), env={}), LAYOUT, NAMES, "m", "cpu", tp_rank=tp[0], tp_size=tp[1])


class Req:
    def __init__(self, rid: str, tokens: list[int], base_id: int, start: int):
        self.rid, self.tokens, self.base_id, self.start = rid, tokens, base_id, start
        self.computed = self.next_save = self.sent = 0
        self.hashes: list[str] = []
        self.state = "waiting"  # waiting / running / finishing / done
        self.scheduled = False


class SlowSave:
    """A save handle that lands only when a poll finds it done (a coin) or waits for it."""

    def __init__(self, handle, rnd):
        self.handle, self.rnd = handle, rnd

    def is_done(self):
        return self.rnd.random() < 0.4

    def synchronize(self):
        self.handle.synchronize()


def check_invariants(store, far, reqs) -> None:
    saves = store.saves
    assert dict(Counter(block_group(k) for k in saves._pins)) == saves._pin_blocks
    for key, slot in saves._pins.items():  # every landed save's pin is a live CPU pin at its slot
        assert store.cpu._slot_of.get(key) == slot and store.cpu._pins.get(key, 0) >= 1, key
    for r in reqs:
        fr = far.requests.get(r.rid)
        if fr is None or not fr.pinned_slots or not fr.pinned_slots[0].numel():
            continue
        n = fr.pinned_slots[0].numel()
        for layer in range(LAYERS):
            slots = fr.pinned_slots[layer]
            want = torch.stack([ref_block(h, layer) for h in fr.hashes[:n]])
            assert torch.equal(store.cpu.read_slots(slots.tolist()), want), f"{r.rid} layer {layer}: wrong far bytes"
            assert [store.cpu._slot_of.get(k) for k in store.keys(fr.hashes[:n], layer)] == slots.tolist()
            if far.pins.device_slots:
                assert torch.equal(fr.pinned_slots_dev[layer][:n].cpu(), slots)


def schedule(data, step: int, reqs: list[Req], finishing: list[Req]) -> None:
    """The scheduler's side of a step: requests start, run, skip a step, are preempted (recompute) or aborted."""
    for r in reqs:
        if r.state not in ("waiting", "running") or step < r.start:
            continue
        act = data.draw(st.sampled_from(["run"] * 8 + ["skip", "preempt", "abort"]), label="act")
        if act == "abort" or (r.state == "running" and r.computed >= len(r.tokens)):
            r.state = "finishing"
            finishing.append(r)
        elif act == "preempt" and r.state == "running":  # vLLM frees its blocks; resumed from a prefix-cache hit
            r.computed = data.draw(st.integers(0, r.computed // BS), label="back") * BS
            event("preempt")
        elif act == "run":
            r.state, r.scheduled = "running", True


def step_saves(data, store, far, rows) -> list[BlockSpan]:
    """The connector metadata: blocks this step fills (less those the tiers hold, when the mask is used), and
    the hashes learnt since the last step."""
    saves = []
    for r, c, n in rows:
        r.next_save = min(r.next_save, c // BS)
        full, first = (c + n) // BS, r.next_save
        if full > first:
            store.extend_hashes(r.hashes, r.tokens, full)
            stored = (store.stored_mask(r.hashes[first:full]) if data.draw(st.booleans(), label="mask")
                      else [False] * (full - first))
            todo = [b for b, held in zip(range(first, full), stored) if not held]
            if todo:
                saves.append(BlockSpan(r.rid, [r.base_id + b for b in todo], [r.hashes[b] for b in todo]))
            r.next_save = full
        store.extend_hashes(r.hashes, r.tokens, c // BS)
        if len(r.hashes) > r.sent:
            far.add_hashes(r.rid, r.sent, r.hashes[r.sent:])
            r.sent = len(r.hashes)
    return saves


def forward(data, store, far, caches, rows, far_rows, saves) -> None:
    """vLLM's cache gets the step's blocks, then per layer: far attention against dense, and the saves."""
    for r, c, n in rows:
        for b in range(c // BS, (c + n) // BS):
            store.extend_hashes(r.hashes, r.tokens, b + 1)
            for layer, name in enumerate(NAMES):
                store.paged.write(caches[name], torch.tensor([r.base_id + b]), ref_block(r.hashes[b], layer).unsqueeze(0))
    q, scale = torch.randn(sum(n for _, _, n in rows), HQ, D), 1 / math.sqrt(D)
    for layer, name in enumerate(NAMES):
        far.prefetch(layer)
        if data.draw(st.booleans(), label="poll_layer"):
            store.poll()
        attended = far.attend(layer, q, scale)  # None when no row has a far block
        for row in far_rows:
            if row.num_far_blocks:
                out, lse = attended
                fr = far.requests[row.req_id]
                blocks = torch.stack([ref_block(h, layer) for h in fr.hashes[: row.num_far_blocks]])
                want_out, want_lse = dense(q[row.q_start:row.q_end], blocks, scale)
                torch.testing.assert_close(out[row.q_start:row.q_end].double(), want_out, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(lse[row.q_start:row.q_end].double(), want_lse, rtol=1e-5, atol=1e-5)
        if saves and (blocks := store.save_layer(layer, caches[name], saves)) is not None:
            far.summarize(layer, saves, blocks)


def run_steps(data, store, far, caches, reqs, n_steps: int) -> None:
    finishing: list[Req] = []
    for step in range(n_steps):
        schedule(data, step, reqs, finishing)
        if data.draw(st.booleans(), label="poll_start"):
            store.poll()
        for r in finishing:
            far.finish(r.rid)
            r.state = "done"
        finishing.clear()
        rows = []
        for r in reqs:
            if r.state == "running" and r.scheduled and r.computed < len(r.tokens):
                rows.append((r, r.computed, data.draw(st.integers(1, min(len(r.tokens) - r.computed, 3 * BS)), label="n")))
            r.scheduled = False
        if not rows:
            continue
        saves = step_saves(data, store, far, rows)
        prompt_steps = [r.rid for r, _, n in rows if n > 1 or data.draw(st.booleans(), label="prompt step")]
        far_rows = far.begin_step([(r.rid, c, n) for r, c, n in rows], prompt_steps=prompt_steps)
        check_invariants(store, far, reqs)
        held = [far.requests[r.rid] for r, _, _ in rows if r.rid in far.requests]
        if any(fr.pinned_groups for fr in held):
            event("far blocks pinned whole")
        if any(any(fr.pinned_keys) for fr in held):
            event("far blocks pinned key by key")
        if far.sparse_rows:
            event("sparse rows")
        forward(data, store, far, caches, rows, far_rows, saves)
        far.end_step()
        if data.draw(st.booleans(), label="poll_end"):
            store.poll()
        for r, c, n in rows:
            r.computed = c + n
        check_invariants(store, far, reqs)


def check_refusal(store, error: RuntimeError) -> None:
    """A refused pin is honest: the unpinned and free slots are fewer than the blocks asked for."""
    cpu = store.cpu
    unpinned = sum(1 for k in cpu._slot_of if not cpu._pin_state.pinned(k)) + len(cpu._free_slots)
    asked = int(re.search(r"all (\d+) found", str(error)).group(1))
    assert unpinned < asked, f"refused with {unpinned} unpinned or free slots for {asked} blocks: {error}"
    event("CPU tier too small: refused")


def run(data, n_req, cpu_blocks, staging_blocks, window, tp, async_saves, sparse, spaced=0) -> None:
    rnd = random.Random(data.draw(st.integers(0, 2**30), label="seed"))
    with tempfile.TemporaryDirectory() as root:
        store = make_store(Path(root), cpu_blocks, staging_blocks, tp, sparse)
        caches = {n: torch.zeros(8 * (MAX_BLOCKS + 1), H, BS, 2 * D) for n in NAMES}
        store.register(caches)
        far = FarKV(store, window, max_model_len=(MAX_BLOCKS + 1) * BS if sparse else None, max_rows=4)
        if async_saves:
            scatter = store.io.scatter
            store.io.scatter = lambda *a, **k: SlowSave(scatter(*a, **k), rnd)
        shared = [rnd.randrange(50) for _ in range(MAX_BLOCKS * BS)]
        reqs = []
        for i in range(n_req):
            nshared = data.draw(st.integers(0, MAX_BLOCKS), label="shared blocks")
            total = data.draw(st.integers(1, MAX_BLOCKS * BS + 3), label="tokens")
            tokens = (shared[: nshared * BS] + [rnd.randrange(50) for _ in range(MAX_BLOCKS * BS + 4)])[:total]
            start = i * spaced + data.draw(st.integers(0, 2)) if spaced else data.draw(st.integers(0, 12), label="start")
            reqs.append(Req(f"r{i}", tokens, i * (MAX_BLOCKS + 1), start))
        n_steps = n_req * spaced + 8 if spaced else data.draw(st.integers(1, 30), label="steps")
        try:
            run_steps(data, store, far, caches, reqs, n_steps)
            for r in reqs:
                far.finish(r.rid)
            store.poll(wait=True)
            cpu, saves = store.cpu, store.saves
            assert not cpu._pins and not cpu._pin_state.blocks.pins and not cpu._pending
            assert not saves._pins and not saves._pin_blocks and not saves._pending
        except RuntimeError as error:
            if REFUSED not in str(error):
                raise
            check_refusal(store, error)
        finally:
            far.close()
            store.close()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), n_req=st.integers(2, 4), cpu_blocks=st.sampled_from([18, 24, 30, 36, 45, 60, 400]),
       staging_blocks=st.sampled_from([4, 64]), window=st.sampled_from([1, BS, BS + 3, 2 * BS]),
       tp=st.sampled_from([(0, 1), (1, 2)]), async_saves=st.booleans(), sparse=st.sampled_from([0, 0, 64 * BS]))
def test_pins_over_request_lifecycles_hold_the_right_bytes_and_balance_to_zero(data, n_req, cpu_blocks, staging_blocks,
                                                                               window, tp, async_saves, sparse):
    run(data, n_req, cpu_blocks, staging_blocks, window, tp, async_saves, sparse)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), n_req=st.integers(4, 7), cpu_blocks=st.sampled_from([15, 21, 27, 36]),
       window=st.sampled_from([1, BS, 2 * BS]), tp=st.sampled_from([(0, 1), (1, 2)]), async_saves=st.booleans(),
       sparse=st.sampled_from([0, 64 * BS]), spaced=st.integers(2, 4))
def test_pins_under_eviction_pressure_with_staggered_requests(data, n_req, cpu_blocks, window, tp, async_saves,
                                                             sparse, spaced):
    run(data, n_req, cpu_blocks, 64, window, tp, async_saves, sparse, spaced=spaced)
