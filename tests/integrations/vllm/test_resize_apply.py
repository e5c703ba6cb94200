"""Run-time resize of the vLLM hot-window pool, applying it on CPU: the worker's KV tensors
(vLLM's own allocation routine), the step-boundary policy over vLLM's own KVCacheManager, and a
failure half-way leaving the old pool. The runner and engine core are small namespaces carrying
what a GPU runner and an EngineCore carry (neither constructs without a GPU)."""
from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.vllm.test_resize_plan import (
    BS, BYTES_PER_BLOCK, D, FIXED_STAGING, H, NAMES, SPEC, groups, manager_of, pool_state, request, write_config)

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402
from vllm.v1.worker.utils import bind_kv_cache  # noqa: E402

from tierkv.budget_change import BudgetRefused  # noqa: E402
from tierkv.config import load_config  # noqa: E402
from tierkv.integrations.vllm import resize_control  # noqa: E402
from tierkv.integrations.vllm.resize_control import POLICY, PoolResizer, missing_vllm_hooks  # noqa: E402
from tierkv.integrations.vllm.resize_plan import split_budget  # noqa: E402
from tierkv.integrations.vllm.resize_worker import missing_worker_hooks, resize_worker_kv  # noqa: E402


class _Impl:
    def __init__(self):
        self.forgotten = 0

    def forget_pool(self):
        self.forgotten += 1


def worker_of(num_blocks: int) -> SimpleNamespace:
    """A worker whose runner allocates by vLLM's GPUModelRunner._allocate_kv_cache_tensors, on CPU,
    in FlashAttention's layout [2, blocks, BS, H, D], and binds by vLLM's bind_kv_cache."""
    tensors = [KVCacheTensor(size=num_blocks * SPEC.page_size_bytes, shared_by=[n]) for n in NAMES]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups())
    context = {n: SimpleNamespace(kv_cache=None, impl=_Impl()) for n in NAMES}
    runner = SimpleNamespace(device=torch.device("cpu"), runner_only_attn_layers=set(), kv_cache_config=config,
                             kv_caches=[], _kernel_block_sizes=[BS], cache_config=SimpleNamespace(num_gpu_blocks=num_blocks),
                             compilation_config=SimpleNamespace(static_forward_context=context))
    runner._allocate_kv_cache_tensors = partial(GPUModelRunner._allocate_kv_cache_tensors, runner)
    runner._reshape_kv_cache_tensors = lambda raw, sizes: {n: t.view(torch.float32).view(2, -1, BS, H, D)
                                                           for n, t in raw.items()}
    caches = runner._reshape_kv_cache_tensors(runner._allocate_kv_cache_tensors(config), [BS])
    for kv in caches.values():
        kv.normal_()
    bind_kv_cache(caches, context, runner.kv_caches)
    return SimpleNamespace(model_runner=runner)


def bound(worker) -> dict[str, torch.Tensor]:
    return {n: layer.kv_cache for n, layer in worker.model_runner.compilation_config.static_forward_context.items()}


def test_vllm_has_what_the_resize_uses():
    assert missing_worker_hooks() == [] and missing_vllm_hooks() == []


def test_a_moved_runner_method_is_named(monkeypatch):
    monkeypatch.delattr(GPUModelRunner, "_reshape_kv_cache_tensors")
    assert "GPUModelRunner._reshape_kv_cache_tensors" in missing_worker_hooks()


@pytest.mark.parametrize("old, new", [(64, 20), (20, 50), (30, 30)])
def test_the_workers_tensors_take_the_new_block_count_and_keep_the_leading_blocks(old, new):
    worker = worker_of(old)
    before = {n: kv.clone() for n, kv in bound(worker).items()}
    result = resize_worker_kv(worker, new)
    runner, kept = worker.model_runner, min(old, new)
    for name, kv in bound(worker).items():
        assert kv.shape == (2, new, BS, H, D)
        assert torch.equal(kv[:, :kept], before[name][:, :kept])
    assert [t.data_ptr() for t in runner.kv_caches] == [kv.data_ptr() for kv in bound(worker).values()]
    assert runner.kv_cache_config.num_blocks == runner.cache_config.num_gpu_blocks == new
    assert [t.size for t in runner.kv_cache_config.kv_cache_tensors] == [new * SPEC.page_size_bytes] * len(NAMES)
    if old != new:
        assert result["old_bytes"] == old * BYTES_PER_BLOCK and result["new_bytes"] == new * BYTES_PER_BLOCK
        assert all(layer.impl.forgotten == 1 for layer in runner.compilation_config.static_forward_context.values())
        # one allocation behind every layer (per-layer tensors under 10 MiB share the caching allocator's 20 MiB
        # segments, which a later shrink could not give back whole), each layer's view its own bytes
        kvs = list(bound(worker).values())
        assert len({kv.untyped_storage().data_ptr() for kv in kvs}) == 1
        spans = sorted((kv.data_ptr(), kv.data_ptr() + kv.numel() * kv.element_size()) for kv in kvs)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        kvs[0].fill_(1.0)
        assert all(torch.equal(kv[:, :kept], before[n][:, :kept]) for n, kv in list(bound(worker).items())[1:])


