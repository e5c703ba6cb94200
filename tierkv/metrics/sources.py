"""Where a viewer (`tierkv dashboard`, `tierkv top`) reads snapshot lines from.

Primitives: `JsonlSource`, `EndpointSource`, `RecorderSource`, `SourceError`, `open_source`.

Each has `lines_since(n) -> (lines, next_n)`: the lines numbered n and later, and the number to
ask from next time (`[], n` when nothing is new). Numbers are the source's own:

    JsonlSource     line index in the file; re-reads only what was appended (a running recorder)
    EndpointSource  a running TieredLLM's metrics server, GET {url}/api/snapshots?since=n
    RecorderSource  a MetricsRecorder in this process (what the metrics server itself serves)
"""
from __future__ import annotations

import errno
import http.client
import json
import math
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

from tierkv.metrics.regular_file import open_regular
from tierkv.metrics.snapshot import SCHEMA


class SourceError(RuntimeError):
    """A source cannot be read: missing or malformed file, unreachable or wrong endpoint."""


class JsonlSource:
    """A JSONL file another process may write (and another user share): opened anew at each poll, never through
    a symbolic link and only as a regular file (a FIFO or device swapped in is refused, not waited on or read
    without end); at most READ_BYTES read per poll and the last KEEP_LINES lines kept; a line longer than
    MAX_LINE_BYTES is skipped with an error; a file cut shorter than what was read (rewritten) is read again
    from its start."""

    READ_BYTES = 8 << 20
    MAX_LINE_BYTES = 1 << 20
    KEEP_LINES = 100_000

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            what = "a directory" if self.path.is_dir() else "no such file" if not self.path.exists() else "not a file"
            raise SourceError(f"{self.path}: {what} (expected a JSONL written by a tierkv metrics recorder)")
        self.description = str(self.path)
        self._lines: list[dict] = []
        self._first = 0  # the number of self._lines[0] (older ones dropped past KEEP_LINES)
        self._offset = 0
        self._skipping = False  # inside a line longer than MAX_LINE_BYTES: up to its newline is dropped
        self._lock = threading.Lock()

    def _read_chunk(self) -> bytes:
        try:
            fd = open_regular(self.path, os.O_RDONLY)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise SourceError(f"{self.path}: not a regular file any more (expected a JSONL written by a tierkv "
                                  "metrics recorder)") from None
            raise SourceError(f"{self.path}: cannot read ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if info.st_size < self._offset:  # cut shorter or rewritten: its lines are new
                self._offset, self._skipping = 0, False
                self._first, self._lines = self._first + len(self._lines), []
            f.seek(self._offset)
            return f.read(self.READ_BYTES)

    def _read_new(self) -> None:
        data = self._read_chunk()
        if self._skipping:
            cut = data.find(b"\n")
            self._offset += len(data) if cut < 0 else cut + 1
            if cut < 0:
                return
            self._skipping, data = False, data[cut + 1 :]
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        if end == 0 and len(data) >= self.MAX_LINE_BYTES:
            self._offset += len(data)
            self._skipping = True
            raise SourceError(f"{self.path}: a line longer than {self.MAX_LINE_BYTES} bytes (skipped)")
        read = 0
        for raw in data[:end].splitlines(keepends=True):
            read += len(raw)
            if raw.strip():
                try:
                    self._lines.append(parse_line(raw, f"{self.path}:{self._first + len(self._lines) + 1}"))
                except SourceError:
                    self._offset += read  # said once: the next read goes on after it (it re-read, and re-added,
                    raise                 # every line before it at each poll, for good)
        self._offset += end
        if len(self._lines) > self.KEEP_LINES:
            dropped = len(self._lines) - self.KEEP_LINES
            self._first, self._lines = self._first + dropped, self._lines[dropped:]

    def read_to_end(self, on_error: Callable[[SourceError], None]) -> list[dict]:
        """Every line up to the file's end (the last KEEP_LINES kept), read past bad lines (each reported to
        `on_error` once): for one-shot readers (a report, `top --once`), which one poll's READ_BYTES would cut off,
        and which one torn line (a run killed mid-write) would stop."""
        while True:
            before = self._offset
            try:
                self.lines_since(0)
            except SourceError as exc:
                on_error(exc)
            if self._offset == before:
                with self._lock:
                    return list(self._lines)

    def lines_since(self, n: int) -> tuple[list[dict], int]:
        """Lines numbered n and later (from the oldest kept when n is older; from the start of a rewritten file
        when n is past what it holds)."""
        with self._lock:
            self._read_new()
            total = self._first + len(self._lines)
            if n > total:
                n = self._first
            return self._lines[max(n - self._first, 0) :], total


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


def within_deadline(timeout_s: float, exchange, late: str):
    """exchange() run to its end within `timeout_s` in all (urllib's timeout bounds each socket read only: a server
    sending a byte a second would hold the caller for ever); RuntimeError(`late`) past it (the exchange's daemon
    thread is left to its socket timeout)."""
    result: dict = {}

    def run():
        try:
            result["value"] = exchange()
        except BaseException as exc:  # (raised again in the caller's thread)
            result["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RuntimeError(late)
    if "error" in result:
        raise result["error"]
    return result["value"]


class EndpointSource:
    MAX_REPLY_BYTES = 64 << 20  # a poll's reply holds the new snapshot lines: some KiB each

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

    def _fetch(self, url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
            return response.read(self.MAX_REPLY_BYTES + 1)

    def lines_since(self, n: int) -> tuple[list[dict], int]:
        with self._lock:
            url = f"{self.url}/api/snapshots?since={self._remote_next}"
            try:
                reply = within_deadline(4 * self.timeout_s, lambda: self._fetch(url), "no complete reply within "
                                        f"{4 * self.timeout_s:g} s")
                if len(reply) > self.MAX_REPLY_BYTES:
                    raise ValueError(f"a reply over {self.MAX_REPLY_BYTES} bytes")
                body = json.loads(reply)
            except (urllib.error.URLError, OSError, ValueError, RecursionError, RuntimeError,
                    http.client.HTTPException) as exc:
                raise SourceError(f"{url}: {getattr(exc, 'reason', None) or type(exc).__name__ + ': ' + str(exc)}") from None
            if (not isinstance(body, dict) or not isinstance(body.get("lines"), list)
                    or isinstance(body.get("next"), bool) or not isinstance(body.get("next"), int)):
                raise SourceError(f"{url}: not a tierkv metrics endpoint (no list 'lines' and integer 'next' in the "
                                  "reply)")
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


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_line(raw: bytes | str, where: str) -> dict:
    try:
        line = json.loads(raw, parse_constant=_no_constant)  # NaN and Infinity: the page's JSON.parse refuses them
    except ValueError as exc:
        raise SourceError(f"{where}: not JSON ({exc})") from None
    except RecursionError:
        raise SourceError(f"{where}: JSON nested too deep for a metrics snapshot") from None
    return check_line(line, where)


def check_line(line: object, where: str) -> dict:
    if not isinstance(line, dict) or line.get("schema") != SCHEMA:
        found = line.get("schema") if isinstance(line, dict) else type(line).__name__
        raise SourceError(f"{where}: not a tierkv metrics snapshot (schema {found!r}, expected {SCHEMA!r})")
    for key, kinds, what in _REQUIRED:
        if not isinstance(line.get(key), kinds) or isinstance(line.get(key), bool):
            raise SourceError(f"{where}: '{key}' is {line.get(key)!r}; {what}")
    if not (0 <= line["t"] < MAX_T and 0 <= line["elapsed_s"] < MAX_T):
        raise SourceError(f"{where}: 't' {line['t']!r:.40} or 'elapsed_s' {line['elapsed_s']!r:.40} out of range")
    for key in ("figures", "rates"):
        for name, value in line[key].items():
            if not _is_number_or_null(value):
                raise SourceError(f"{where}: {key}[{name!r:.80}] is {value!r:.80}; a number or null")
    _check_request(line.get("request"), where)
    _check_latency(line.get("latency"), where)
    _check_prefetch(line, where)
    return line


MAX_T = 1e11  # seconds: the year 5138, past any clock; a date past it stopped the page drawing
MAX_NUMBER = 2.0**1000  # past float's range a viewer's float() raised


def _is_number_or_null(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and abs(value) < MAX_NUMBER and not (isinstance(value, float) and math.isnan(value)))


def _numbers(value) -> bool:
    return isinstance(value, list) and all(_is_number_or_null(v) and v is not None for v in value)


def _check_latency(latency, where: str) -> None:
    """The latency histograms a viewer reads: {name: {buckets_s, counts, sum_s, count}}."""
    if latency is None:
        return
    if not isinstance(latency, dict):
        raise SourceError(f"{where}: 'latency' is {latency!r:.80}; an object of histograms")
    for name, h in latency.items():
        if not (isinstance(h, dict) and _numbers(h.get("buckets_s")) and _numbers(h.get("counts"))
                and _is_number_or_null(h.get("sum_s")) and _is_number_or_null(h.get("count"))
                and h.get("sum_s") is not None and h.get("count") is not None
                and len(h["counts"]) in (len(h["buckets_s"]), len(h["buckets_s"]) + 1)):
            raise SourceError(f"{where}: latency[{name!r:.80}] is {h!r:.80}; an object of buckets_s, counts (numbers), "
                              "sum_s and count")


_PREFETCH_FIELDS = {"prefetch_layers": ("chunks", "late_chunks", "wait_s"),
                    "prefetch_chunks": ("n", "t", "layer", "is_late", "wait_s")}


def _check_prefetch(line: dict, where: str) -> None:
    """The prefetch detail a viewer's timeline reads: lists of numbers or nulls (a wait not timed) of one length."""
    for key, fields in _PREFETCH_FIELDS.items():
        detail = line.get(key)
        if detail is None:
            continue
        lists = [detail.get(f) for f in fields] if isinstance(detail, dict) else [None]
        ok = all(isinstance(v, list) and all(isinstance(x, bool) or _is_number_or_null(x) for x in v) for v in lists)
        if not ok or len({len(v) for v in lists}) > 1:
            raise SourceError(f"{where}: '{key}' is {detail!r:.80}; an object of equal-length lists "
                              f"{', '.join(fields)}")


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
