"""`tierkv run`: generate from a prompt with a model directory (or the built-in demo model).

    tierkv run --model /models/Llama-3.1-8B-Instruct --config configs/long-128k.yaml --prompt-file doc.txt
    tierkv run --demo --prompt-tokens 8192 --jsonl run.jsonl --report run.html

The prompt is text (needs the model's tokenizer), a file of text, or a file holding a JSON list
of token ids; --demo makes a random prompt of --prompt-tokens. The generated text (or token ids)
goes to stdout; progress bars on prefill (for prompts longer than four prefill chunks) and on
decode (tokens and tok/s, from 16 new tokens), and a summary, go to stderr. --jsonl records metrics
snapshots; --report writes the dashboard as HTML, made from the snapshots of --jsonl, else of the
config's metrics.jsonl_path, else of a file named as the report with .jsonl (never the report itself).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tierkv.units import TOKEN_UNITS_HELP


def add_parser(commands) -> None:
    p = commands.add_parser("run", help="generate from a prompt", description=__doc__.splitlines()[0])
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", metavar="MODEL", help="local checkpoint directory, a .gguf file, or smollm2-135m")
    model.add_argument("--demo", action="store_true", help="the built-in random-weight Llama-architecture model")
    p.add_argument("--config", metavar="YAML", help="tierkv config (default: $TIERKV_CONFIG_FILE, built-in defaults;"
                   " with --demo, configs/default.yaml)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT")
    prompt.add_argument("--prompt-file", metavar="PATH", help="text, or a JSON list of token ids")
    prompt.add_argument("--prompt-tokens", metavar="N", help="a random prompt of N token ids (default with --demo: 2048); "
                        f"token counts take {TOKEN_UNITS_HELP}")
    p.add_argument("--chat", action="store_true", help="wrap --prompt / --prompt-file text in the model's chat "
                   "template as one user turn (an instruct model answers raw text with little or nothing)")
    p.add_argument("--max-new-tokens", metavar="N", default="32", help="default 32; e.g. 512 or 4k")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, default=0, help="sampling seed and random-prompt seed")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: CUDA when present)")
    p.add_argument("--jsonl", metavar="PATH", help="append metrics snapshots to PATH (sets metrics.jsonl_path)")
    p.add_argument("--prometheus-port", type=int, metavar="PORT", help="serve /metrics and the live dashboard")
    p.add_argument("--report", metavar="HTML", help="write the dashboard of this run as one static HTML file, made "
                   "from the snapshots of --jsonl, else of the config's metrics.jsonl_path, else of HTML's name with "
                   ".jsonl; refused when that is HTML itself")
    p.add_argument("--json", action="store_true", help="print outputs and stats as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bars, no summary")
    p.set_defaults(handler=run_generate)


def run_generate(args) -> int:
    from tierkv.cli.errors import UsageError
    from tierkv.sampling import SamplingParams

    prompt = _read_prompt(args)  # before loading anything: a bad prompt or device fails fast
    _check_device(args.device)
    max_new_tokens = _token_count("--max-new-tokens", args.max_new_tokens)
    if not 0 <= args.seed < 2**63:  # torch's generators take 64-bit seeds; SamplingParams the same range
        raise UsageError(f"--seed: got {args.seed}; expected 0 to 2**63 - 1")
    if args.demo and isinstance(prompt, str):
        raise UsageError("the demo model has no tokenizer: use --prompt-tokens N or a --prompt-file of token ids")
    if args.chat and not isinstance(prompt, str):
        raise UsageError("--chat wraps text in the chat template: give --prompt TEXT or a --prompt-file of text")
    try:
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed if args.temperature > 0 else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    config = _with_flags(_load_config(args), args)
    llm = _make_llm(args, config)
    with llm:
        if llm.metrics.url and not args.quiet:
            print(f"tierkv run: metrics and live dashboard at {llm.metrics.url}/", file=sys.stderr)
        if isinstance(prompt, int):
            fits = getattr(getattr(llm, "runtime", None), "check_fits", None)
            if fits is not None:  # before building the prompt: a huge --prompt-tokens is refused at once
                try:
                    fits(prompt + max_new_tokens - 1)  # (the last new token is never fed back)
                except ValueError as exc:
                    raise UsageError(f"--prompt-tokens {args.prompt_tokens}: {exc}") from None
            prompt = _random_prompt(prompt, llm.vocab_size, args.seed)
        if args.chat:
            prompt = _chat_prompt(llm.tokenizer, prompt)
        try:
            (out,) = llm.generate([prompt], sampling)
        except (ValueError, TypeError) as exc:  # bad prompt (PromptError), or a request the CPU tier cannot hold
            raise UsageError(str(exc)) from None
        stats = llm.stats()
    _print(args, out, stats)
    if isinstance(prompt, str) and not args.quiet and not args.json and out.finish_reason == "stop" \
            and len(out.token_ids) <= 1 and getattr(getattr(llm, "tokenizer", None), "chat_template", None):
        print("tierkv run: the model stopped at once; an instruct model answers a question in its chat template: "
              "add --chat", file=sys.stderr)
    if args.report:
        from tierkv.dashboard import write_report

        write_report(os.path.expanduser(config.metrics.jsonl_path), args.report)  # (as the recorder wrote it)
        if not args.quiet:
            print(f"tierkv run: report written to {args.report}", file=sys.stderr)
    return 0


def _chat_prompt(tokenizer, text: str) -> list[int]:
    """`text` as one user turn of the tokenizer's chat template, ready for the assistant's answer."""
    from tierkv.cli.errors import UsageError

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise UsageError("--chat: this model's tokenizer has no chat template; leave --chat out")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # (a BatchEncoding from some tokenizers)
    return [int(t) for t in ids]


def _load_config(args):
    """--config (or the demo's, or $TIERKV_CONFIG_FILE's) with --prometheus-port given before the config's rules
    run: metrics.control_enabled needs a port, and the flag may be what gives it."""
    from tierkv.cli.errors import UsageError
    from tierkv.config import ConfigError, load_config

    env = dict(os.environ)
    var = "TIERKV_METRICS__PROMETHEUS_PORT"
    if args.prometheus_port is not None:
        env[var] = str(args.prometheus_port)
    try:
        return load_config(args.config if args.config or not args.demo else _demo_config(), env=env)
    except ConfigError as exc:
        if args.prometheus_port is not None and var not in os.environ and exc.key.startswith("metrics.prometheus_port"):
            raise UsageError(f"--prometheus-port {args.prometheus_port}: "
                             f"{ConfigError('metrics.prometheus_port', exc.value, exc.allowed)}") from None
        raise


def _with_flags(config, args):
    """The config with --jsonl / --report / --prometheus-port written into its metrics section, checked by the
    config's own rules (UsageError naming the flag)."""
    from tierkv.cli.errors import UsageError
    from tierkv.config import ConfigError, load_config
    from tierkv.config.load import to_dict

    metrics, flags = {}, []
    jsonl_path, named_by = _snapshots_path(config, args)
    if jsonl_path is not None and named_by != "metrics.jsonl_path":  # a flag names it: written into the config
        metrics["jsonl_path"] = jsonl_path
        flags.append(f"--jsonl {args.jsonl}" if args.jsonl else f"--report {args.report}")
    if args.prometheus_port is not None:
        metrics["prometheus_port"] = args.prometheus_port
        flags.append(f"--prometheus-port {args.prometheus_port}")
    if args.report:  # written after the run: refused before it, as the config's own file paths are
        _check_report(args.report, jsonl_path, named_by)
    if not metrics:
        return config
    values = to_dict(config)
    values["metrics"] = {**values.get("metrics", {}), **metrics}
    try:
        return load_config(values, env={})
    except ConfigError as exc:
        raise UsageError(f"{' / '.join(flags)}: {exc}") from None