@pytest.mark.parametrize("old, new", [(40, 17), (17, 1), (1, 55)])
def test_a_mamba_layers_state_tensors_keep_their_leading_blocks(old, new):
    """vLLM binds a Mamba layer's cache as a list of state tensors (each [blocks, ...], views of the layer's
    buffer): each keeps its leading blocks, and the bytes count each allocation once (found by a probe of hybrid
    attention + Mamba models: the copy read the list as one tensor and the resize failed)."""
    worker = worker_of(old)
    runner, mamba = worker.model_runner, NAMES[-1]
    floats = SPEC.page_size_bytes // 4
    attention = runner._reshape_kv_cache_tensors

    def reshape(raw, sizes):
        caches = attention({n: t for n, t in raw.items() if n != mamba}, sizes)
        rows = raw[mamba].view(torch.float32).view(-1, floats)  # a block's bytes: conv state, then SSM state
        caches[mamba] = [rows[:, : floats // 4], rows[:, floats // 4 :]]
        return caches

    runner._reshape_kv_cache_tensors = reshape
    context = runner.compilation_config.static_forward_context
    context[mamba].kv_cache = reshape(runner._allocate_kv_cache_tensors(runner.kv_cache_config), [BS])[mamba]
    for state in context[mamba].kv_cache:
        state.normal_()
    before = {n: [t.clone() for t in kv] if isinstance(kv, list) else kv.clone() for n, kv in bound(worker).items()}
    result = resize_worker_kv(worker, new)
    kept = min(old, new)
    for name, kv in bound(worker).items():
        if name == mamba:
            assert [t.shape[0] for t in kv] == [new, new]
            assert all(torch.equal(t[:kept], b[:kept]) for t, b in zip(kv, before[name]))
        else:
            assert kv.shape[1] == new and torch.equal(kv[:, :kept], before[name][:, :kept])
    assert result["old_bytes"] == old * BYTES_PER_BLOCK and result["new_bytes"] == new * BYTES_PER_BLOCK


@pytest.mark.parametrize("where", ["allocate", "reshape"])
def test_a_worker_failure_half_way_leaves_the_old_tensors_bound(where):
    worker = worker_of(64)
    runner = worker.model_runner
    before, config = bound(worker), runner.kv_cache_config
    if where == "allocate":
        def fail(config):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        runner._allocate_kv_cache_tensors = fail
    else:  # tensors of the wrong layout: the copy refuses them
        runner._reshape_kv_cache_tensors = lambda raw, sizes: {n: t.view(torch.float32).view(-1, BS, H, D)
                                                               for n, t in raw.items()}
    with pytest.raises((torch.OutOfMemoryError, ValueError)):
        resize_worker_kv(worker, 20)
    assert all(bound(worker)[n] is before[n] for n in NAMES) and runner.kv_cache_config is config
    assert [t.data_ptr() for t in runner.kv_caches] == [before[n].data_ptr() for n in NAMES]


def engine_of(tmp_path, num_blocks: int = 64, graphs: str = "NONE", step_s: float = 0.0, on_step=None,
              sleep_mode: bool = False):
    """(PoolResizer, engine core, worker, steps run) over vLLM's KVCacheManager and a CPU worker;
    each step takes step_s seconds and calls on_step() (if given) inside it."""
    manager, worker, steps = manager_of(num_blocks), worker_of(num_blocks), []
    scheduler = SimpleNamespace(kv_cache_manager=manager, running=[])
    scheduler.has_unfinished_requests = lambda: bool(scheduler.running)
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2 * BS, max_num_seqs=2),
        model_config=SimpleNamespace(max_model_len=4096, enable_sleep_mode=sleep_mode), cache_config=SimpleNamespace(num_gpu_blocks=num_blocks),
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=graphs)))
    def abort_requests(ids):  # vLLM's: the scheduler finishes them, their blocks freed
        for req in [r for r in scheduler.running if r.request_id in ids]:
            scheduler.running.remove(req)
            manager.free(req)

    core = SimpleNamespace(scheduler=scheduler, vllm_config=vllm_config, batch_queue=None,
                           step_fn=lambda: (time.sleep(step_s), on_step and on_step(), steps.append(len(steps))),
                           collective_rpc=lambda fn, args=(): [fn(worker, *args)], abort_requests=abort_requests,
                           post_step=lambda model_executed: steps.append(("post", model_executed)))
    config = load_config(write_config(tmp_path, window=4 * BS, staging_blocks=8, scheduler_lines=FIXED_STAGING))
    split = partial(split_budget, config)
    budget = config.scheduler.staging_bytes + num_blocks * BYTES_PER_BLOCK
    return PoolResizer(core, split, budget), core, worker, steps, config.scheduler.staging_bytes


