"""After a failed load, every request holding the block recomputes it, and it leaves vLLM's prefix cache.

Primitives: `patch_scheduler` (installed by the plugin's `register` and by the scheduler-side connector).

tierkv loads synchronously and runs vLLM's "recompute" policy for a block no tier could give: vLLM moves
the request's computed tokens back to that block and computes it again. vLLM 0.26 leaves two holes there,
both seen with its prefix cache on (`TieredLLM(hot_window=False)`):

- it drops the failed block (and the request's blocks after it, computed over it) from its prefix cache only
  under the "fail" policy: under "recompute" it keeps them for the recompute to fill, so a request aborted or
  preempted first leaves them to the next request with the prompt, wrong KV served as a prefix hit;
- of several requests holding the failed block (a duplicate prompt in the step got it from vLLM's cache), only
  the first moves back; the others keep it counted computed, relying on the first's recompute. Aborted first,
  nobody recomputes it: the others sample from KV computed over it, and save their next blocks with it.

For an engine served by tierkv's connector, under "recompute", every request holding a failed block moves
back to the first one it holds, and its blocks from there leave the prefix cache (they stay with their
requests, which compute them again; vLLM does not cache them again: the tiers serve the prompt instead).
"""
from __future__ import annotations

import functools


def patch_scheduler() -> None:
    """Wrap vLLM's `Scheduler._update_requests_with_invalid_blocks` as above. Idempotent."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._update_requests_with_invalid_blocks
    if getattr(original, "_tierkv_load_failures", False):
        return

    @functools.wraps(original)
    def update(self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks=True):
        if not (evict_blocks and _serves_tierkv(self) and getattr(self, "recompute_kv_load_failures", False)):
            return original(self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks)
        affected, tokens, to_evict = every_holder_recomputes(self, requests, invalid_block_ids, num_scheduled_tokens)
        if to_evict:
            self.kv_cache_manager.evict_blocks(to_evict)  # vLLM evicts the first holder's itself, under "fail" only
        return affected, tokens, to_evict

    update._tierkv_load_failures = True
    Scheduler._update_requests_with_invalid_blocks = update


def every_holder_recomputes(scheduler, requests, invalid_block_ids, num_scheduled_tokens) -> tuple[set[str], int, set[int]]:
    """vLLM's accounting of requests holding failed blocks (affected request ids, tokens to recompute, blocks
    to evict), with every holder moved back to its first failed block: of the blocks it counted computed before
    this step's new tokens (its loads and prefix hits), the first that failed."""
    affected, tokens, to_evict = set(), 0, set()
    block_size = scheduler.block_size
    for request in requests:
        (block_ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        computed = request.num_computed_tokens - num_scheduled_tokens.get(request.request_id, 0)
        held = -(-computed // block_size)
        first = next((i for i, block in enumerate(block_ids[:held]) if block in invalid_block_ids), None)
        if first is None:
            continue
        request.num_computed_tokens = first * block_size
        tokens += computed - request.num_computed_tokens
        affected.add(request.request_id)
        to_evict.update(block_ids[first:])
    return affected, tokens, to_evict


def _serves_tierkv(scheduler) -> bool:
    """Whether `scheduler`'s KV connector is tierkv's (other engines in the process are left as vLLM made them)."""
    connector = getattr(scheduler, "connector", None)
    return connector is not None and type(connector).__module__.startswith("tierkv.")