def _snapshots_path(config, args) -> tuple[str | None, str]:
    """(where the metrics snapshots go, what names it): --jsonl, else the config's metrics.jsonl_path, else with
    --report the report's name with .jsonl (the report is made from them)."""
    if args.jsonl:
        return args.jsonl, "--jsonl"
    if config.metrics.jsonl_path is not None:
        return config.metrics.jsonl_path, "metrics.jsonl_path"
    if args.report:
        return str(Path(args.report).with_suffix(".jsonl")), "--jsonl (not given: --report's name with .jsonl)"
    return None, ""


def _check_report(report: str, jsonl_path: str, named_by: str) -> None:
    """--report can be written and is not the file the snapshots go to (read back to make the report)."""
    from tierkv.cli.dashboard_cmd import refuse_same_file
    from tierkv.cli.errors import UsageError
    from tierkv.config import ConfigError
    from tierkv.config.fields import check_writable_file

    refuse_same_file("--report", report, named_by, os.path.expanduser(jsonl_path))  # (the recorder expands ~)
    try:
        check_writable_file(report, "--report")
    except ConfigError as exc:
        raise UsageError(f"--report {report}: {exc.allowed}") from None


def _read_prompt(args) -> str | list | int:
    """Text, token ids, or the length of a random prompt to make once the vocabulary is known."""
    from tierkv.cli.errors import UsageError

    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--prompt-file: cannot read {args.prompt_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"--prompt-file: {args.prompt_file} is not UTF-8 text (byte {exc.start}: "
                             f"{exc.object[exc.start:exc.start + 1]!r})") from None
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return value if isinstance(value, list) else text
    if args.prompt_tokens is None and not args.demo:
        raise UsageError("give a prompt: --prompt TEXT, --prompt-file PATH or --prompt-tokens N")
    return 2048 if args.prompt_tokens is None else _token_count("--prompt-tokens", args.prompt_tokens)


