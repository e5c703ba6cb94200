"""tierkv's hot-window attention backend for vLLM 0.26, registered as "CUSTOM" by
`hot_window.register()`: vLLM's FlashAttention backend whose forward adds the far blocks.

Primitives: `HotWindowBackend`, `HotWindowImpl`, `HotWindowMetadataBuilder`.

    near: FlashAttention over vLLM's pool with each row's block table and key length starting
          past its far blocks (`HotWindowStep.near`), causal, returning the LSE
    far:  `FarKV.attend_into` over the blocks vLLM freed, streamed from the CPU tier; prefill
          chunks attend each staging chunk with the same FlashAttention kernel (`_dense`)
    out:  the LSE merge of the two (`far_attention.merge_with_near`: one pass for a single prefill row; the
          sparse decode rows served by a CUDA graph merge inside it; when the graphs serve every
          row of the step, they run the near FlashAttention too (`_WindowAttention`), so a
          layer's attention costs the host a query copy, a replay and an output copy)

Imported only where vLLM's CUDA attention modules load (vLLM resolves the class by its path).
"""
from __future__ import annotations

import os

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends import flash_attn as fa

from tierkv.integrations.vllm.far_attention import profiled
from tierkv.integrations.vllm.graphed_rows import rows_of
from tierkv.integrations.vllm.hot_window import _STATE, current_step, full_decode_graphs, full_rows


class HotWindowMetadataBuilder(fa.FlashAttentionMetadataBuilder):
    # the far part streams per layer under host control: never inside a captured graph, unless the engine's
    # config asks for its sparse decode step inside vLLM's full decode graph (`full_graph_rows`)
    _cudagraph_support = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if full_decode_graphs(vllm_config)
                else AttentionCGSupport.NEVER)


