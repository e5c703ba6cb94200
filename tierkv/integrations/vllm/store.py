"""What a vLLM engine's tierkv connector keeps: tiers, transfer engine, and the layer-wise moves
between vLLM's paged KV cache and the CPU tier. No vLLM import: tested on CPU with plain tensors.

Primitives: `VllmKVStore` (`PagedLayout`, `BlockSpan`, `layer_order` from paged_layout; the saves
in store_saves, the loads in store_loads).

    vLLM paged cache of one layer (FlashAttention, logical view):  [num_blocks, H, T, 2 * D]
    tierkv block:                                                  [2, H, T, D]   (K, V)

    save (per layer, in the forward that computed the blocks; store_saves):
        kv_cache[block_ids] --copy on the compute stream--> private [n, 2, H, T, D]
            --D2H on the copy stream--> CPU-tier slots (prepared, pinned)
        later, once the copy has landed: slots become visible to lookups (poll)
    load (per layer, `lookahead_layers` ahead of the layer that needs it; store_loads):
        CPU-tier slots (pinned by acquire) --H2D--> fresh [n, 2, H, T, D] --> kv_cache[block_ids]

The private copy means vLLM may free or reuse a saved block as soon as the forward returns:
nothing reads vLLM's cache after the step.

One store per engine (store_registry.shared_store, keyed by vLLM's engine id): the scheduler-side and
the worker-side connector of an in-process engine share it, so prefix lookups see the CPU tier. A
scheduler in another process gets a lookup-only store over the shared tiers (disk, Redis).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Sequence

import torch

from tierkv.block_io import BlockIO
from tierkv.addresses import kv_path
from tierkv.blocks import BlockLayout, block_keys, chain_block_hashes, model_fingerprint
from tierkv.config import TierKVConfig
from tierkv.model_identity import ModelIdentity
from tierkv.storage import build_tiers
from tierkv.transfer import configured_engine
from tierkv.integrations.vllm.paged_layout import BlockSpan, PagedLayout, layer_order
from tierkv.integrations.vllm.store_loads import LayerLoads
from tierkv.integrations.vllm.store_saves import LayerSaves

__all__ = ["BlockSpan", "PagedLayout", "VllmKVStore", "layer_order"]


class VllmKVStore:
    def __init__(self, config: TierKVConfig, layout: BlockLayout, layer_names: Sequence[str],
                 model_id: str | ModelIdentity, device: torch.device | str, *, lookup_only: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        """model_id: what names the model in every block address (a `ModelIdentity`, or a string
        taken as it is). tp_rank, tp_size: under tensor parallelism each rank holds its own KV heads,
        so its keys name the rank (`<hash>/L<layer>/R<rank>of<size>`); a lookup store (scheduler
        side) finds a block only when every rank's copy is held."""
        self.identity = model_id if isinstance(model_id, ModelIdentity) else ModelIdentity(model_id, model_id, None)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank: got {tp_rank}; must be in [0, tp_size={tp_size})")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.config = config
        self.layout = layout
        self.layer_index = layer_order(layer_names)
        self.num_layers = len(self.layer_index)
        # the same on the scheduler side (lookup_only, no CPU tier of its own): every tier of the config counts
        self.fingerprint = model_fingerprint(self.identity.key, self.num_layers, layout, kv_path(config))
        self.device = torch.device(device)
        self.lookup_only = lookup_only
        tiers = [t for t in config.tiers if t.kind != "cpu"] if lookup_only else config.tiers
        self.chain = (build_tiers(tiers, layout, pin_memory=self.device.type == "cuda", storage=config.storage)
                      if tiers else None)
        self.paged = PagedLayout(layout)
        self.lookahead = max(1, config.scheduler.lookahead_layers)
        if not lookup_only:
            self.cpu = self.chain.tiers[0]
            if hasattr(self.cpu, "index_blocks"):  # lookups per block, not per key (present_prefix)
                self.cpu.index_blocks(self.num_layers)
            self.engine = configured_engine(self.device, config.scheduler.transfer_backend)
            self.io = BlockIO(self.engine, self.cpu)
        self.kv_caches: list[torch.Tensor | None] = [None] * self.num_layers
        self._lock = threading.RLock()
        self.loads = LayerLoads(self, self._lock)  # a step's prefix loads into vLLM's cache (store_loads)
        self.saves = LayerSaves(self, self._lock)  # a step's saves out of it, and the hot window's pins (store_saves)
        self.hot_window = None   # the hot window's far-block reader (far.FarKV), set by the connector
        self.counts = {"blocks_saved": 0, "blocks_loaded": 0, "save_fallbacks": 0, "saves_dropped": 0, "load_failures": 0,
                       "lookups": 0, "lookup_hit_blocks": 0}
        # per engine step, the worker connector's host ms in start_load_kv, save_kv_layer and wait_for_save
        self.step_connector_ms: deque[tuple[float, float, float]] = deque(maxlen=512)
        # per step that saved blocks after a full graph's replay, the host ms of wait_for_save's parts: the
        # reads from vLLM's pool, the tier (quantization, slots, D2H), the key summaries, the poll, and the whole hook
        self.save_step_ms: deque[tuple[float, float, float, float, float]] = deque(maxlen=128)

    # -- addresses -------------------------------------------------------------------------------
    def extend_hashes(self, hashes: list[str], token_ids: Sequence[int], num_blocks: int,
                      root: str | None = None) -> list[str]:
        """`hashes` grown in place to the first `num_blocks` full blocks of token_ids, never past the
        full blocks token_ids has: a position may run ahead of the token ids known on the host (a
        token still being sampled), and a partial block's hash would name a block whose other
        tokens are not yet known. root: the first block's parent (`request_identity.chain_root`;
        None: the model's fingerprint)."""
        bs = self.layout.block_tokens
        num_blocks = min(num_blocks, len(token_ids) // bs)
        if num_blocks > len(hashes):
            parent = hashes[-1] if hashes else root
            hashes.extend(chain_block_hashes(token_ids[len(hashes) * bs : num_blocks * bs], bs, self.fingerprint,
                                             parent_hash=parent))
        return hashes

    def keys(self, hashes: Sequence[str], layer: int, rank: int | None = None) -> list[str]:
        """Keys of blocks `hashes` of `layer` for tensor-parallel rank `rank` (this store's by default)."""
        return block_keys(hashes, layer, self._rank_suffix(rank))

    def block_groups(self, hashes: Sequence[str]) -> list[str] | None:
        """The CPU tier's names of blocks `hashes`, all layers at once (`cpu_blocks`: hash + this rank's
        suffix); None when some hash has a "/" (its keys read as another block's: name them key by key)."""
        if any("/" in h for h in hashes):
            return None
        suffix = self._rank_suffix()
        return [h + suffix for h in hashes]

    def _rank_suffix(self, rank: int | None = None) -> str:
        """What keys of tensor-parallel rank `rank` (this store's by default) end with: "" without TP."""
        return "" if self.tp_size == 1 else f"/R{self.tp_rank if rank is None else rank}of{self.tp_size}"

    def _lookup_keys(self, hashes: Sequence[str], layer: int) -> list[list[str]]:
        """Keys to find for a block to count as held: this rank's on a worker, every rank's on a lookup store."""
        ranks = range(self.tp_size) if self.lookup_only else [self.tp_rank]
        return [self.keys(hashes, layer, rank) for rank in ranks]

    def _held(self, hashes: Sequence[str], layer: int) -> list[bool]:
        held = [True] * len(hashes)
        for keys in self._lookup_keys(hashes, layer):
            held = [h and w is not None for h, w in zip(held, self.chain.locate_many(keys))]
        return held

    # -- scheduler side: lookups ---------------------------------------------------------------------
    def present_prefix(self, hashes: Sequence[str]) -> int:
        """How many leading blocks of `hashes` some tier holds for every layer."""
        if self.chain is None or not hashes:
            return 0
        self.poll(wait=True)  # saves that have landed count
        with self._lock:
            n = self._cpu_prefix(hashes)
            if n < len(hashes):  # the rest key by key, through every tier
                n += self._prefix_per_key(hashes[n:])
            self.counts["lookups"] += 1
            self.counts["lookup_hit_blocks"] += n
        return n

    def _cpu_prefix(self, hashes: Sequence[str]) -> int:
        """Leading blocks the CPU tier holds for every layer, one probe per block where it counts
        them (`CpuTier.index_blocks`); 0 where it does not, or is not consulted (a lookup store,
        an unhealthy tier: the per-key path skips it too)."""
        if self.lookup_only or not self.cpu.is_healthy or not hasattr(self.cpu, "held_prefix"):
            return 0
        return self.cpu.held_prefix(hashes, self._rank_suffix()) or 0

    def _prefix_per_key(self, hashes: Sequence[str]) -> int:
        """Leading blocks some tier holds for every layer, layer by layer over every key."""
        first = self._held(hashes, 0)
        n = next((i for i, held in enumerate(first) if not held), len(hashes))
        for layer in range(1, self.num_layers):
            if n == 0:
                break
            held = self._held(hashes[:n], layer)
            n = next((i for i, h in enumerate(held) if not h), n)
        return n

    def stored_mask(self, hashes: Sequence[str], every_layer: bool = False) -> list[bool]:
        """Per block: already held for the first and the last layer (then it need not be saved); every_layer:
        for every layer (blocks a failed load had recomputed: one layer of one may be what was lost)."""
        if self.chain is None or not hashes:
            return [False] * len(hashes)
        layers = range(self.num_layers) if every_layer else sorted({0, self.num_layers - 1})
        mask = [True] * len(hashes)
        with self._lock:
            for layer in layers:
                mask = [m and h for m, h in zip(mask, self._held(hashes, layer))]
        return mask

    # -- worker side ------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, kv in kv_caches.items():
            if name not in self.layer_index:
                raise ValueError(f"vLLM layer {name!r} is not among the layers of the KV cache config")
            self.paged.kind(kv)  # a layout tierkv reads, or a clear error now
            self.kv_caches[self.layer_index[name]] = kv

    def save_layer(self, layer: int, kv: torch.Tensor, spans: Sequence[BlockSpan]) -> torch.Tensor | None:
        """Copy this step's full blocks of `layer` out of vLLM's cache and start their D2H.
        Returns the private copy [n, 2, H, T, D] (the spans' blocks in order), None if none."""
        blocks = self.save_layers([layer], [kv], spans)
        return None if blocks is None else blocks[0]

    def save_layers(self, layers: Sequence[int], kvs: Sequence[torch.Tensor],
                    spans: Sequence[BlockSpan]) -> torch.Tensor | None:
        """`save_layer` for several layers at once (a full decode graph's replay saves every layer
        after the forward): one read per layer, then one quantization, one slot reservation and
        one D2H for all of them, so the host's calls do not grow with the layers. Returns the
        private copy [len(layers), n, 2, H, T, D], None if the spans hold no block."""
        return self.saves.save_layers(layers, kvs, spans)

    def savable(self, spans: Sequence[BlockSpan]) -> Sequence[BlockSpan]:
        """This step's saves less those whose request read a block this step failed to load (`BlockSpan.reads`):
        what it computed attended KV that is not there. vLLM's recompute policy runs it again from the failed
        block, and that step saves it; saved now, the wrong KV would stand in the tiers under the right hashes
        (the recompute finds it held and saves nothing). A load fails before the layers it feeds compute, so
        the layers saved earlier in the step were computed before it (and are saved again with the rest)."""
        failed = self.loads.step_errors
        if not failed:
            return spans
        return [span for span in spans if failed.isdisjoint(span.reads)]

    def begin_loads(self, spans: Sequence[BlockSpan]) -> None:
        """Plan this step's loads and start the first `lookahead` layers' H2D copies (store_loads)."""
        self.loads.begin(spans)

    def finish_layer_load(self, layer: int) -> None:
        """Before layer `layer`'s attention: its loaded blocks are in vLLM's cache (stream order)."""
        self.loads.finish_layer(layer)
        self.poll()

    def num_held(self, keys: Sequence[str]) -> int:
        """How many of `keys` some tier holds."""
        return sum(where is not None for where in self.chain.locate_many(keys))

    def take_load_errors(self) -> set[int]:
        return self.loads.take_errors()

    def poll(self, wait: bool = False) -> None:
        """Make landed saves visible and unpin landed loads (all of them when `wait`)."""
        if self.lookup_only:
            return
        with self._lock:
            self.saves.poll(wait)
            self.loads.poll(wait)

    # -- lifecycle -------------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"counts": dict(self.counts), "model": {**self.identity.stats(), "block_fingerprint": self.fingerprint}}
        if self.step_connector_ms:
            out["step_connector_ms"] = list(self.step_connector_ms)
        if self.save_step_ms:
            out["save_step_ms"] = list(self.save_step_ms)
        if self.chain is not None:
            out.update(self.chain.snapshot())
        if self.hot_window is not None:
            out["hot_window"] = self.hot_window.stats()
        if not self.lookup_only:  # the engine's copies and the far-block caches' (counted on the device)
            out["bytes_moved"] = dict(self.engine.num_bytes_moved)
            out["bytes_moved"]["h2d"] += out.get("hot_window", {}).get("cache_copied_bytes", 0)
            out["load_ring_bytes"] = self.loads.ring_bytes  # the hot window's staging of prefix loads (store_loads)
        return out

    def close(self) -> None:
        if not self.lookup_only:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.poll(wait=True)
        if self.chain is not None:
            self.chain.close()
