"""One tierkv store per vLLM engine, shared by its connectors; the stats of every tensor-parallel rank's store.

Primitives: `shared_store`, `peek_store`, `release_store`, `worker_stats`, `merge_rank_stats`.

The worker-side connector of an in-process engine makes the full store first; the scheduler-side
connector of the same engine takes a reference to it, so prefix lookups see the CPU tier. A
scheduler in another process finds none and makes a lookup-only store over the shared tiers.
Under tensor parallelism each rank's worker store is keyed `<engine id>/rank<k>`.
"""
from __future__ import annotations

import threading
from typing import Sequence

from tierkv.integrations.vllm.store import VllmKVStore

_STORES: dict[str, tuple[VllmKVStore, int]] = {}
_STORES_LOCK = threading.Lock()


def shared_store(engine_id: str, make) -> VllmKVStore:
    """The engine's store, made by `make(lookup_only)` on first use; each call takes a reference.

    The worker side calls first in an in-process engine and makes the full store; a scheduler
    side that finds none (its worker lives in another process) makes a lookup-only one.
    """
    with _STORES_LOCK:
        store, refs = _STORES.get(engine_id, (None, 0))
        if store is None:
            store = make()
        _STORES[engine_id] = (store, refs + 1)
        return store


def peek_store(engine_id: str) -> VllmKVStore | None:
    with _STORES_LOCK:
        entry = _STORES.get(engine_id)
        return entry[0] if entry else None


def release_store(engine_id: str) -> None:
    """Drop a reference; the last one closes the store (flushing saves)."""
    with _STORES_LOCK:
        store, refs = _STORES.get(engine_id, (None, 0))
        if store is None:
            return
        if refs > 1:
            _STORES[engine_id] = (store, refs - 1)
            return
        del _STORES[engine_id]
    store.close()


def worker_stats(_worker, engine_id: str) -> list[dict]:
    """Run in every vLLM worker by `LLM.collective_rpc(worker_stats, args=(engine_id,))`: the
    stats of the worker-side stores of engine `engine_id` in this process (one per tensor-parallel
    rank it holds), each with its rank."""
    with _STORES_LOCK:
        stores = [store for key, (store, _) in _STORES.items() if key == engine_id or key.startswith(f"{engine_id}/rank")]
    return [{"tp_rank": store.tp_rank, "tp_size": store.tp_size, **store.stats()} for store in stores if not store.lookup_only]


def merge_rank_stats(per_rank: Sequence[dict]) -> dict:
    """Stats of several tensor-parallel ranks as one stats() dict: each rank's tiers under their
    own name, `<tier>@rank<k>` (so the metrics, the Prometheus endpoint and the dashboard show a
    tier per rank), and everything else of rank k under `ranks.rank<k>`."""
    tiers, ranks = [], {}
    for stats in sorted(per_rank, key=lambda s: s["tp_rank"]):
        rank = stats["tp_rank"]
        tiers.extend({**tier, "tier": f"{tier['tier']}@rank{rank}"} for tier in stats.get("tiers", []))
        ranks[f"rank{rank}"] = {k: v for k, v in stats.items() if k not in ("tiers", "tp_rank", "tp_size")}
    sizes = {s["tp_size"] for s in per_rank}
    if len(sizes) > 1:
        raise ValueError(f"per_rank: stats of different tensor-parallel sizes {sorted(sizes)}")
    return {"tensor_parallel_size": sizes.pop() if sizes else 1, "tiers": tiers, "ranks": ranks}
