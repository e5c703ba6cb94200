"""`tierkv plan`: where one request's KV lives and what each decode step moves, without a model.

Primitives: `KVShape`, `PRESETS`, `load_shape`, `make_plan`, `format_plan` (token counts: `tierkv.units.parse_tokens`).

    tierkv plan --model-config llama-3.1-8b --context 128k --gpu-budget 2GiB [--config YAML]
                [--h2d-gbps 55] [--vllm-kv-pool 20GiB] [--backend vllm [--max-num-seqs N]] [--json]

Exact mode reads every block of every layer at every step; blocks that are not resident in the
GPU hot window are streamed over PCIe, so bytes streamed / H2D bandwidth is a floor on the time
of a decode step. 55 GB/s is the pinned H2D rate measured on an H200 (DESIGN.md); --h2d-gbps
sets another. vLLM pre-allocates its KV pool and refuses to start unless one max_model_len
request fits in it (16-token blocks, every layer).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tierkv.cli.plan_format import _vllm_plan, format_plan
from tierkv.model_shape import model_shape, read_config_json, text_config
from tierkv.units import TOKEN_UNITS_HELP

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DEFAULT_H2D_GBPS = 55.0
MIN_H2D_GBPS, MAX_H2D_GBPS = 0.01, 10_000.0  # a rate outside these is a unit mistake
VLLM_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class KVShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "bfloat16"
    max_context: int | None = None  # the checkpoint's max_position_embeddings, when known
    sliding_window: int | None = None  # the model's own attention window, when it has one
    scaled_context: int | None = None  # the length its rope scaling reaches, as vLLM derives max_model_len
    attention_chunk: int | None = None  # Llama 4's chunked attention: its layers attend within chunks of this many

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]


PRESETS = {  # KV shapes of the released checkpoints (config.json of each)
    "llama-3.1-8b": KVShape("llama-3.1-8b", 32, 8, 128, max_context=131072),
    "qwen2-7b": KVShape("qwen2-7b", 28, 4, 128, max_context=32768),  # Instruct; longer with YaRN
    "mistral-7b": KVShape("mistral-7b", 32, 8, 128, max_context=32768),  # v0.3
    # the main job's model (its GGUF has no config.json); float32, as it runs on a CPU (bfloat16 on CUDA)
    "smollm2-135m": KVShape("smollm2-135m", 30, 3, 64, kv_dtype="float32", max_context=8192),
}


def load_shape(spec: str, kv_dtype: str | None = None) -> KVShape:
    """A preset name, or a transformers config.json (or the directory holding one)."""
    from tierkv.cli.errors import UsageError

    if spec in PRESETS:
        shape = PRESETS[spec]
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UsageError(f"--model-config: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
        try:
            raw = read_config_json(path)
            latent = text_config(raw).get("kv_lora_rank")  # the runtime's check (model_support), on the file
            if latent:
                raise UsageError(f"--model-config {path}: the model uses multi-head latent attention (kv_lora_rank="
                                 f"{latent}): its cached keys and values differ in width, and tierkv refuses it")
            parsed = model_shape(raw, str(path))
        except ValueError as exc:
            raise UsageError(f"--model-config {path}: not a transformers model config ({exc})") from None
        shape = KVShape(name=parsed.name or path.parent.name, num_layers=parsed.num_layers,
                        num_kv_heads=parsed.num_kv_heads, head_dim=parsed.head_dim, kv_dtype=_dtype(parsed.dtype),
                        max_context=parsed.max_position_embeddings, sliding_window=parsed.sliding_window,
                        scaled_context=_scaled_context(text_config(raw), parsed.max_position_embeddings),
                        attention_chunk=_attention_chunk(text_config(raw)))
    return shape if kv_dtype is None else KVShape(**{**asdict(shape), "kv_dtype": kv_dtype})


def _scaled_context(text: dict, max_positions: int | None) -> int | None:
    """The length a rope scaling with a factor carries the model to, as vLLM 0.26 derives max_model_len (yarn from
    its original_max_position_embeddings; llama3 and longrope already count theirs in max_position_embeddings)."""
    scaling = text.get("rope_scaling") if isinstance(text, dict) else None
    if not isinstance(scaling, dict) or not max_positions:
        return None
    kind, factor = scaling.get("rope_type", scaling.get("type")), scaling.get("factor")
    if kind in (None, "default", "su", "longrope", "llama3") or not isinstance(factor, (int, float)) or factor <= 1:
        return None
    base = scaling.get("original_max_position_embeddings", max_positions) if kind == "yarn" else max_positions
    return int(base * factor) if isinstance(base, int) and base > 0 else None


def _attention_chunk(text: dict) -> int | None:
    """attention_chunk_size where some layers attend in chunks (`model_support.attention_span`'s reading)."""
    chunk, kinds = text.get("attention_chunk_size"), text.get("layer_types")
    chunked = "chunked_attention" in kinds if isinstance(kinds, list) and kinds else True
    return chunk if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0 and chunked else None


def _dtype(name: str) -> str:
    return name if name in DTYPE_BYTES else "bfloat16"


def make_plan(shape: KVShape, context: int, config, *, h2d_gbps: float = DEFAULT_H2D_GBPS,
              vllm_kv_pool_bytes: int | None = None, backend: str = "transformers", max_num_seqs: int = 1) -> dict:
    """Everything `tierkv plan` prints, as plain data. Raises ConfigError when the budget is too small.
    backend "vllm": the GPU part is the vLLM hot-window engine's split of the budget (`plan_gpu`)."""
    from tierkv.blocks import BlockLayout, dtype_from_name
    from tierkv.storage.cpu_slab import slot_num_bytes

    cache, sched = config.cache, config.scheduler
    T, L = cache.block_tokens, shape.num_layers
    layout = BlockLayout(shape.num_kv_heads, T, shape.head_dim, dtype_from_name(shape.kv_dtype))
    block = layout.num_bytes
    num_blocks = -(-context // T)
    if backend == "vllm":  # the hot-window pool: no sinks or far cache, the window's blocks per request
        gpu = _vllm_plan().vllm_gpu_plan(shape, context, config, max_num_seqs)
        streamed = _vllm_plan().vllm_streamed_blocks(config, context)
    else:
        gpu, streamed = _transformers_gpu(layout, L, context, config)
    cpu = config.tiers[0]
    # a quantized CPU tier holds (and PCIe carries) a block's codes and scales, not the block
    slot = slot_num_bytes(layout, None if cpu.storage_dtype == "auto" else cpu.storage_dtype)
    streamed_bytes = streamed * L * slot
    requests = max_num_seqs if backend == "vllm" else 1  # the CPU tier holds every running request's blocks
    cpu_blocks_needed = num_blocks * L * requests
    vllm_needed = -(-context // VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS * shape.kv_bytes_per_token
    within = not shape.max_context or context <= (shape.scaled_context or shape.max_context)  # vLLM's max_model_len
    return {
        "warnings": _window_warnings(shape, context, backend),
        "model": asdict(shape), "kv_bytes_per_token": shape.kv_bytes_per_token, "context_tokens": context,
        "kv_bytes": context * shape.kv_bytes_per_token, "block_tokens": T, "block_bytes": block,
        "blocks_per_layer": num_blocks, "num_layers": L, "backend": backend, "policy": sched.policy,
        "gpu": gpu,
        "cpu": {"capacity_bytes": cpu.capacity_bytes, "blocks_needed": cpu_blocks_needed, "slot_bytes": slot,
                "bytes_needed": cpu_blocks_needed * slot, "fits": cpu_blocks_needed <= cpu.capacity_bytes // slot},
        "lower_tiers": [{"kind": t.kind, "capacity_bytes": t.capacity_bytes} for t in config.tiers[1:]],
        "decode_step": {"streamed_blocks_per_layer": streamed, "streamed_bytes": streamed_bytes,
                        "h2d_gbps": h2d_gbps, "pcie_floor_s": streamed_bytes / (h2d_gbps * 1e9)},
        "vllm": {"block_tokens": VLLM_BLOCK_TOKENS, "kv_pool_needed_bytes": vllm_needed, "requests": requests,
                 "batch_pool_needed_bytes": requests * vllm_needed,
                 "kv_pool_bytes": vllm_kv_pool_bytes,
                 # vLLM keeps one block of its pool aside (its null block): a pool of exactly the need admits none
                 "fits": None if vllm_kv_pool_bytes is None else (
                     vllm_needed + VLLM_BLOCK_TOKENS * shape.kv_bytes_per_token <= vllm_kv_pool_bytes and within)},
    }


def _check_model_section(model, shape: KVShape) -> None:
    """The config's `model:` shape against the model's, as a start refuses a difference (runtime_for_model)."""
    from tierkv.cli.errors import UsageError

    for key in ("num_layers", "num_kv_heads", "head_dim"):
        configured = getattr(model, key, None)
        if configured is not None and configured != getattr(shape, key):
            raise UsageError(f"config key 'model.{key}': got {configured}; the model has {getattr(shape, key)} (a "
                             f"start refuses the difference: drop the key or plan the model it names)")
    if model.kv_dtype not in ("auto", shape.kv_dtype):
        raise UsageError(f"config key 'model.kv_dtype': got {model.kv_dtype!r}; the plan's KV dtype is "
                         f"{shape.kv_dtype!r} (--kv-dtype or the model's own)")


def _window_warnings(shape: KVShape, context: int, backend: str) -> list[str]:
    """What the runtime refuses of this plan because the model attends its own sliding window (or chunks)."""
    window = shape.sliding_window
    chunk = shape.attention_chunk
    if chunk and backend != "vllm" and context > chunk and not (window and window < chunk):
        return [f"the model's layers attend in chunks of {chunk} tokens (attention_chunk_size): the transformers "
                f"engine serves sequences of at most {chunk} tokens and refuses this {context}-token request"]
    if not window:
        return []
    if backend == "vllm":
        return [f"the model attends its own sliding window of {window} tokens: TieredLLM(backend='vllm') refuses "
                "the hot window for it (vLLM keeps only that window of KV already; hot_window=False runs tierkv's "
                "connector alone), so the GPU part below does not apply"]
    if context > window:
        return [f"the model attends its own sliding window of {window} tokens: the transformers engine serves "
                f"sequences of at most {window} tokens and refuses this {context}-token request"]
    return []


def _transformers_gpu(layout, num_layers: int, context: int, config) -> tuple[dict, int]:
    """The transformers engine's GPU part of the plan (sinks, far cache, window, staging ring beside the
    budget) and the blocks per layer its decode step after `context` tokens streams."""
    from tierkv.scheduler.plan import plan_step
    from tierkv.storage.gpu import plan_residency, staging_region_blocks

    cache, sched = config.cache, config.scheduler
    T, L, block = cache.block_tokens, num_layers, layout.num_bytes
    residency = plan_residency(layout, L, cache.gpu_budget_bytes, cache.sink_tokens, cache.window_tokens)
    num_regions = max(2, sched.lookahead_layers + 1)
    region_blocks = staging_region_blocks(layout, sched.staging_bytes, num_regions)  # the runtime's check and words
    step = plan_step(residency, T, context, 1)  # the decode step after `context` tokens
    sink_blocks = -(-cache.sink_tokens // T)
    front = min(residency.num_front_blocks, -(-context // T))
    gpu = {"budget_bytes": cache.gpu_budget_bytes,
           "sink_blocks": min(sink_blocks, front), "far_cache_blocks": max(0, front - sink_blocks),
           "window_blocks": residency.num_window_blocks, "slots_per_layer": residency.slots_per_layer,
           "resident_bytes": residency.slots_per_layer * L * block,
           "staging_bytes": num_regions * region_blocks * block, "staging_regions": num_regions,
           "resident_blocks_per_layer_at_decode": len(step.resident_blocks) + step.num_blocks_after - step.first_block}
    streamed = len(step.streamed_blocks)
    if sched.policy == "sparse":  # each step reads the selected far blocks, and keeps each block's key bounds
        streamed = min(streamed, sched.sparse_token_budget // T)
        gpu["summary_bytes"] = L * -(-context // T) * 2 * layout.num_kv_heads * layout.head_dim * layout.dtype.itemsize
    return gpu, streamed


def add_parser(commands) -> None:
    p = commands.add_parser("plan", help="tier layout, bytes per decode step, PCIe floor, vLLM check",
                            description=__doc__.splitlines()[0])
    p.add_argument("--model-config", required=True, metavar="PRESET|PATH",
                   help=f"a preset ({', '.join(PRESETS)}) or a transformers config.json / model directory")
    p.add_argument("--context", required=True, metavar="TOKENS",
                   help=f"tokens in the request, e.g. 131072, 128k or 1M; {TOKEN_UNITS_HELP}")
    p.add_argument("--gpu-budget", metavar="SIZE", help="GPU bytes for KV, e.g. 2GiB (default: the config's)")
    p.add_argument("--config", metavar="YAML", help="tierkv config (block size, window, tiers; default: built-in)")
    p.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), help="KV dtype (default: the model's)")
    p.add_argument("--h2d-gbps", type=float, default=DEFAULT_H2D_GBPS, help="host-to-GPU bandwidth, GB/s (default 55)")
    p.add_argument("--vllm-kv-pool", metavar="SIZE", help="GPU KV pool vLLM would have, e.g. 20GiB")
    p.add_argument("--backend", choices=("transformers", "vllm"), default="transformers",
                   help="the engine: transformers (TieredLLM's default) or vllm (the hot-window pool, whose budget "
                        "holds the staging and the sparse reservations)")
    p.add_argument("--max-num-seqs", type=int, default=1, metavar="N",
                   help="--backend vllm: requests at once (the sparse key summaries are kept for each)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(handler=run_plan)


def run_plan(args) -> int:
    from tierkv.cli.errors import UsageError, check_positive
    from tierkv.config import ConfigError, load_config
    from tierkv.units import parse_bytes, parse_tokens

    try:
        context = parse_tokens(args.context)
    except ValueError as exc:
        raise UsageError(f"--context: {exc}") from None
    sizes = {}
    for flag, text in (("--gpu-budget", args.gpu_budget), ("--vllm-kv-pool", args.vllm_kv_pool)):
        try:
            sizes[flag] = parse_bytes(text) if text is not None else None
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    budget, pool = sizes["--gpu-budget"], sizes["--vllm-kv-pool"]
    for flag, size in sizes.items():
        if size is not None and size <= 0:
            raise UsageError(f"{flag}: got {getattr(args, flag[2:].replace('-', '_'))}; it must be positive")
    check_positive("--h2d-gbps", args.h2d_gbps)  # nan too
    if not MIN_H2D_GBPS <= args.h2d_gbps <= MAX_H2D_GBPS:  # GB/s, not bytes/s or TB/s
        raise UsageError(f"--h2d-gbps: got {args.h2d_gbps:g}; expected GB/s from {MIN_H2D_GBPS:g} to {MAX_H2D_GBPS:g} "
                         f"(a PCIe 5 x16 link gives about 55)")
    if args.max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs: got {args.max_num_seqs}; it must be at least 1")
    if args.max_num_seqs != 1 and args.backend != "vllm":
        raise UsageError(f"--max-num-seqs {args.max_num_seqs}: only --backend vllm runs several requests at once "
                         "(the transformers engine runs a batch one request after another)")
    config = load_config(args.config)
    if budget is not None:
        import dataclasses

        from tierkv.config.fields import check_value

        meta = {f.name: f.metadata for f in dataclasses.fields(config.cache)}["gpu_budget_bytes"]
        try:  # the config's own bounds (a budget past them was planned as given)
            check_value(budget, "cache.gpu_budget_bytes", "gpu_budget_bytes", meta)
        except ConfigError as exc:
            raise UsageError(f"--gpu-budget {args.gpu_budget}: {exc.allowed}") from None
        config.cache.gpu_budget_bytes = budget
    shape = load_shape(args.model_config, args.kv_dtype)
    if args.backend == "vllm" and args.kv_dtype is None and shape.kv_dtype == "float32":
        shape = KVShape(**{**asdict(shape), "kv_dtype": "bfloat16"})  # vLLM's auto dtype runs float32 models in 16 bits
    _check_model_section(config.model, shape)
    try:
        plan = make_plan(shape, context, config, h2d_gbps=args.h2d_gbps, vllm_kv_pool_bytes=pool,
                         backend=args.backend, max_num_seqs=args.max_num_seqs)
    except ConfigError as exc:
        if exc.key == "cache.gpu_budget_bytes" and budget is not None:
            raise UsageError(f"--gpu-budget {args.gpu_budget}: {exc.allowed}") from None
        raise
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0
