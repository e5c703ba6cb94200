"""The KV cache of one sequence, all layers: what is on the GPU, what is in the CPU tier.

Primitives: `SequenceKV` (`append`, `attend`, `finish`), `CapacityError`.

Per layer and step (one `append` then one `attend`, layer after layer):

    append(layer, k_new, v_new)
        fresh = old tokens of the partial block + new tokens     [nb, 2, H, T, D] on device
        full fresh blocks  --D2H-->  CPU tier slots (keys: content hash when tokens are known, sequence_keys)
        resident fresh blocks  -->  their GPU slots
    attend(layer, q)
        resident old blocks (paged) + streamed old blocks (staging ring) + fresh tokens (causal)
        merged with the log-sum-exp rule: exact attention over the whole sequence
"""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import torch

from tierkv.attention import contiguous_partial_attention, merge_partials, paged_partial_attention
from tierkv.attention.flash import can_use_flash, flash_partial_attention, gather_blocks
from tierkv.scheduler import StepPlan, plan_step
from tierkv.transfer.device import to_device_no_sync
from tierkv.transfer.step_indices import StepIndices, step_indices
from tierkv.engine.predictors import predictor_for
from tierkv.engine.sequence_keys import SequenceKeys
from tierkv.sparse.summaries import BlockSummaries, select_far_blocks_on_device, select_far_blocks_per_kv_head

if TYPE_CHECKING:
    from tierkv.engine.runtime import KVRuntime


class CapacityError(ValueError):
    """A request's KV does not fit the tier it must live in."""


