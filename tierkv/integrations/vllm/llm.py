"""`TieredLLM(model_dir, config, backend="vllm")`: a vLLM engine whose KV blocks go to the tierkv
tiers and whose repeated prefixes come back from them.

Primitives: `VllmTieredLLM` (`generate`, `stats`, `set_gpu_budget`, `close`), what `TieredLLM` returns for
backend="vllm".

    llm = TieredLLM("/models/llama-3.1-8b", "configs/vllm-128k.yaml", backend="vllm",
                    max_model_len=131072, gpu_memory_utilization=0.5)
    out = llm.generate([ids_or_text], SamplingParams(max_new_tokens=64))

The engine runs in-process (the scheduler and the worker share one tier chain) and eagerly
(the connector's per-layer hooks run outside CUDA graphs), or compiled where the config puts the
sparse step inside vLLM's full decode graph (`scheduler.sparse_full_graphs`); `enforce_eager` given
wins. Under `scheduler.vllm_rows_from_batch` the sparse graphs' rows and their staging are sized for
`max_num_seqs` before vLLM starts (`batch_sizing`).

With `hot_window=True` (the default) vLLM's KV pool holds only each request's last
`cache.window_tokens` tokens: the pool is `cache.gpu_budget_bytes` minus the staging ring
(`scheduler.staging_bytes`), whatever `max_model_len` is, and tierkv's attention backend reads
older blocks from the tiers (`hot_window.py`). Under `scheduler.policy: sparse` the budget also
holds the key summaries of `max_num_seqs` requests of `max_model_len` tokens (`max_num_seqs` is
then required; `max_model_len` defaults to the checkpoint's max_position_embeddings and is passed
to vLLM, so the summaries are reserved for and capped at the length vLLM runs with; their bytes
come from the checkpoint's config.json), so vLLM's pool, the staging ring and the summaries
together stay within `cache.gpu_budget_bytes`; with `scheduler.sparse_full_graphs` over a quantized
CPU tier, so do the full decode graph's codes and scales (`full_graph_packed_bytes`). Prompts are
prefilled in chunks of `scheduler.prefill_chunk_tokens`; vLLM's own prefix cache is off (the tiers
hold every block). `hot_window=False` keeps vLLM's full pool (sized by `gpu_memory_utilization`)
with the connector alone: repeated prefixes are then loaded back from the tiers instead of prefilled.
An eager engine (`enforce_eager`, the exact policy's default) runs its forward once at a ladder of token
counts before serving (`warm_start`), so no request pays its GEMMs' first launch at a new count.

This module owns the front end (start, generate, stats, close); vLLM's arguments come from
`engine_args`, the sizes of the budget's parts from `pool_sizing`, the run-time resize from
`resize_front`.
"""
from __future__ import annotations

import os
import tempfile
import time
import weakref

from tierkv.config import TierKVConfig, load_config
from tierkv.config.load import to_dict
from tierkv.config.yaml_reader import dump_yaml
from tierkv.llm import TieredLLM
from tierkv.llm_inputs import config_of, generate_inputs
from tierkv.llm_totals import RequestTotals, start_metrics
from tierkv.sampling import RequestOutput, SamplingParams
from tierkv.integrations.vllm.batch_sizing import size_rows_for_batch
from tierkv.integrations.vllm.engine_args import tiered_engine_args
from tierkv.integrations.vllm.pool_sizing import check_full_graph_rows
from tierkv.integrations.vllm.resize_front import apply_gpu_budget, pool_resizer
from tierkv.integrations.vllm.warm_start import warm_engine