class HotWindowImpl(fa.FlashAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        self._check_supported(attn_metadata, output_scale, output_block_scale)
        n = attn_metadata.num_actual_tokens
        step = current_step()
        full = full_rows()
        if step is None and full is not None and attn_metadata.max_query_len == 1 and n <= full.max_rows:
            # vLLM capturing (or warming up) its full decode graph: the body reads per-row buffers written
            # before each replayed step (full_graph_rows); no connector step exists at start-up
            window = self._window(layer, *self._kv_views(kv_cache))
            full.attend(rows_of(output, 0, n), full.layer_index[layer.layer_name], rows_of(query, 0, n), self.scale,
                        window, attn_metadata)
            return output
        if step is None:  # a warm-up forward outside the connector: nothing may lie beyond the window
            window = _STATE.get("window")
            if window is None or attn_metadata.max_seq_len > window:
                raise RuntimeError(
                    f"tierkv hot window: a forward over {attn_metadata.max_seq_len} tokens (window {window}) "
                    "without the connector's step; the far blocks are unknown")
            table, seqused_k, max_k = attn_metadata.block_table, attn_metadata.seq_lens, attn_metadata.max_seq_len
        else:
            step.ran = True  # (not a full-graph replay)
            table, seqused_k, max_k = step.near(attn_metadata)
        window = self._window(layer, *self._kv_views(kv_cache))
        q, out = rows_of(query, 0, n), rows_of(output, 0, n)  # the step's tokens (vLLM may pad the batch)
        has_far = step is not None and step.has_far
        layer_index = step.layer_index[layer.layer_name] if has_far else None
        if has_far and step.far.graphs is not None:  # every row a graphed decoding row: one graph, window and far
            check = _CHECK_WHOLE.check(window, q, table, seqused_k, attn_metadata.query_start_loc, max_k)
            if step.far.attend_whole(out, layer_index, q, self.scale, window, (table, seqused_k, max_k), check):
                return output
        # with far blocks the near part goes to its own buffer: where the layer's CUDA graph reads it
        # when the graphs serve every row of the step, else a new one
        near = step.far.near_out_buffer(layer_index, n, self.scale) if has_far else out
        result = window.run(q, table, seqused_k, attn_metadata.query_start_loc, attn_metadata.max_query_len, max_k,
                            out=near, return_lse=has_far)
        if not has_far:
            return output
        near_out, near_lse = result
        with profiled("tierkv.far"):
            near_lse = near_lse if near_lse.shape[1] == n else near_lse[:, :n]
            step.far.attend_into(out, layer_index, q, near_out, near_lse.transpose(0, 1), self.scale, dense=self._dense)
        return output

    def _check_supported(self, attn_metadata, output_scale, output_block_scale) -> None:
        """NotImplementedError naming what the hot window does not serve (the far part would ignore it)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tierkv hot window: fused output quantization is not supported")
        if self.attn_type != AttentionType.DECODER or attn_metadata.use_cascade or self.dcp_world_size > 1:
            raise NotImplementedError("tierkv hot window serves decoder self-attention without cascade or DCP")
        if fa.is_quantized_kv_cache(self.kv_cache_dtype):
            raise NotImplementedError("tierkv hot window: use kv_cache_dtype 'auto' (tierkv quantizes its own tiers)")
        if self.sliding_window not in (None, (-1, -1)):
            raise NotImplementedError(f"tierkv hot window: this layer attends only its own sliding window of "
                                      f"{self.sliding_window[0] + 1} tokens, and the far part would add every block "
                                      "before it; serve this model without the hot window")
        if self.alibi_slopes is not None or self.logits_soft_cap:
            raise NotImplementedError("tierkv hot window: ALiBi and logit soft-capping are not applied to far blocks; "
                                      "this model needs a full pool (tierkv without the hot window)")

    def _window(self, layer, key_cache: torch.Tensor, value_cache: torch.Tensor) -> "_WindowAttention":
        """The layer's window part (FlashAttention over vLLM's pool), as the forward and a step graph
        run it, made once (its cache views and scales stay the same for the engine's life)."""
        window = getattr(self, "_window_part", None)
        if window is None or window.key_cache is not key_cache:
            window = self._window_part = _WindowAttention(self, layer, key_cache, value_cache)
        return window

    def forget_pool(self) -> None:
        """Drop the views of vLLM's pool kept across steps (a run-time resize replaced the pool:
        the old tensor's memory can go back to the driver; `resize_worker`)."""
        self._views = self._window_part = None

    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value views of its pool tensor, made once (a split costs host time
        every layer of every step; the pool tensor stays the same for the engine's life)."""
        views = getattr(self, "_views", None)
        if views is None or views[0] is not kv_cache:
            views = self._views = (kv_cache, *kv_cache.transpose(1, 2).split(self.head_size, dim=-1))
        return views[1], views[2]

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Unmasked attention of q [n, H, D] over contiguous k, v [m, Hkv, D] (a staging chunk of far
        blocks) by vLLM's FlashAttention: float32 (out [n, H, D], lse [n, H])."""
        n, m = q.shape[0], k.shape[0]
        steps = torch.arange(2, dtype=torch.int32, device=q.device)  # [0, 1]: cu_seqlens built on the device
        out, lse = fa.flash_attn_varlen_func(
            q=q, k=k, v=v, cu_seqlens_q=steps * n, max_seqlen_q=n, cu_seqlens_k=steps * m, max_seqlen_k=m,
            softmax_scale=scale, causal=False, fa_version=self.vllm_flash_attn_version, return_softmax_lse=True,
        )
        return out.float(), lse[:, :n].transpose(0, 1).float()


class _WindowAttention:
    """A layer's FlashAttention over the rows' windows in vLLM's pool (causal, each row's blocks and
    key count past its far blocks): `run` as the backend's forward calls it, and as a step graph
    captures it for decoding rows (`FarKV.attend_whole`): (q [m, H, D], block table [m, C], key
    counts [m], query offsets [m + 1], an upper bound of the key counts) -> (out [m, H, D], lse
    [m, H]). Its cache views and scales are fixed for the engine's life; `key` names them for the
    graphs."""

    def __init__(self, impl: "HotWindowImpl", layer, key_cache: torch.Tensor, value_cache: torch.Tensor):
        self.impl, self.layer, self.key_cache, self.value_cache = impl, layer, key_cache, value_cache
        self.key = (key_cache.data_ptr(), value_cache.data_ptr(), layer._k_scale.data_ptr(), layer._v_scale.data_ptr())

    def run(self, q, table, seqused_k, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, out=None,
            return_lse: bool = True):
        """vLLM's flash_attn_varlen_func over the pool: out (into `out` when given), with the LSE
        [H, tokens] when return_lse."""
        impl = self.impl
        descale = (cu_seqlens_q.shape[0] - 1, impl.num_kv_heads)
        return fa.flash_attn_varlen_func(
            q=q, k=self.key_cache, v=self.value_cache, out=out, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            seqused_k=seqused_k, max_seqlen_k=max_seqlen_k, softmax_scale=impl.scale, causal=True,
            alibi_slopes=impl.alibi_slopes, window_size=None, block_table=table, softcap=impl.logits_soft_cap,
            fa_version=impl.vllm_flash_attn_version, k_descale=self.layer._k_scale.expand(descale),
            v_descale=self.layer._v_scale.expand(descale), s_aux=impl.sinks, return_softmax_lse=return_lse)

    def __call__(self, q, table, seqused_k, cu_seqlens_q, max_seqlen_k):
        out, lse = self.run(q, table, seqused_k, cu_seqlens_q, 1, max_seqlen_k)
        return out, lse[:, : q.shape[0]].transpose(0, 1)


class _CheckWhole:
    """CHECK_WHOLE_GRAPHS=N: in the first N layer calls served by a whole graph, also run the
    split path (the window part here, the far part by its own graph) and keep the largest output
    difference (FarKV stats' whole_check_max_abs). For verifying a run; it slows those calls. (Not
    a TIERKV_ variable: those set configuration keys.)"""

    def __init__(self):
        self.left = int(os.environ.get("CHECK_WHOLE_GRAPHS", "0") or 0)

    def check(self, window: "_WindowAttention", *args):
        """`FarKV.attend_whole`'s check for this call (window(*args): the window part run here), or
        None once the checks are used up. It counts only when called, and attend_whole calls it only
        when a whole graph served the layer."""
        if self.left <= 0:
            return None

        def run():
            if self.left <= 0:
                return None
            self.left -= 1
            return window(*args)

        return run


_CHECK_WHOLE = _CheckWhole()


class HotWindowBackend(fa.FlashAttentionBackend):
    _tierkv_hot_window = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return HotWindowImpl

    @staticmethod
    def get_builder_cls():
        return HotWindowMetadataBuilder
