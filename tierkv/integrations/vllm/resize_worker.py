"""Run-time resize of the vLLM hot-window pool, the worker half: each GPU worker's KV tensors are
reallocated at the new block count, by vLLM's own allocation and reshape (the layout it made at
start-up), run in every worker by `collective_rpc(resize_worker_kv, args=(num_blocks,))`.

Primitives: `resized_kv_caches` (no vLLM: allocate, copy the kept blocks), `resize_worker_kv`
(the collective_rpc body), `worker_least_staging`, `worker_runner_missing`, `missing_worker_hooks`.

    1. allocate every layer's new tensor      an OOM here: the new ones are dropped, nothing changed
    2. copy block ids [0, min(old, new))      on the device, along each tensor's block dimension
    3. swap: the runner's kv_caches, each attention layer's kv_cache, the runner's kv_cache_config,
       the connector's registered caches (its store reads and saves through them), the hot-window
       backend's cached views
    4. drop the old tensors, torch.cuda.empty_cache(): the bytes go back to the driver (the new ones are made
       in an allocator pool of their own, `own_segments`, so that the next resize gives back all of theirs)
    (with staging_bytes, the exact hot window's staging ring is re-made the same way: allocated in 1,
    bound in 3, the old one dropped in 4)

Runs between engine steps only (the caller's step-boundary lock): no forward reads a tensor
being replaced. Refuses engines whose CUDA graphs captured the pool's addresses.
"""
from __future__ import annotations

import copy
import time
import traceback

import torch

from tierkv.storage.gpu import own_segments

RUNNER_METHODS = ("_allocate_kv_cache_tensors", "_reshape_kv_cache_tensors")
RUNNER_ATTRIBUTES = ("kv_cache_config", "kv_caches", "_kernel_block_sizes", "compilation_config", "cache_config")


def missing_worker_hooks() -> list[str]:
    """The vLLM names the worker resize uses that the installed vLLM lacks (empty: all there):
    GPUModelRunner's methods, and the instance attributes its methods name."""
    import inspect

    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assigned = set()
    for _, member in inspect.getmembers(GPUModelRunner, inspect.isfunction):
        assigned.update(member.__code__.co_names)
    missing = [f"GPUModelRunner.{a}" for a in RUNNER_METHODS if not callable(getattr(GPUModelRunner, a, None))]
    missing += [f"GPUModelRunner.{a}" for a in RUNNER_ATTRIBUTES if a not in assigned]
    missing += [f"vllm.v1.worker.utils.{a}" for a in ("bind_kv_cache",) if not hasattr(worker_utils, a)]
    return missing


def block_dim(old: torch.Tensor, new: torch.Tensor) -> int | None:
    """The one dimension in which two KV tensors of one layer differ (None: same shape)."""
    if old.dim() != new.dim():
        raise ValueError(f"KV tensors of {old.dim()} and {new.dim()} dimensions: not one layer's at two sizes")
    dims = [d for d in range(old.dim()) if old.shape[d] != new.shape[d]]
    if len(dims) > 1:
        raise ValueError(f"KV tensors {tuple(old.shape)} and {tuple(new.shape)} differ in more than the block dimension")
    return dims[0] if dims else None


def copy_kept_blocks(old_caches: dict, new_caches: dict) -> None:
    """Copy each layer's leading blocks (as many as both hold) from old_caches into new_caches
    (same layer names; tensors of vLLM's per-layer layout, any dtype and device, differing only in
    the block dimension; a Mamba layer's is a list of state tensors, each copied so)."""
    if old_caches.keys() != new_caches.keys():
        raise ValueError(f"layers differ: {sorted(old_caches.keys() ^ new_caches.keys())[:4]}")
    for name, layer in new_caches.items():
        for old, new in _layer_tensors(name, old_caches[name], layer):
            _copy_leading(old, new)


def _layer_tensors(name: str, old, new) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(old, new) tensor pairs of one layer's caches: one pair, or one per state tensor of a Mamba layer."""
    if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor):
        return [(old, new)]
    if isinstance(new, (list, tuple)) and isinstance(old, (list, tuple)) and len(old) == len(new):
        return list(zip(old, new))
    raise ValueError(f"layer {name}: KV caches of different kinds ({type(old).__name__}, {type(new).__name__})")


