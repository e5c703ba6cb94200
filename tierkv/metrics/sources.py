"""Where a viewer (`tierkv dashboard`, `tierkv top`) reads snapshot lines from.

Primitives: `JsonlSource`, `EndpointSource`, `RecorderSource`, `SourceError`, `open_source`.

Each has `lines_since(n) -> (lines, next_n)`: the lines numbered n and later, and the number to
ask from next time (`[], n` when nothing is new). Numbers are the source's own:

    JsonlSource     line index in the file; re-reads only what was appended (a running recorder)
    EndpointSource  a running TieredLLM's metrics server, GET {url}/api/snapshots?since=n
    RecorderSource  a MetricsRecorder in this process (what the metrics server itself serves)
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from tierkv.metrics.snapshot import SCHEMA


class SourceError(RuntimeError):
    """A source cannot be read: missing or malformed file, unreachable or wrong endpoint."""


class JsonlSource:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            what = "a directory" if self.path.is_dir() else "no such file" if not self.path.exists() else "not a file"
            raise SourceError(f"{self.path}: {what} (expected a JSONL written by a tierkv metrics recorder)")
        self.description = str(self.path)
        self._lines: list[dict] = []
        self._offset = 0
        self._lock = threading.Lock()

    def _read_new(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError as exc:
            raise SourceError(f"{self.path}: cannot read ({exc.strerror})") from None
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        read = 0
        for raw in data[:end].splitlines(keepends=True):
            read += len(raw)
            if raw.strip():
                try:
                    self._lines.append(parse_line(raw, f"{self.path}:{len(self._lines) + 1}"))
                except SourceError:
                    self._offset += read  # said once: the next read goes on after it (it re-read, and re-added,
                    raise                 # every line before it at each poll, for good)
        self._offset += end

    def lines_since(self, n: int) -> tuple[list[dict], int]:
        with self._lock:
            self._read_new()
            return self._lines[n:], len(self._lines)


def endpoint_problem(url: str) -> str | None:
    """Why `url` is not http(s)://host[:port] (a malformed IPv6 host, a port that is not a number in
    1..65535, no host), or None."""
    if not url.startswith(("http://", "https://")):
        return "expected http://host:port of a TieredLLM's metrics server"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # ValueError for a port that is not a number in 0..65535
    except ValueError as exc:
        return f"not a URL ({exc})"
    if not parts.hostname:
        return "no host in it; expected http://host:port"
    if port == 0:
        return "port 0; expected a port in 1..65535"
    return None


class EndpointSource:
    def __init__(self, url: str, *, timeout_s: float = 2.0):
        problem = endpoint_problem(url)
        if problem:
            raise SourceError(f"endpoint: got {url!r}; {problem}")
        self.url = url.rstrip("/")
        self.description = self.url
        self.timeout_s = timeout_s
        self._lines: list[dict] = []
        self._remote_next = 0
        self._lock = threading.Lock()

    def lines_since(self, n: int) -> tuple[list[dict], int]:
        with self._lock:
            url = f"{self.url}/api/snapshots?since={self._remote_next}"
            try:
                with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                    body = json.loads(response.read())
            except (urllib.error.URLError, OSError, ValueError) as exc:
                raise SourceError(f"{url}: {getattr(exc, 'reason', exc)}") from None
            if not isinstance(body, dict) or "lines" not in body or "next" not in body:
                raise SourceError(f"{url}: not a tierkv metrics endpoint (no 'lines' and 'next' in the reply)")
            for i, line in enumerate(body["lines"]):
                self._lines.append(check_line(line, f"{url} line {i}"))
            self._remote_next = body["next"]
            return self._lines[n:], len(self._lines)


class RecorderSource:
    def __init__(self, recorder):
        self.recorder = recorder
        self.description = f"this process (run {recorder.run_id})"

    def lines_since(self, n: int) -> tuple[list[dict], int]:
        return self.recorder.lines_since(n)


def open_source(*, jsonl: str | None = None, endpoint: str | None = None):
    if (jsonl is None) == (endpoint is None):
        raise SourceError("give exactly one of a JSONL file or an endpoint URL")
    return JsonlSource(jsonl) if jsonl is not None else EndpointSource(endpoint)


def parse_line(raw: bytes | str, where: str) -> dict:
    try:
        line = json.loads(raw)
    except ValueError as exc:
        raise SourceError(f"{where}: not JSON ({exc})") from None
    return check_line(line, where)


def check_line(line: object, where: str) -> dict:
    if not isinstance(line, dict) or line.get("schema") != SCHEMA:
        found = line.get("schema") if isinstance(line, dict) else type(line).__name__
        raise SourceError(f"{where}: not a tierkv metrics snapshot (schema {found!r}, expected {SCHEMA!r})")
    for key, kinds, what in _REQUIRED:
        if not isinstance(line.get(key), kinds) or isinstance(line.get(key), bool):
            raise SourceError(f"{where}: '{key}' is {line.get(key)!r}; {what}")
    for key in ("figures", "rates"):
        for name, value in line[key].items():
            if not _is_number_or_null(value):
                raise SourceError(f"{where}: {key}[{name!r}] is {value!r}; a number or null")
    _check_request(line.get("request"), where)
    return line


def _is_number_or_null(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


_REQUEST_NUMBERS = ("prompt_tokens", "prefix_tokens", "prefill_s", "decode_s", "generated_tokens", "gpu_hit_rate",
                    "h2d_bytes", "d2h_bytes", "stalls")  # what the dashboard's request table shows


def _check_request(request, where: str) -> None:
    """A request line's figures, as the dashboard's table reads them (a string there stopped the page drawing)."""
    if request is None:
        return
    if not isinstance(request, dict):
        raise SourceError(f"{where}: 'request' is {request!r:.80}; an object")
    for name in _REQUEST_NUMBERS:
        if not _is_number_or_null(request.get(name)):
            raise SourceError(f"{where}: request[{name!r}] is {request.get(name)!r:.80}; a number or null")
    by_tier = request.get("prefix_blocks_by_tier", {})
    if not isinstance(by_tier, dict) or not all(_is_number_or_null(v) for v in by_tier.values()):
        raise SourceError(f"{where}: request['prefix_blocks_by_tier'] is {by_tier!r:.80}; an object of tier to blocks")


_REQUIRED = (("run_id", str, "a string"), ("seq", int, "an integer"), ("kind", str, "a string"),
             ("t", (int, float), "a number (unix seconds)"), ("elapsed_s", (int, float), "a number of seconds"),
             ("figures", dict, "an object of dotted names to numbers"),
             ("rates", dict, "an object of dotted names to numbers"))
