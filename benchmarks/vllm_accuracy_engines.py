"""The three engines of benchmarks/vllm_accuracy.py and the tierkv configs they run, sized from the
checkpoint's config.json (no GPU needed to build the configs; the engines need one).

Primitives: `MODES`, `KvShape`, `tierkv_config`, `start_engine` (-> `Engine`), `Completion`.

  plain          vllm.LLM, full KV pool, prefix caching off, FlashAttention
  tierkv-exact   TieredLLM(backend="vllm"), exact policy: configs/vllm-128k.yaml's hot window scaled from a
                 131072-token request to one of MAX_MODEL_LEN tokens (GPU budget 1/8 of its KV, staging a
                 quarter of that, window 1/64 and prefill chunk 1/16 of max_model_len, 16-token blocks where
                 the file has 64: exact answers do not depend on the block size, and the rows stay comparable),
                 one request at a time (`engine_kwargs` says why)
  tierkv-sparse  the same scaling of configs/vllm-128k-sparse.yaml's sparse policy, eager (--sparse-block-tokens,
                 16 by default where the file has 64: SPARSE_BLOCK_TOKENS says why; the sparse step's CUDA graphs, a far-block cache of one selection per layer, max_num_seqs 1; not the
                 file's full decode graph, async scheduling or prefetch margin, which need a compiled vLLM); the
                 budget holds vLLM's pool, the staging that keeps the cache and the key summaries of one
                 request; the far tokens per step are --sparse-token-budget (the shipped 2048 is 1/64 of
                 128k: 128 tokens at 8k; run_gpu.py's vllm-accuracy-sparse gives each length 1/4 of itself)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MODES = ("plain", "tierkv-exact", "tierkv-sparse")
MAX_MODEL_LEN = 8192
NEW_TOKENS = 16
BUDGET_FRACTION = 8                      # the shipped 2 GiB of a 16 GiB 128k request (Llama-3.1-8B)
WINDOW_TOKENS = MAX_MODEL_LEN // 64       # the shipped 2048 of 131072
PREFILL_CHUNK_TOKENS = MAX_MODEL_LEN // 16  # the shipped 8192 of 131072
SPARSE_TOKEN_BUDGET = 512                # 1/4 of a 2k context, 1/16 of 8k
# 16, not the 128k file's 64: on this model 64-token blocks lose retrieval cases that 16-token blocks keep at
# the same budget (benchmarks/RESULTS.md, "block size"); the summaries are 4x larger (6% of an 8k request's KV)
SPARSE_BLOCK_TOKENS = 16
CPU_TIER_REQUESTS = 8                    # the CPU tier holds this many max_model_len requests' KV


@dataclass(frozen=True)
class KvShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @classmethod
    def of_checkpoint(cls, model_dir: str) -> "KvShape":
        from tierkv.model_shape import checkpoint_shape

        shape = checkpoint_shape(model_dir)
        return cls(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes)

    def block_bytes(self, block_tokens: int) -> int:
        """K and V of one block in one layer."""
        return 2 * self.num_kv_heads * block_tokens * self.head_dim * self.dtype_bytes

    @property
    def request_kv_bytes(self) -> int:
        """K and V of one MAX_MODEL_LEN-token request over all layers."""
        return self.num_layers * self.block_bytes(MAX_MODEL_LEN)


def sparse_args_problem(sparse_token_budget: int, sparse_block_tokens: int) -> str | None:
    """What is wrong with a sparse run's budget and block (named by their options), or None."""
    block = sparse_block_tokens
    if block < 1 or block & (block - 1):
        return f"--sparse-block-tokens: got {block}; a power of two (vLLM's block_size)"
    if sparse_token_budget < block or sparse_token_budget % block:
        return f"--sparse-token-budget: got {sparse_token_budget}; a positive multiple of --sparse-block-tokens ({block})"
    return None


