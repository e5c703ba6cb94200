"""The scheduler side of tierkv's vLLM connector: which prefix blocks the tiers hold, and each
step's metadata for the workers.

Primitives: `ConnectorScheduler`, `TierKVMetadata`.

    get_num_new_matched_tokens   prefix blocks held in every layer by some tier (beyond vLLM's own cache)
    update_state_after_alloc     where vLLM put them: the step's loads
    build_connector_meta         loads, and each request's blocks that become full in this step
                                 (saves); under the hot window, every scheduled request's position,
                                 the block hashes learnt since the last step and the finished requests

No vLLM object is built here, but the metadata is a vLLM `KVConnectorMetadata`: needs vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from tierkv.integrations.vllm.far_step import far_blocks
from tierkv.integrations.vllm.load_failures import patch_scheduler
from tierkv.integrations.vllm.paged_layout import BlockSpan
from tierkv.integrations.vllm.request_identity import chain_root

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from tierkv.integrations.vllm.store import VllmKVStore


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    """What the worker does in one step; pickled from the scheduler to the workers."""

    loads: list[BlockSpan] = field(default_factory=list)
    saves: list[BlockSpan] = field(default_factory=list)
    # hot window only: every scheduled request's (tokens before the step, tokens in it), the block
    # hashes learnt since the last step (req_id, first block, hashes), requests that finished
    scheduled: dict[str, tuple[int, int]] = field(default_factory=dict)
    # scheduled requests whose step lies within their prompt: prefill, exact under any policy (a prompt's
    # last token after a cached prefix is a one-token step, and no decode step)
    prompt_steps: list[str] = field(default_factory=list)
    # scheduled requests whose block table starts with more of vLLM's null block than their far part covers:
    # a window block's load failed and vLLM's recompute moved their tokens back before the window it loaded
    # (the blocks before it were never allocated): their far part reads every block up to the first one held
    far_floors: dict[str, int] = field(default_factory=dict)
    hashes: list[tuple[str, int, list[str]]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


@dataclass
class _RequestState:
    request: Any
    root: str | None = None  # its block-hash chain's root (request_identity.chain_root)
    hashes: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    next_block_to_save: int = 0
    hashes_sent: int = 0
    load_range: tuple[int, int] | None = None
    hole_from: int | None = None  # the first block the lookup found held in some layers but not all
    pending_load: BlockSpan | None = None
    leading_nulls: int = 0  # vLLM's null block at the start of its block table (a prefix hit's far blocks)
    step_computed: int = 0  # its tokens computed before the step build_connector_meta describes


class ConnectorScheduler:
    """The connector's scheduler-side state: one `_RequestState` per request it was told of.

    block_size: vLLM's tokens per block. hot_window: the window's tokens, None without one.
    store: the engine's store (a lookup store where the scheduler runs apart from the workers),
    made on first use. own_window: without the hot window, the model's own sliding window (None: full
    attention): vLLM frees the blocks that leave it, and gives those before it on a prefix hit its null block.
    """

    def __init__(self, block_size: int, hot_window: int | None, store: Callable[[], VllmKVStore],
                 own_window: int | None = None):
        self.block_size, self.hot_window, self._store = block_size, hot_window, store
        self.own_window = None if hot_window is not None else own_window
        self._requests: dict[str, _RequestState] = {}
        patch_scheduler()  # a failed load leaves vLLM's prefix cache (also where the plugin's entry point did not run)

    def state(self, request: "Request") -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            root = chain_root(request, self._store().fingerprint)
            state = self._requests[request.request_id] = _RequestState(request, root)
        return state

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self.state(request)
        prompt = request.prompt_token_ids or []
        start = num_computed_tokens // self.block_size
        end = (len(prompt) - 1) // self.block_size  # vLLM must compute at least the last token
        state.load_range, state.hole_from = None, None
        if end <= start:
            return 0, False
        hashes = self._store().extend_hashes(state.hashes, prompt, end, state.root)
        found = self._store().present_prefix(hashes[start:end])
        if (self.hot_window is None and start + found < end  # (the hot window saves every block it computes)
                and self._store().stored_mask(hashes[start + found : start + found + 1])[0]):
            state.hole_from = start + found  # a layer of it is gone (a tier dropped one key): save it whole again
        if found == 0:
            return 0, False
        state.load_range = (start, start + found)
        return start * self.block_size + found * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        state = self.state(request)
        row = blocks.blocks[0] if blocks.blocks else ()
        # the blocks before the window of a prefix hit are vLLM's null block: never allocated, whatever vLLM's
        # recompute policy later does to the request's tokens (far_floors)
        state.leading_nulls = next((i for i, b in enumerate(row) if not b.is_null), len(row))
        if num_external_tokens <= 0 or state.load_range is None:
            state.load_range = None
            return
        start, end = state.load_range
        row = blocks.blocks[0]
        # under the hot window vLLM gives the prefix's blocks before the window the null block:
        # only the window is loaded into its pool, the far part reads the rest from the tiers
        keep = [i for i in range(start, min(end, len(row))) if not row[i].is_null]
        state.pending_load = BlockSpan(request.request_id, [row[i].block_id for i in keep], [state.hashes[i] for i in keep])
        state.next_block_to_save = max(state.next_block_to_save, end)  # already held by the tiers
        state.load_range = None

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> TierKVMetadata:
        meta = TierKVMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if state.pending_load is not None:
                meta.loads.append(state.pending_load)
                state.pending_load = None
            self._add_saves(meta, state, new.num_computed_tokens, scheduled.get(new.req_id, 0))
            self._add_hot_window(meta, state, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            if state.pending_load is not None:  # a preempted request resumed with a prefix hit: vLLM counts
                meta.loads.append(state.pending_load)  # those tokens computed, so the load must go with this step
                state.pending_load = None
            self._add_saves(meta, state, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
            self._add_hot_window(meta, state, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        if self.hot_window is not None:
            meta.finished = sorted(scheduler_output.finished_req_ids)
        if meta.loads and meta.saves:
            self._add_reads(meta)
        return meta

    def _add_reads(self, meta: TierKVMetadata) -> None:
        """Each save's `reads`: the blocks loaded in this step that its request holds. Its new tokens attend
        them, so a load that fails leaves wrong KV in what the step computes (vLLM recomputes it; the worker
        saves it then, not now). A request with no load of its own can hold one: a duplicate prompt in the
        step shares the block vLLM cached for the request that loads it."""
        loaded = {b for span in meta.loads for b in span.block_ids}
        for span in meta.saves:
            state = self._requests.get(span.req_id)
            span.reads = sorted(loaded.intersection(self._held(state))) if state is not None else []

    def _held(self, state: _RequestState) -> list[int]:
        """The vLLM block ids `state`'s request holds in this step. Under the hot window not the ids before its
        window: vLLM freed those as they left it (`far_blocks`, its sliding-window skip) and may have given them
        to another request, whose failed load into one then dropped this request's save, never recomputed (its
        table no longer holds the block): the block was in no tier when it turned far, and the engine stopped."""
        window = self.hot_window if self.hot_window is not None else self.own_window  # a model's own: freed alike
        if window is None:
            return state.block_ids
        return state.block_ids[far_blocks(state.step_computed, window, self.block_size):]

    def _add_hot_window(self, meta: TierKVMetadata, state: _RequestState, num_computed: int, num_new: int) -> None:
        """The worker's far/near split needs each request's position and the hashes of its full blocks."""
        if self.hot_window is None or num_new <= 0:
            return
        meta.scheduled[state.request.request_id] = (num_computed, num_new)
        if state.leading_nulls > far_blocks(num_computed, self.hot_window, self.block_size):
            meta.far_floors[state.request.request_id] = state.leading_nulls
        if num_computed + num_new <= getattr(state.request, "num_prompt_tokens", 0):
            meta.prompt_steps.append(state.request.request_id)
        hashes = self._store().extend_hashes(state.hashes, state.request.all_token_ids, num_computed // self.block_size,
                                             state.root)
        if len(hashes) > state.hashes_sent:
            meta.hashes.append((state.request.request_id, state.hashes_sent, hashes[state.hashes_sent:]))
            state.hashes_sent = len(hashes)

    def _add_saves(self, meta: TierKVMetadata, state: _RequestState, num_computed: int, num_new: int) -> None:
        """The request's blocks this step completes, to save (those the tiers do not hold yet). A step
        that starts before blocks counted as saved recomputes them: a load that failed (vLLM's recompute
        policy moved num_computed back to the first block the tiers could not give), so they are saved again."""
        tokens = state.request.all_token_ids
        state.step_computed = num_computed
        recomputed_to = state.next_block_to_save  # blocks below it a failed load has this step recompute
        if num_new > 0:
            state.next_block_to_save = min(state.next_block_to_save, num_computed // self.block_size)
        full = min(num_computed + num_new, len(tokens)) // self.block_size
        full = min(full, len(state.block_ids))
        first = state.next_block_to_save
        if self.own_window is not None:
            # blocks before the model's window when the step starts: vLLM's null block where its prefix cache hit
            # past the window (or a failed load moved the tokens back), freed otherwise; never this step's blocks
            first = max(first, far_blocks(num_computed, self.own_window, self.block_size))
        if full <= first:
            return
        hashes = self._store().extend_hashes(state.hashes, tokens, full, state.root)
        if self.hot_window is not None:
            # every block this request computes is saved, held already or not: the save's pin keeps it in the CPU
            # tier until it turns far and this request reads it there (a held block left unpinned was evicted by
            # later saves: the step it turned far stopped the engine). Held blocks it computes lie past a hole in
            # a shared prefix the lookup stopped at, or were recomputed after a failed load: rare
            stored = [False] * (full - first)
        else:
            stored = self._stored(state, hashes, range(first, full), recomputed_to)
        todo = [b for b, held in zip(range(first, full), stored) if not held]
        if todo:
            meta.saves.append(BlockSpan(state.request.request_id, [state.block_ids[b] for b in todo],
                                        [hashes[b] for b in todo]))
        state.next_block_to_save = full

    def _stored(self, state: _RequestState, hashes: list[str], blocks: range, recomputed_to: int) -> list[bool]:
        """Per block of `blocks`: held already (not saved again). The first and last layer tell for most; every
        layer counts for blocks recomputed after a failed load (below `recomputed_to`) and from a hole the
        lookup met on (`hole_from`): one lost layer is what made them computed, and checked on two layers they
        read as held, were never saved again, and every later request stopped its prefix there."""
        hole = state.hole_from if state.hole_from is not None else blocks.stop
        every = [b < recomputed_to or b >= hole for b in blocks]
        full = iter(self._store().stored_mask([hashes[b] for b, e in zip(blocks, every) if e], every_layer=True))
        ends = iter(self._store().stored_mask([hashes[b] for b, e in zip(blocks, every) if not e]))
        return [next(full) if e else next(ends) for e in every]

    def request_finished(self, request: "Request") -> None:
        self._requests.pop(request.request_id, None)