def test_between_requests_a_change_applies_at_once(tmp_path):
    resizer, core, worker, _, staging = engine_of(tmp_path)
    resizer.set_gpu_budget(staging + 20 * BYTES_PER_BLOCK).wait(0)
    assert pool_state(core.scheduler.kv_cache_manager)[:3] == (20, list(range(20)), 19)
    assert all(kv.shape[1] == 20 for kv in bound(worker).values())
    stats = resizer.stats()
    assert stats["pool_blocks"] == 20 and stats["returned_bytes"] == 44 * BYTES_PER_BLOCK
    assert stats["budget_changes"] == 1 and stats["pending_budget_bytes"] is None and stats["resize_policy"] == POLICY
    resizer.set_gpu_budget(staging + 50 * BYTES_PER_BLOCK).wait(0)
    assert resizer.stats()["taken_bytes"] == 30 * BYTES_PER_BLOCK and resizer.num_blocks == 50


def running_on_ids_31_32(core):
    """The engine's one running request, "tail", holding block ids 31 and 32 (a filler took 1..30 first)."""
    manager = core.scheduler.kv_cache_manager
    filler, tail = request("filler", 30 * BS), request("tail", 2 * BS)
    assert manager.allocate_slots(filler, 30 * BS) is not None and manager.allocate_slots(tail, 2 * BS) is not None
    manager.free(filler)
    core.scheduler.running = [tail]
    return tail


def test_a_shrink_over_a_running_requests_blocks_waits_for_the_step_boundary_where_they_are_free(tmp_path):
    resizer, core, worker, steps, staging = engine_of(tmp_path)
    manager = core.scheduler.kv_cache_manager
    tail = running_on_ids_31_32(core)
    before = {n: kv.clone() for n, kv in bound(worker).items()}
    first = resizer.set_gpu_budget(staging + 24 * BYTES_PER_BLOCK)
    second = resizer.set_gpu_budget(staging + 20 * BYTES_PER_BLOCK)  # replaces the first before it applied
    assert not first.is_done and resizer.stats()["pending_budget_bytes"] == second.budget_bytes
    assert resizer.stats()["pending_held_blocks"] == 2 and resizer.num_blocks == 64
    core.step_fn()
    assert steps == [0] and not second.is_done  # still held
    manager.free(tail)
    core.scheduler.running = []
    core.step_fn()  # applied at this boundary
    assert first.wait(0) and second.wait(0) and resizer.num_blocks == 20 and steps == [0, 1]
    assert all(torch.equal(kv, before[n][:, :20]) for n, kv in bound(worker).items())


def test_a_grow_during_requests_applies_at_the_step_boundary_and_keeps_their_blocks(tmp_path):
    resizer, core, worker, _, staging = engine_of(tmp_path, num_blocks=20)
    manager = core.scheduler.kv_cache_manager
    req = request("a", 5 * BS)
    assert manager.allocate_slots(req, 5 * BS) is not None
    core.scheduler.running = [req]
    before = {n: kv.clone() for n, kv in bound(worker).items()}
    resizer.set_gpu_budget(staging + 40 * BYTES_PER_BLOCK).wait(0)
    assert resizer.stats()["changes_during_requests"] == 1 and manager.block_pool.get_num_free_blocks() == 39 - 5
    assert all(torch.equal(kv[:, :20], before[n]) for n, kv in bound(worker).items())


