"""Typed configuration: dataclasses with a default and a doc per field, loaded from YAML.

Primitives: `TierKVConfig` and its sections, `load_config`, `config_errors`, `ConfigError`.

One loader (`tierkv.config.load`) turns a YAML file or dict plus `TIERKV_*` environment
variables into these dataclasses. Every bad value raises `ConfigError` naming the key, the
value and what is allowed. Environment overrides use `__` between levels:

    TIERKV_CACHE__GPU_BUDGET_BYTES=1GiB      TIERKV_TIERS__1__PATH=/nvme/tierkv
    TIERKV_CONFIG_FILE=configs/long-128k.yaml  (the file to start from)

A variable is read by its field's type, not as YAML: a text field (names, paths, secrets, URLs,
tokens, dtypes) takes the text verbatim ('#', quotes and backslashes included); a number field
plain decimals (0100 is 100), a boolean true or false (yes, no, on, off as YAML), a size its units (2GiB); a section or the
tier list a YAML flow mapping or list. An empty value sets an optional field to None. A file's
numbers read alike: decimal integers (0100 is 100; 0x20 and 1:30 are text, refused by a number field) and
floats with an exponent (1e2), not YAML 1.1's octal, hex and base 60.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from tierkv.config import load as loader
from tierkv.config.errors import ConfigError
from tierkv.config.rules import check_config


class _Shown:
    """A config section's repr with its secrets masked (secret-named fields, URL passwords), as
    `shown_dict` shows it: a logged config or a traceback's locals never carry them."""

    def __repr__(self) -> str:
        fields_shown = ", ".join(f"{k}={v!r}" for k, v in loader.shown_dict(self).items())
        return f"{type(self).__name__}({fields_shown})"


def doc(text: str, **extra: object) -> dict:
    """Field metadata: a docstring and optional `choices` / `min_value` / `max_value` / `check` / `kinds`.

    Each field is also checked by its type and name (`tierkv.config.fields`): finite floats,
    bounded ints and sizes (`*_bytes`), real booleans, UTF-8 strings without NUL, paths (`path`,
    `*_path`) that can name a file."""
    return {"doc": text, **extra}


@dataclass(repr=False)
class ModelConfig(_Shown):
    """Shape of the model's KV cache; None fields are taken from the model at start-up."""

    name: str = field(default="unnamed-model", metadata=doc("model id, part of every block's address",
                                                         check="non_empty"))
    num_layers: int | None = field(default=None, metadata=doc("attention layers", min_value=1))
    num_kv_heads: int | None = field(default=None, metadata=doc("KV heads per layer", min_value=1))
    head_dim: int | None = field(default=None, metadata=doc("dims per head", min_value=1))
    kv_dtype: str = field(default="auto", metadata=doc("KV dtype; auto = the model's dtype",
                                                         choices=("auto", "bfloat16", "float16", "float32")))


@dataclass(repr=False)
class CacheConfig(_Shown):
    """The GPU hot window."""

    block_tokens: int = field(default=16, metadata=doc("tokens per KV block", min_value=1))
    gpu_budget_bytes: int = field(default=2 * 1024**3, metadata=doc("GPU bytes for KV blocks, all layers", min_value=1))
    sink_tokens: int = field(default=64, metadata=doc("first tokens kept on the GPU", min_value=0))
    window_tokens: int = field(default=1024, metadata=doc("most recent tokens kept on the GPU", min_value=0))


STORAGE_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8", "float8_e4m3fn")


@dataclass(repr=False)
class CpuTierConfig(_Shown):
    """Pinned host memory: a slab of block slots with LRU eviction into the next tier."""

    kind: str = field(default="cpu", metadata=doc("tier kind", choices=("cpu",)))
    capacity_bytes: int = field(default=8 * 1024**3, metadata=doc("slab size", min_value=1))
    storage_dtype: str = field(default="auto", metadata=doc("dtype blocks are stored in", choices=STORAGE_DTYPES))


@dataclass(repr=False)
class DiskTierConfig(_Shown):
    """Checksummed block files on a local (NVMe) path."""

    kind: str = field(default="disk", metadata=doc("tier kind", choices=("disk",)))
    path: str = field(default="~/.cache/tierkv/blocks", metadata=doc("directory for block files (made 0700; refused if another user owns it or others can write it)", check="writable_dir"))
    capacity_bytes: int = field(default=64 * 1024**3, metadata=doc("bytes on disk", min_value=1))
    storage_dtype: str = field(default="auto", metadata=doc("dtype blocks are stored in", choices=STORAGE_DTYPES))
    write_through: bool = field(default=True, metadata=doc(
        "also write every content-addressed block here as soon as it is in the CPU tier (in the background), "
        "so later processes reuse prefixes; false = only blocks the tiers above evict reach this tier"))
    trusted: bool = field(default=False, metadata=doc(
        "store blocks without authentication (no secret needed): only where nobody else can write to the tier"))
    encrypt: bool = field(default=False, metadata=doc(
        "encrypt blocks at rest (AES-256-GCM keyed by storage.secret) besides authenticating them"))