def tierkv_config(mode: str, shape: KvShape, sparse_token_budget: int = SPARSE_TOKEN_BUDGET,
                  sparse_block_tokens: int = SPARSE_BLOCK_TOKENS) -> dict:
    """The tierkv config of `mode` ('tierkv-exact' or 'tierkv-sparse'); ValueError for another mode or
    a sparse token budget that is not a positive multiple of the sparse block."""
    request = shape.request_kv_bytes
    cpu = [{"kind": "cpu", "capacity_bytes": CPU_TIER_REQUESTS * request}]
    if mode == "tierkv-exact":
        budget = request // BUDGET_FRACTION
        return {"cache": {"block_tokens": 16, "window_tokens": WINDOW_TOKENS, "gpu_budget_bytes": budget},
                "tiers": cpu, "scheduler": {"lookahead_layers": 2, "staging_bytes": budget // 4,
                                            "prefill_chunk_tokens": PREFILL_CHUNK_TOKENS}}
    if mode != "tierkv-sparse":
        raise ValueError(f"mode: got {mode!r}; a tierkv config exists for: tierkv-exact, tierkv-sparse")
    block = sparse_block_tokens
    problem = sparse_args_problem(sparse_token_budget, block)
    if problem:
        raise ValueError(problem)
    from tierkv.config import load_config
    from tierkv.integrations.vllm.pool_sizing import hot_window_pool_need
    from tierkv.sparse.request_summaries import summary_bytes_per_request
    from tierkv.sparse.row_caches import staging_for_caches

    k, block_bytes = sparse_token_budget // block, shape.block_bytes(block)
    staging = staging_for_caches(1, 1, 2 * k * block_bytes, shape.num_layers, k, block_bytes, 0)
    dims = {"num_hidden_layers": shape.num_layers, "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "max_position_embeddings": MAX_MODEL_LEN, "dtype_bytes": shape.dtype_bytes,
            "sliding_window": None}
    windowed = load_config({"cache": {"block_tokens": block, "window_tokens": WINDOW_TOKENS}}, env={})
    # the least pool vLLM admits a request into (its null block included: one block less stepped idle)
    pool = hot_window_pool_need(dims, windowed, {"max_num_batched_tokens": PREFILL_CHUNK_TOKENS,
                                                 "max_model_len": MAX_MODEL_LEN})
    summaries = summary_bytes_per_request(MAX_MODEL_LEN, block, shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                          shape.dtype_bytes)
    return {"cache": {"block_tokens": block, "window_tokens": WINDOW_TOKENS,
                      "gpu_budget_bytes": pool + staging + summaries},
            "tiers": cpu, "scheduler": {"lookahead_layers": 2, "staging_bytes": staging,
                                        "prefill_chunk_tokens": PREFILL_CHUNK_TOKENS, "policy": "sparse",
                                        "sparse_token_budget": sparse_token_budget, "sparse_cuda_graphs": True,
                                        "sparse_cache_selections": 1}}


def engine_kwargs(mode: str) -> dict:
    """vLLM arguments beside the model and the tierkv config. The tierkv modes run one request at a time
    (max_num_seqs 1): the sparse budget holds one request's summaries, and the exact pool (48 blocks)
    holds one request's window and prefill chunk (41 blocks) but not two, where vLLM would preempt one
    request for another, a path this run is not about."""
    common = dict(max_model_len=MAX_MODEL_LEN, enforce_eager=True, gpu_memory_utilization=0.3)
    if mode == "plain":
        return dict(common, enable_prefix_caching=False, attention_config={"backend": "FLASH_ATTN"})
    return dict(common, max_num_seqs=1)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str | None                  # vLLM's detokenized text
    top2_logprobs: list[list[float]]  # per generated token, the two largest logprobs


@dataclass
class Engine:
    generate: Callable[[list[list[int]]], list[Completion]]  # prompts' token ids -> one completion each, in order
    stats: Callable[[], dict]                                 # tierkv's stats (empty for plain vLLM)


def start_engine(mode: str, model_dir: str, config: dict | None) -> Engine:
    """Start `mode`'s engine in this process (one engine per process: vLLM's in-process engine is not
    torn down); greedy decoding of NEW_TOKENS tokens, stopping at the model's EOS."""
    if mode == "plain":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model_dir, **engine_kwargs(mode))
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=2)

        def generate(batch: list[list[int]]) -> list[Completion]:
            outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
            return [Completion(list(o.outputs[0].token_ids), o.outputs[0].text,
                               [sorted((x.logprob for x in step.values()), reverse=True)[:2]
                                for step in (o.outputs[0].logprobs or [])]) for o in outs]
        return Engine(generate, dict)
    from tierkv import TieredLLM
    from tierkv.sampling import SamplingParams as TierSampling

    tiered = TieredLLM(model_dir, config, backend="vllm", **engine_kwargs(mode))

    def generate_tiered(batch: list[list[int]]) -> list[Completion]:
        outs = tiered.generate(batch, TierSampling(max_new_tokens=NEW_TOKENS))
        return [Completion(list(o.token_ids), o.text, o.stats.get("top2_logprobs", [])) for o in outs]
    return Engine(generate_tiered, tiered.stats)
