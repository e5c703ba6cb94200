"""A block the tiers failed to load leaves vLLM's prefix cache at once, so no later request reads it.

Primitives: `patch_scheduler` (installed by the plugin's `register`).

tierkv loads synchronously and runs vLLM's "recompute" policy for a block no tier could give: vLLM moves
the request's computed tokens back to that block and computes it again. vLLM 0.26 drops such blocks (and
the request's blocks after them, computed over them) from its prefix cache only under the "fail" policy:
under "recompute" it keeps them, expecting the recompute to fill them. When the request is aborted or
preempted first, the block stays cached with what the failed load left in it, and the next request with
the prompt gets it as a prefix hit: wrong KV, silently. For an engine served by tierkv's connector the
same blocks vLLM computes for the "fail" policy leave the cache under "recompute" too. They stay with
their request, which still recomputes them; vLLM does not cache them again (the rest of the prompt is
found in the tiers instead).
"""
from __future__ import annotations

import functools


def patch_scheduler() -> None:
    """Wrap vLLM's `Scheduler._update_requests_with_invalid_blocks`: for a tierkv engine under the recompute
    policy, the blocks it collects for eviction are evicted from the prefix cache. Idempotent."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._update_requests_with_invalid_blocks
    if getattr(original, "_tierkv_load_failures", False):
        return

    @functools.wraps(original)
    def update(self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks=True):
        affected, tokens, to_evict = original(self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks)
        if evict_blocks and to_evict and _serves_tierkv(self) and getattr(self, "recompute_kv_load_failures", False):
            self.kv_cache_manager.evict_blocks(to_evict)  # vLLM evicts them itself under "fail"
        return affected, tokens, to_evict

    update._tierkv_load_failures = True
    Scheduler._update_requests_with_invalid_blocks = update


def _serves_tierkv(scheduler) -> bool:
    """Whether `scheduler`'s KV connector is tierkv's (other engines in the process are left as vLLM made them)."""
    connector = getattr(scheduler, "connector", None)
    return connector is not None and type(connector).__module__.startswith("tierkv.")
