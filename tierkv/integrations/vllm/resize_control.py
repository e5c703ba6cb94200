"""`set_gpu_budget` for a vLLM hot-window engine: plan, refuse or queue, apply at a step boundary.

Primitives: `PoolResizer` (`set_gpu_budget`, `stats`), `engine_core_of`, `missing_vllm_hooks`.

    set_gpu_budget(b) ── plan_resize (resize_plan) ── refused: BudgetRefused/ValueError, nothing changed
                      └─ queued ── at the next step boundary (or now, between steps or requests):
                           shrink whose dropped block ids a request holds → held, retried every boundary;
                                 meanwhile the free ids it drops go to no new request (fenced)
                           else: workers' KV tensors (resize_worker, collective_rpc), then vLLM's
                                 BlockPool (resize_blocks); a failure leaves the old pool working

A step boundary is the wrapper this class puts around the engine core's `step_fn` (this engine
only): it holds the step lock for the step, so a change applies only between steps, and it tries a
pending change before and after each step. `set_gpu_budget` never waits for that lock: it refuses
what needs no engine state at once, queues the change under a short lock of its own, and applies it
itself only when the step lock is free (between steps or requests); otherwise the engine's thread
applies it at the next boundary (a caller blocked on the step lock would lose it to the engine loop
step after step, and wait for the whole request). Policy "step_boundary": a grow applies at the next
boundary; a shrink at the first boundary where the block ids it drops are free (at the latest when
the requests running when it was asked finish: requests admitted after get only kept ids). Under vLLM's async scheduling a step leaves work in flight: there
changes wait until the engine is idle. `stats()` shows the policy and any pending change.
"""
from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Callable

from tierkv.budget_change import BudgetChange, BudgetRefused, parse_budget
from tierkv.units import format_bytes
from tierkv.integrations.vllm.engine_config import sleep_mode_of
from tierkv.integrations.vllm.resize_blocks import (fence_tail, held_tail_block_ids, missing_block_pool_hooks,
                                                    release_fence, resize_block_pool)
from tierkv.integrations.vllm.resize_plan import BudgetSplit, ResizePlan, RunningRequest, plan_resize, window_blocks
from tierkv.integrations.vllm.resize_worker import (missing_worker_hooks, resize_worker_kv, worker_least_staging,
                                                    worker_runner_missing)

logger = logging.getLogger(__name__)
POLICY = "step_boundary"


def missing_vllm_hooks() -> list[str]:
    """Everything the run-time resize uses of vLLM that the installed vLLM lacks (empty: all there)."""
    from vllm.v1.engine.core import EngineCore

    missing = missing_block_pool_hooks() + missing_worker_hooks()
    names = inspect.unwrap(EngineCore.__init__).__code__.co_names  # vLLM's own (the plugin wraps it: hot_window)
    missing += [f"EngineCore.{a}" for a in ("step_fn", "scheduler", "batch_queue", "vllm_config") if a not in names]
    missing += [f"EngineCore.{a}" for a in ("collective_rpc",) if not hasattr(EngineCore, a)]
    return missing


