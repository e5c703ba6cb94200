"""`TieredLLM`: the Python backend — generate with a KV cache far larger than the GPU budget.

Primitives: `TieredLLM` (`generate`, `stats`, `close`).

    llm = TieredLLM("/models/llama-3.1-8b", "configs/long-128k.yaml")
    out = llm.generate(["...a 100k-token document..."], SamplingParams(max_new_tokens=128))
    out[0].text, out[0].stats, llm.stats()

backend="vllm" returns a `tierkv.vllm_backend.llm.VllmTieredLLM` with the same methods.

Requests of a batch run one after another (each owns the GPU hot window while it runs). A
request whose KV does not fit the CPU tier is refused before any work; the GPU budget never
refuses a request. Prompts that share a prefix with earlier requests (in any tier) skip it.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Sequence

import torch

from tierkv.config import TierKVConfig, load_config
from tierkv.config_loader import to_dict
from tierkv.metrics import MetricsService, runtime_reads
from tierkv.prefix import load_prefix
from tierkv.sampling import RequestOutput, SamplingParams, sample_next

BACKENDS = ("transformers", "vllm")


class TieredLLM:
    def __new__(cls, model=None, config=None, backend: str = "transformers", **kwargs):
        if backend == "vllm":  # the same API over a vLLM engine (tierkv.vllm_backend.llm)
            from tierkv.vllm_backend.llm import VllmTieredLLM

            return VllmTieredLLM(model, config, **kwargs)
        return super().__new__(cls)

    def __init__(self, model, config: TierKVConfig | str | os.PathLike | dict | None = None,
                 backend: str = "transformers", *, tokenizer=None, device: str | None = None,
                 show_progress: bool = True, gguf_file: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend: got {backend!r}; allowed: {', '.join(BACKENDS)}")
        self.config = config if isinstance(config, TierKVConfig) else load_config(config)
        self.model, self.tokenizer, model_id = _load_model(model, tokenizer, device, gguf_file)
        from tierkv.adapters.hf import forward_kwargs, runtime_for_model

        self.runtime = runtime_for_model(self.model, self.config, model_id)
        self._cache_kwargs = lambda cache: forward_kwargs(self.model, cache)
        self.show_progress = show_progress
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self._totals = {"requests": 0, "prompt_tokens": 0, "prefix_tokens": 0, "generated_tokens": 0,
                        "prefill_s": 0.0, "decode_s": 0.0}
        try:
            self.metrics = MetricsService.from_config(self.config.metrics, self.stats, live_reads=runtime_reads(self.runtime),
                                                      set_gpu_budget=self.set_gpu_budget)
        except Exception:
            self.runtime.close()
            raise

    # -- public --------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling: SamplingParams | None = None, **sampling_kwargs) -> list[RequestOutput]:
        """Prompts as text (needs a tokenizer) or token ids; one RequestOutput per prompt."""
        sampling, batch = generate_inputs(prompts, sampling, sampling_kwargs)
        requests = [self._prompt_ids(i, p) for i, p in enumerate(batch)]
        for i, ids in enumerate(requests):  # refuse before doing any work
            try:
                self.runtime.check_fits(len(ids) + sampling.max_new_tokens)
            except ValueError as exc:
                raise type(exc)(f"request {i}: {exc}") from None
        return [self._run_one(ids, sampling) for ids in requests]

    def set_gpu_budget(self, budget: int | str, *, wait: bool = True, timeout_s: float | None = 60.0) -> None:
        """Resize the GPU KV budget ("1GiB" or bytes), between or during requests; outputs do not change.

        Shrinking returns the memory to the driver. With `wait`, blocks until it took effect
        (a running request applies it at its next forward step).
        """
        from tierkv.units import parse_bytes

        num_bytes = parse_bytes(budget)
        if num_bytes <= 0:
            raise ValueError(f"budget: got {budget!r}; must be positive")
        self.runtime.set_gpu_budget(num_bytes)
        if wait and not self.runtime.wait_for_budget(timeout_s):
            raise TimeoutError(f"the GPU budget change to {budget!r} did not take effect within {timeout_s} s")

    def reload_config(self, config: TierKVConfig | str | os.PathLike | dict) -> list[str]:
        """Apply a changed config at run time; returns the keys applied.

        Only `cache.gpu_budget_bytes` can change while the model is loaded; a change to any other
        key raises ValueError naming it (those need a new TieredLLM), and nothing is applied.
        """
        new = config if isinstance(config, TierKVConfig) else load_config(config)
        old_flat, new_flat = _flatten(to_dict(self.config)), _flatten(to_dict(new))
        changed = sorted(k for k in old_flat.keys() | new_flat.keys() if old_flat.get(k) != new_flat.get(k))
        fixed = [k for k in changed if k != "cache.gpu_budget_bytes"]
        if fixed:
            raise ValueError(f"config reload: {', '.join(fixed)} cannot change at run time (make a new TieredLLM); "
                             "only cache.gpu_budget_bytes can")
        if changed:
            self.set_gpu_budget(new.cache.gpu_budget_bytes)
        return changed

    def stats(self) -> dict:
        """Running totals since construction: requests, tokens, times, tiers, transfers."""
        return {"requests": dict(self._totals), **self.runtime.stats()}

    def close(self) -> None:
        self.metrics.close()
        self.runtime.close()

    def __enter__(self) -> "TieredLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one request -----------------------------------------------------------------------------
    @torch.no_grad()
    def _run_one(self, ids: list[int], sampling: SamplingParams) -> RequestOutput:
        from tierkv.adapters.hf import TieredCache

        rt = self.runtime
        before = rt.stats()
        cache = TieredCache(rt, ids)
        try:
            start = time.perf_counter()
            num_prefix = load_prefix(cache.seq, ids)
            logits = self._prefill(cache, ids, num_prefix)
            prefill_s = _elapsed(start, rt.device)
            generated, reason, decode_s = self._decode(cache, logits, sampling)
        finally:
            cache.finish()
        after = rt.stats()
        stats = {
            "prompt_tokens": len(ids), "prefix_tokens": num_prefix, "generated_tokens": len(generated),
            "prefix_blocks_by_tier": dict(cache.seq.prefix_blocks_by_tier),
            "prefill_s": prefill_s, "decode_s": decode_s,
            "h2d_bytes": after["transfer"]["h2d_bytes"] - before["transfer"]["h2d_bytes"],
            "d2h_bytes": after["transfer"]["d2h_bytes"] - before["transfer"]["d2h_bytes"],
            "stalls": after["scheduler"]["stalls"] - before["scheduler"]["stalls"],
            **cache.seq.read_stats(),
        }
        for key in ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s"):
            self._totals[key] += stats[key]
        self._totals["prefix_tokens"] += num_prefix
        self._totals["requests"] += 1
        self.metrics.record_request(stats)
        text = self.tokenizer.decode(generated, skip_special_tokens=True) if self.tokenizer is not None else None
        return RequestOutput(prompt_token_ids=ids, token_ids=generated, text=text, finish_reason=reason, stats=stats)

    def _prefill(self, cache, ids: list[int], start: int) -> torch.Tensor:
        """Run the prompt from `start` in chunks; returns the last position's logits [vocab]."""
        chunk = self.config.scheduler.prefill_chunk_tokens
        device = self.runtime.device
        todo = len(ids) - start
        progress = _progress(todo, self.show_progress and todo > 4 * chunk)
        logits = None
        for pos in range(start, len(ids), chunk):
            piece = torch.tensor([ids[pos : pos + chunk]], device=device)
            logits = self.model(input_ids=piece, logits_to_keep=1, **self._cache_kwargs(cache)).logits[0, -1]
            progress.update(piece.shape[1])
        progress.close()
        return logits

    def _decode(self, cache, logits: torch.Tensor, sampling: SamplingParams) -> tuple[list[int], str, float]:
        from tierkv.decode_graph import DecodeStep

        device = self.runtime.device
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        stop_ids = set(sampling.stop_token_ids if sampling.stop_token_ids is not None else self._eos_ids())
        generated: list[int] = []
        step = DecodeStep(self.model, cache)  # replayed from a CUDA graph where it can be (tierkv.decode_graph)
        start = time.perf_counter()
        while True:
            token = sample_next(logits, sampling, generator)
            generated.append(token)
            if token in stop_ids and not sampling.ignore_eos:
                return generated, "stop", _elapsed(start, device)
            if len(generated) >= sampling.max_new_tokens:
                return generated, "length", _elapsed(start, device)
            cache.seq.token_ids.append(token)
            logits = step(token)

    # -- input checks ------------------------------------------------------------------------------
    def _prompt_ids(self, index: int, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {index}: a text prompt needs a tokenizer; pass token ids or tokenizer=")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError(f"request {index}: the prompt is empty")
        for pos, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"request {index}: token {pos} is {token!r}; token ids are ints in [0, {self.vocab_size})"
                )
        return ids

    def _eos_ids(self) -> list[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _flatten(data, prefix: str = "") -> dict:
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    if isinstance(data, list):
        return {k: v for i, value in enumerate(data) for k, v in _flatten(value, f"{prefix[:-1]}[{i}].").items()}
    return {prefix[:-1]: data}


def generate_inputs(prompts, sampling: SamplingParams | None, sampling_kwargs: dict) -> tuple[SamplingParams, list]:
    """`generate()`'s arguments as (sampling settings, list of prompts), for every backend: one prompt
    (text or a token-id list) or a batch of them; settings as SamplingParams or keywords, not both."""
    if sampling is None:
        sampling = SamplingParams(**sampling_kwargs)
    elif sampling_kwargs:
        raise ValueError("pass either sampling=SamplingParams(...) or keyword settings, not both")
    return sampling, [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)


def _is_token_list(prompts) -> bool:
    return isinstance(prompts, (list, tuple)) and len(prompts) > 0 and isinstance(prompts[0], int)


def _elapsed(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", desc="prefill", disable=not enabled, file=sys.stderr)


def _load_model(model, tokenizer, device: str | None, gguf_file: str | None = None):
    """A loaded model, or a checkpoint (directory, .gguf file, shortcut: tierkv.model_loading) loaded on
    `device` (CUDA when present)."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model.eval(), tokenizer, getattr(model.config, "_name_or_path", "") or type(model).__name__
    from tierkv.model_loading import load_checkpoint

    return load_checkpoint(model, tokenizer, device, gguf_file)
