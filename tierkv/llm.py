"""`TieredLLM`: the Python backend — generate with a KV cache far larger than the GPU budget.

Primitives: `TieredLLM` (`generate`, `stats`, `close`).

    llm = TieredLLM("/models/llama-3.1-8b", "configs/long-128k.yaml")
    out = llm.generate(["...a 100k-token document..."], SamplingParams(max_new_tokens=128))
    out[0].text, out[0].stats, llm.stats()

backend="vllm" makes a `tierkv.integrations.vllm.llm.VllmTieredLLM`, a subclass with the same
methods, found by name in `BACKENDS` (this module does not import the vLLM integration).

Requests of a batch run one after another (each owns the GPU hot window while it runs). A
request whose KV does not fit the CPU tier is refused before any work; the GPU budget never
refuses a request. Prompts that share a prefix with earlier requests (in any tier) skip it.
With `show_progress`, tqdm bars on stderr count prefill tokens (prompts longer than four prefill
chunks) and decode tokens with their rate in tok/s (from DECODE_PROGRESS_MIN_TOKENS new tokens).
"""
from __future__ import annotations

import importlib
import itertools
import os
import sys
import threading
import time

import torch

from tierkv.config import TierKVConfig
from tierkv.config.load import to_dict
from tierkv.llm_totals import RequestTotals, start_metrics
from tierkv.metrics import runtime_reads
from tierkv.engine.prefix import load_prefix
from tierkv.generation_defaults import GenerationDefaults, LogitsRules
from tierkv.prompts import PromptError, token_ids
from tierkv.llm_inputs import check_device_and_tokenizer, config_of, generate_inputs, load_model, warn_past_positions
from tierkv.sampling import RequestOutput, SamplingParams, sample_next

DECODE_PROGRESS_MIN_TOKENS = 16  # show_progress: a decode bar (tok/s) once max_new_tokens reaches this
BACKENDS = {  # backend name -> "module:class" of its TieredLLM subclass (None: TieredLLM itself)
    "transformers": None,
    "vllm": "tierkv.integrations.vllm.llm:VllmTieredLLM",
}