def _copy_leading(old: torch.Tensor, new: torch.Tensor) -> None:
    """`old`'s leading blocks into `new` (along the one dimension in which they differ)."""
    dim = block_dim(old, new)
    if dim is None:
        new.copy_(old)
        return
    kept = min(old.shape[dim], new.shape[dim])
    new.narrow(dim, 0, kept).copy_(old.narrow(dim, 0, kept))


def resized_config(kv_cache_config, new_num_blocks: int):
    """A copy of vLLM's KVCacheConfig at `new_num_blocks`: each tensor's bytes scaled per block."""
    config = copy.deepcopy(kv_cache_config)
    old = config.num_blocks
    for tensor in config.kv_cache_tensors:
        if tensor.size % old:
            raise ValueError(f"KV tensor of {tensor.size} bytes is not {old} equal blocks")
        tensor.size = tensor.size // old * new_num_blocks
    config.num_blocks = new_num_blocks
    return config


def resize_worker_kv(worker, new_num_blocks: int, staging_bytes: int | None = None) -> dict:
    """collective_rpc body: give this worker's model runner KV tensors of `new_num_blocks` blocks,
    the kept blocks' contents copied, and, with `staging_bytes`, the exact hot window's staging ring
    that size (`TierKVConnector.prepare_staging`: allocated before anything is bound). Returns
    {"old_bytes", "new_bytes", "seconds"} of this GPU's KV tensors."""
    started = time.perf_counter()
    runner = worker.model_runner
    try:
        bind_ring = _prepare_ring(staging_bytes)  # an OOM here changes nothing
    except BaseException as exc:
        _release_failed(runner, exc)
        raise
    if runner.kv_cache_config.num_blocks == new_num_blocks:  # (a restore after a failure elsewhere)
        if bind_ring is not None:
            bind_ring()
            _release(runner)
        return {"old_bytes": 0, "new_bytes": 0, "seconds": time.perf_counter() - started}
    if getattr(runner, "cross_layers_kv_cache", None) is not None or getattr(runner, "shared_kv_cache_layers", None):
        raise RuntimeError("a KV pool shared across layers cannot be resized at run time")
    config = resized_config(runner.kv_cache_config, new_num_blocks)
    context = runner.compilation_config.static_forward_context
    segments = raw = new_caches = None
    try:  # 1. allocate: an OOM leaves the old tensors bound
        with own_segments(getattr(runner, "device", "cpu")) as segments:  # the next resize gives back every byte of them
            raw = _allocate_one_backing(runner, config)
        new_caches = runner._reshape_kv_cache_tensors(raw, runner._kernel_block_sizes)
        del raw
        old_caches = {name: context[name].kv_cache for name in new_caches}
        copy_kept_blocks(old_caches, new_caches)  # 2.
    except BaseException as exc:
        new_caches = raw = segments = None  # noqa: F841  dropped (tensors, then their pool) before the cache is emptied
        _release_failed(runner, exc)
        raise
    old_bytes = _storage_bytes(old_caches)
    _bind(runner, config, new_caches)  # 3.
    if bind_ring is not None:
        bind_ring()
    del old_caches
    runner._tierkv_kv_segments = segments  # the old tensors' allocator pool (a resize's) goes after them
    _release(runner)  # 4.
    new_bytes = _storage_bytes(new_caches)
    return {"old_bytes": old_bytes, "new_bytes": new_bytes, "seconds": time.perf_counter() - started}