def _token_count(flag: str, text: str) -> int:
    from tierkv.cli.errors import UsageError
    from tierkv.units import parse_tokens

    try:
        return parse_tokens(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _check_device(device: str | None) -> None:
    from tierkv.cli.errors import UsageError

    if device is None:
        return
    import torch

    try:
        kind = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device: got {device!r}; expected e.g. cpu, cuda or cuda:1") from None
    if kind.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__})")
    if kind.type == "cuda" and kind.index is not None and kind.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA devices")
    if kind.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: tierkv runs on cpu or cuda")


def _random_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    import torch

    return torch.randint(0, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def _demo_config():
    from tierkv.demo import DEFAULT_CONFIG

    return DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else None


def _make_llm(args, config):
    from tierkv.cli.errors import UsageError
    from tierkv.llm import TieredLLM

    if args.demo:
        from tierkv.demo import tiny_llama

        model = tiny_llama() if args.device is None else tiny_llama().to(args.device)  # (_check_device passed)
        return TieredLLM(model, config, show_progress=not args.quiet)
    from tierkv.model_loading import resolve_checkpoint

    try:
        resolve_checkpoint(args.model)  # before loading anything: a bad --model fails fast
    except (ValueError, ModuleNotFoundError) as exc:
        raise UsageError(f"--model: {exc}") from None
    return TieredLLM(args.model, config, device=args.device, show_progress=not args.quiet)


def _print(args, out, stats) -> None:
    from tierkv.units import format_bytes as fb

    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
                          "stats": out.stats, "totals": stats}, default=str))
        return
    print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    if args.quiet:
        return
    s = out.stats
    hit = "n/a" if s["gpu_hit_rate"] is None else f"{100 * s['gpu_hit_rate']:.1f}%"
    print(f"tierkv run: {s['prompt_tokens']} prompt tokens ({s['prefix_tokens']} reused), {s['generated_tokens']} generated"
          f" ({out.finish_reason}); prefill {s['prefill_s']:.2f} s, decode {s['decode_s']:.2f} s; GPU hit rate {hit};"
          f" H2D {fb(s['h2d_bytes'])}, D2H {fb(s['d2h_bytes'])}, stalls {s['stalls']}", file=sys.stderr)
