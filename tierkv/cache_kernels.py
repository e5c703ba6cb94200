"""Triton kernels of the far-block caches' placement (`tierkv.vllm_backend.far_cache.RowCaches.place_rows`).

Primitives: `place_rows`, `place_rows_lru` (one program per row, each in its own cache set);
`copy_sources` (the CPU-tier slots the copy kernel reads for the rows' misses, each row from its
own slot list).

One program per row does what the PyTorch path does in some 25 launches: compare the k selected
ids with the k held ones, keep each held id where it is, give the r-th missing id the r-th slot
whose block was not selected again, write the new held ids, and count hits, misses and whether the
row missed. A negative id (a row with fewer far blocks than k selects fewer) is neither held nor
missed; its slot is one of the set's, read with no token. Same result as the PyTorch path
(`RowCaches.place`), bit for bit (both place deterministically). `place_rows_lru` does the same
over C > k slots per layer, the misses taking the least recently used slots the selection does not
read. Imported
lazily where a CUDA selection arrives; also runs under the Triton interpreter (`TRITON_INTERPRET=1`)
on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_placement(i, in_k, local, hit, miss, base, slots_ptr, miss_ptr, counters_ptr):
    """Both kernels' outputs: each of the k ids' slot (local + base) and miss flag, and the counters
    (hits, misses, whether the row missed)."""
    tl.store(slots_ptr + i, local.to(tl.int64) + base, mask=in_k)
    tl.store(miss_ptr + i, miss.to(tl.int8), mask=in_k)
    hits = tl.sum(hit.to(tl.int64), axis=0)
    misses = tl.sum(miss.to(tl.int64), axis=0)
    tl.atomic_add(counters_ptr, hits)
    tl.atomic_add(counters_ptr + 1, misses)
    tl.atomic_add(counters_ptr + 2, (misses > 0).to(tl.int64))


@triton.jit
def _row(ids_ptr, held_ptr, slots_ptr, miss_ptr, sets_ptr, set_stride, base, k):
    """Program r's row: its ids, slots and miss flags at row r of [m, k], and its cache set's slots
    (set sets[r]: held and base move by set_stride per set)."""
    r = tl.program_id(0).to(tl.int64)
    ids_ptr += r * k
    slots_ptr += r * k
    miss_ptr += r * k
    at = tl.load(sets_ptr + r) * set_stride
    return ids_ptr, held_ptr + at, slots_ptr, miss_ptr, base + at


@triton.jit
def _place_kernel(ids_ptr, held_ptr, slots_ptr, miss_ptr, counters_ptr, sets_ptr, set_stride, base, k,
                  K_PAD: tl.constexpr):
    ids_ptr, held_ptr, slots_ptr, miss_ptr, base = _row(ids_ptr, held_ptr, slots_ptr, miss_ptr, sets_ptr, set_stride,
                                                        base, k)
    i = tl.arange(0, K_PAD)
    in_k = i < k
    ids = tl.load(ids_ptr + i, mask=in_k, other=-2)
    valid = in_k & (ids >= 0)  # a negative id selects nothing: never held, placed, hit or missed
    held = tl.load(held_ptr + i, mask=in_k, other=-3)
    same = (ids[:, None] == held[None, :]) & valid[:, None] & in_k[None, :]   # id i held in slot j
    same_i = same.to(tl.int32)
    hit = tl.max(same_i, axis=1) > 0
    used = tl.max(same_i, axis=0) > 0
    miss = valid & (hit == 0)
    free = in_k & (used == 0)
    miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    # the r-th miss takes the r-th free slot
    match = ((free_rank[None, :] == miss_rank[:, None]) & free[None, :]).to(tl.int32)
    local = tl.where(hit, tl.argmax(same_i, axis=1), tl.where(miss, tl.argmax(match, axis=1), 0))
    tl.store(held_ptr + local, ids, mask=valid)
    _write_placement(i, in_k, local, hit, miss, base, slots_ptr, miss_ptr, counters_ptr)


def _check_rows(name: str, held: torch.Tensor, sets: torch.Tensor, ids: torch.Tensor, layer: int) -> None:
    if (held.dim() != 3 or not held.is_contiguous() or ids.dim() != 2 or sets.shape != (ids.shape[0],)
            or {held.dtype, sets.dtype, ids.dtype} != {torch.int64} or not 0 <= layer < held.shape[1]):
        raise ValueError(f"{name}: held {held.dtype} {tuple(held.shape)}, sets {sets.dtype} {tuple(sets.shape)}, "
                         f"ids {ids.dtype} {tuple(ids.shape)}, layer {layer}")


def place_rows(held: torch.Tensor, sets: torch.Tensor, layer: int, ids: torch.Tensor,
               counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The placement of m rows' selections in one launch: held int64 [sets, L, k] (every set, updated
    in place; slot j of set s and layer l is s*L*k + l*k + j), sets int64 [m] (each row's set, on the
    device), ids int64 [m, k] (each row's ids, distinct where not negative), counters int64 [3]
    (hits, misses, rows that missed; added to) -> (slots int64 [m, k], miss bool [m, k]). No host
    sync."""
    _check_rows("place_rows", held, sets, ids, layer)
    m, k = ids.shape
    if held.shape[2] != k:
        raise ValueError(f"place_rows: held has {held.shape[2]} slots per layer, the selections {k} ids")
    ids = ids if ids.is_contiguous() else ids.contiguous()
    slots = torch.empty((m, k), dtype=torch.int64, device=ids.device)
    miss = torch.empty((m, k), dtype=torch.int8, device=ids.device)
    if m == 0 or k == 0:  # no row or an empty selection: nothing to place, no zero-size launch
        return slots, miss.view(torch.bool)
    at = layer * k
    _place_kernel[(m,)](ids, held.view(-1)[at:], slots, miss, counters, sets, held.stride(0), at, k,
                        K_PAD=triton.next_power_of_2(k))
    return slots, miss.view(torch.bool)


