"""`tierkv dashboard`: serve the web dashboard, or write it as one static HTML file.

    tierkv dashboard --jsonl run.jsonl                  serve http://127.0.0.1:8050/ until Ctrl-C
    tierkv dashboard --endpoint http://127.0.0.1:9400   a running TieredLLM, through this server
    tierkv dashboard --jsonl run.jsonl --html run.html  write a self-contained report and exit
                                                        (refused when --html names the --jsonl file)

The server binds 127.0.0.1 unless --host says otherwise (it has no authentication: it only reads).
Requests must name --host (or, on loopback, localhost) in their Host header, which stops DNS rebinding.
"""
from __future__ import annotations

import os
import signal
import sys
import threading


def add_parser(commands) -> None:
    p = commands.add_parser("dashboard", help="serve the web dashboard or write it as HTML",
                            description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--jsonl", metavar="PATH", help="a metrics JSONL file (re-read as it grows)")
    source.add_argument("--endpoint", metavar="URL", help="a TieredLLM's metrics server, http://host:port")
    p.add_argument("--html", metavar="OUT", help="write a static HTML report to OUT and exit")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="port to listen on; 0 picks a free one (default 8050)")
    p.set_defaults(handler=run_dashboard)


def dashboard_server(source, host: str, port: int):
    """The live dashboard of `source` on host:port, behind the Host and Origin checks (a RunningServer)."""
    from tierkv.dashboard import dashboard_app, serve
    from tierkv.dashboard.guard import guarded

    return serve(guarded(dashboard_app(source), host), host, port)


def is_same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: the same path once links and '..' are resolved, or the same inode where
    both exist (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # one is missing (or not a path a file can have)
        return False


def refuse_same_file(out_flag: str, out: str, jsonl_flag: str, jsonl: str | os.PathLike) -> None:
    """UsageError (exit 2) naming both flags when the report written to `out` would overwrite the metrics JSONL."""
    from tierkv.cli.errors import UsageError

    if is_same_file(out, jsonl):
        raise UsageError(f"{out_flag} {out} and {jsonl_flag} {jsonl} are the same file: the HTML report would "
                         f"overwrite the metrics snapshots it is made from; write the report to another file")


def run_dashboard(args) -> int:
    from tierkv.cli.errors import UsageError, check_endpoint
    from tierkv.dashboard import static_page
    from tierkv.dashboard.page import write_page
    from tierkv.metrics.sources import SourceError, open_source

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port: got {args.port}; expected 0..65535")
    if args.endpoint is not None:
        check_endpoint("--endpoint", args.endpoint)
    if args.html and args.jsonl:  # before reading: the snapshots are still there to read after a refusal
        refuse_same_file("--html", args.html, "--jsonl", args.jsonl)
    try:
        source = open_source(jsonl=args.jsonl, endpoint=args.endpoint)
        if args.html:
            lines = (source.read_to_end(lambda exc: print(f"tierkv dashboard: skipped: {exc}", file=sys.stderr))
                     if args.jsonl else source.lines_since(0)[0])
    except SourceError as exc:
        raise UsageError(str(exc)) from None
    if args.html:
        if not lines:  # a file without one whole snapshot line (binary, empty, still being written)
            raise UsageError(f"{source.description}: no snapshot lines to report (expected a JSONL written by a tierkv "
                             "metrics recorder)")
        try:
            write_page(args.html, static_page(lines, source=source.description))
        except OSError as exc:
            raise UsageError(f"--html: cannot write {args.html}: {exc.strerror or exc}") from None
        print(f"tierkv dashboard: wrote {args.html} ({len(lines)} snapshots from {source.description})", file=sys.stderr)
        return 0
    try:
        server = dashboard_server(source, args.host, args.port)
    except OSError as exc:
        import errno
        import socket

        reason = exc.strerror or str(exc)
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {args.host}: not an address this machine can listen on ({reason})") from None
        if exc.errno == errno.EACCES:
            raise UsageError(f"--port {args.port}: not allowed to listen there ({reason})") from None
        raise RuntimeError(f"cannot listen on {args.host}:{args.port}: {reason}") from None
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"tierkv dashboard: {source.description} at {server.url}/ (Ctrl-C to stop)", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