def test_a_refused_budget_changes_nothing(tmp_path):
    resizer, core, worker, _, staging = engine_of(tmp_path)
    manager = core.scheduler.kv_cache_manager
    reqs = [request(f"r{i}", 3 * BS) for i in range(4)]
    for req in reqs:
        assert manager.allocate_slots(req, 3 * BS) is not None
    core.scheduler.running = reqs
    before, tensors = pool_state(manager), bound(worker)
    with pytest.raises(BudgetRefused, match="4 running requests"):
        resizer.set_gpu_budget(staging + 12 * BYTES_PER_BLOCK)
    with pytest.raises(ValueError, match="budget"):
        resizer.set_gpu_budget("-1GiB")
    assert pool_state(manager) == before and all(bound(worker)[n] is tensors[n] for n in NAMES)
    stats = resizer.stats()
    assert stats["budget_refusals"] == 2 and stats["last_budget_refusal"].startswith("budget:")


def test_captured_cuda_graphs_refuse_a_resize(tmp_path):
    resizer, core, _, _, staging = engine_of(tmp_path, graphs="FULL_AND_PIECEWISE")
    with pytest.raises(BudgetRefused, match="enforce_eager"):
        resizer.set_gpu_budget(staging + 20 * BYTES_PER_BLOCK)
    assert resizer.num_blocks == 64


def test_an_engine_in_sleep_mode_refuses_a_resize_before_anything_changes(tmp_path):
    """vLLM's sleep mode frees and maps back the pool it allocated in its CuMem allocator; tensors a resize made
    outside it would stay through sleep(): the resize is refused, by name."""
    resizer, core, worker, _, staging = engine_of(tmp_path, sleep_mode=True)
    before = {n: kv.data_ptr() for n, kv in bound(worker).items()}
    with pytest.raises(BudgetRefused, match="sleep mode"):
        resizer.set_gpu_budget(staging + 20 * BYTES_PER_BLOCK)
    assert resizer.num_blocks == 64 and {n: kv.data_ptr() for n, kv in bound(worker).items()} == before
    assert resizer.stats()["budget_refusals"] == 1


@pytest.mark.parametrize("where", ["workers", "block_pool"])
def test_a_failure_half_way_leaves_the_old_pool_working(tmp_path, monkeypatch, where):
    resizer, core, worker, _, staging = engine_of(tmp_path)
    manager = core.scheduler.kv_cache_manager
    before_state, before = pool_state(manager), {n: kv.clone() for n, kv in bound(worker).items()}
    if where == "workers":
        def fail(config):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        worker.model_runner._allocate_kv_cache_tensors = fail
    else:  # the workers resized, then the scheduler's pool failed: the workers go back
        def fail(manager, num_blocks):
            raise RuntimeError("block pool (simulated)")
        monkeypatch.setattr(resize_control, "resize_block_pool", fail)
    change = resizer.set_gpu_budget(staging + 100 * BYTES_PER_BLOCK)
    with pytest.raises(BudgetRefused, match="the pool stays 64 blocks"):
        change.wait(0)
    assert pool_state(manager) == before_state and resizer.stats()["budget_refusals"] == 1
    assert all(torch.equal(kv, before[n]) for n, kv in bound(worker).items())
    assert manager.allocate_slots(request("after", 3 * BS), 3 * BS) is not None  # the old pool still serves


def vllm_llm(resizer, error: str | None = None):
    from tierkv.integrations.vllm.llm import VllmTieredLLM

    llm = object.__new__(VllmTieredLLM)
    llm.resizer, llm._resize_error = resizer, error
    return llm