@dataclass(repr=False)
class RedisTierConfig(_Shown):
    """Redis, shared across processes and hosts."""

    kind: str = field(default="redis", metadata=doc("tier kind", choices=("redis",)))
    url: str = field(default="redis://127.0.0.1:6379/0", metadata=doc(
        "redis://host:port/db, rediss://..., unix:///path; a Redis Cluster (or Valkey cluster): "
        "redis+cluster://host:port,host2:port2 (any reachable nodes of it; rediss+cluster:// for TLS)",
        check="redis_url"))
    namespace: str = field(default="tierkv", metadata=doc("key prefix", check="non_empty"))
    ttl_s: float | None = field(default=None, metadata=doc("expiry of stored blocks; None = never", min_value=1e-3))
    capacity_bytes: int | None = field(default=None, metadata=doc("bytes this client may hold; None = server policy", min_value=1))
    timeout_s: float = field(default=0.5, metadata=doc(
        "socket timeout of each call (a cluster: of each node's); slower counts as down", min_value=1e-3))
    retry_interval_s: float = field(default=2.0, metadata=doc(
        "wait before retrying a down server (a cluster: a down node)", min_value=0.0))
    storage_dtype: str = field(default="auto", metadata=doc("dtype blocks are stored in", choices=STORAGE_DTYPES))
    write_through: bool = field(default=True, metadata=doc(
        "also write every content-addressed block here as soon as it is in the CPU tier (in the background), "
        "so other processes and hosts reuse prefixes; false = only blocks the tiers above evict reach Redis"))
    trusted: bool = field(default=False, metadata=doc(
        "store blocks without authentication (no secret needed): only where nobody else can write to the tier"))
    encrypt: bool = field(default=False, metadata=doc(
        "encrypt blocks at rest (AES-256-GCM keyed by storage.secret) besides authenticating them"))


@dataclass(repr=False)
class StorageConfig(_Shown):
    """The deployment's secret: authenticates (and names) blocks in the disk and Redis tiers."""

    secret: str | None = field(default=None, metadata=doc(
        "the secret itself (at least 16 bytes besides surrounding whitespace); prefer secret_file or TIERKV_STORAGE__SECRET", check="secret"))
    secret_file: str | None = field(default=None, metadata=doc(
        "file holding the secret (~ expanded; must not be readable by group or others)", check="non_empty"))
    create_secret_file: bool = field(default=False, metadata=doc(
        "create secret_file with a random secret (mode 0600) if it does not exist: for one user on one host"))


TierConfig = Union[CpuTierConfig, DiskTierConfig, RedisTierConfig]
TIER_CONFIG_KINDS: dict[str, type] = {"cpu": CpuTierConfig, "disk": DiskTierConfig, "redis": RedisTierConfig}