class VllmTieredLLM(TieredLLM):
    """`TieredLLM(..., backend="vllm")`: the same public methods over a vLLM engine."""

    summary_reserved_bytes = 0  # GPU bytes of the budget kept for sparse key summaries (set by __init__)
    warmed_token_counts: list[int] = []  # the token counts an eager engine ran at start-up (`warm_start`)
    full_graph_reserved_bytes = 0  # and for the full decode graph's codes and scales (quantized CPU tier)

    def __init__(self, model, config: TierKVConfig | str | os.PathLike | dict | None = None,
                 backend: str = "vllm", *, tokenizer=None, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.5, enable_prefix_caching: bool | None = None, hot_window: bool = True,
                 **engine_kwargs):
        if backend != "vllm":
            raise ValueError(f"backend: got {backend!r}; VllmTieredLLM is backend='vllm'")
        if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
            raise ValueError(f"model: got {model!r}; backend='vllm' needs a local checkpoint directory (a .gguf file "
                             f"or a shortcut such as 'smollm2-135m' runs on the default backend, transformers)")
        if tokenizer is not None:
            raise ValueError("tokenizer: backend='vllm' loads the tokenizer from the checkpoint directory")
        self.config, self.config_file, owned = _config_file(config)
        self._owned_config_file = _owned(self, owned)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: scheduler and worker share the tiers
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runner the connector was run with on the GPU
        from vllm import LLM

        self.hot_window = hot_window
        try:  # a bad argument or a failed start leaves no config file behind
            if hot_window:
                self._use_config(size_rows_for_batch(model, self.config, engine_kwargs))
            args = tiered_engine_args(model, self.config, self.config_file, engine_kwargs, hot_window=hot_window,
                                      max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                                      enable_prefix_caching=enable_prefix_caching,
                                      resolved_config=self._owned_config_file is not None)
            self.summary_reserved_bytes = args.summary_reserved_bytes
            self.full_graph_reserved_bytes = args.full_graph_reserved_bytes
            self.engine = _start_vllm(LLM, args.kwargs)
            check_full_graph_rows(args.full_graph_reserved_rows, self.engine.llm_engine.vllm_config)
            # an eager engine runs its forward at a ladder of token counts now, not at a request's first step
            self.warmed_token_counts = warm_engine(self.engine)
        except BaseException:
            self.close()
            raise
        self.engine_id = str(self.engine.llm_engine.vllm_config.kv_transfer_config.engine_id)
        self.resizer, self._resize_error = pool_resizer(self.engine, self.config, args, hot_window=hot_window)
        self.totals = RequestTotals(("prompt_tokens", "generated_tokens", "prefix_tokens"), per_call=("wall_s",))
        self.metrics = start_metrics(self.config, self.stats, on_failure=self.close,
                                     set_gpu_budget=self.set_gpu_budget if hot_window else None)

    def generate(self, prompts, sampling: SamplingParams | None = None, **sampling_kwargs) -> list[RequestOutput]:
        """Same inputs (any form `tierkv.prompts` accepts, checked before any work) and outputs as the
        transformers backend; vLLM batches the prompts."""
        from vllm import SamplingParams as VllmSampling

        self._check_open()
        sampling, batch = generate_inputs(prompts, sampling, sampling_kwargs, vocab_size=self._vocab_size())
        inputs = [prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt} for prompt in batch]
        model = self._model_defaults()  # repetition_penalty and min_tokens left at None: the checkpoint's
        params = VllmSampling(
            max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k or 0,
            top_p=sampling.top_p or 1.0, seed=sampling.seed, ignore_eos=sampling.ignore_eos,
            stop_token_ids=sampling.stop_token_ids, logprobs=2,
            repetition_penalty=_given(sampling.repetition_penalty, model.get("repetition_penalty", 1.0)),
            min_tokens=_given(sampling.min_tokens, model.get("min_tokens", 0)),
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
            self.totals.record(stats, self.metrics, {k: v for k, v in stats.items() if not k.startswith("top2")})
            results.append(RequestOutput(prompt_token_ids=list(out.prompt_token_ids), token_ids=list(completion.token_ids),
                                         text=completion.text, finish_reason=completion.finish_reason or "length",
                                         stats=stats, request_id=str(out.request_id), prompt=out.prompt))
        self.totals.add("wall_s", wall_s)
        return results

    def _model_defaults(self) -> dict:
        """The checkpoint's generation_config settings vLLM reads (its `get_diff_sampling_param`: e.g.
        repetition_penalty), {} when the engine's model config does not say."""
        model_config = getattr(self.engine.llm_engine, "model_config", None)
        read = getattr(model_config, "get_diff_sampling_param", None)
        return dict(read() or {}) if read is not None else {}

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

        totals = {"requests": self.totals.as_dict(), "backend": "vllm", "summary_reserved_bytes": self.summary_reserved_bytes,
                  "full_graph_reserved_bytes": self.full_graph_reserved_bytes}
        if getattr(self, "resizer", None) is not None:
            totals["gpu"] = self.resizer.stats()
        if self.engine.llm_engine.vllm_config.parallel_config.tensor_parallel_size > 1:
            per_rank = [s for worker in self.engine.collective_rpc(worker_stats, args=(self.engine_id,)) for s in worker]
            return {**totals, **merge_rank_stats(per_rank)}
        store = peek_store(self.engine_id)
        return {**totals, **(store.stats() if store is not None else {})}

    def set_gpu_budget(self, budget: int | str, *, wait: bool = True, timeout_s: float | None = 60.0) -> None:
        """Resize the GPU budget ("1GiB" or bytes) of the hot-window pool: vLLM's pool takes the
        budget less the staging ring and the sparse reservations (the start-up split); shrinking
        gives the memory back to the driver. Refused, changing nothing, with ValueError (not a
        size) or BudgetRefused (sizes named: see docs/vllm-resize.md). Applied between engine steps:
        at once when idle; during requests at the next step boundary, a shrink once the block ids it
        drops are free (`stats()["gpu"]`: resize_policy, pending_budget_bytes). With `wait`, blocks
        until applied (TimeoutError after timeout_s) and raises a refusal met when applying."""
        self._check_open()
        apply_gpu_budget(self.resizer, self._resize_error, budget, wait=wait, timeout_s=timeout_s)

    def reload_config(self, config) -> list[str]:
        raise NotImplementedError("backend='vllm': the engine's config is fixed at start-up (make a new TieredLLM); "
                                  "run-time changes exist on the transformers backend")

    def close(self) -> None:
        self._closed = True  # generate refuses from now on (TieredLLM._check_open)
        metrics, self.metrics = getattr(self, "metrics", None), None
        if metrics is not None:
            metrics.close()
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
        _drop_owned(getattr(self, "_owned_config_file", None))
        self._owned_config_file = None

    def _use_config(self, config: TierKVConfig) -> None:
        """Run with `config` in place of the loaded one (sizes TieredLLM worked out): a file of its own
        for the connector to load, removed at close like any config file written here."""
        if config is self.config:
            return
        _drop_owned(self._owned_config_file)
        self._owned_config_file = None
        self.config, self.config_file = config, _write_config(config)
        self._owned_config_file = _owned(self, self.config_file)

    def __enter__(self) -> "VllmTieredLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _config_file(config) -> tuple[TierKVConfig, str, str | None]:
    """(validated config, a YAML path the connector loads, that path if written here to be removed)."""
    if isinstance(config, (str, os.PathLike)):
        return load_config(config), os.fspath(config), None
    loaded = config_of(config)
    path = _write_config(loaded)
    return loaded, path, path


def _write_config(config: TierKVConfig) -> str:
    """A YAML file of `config` (a new temporary path) for the connector to load."""
    handle, path = tempfile.mkstemp(prefix="tierkv-vllm-", suffix=".yaml")
    with os.fdopen(handle, "w") as f:
        dump_yaml(to_dict(config), f)  # (a string that reads as a number is quoted)
    return path


def _owned(owner, path: str | None) -> weakref.finalize | None:
    """A file written for the engine, removed by calling what this returns (at close; it runs once), or when its
    TieredLLM is collected or the interpreter exits without a close: no config file is left in the temporary
    directory."""
    return weakref.finalize(owner, _remove_quietly, path) if path is not None else None


def _drop_owned(owned: weakref.finalize | None) -> None:
    if owned is not None:
        owned()


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _given(value, default):
    """`value` unless it is None (the setting left to the model), then `default`."""
    return default if value is None else value


def _start_vllm(llm_class, kwargs: dict):
    """vLLM's LLM(**kwargs). With no CUDA device visible a failed start says so first (vLLM's own error on a
    CPU-only machine, "Device string must not be empty", names no device), vLLM's error chained."""
    try:
        return llm_class(**kwargs)
    except Exception as exc:
        import torch

        if torch.cuda.is_available():
            raise
        raise RuntimeError(f"backend='vllm' runs on a CUDA GPU and none is visible (torch.cuda.is_available() is "
                           f"False); vLLM's start failed with {type(exc).__name__}: {exc}. On a CPU, use the default "
                           f"backend (transformers)") from exc