def test_the_vllm_backend_resizes_through_its_resizer_and_waits_for_a_held_change(tmp_path):
    resizer, core, _, _, staging = engine_of(tmp_path)
    llm = vllm_llm(resizer)
    llm.set_gpu_budget(f"{staging + 20 * BYTES_PER_BLOCK}B")
    assert resizer.num_blocks == 20
    manager = core.scheduler.kv_cache_manager
    held = request("held", 19 * BS)
    assert manager.allocate_slots(held, 19 * BS) is not None  # ids 1..19: a shrink to 10 must wait
    core.scheduler.running = [held]
    with pytest.raises(BudgetRefused, match="running requests"):
        llm.set_gpu_budget(staging + 10 * BYTES_PER_BLOCK)
    manager.free(held)
    keep = request("keep", 2 * BS)
    assert manager.allocate_slots(keep, 2 * BS) is not None
    keep_ids = manager.get_block_ids("keep")[0]
    core.scheduler.running = [keep]
    target = max(keep_ids)  # drops the request's last block: held until it is free
    with pytest.raises(TimeoutError, match="did not take effect"):
        llm.set_gpu_budget(staging + target * BYTES_PER_BLOCK, timeout_s=0.01)
    assert resizer.stats()["pending_budget_bytes"] == staging + target * BYTES_PER_BLOCK


def test_the_vllm_backend_without_a_resizer_says_why():
    with pytest.raises(NotImplementedError, match="backend='vllm': hot_window=False keeps vLLM's full pool"):
        vllm_llm(None, "hot_window=False keeps vLLM's full pool").set_gpu_budget("1GiB")


def test_the_control_endpoint_reaches_the_vllm_resize_and_maps_its_refusals(tmp_path):
    import io
    import json

    from tierkv.metrics.control import BudgetControl

    resizer, _, _, _, staging = engine_of(tmp_path)
    control = BudgetControl(vllm_llm(resizer).set_gpu_budget, "s3cret-token-for-tests-0123456789")

    def post(budget):
        body = json.dumps({"budget": budget}).encode()
        environ = {"REQUEST_METHOD": "POST", "HTTP_AUTHORIZATION": "Bearer s3cret-token-for-tests-0123456789",
                   "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body)}
        status = []
        control.handle(environ, lambda s, headers: status.append(s))
        return status[0]

    assert post(staging + 20 * BYTES_PER_BLOCK).startswith("200") and resizer.num_blocks == 20
    assert post(staging + 2 * BYTES_PER_BLOCK).startswith("409") and resizer.num_blocks == 20
    assert post("lots").startswith("400")


@pytest.mark.parametrize("grow", [True, False])
def test_a_change_made_while_the_engine_steps_back_to_back_applies_at_a_boundary_during_the_request(tmp_path, grow):
    """The engine's thread runs steps back to back (each holding the step lock, as vLLM's loop does);
    a change from another thread applies at a boundary while the request still runs, not once the
    engine goes idle (a caller blocked on the step lock lost it to the loop at every boundary: seen on
    the H200, where a grow made during a 16k request applied only after the request finished)."""
    resizer, core, _, steps, staging = engine_of(tmp_path, num_blocks=40, step_s=0.002)
    manager = core.scheduler.kv_cache_manager
    req = request("a", 5 * BS)
    assert manager.allocate_slots(req, 5 * BS) is not None
    core.scheduler.running = [req]
    stop = threading.Event()

    def engine_loop():  # vLLM's loop: the wrapped step, again and again, while the request runs
        while not stop.is_set():
            core.step_fn()

    thread = threading.Thread(target=engine_loop)
    thread.start()
    try:
        time.sleep(0.02)
        new_blocks = 60 if grow else 20
        started = time.perf_counter()
        assert resizer.wait(resizer.set_gpu_budget(staging + new_blocks * BYTES_PER_BLOCK), timeout_s=5.0)
        took = time.perf_counter() - started
        at_change = len(steps)
        deadline = time.monotonic() + 5.0
        while len(steps) < at_change + 3 and time.monotonic() < deadline:  # the loop steps on past the change
            time.sleep(0.001)
    finally:
        stop.set()
        thread.join()
    # applied between running steps (a change that waited for the engine to go idle would time out the 5 s wait;
    # the bound leaves a loaded 2-core machine seconds)
    assert took < 4.0 and at_change > 0 and len(steps) >= at_change + 3
    assert resizer.num_blocks == new_blocks and resizer.stats()["changes_during_requests"] == 1


def test_a_change_left_pending_when_the_engine_goes_idle_is_applied_by_the_waiting_caller(tmp_path):
    resizer, core, _, steps, staging = engine_of(tmp_path, num_blocks=40)
    in_step, step_over = threading.Event(), threading.Event()

    def a_step_on_the_engine_thread():  # holds the step lock, as a running step does
        with resizer._step_lock:
            in_step.set()
            step_over.wait()

    engine = threading.Thread(target=a_step_on_the_engine_thread)
    engine.start()
    in_step.wait()
    change = resizer.set_gpu_budget(staging + 30 * BYTES_PER_BLOCK)  # queued for the step's boundary
    assert not change.is_done and resizer.stats()["pending_budget_bytes"] == change.budget_bytes
    step_over.set()  # the step ends without running the wrapper's boundary, and the engine goes idle
    engine.join()
    assert resizer.wait(change, timeout_s=1.0) and resizer.num_blocks == 30 and steps == []


def test_a_shrink_whose_workers_fail_keeps_every_id_the_pool_hands_out_inside_their_tensors(tmp_path):
    """A shrink cuts vLLM's pool first, then the workers. Under tensor parallelism one rank may shrink while
    another fails, and the shrunk one may not get its old tensors back (the memory a shrink gives back is what
    another process takes): the pool stays at the smaller size every worker holds (it kept the old size with
    the workers at the new one: ids past the GPU tensors; found by a resize probe)."""
    resizer, core, worker, _, staging = engine_of(tmp_path)
    manager = core.scheduler.kv_cache_manager
    rpc, allocate = core.collective_rpc, worker.model_runner._allocate_kv_cache_tensors

    def another_rank_fails(fn, args=()):
        rpc(fn, args)  # this rank shrinks
        raise RuntimeError("rank 1: CUDA out of memory (simulated)")
    core.collective_rpc = another_rank_fails

    def no_memory_to_grow(config):
        if config.num_blocks > 20:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: the freed bytes were taken)")
        return allocate(config)
    worker.model_runner._allocate_kv_cache_tensors = no_memory_to_grow
    with pytest.raises(BudgetRefused, match="the pool stays 20 blocks"):
        resizer.set_gpu_budget(staging + 20 * BYTES_PER_BLOCK).wait(0)
    assert resizer.num_blocks == 20 and all(kv.shape[1] == 20 for kv in bound(worker).values())
    ids = manager.allocate_slots(request("after", 10 * BS), 10 * BS).get_block_ids()[0]
    assert max(ids) < 20


