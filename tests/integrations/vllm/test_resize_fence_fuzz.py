"""A random-op state machine over vLLM 0.26's own KVCacheManager / BlockPool (prefix caching off, as the hot
window runs it, and on) and tierkv's PoolResizer: admit (shared or unique prefixes, onto high ids), decode
(the sliding window frees mid-step), finish or preempt, set_gpu_budget to smaller and larger pools, step
boundaries, injected worker and block-pool failures, reset_prefix_cache. After every op: each id free, held
or fenced (`resize_blocks.fence_tail`), exactly once; fenced ids hold no hash and go to no request; a request
admitted while a change waits gets only ids the change keeps; an idle engine leaves nothing pending or fenced;
vLLM's pool and the workers' tensors agree on the block count."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import tests.integrations.vllm.test_resize_apply as ra  # noqa: E402
from tests.integrations.vllm.test_resize_plan import BS, BYTES_PER_BLOCK, NAMES, SPEC, groups  # noqa: E402
from tierkv.budget_change import BudgetRefused  # noqa: E402
from tierkv.integrations.vllm import resize_control  # noqa: E402
from tierkv.integrations.vllm.resize_blocks import _fenced  # noqa: E402

init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def manager_caching(num_blocks: int, caching: bool = True) -> KVCacheManager:
    tensors = [KVCacheTensor(size=num_blocks * SPEC.page_size_bytes, shared_by=[n]) for n in NAMES]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups())
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                          max_in_flight_tokens=256, enable_caching=caching)


def req(req_id: str, tokens, max_tokens: int = 4) -> Request:
    tokens = list(tokens) if not isinstance(tokens, int) else list(range(tokens))
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens), None, block_hasher=HASHER)


def check(manager, where=""):
    """free + held + fenced == num_gpu_blocks - 1, each id in exactly one place."""
    pool = manager.block_pool
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert len(free) == pool.get_num_free_blocks(), where
    held = [b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null]
    fenced = list(_fenced(pool))
    ids = free + held + fenced
    assert len(ids) == len(set(ids)), (where, "an id in two places", sorted(free), sorted(held), sorted(fenced))
    assert sorted(ids) == list(range(1, pool.num_gpu_blocks)), (
        where, "lost", sorted(set(range(1, pool.num_gpu_blocks)) - set(ids)), sorted(fenced))
    assert all(i < pool.num_gpu_blocks for i in ids)
    assert len(pool.blocks) == pool.num_gpu_blocks
    for b in pool.blocks:
        if b.block_id in _fenced(pool):
            assert b.block_hash is None and b.ref_cnt == 0, (where, "fenced block has hash/ref", b)
    return free, held, fenced

COV = {"fenced_steps": 0, "held_steps": 0}


def machine(caching: bool):
    class M(RuleBasedStateMachine):
        @initialize(n=st.sampled_from([24, 40, 64]))
        def start(self, n):
            import tempfile, pathlib
            ra_manager = ra.manager_of
            ra.manager_of = lambda k: manager_caching(k, caching)
            try:
                self.r, self.core, self.worker, _, self.staging = ra.engine_of(pathlib.Path(tempfile.mkdtemp()), num_blocks=n)
            finally:
                ra.manager_of = ra_manager
            self.m = self.core.scheduler.kv_cache_manager
            self.reqs, self.k, self.fail = {}, 0, None
            self.changes = []
            rpc = self.core.collective_rpc

            def maybe_failing_rpc(fn, args=()):
                if self.fail == "worker" and fn is resize_control.resize_worker_kv:
                    self.fail = None
                    raise RuntimeError("worker resize (injected)")
                return rpc(fn, args)
            self.core.collective_rpc = maybe_failing_rpc
            self.at_ask = None

        def _sync(self):
            self.core.scheduler.running = list(self.reqs.values())

        @rule(blocks=st.integers(1, 12), shared=st.booleans())
        def admit(self, blocks, shared):
            self.k += 1
            toks = list(range(blocks * BS)) if shared else list(range(self.k * 10_000, self.k * 10_000 + blocks * BS))
            r = req(f"r{self.k}", toks + [self.k], max_tokens=50)
            comp, hit, _ = self.m.get_computed_blocks(r)
            got = self.m.allocate_slots(r, len(r.prompt_token_ids) - hit, hit, comp)
            check(self.m, "admit")
            if got is not None:
                r.num_computed_tokens = len(r.prompt_token_ids)
                self.reqs[r.request_id] = r
                ids = self.m.get_block_ids(r.request_id)[0]
                assert not set(ids) & set(_fenced(self.m.block_pool)), "fenced id handed to a request"
                if self.r._pending is not None:  # admitted while a change waits: kept ids only
                    target = self.r._plan(self.r._pending[0], ()).new_num_blocks
                    assert max(ids) < target, f"newcomer got dropped id {max(ids)} >= {target}"
            self._sync()

        @rule(leave=st.integers(0, 30), blocks=st.integers(1, 4))
        def admit_at_tail(self, leave, blocks):
            """a filler takes the low free ids, a small request lands on high ids, the filler finishes"""
            free = self.m.block_pool.get_num_free_blocks()
            fill = max(0, free - blocks - leave)
            self.k += 1
            filler = req(f"f{self.k}", range(self.k * 10_000, self.k * 10_000 + fill * BS))
            if fill and self.m.allocate_slots(filler, fill * BS) is None:
                return
            self.admit(blocks, False)
            if fill:
                self.m.free(filler)
            check(self.m, "admit_at_tail")

        @rule(keep=st.integers(8, 40))
        def shrink_under_a_tail_request(self, keep):
            """a request on the pool's last free ids, a shrink below them, a boundary: held there (the random
            rules alone reach it in a few examples only)"""
            self.admit_at_tail(0, 2)
            self.budget(min(keep, self.m.block_pool.num_gpu_blocks - 1))
            self.step()

        @rule(i=st.integers(0, 50), n=st.integers(1, 3 * BS))
        def decode(self, i, n):
            if not self.reqs:
                return
            r = list(self.reqs.values())[i % len(self.reqs)]
            for _ in range(n):
                r.append_output_token_ids(3)
            if self.m.allocate_slots(r, n) is not None:
                r.num_computed_tokens += n
                assert not set(self.m.get_block_ids(r.request_id)[0]) & set(_fenced(self.m.block_pool))
            else:
                del r._output_token_ids[-n:]; del r._all_token_ids[-n:]
            check(self.m, "decode")

        @rule(i=st.integers(0, 50))
        def finish(self, i):
            if self.reqs:
                rid = list(self.reqs)[i % len(self.reqs)]
                self.m.free(self.reqs.pop(rid))
                self._sync()
                check(self.m, "finish")

        @rule(blocks=st.integers(4, 90))
        def budget(self, blocks):
            try:
                self.changes.append(self.r.set_gpu_budget(self.staging + blocks * BYTES_PER_BLOCK))
            except (BudgetRefused, ValueError):
                pass
            check(self.m, "budget")

        @rule()
        def step(self):
            self.core.step_fn()
            COV["fenced_steps"] += bool(_fenced(self.m.block_pool))
            COV["held_steps"] += bool(self.r._pending)
            check(self.m, "step")

        @rule()
        def arm_worker_failure(self):
            self.fail = "worker"

        @rule()
        def step_pool_fails(self):
            real = resize_control.resize_block_pool

            def once(manager, n):
                resize_control.resize_block_pool = real
                raise RuntimeError("pool resize (injected)")
            resize_control.resize_block_pool = once
            try:
                self.core.step_fn()
            finally:
                resize_control.resize_block_pool = real
            check(self.m, "pool fails")

        @rule()
        def reset_cache(self):
            ok = self.m.reset_prefix_cache()
            if not self.reqs and self.r._pending is None:
                assert ok, "idle engine, nothing pending, but reset_prefix_cache refused"
            check(self.m, "reset")

        @invariant()
        def idle_applies(self):
            if not hasattr(self, "r"):
                return
            if not self.reqs and self.r._pending is not None:
                self.core.step_fn()
                assert self.r._pending is None, "idle engine, change still pending"
                assert not _fenced(self.m.block_pool), "idle engine, ids still fenced"
                check(self.m, "idle")
            if self.r._pending is None:
                assert not _fenced(self.m.block_pool), "no pending change but fenced ids"
            assert self.m.kv_cache_config.num_blocks == self.m.block_pool.num_gpu_blocks
            assert all(kv.shape[1] == self.m.block_pool.num_gpu_blocks for kv in ra.bound(self.worker).values())
    return M


@pytest.mark.parametrize("caching", [False, True])
def test_fenced_shrinks_over_random_admissions_frees_and_budgets_lose_no_block(caching):
    M = machine(caching)
    M.TestCase.settings = settings(max_examples=int(os.environ.get("RESIZE_FUZZ_EXAMPLES", 100)), stateful_step_count=60,
                                   deadline=None, suppress_health_check=list(HealthCheck))
    M.TestCase().runTest()
    assert COV["held_steps"] > 0 and COV["fenced_steps"] > 0  # the fuzzer reached held, fenced shrinks
    COV.update(held_steps=0, fenced_steps=0)  # (each parameter reaches them on its own)


def _engine(tmp_path, monkeypatch, caching: bool, num_blocks: int = 64):
    monkeypatch.setattr(ra, "manager_of", lambda n: manager_caching(n, caching))
    return ra.engine_of(tmp_path, num_blocks=num_blocks)


@pytest.mark.parametrize("caching", [False, True])
def test_blocks_the_sliding_window_frees_inside_a_step_are_fenced_before_that_step_allocates(tmp_path, monkeypatch,
                                                                                              caching):
    """A running request's out-of-window blocks are freed inside allocate_slots (mid-step: vLLM puts unhashed
    ones at the head of its free queue, for the same step's next allocation); past a waiting shrink's pool
    they are fenced at once, so a request admitted in that step gets kept ids and the shrink applies when the
    request running at the ask finishes."""
    resizer, core, _, _, staging = _engine(tmp_path, monkeypatch, caching)
    m = core.scheduler.kv_cache_manager
    filler = req("filler", range(10_000, 10_000 + 30 * BS))
    assert m.allocate_slots(filler, 30 * BS) is not None
    old = req("old", range(8 * BS), max_tokens=100)
    assert m.allocate_slots(old, 8 * BS) is not None  # ids 31..38
    old.num_computed_tokens = 8 * BS
    m.free(filler)
    core.scheduler.running = [old]
    change = resizer.set_gpu_budget(staging + 20 * BYTES_PER_BLOCK)
    core.step_fn()
    assert not change.is_done
    old.append_output_token_ids(5)  # one step: old decodes (its window moves, freeing blocks), a newcomer comes
    assert m.allocate_slots(old, 1) is not None
    new = req("new", range(50_000, 50_000 + 4 * BS))
    assert m.allocate_slots(new, 4 * BS) is not None
    check(m, "mid-step")
    assert max(m.get_block_ids("new")[0]) < 20
    core.scheduler.running = [old, new]
    core.step_fn()
    m.free(old)
    core.scheduler.running = [new]
    core.step_fn()
    assert change.is_done and resizer.num_blocks == 20
    check(m, "applied")


def test_a_prefix_shared_with_a_held_tail_block_is_no_hit_while_a_shrink_waits(tmp_path, monkeypatch):
    """Prefix caching on: the held blocks past a waiting shrink's pool lose their hashes, so requests with the
    same prefix do not take those ids (each would hold the shrink back in turn)."""
    resizer, core, _, _, staging = _engine(tmp_path, monkeypatch, caching=True)
    m = core.scheduler.kv_cache_manager
    filler = req("filler", range(10_000, 10_000 + 30 * BS))
    assert m.allocate_slots(filler, 30 * BS) is not None
    prefix = list(range(2 * BS))
    old = req("old", prefix + [7])
    assert m.allocate_slots(old, 2 * BS + 1) is not None
    m.free(filler)
    core.scheduler.running = [old]
    change = resizer.set_gpu_budget(staging + 20 * BYTES_PER_BLOCK)
    core.step_fn()
    assert not change.is_done
    new = req("new", prefix + [100])
    blocks, hit, _ = m.get_computed_blocks(new)
    assert hit == 0
    assert m.allocate_slots(new, 2 * BS + 1 - hit, hit, blocks) is not None
    assert max(m.get_block_ids("new")[0]) < 20
    m.free(old)
    core.scheduler.running = [new]
    core.step_fn()
    assert change.is_done and resizer.num_blocks == 20
    check(m, "applied")