@dataclass(repr=False)
class SchedulerConfig(_Shown):
    """The lookahead prefetch scheduler."""

    policy: str = field(default="exact", metadata=doc("which far blocks attention reads", choices=("exact", "sparse")))
    lookahead_layers: int = field(default=2, metadata=doc("layers prefetched ahead of compute", min_value=1))
    staging_bytes: int = field(default=256 * 1024**2, metadata=doc("GPU bytes for streamed blocks", min_value=1))
    sparse_token_budget: int = field(default=2048, metadata=doc("far tokens attended per step (sparse)", min_value=1))
    sparse_selection: str = field(default="per_layer", metadata=doc(
        "sparse: 'per_layer' reads one selection of far blocks for all heads of a layer; 'per_kv_head' lets each "
        "KV head read its own sparse_token_budget tokens (the same keys per head, better chosen: KL to dense "
        "attention 27-39% lower on real text, retrieval unchanged, benchmarks/RESULTS.md 'Selection rules'); the "
        "default keeps the CPU's selection the GPU's; per_kv_head is built where "
        "far blocks are read in place (a CPU device, cpu_far_reads: direct); on a GPU it would copy single heads' "
        "slices, not built, and is refused there", choices=("per_layer", "per_kv_head")))
    sparse_bound_weight: float = field(default=1.0, metadata=doc(
        "sparse: how far blocks are ranked; a block's score is w x Quest's bound (the largest score any of its keys "
        "can give) + (1 - w) x the score of its midpoint key ((key max + key min) / 2), max over query heads. 1 (the "
        "bound alone) keeps a block holding one outstanding key, as a retrieved fact is: retrieval as dense at 1/4 "
        "of the context; 0.5 follows ordinary text more closely (KL to dense attention 26-51% lower on real text, "
        "SmolLM2-135M, 2k-7k tokens) but lost multi-key retrieval cases (benchmarks/RESULTS.md, 'Selection rules'); "
        "no memory or copies either way", min_value=0.0, max_value=1.0))
    predictor: str = field(default="previous", metadata=doc(
        "sparse prefetch: 'previous' copies each layer's last selection ahead, 'none' fetches on demand, "
        "'query' predicts the next lookahead_layers layers' selection from the current hidden state and keeps "
        "fetched far blocks in an LRU cache in the staging memory, 'cache' (transformers engine) keeps each layer's "
        "last sparse_cache_selections selections in the staging memory and copies only the selected blocks it lacks, "
        "the selection, copies and far attention of a layer in one CUDA graph where sparse_cuda_graphs allows",
        choices=("previous", "none", "query", "cache")))
    predict_with_previous: bool = field(default=True, metadata=doc(
        "predictor 'query': also prefetch each layer's previous-step selection"))
    sparse_cuda_graphs: bool = field(default=True, metadata=doc(
        "sparse policy under vLLM's hot window: capture, per layer, the decoding rows' selection, fetch and "
        "far attention in one CUDA graph and replay it (CUDA, copy-kernel transfer backends; a quantized CPU tier's "
        "codes are dequantized inside the graph; elsewhere, and after a failed capture, the eager path)"))
    sparse_graph_rows: int = field(default=8, metadata=doc(
        "sparse CUDA graphs: decoding rows one layer's graph serves, at most vLLM's max_num_seqs; each row's request "
        "holds a far-block cache of one selection per layer (layers x sparse_token_budget tokens of KV, within three "
        "quarters of staging_bytes), so only selected blocks it lacks cross PCIe; where staging cannot hold that for "
        "every row, one selection per row copied every step (a warning says so); rows beyond go the eager way",
        min_value=1))
    sparse_cache_selections: int = field(default=1, metadata=doc(
        "sparse CUDA graphs: selections each graphed request's far-block cache keeps per layer; past 1, a block "
        "selected again after a step or more away is still on the GPU (the least recently used replaced); each "
        "adds layers x sparse_token_budget tokens of KV to what staging_bytes must hold per row; 0: keep nothing, "
        "copy every selected block each step (one selection's staging per row)", min_value=0))
    sparse_prefetch_margin: int = field(default=0, metadata=doc(
        "sparse step inside vLLM's full decode graph, or the transformers engine's predictor 'cache': far blocks per "
        "layer and row ranked just below the selection (the next k..k+m of the same bounds), copied into the "
        "far-block cache on a side stream (under vLLM while the next layers compute; in the transformers engine "
        "beside the layer's attention), so the next step finds them there; needs sparse_cache_selections x the "
        "selection's blocks >= the selection's blocks + the margin (2 selections: a margin up to one selection); "
        "0: off",
        min_value=0))
    decode_cuda_graph: bool = field(default=True, metadata=doc(
        "transformers engine, sparse policy with predictor 'cache', on CUDA with a copy-kernel transfer backend: "
        "replay a one-token decode step (the model's forward and tierkv's attention) from one CUDA graph, captured "
        "per sequence; steps that complete a block, and all steps after a failed capture, run eagerly"))
    sparse_full_graphs: bool = field(default=False, metadata=doc(
        "sparse CUDA graphs under compiled vLLM: let vLLM capture the attention of single-token decode steps in its "
        "full decode graph (window, selection, fetch and far attention of every row), with per-row inputs written "
        "before each step and the step's saves after it; other steps run piecewise as before. Needs compiled vLLM and "
        "max_num_seqs (TieredLLM adds it to vLLM's capture sizes)"))
    staging_follows_budget: bool = field(default=True, metadata=doc(
        "under vLLM's hot window: a run-time GPU budget below cache.gpu_budget_bytes (set_gpu_budget) shrinks "
        "staging_bytes once vLLM's pool is down to every max_num_seqs row's window, never below its share of the "
        "budget, and a grow restores it up to staging_bytes, so the staging's memory (the ring; "
        "under the sparse policy also its eager regions and far-block caches, re-made empty, the step graphs "
        "captured again) goes back with the pool's; false keeps staging_bytes at any budget. Kept either way with "
        "sparse_full_graphs (vLLM's captured graphs hold the caches)"))
    vllm_rows_from_batch: bool = field(default=False, metadata=doc(
        "sparse CUDA graphs under TieredLLM(backend='vllm'): size the graphed rows by the engine's max_num_seqs at "
        "start-up: sparse_graph_rows rises to max_num_seqs and staging_bytes to what every row's far-block caches "
        "of sparse_cache_selections selections need beside the eager regions (plus 64 MiB for the streamed chunks), "
        "out of cache.gpu_budget_bytes; off: both as written (rows past sparse_graph_rows run eagerly, rows the "
        "staging cannot hold copy every selected block each step)"))
    vllm_async_scheduling: bool = field(default=False, metadata=doc(
        "under vLLM's hot window: let vLLM schedule and prepare step N+1 while the GPU runs step N (its async "
        "scheduling, on by default in plain vLLM); a block completed by a token still being sampled is saved one "
        "step later, and vLLM's pool keeps twice the prefill chunk of in-flight tokens per request (halve "
        "prefill_chunk_tokens to keep the pool; TieredLLM checks it before vLLM starts)"))
    cpu_far_reads: str = field(default="direct", metadata=doc(
        "on a CPU device (the transformers engine on a machine without a GPU): 'direct' attends each layer's far "
        "blocks in place in the CPU tier's slab, one call per layer (no staging copies; the sparse policy's "
        "predictors, which exist to hide copies, are not used); 'staged' copies them through the staging ring as on "
        "CUDA; ignored on CUDA", choices=("direct", "staged")))
    prefill_chunk_tokens: int = field(default=2048, metadata=doc("prompt tokens per prefill forward", min_value=1))
    transfer_backend: str = field(default="auto", metadata=doc(
        "how blocks cross PCIe on CUDA: 'auto' ('adaptive', else the first that works), 'adaptive' (the copy "
        "engines for long runs of consecutive slots, the copy kernel otherwise), 'cupy' (the copy kernel, on SMs), "
        "'memcpy_batch' (CUDA's batched memcpy on the copy engines), 'torch_uva', 'copy_loop'; ignored on CPU",
        choices=("auto", "cupy", "memcpy_batch", "adaptive", "torch_uva", "copy_loop")))