@triton.jit
def _place_lru_kernel(ids_ptr, held_ptr, last_use_ptr, clock_ptr, slots_ptr, miss_ptr, counters_ptr, sets_ptr,
                      fresh_ptr, used_ptr, set_stride, base, k, c, K_PAD: tl.constexpr, C_PAD: tl.constexpr,
                      TRACK: tl.constexpr, PREFETCH: tl.constexpr):
    s = tl.load(sets_ptr + tl.program_id(0).to(tl.int64))  # last_use moves with held; the clock is the set's
    last_use_ptr += s * set_stride
    fresh_ptr += s * set_stride
    clock_ptr += s
    ids_ptr, held_ptr, slots_ptr, miss_ptr, base = _row(ids_ptr, held_ptr, slots_ptr, miss_ptr, sets_ptr, set_stride,
                                                        base, k)
    i = tl.arange(0, K_PAD)
    j = tl.arange(0, C_PAD)
    in_k = i < k
    valid_j = j < c
    ids = tl.load(ids_ptr + i, mask=in_k, other=-2)
    valid_i = in_k & (ids >= 0)  # a negative id selects nothing
    held = tl.load(held_ptr + j, mask=valid_j, other=-3)
    last_use = tl.load(last_use_ptr + j, mask=valid_j, other=0)
    tick = tl.load(clock_ptr)
    same = ((ids[:, None] == held[None, :]) & valid_i[:, None] & valid_j[None, :]).to(tl.int32)   # [K, C]
    hit = tl.max(same, axis=1) > 0
    read = tl.max(same, axis=0) > 0
    miss = valid_i & (hit == 0)
    unread = valid_j & (read == 0)
    # each unread slot's rank by (last use, index): the r-th miss takes the slot of rank r
    jj = tl.arange(0, C_PAD)
    before = ((last_use[:, None] < last_use[None, :]) |
              ((last_use[:, None] == last_use[None, :]) & (jj[:, None] < jj[None, :]))) & unread[:, None]
    rank = tl.sum(before.to(tl.int32), axis=0)                                   # [C]: unread slots before j
    miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    match = ((rank[None, :] == miss_rank[:, None]) & unread[None, :]).to(tl.int32)   # [K, C]
    local = tl.where(hit, tl.argmax(same, axis=1), tl.where(miss, tl.argmax(match, axis=1), 0))
    if TRACK:  # which slots hold a prefetched block no selection has read yet
        if PREFETCH:  # the blocks this placement copies in are fresh; held ones keep their mark
            tl.store(fresh_ptr + local, tl.zeros([K_PAD], tl.int8) + 1, mask=miss)
        else:  # a selection reads its slots: a fresh one was a prefetch used; none stays fresh
            fresh = tl.load(fresh_ptr + j, mask=valid_j, other=0)
            tl.atomic_add(used_ptr, tl.sum((read & (fresh != 0)).to(tl.int64), axis=0))
            tl.store(fresh_ptr + local, tl.zeros([K_PAD], tl.int8), mask=valid_i)
    tl.store(held_ptr + local, ids, mask=valid_i)
    tl.store(last_use_ptr + local, tl.zeros([K_PAD], tl.int64) + tick, mask=valid_i)
    tl.store(clock_ptr, tick + 1)
    _write_placement(i, in_k, local, hit, miss, base, slots_ptr, miss_ptr, counters_ptr)


