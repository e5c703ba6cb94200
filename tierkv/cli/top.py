"""`tierkv top`: a live terminal view of the same figures as the dashboard.

    tierkv top --endpoint http://127.0.0.1:9400     a running TieredLLM (metrics.prometheus_port)
    tierkv top --jsonl run.jsonl [--once]           a recorded or growing JSONL file

Redraws every --interval seconds until Ctrl-C; --once prints one frame and exits. The frame
fits the terminal's width (COLUMNS, else 120 when not a terminal): the tier table keeps the
columns that fit, most useful first, and the other lines wrap between words (drawn with rich).
"""
from __future__ import annotations

import io
import shutil
import sys
import time

from tierkv.metrics.snapshot import histogram_quantile, tier_names
from tierkv.metrics.sources import shown
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
    from tierkv.cli.errors import UsageError, check_endpoint, check_positive
    from tierkv.metrics.sources import EndpointSource, JsonlSource, SourceError

    check_positive("--interval", args.interval)  # nan too: time.sleep(nan) fails after the first frame
    if args.endpoint is not None:
        check_endpoint("--endpoint", args.endpoint)
    try:
        source = JsonlSource(args.jsonl) if args.jsonl else EndpointSource(args.endpoint, keep_lines=1)
    except SourceError as exc:
        raise UsageError(str(exc)) from None
    if args.once and args.jsonl:
        return _once_from_file(source)
    lines: list[dict] = []
    next_n = 0
    last_answer_t = time.monotonic()
    try:
        while True:
            failure = None  # an endpoint that stopped answering: said above the last frame, with its age
            try:
                new, next_n = source.lines_since(next_n)
                last_answer_t = time.monotonic()
            except SourceError as exc:
                if args.jsonl:  # a bad line (a run killed mid-write): said, and read past at the next poll
                    print(f"tierkv top: skipped: {shown(exc)}", file=sys.stderr)
                elif args.once or not lines:  # an endpoint that does not answer: a failure at run time
                    print(f"tierkv top: error: {shown(exc)}", file=sys.stderr)
                    return 1
                else:
                    failure = (f"tierkv top: error: {shown(exc)}\n"
                               f"(the figures below are {time.monotonic() - last_answer_t:.0f} s old)")
                    print(failure.replace("\n", " "), file=sys.stderr)
                new = []
            lines = (lines + new)[-1:]  # only the newest is drawn
            if args.once:
                if not lines:
                    print(f"tierkv top: no snapshots in {source.description} yet", file=sys.stderr)
                    return 1
                print(render(lines[-1], source.description, width=terminal_width()))
                return 0
            frame = (render(lines[-1], source.description, width=terminal_width()) if lines
                     else f"waiting for snapshots from {source.description}")
            if failure is not None:
                frame = failure + "\n\n" + frame
            sys.stdout.write((CLEAR if sys.stdout.isatty() else "") + frame + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _once_from_file(source) -> int:
    """`--once --jsonl`: the newest snapshot of the whole file (read to its end, past bad lines, each said); exit 2
    when it holds none and had bad lines (not metrics), 1 when it holds none yet."""
    errors: list[Exception] = []
    lines = source.read_to_end(errors.append)
    for exc in errors:
        print(f"tierkv top: {'skipped' if lines else 'error'}: {shown(exc)}", file=sys.stderr)
    if not lines:
        if not errors:
            print(f"tierkv top: no snapshots in {source.description} yet", file=sys.stderr)
        return 2 if errors else 1
    print(render(lines[-1], source.description, width=terminal_width()))
    return 0


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _bytes(value) -> str:
    return "-" if value is None else format_bytes(value)


def _rate(value) -> str:
    return "-" if value is None else format_bytes(value) + "/s"


def _num(value) -> str:
    return "-" if value is None else str(value)


def terminal_width() -> int:
    return shutil.get_terminal_size((120, 24)).columns


# tier table columns in display order: (header, cell of (tier name, figures, rates, p50 of get))
TIER_COLUMNS = (
    ("tier", lambda name, f, r, p50: name),
    ("hit rate", lambda name, f, r, p50: _pct(f.get(f"tier.{name}.hit_rate"))),
    ("interval", lambda name, f, r, p50: _pct(r.get(f"tier.{name}.hit_rate_interval"))),
    ("lookups", lambda name, f, r, p50: _num(f.get(f"tier.{name}.lookups"))),
    ("hits", lambda name, f, r, p50: _num(f.get(f"tier.{name}.hits"))),
    ("misses", lambda name, f, r, p50: _num(f.get(f"tier.{name}.misses"))),
    ("read", lambda name, f, r, p50: _bytes(f.get(f"tier.{name}.bytes_read"))),
    ("written", lambda name, f, r, p50: _bytes(f.get(f"tier.{name}.bytes_written"))),
    ("read/s", lambda name, f, r, p50: _rate(r.get(f"tier.{name}.bytes_read_per_s"))),
    ("written/s", lambda name, f, r, p50: _rate(r.get(f"tier.{name}.bytes_written_per_s"))),
    ("get p50", lambda name, f, r, p50: "-" if p50 is None else f"<={p50 * 1e3:g}ms"),
)
# which columns a narrow terminal keeps: most useful first
COLUMN_PRIORITY = ("tier", "hit rate", "lookups", "hits", "misses", "read", "written", "interval", "get p50",
                   "read/s", "written/s")


def _tier_table(line: dict, width: int):
    """The per-tier table, one line per tier: the columns that fit `width`, taken in COLUMN_PRIORITY
    order and shown in TIER_COLUMNS order."""
    from rich.table import Table

    f, r = line["figures"], line["rates"]
    rows = []
    for name in tier_names(f):
        get = line.get("latency", {}).get(f"{name}.get")
        p50 = histogram_quantile(get, 0.5) if get else None
        rows.append([cell(name, f, r, p50) for _, cell in TIER_COLUMNS])
    kept, used = [], 0
    headers = [header for header, _ in TIER_COLUMNS]
    for header in COLUMN_PRIORITY:
        i = headers.index(header)
        column_width = max([len(header)] + [len(row[i]) for row in rows]) + 2  # one space of padding each side
        if used + column_width > width:
            break  # a narrower, less useful column does not take the place of this one
        kept.append(i)
        used += column_width
    kept.sort()
    table = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 1))
    for i in kept:
        table.add_column(TIER_COLUMNS[i][0], justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(row[i] for i in kept))
    return table


def render(line: dict, description: str, *, width: int = 120) -> str:
    """One frame no wider than `width`: per-tier table, GPU memory, transfers, scheduler, prefetch, requests."""
    from rich.console import Console

    f, r = line["figures"], line["rates"]
    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False, emoji=False,
                      markup=False, soft_wrap=False)
    say = lambda text: console.print(text, overflow="fold")  # noqa: E731 - wraps between words, folds a long word
    say(f"tierkv top - {description} - run {line['run_id']}, {line['elapsed_s']:.1f} s, "
        f"snapshot {line['seq']} ({line['kind']})")
    console.print()
    console.print(_tier_table(line, width))
    console.print()
    stall_s = f.get("prefetch.stall_s")
    for text in (
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
    ):
        say(text)
    frame = "\n".join(row.rstrip() for row in console.file.getvalue().rstrip("\n").split("\n"))
    return shown(frame, keep="\n")  # names and ids from a shared JSONL or a server never reach the terminal as escapes