@dataclass(repr=False)
class MetricsConfig(_Shown):
    """Counters, the Prometheus endpoint and JSONL snapshots."""

    enabled: bool = field(default=True, metadata=doc("keep counters"))
    prometheus_port: int | None = field(default=None, metadata=doc("serve /metrics on this port", min_value=1, max_value=65535))
    jsonl_path: str | None = field(default=None, metadata=doc("append snapshots to this file (~ expanded)",
                                                              check="writable_file"))
    snapshot_interval_s: float = field(default=1.0, metadata=doc("seconds between JSONL snapshots", min_value=1e-3))
    history_bytes: int = field(default=8 * 1024**2, metadata=doc(
        "memory for the snapshot lines kept in the process (what /api/snapshots and the live dashboard serve), "
        "held as compact JSON (the process pays this bound plus ~100 bytes per line); a line is ~4 KB for a "
        "2-layer model and grows with layers and tiers (a loaded 32-layer runtime: ~20 KB), so 8 MiB keeps the "
        "last ~400-2,000 lines (7-30 minutes at one a second); the JSONL file keeps every line",
        min_value=1))
    host: str = field(default="127.0.0.1", metadata=doc(
        "address the metrics endpoint listens on; requests must name it in their Host header (loopback also "
        "accepts localhost; 0.0.0.0 or :: listen everywhere and accept IP addresses): keep loopback unless "
        "the endpoint must be reached from other hosts", check="host"))
    control_enabled: bool = field(default=False, metadata=doc(
        "serve POST /api/gpu_budget (`tierkv budget`) on the metrics endpoint; needs control_token or the "
        "TIERKV_CONTROL_TOKEN environment variable (docs/security.md)"))
    control_token: str | None = field(default=None, metadata=doc(
        "bearer token of the control endpoint, at least 16 characters, no whitespace at either end; "
        "None: TIERKV_CONTROL_TOKEN", check="control_token"))


def _default_tiers() -> list:
    return [CpuTierConfig()]


@dataclass(repr=False)
class TierKVConfig(_Shown):
    """Everything tierkv needs; `tiers` is the ordered list of tiers below the GPU."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata=doc("KV shape of the model"))
    cache: CacheConfig = field(default_factory=CacheConfig, metadata=doc("GPU hot window"))
    tiers: list[TierConfig] = field(default_factory=_default_tiers, metadata=doc(
        "tiers below the GPU, in order", kinds=TIER_CONFIG_KINDS))
    storage: StorageConfig = field(default_factory=StorageConfig, metadata=doc("secret of the disk and Redis tiers"))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig, metadata=doc("prefetch scheduler"))
    metrics: MetricsConfig = field(default_factory=MetricsConfig, metadata=doc("metrics"))


def load_config(source=None, *, env=None) -> TierKVConfig:
    """Load from a YAML path, a dict, or None (defaults), then apply TIERKV_* overrides."""
    return loader.load(TierKVConfig, source, env=env, check=check_config)


def config_errors(source=None, *, env=None) -> list[ConfigError]:
    """Every ConfigError `load_config` would find (one per bad field); [] for a good config."""
    return loader.load_with_errors(TierKVConfig, source, env=env, check=check_config)[1]