class SequenceKV:
    def __init__(self, runtime: "KVRuntime", token_ids: list[int] | None = None):
        self.rt = runtime
        self.seq_id = uuid.uuid4().hex[:16]
        self.token_ids: list[int] = list(token_ids or [])  # known tokens, for content keys
        # the prompt's length when given: every step within it is prefill, exact under any policy (a prompt's
        # last token after a reused prefix, or a one-token last chunk, is no decode step)
        self.prompt_tokens = len(self.token_ids)
        num_layers = runtime.num_layers
        self.num_tokens = [0] * num_layers
        self.cpu_slots: list[list[int]] = [[] for _ in range(num_layers)]
        self._slots_mirror: list[tuple[list[int] | None, torch.Tensor | None]] = [(None, None)] * num_layers
        self.block_keys: list[list[str]] = [[] for _ in range(num_layers)]
        self._pending_d2h: list[tuple[list[str], object]] = []
        self._last_d2h = None
        self._step: StepPlan | None = None
        self._step_index: StepIndices | None = None  # the step plan's index lists on the device
        self._fresh: list[torch.Tensor | None] = [None] * num_layers
        self.prefix_blocks_by_tier: dict[str, int] = {}
        self.is_finished = False
        sparse = runtime.config.scheduler.policy == "sparse"
        layout = runtime.layout
        self.summaries = (BlockSummaries(num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, runtime.device,
                                         bound_weight=runtime.config.scheduler.sparse_bound_weight)
                          if sparse else None)
        self._is_sparse_step = False
        self._keys = SequenceKeys(self.seq_id, layout.block_tokens, runtime.fingerprint,  # CPU-tier keys of its blocks
                                  self.prompt_tokens if sparse else None)
        # a CPU device: far blocks are attended in the CPU tier's slab, no staging, no predictor (the
        # runtime's `InPlaceFarReads`, tierkv.attention.cpu_far: its buffer and count serve every sequence)
        self.far_in_place = runtime.far_in_place
        # the far part of a sparse decode step: one policy per predictor (tierkv.engine.predictors); read in
        # place, predictor 'none' (the predictors exist to hide copies)
        self.predictor = predictor_for(runtime, sparse and self.far_in_place is None)
        self._graph_step = None  # a decode step run for a CUDA graph (`tierkv.engine.graph_step.GraphStep`)
        self.num_resident_reads = 0  # block reads served from GPU slots (all layers)
        self.num_streamed_reads = 0  # block reads streamed from the CPU tier (all layers)

    @property
    def seq_length(self) -> int:
        return self.num_tokens[0]

    # -- writes ---------------------------------------------------------------------------------
    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """k_new, v_new: [n, num_kv_heads, head_dim] on the runtime's device, KV dtype."""
        if self.is_finished:
            raise RuntimeError(f"sequence {self.seq_id} is finished")
        if self._graph_step is not None:
            self._graph_step.append(layer, k_new, v_new)
            return
        rt = self.rt
        n = k_new.shape[0]
        if layer == 0:
            self._begin_step(n)
        step = self._step
        if self.num_tokens[layer] != step.t0 or n != step.num_new_tokens:
            raise RuntimeError(
                f"layer {layer}: got {n} tokens at position {self.num_tokens[layer]}, "
                f"layer 0 of this step had {step.num_new_tokens} at {step.t0}"
            )
        blocks = self._assemble_fresh(layer, step, k_new, v_new)
        self._write_back(layer, step, blocks)
        resident = rt.pool.resident[layer]
        index = self._step_index
        resident.index_copy_(0, index.fresh_resident_slots, blocks.index_select(0, index.fresh_resident_index))
        self.num_tokens[layer] += n
        if self._is_sparse_step:
            self.predictor.after_append(self, layer)

    def _begin_step(self, n: int) -> None:
        rt = self.rt
        self._complete_finished_d2h()
        rt.apply_pending_budget(self)
        step = plan_step(rt.residency, rt.layout.block_tokens, self.num_tokens[0], n)
        self._step = step
        self._step_index = step_indices(step, rt.device)
        self.num_resident_reads += len(step.resident_blocks) * rt.num_layers
        is_decode = n == 1 and self.num_tokens[0] >= self.prompt_tokens  # a generated token, not the prompt's
        self._is_sparse_step = self.summaries is not None and is_decode
        if self._is_sparse_step:  # blocks are chosen per layer at attention time
            rt.streamer.clear()
            self.predictor.begin_step(self, step.streamed_blocks, self._last_d2h)
            return
        self.predictor.invalidate()  # the streamer's regions overwrite a predictor's far-block caches
        self.num_streamed_reads += len(step.streamed_blocks) * rt.num_layers
        if self.far_in_place is not None:
            rt.streamer.clear()
            return
        cpu_slots = [torch.tensor(slots[step.streamed_blocks.start : step.streamed_blocks.stop], dtype=torch.int64)
                     for slots in self.cpu_slots]
        rt.streamer.plan(step, cpu_slots, rt.layout.block_tokens, after=self._last_d2h)
        rt.streamer.run(through_layer=rt.config.scheduler.lookahead_layers - 1)

    def _assemble_fresh(self, layer: int, step: StepPlan, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """[nb, 2, H, T, D] blocks from the partial block's old tokens and the new tokens."""
        rt = self.rt
        T = rt.layout.block_tokens
        num_blocks = step.num_blocks_after - step.first_block
        offset = step.t0 - step.first_block * T
        tokens = torch.zeros((2, num_blocks * T, *k_new.shape[1:]), dtype=k_new.dtype, device=k_new.device)
        if offset:
            old = rt.pool.resident[layer, rt.residency.slot_of(step.first_block)]  # [2, H, T, D]
            tokens[:, :offset] = old[:, :, :offset].transpose(1, 2)
        tokens[0, offset : offset + k_new.shape[0]] = k_new
        tokens[1, offset : offset + k_new.shape[0]] = v_new
        self._fresh[layer] = tokens[:, : offset + k_new.shape[0]]  # [2, num_fresh, H, D]
        # [2, nb*T, H, D] -> [nb, 2, H, T, D]
        return tokens.view(2, num_blocks, T, *k_new.shape[1:]).permute(1, 0, 3, 2, 4).contiguous()

    def _write_back(self, layer: int, step: StepPlan, blocks: torch.Tensor) -> None:
        """D2H the blocks that became full into pinned CPU-tier slots held by this sequence. A refusal, or an
        interrupt (Ctrl-C) before the copy is handed over to `_pending_d2h`, leaves no slot taken (`prepared_put`)."""
        rt = self.rt
        num_full = step.num_fresh_full
        if num_full == 0:
            return
        first = step.first_block
        keys = [self._keys.key(self.token_ids, b, layer) for b in range(first, first + num_full)]
        with rt.cpu.prepared_put(keys) as put:
            rt.chain.spill(0, put.evicted)
            if None in put.slots:
                raise CapacityError(
                    f"the CPU tier ({rt.cpu.num_slots} blocks) has no free slot for sequence {self.seq_id}: "
                    f"raise tiers[0].capacity_bytes"
                )
            put.copy = rt.io.scatter(blocks[:num_full], torch.tensor(put.slots, dtype=torch.int64))
            put.hand_over(self._pending_d2h, (keys, put.copy))  # completed by _complete_finished_d2h once it lands
        self._last_d2h = put.copy
        if self.summaries is not None:
            self.summaries.update(layer, first, blocks[:num_full])
        self.cpu_slots[layer].extend(put.slots)
        self.block_keys[layer].extend(keys)

    def wait_for_write_back(self) -> None:
        """Host wait until every block written back so far is in the CPU tier."""
        self._complete_finished_d2h(wait=True)

    def _complete_finished_d2h(self, wait: bool = False) -> None:
        for entry in list(self._pending_d2h):
            keys, handle = entry
            if wait:
                handle.synchronize()
            if handle.is_done():
                self._pending_d2h.remove(entry)  # first: an interrupt (Ctrl-C) past here must not complete it twice
                self.rt.cpu.complete_put(keys, keep_pinned=True)
                self.rt.chain.write_through([k for k in keys if not k.startswith("anon-")])

    # -- reads ----------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [n, num_heads, head_dim] for the tokens of this step -> float32 [n, num_heads, head_dim]."""
        if self._graph_step is not None:
            return self._graph_step.attend(layer, q, scale)
        rt = self.rt
        step, index = self._step, self._step_index
        use_flash = can_use_flash(q)  # prefill chunks on CUDA: old keys all precede the queries
        acc = None
        in_place = self.far_in_place
        if step.resident_blocks and (in_place is None or not in_place.reads_resident):
            acc = self._attend_blocks(q, rt.pool.resident[layer], index.resident_slots, index.resident_start_pos,
                                      index.resident_num_tokens, scale, use_flash)
        if in_place is not None:
            return self._attend_in_place(layer, q, scale, acc)
        sparse = self._is_sparse_step
        chunks = (self.predictor.chunks_for_layer(self, layer, q, step.streamed_blocks, self._last_d2h) if sparse
                  else rt.streamer.chunks_for_layer(layer))
        for chunk in chunks:
            part = self._attend_blocks(q, rt.pool.staging, chunk.slots, chunk.start_pos, chunk.num_tokens,
                                       scale, use_flash)
            acc = part if acc is None else merge_partials([acc, part])
        fresh = self._fresh[layer]
        self._fresh[layer] = None
        if use_flash and fresh.shape[1] == q.shape[0]:
            part = flash_partial_attention(q, fresh[0], fresh[1], scale=scale, causal=True)
        else:
            part = contiguous_partial_attention(q, fresh[0], fresh[1], scale=scale, q_positions=index.q_positions,
                                                k_positions=index.fresh_positions)
        near = part if acc is None else merge_partials([acc, part])
        return self.predictor.attend_far(layer, q, near, scale) if sparse else near[0]

    def _attend_in_place(self, layer: int, q: torch.Tensor, scale: float, acc) -> torch.Tensor:
        """A CPU device: `acc` (the resident part, or None) merged with one call over the layer's far
        blocks (all of them, or the sparse selection) read where they lie in the CPU tier, with the
        resident ones where `reads_resident` (identical copies are in the tier) and, in a one-token
        decode step, the fresh tokens (none after the query); a prefill's fresh part is causal, apart."""
        step = self._step
        fresh = self._fresh[layer]
        self._fresh[layer] = None
        with_resident = self.far_in_place.reads_resident
        blocks = range(step.first_block) if with_resident else step.streamed_blocks  # old full blocks: 0..first-1
        if self._is_sparse_step:
            scheduler = self.rt.config.scheduler
            k = scheduler.sparse_token_budget // self.rt.layout.block_tokens
            select = (select_far_blocks_per_kv_head if scheduler.sparse_selection == "per_kv_head"
                      else select_far_blocks_on_device)  # [Hkv, k]: each KV head its own blocks; [k]: one set
            blocks = select(self.summaries, layer, q[0], step.streamed_blocks, k)
            self.num_streamed_reads += blocks.shape[-1]  # per KV head: k blocks of one head each, k blocks' bytes
            if with_resident:
                resident = torch.as_tensor(step.resident_blocks, dtype=torch.int64)
                blocks = torch.cat([resident.expand(*blocks.shape[:-1], -1), blocks], dim=-1)
        is_decode = step.num_new_tokens == 1
        far = self.far_in_place.attend(q, self.device_cpu_slots(layer), blocks, scale=scale,
                                       fresh=fresh if is_decode else None)
        parts = [part for part in (acc, far) if part is not None]
        if not is_decode:
            index = self._step_index
            parts.append(contiguous_partial_attention(q, fresh[0], fresh[1], scale=scale, q_positions=index.q_positions,
                                                      k_positions=index.fresh_positions))
        return (parts[0] if len(parts) == 1 else merge_partials(parts))[0]

    def device_cpu_slots(self, layer: int) -> torch.Tensor:
        """cpu_slots[layer] as an int64 tensor on the runtime's device, extended as blocks are written."""
        slots = self.cpu_slots[layer]
        source, mirror = self._slots_mirror[layer]
        if source is not slots or mirror.numel() > len(slots):  # the list was replaced (prefix load)
            source, mirror = slots, torch.empty(0, dtype=torch.int64, device=self.rt.device)
        if mirror.numel() < len(slots):
            mirror = torch.cat([mirror, to_device_no_sync(slots[mirror.numel():], self.rt.device)])
        self._slots_mirror[layer] = (source, mirror)
        return mirror

    def _attend_blocks(self, q, pool, slots, start_pos, num_tokens, scale, use_flash):
        if use_flash:  # full blocks, all before every query: no mask needed
            k, v = gather_blocks(pool, slots)
            return flash_partial_attention(q, k, v, scale=scale, causal=False)
        return paged_partial_attention(q, pool, slots, start_pos, num_tokens, scale=scale,
                                       q_positions=self._step_index.q_positions)

    def observe_layer_input(self, layer: int, hidden: torch.Tensor, position: object) -> None:
        """Layer `layer`'s input hidden state ([hidden_size], one decode token) and its position as
        the runtime's `query_projector` takes it; predictor `query` predicts the next layers from it."""
        self.predictor.observe(layer, hidden, position)

    def read_stats(self) -> dict:
        """GPU hit rate at attention time: resident block reads over all block reads (far-block cache
        hits count as resident, its misses as streamed). Waits for the device's counters."""
        hits, misses = self.predictor.read_counts()
        resident, streamed = self.num_resident_reads + hits, self.num_streamed_reads + misses
        total = resident + streamed
        return {"resident_block_reads": resident, "streamed_block_reads": streamed,
                "gpu_hit_rate": resident / total if total else None}

    # -- end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for write-backs, publish content-addressed blocks for reuse, release the rest."""
        if self.is_finished:
            return
        self.is_finished = True
        self.rt.streamer.clear()  # chunks copied ahead for a next step that will not come are discarded
        self.predictor.finish()
        self._complete_finished_d2h(wait=True)
        keys = [k for layer_keys in self.block_keys for k in layer_keys]
        self.rt.cpu.release(keys)
        self.rt.cpu.remove_many([k for k in keys if k.startswith("anon-")])
        # a budget change made after this sequence's last forward step would otherwise wait for the next one
        self.rt.apply_pending_requested()