def engine_core_of(llm) -> object:
    """The in-process EngineCore of a `vllm.LLM` (RuntimeError when it runs in another process)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None:
        raise RuntimeError("set_gpu_budget under vLLM needs its engine core in this process "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0, as TieredLLM sets)")
    return core


class PoolResizer:
    def __init__(self, core, split_fn: Callable[..., BudgetSplit], budget_bytes: int):
        """core: vLLM's in-process EngineCore of a hot-window engine; split_fn: the engine's budget
        split (`resize_plan.split_budget` with its reservations, taking rows_pool_bytes and least_staging_bytes); budget_bytes: the
        start-up budget."""
        missing = missing_vllm_hooks()
        if missing:
            import vllm

            raise RuntimeError(f"vLLM {vllm.__version__} lacks what tierkv's run-time pool resize uses: {missing}")
        missing = sorted({m for found in core.collective_rpc(worker_runner_missing) for m in found})
        if missing:
            raise RuntimeError(f"the engine's model runner lacks what tierkv's run-time pool resize uses: {missing} "
                               "(vLLM's V1 GPU runner has them: VLLM_USE_V2_MODEL_RUNNER=0, as TieredLLM sets by default)")
        self.core, self._split_fn, self.budget_bytes = core, split_fn, budget_bytes
        self.manager = core.scheduler.kv_cache_manager
        config = self.manager.kv_cache_config
        self.bytes_per_block = sum(t.size for t in config.kv_cache_tensors) // config.num_blocks
        vllm_config = core.vllm_config
        spec = config.kv_cache_groups[0].kv_cache_spec
        self.block_tokens = spec.block_size
        in_flight = vllm_config.scheduler_config.max_num_batched_tokens * (2 if core.batch_queue is not None else 1)
        self.window_blocks = window_blocks(spec.sliding_window, in_flight, vllm_config.model_config.max_model_len,
                                           self.block_tokens)
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        # the pool a smaller budget keeps before it cuts the staging: every row's window and the null block
        self.rows_pool_bytes = (self.max_num_seqs * self.window_blocks + 1) * self.bytes_per_block
        # the least staging every worker's hot window can be re-made from (its start-up regions' sizes)
        self.least_staging_bytes = max(core.collective_rpc(worker_least_staging), default=0)
        mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
        self.graphs = getattr(mode, "name", "NONE") != "NONE"
        self.sleep_mode = sleep_mode_of(vllm_config)
        self._step_lock = threading.RLock()  # held for each engine step and each resize
        self._stepping: int | None = None    # the thread inside vLLM's step (a call from it only queues)
        self._plan_lock = threading.Lock()   # guards _pending; never held across a step
        self._pending: tuple[int, list[BudgetChange]] | None = None  # budget bytes, the changes it resolves
        self.held_blocks = 0  # block ids a pending shrink waits for
        self.fenced_blocks = 0  # free ids past its new pool kept from new requests meanwhile (`fence_tail`)
        self.counts = {"budget_changes": 0, "budget_refusals": 0, "returned_bytes": 0, "taken_bytes": 0,
                       "changes_during_requests": 0}
        self.last_refusal: str | None = None
        self.last_resize_s: float | None = None
        step = core.step_fn

        def step_at_boundary():
            with self._step_lock:
                self._apply_pending()
                self._stepping = threading.get_ident()
                try:
                    result = step()
                finally:
                    self._stepping = None
                self._apply_pending()
                return result

        core.step_fn = step_at_boundary
        # vLLM frees blocks outside the step too (an abort from the output processor, a prefix-cache reset, a
        # pause that aborts), in the engine's thread between steps, where a resize may run from another: they take
        # the step lock as well, and so does the in-process client's post-step (speculative decoding's draft
        # tokens: a collective_rpc to the workers and the scheduler's requests, beside a resize's)
        for name in ("abort_requests", "reset_prefix_cache", "pause_scheduler", "post_step"):
            call = getattr(core, name, None)
            if call is not None:
                setattr(core, name, self._under_step_lock(call))

    def _under_step_lock(self, call):
        def serialized(*args, **kwargs):
            with self._step_lock:
                return call(*args, **kwargs)
        return serialized

    @property
    def num_blocks(self) -> int:
        return self.manager.block_pool.num_gpu_blocks

    def set_gpu_budget(self, budget) -> BudgetChange:
        """Plan `budget` (bytes or "1GiB"); refuse now (ValueError, BudgetRefused: nothing changes) or
        return the change, applied at once between steps or queued for the next step boundary."""
        with self._plan_lock:
            try:
                if self.graphs:
                    raise BudgetRefused(parse_budget(budget), "vLLM captured CUDA graphs over its pool's addresses: resizing needs an "
                                   "eager engine (pass enforce_eager=True; TieredLLM starts compiled only for "
                                   "scheduler.sparse_full_graphs, as configs/vllm-128k-sparse.yaml sets)")
                if self.sleep_mode:
                    raise BudgetRefused(parse_budget(budget), "vLLM's sleep mode keeps the KV pool in its CuMem allocator "
                                   "(sleep() frees it, wake_up() maps it back): a resized pool would live outside it "
                                   "and outlast sleep(); start without enable_sleep_mode to resize at run time")
                budget_bytes = self._plan(budget, running=()).budget_bytes  # what needs no engine state
            except (ValueError, BudgetRefused) as exc:
                self._record_refusal(exc)
                raise
            change = BudgetChange(budget_bytes)
            replaced = self._pending[1] if self._pending is not None else []
            self._pending = (budget_bytes, replaced + [change])
        refused = self._apply_if_between_steps()  # refused for the running requests: before any change
        if refused is not None:
            raise refused
        return change

    def wait(self, change: BudgetChange, timeout_s: float | None) -> bool:
        """Until `change` is applied (True), refused (raises it) or timeout_s passes (False); applies a
        change left pending by an engine that went idle meanwhile."""
        if self._stepping == threading.get_ident() and not change.wait(0):
            raise RuntimeError("a GPU budget change cannot be waited for from inside vLLM's step: it applies at the "
                               "step's end (call set_gpu_budget without waiting there)")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._apply_if_between_steps()
            left = None if deadline is None else deadline - time.monotonic()
            if change.wait(0.005 if left is None else max(0.0, min(0.005, left))):
                return True
            if left is not None and left <= 0:
                return False

    def running_requests(self) -> list[RunningRequest]:
        """vLLM's running requests with the pool blocks they hold."""
        out = []
        for req in self.core.scheduler.running:
            ids = tuple(b for b in self.manager.get_block_ids(req.request_id)[0] if b != 0)  # 0: the null block
            length = req.num_prompt_tokens + (req.max_tokens or 0)
            out.append(RunningRequest(req.request_id, ids, min(self.window_blocks, -(-length // self.block_tokens) + 1)))
        return out

    def _plan(self, budget, running) -> ResizePlan:
        return plan_resize(budget, self.split, bytes_per_block=self.bytes_per_block, old_num_blocks=self.num_blocks,
                           window_blocks_per_request=self.window_blocks, running=running)

    def _apply_if_between_steps(self) -> BaseException | None:
        if self._stepping == threading.get_ident():  # called from inside the step (a callback): the lock is
            return None                              # re-entrant, so only the boundary may apply it
        if not self._step_lock.acquire(blocking=False):  # a step runs: its thread applies at the boundary
            return None
        try:
            return self._apply_pending()
        finally:
            self._step_lock.release()

    def _apply_pending(self) -> BaseException | None:
        """With the step lock held: the pending change planned against the running requests, then
        applied, held (a shrink over blocks in use) or refused (returned, its changes resolved)."""
        with self._plan_lock:
            if self._pending is None:
                return None
            budget_bytes, changes = self._pending
            busy = self.core.scheduler.has_unfinished_requests()
            if busy and self.core.batch_queue is not None:  # async scheduling: work of the last step still in flight
                return None
            pool = self.manager.block_pool
            try:
                plan = self._plan(budget_bytes, self.running_requests())
            except (ValueError, BudgetRefused) as exc:
                self._pending = None
                release_fence(pool)
                self._record_refusal(exc)
                for change in changes:
                    change.resolve(exc)
                return exc
            held = held_tail_block_ids(pool, plan.new_num_blocks) if plan.is_shrink else []
            self.held_blocks = len(held)
            if held:  # the free ids past the new pool go to no new request meanwhile: only these are waited for
                self.fenced_blocks = fence_tail(pool, plan.new_num_blocks)
                return None
            self._pending, self.fenced_blocks = None, 0
        try:
            self._resize(plan)
        except Exception as exc:  # the old pool is back in force (see _resize), fenced ids in its free queue again
            release_fence(self.manager.block_pool)
            refused = BudgetRefused(plan.budget_bytes, f"{type(exc).__name__}: {exc}; the pool stays "
                                                       f"{self.num_blocks} blocks ({format_bytes(self.budget_bytes)} budget)")
            self._record_refusal(refused)
            for change in changes:
                change.resolve(refused)
            return None
        self.budget_bytes = plan.budget_bytes
        self.counts["budget_changes"] += 1
        self.counts["changes_during_requests"] += busy
        for change in changes:
            change.resolve()
        return None

    def _resize(self, plan) -> None:
        """vLLM's BlockPool and the workers' tensors (and an exact hot window's staging ring, when the split moves
        it), in the order that keeps every block id the pool can hand out inside every worker's tensors: a shrink
        cuts the pool first, a grow the workers first. A failure puts back what it can: the old pool in every
        place, or, when a worker cannot take its old tensors back (another process took the memory a shrink gave
        back), the pool at the size every worker holds."""
        new_num_blocks, old = plan.new_num_blocks, self.num_blocks
        old_staging = self.split(self.budget_bytes).staging_bytes
        started = time.perf_counter()
        if plan.is_shrink:
            resize_block_pool(self.manager, new_num_blocks)  # (a failure here changed nothing)
        try:  # (the workers leave a staging of this size as it is)
            results = self.core.collective_rpc(resize_worker_kv, args=(new_num_blocks, plan.split.staging_bytes))
        except Exception:
            restored = self._restore_workers(old, old_staging)  # under tensor parallelism some may have resized
            if plan.is_shrink and restored:
                resize_block_pool(self.manager, old)  # (growing the pool back cannot fail on ids)
            raise
        if not plan.is_shrink:
            try:
                resize_block_pool(self.manager, new_num_blocks)
            except Exception:
                self._restore_workers(old, old_staging)  # (smaller again: the pool never handed out their ids)
                raise
        self.core.vllm_config.cache_config.num_gpu_blocks = new_num_blocks
        freed = sum(r["old_bytes"] - r["new_bytes"] for r in results)
        self.counts["returned_bytes" if freed >= 0 else "taken_bytes"] += abs(freed)
        self.last_resize_s = time.perf_counter() - started

    def _restore_workers(self, num_blocks: int, staging_bytes: int) -> bool:
        """Every worker back at `num_blocks`; False (logged) when one could not be (it kept the tensors it had)."""
        try:
            self.core.collective_rpc(resize_worker_kv, args=(num_blocks, staging_bytes))
            return True
        except Exception:  # a worker not at num_blocks is the one that failed: it kept its tensors
            logger.exception("tierkv: restoring the workers' KV tensors to %d blocks failed", num_blocks)
            return False

    def split(self, budget_bytes: int) -> BudgetSplit:
        """The engine's split of `budget_bytes` (the start-up one), its pool kept at every row's window first."""
        return self._split_fn(budget_bytes, rows_pool_bytes=self.rows_pool_bytes,
                              least_staging_bytes=self.least_staging_bytes)

    def _record_refusal(self, exc: BaseException) -> None:
        self.counts["budget_refusals"] += 1
        self.last_refusal = str(exc)
        logger.warning("tierkv: GPU budget change refused: %s", exc)

    def stats(self) -> dict:
        """The budget, vLLM's pool, the policy and any pending change (reads only)."""
        pending = self._pending
        split = self.split(self.budget_bytes)
        return {"budget_bytes": self.budget_bytes, "pool_blocks": self.num_blocks,
                "pool_bytes": self.num_blocks * self.bytes_per_block, "staging_bytes": split.staging_bytes,
                "summary_bytes": split.summary_bytes, "full_graph_bytes": split.full_graph_bytes,
                "resize_policy": POLICY, "pending_budget_bytes": pending[0] if pending else None,
                "pending_held_blocks": self.held_blocks if pending else 0,
                "pending_fenced_blocks": self.fenced_blocks if pending else 0, **self.counts,
                "last_budget_refusal": self.last_refusal, "last_resize_s": self.last_resize_s}