def place_rows_lru(held: torch.Tensor, last_use: torch.Tensor, clock: torch.Tensor, sets: torch.Tensor, layer: int,
                   ids: torch.Tensor, counters: torch.Tensor, fresh: torch.Tensor | None = None,
                   used: torch.Tensor | None = None, prefetch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`place_rows` over C >= k slots per layer: held, last_use int64 [sets, L, C] (updated in place),
    clock int64 [sets] (each set's tick, advanced by one per row), sets int64 [m], ids int64 [m, k]
    -> (slots int64 [m, k], miss bool [m, k]); the misses take the least recently used slots the
    selection does not read. fresh int8 [sets, L, C] and used int64 [1], when given, track the
    prefetch: a placement with `prefetch` marks the slots it fills fresh; any other (a selection)
    adds the fresh slots it reads to `used` and leaves none of its slots fresh."""
    _check_rows("place_rows_lru", held, sets, ids, layer)
    m, k = ids.shape
    c = held.shape[2]
    if last_use.shape != held.shape or not last_use.is_contiguous() or c < k or clock.shape != (held.shape[0],):
        raise ValueError(f"place_rows_lru: held {tuple(held.shape)}, last_use {tuple(last_use.shape)}, "
                         f"clock {tuple(clock.shape)}, ids {tuple(ids.shape)}")
    track = fresh is not None
    if track and (fresh.shape != held.shape or fresh.dtype != torch.int8 or not fresh.is_contiguous()
                  or used is None or used.shape != (1,) or used.dtype != torch.int64):
        raise ValueError(f"place_rows_lru: fresh {fresh.dtype} {tuple(fresh.shape)} (int8 like held "
                         f"{tuple(held.shape)}), used {None if used is None else tuple(used.shape)} (int64 [1])")
    ids = ids if ids.is_contiguous() else ids.contiguous()
    slots = torch.empty((m, k), dtype=torch.int64, device=ids.device)
    miss = torch.empty((m, k), dtype=torch.int8, device=ids.device)
    if m == 0 or k == 0:  # no row or an empty selection: nothing placed, no clock advanced, no launch
        return slots, miss.view(torch.bool)
    at = layer * c
    fresh_at = fresh.view(-1)[at:] if track else miss  # (not read without TRACK)
    _place_lru_kernel[(m,)](ids, held.view(-1)[at:], last_use.view(-1)[at:], clock, slots, miss, counters, sets,
                            fresh_at, used if track else counters, held.stride(0), at, k, c,
                            K_PAD=triton.next_power_of_2(k), C_PAD=triton.next_power_of_2(c), TRACK=track,
                            PREFETCH=prefetch)
    return slots, miss.view(torch.bool)


@triton.jit
def _copy_sources_kernel(lists_ptr, ids_ptr, miss_ptr, src_ptr, k, K_PAD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    slots_ptr = tl.load(lists_ptr + r).to(tl.pointer_type(tl.int64))  # row r's slot list
    i = tl.arange(0, K_PAD)
    valid = i < k
    ids = tl.load(ids_ptr + r * k + i, mask=valid, other=0)
    miss = tl.load(miss_ptr + r * k + i, mask=valid, other=0) != 0
    src = tl.load(slots_ptr + ids, mask=valid & miss, other=-1)
    tl.store(src_ptr + r * k + i, tl.where(miss, src, -1), mask=valid)


def copy_sources(lists: torch.Tensor, ids: torch.Tensor, miss: torch.Tensor) -> torch.Tensor:
    """src int64 [m, k]: src[r, j] = row r's slot list at ids[r, j] where miss[r, j], else -1 (held,
    not copied). lists: the addresses of the rows' slot lists (int64 tensors on the device, each
    longer than its row's ids), int64 [m] on the device; ids int64 [m, k]; miss bool [m, k]. One
    launch. No host sync."""
    m, k = ids.shape
    if lists.shape != (m,) or lists.dtype != torch.int64 or ids.dtype != torch.int64 or miss.shape != ids.shape:
        raise ValueError(f"copy_sources: lists {lists.dtype} {tuple(lists.shape)}, ids {ids.dtype} {tuple(ids.shape)}, "
                         f"miss {tuple(miss.shape)}")
    ids = ids if ids.is_contiguous() else ids.contiguous()
    miss = (miss if miss.is_contiguous() else miss.contiguous()).view(torch.int8)
    src = torch.empty((m, k), dtype=torch.int64, device=ids.device)
    if m and k:
        _copy_sources_kernel[(m,)](lists, ids, miss, src, k, K_PAD=triton.next_power_of_2(k))
    return src
