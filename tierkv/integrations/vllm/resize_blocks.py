"""Run-time resize of the vLLM hot-window pool, the scheduler half: vLLM 0.26's `BlockPool` (one per
engine, shared by its KVCacheManager) gains or loses block ids at its tail. Touches vLLM internals;
`missing_block_pool_hooks` names what it relies on, and a test runs it against the installed vLLM.

Primitives: `held_tail_block_ids`, `fence_tail`, `release_fence`, `resize_block_pool`, `missing_block_pool_hooks`.

    ids   0      1 ...                     new-1 | new ... old-1
          null   blocks kept (their KV copied)   | dropped: must all be free (ref_cnt 0, in the
                                                 | free queue); unlinked from it, hashes evicted
    grow: ids old .. new-1 are new KVCacheBlocks appended to the free queue's tail.

Both check everything before the first change: a refusal (BlockPoolBusy) leaves the pool as it was.

While a shrink waits for held ids, `fence_tail` takes the free ids past its target out of the free queue
(fenced: ref_cnt 0, unlinked, no hash), evicts the held ones' hashes, and fences each as vLLM frees it
(the pool's `free_blocks` followed: the one way vLLM frees, mid-step too), so vLLM hands them to no new
request and the shrink waits only for the blocks held when it was asked, not for every request admitted
after (under steady load it would wait forever). vLLM sees fewer free blocks meanwhile and admits
accordingly. `release_fence` puts them back when the change is refused or replaced by a larger one.
"""
from __future__ import annotations

BLOCK_POOL_HOOKS = ("num_gpu_blocks", "blocks", "free_block_queue", "null_block", "_maybe_evict_cached_block",
                    "get_num_free_blocks", "free_blocks")
FREE_QUEUE_HOOKS = ("remove", "append_n", "num_free_blocks")
MANAGER_HOOKS = ("block_pool", "kv_cache_config", "watermark_blocks")


class BlockPoolBusy(RuntimeError):
    """A shrink whose dropped block ids are still held; nothing was changed."""

    def __init__(self, held_ids: list[int], new_num_blocks: int):
        self.held_ids = held_ids
        super().__init__(f"vLLM's pool cannot shrink to {new_num_blocks} blocks: {len(held_ids)} block ids at or past "
                         f"it are held by running requests (first {held_ids[:8]})")


