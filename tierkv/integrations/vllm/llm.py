"""`TieredLLM(model_dir, config, backend="vllm")`: a vLLM engine whose KV blocks go to the tierkv
tiers and whose repeated prefixes come back from them.

Primitives: `VllmTieredLLM` (`generate`, `stats`, `set_gpu_budget`, `close`), what `TieredLLM` returns for
backend="vllm".

    llm = TieredLLM("/models/llama-3.1-8b", "configs/vllm-128k.yaml", backend="vllm",
                    max_model_len=131072, gpu_memory_utilization=0.5)
    out = llm.generate([ids_or_text], SamplingParams(max_new_tokens=64))

The engine runs in-process (the scheduler and the worker share one tier chain) and eagerly
(the connector's per-layer hooks run outside CUDA graphs).

With `hot_window=True` (the default) vLLM's KV pool holds only each request's last
`cache.window_tokens` tokens: the pool is `cache.gpu_budget_bytes` minus the staging ring
(`scheduler.staging_bytes`), whatever `max_model_len` is, and tierkv's attention backend reads
older blocks from the tiers (`hot_window.py`). Under `scheduler.policy: sparse` the budget also
holds the key summaries of `max_num_seqs` requests of `max_model_len` tokens (`max_num_seqs` is
then required; `max_model_len` defaults to the checkpoint's max_position_embeddings and is passed
to vLLM, so the summaries are reserved for and capped at the length vLLM runs with; their bytes
come from the checkpoint's config.json), so vLLM's pool, the staging ring and the summaries
together stay within `cache.gpu_budget_bytes`; with `scheduler.sparse_full_graphs` over a quantized
CPU tier, so do the full decode graph's codes and scales (`full_graph_packed_bytes`). Prompts are prefilled in chunks of
`scheduler.prefill_chunk_tokens`; vLLM's own prefix cache is off (the tiers hold every block).
`hot_window=False` keeps vLLM's full pool (sized by `gpu_memory_utilization`) with the connector
alone: repeated prefixes are then loaded back from the tiers instead of prefilled.
"""
from __future__ import annotations

import os
import tempfile
import time

import yaml

from tierkv.config import TierKVConfig, load_config
from tierkv import model_shape
from tierkv.config.load import to_dict
from tierkv.llm import TieredLLM, generate_inputs
from tierkv.sampling import RequestOutput, SamplingParams
from tierkv.integrations.vllm.config import kv_transfer_config
from tierkv.integrations.vllm.full_graph_rows import full_graphs_configured