def test_a_shrink_whose_workers_fail_once_goes_back_whole(tmp_path):
    resizer, core, worker, _, staging = engine_of(tmp_path)
    manager = core.scheduler.kv_cache_manager
    before_state, before = pool_state(manager), {n: kv.clone() for n, kv in bound(worker).items()}
    allocate, calls = worker.model_runner._allocate_kv_cache_tensors, []

    def fail_once(config):
        calls.append(config.num_blocks)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return allocate(config)
    worker.model_runner._allocate_kv_cache_tensors = fail_once
    with pytest.raises(BudgetRefused, match="the pool stays 64 blocks"):
        resizer.set_gpu_budget(staging + 20 * BYTES_PER_BLOCK).wait(0)
    assert pool_state(manager) == before_state
    assert all(torch.equal(kv, before[n]) for n, kv in bound(worker).items())


def test_a_failure_evicting_a_dropped_block_leaves_the_pool_whole(tmp_path):
    """The shrink evicts every dropped block's cached hash before it unlinks any: a failure there leaves every
    block in the free queue (one unlinked block was lost for good, and a later shrink waited on it forever)."""
    resizer, core, _, _, staging = engine_of(tmp_path, num_blocks=20)
    manager = core.scheduler.kv_cache_manager
    pool, before_state = manager.block_pool, pool_state(manager)
    evict, calls = pool._maybe_evict_cached_block, []

    def flaky(block):
        calls.append(block.block_id)
        if len(calls) == 2:
            raise RuntimeError("evict (simulated)")
        return evict(block)
    pool._maybe_evict_cached_block = flaky
    with pytest.raises(BudgetRefused, match="the pool stays 20 blocks"):
        resizer.set_gpu_budget(staging + 8 * BYTES_PER_BLOCK).wait(0)
    del pool._maybe_evict_cached_block
    assert pool_state(manager) == before_state and pool.get_num_free_blocks() == 19
    change = resizer.set_gpu_budget(staging + 8 * BYTES_PER_BLOCK)
    assert resizer.wait(change, 1.0) and resizer.num_blocks == 8