def _allocate_one_backing(runner, config) -> dict[str, torch.Tensor]:
    """vLLM's raw per-layer KV buffers for `config` (what `_allocate_kv_cache_tensors` gives: int8, layers
    sharing a KVCacheTensor sharing its buffer) as views of one allocation that vLLM's own routine makes:
    the caching allocator packs per-layer tensors under 10 MiB into shared 20 MiB segments, which a later
    shrink cannot hand back to the driver whole (on the H100 a shrink to 140 blocks of 32 layers showed a
    quarter of its bytes free). Packed layouts (a block stride) and Mamba state (vLLM's reshape places it by
    storage offsets from the allocation's start) keep vLLM's per-tensor allocation."""
    import dataclasses

    tensors = config.kv_cache_tensors
    if (len(tensors) < 2 or any(getattr(t, "block_stride", 0) > 0 for t in tensors)
            or getattr(config, "has_mamba_layers", False)):
        return runner._allocate_kv_cache_tensors(config)
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.size // 256) * 256  # each layer's view 256-byte aligned
    names = [name for t in tensors for name in t.shared_by]
    whole = dataclasses.replace(config, kv_cache_tensors=[dataclasses.replace(tensors[0], size=total, shared_by=names)])
    backing = runner._allocate_kv_cache_tensors(whole)[names[0]]
    return {name: backing[o : o + t.size] for t, o in zip(tensors, offsets) for name in t.shared_by}


def _storage_bytes(caches: dict) -> int:
    """Bytes of the distinct allocations behind `caches` (views of one backing counted once; a Mamba layer's
    state tensors each)."""
    tensors = [t for v in caches.values() for t in (v if isinstance(v, (list, tuple)) else [v])]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _bind(runner, config, new_caches: dict[str, torch.Tensor]) -> None:
    """Point vLLM (runner, layers), the tierkv connector and the hot-window backend at new_caches."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.v1.worker.utils import bind_kv_cache

    context = runner.compilation_config.static_forward_context
    runner.kv_caches.clear()
    bind_kv_cache(new_caches, context, runner.kv_caches)
    runner.kv_cache_config = config
    runner.cache_config.num_gpu_blocks = config.num_blocks
    for name in new_caches:
        forget = getattr(getattr(context[name], "impl", None), "forget_pool", None)
        if forget is not None:
            forget()
    if has_kv_transfer_group():
        get_kv_transfer_group().register_kv_caches(new_caches)


def worker_runner_missing(worker) -> list[str]:
    """collective_rpc body: what the worker resize calls that this worker's model runner lacks (empty: all
    there). `missing_worker_hooks` reads the GPUModelRunner class; a worker may run another runner (vLLM's
    V2 runner when VLLM_USE_V2_MODEL_RUNNER=1)."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return ["worker.model_runner"]
    name = type(runner).__name__
    return ([f"{name}.{a}" for a in RUNNER_METHODS if not callable(getattr(runner, a, None))]
            + [f"{name}.{a}" for a in RUNNER_ATTRIBUTES if not hasattr(runner, a)])


def worker_least_staging(worker) -> int:
    """collective_rpc body: the least staging this worker's hot window can be re-made from
    (`far_staging.ChunkGrid.least_staging_bytes`); 0 without one."""
    far = getattr(_connector(), "_far", None)
    return far.grid.least_staging_bytes(far.store.layout.num_bytes) if far is not None else 0


def _connector():
    """This worker's KV connector (None without one)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _prepare_ring(staging_bytes: int | None):
    """The tierkv connector's new staging ring, allocated, and the callable that binds it (None: no change)."""
    if staging_bytes is None:
        return None
    prepare = getattr(_connector(), "prepare_staging", None)
    return prepare(staging_bytes) if prepare is not None else None


def _release_failed(runner, exc: BaseException) -> None:
    """`_release` after a failure half-way: the frames of the callees that raised held what they made (the
    error, kept by the caller, keeps its traceback; their locals are cleared)."""
    traceback.clear_frames(exc.__traceback__)
    _release(runner)


def _release(runner) -> None:
    """Hand freed KV memory back to the driver once nothing reads it: the tierkv connector's copy engine
    drops the tensors it keeps alive for its finished copies first (the last step's reads and saves name the
    old KV tensors and staging ring; kept until its next copy, they held a shrink's bytes)."""
    device = getattr(runner, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        settle = getattr(_connector(), "settle_transfers", None)
        if settle is not None:
            settle()
        torch.cuda.empty_cache()
