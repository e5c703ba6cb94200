"""The dashboard page: served (the browser polls for snapshots) or written as one static file.

Primitives: `live_page`, `live_page_csp`, `static_page`, `write_report`, `STATIC_DIR`, `STATIC_FILES`.

    static/index.html     the page; <!--TIERKV_HEAD--> and <!--TIERKV_SCRIPTS--> are filled here
    static/dashboard.js   reads snapshot lines, draws the charts and tables
    static/vendor/        uPlot (MIT), the charting library, unmodified
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from tierkv.metrics.regular_file import open_regular
from tierkv.metrics.sources import JsonlSource

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_FILES = {  # URL path under static/ -> (file, content type)
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "uPlot.min.css": ("vendor/uPlot.min.css", "text/css; charset=utf-8"),
}


def _fill(head: str, scripts: str) -> str:
    template = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    return template.replace("<!--TIERKV_HEAD-->", head).replace("<!--TIERKV_SCRIPTS-->", scripts)


def _config_script(config: dict) -> str:
    return f"<script>window.TIERKV = {_script_json(config)};</script>"


def _script_json(value: object) -> str:
    """JSON that is safe inside a script element: no "<" at all (it only occurs inside strings)."""
    return json.dumps(value, default=str).replace("<", "\\u003c")


def live_page_csp(*, poll_ms: int = 1000) -> str:
    """The Content-Security-Policy of `live_page`: its one inline script allowed by its hash, nothing else inline."""
    from tierkv.dashboard.guard import DEFAULT_CSP

    inline = _config_script({"mode": "live", "poll_ms": poll_ms})[len("<script>"):-len("</script>")]
    digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
    return DEFAULT_CSP.replace("script-src 'self'", f"script-src 'self' 'sha256-{digest}'")


def live_page(*, poll_ms: int = 1000) -> str:
    """The page as a server sends it: assets under static/, data from api/snapshots."""
    head = '<link rel="stylesheet" href="static/uPlot.min.css">\n<link rel="stylesheet" href="static/dashboard.css">'
    scripts = "\n".join([
        _config_script({"mode": "live", "poll_ms": poll_ms}),
        '<script src="static/uPlot.iife.min.js"></script>',
        '<script src="static/dashboard.js"></script>',
    ])
    return _fill(head, scripts)


def static_page(lines: list[dict], *, source: str = "") -> str:
    """One self-contained HTML file: styles, uPlot, the app and the data inlined."""
    def asset(name: str) -> str:
        return (STATIC_DIR / STATIC_FILES[name][0]).read_text(encoding="utf-8")

    head = f"<style>{asset('uPlot.min.css')}</style>\n<style>{asset('dashboard.css')}</style>"
    scripts = "\n".join([
        _config_script({"mode": "static", "source": source}),
        f'<script type="application/json" id="tierkv-data">{_script_json(lines)}</script>',
        f"<script>{asset('uPlot.iife.min.js')}</script>",
        f"<script>{asset('dashboard.js')}</script>",
    ])
    return _fill(head, scripts)


def write_report(jsonl_path: str | Path, out_path: str | Path, on_error=None) -> int:
    """Write the static report of a recorded JSONL file, read to its end past bad lines (each given to
    `on_error`; default: a warning on stderr); returns the number of snapshot lines."""
    lines = JsonlSource(jsonl_path).read_to_end(on_error or _warn)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_page(out, static_page(lines, source=f"recorded: {Path(jsonl_path).name}"))
    return len(lines)


def _warn(exc: Exception) -> None:
    import sys

    print(f"tierkv: skipped: {exc}", file=sys.stderr)


def write_page(path: str | Path, text: str) -> None:
    """Write a report page to `path`, never through a symbolic link planted there (a shared directory's other
    user would have the page written over a file of theirs choosing) and only over a regular file: OSError."""
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.truncate(0)
        f.write(text)