def backend_class(backend: str) -> type["TieredLLM"]:
    """The TieredLLM class of `backend`, imported by name (ValueError naming the allowed ones)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r:.80}; allowed: {', '.join(BACKENDS)}")
    if BACKENDS[backend] is None:
        return TieredLLM
    module_name, class_name = BACKENDS[backend].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, TieredLLM)):
        raise TypeError(f"backend {backend!r}: {BACKENDS[backend]} is not a TieredLLM subclass")
    return cls


class TieredLLM:
    def __new__(cls, model=None, config=None, backend: str = "transformers", *args, **kwargs):
        # TieredLLM(..., backend="vllm") is a VllmTieredLLM; Python then runs that class's __init__
        return super().__new__(backend_class(backend) if cls is TieredLLM else cls)

    def __init__(self, model, config: TierKVConfig | str | os.PathLike | dict | None = None,
                 backend: str = "transformers", *, tokenizer=None, device: str | None = None,
                 show_progress: bool = True, gguf_file: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend: got {backend!r}; allowed: {', '.join(BACKENDS)}")
        self.config = config_of(config)
        self._closed, self._request_lock = False, threading.RLock()
        self._request_ids = itertools.count()  # vLLM's request ids: "0", "1", ...
        check_device_and_tokenizer(device, tokenizer)
        self.model, self.tokenizer, model_id = load_model(model, tokenizer, device, gguf_file, self.config)
        from tierkv.integrations.hf import forward_kwargs, runtime_for_model
        from tierkv.integrations.model_support import length_dependent_rotary, rotary_switch

        self.runtime = runtime_for_model(self.model, self.config, model_id)
        self._cache_kwargs = lambda cache: forward_kwargs(self.model, cache)
        self._length_rotary = length_dependent_rotary(self.model)  # rope dynamic / longrope (`_prefill`)
        self._rotary_switch = rotary_switch(self.model)  # Phi-3 longrope: the cache recomputed past it
        self.show_progress = show_progress
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.totals = RequestTotals(("prompt_tokens", "prefix_tokens", "generated_tokens", "prefill_s", "decode_s"))
        self.metrics = start_metrics(self.config, self.stats, on_failure=self.runtime.close,
                                     live_reads=runtime_reads(self.runtime), set_gpu_budget=self.set_gpu_budget)

    # -- public --------------------------------------------------------------------------------
    def generate(self, prompts, sampling: SamplingParams | None = None, **sampling_kwargs) -> list[RequestOutput]:
        """One RequestOutput per prompt. prompts: text (needs a tokenizer), token ids (a list, a 1-D
        integer tensor or array), a batch of those or a 2-D [batch, n] tensor, or a tokenizer's output
        (`tierkv.prompts`); bad ones raise PromptError (a ValueError) naming request and token, before any work."""
        no_text = None if self.tokenizer is not None else "a text prompt needs a tokenizer; pass token ids or tokenizer="
        self._check_open()
        sampling, batch = generate_inputs(prompts, sampling, sampling_kwargs, vocab_size=self.vocab_size, text_error=no_text)
        defaults = GenerationDefaults.of_model(self.model)  # model.generation_config now; what tierkv lacks raises
        requests = [self._prompt_ids(i, p) for i, p in enumerate(batch)]
        from tierkv.integrations.model_support import span_problem

        span = getattr(self.runtime, "attention_span", None)
        for i, ids in enumerate(requests):  # refuse before doing any work
            fed = len(ids) + sampling.max_new_tokens - 1  # the last new token is never fed back: no KV
            try:
                self.runtime.check_fits(fed)
            except ValueError as exc:
                raise type(exc)(f"request {i}: {exc}") from None
            if span is not None and fed > span[0]:
                raise PromptError(f"request {i}: {len(ids)} prompt tokens + max_new_tokens {sampling.max_new_tokens} "
                                  f"- 1 = {fed}; {span_problem(span)}")
            switch = self._rotary_switch
            if switch is not None and len(ids) <= switch < fed:
                raise PromptError(
                    f"request {i}: {len(ids)} prompt tokens + max_new_tokens {sampling.max_new_tokens} would pass "
                    f"original_max_position_embeddings={switch} while decoding, where transformers recomputes the "
                    f"whole sequence with the long rotary factors (tierkv keeps its cached keys): give at most "
                    f"{switch - len(ids) + 1} new tokens, or a prompt of more than {switch} tokens")
            warn_past_positions(self.model, i, fed)
        with self._request_lock:  # one request at a time; close() waits for the running one
            self._check_open()
            return [self._run_one(ids, sampling, prompt if isinstance(prompt, str) else None, defaults)
                    for ids, prompt in zip(requests, batch)]

    def set_gpu_budget(self, budget: int | str, *, wait: bool = True, timeout_s: float | None = 60.0) -> None:
        """Resize the GPU KV budget ("1GiB" or bytes), between or during requests; exact mode's outputs do not
        change with tiers that store blocks as they are (a quantized CPU tier, `storage_dtype` int8 or fp8, rounds
        the blocks outside the hot window, so its tokens follow the budget, as the sparse policy's do: it attends
        the hot window's resident blocks besides its selection).

        Shrinking returns the memory to the driver. A change that cannot be applied is refused and
        the running request goes on at the old budget: a bad value, sinks + window that do not fit
        or a pool larger than the device raise here (ValueError, BudgetRefused); a failed allocation
        when the change is applied raises BudgetRefused with `wait`, and is logged and counted in
        `stats()["gpu"]["budget_refusals"]` either way. With `wait`, blocks until the change took
        effect (a running request applies it at its next forward step).
        """
        self._check_open()
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s >= 0 or timeout_s == float("inf")):
            raise ValueError(f"timeout_s: got {timeout_s!r}; seconds (a finite number >= 0) or None to wait without end")
        change = self.runtime.set_gpu_budget(budget)
        if wait and not change.wait(timeout_s):
            raise TimeoutError(f"the GPU budget change to {budget!r} did not take effect within {timeout_s} s; it "
                               "stays pending and applies when it can (a later set_gpu_budget replaces it)")

    def reload_config(self, config: TierKVConfig | str | os.PathLike | dict) -> list[str]:
        """Apply a changed config at run time; returns the keys applied.

        Only `cache.gpu_budget_bytes` can change while the model is loaded; a change to any other
        key raises ValueError naming it (those need a new TieredLLM), and nothing is applied.
        """
        new = config_of(config)  # a TierKVConfig, a YAML path or a dict (TypeError naming what it got)
        old_flat, new_flat = _flatten(to_dict(self.config)), _flatten(to_dict(new))
        changed = sorted(k for k in old_flat.keys() | new_flat.keys() if old_flat.get(k) != new_flat.get(k))
        fixed = [k for k in changed if k != "cache.gpu_budget_bytes"]
        if fixed:
            raise ValueError(f"config reload: {', '.join(fixed)} cannot change at run time (make a new TieredLLM); "
                             "only cache.gpu_budget_bytes can")
        pending = self.runtime.pending_budget_bytes  # asked for, not applied yet: the reload's budget replaces it
        if changed or (pending is not None and pending != new.cache.gpu_budget_bytes):
            self.set_gpu_budget(new.cache.gpu_budget_bytes)
            changed = changed or ["cache.gpu_budget_bytes"]
        return changed

    def stats(self) -> dict:
        """Running totals since construction: requests, tokens, times, tiers, transfers."""
        return {"requests": self.totals.as_dict(), **self.runtime.stats()}

    def close(self) -> None:
        """Refuse new requests, wait for a running one (another thread's) to end, then release the tiers,
        the GPU pool and the metrics endpoint. Idempotent."""
        self._closed = True
        with self._request_lock:
            if getattr(self, "_released", False):
                return
            self._released = True
            self.metrics.close()
            self.runtime.close()

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError("this TieredLLM is closed: make a new one to generate")

    def __enter__(self) -> "TieredLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one request -----------------------------------------------------------------------------
    @torch.no_grad()
    def _run_one(self, ids: list[int], sampling: SamplingParams, prompt: str | None,
                 defaults: GenerationDefaults) -> RequestOutput:
        from tierkv.integrations.hf import TieredCache

        rt = self.runtime
        before = rt.stats()
        cache = TieredCache(rt, ids)
        cache.check_fed_ids = False  # fed from `ids` itself: no host read of the device's input ids per forward
        try:
            start = time.perf_counter()
            # a length-dependent rotary embedding rotates keys by the request's length: blocks of another
            # request are not this one's keys (RotaryForLength), so nothing is reused for such a model
            num_prefix = load_prefix(cache.seq, ids) if not self._length_rotary else 0
            logits = self._prefill(cache, ids, num_prefix)
            prefill_s = _elapsed(start, rt.device)
            rules = defaults.rules(sampling, ids, self._eos_ids())
            generated, reason, decode_s = self._decode(cache, logits, sampling, rules)
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
        self.totals.record(stats, self.metrics)
        text = self.tokenizer.decode(generated, skip_special_tokens=True) if self.tokenizer is not None else None
        return RequestOutput(prompt_token_ids=ids, token_ids=generated, text=text, finish_reason=reason, stats=stats,
                             request_id=str(next(self._request_ids)), prompt=prompt)

    def _prefill(self, cache, ids: list[int], start: int) -> torch.Tensor:
        """Run the prompt from `start` in chunks; returns the last position's logits [vocab]."""
        chunk = self.config.scheduler.prefill_chunk_tokens
        device = self.runtime.device
        todo = len(ids) - start
        progress = _progress(todo, self.show_progress and todo > 4 * chunk, "prefill")
        logits = None
        from tierkv.integrations.model_support import RotaryForLength

        with RotaryForLength(self._length_rotary if todo > chunk else [], len(ids)):
            for pos in range(start, len(ids), chunk):
                piece = torch.tensor([ids[pos : pos + chunk]], device=device)
                logits = self.model(input_ids=piece, logits_to_keep=1, **self._cache_kwargs(cache)).logits[0, -1]
                progress.update(piece.shape[1])
        progress.close()
        return logits

    def _decode(self, cache, logits: torch.Tensor, sampling: SamplingParams,
                rules: LogitsRules) -> tuple[list[int], str, float]:
        from tierkv.engine.decode_graph import DecodeStep

        device = self.runtime.device
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        stop_ids = set(sampling.stop_token_ids or ()) | (set() if sampling.ignore_eos else set(self._eos_ids()))
        generated: list[int] = []
        step = DecodeStep(self.model, cache)  # replayed from a CUDA graph where it can be (tierkv.engine.decode_graph)
        start = time.perf_counter()
        show = self.show_progress and sampling.max_new_tokens >= DECODE_PROGRESS_MIN_TOKENS
        with _progress(sampling.max_new_tokens, show, "decode") as progress:
            while True:
                token = sample_next(rules.apply(logits, generated), sampling, generator)
                generated.append(token)
                progress.update(1)
                if token in stop_ids:  # the bar ends full at the tokens made, not as if cut short
                    progress.total = len(generated)
                    progress.refresh()
                    return generated, "stop", _elapsed(start, device)
                if len(generated) >= sampling.max_new_tokens:
                    return generated, "length", _elapsed(start, device)
                cache.seq.token_ids.append(token)
                logits = step(token)

    # -- input checks ------------------------------------------------------------------------------
    def _prompt_ids(self, index: int, prompt: str | list[int]) -> list[int]:
        """A normalised prompt's token ids: text tokenized, then checked like given ids."""
        if not isinstance(prompt, str):
            return prompt
        return token_ids(self.tokenizer(prompt, add_special_tokens=True)["input_ids"], index=index, vocab_size=self.vocab_size)

    def _eos_ids(self) -> list[int]:
        """The generation config's EOS ids and the tokenizer's, as vLLM stops at both."""
        ids = []
        for eos in (getattr(self.model.generation_config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None):
            ids += [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        return ids


def _flatten(data, prefix: str = "") -> dict:
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    if isinstance(data, list):
        return {k: v for i, value in enumerate(data) for k, v in _flatten(value, f"{prefix[:-1]}[{i}].").items()}
    return {prefix[:-1]: data}


def _elapsed(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _progress(total: int, enabled: bool, desc: str):
    """A tqdm bar on stderr counting tokens (its rate in tok/s); a no-op bar when not `enabled`."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", desc=desc, disable=not enabled, file=sys.stderr)
