"""The `tierkv` command line.

Primitives: `main(argv) -> exit code`, `build_parser`, `UsageError`.

    tierkv run          generate from a prompt with a model directory (or --demo) and a config
    tierkv plan         what sits on which tier, bytes per decode step, PCIe floor, vLLM check
    tierkv config check validate a config and print it resolved (defaults, environment applied)
    tierkv bench        list or run the scripts in benchmarks/
    tierkv top          a live terminal view of a running TieredLLM's figures or a JSONL
    tierkv dashboard    serve the web dashboard, or write it as one static HTML file
    tierkv budget       resize a running TieredLLM's GPU KV budget through its endpoint

Exit codes: 0 done; 2 bad arguments or config (a message on stderr names the problem);
1 a failure while running; 130 interrupted (top and dashboard stop with 0 on Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

from tierkv.cli.errors import UsageError
from tierkv.config import ConfigError
from tierkv.redact import redact_text

__all__ = ["UsageError", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse, with every word that starts like a negative number ('-1GiB', '-4k', '-1e3', '-.5', '-inf') read
    as a value, never as an option: the command's own check then refuses it by name (argparse alone takes only
    '-1' and '-0.5' as values, and says "expected one argument" or "required: size" for the rest). No option of
    tierkv starts with '-' and a digit or '-inf'. Subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-(?:\.?[0-9]|inf)", re.IGNORECASE)  # argparse's .match()


def build_parser() -> argparse.ArgumentParser:
    from tierkv import __version__
    from tierkv.cli import bench, budget, config_cmd, dashboard_cmd, plan, run, top

    parser = _Parser(prog="tierkv", description="tierkv: a tiered KV-cache runtime.")
    parser.add_argument("--version", action="version", version=f"tierkv {__version__}")
    parser.add_argument("--traceback", action="store_true", help="print the full traceback of a failure")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (run, plan, config_cmd, bench, top, dashboard_cmd, budget):
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors exit 2 here, with argparse's message
    name = " ".join(["tierkv", args.command] + ([args.config_command] if args.command == "config" else []))
    try:
        return args.handler(args)
    except (UsageError, ConfigError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # a failure while running: reported, exit 1
        if args.traceback:
            traceback.print_exc()
        print(f"{name}: error: {redact_text(f'{type(exc).__name__}: {exc}')}", file=sys.stderr)
        return 1