class VllmTieredLLM(TieredLLM):
    """`TieredLLM(..., backend="vllm")`: the same public methods over a vLLM engine."""

    summary_reserved_bytes = 0  # GPU bytes of the budget kept for sparse key summaries (set by __init__)
    full_graph_reserved_bytes = 0  # and for the full decode graph's codes and scales (quantized CPU tier)
    full_graph_reserved_rows = 0  # the rows those codes were reserved for (the largest captured batch)

    def __init__(self, model, config: TierKVConfig | str | os.PathLike | dict | None = None,
                 backend: str = "vllm", *, tokenizer=None, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.5, enable_prefix_caching: bool = True, hot_window: bool = True,
                 **engine_kwargs):
        if backend != "vllm":
            raise ValueError(f"backend: got {backend!r}; VllmTieredLLM is backend='vllm'")
        if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
            raise ValueError(f"model: got {model!r}; backend='vllm' needs a local checkpoint directory")
        if tokenizer is not None:
            raise ValueError("tokenizer: backend='vllm' loads the tokenizer from the checkpoint directory")
        self.config, self.config_file, self._owned_config_file = _config_file(config)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: scheduler and worker share the tiers
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runner the connector was run with on the GPU
        from vllm import LLM

        self.hot_window = hot_window
        try:  # a bad argument or a failed start leaves no config file behind
            self.engine = LLM(**self._engine_kwargs(model, max_model_len, gpu_memory_utilization, enable_prefix_caching,
                                                    engine_kwargs))
            check_full_graph_rows(self.full_graph_reserved_rows, self.engine.llm_engine.vllm_config)
        except BaseException:
            self.close()
            raise
        self.engine_id = str(self.engine.llm_engine.vllm_config.kv_transfer_config.engine_id)
        self.resizer, self._resize_error = self._pool_resizer()
        self._totals = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "prefix_tokens": 0, "wall_s": 0.0}
        from tierkv.metrics import MetricsService

        try:  # the config's metrics section: JSONL snapshots / endpoint / dashboard, as on the transformers backend
            self.metrics = MetricsService.from_config(self.config.metrics, self.stats,
                                                      set_gpu_budget=self.set_gpu_budget if hot_window else None)
        except Exception:
            self.close()
            raise

    def _engine_kwargs(self, model, max_model_len: int | None, gpu_memory_utilization: float,
                       enable_prefix_caching: bool, engine_kwargs: dict) -> dict:
        """vLLM's arguments: the connector, and with the hot window its pool (sets
        `summary_reserved_bytes` under the sparse policy)."""
        kwargs = dict(
            model=os.fspath(model),
            kv_transfer_config=kv_transfer_config(self.config_file, model_id=os.path.abspath(model)),
            block_size=self.config.cache.block_tokens,
            enforce_eager=True,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
        )
        if self.hot_window:
            clash = sorted({"attention_config", "kv_cache_memory_bytes"} & set(engine_kwargs))
            if clash:
                raise ValueError(f"{', '.join(clash)}: set by the hot window (backend CUSTOM, pool = "
                                 "cache.gpu_budget_bytes - scheduler.staging_bytes - sparse key summaries); "
                                 "pass hot_window=False to set them")
            if self.config.scheduler.policy == "sparse":
                # the summaries are reserved for, and capped at, the same max_model_len vLLM runs with
                max_model_len = sparse_max_model_len(model, max_model_len)
                self.summary_reserved_bytes = sparse_summary_bytes(model, self.config, max_model_len, engine_kwargs)
                self.full_graph_reserved_bytes = full_graph_packed_bytes(model, self.config, engine_kwargs)
                if self.full_graph_reserved_bytes:
                    self.full_graph_reserved_rows = full_graph_rows(engine_kwargs)
            kwargs.update(hot_window_engine_args(self.config, self.summary_reserved_bytes,
                                                 self.full_graph_reserved_bytes))
            if int(engine_kwargs.get("tensor_parallel_size", 1) or 1) > 1:
                require_plugin_installed()
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(engine_kwargs)
        if self.hot_window and os.path.isfile(os.path.join(os.fspath(model), "config.json")):
            check_hot_window_pool(model, self.config, kwargs)
        if (self.hot_window and full_graphs_configured(self.config) and not kwargs.get("enforce_eager")
                and "compilation_config" not in engine_kwargs):
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": full_decode_capture_sizes(
                kwargs.get("max_num_seqs"))}
        return kwargs

    def generate(self, prompts, sampling: SamplingParams | None = None, **sampling_kwargs) -> list[RequestOutput]:
        """Same inputs (any form `tierkv.prompts` accepts, checked before any work) and outputs as the
        transformers backend; vLLM batches the prompts."""
        from vllm import SamplingParams as VllmSampling

        sampling, batch = generate_inputs(prompts, sampling, sampling_kwargs, vocab_size=self._vocab_size())
        inputs = [prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt} for prompt in batch]
        params = VllmSampling(
            max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k or 0,
            top_p=sampling.top_p or 1.0, seed=sampling.seed, ignore_eos=sampling.ignore_eos,
            stop_token_ids=sampling.stop_token_ids, logprobs=2,
        )
        start = time.perf_counter()
        outputs = self.engine.generate(inputs, params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        results = []
        for out in outputs:
            completion = out.outputs[0]
            top2 = [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in (completion.logprobs or [])]
            stats = {"prompt_tokens": len(out.prompt_token_ids), "generated_tokens": len(completion.token_ids),
                     "prefix_tokens": out.num_cached_tokens or 0, "batch_wall_s": wall_s,
                     "top2_logprobs": top2, "top2_margins": [t[0] - t[1] if len(t) > 1 else None for t in top2]}
            self._totals["requests"] += 1
            self._totals["prompt_tokens"] += stats["prompt_tokens"]
            self._totals["generated_tokens"] += stats["generated_tokens"]
            self._totals["prefix_tokens"] += stats["prefix_tokens"]
            self.metrics.record_request({k: v for k, v in stats.items() if not k.startswith("top2")})
            results.append(RequestOutput(prompt_token_ids=list(out.prompt_token_ids), token_ids=list(completion.token_ids),
                                         text=completion.text, finish_reason=completion.finish_reason or "length",
                                         stats=stats, request_id=str(out.request_id), prompt=out.prompt))
        self._totals["wall_s"] += wall_s
        return results

    def _vocab_size(self) -> int | None:
        """The engine model's vocabulary size (token ids are checked against it), None when not known."""
        model_config = getattr(self.engine.llm_engine, "model_config", None)
        return model_config.get_vocab_size() if hasattr(model_config, "get_vocab_size") else None

    def stats(self) -> dict:
        """Running totals, the GPU bytes reserved for sparse key summaries, and the tiers'
        statistics; under tensor parallelism each rank's (its
        tiers named `<tier>@rank<k>`, the rest under `ranks.rank<k>`), gathered from the worker
        processes by vLLM's `collective_rpc`."""
        from tierkv.integrations.vllm.store_registry import merge_rank_stats, peek_store, worker_stats

        totals = {"requests": dict(self._totals), "backend": "vllm", "summary_reserved_bytes": self.summary_reserved_bytes,
                  "full_graph_reserved_bytes": self.full_graph_reserved_bytes}
        if getattr(self, "resizer", None) is not None:
            totals["gpu"] = self.resizer.stats()
        if self.engine.llm_engine.vllm_config.parallel_config.tensor_parallel_size > 1:
            per_rank = [s for worker in self.engine.collective_rpc(worker_stats, args=(self.engine_id,)) for s in worker]
            return {**totals, **merge_rank_stats(per_rank)}
        store = peek_store(self.engine_id)
        return {**totals, **(store.stats() if store is not None else {})}

    def _pool_resizer(self):
        """(the hot-window pool's PoolResizer, None) or (None, why set_gpu_budget cannot work)."""
        if not self.hot_window:
            return None, ("hot_window=False keeps vLLM's full pool (sized by gpu_memory_utilization), which is not "
                          "resized at run time; the hot-window pool is")
        from tierkv.integrations.vllm.resize_control import PoolResizer, engine_core_of
        from tierkv.integrations.vllm.resize_plan import split_budget

        def split(budget_bytes: int):  # the start-up split (hot_window_engine_args)
            return split_budget(self.config, budget_bytes, self.summary_reserved_bytes, self.full_graph_reserved_bytes)

        try:
            return PoolResizer(engine_core_of(self.engine), split, self.config.cache.gpu_budget_bytes), None
        except RuntimeError as exc:  # vLLM moved what the resize uses, or its core runs in another process
            return None, str(exc)

    def set_gpu_budget(self, budget: int | str, *, wait: bool = True, timeout_s: float | None = 60.0) -> None:
        """Resize the GPU budget ("1GiB" or bytes) of the hot-window pool: vLLM's pool takes the
        budget less the staging ring and the sparse reservations (the start-up split); shrinking
        gives the memory back to the driver. Refused, changing nothing, with ValueError (not a
        size) or BudgetRefused (sizes named: see docs/vllm-resize.md). Applied between engine steps:
        at once when idle; during requests at the next step boundary, a shrink once the block ids it
        drops are free (`stats()["gpu"]`: resize_policy, pending_budget_bytes). With `wait`, blocks
        until applied (TimeoutError after timeout_s) and raises a refusal met when applying."""
        if self.resizer is None:
            raise NotImplementedError(f"backend='vllm': {self._resize_error}")
        change = self.resizer.set_gpu_budget(budget)
        if wait and not change.wait(timeout_s):
            raise TimeoutError(f"the GPU budget change to {budget!r} did not take effect within {timeout_s} s "
                               "(a shrink waits for the running requests' blocks past the new pool)")

    def reload_config(self, config) -> list[str]:
        raise NotImplementedError("backend='vllm': the engine's config is fixed at start-up (make a new TieredLLM); "
                                  "run-time changes exist on the transformers backend")

    def close(self) -> None:
        metrics, self.metrics = getattr(self, "metrics", None), None
        if metrics is not None:
            metrics.close()
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
        owned, self._owned_config_file = getattr(self, "_owned_config_file", None), None
        if owned and os.path.exists(owned):
            os.unlink(owned)

    def __enter__(self) -> "VllmTieredLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hot_window_engine_args(config: TierKVConfig, summary_bytes: int = 0, full_graph_bytes: int = 0) -> dict:
    """vLLM engine arguments of the hot-window pool: backend CUSTOM, a KV pool of the GPU budget
    minus the staging ring and `summary_bytes` (the sparse policy's key summaries,
    `sparse_summary_bytes`), prefill chunks of `scheduler.prefill_chunk_tokens`, vLLM's async
    scheduling as `scheduler.vllm_async_scheduling` says (off by default). full_graph_bytes: what the
    full decode graph keeps for a quantized CPU tier's codes and scales (`full_graph_packed_bytes`),
    also out of the budget."""
    from tierkv.config import ConfigError
    from tierkv.integrations.vllm import hot_window
    from tierkv.integrations.vllm.resize_plan import split_budget

    split = split_budget(config, config.cache.gpu_budget_bytes, summary_bytes, full_graph_bytes)
    if split.pool_bytes <= 0:
        raise ConfigError("cache.gpu_budget_bytes", config.cache.gpu_budget_bytes,
                          f"must exceed {split.reserved_text()}: the rest is vLLM's hot-window pool")
    hot_window.register()
    return dict(attention_config={"backend": "CUSTOM"}, kv_cache_memory_bytes=split.pool_bytes, enable_prefix_caching=False,
                max_num_batched_tokens=config.scheduler.prefill_chunk_tokens,
                async_scheduling=config.scheduler.vllm_async_scheduling)


def rank_kv_heads(shape: dict, engine_kwargs: dict) -> int:
    """KV heads of the checkpoint `shape` on each GPU: split over the engine's tensor_parallel_size."""
    return max(1, shape["num_key_value_heads"] // int(engine_kwargs.get("tensor_parallel_size", 1) or 1))


def engine_dtype_bytes(engine_kwargs: dict, auto_bytes: int = 2) -> int:
    """Bytes per element of the engine's dtype: 4 for float32, 2 for any other named dtype,
    `auto_bytes` when the engine takes the checkpoint's ('auto' or not given)."""
    dtype = str(engine_kwargs.get("dtype", "auto"))
    return auto_bytes if dtype == "auto" else 4 if dtype in ("float32", "float", "torch.float32") else 2


def hot_window_pool_need(model_dir, config: TierKVConfig, engine_kwargs: dict) -> int:
    """Bytes vLLM's start-up check asks of the hot-window pool for one request, at least: every
    layer's window of `cache.window_tokens` (the model's own sliding window when smaller) plus the
    tokens in flight (max_num_batched_tokens, twice that
    under vLLM's async scheduling, which keeps two batches in flight), capped at max_model_len, in
    blocks of `cache.block_tokens`, plus one block (vLLM's sliding-window bound)."""
    from tierkv.integrations.vllm.resize_plan import window_blocks

    shape = checkpoint_shape(model_dir)
    tokens = config.cache.block_tokens
    in_flight = int(engine_kwargs.get("max_num_batched_tokens") or config.scheduler.prefill_chunk_tokens)
    if engine_kwargs.get("async_scheduling"):
        in_flight *= 2
    max_len = engine_kwargs.get("max_model_len") or shape["max_position_embeddings"] or (1 << 62)
    # a model with its own sliding window keeps those layers' spec: the smaller window, so the check
    # never asks more than vLLM does (a larger own window is left to vLLM's check)
    window = min(config.cache.window_tokens, shape["sliding_window"] or config.cache.window_tokens)
    blocks = window_blocks(window, in_flight, max_len, tokens)
    element = (1 if str(engine_kwargs.get("kv_cache_dtype", "auto")).startswith("fp8") else
               engine_dtype_bytes(engine_kwargs, shape["dtype_bytes"]))
    return (shape["num_hidden_layers"] * blocks * 2 * rank_kv_heads(shape, engine_kwargs) * tokens
            * shape["head_dim"] * element)


def check_hot_window_pool(model_dir, config: TierKVConfig, engine_kwargs: dict) -> None:
    """A config error naming the keys to change when the hot-window pool is smaller than vLLM's
    start-up check asks (`hot_window_pool_need`); vLLM's own error would speak of max_model_len,
    which the hot window does not keep on the GPU."""
    from tierkv.config import ConfigError
    from tierkv.units import format_bytes

    need = hot_window_pool_need(model_dir, config, engine_kwargs)
    pool = engine_kwargs["kv_cache_memory_bytes"]
    if pool < need:
        doubled = (" (twice max_num_batched_tokens in flight under scheduler.vllm_async_scheduling: halve "
                   "scheduler.prefill_chunk_tokens to keep the pool)" if engine_kwargs.get("async_scheduling") else "")
        raise ConfigError("cache.gpu_budget_bytes", config.cache.gpu_budget_bytes,
                          f"leaves vLLM a hot-window pool of {format_bytes(pool)}, and its window of "
                          f"{config.cache.window_tokens} tokens plus "
                          f"{engine_kwargs.get('max_num_batched_tokens')} prefill tokens in flight{doubled} "
                          f"needs {format_bytes(need)}: raise the budget, or lower cache.window_tokens or "
                          "scheduler.prefill_chunk_tokens")


def full_decode_capture_sizes(max_num_seqs) -> list[int]:
    """The batch sizes vLLM captures graphs for under `scheduler.sparse_full_graphs`: vLLM's default
    sizes (1, 2, 4, multiples of 8 below 256, of 16 from 256, up to twice max_num_seqs and 512) with
    max_num_seqs itself added. vLLM keeps a full decode graph only for the sizes up to max_num_seqs and
    pads a batch up to the next one, so without it a batch of, say, 10 of max_num_seqs 10 found no
    full graph (10 is not a default size, 16 is past 10) and every such step ran piecewise, the sparse
    step outside the graph."""
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: got {max_num_seqs!r}; scheduler.sparse_full_graphs captures vLLM's full "
                         "decode graphs up to it: pass a positive max_num_seqs")
    largest = min(2 * max_num_seqs, 512)
    default = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    return sorted({size for size in default if size <= largest} | {min(max_num_seqs, 512)})


def full_graph_rows(engine_kwargs: dict) -> int:
    """The largest batch vLLM will capture a full decode graph for, worked out before the engine
    exists: the largest capture size of the engine's compilation_config when given, else of
    `full_decode_capture_sizes(max_num_seqs)`, and at least max_num_seqs (the connector sizes its
    rows from vLLM's resolved size, `connector.graph_rows`; `check_full_graph_rows` ties the two)."""
    max_num_seqs = engine_kwargs.get("max_num_seqs")
    sizes = full_decode_capture_sizes(max_num_seqs)
    own = engine_kwargs.get("compilation_config")
    if isinstance(own, dict) and own.get("cudagraph_capture_sizes"):
        sizes = list(own["cudagraph_capture_sizes"])
    return max(max_num_seqs, *sizes)


def check_full_graph_rows(reserved_rows: int, vllm_config) -> None:
    """After vLLM starts: the rows the full decode graph's codes were reserved for in the budget
    (`full_graph_rows`) must cover the batch the connector sizes them for (`connector.graph_rows`);
    otherwise the GPU would hold more than cache.gpu_budget_bytes. Nothing to check when nothing
    was reserved."""
    if not reserved_rows:
        return
    from tierkv.integrations.vllm.connector import graph_rows

    rows = graph_rows(vllm_config)
    if rows > reserved_rows:
        raise RuntimeError(f"the full decode graph's codes were reserved for {reserved_rows} rows, and vLLM resolved "
                           f"its largest captured batch to {rows}: pass compilation_config="
                           "{'cudagraph_capture_sizes': [...]} with the sizes to capture")


def full_graph_packed_bytes(model_dir, config: TierKVConfig, engine_kwargs: dict) -> int:
    """GPU bytes the sparse step inside vLLM's full decode graph keeps on each GPU beside the caches:
    over a quantized CPU tier, the codes and scales of a selection for each row of the largest
    captured batch (`full_graph_rows.FullDecodeRows`), and of the next-step prefetch's margin
    (`prefetch_margin.MarginPrefetch`, with its per-layer slot lists over any tier); 0 without
    `scheduler.sparse_full_graphs` or under an eager engine. The largest batch is the largest
    capture size: of the engine's compilation_config when given, else of
    `full_decode_capture_sizes(max_num_seqs)`."""
    if not full_graphs_configured(config) or engine_kwargs.get("enforce_eager", True):
        return 0
    rows = full_graph_rows(engine_kwargs)
    shape = checkpoint_shape(model_dir)
    tokens, margin = config.cache.block_tokens, config.scheduler.sparse_prefetch_margin
    lists = rows * margin * shape["num_hidden_layers"] * 2 * 8  # int64 sources and targets per layer
    cpu = config.tiers[0] if config.tiers and config.tiers[0].kind == "cpu" else None
    if cpu is None or cpu.storage_dtype not in ("int8", "float8_e4m3fn"):
        return lists
    kv_heads = rank_kv_heads(shape, engine_kwargs)
    per_block = 2 * kv_heads * tokens * shape["head_dim"] + 2 * kv_heads * 4  # one-byte codes, a float32 scale per head
    return lists + rows * (max(1, config.scheduler.sparse_token_budget // tokens) + margin) * per_block


def sparse_summary_bytes(model_dir, config: TierKVConfig, max_model_len: int | None, engine_kwargs: dict) -> int:
    """GPU bytes the sparse policy's key summaries take at most on each GPU: `max_num_seqs`
    requests of `max_model_len` tokens (default: the checkpoint's max_position_embeddings), the
    model's shape read from the checkpoint's config.json, its KV heads split over
    `tensor_parallel_size`."""
    from tierkv.sparse.request_summaries import summary_bytes_per_request

    max_num_seqs = engine_kwargs.get("max_num_seqs")
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: got {max_num_seqs!r}; scheduler.policy 'sparse' keeps the key summaries of "
                         "every running request on the GPU inside cache.gpu_budget_bytes, so the engine needs a "
                         "positive max_num_seqs (requests at once)")
    shape = checkpoint_shape(model_dir)
    max_len = sparse_max_model_len(model_dir, max_model_len, shape)
    per_request = summary_bytes_per_request(max_len, config.cache.block_tokens, shape["num_hidden_layers"],
                                            rank_kv_heads(shape, engine_kwargs), shape["head_dim"],
                                            engine_dtype_bytes(engine_kwargs))
    return max_num_seqs * per_request


def sparse_max_model_len(model_dir, max_model_len: int | None, shape: dict | None = None) -> int:
    """The length the sparse policy reserves summaries for: `max_model_len`, else the checkpoint's
    max_position_embeddings (what vLLM would take). shape: `checkpoint_shape(model_dir)` when the
    caller has read it."""
    max_len = max_model_len or (shape or checkpoint_shape(model_dir))["max_position_embeddings"]
    if not max_len:
        raise ValueError(f"max_model_len: not given and {model_dir}/config.json has no max_position_embeddings; "
                         "the sparse policy sizes its key summaries from it")
    return max_len


def checkpoint_shape(model_dir) -> dict:
    """num_hidden_layers, num_key_value_heads, head_dim, max_position_embeddings (None when
    absent), dtype_bytes (4 for float32, else 2) and sliding_window (the model's own, None when
    absent or turned off) of a checkpoint directory's config.json (`tierkv.model_shape`)."""
    try:
        shape = model_shape.checkpoint_shape(model_dir)
    except ValueError as e:
        raise ValueError(f"{e}; the sparse policy sizes its key summaries from the model's shape") from e
    return {"num_hidden_layers": shape.num_layers, "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "max_position_embeddings": shape.max_position_embeddings,
            "dtype_bytes": shape.dtype_bytes, "sliding_window": shape.sliding_window}


PLUGIN_ENTRY_POINT = "tierkv.integrations.vllm.hot_window:register"


def require_plugin_installed(entry_points=None) -> None:
    """Tensor-parallel workers are separate processes: vLLM registers the hot-window backend there
    only through the `vllm.general_plugins` entry point of an installed tierkv."""
    if entry_points is None:
        from importlib.metadata import entry_points as installed

        entry_points = installed(group="vllm.general_plugins")
    if not any(ep.value == PLUGIN_ENTRY_POINT for ep in entry_points):
        raise RuntimeError("tensor_parallel_size > 1 with the hot window needs tierkv installed (pip install "
                           "tierkv-runtime, or pip install -e . in a checkout) so that vLLM's worker processes load "
                           f"its plugin {PLUGIN_ENTRY_POINT!r}; or pass hot_window=False")


def _config_file(config) -> tuple[TierKVConfig, str, str | None]:
    """(validated config, a YAML path the connector loads, that path if written here to be removed)."""
    from tierkv.llm import config_of

    if isinstance(config, (str, os.PathLike)):
        return load_config(config), os.fspath(config), None
    loaded = config_of(config)
    handle, path = tempfile.mkstemp(prefix="tierkv-vllm-", suffix=".yaml")
    with os.fdopen(handle, "w") as f:
        yaml.safe_dump(to_dict(loaded), f)
    return loaded, path, path
