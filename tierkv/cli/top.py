"""`tierkv top`: a live terminal view of the same figures as the dashboard.

    tierkv top --endpoint http://127.0.0.1:9400     a running TieredLLM (metrics.prometheus_port)
    tierkv top --jsonl run.jsonl [--once]           a recorded or growing JSONL file

Redraws every --interval seconds until Ctrl-C; --once prints one frame and exits.
"""
from __future__ import annotations

import sys
import time

from tierkv.metrics.snapshot import histogram_quantile, tier_names
from tierkv.units import format_bytes

CLEAR = "\x1b[H\x1b[2J"


def add_parser(commands) -> None:
    p = commands.add_parser("top", help="live terminal view of the figures", description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--endpoint", metavar="URL", help="a TieredLLM's metrics server, http://host:port")
    source.add_argument("--jsonl", metavar="PATH", help="a metrics JSONL file")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(handler=run_top)


def run_top(args) -> int:
    from tierkv.cli.errors import UsageError
    from tierkv.metrics.sources import EndpointSource, JsonlSource, SourceError

    if args.interval <= 0:
        raise UsageError(f"--interval: got {args.interval}; must be positive")
    try:
        source = JsonlSource(args.jsonl) if args.jsonl else EndpointSource(args.endpoint)
    except SourceError as exc:
        raise UsageError(str(exc)) from None
    lines: list[dict] = []
    next_n = 0
    try:
        while True:
            try:
                new, next_n = source.lines_since(next_n)
            except SourceError as exc:
                if args.once or not lines:
                    print(f"tierkv top: error: {exc}", file=sys.stderr)
                    return 1
                new = []
            lines.extend(new)
            if args.once:
                if not lines:
                    print(f"tierkv top: no snapshots in {source.description} yet", file=sys.stderr)
                    return 1
                print(render(lines[-1], source.description))
                return 0
            frame = render(lines[-1], source.description) if lines else f"waiting for snapshots from {source.description}"
            sys.stdout.write((CLEAR if sys.stdout.isatty() else "") + frame + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _bytes(value) -> str:
    return "-" if value is None else format_bytes(value)


def _rate(value) -> str:
    return "-" if value is None else format_bytes(value) + "/s"


def _num(value) -> str:
    return "-" if value is None else str(value)


def render(line: dict, description: str) -> str:
    """One frame: per-tier table, GPU memory, transfers, scheduler, prefetch, requests."""
    f, r = line["figures"], line["rates"]
    out = [f"tierkv top - {description} - run {line['run_id']}, {line['elapsed_s']:.1f} s, "
           f"snapshot {line['seq']} ({line['kind']})", ""]
    head = f"{'tier':<6} {'hit rate':>9} {'interval':>9} {'lookups':>9} {'hits':>9} {'misses':>9} " \
           f"{'read':>11} {'written':>11} {'read/s':>13} {'written/s':>13} {'get p50':>9}"
    out.append(head)
    for name in tier_names(f):
        get = line.get("latency", {}).get(f"{name}.get")
        p50 = histogram_quantile(get, 0.5) if get else None
        out.append(
            f"{name:<6} {_pct(f.get(f'tier.{name}.hit_rate')):>9} {_pct(r.get(f'tier.{name}.hit_rate_interval')):>9} "
            f"{_num(f.get(f'tier.{name}.lookups')):>9} {_num(f.get(f'tier.{name}.hits')):>9} "
            f"{_num(f.get(f'tier.{name}.misses')):>9} {_bytes(f.get(f'tier.{name}.bytes_read')):>11} "
            f"{_bytes(f.get(f'tier.{name}.bytes_written')):>11} {_rate(r.get(f'tier.{name}.bytes_read_per_s')):>13} "
            f"{_rate(r.get(f'tier.{name}.bytes_written_per_s')):>13} {'-' if p50 is None else f'<={p50 * 1e3:g}ms':>9}"
        )
    stall_s = f.get("prefetch.stall_s")
    out += [
        "",
        f"GPU KV    held {_bytes(f.get('gpu.held_bytes'))} (resident {_bytes(f.get('gpu.resident_bytes'))} + staging "
        f"{_bytes(f.get('gpu.staging_bytes'))}), budget {_bytes(f.get('gpu.budget_bytes'))}",
        f"PCIe      H2D {_bytes(f.get('transfer.h2d_bytes'))} ({_rate(r.get('transfer.h2d_bytes_per_s'))}), "
        f"D2H {_bytes(f.get('transfer.d2h_bytes'))} ({_rate(r.get('transfer.d2h_bytes_per_s'))})",
        f"scheduler chunks streamed {_num(f.get('scheduler.chunks_streamed'))}, late chunks (stalls) "
        f"{_num(f.get('scheduler.stalls'))} ({_num(r.get('scheduler.stalls_interval'))} in interval), stall time "
        f"{'not reported' if stall_s is None else f'{stall_s:.3f} s'}",
        f"prefetch  precision {_pct(f.get('prefetch.precision'))}, recall {_pct(f.get('prefetch.recall'))}"
        + (" (no predictor has reported: exact mode)" if f.get("prefetch.precision") is None else ""),
        f"chain     spilled {_num(f.get('chain.spilled'))}, promoted {_num(f.get('chain.promoted'))}, "
        f"dropped {_num(f.get('chain.dropped'))}",
        f"requests  {_num(f.get('requests.requests'))}: {_num(f.get('requests.prompt_tokens'))} prompt tokens "
        f"({_num(f.get('requests.prefix_tokens'))} reused), {_num(f.get('requests.generated_tokens'))} generated",
    ]
    return "\n".join(out)