def missing_block_pool_hooks() -> list[str]:
    """The vLLM attributes this module uses that the installed vLLM lacks (empty: all there)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    probe = BlockPool(num_gpu_blocks=2, enable_caching=False, hash_block_size=16)
    missing = [f"BlockPool.{a}" for a in BLOCK_POOL_HOOKS if not hasattr(probe, a)]
    queue = getattr(probe, "free_block_queue", None)
    missing += [f"FreeKVCacheBlockQueue.{a}" for a in FREE_QUEUE_HOOKS
                if not hasattr(queue if queue is not None else FreeKVCacheBlockQueue, a)]
    block = KVCacheBlock(0)
    missing += [f"KVCacheBlock.{a}" for a in ("block_id", "ref_cnt", "prev_free_block", "next_free_block", "is_null")
                if not hasattr(block, a)]
    init = KVCacheManager.__init__.__code__.co_names
    missing += [f"KVCacheManager.{a}" for a in MANAGER_HOOKS if a not in init]
    return missing


def held_tail_block_ids(pool, new_num_blocks: int) -> list[int]:
    """Ids in [new_num_blocks, pool.num_gpu_blocks) that are not free (a shrink to new_num_blocks
    must wait for them); fenced ids are free."""
    fenced = _fenced(pool)
    return [b.block_id for b in pool.blocks[new_num_blocks:] if not _is_free(b) and b.block_id not in fenced]


def fence_tail(pool, new_num_blocks: int) -> int:
    """Fence the ids at or past `new_num_blocks` until the shrink to it applies or `release_fence`: the free
    ones leave vLLM's free queue now, their cached hashes evicted (a block whose eviction fails stays in the
    queue), ids fenced for a smaller target go back; the held ones lose their hashes (no prefix hit hands them
    to a new request) and are fenced the moment vLLM frees them (inside a step too: its sliding window and
    preemption free blocks that the same step's allocations would take). Returns how many are fenced."""
    release_fence(pool, below=new_num_blocks)
    _hook_frees(pool)
    pool._tierkv_fence_target = new_num_blocks
    fenced = _fenced(pool)
    for block in pool.blocks[new_num_blocks:]:
        if block.block_id not in fenced:
            _fence(pool, block, fenced)
    return len(fenced)


def release_fence(pool, below: int | None = None) -> None:
    """Fenced ids (those below `below`; None: all, and nothing fenced from now on) back at the free queue's tail."""
    fenced = _fenced(pool)
    back = [fenced.pop(i) for i in sorted(fenced) if below is None or i < below]
    if below is None:
        pool._tierkv_fence_target = None
    if back:
        pool.free_block_queue.append_n(back)


def _fence(pool, block, fenced: dict) -> None:
    """A free block out of the free queue into `fenced`, a held one's hash evicted; what vLLM's own
    bookkeeping refuses is left as it was (the shrink waits for it as before the fence)."""
    try:
        pool._maybe_evict_cached_block(block)
    except Exception:
        return
    if _is_free(block):
        pool.free_block_queue.remove(block)
        fenced[block.block_id] = block


def _hook_frees(pool) -> None:
    """This pool's `free_blocks` (the one way vLLM frees blocks) followed, while a fence stands, by fencing
    what it freed at or past the target."""
    if getattr(pool, "_tierkv_frees_hooked", False):
        return
    free_blocks = pool.free_blocks

    def fencing_free_blocks(ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        free_blocks(blocks)
        target = getattr(pool, "_tierkv_fence_target", None)
        if target is not None:
            fenced = _fenced(pool)
            for block in blocks:
                if block.block_id >= target and block.block_id not in fenced and block.ref_cnt == 0:
                    _fence(pool, block, fenced)

    pool.free_blocks = fencing_free_blocks
    pool._tierkv_frees_hooked = True


def _fenced(pool) -> dict:
    """{block id: KVCacheBlock} of the pool's fenced blocks (kept on the pool object)."""
    if not hasattr(pool, "_tierkv_fenced"):
        pool._tierkv_fenced = {}
    return pool._tierkv_fenced


def resize_block_pool(manager, new_num_blocks: int) -> None:
    """Give vLLM's KVCacheManager `manager` a pool of `new_num_blocks` block ids (null block
    included). A shrink raises BlockPoolBusy, changing nothing, while a dropped id is held."""
    pool = manager.block_pool
    old = pool.num_gpu_blocks
    if new_num_blocks < 2:
        raise ValueError(f"new_num_blocks: got {new_num_blocks}; vLLM's pool needs the null block and one more")
    release_fence(pool, below=new_num_blocks)  # kept ids go back; fenced ids past it are dropped with the rest
    pool._tierkv_fence_target = None  # (the change a fence stood for is this one)
    if new_num_blocks < old:
        _shrink(pool, new_num_blocks)
    elif new_num_blocks > old:
        _grow(pool, new_num_blocks)
    manager.kv_cache_config.num_blocks = new_num_blocks
    # vLLM's int(watermark x num_blocks), from the fraction first seen (rescaling the rounded count decayed to 0)
    if not hasattr(manager, "_tierkv_watermark"):
        manager._tierkv_watermark = manager.watermark_blocks / old
    manager.watermark_blocks = int(manager._tierkv_watermark * new_num_blocks)


def _is_free(block) -> bool:
    return block.ref_cnt == 0 and not block.is_null and block.prev_free_block is not None \
        and block.next_free_block is not None


def _shrink(pool, new_num_blocks: int) -> None:
    held = held_tail_block_ids(pool, new_num_blocks)
    if held:
        raise BlockPoolBusy(held, new_num_blocks)
    fenced = _fenced(pool)
    dropped = [b for b in pool.blocks[new_num_blocks:] if b.block_id not in fenced]  # (fenced: already out)
    for block in dropped:  # first what can fail: a failure leaves every block in the free queue
        pool._maybe_evict_cached_block(block)
    for block in dropped:  # every one is linked in the free queue (checked above): unlinking cannot fail
        pool.free_block_queue.remove(block)
    fenced.clear()  # (every fenced id was at or past new_num_blocks: release_fence put the others back)
    del pool.blocks[new_num_blocks:]
    pool.num_gpu_blocks = new_num_blocks


def _grow(pool, new_num_blocks: int) -> None:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    added = [KVCacheBlock(i) for i in range(pool.num_gpu_blocks, new_num_blocks)]
    pool.free_block_queue.append_n(added)
    pool.blocks.extend(added)
    pool.num_gpu_blocks = new_num_blocks