def test_the_watermark_follows_the_pool_without_decaying(tmp_path):
    resizer, core, _, _, staging = engine_of(tmp_path)
    manager = core.scheduler.kv_cache_manager
    manager.watermark_blocks = int(0.05 * 64)  # vLLM's int(watermark x num_blocks)
    for blocks in (20, 64, 20, 64):
        resizer.set_gpu_budget(staging + blocks * BYTES_PER_BLOCK).wait(0)
    assert manager.watermark_blocks == 3  # rescaling the rounded count went 3 -> 0 -> 0
    resizer.set_gpu_budget(staging + 200 * BYTES_PER_BLOCK).wait(0)
    assert manager.watermark_blocks == 9


def test_a_change_asked_from_inside_a_step_applies_at_its_end(tmp_path):
    """The step lock is re-entrant: a set_gpu_budget from the engine's own thread inside a step (a callback)
    resized in the middle of that step (found by a resize probe). It now queues, applies at the step's end, and
    waiting for it there is refused rather than blocking the step that would apply it."""
    seen = {}

    def a_callback_in_the_step():
        change = seen["resizer"].set_gpu_budget(seen["staging"] + 20 * BYTES_PER_BLOCK)
        seen["inside"] = seen["resizer"].num_blocks
        with pytest.raises(RuntimeError, match="inside vLLM's step"):
            seen["resizer"].wait(change, None)
        seen["change"] = change

    resizer, core, _, _, staging = engine_of(tmp_path, num_blocks=40, on_step=a_callback_in_the_step)
    seen.update(resizer=resizer, staging=staging)
    core.step_fn()
    assert seen["inside"] == 40 and resizer.num_blocks == 20 and seen["change"].wait(0)


def _held_shrink(tmp_path):
    """An engine of 64 blocks whose running request "tail" holds ids 31 and 32, and a shrink to 20 blocks
    asked and held at one step boundary: (resizer, core, the change, the tail request, staging)."""
    resizer, core, _, _, staging = engine_of(tmp_path)
    tail = running_on_ids_31_32(core)
    change = resizer.set_gpu_budget(staging + 20 * BYTES_PER_BLOCK)
    core.step_fn()
    assert not change.is_done and resizer.stats()["pending_held_blocks"] == 2
    return resizer, core, change, tail, staging


def test_a_held_shrink_keeps_the_ids_it_drops_from_requests_admitted_meanwhile(tmp_path):
    """While a shrink waits for a running request's tail blocks, the free ids past the new pool leave vLLM's
    free queue (fenced): a request admitted meanwhile gets only kept ids, so the shrink applies once the
    requests running when it was asked finish, though new ones keep running (under steady load it would
    otherwise wait for ever)."""
    resizer, core, change, tail, _ = _held_shrink(tmp_path)
    manager = core.scheduler.kv_cache_manager
    assert resizer.stats()["pending_fenced_blocks"] == 64 - 20 - 2  # ids 20..63 but the two held
    assert manager.block_pool.get_num_free_blocks() == 19  # ids 1..19 (0 is vLLM's null block)
    newcomer = request("newcomer", 10 * BS)
    assert manager.allocate_slots(newcomer, 10 * BS) is not None
    assert max(manager.get_block_ids("newcomer")[0]) < 20
    core.scheduler.running = [tail, newcomer]
    core.step_fn()
    assert not change.is_done
    manager.free(tail)
    core.scheduler.running = [newcomer]
    core.step_fn()  # the shrink applies with the newcomer running on kept ids
    assert change.wait(0) and resizer.num_blocks == 20 and resizer.stats()["pending_fenced_blocks"] == 0
    assert manager.block_pool.get_num_free_blocks() == 19 - 10
    manager.free(newcomer)
    assert manager.block_pool.get_num_free_blocks() == 19


