"""What `VllmTieredLLM.set_gpu_budget` stands on: the hot-window pool's `PoolResizer` built over
the engine core with the start-up split of the budget, or the reason there is none; and the call
that hands it a budget and waits for the change.

Primitives: `pool_resizer`, `apply_gpu_budget`.

    resizer, why_not = pool_resizer(engine, config, reserved, hot_window=True)
    apply_gpu_budget(resizer, why_not, "2GiB", wait=True, timeout_s=60.0)
"""
from __future__ import annotations

from tierkv.config import TierKVConfig
from tierkv.integrations.vllm.engine_args import TieredEngineArgs
from tierkv.integrations.vllm.resize_control import PoolResizer, engine_core_of
from tierkv.integrations.vllm.resize_plan import split_budget


def pool_resizer(engine, config: TierKVConfig, reserved: TieredEngineArgs, *,
                 hot_window: bool) -> tuple[PoolResizer | None, str | None]:
    """(the hot-window pool's PoolResizer, None) or (None, why set_gpu_budget cannot work) for a
    started `vllm.LLM`; `reserved`: what the budget keeps beside vLLM's pool (the split at start-up,
    `hot_window_engine_args`, is the split of every later budget)."""
    if not hot_window:
        return None, ("hot_window=False keeps vLLM's full pool (sized by gpu_memory_utilization), which is not "
                      "resized at run time; the hot-window pool is")

    def split(budget_bytes: int, rows_pool_bytes: int | None = None, least_staging_bytes: int = 0):
        return split_budget(config, budget_bytes, reserved.summary_reserved_bytes, reserved.full_graph_reserved_bytes,
                            rows_pool_bytes=rows_pool_bytes, least_staging_bytes=least_staging_bytes)

    try:
        return PoolResizer(engine_core_of(engine), split, config.cache.gpu_budget_bytes), None
    except RuntimeError as exc:  # vLLM moved what the resize uses, or its core runs in another process
        return None, str(exc)


def apply_gpu_budget(resizer: PoolResizer | None, why_not: str | None, budget: int | str, *, wait: bool,
                     timeout_s: float | None) -> None:
    """Hand `budget` to the resizer (NotImplementedError with `why_not` when there is none); with
    `wait`, block until applied (TimeoutError after timeout_s; a refusal met when applying raises)."""
    if resizer is None:
        raise NotImplementedError(f"backend='vllm': {why_not}")
    change = resizer.set_gpu_budget(budget)
    if wait and not resizer.wait(change, timeout_s):
        raise TimeoutError(f"the GPU budget change to {budget!r} did not take effect within {timeout_s} s "
                           "(a shrink waits for the running requests' blocks past the new pool); it stays pending and "
                           "applies when they are free (a later set_gpu_budget replaces it)")
