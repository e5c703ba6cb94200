"""Run-time resize of the vLLM hot-window pool, the bookkeeping half: what a new GPU budget means
in vLLM blocks, and whether it is refused, decided before anything changes. No vLLM import, no CUDA.

Primitives: `BudgetSplit`, `split_budget` (the split the engine uses at start-up too), `staging_for_budget`,
`window_blocks`, `admission_floor_blocks`, `RunningRequest`, `ResizePlan`, `plan_resize`.

    budget ──split_budget──> staging (scheduler.staging_follows_budget: a smaller budget cuts it once vLLM's pool
                             is down to every row's window, never below its share of the budget nor
                             one region of the start-up ring)
                             + key summaries + full-graph codes (fixed) + vLLM's pool = the rest
    vLLM's pool // bytes_per_block = num_blocks (vLLM's own get_num_blocks arithmetic)

Refusals (BudgetRefused, sizes named): the budget does not exceed the fixed reservations; the pool
would hold fewer blocks than one request's window plus vLLM's null block (`admission_floor_blocks`, the
start-up check's floor too); or fewer than the running requests can hold (each up to its window).
A plan that passes can still have to wait: a shrink drops the blocks at the tail of vLLM's pool
(ids >= new_num_blocks), so it waits while a running request holds one (`held_tail_blocks`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tierkv.budget_change import BudgetRefused, parse_budget
from tierkv.units import format_bytes


@dataclass(frozen=True)
class BudgetSplit:
    """One GPU budget (bytes per GPU) cut into tierkv's fixed reservations and vLLM's pool."""

    budget_bytes: int
    staging_bytes: int        # scheduler.staging_bytes: the staging ring (and the far-block caches carved from it)
    summary_bytes: int = 0    # the sparse policy's key summaries (max_num_seqs requests of max_model_len)
    full_graph_bytes: int = 0  # the full decode graph's codes and scales (quantized CPU tier)

    @property
    def pool_bytes(self) -> int:
        """vLLM's hot-window pool: the budget less the reservations (<= 0: nothing left)."""
        return self.budget_bytes - self.staging_bytes - self.summary_bytes - self.full_graph_bytes

    def reserved_text(self, staging_name: str = "scheduler.staging_bytes") -> str:
        """The reservations in words, as the start-up error names them (a resize's staging: `staging_name`)."""
        text = f"{staging_name} ({format_bytes(self.staging_bytes)})"
        if self.summary_bytes:
            text += f" and the sparse key summaries ({format_bytes(self.summary_bytes)})"
        if self.full_graph_bytes:
            text += f" and the full decode graph's codes and scales ({format_bytes(self.full_graph_bytes)})"
        return text


def split_budget(config, budget_bytes: int, summary_bytes: int = 0, full_graph_bytes: int = 0, *,
                 rows_pool_bytes: int | None = None, least_staging_bytes: int = 0) -> BudgetSplit:
    """The split of `budget_bytes` for an engine of tierkv `config` (a TierKVConfig): the one
    `hot_window_engine_args` sizes vLLM's pool with at start-up, and every resize after (`staging_for_budget`;
    rows_pool_bytes: the pool that holds every max_num_seqs row's window, which a smaller budget keeps
    before it cuts the staging; None: the staging's share of the budget alone; least_staging_bytes: what the
    workers' hot windows report they can be re-made from, 0: not known)."""
    spare = 0 if rows_pool_bytes is None else budget_bytes - summary_bytes - full_graph_bytes - rows_pool_bytes
    return BudgetSplit(budget_bytes, staging_for_budget(config, budget_bytes, spare, least_staging_bytes), summary_bytes,
                       full_graph_bytes)