@pytest.mark.parametrize("then", ["grow back", "refused"])
def test_a_replaced_or_refused_shrink_gives_its_fenced_ids_back(tmp_path, then):
    resizer, core, change, tail, staging = _held_shrink(tmp_path)
    manager = core.scheduler.kv_cache_manager
    if then == "grow back":
        resizer.set_gpu_budget(staging + 64 * BYTES_PER_BLOCK)  # replaces the shrink before it applied
        core.step_fn()
        assert change.wait(0) and resizer.num_blocks == 64
    else:  # the running request grows past what the smaller pool can hold: the pending shrink is refused
        core.scheduler.running = [tail, *(request(f"r{i}", 2 * BS) for i in range(3))]
        core.scheduler.kv_cache_manager.get_block_ids = lambda req_id: ([*range(1, 20)],)
        core.step_fn()
        with pytest.raises(BudgetRefused):
            change.wait(0)
        core.scheduler.kv_cache_manager.get_block_ids = type(manager).get_block_ids.__get__(manager)
    assert resizer.stats()["pending_fenced_blocks"] == 0
    assert manager.block_pool.get_num_free_blocks() == 63 - 2  # every id but the null block and the two held


def test_an_abort_between_steps_waits_for_a_resize_in_progress(tmp_path):
    """vLLM aborts requests (freeing their blocks) in the engine's thread between steps, where a resize may be
    running from another thread: the abort takes the step lock too, so it never edits the block pool midway."""
    resizer, core, _, _, _ = engine_of(tmp_path)
    manager = core.scheduler.kv_cache_manager
    req = request("a", 4 * BS)
    assert manager.allocate_slots(req, 4 * BS) is not None
    core.scheduler.running = [req]
    assert returns_after_a_resize_in_progress(resizer, lambda: core.abort_requests({"a"}))  # not during it
    assert core.scheduler.running == [] and manager.block_pool.get_num_free_blocks() == 63


def returns_after_a_resize_in_progress(resizer, call) -> bool:
    """Run `call` while another thread holds the resizer's step lock (a resize in progress, 0.3 s): whether it
    returned only after that thread let go."""
    holding, released = threading.Event(), []

    def a_resize_in_progress():
        with resizer._step_lock:
            holding.set()
            time.sleep(0.3)
            released.append(time.perf_counter())

    thread = threading.Thread(target=a_resize_in_progress)
    thread.start()
    holding.wait()
    call()
    done = time.perf_counter()
    thread.join()
    return bool(released) and done >= released[0]


def test_the_post_step_waits_for_a_resize_in_progress(tmp_path):
    """vLLM's in-process client calls post_step after each step, outside step_fn (speculative decoding's draft
    tokens: a collective_rpc to the workers): it takes the step lock, so it never interleaves with a resize's."""
    resizer, core, _, steps, _ = engine_of(tmp_path)
    assert returns_after_a_resize_in_progress(resizer, lambda: core.post_step(model_executed=True))
    assert steps == [("post", True)]


def test_a_worker_running_another_model_runner_is_refused_when_the_resizer_starts(tmp_path, monkeypatch):
    """`missing_worker_hooks` reads vLLM's GPUModelRunner class; the runner a worker runs may be another (vLLM's
    V2 runner): the resizer asks each worker's runner itself, and names what it lacks instead of failing at the
    first resize."""
    worker = worker_of(64)
    del worker.model_runner._allocate_kv_cache_tensors
    monkeypatch.setattr(sys.modules[__name__], "worker_of", lambda n: worker)
    with pytest.raises(RuntimeError, match=r"_allocate_kv_cache_tensors.*VLLM_USE_V2_MODEL_RUNNER=0"):
        engine_of(tmp_path)


def test_a_failed_resize_holds_none_of_its_new_tensors_while_its_error_is_kept():
    """The error of a failed copy keeps its traceback (vLLM's collective_rpc, the caller's handler), whose
    frames held the half-made tensors past the cache's emptying: their bytes stayed with the process. The
    frames below the resize are cleared before it hands memory back."""
    worker = worker_of(64)
    runner = worker.model_runner
    made = []

    def wrong_layout(raw, sizes):  # the copy refuses it, half-way through the resize
        caches = {n: t.view(torch.float32).view(-1, BS, H, D) for n, t in raw.items()}
        made.extend(weakref.ref(t) for t in caches.values())
        return caches

    runner._reshape_kv_cache_tensors = wrong_layout
    with pytest.raises(ValueError) as failure:
        resize_worker_kv(worker, 20)
    gc.collect()
    assert made and all(ref() is None for ref in made), "a failed resize's tensors outlived it"
    assert failure.value.__traceback__ is not None  # the error itself is kept whole