def staging_for_budget(config, budget_bytes: int, spare_bytes: int = 0, least_bytes: int = 0) -> int:
    """The staging of a budget: `scheduler.staging_bytes` at the start-up budget (`cache.gpu_budget_bytes`)
    and above; with `scheduler.staging_follows_budget` a smaller budget keeps what `spare_bytes` (the budget
    less the fixed reservations and a pool for every row's window) leaves of it, and never less than its share
    of the budget nor than one of the start-up ring's regions (a run-time shrink re-makes the exact policy's
    ring, or the sparse policy's ring, eager regions and far-block caches, with fewer regions of the start-up
    sizes: `FarKV.make_staging`, `far_staging.ChunkGrid`). least_bytes: that least staging as the workers
    report it (`ChunkGrid.least_staging_bytes`: under the sparse policy the eager regions come with it); 0:
    a third of the start-up staging at lookahead 2 (one ring region of the exact policy). The exact policy's
    ring is whole regions: with least_bytes known, a cut staging is a multiple of it, the rest left to the
    pool. A pool past every row's window
    only keeps old blocks; the staging's size is the decode's speed (a ring a quarter the size took 2.5x the
    decode time at 128k). Kept as written under the sparse step inside vLLM's full decode graph (its rows'
    buffers hold the caches' addresses)."""
    from tierkv.integrations.vllm.full_graph_rows import full_graphs_configured

    staging, start = config.scheduler.staging_bytes, config.cache.gpu_budget_bytes
    if not config.scheduler.staging_follows_budget or budget_bytes >= start or full_graphs_configured(config):
        return staging
    least = least_bytes or -(-staging // max(2, config.scheduler.lookahead_layers + 1))
    cut = min(staging, max(least, staging * budget_bytes // start, spare_bytes))
    if least_bytes and config.scheduler.policy == "exact" and cut < staging:  # whole ring regions
        cut = cut // least_bytes * least_bytes
    return cut


def window_blocks(window_tokens: int, in_flight_tokens: int, max_model_len: int, block_tokens: int) -> int:
    """Pool blocks one request holds at most under the hot window: its window, the tokens in
    flight (max_num_batched_tokens; twice that under async scheduling), capped at max_model_len,
    plus one block (vLLM's sliding-window bound). What vLLM's start-up check asks for one request."""
    return -(-min(window_tokens - 1 + in_flight_tokens, max_model_len) // block_tokens) + 1


def admission_floor_blocks(window_blocks_per_request: int) -> int:
    """The fewest pool blocks in which vLLM admits a request: one request's window (`window_blocks`)
    plus vLLM's null block, which it never hands out. The start-up check (`pool_sizing.hot_window_pool_need`)
    and every resize ask this one floor, so a budget the engine started at is never refused later.
    max_num_seqs is no part of it: vLLM's scheduler runs as many requests as their windows fit and queues the
    rest (nothing in vLLM 0.26 asks num_gpu_blocks >= max_num_seqs; its warm-up caps its dummy batch at the
    pool), and a batch of max_num_seqs rows would need a window each, not one block each."""
    return window_blocks_per_request + 1


@dataclass(frozen=True)
class RunningRequest:
    """A request vLLM's scheduler holds pool blocks for."""

    req_id: str
    block_ids: tuple[int, ...]  # the pool blocks it holds (vLLM's null block 0 left out)
    need_blocks: int            # the most it can hold: its window, capped at its own length


@dataclass(frozen=True)
class ResizePlan:
    split: BudgetSplit
    old_num_blocks: int
    new_num_blocks: int
    bytes_per_block: int  # all layers of one block id, on one GPU

    @property
    def budget_bytes(self) -> int:
        return self.split.budget_bytes

    @property
    def new_pool_bytes(self) -> int:
        return self.new_num_blocks * self.bytes_per_block

    @property
    def old_pool_bytes(self) -> int:
        return self.old_num_blocks * self.bytes_per_block

    @property
    def is_shrink(self) -> bool:
        return self.new_num_blocks < self.old_num_blocks

    def held_tail_blocks(self, running: Sequence[RunningRequest]) -> list[int]:
        """Block ids a shrink would drop that a running request holds (empty: it can apply now)."""
        return sorted(b for r in running for b in r.block_ids if b >= self.new_num_blocks)


def plan_resize(budget, split_fn: Callable[[int], BudgetSplit], *, bytes_per_block: int, old_num_blocks: int,
                window_blocks_per_request: int, running: Sequence[RunningRequest] = ()) -> ResizePlan:
    """The new block count for `budget` (bytes or a size such as "1GiB"), or a refusal naming the
    sizes and what to change, before anything changes. ValueError: not a positive size. BudgetRefused: see
    the module (max_num_seqs is no part of the floor: `admission_floor_blocks`)."""
    budget_bytes = parse_budget(budget)
    if bytes_per_block <= 0 or old_num_blocks <= 0:
        raise ValueError(f"bytes_per_block {bytes_per_block}, old_num_blocks {old_num_blocks}: must be positive")
    split = split_fn(budget_bytes)
    if split.pool_bytes <= 0:
        raise BudgetRefused(budget_bytes, f"it must exceed {split.reserved_text('the staging kept at this budget')}: "
                                          f"the rest is vLLM's hot-window pool, where one request's window needs "
                                          f"{window_blocks_per_request} blocks "
                                          f"({format_bytes(window_blocks_per_request * bytes_per_block)})")
    plan = ResizePlan(split, old_num_blocks, split.pool_bytes // bytes_per_block, bytes_per_block)
    pool = f"vLLM's pool would hold {plan.new_num_blocks} blocks ({format_bytes(split.pool_bytes)})"
    floor = admission_floor_blocks(window_blocks_per_request)
    if plan.new_num_blocks < floor:
        raise BudgetRefused(budget_bytes, f"{pool}; one request's window needs {window_blocks_per_request} blocks "
                                          "(cache.window_tokens and the prefill tokens in flight), which vLLM admits "
                                          f"a request only with free, plus its null block: at least {floor} blocks "
                                          f"({format_bytes(floor * bytes_per_block)} + {split.reserved_text()}), "
                                          "as at start-up; raise the budget, or start the engine with a lower "
                                          "cache.window_tokens or scheduler.prefill_chunk_tokens")
    need = sum(max(len(r.block_ids), min(r.need_blocks, window_blocks_per_request)) for r in running) + 1
    if running and plan.new_num_blocks < need:
        raise BudgetRefused(budget_bytes, f"{pool}; the {len(running)} running requests can hold {need - 1} blocks "
                                          f"plus the null block ({format_bytes(need * bytes_per_block)})")
    return plan
