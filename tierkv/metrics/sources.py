"""Where a viewer (`tierkv dashboard`, `tierkv top`) reads snapshot lines from.

Primitives: `JsonlSource`, `EndpointSource`, `RecorderSource`, `SourceError`, `open_source`, `shown` (what a line
must be: `tierkv.metrics.snapshot_lines`; an endpoint's HTTP exchange: `tierkv.metrics.http_deadline`).

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
import os
import threading
import unicodedata
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Callable

from tierkv.metrics.http_deadline import exchange
from tierkv.metrics.regular_file import open_regular
from tierkv.metrics.snapshot_lines import SourceError, check_line, parse_line  # noqa: F401 (also names of this module)


# Not shown as they are on a terminal: controls (escape sequences), format characters (U+202E and the other bidi
# controls reorder what follows), line and paragraph separators, and lone surrogates (print() raises on them).
_UNSHOWN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def shown(text: object, *, keep: str = "") -> str:
    """`text` (a server's or a shared file's words) safe to print: each character of _UNSHOWN_CATEGORIES
    but those in `keep` (e.g. "\n" for a whole frame) as '?'."""
    text = str(text)
    if text.isprintable():  # the common case; isprintable() is False for every category above
        return text
    return "".join("?" if ch not in keep and unicodedata.category(ch) in _UNSHOWN_CATEGORIES else ch for ch in text)


def _newest(first: int, lines: list, keep: int) -> tuple[int, list]:
    """(number of the first line kept, the lines kept): the newest `keep` of `lines`, numbered from `first`."""
    dropped = max(0, len(lines) - keep)
    return (first + dropped, lines[dropped:]) if dropped else (first, lines)


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
        self._line_number = 0  # of the file's last line read past (blank and bad ones too): named in errors
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
            try:  # opened, then refused (EIO from /proc/self/mem, a disk error): named, as a failed open is
                info = os.fstat(fd)
                if info.st_size < self._offset:  # cut shorter or rewritten: its lines are new
                    self._offset, self._skipping, self._line_number = 0, False, 0
                    self._first, self._lines = self._first + len(self._lines), []
                f.seek(self._offset)
                return f.read(self.READ_BYTES)
            except OSError as exc:
                raise SourceError(f"{self.path}: cannot read ({exc.strerror or exc})") from None

    def _read_new(self) -> None:
        data = self._read_chunk()
        if self._skipping:
            cut = data.find(b"\n")
            self._offset += len(data) if cut < 0 else cut + 1
            if cut < 0:
                return
            self._skipping, data = False, data[cut + 1 :]
            self._line_number += 1
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        if end == 0 and len(data) > self.MAX_LINE_BYTES:
            self._offset += len(data)
            self._skipping = True
            raise self._too_long()
        read = 0
        for raw in data[:end].split(b"\n")[:-1]:  # the lines as the file numbers them ("\r" is no line end)
            read += len(raw) + 1
            self._line_number += 1
            if len(raw.rstrip(b"\r")) > self.MAX_LINE_BYTES:  # whole in this read: skipped all the same, unparsed
                self._offset += read
                raise self._too_long()
            if raw.strip():
                try:
                    self._lines.append(parse_line(raw, f"{self.path}:{self._line_number}"))
                except SourceError:
                    self._offset += read  # said once: the next read goes on after it (it re-read, and re-added,
                    raise                 # every line before it at each poll, for good)
        self._offset += end
        self._first, self._lines = _newest(self._first, self._lines, self.KEEP_LINES)

    def _too_long(self) -> SourceError:
        return SourceError(f"{self.path}: a line longer than {self.MAX_LINE_BYTES} bytes (skipped; the file's line "
                           f"{self._line_number + 1 if self._skipping else self._line_number})")

    def read_to_end(self, on_error: Callable[[SourceError], None]) -> list[dict]:
        """Every line up to the file's end (the last KEEP_LINES kept), read past bad lines (each reported to
        `on_error` once): for one-shot readers (a report, `top --once`), which one poll's READ_BYTES would cut off,
        and which one torn line (a run killed mid-write) would stop."""
        while True:
            before = self._offset
            try:
                with self._lock:
                    self._read_new()
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


class EndpointSource:
    """A running TieredLLM's metrics server, polled for the lines after the last it sent; the last KEEP_LINES kept
    (a viewer left open polls for days). Whatever the server says in an error reaches the caller through `shown`."""

    MAX_REPLY_BYTES = 64 << 20  # a poll's reply holds the new snapshot lines: some KiB each
    KEEP_LINES = JsonlSource.KEEP_LINES
    MAX_DETAIL_CHARS = 300  # of a server's words in an error (a reason phrase, a status line)

    def __init__(self, url: str, *, timeout_s: float = 2.0, keep_lines: int | None = None):
        """`keep_lines`: how many of the newest lines to keep (None: KEEP_LINES; `top` draws only the newest)."""
        problem = endpoint_problem(url)
        if problem:
            raise SourceError(f"endpoint: got {url!r}; {problem}")
        self.url = url.rstrip("/")
        self.description = self.url
        self.timeout_s = timeout_s
        self.keep_lines = self.KEEP_LINES if keep_lines is None else keep_lines
        self._lines: list[dict] = []
        self._first = 0  # the number of self._lines[0] (older ones dropped past keep_lines)
        self._remote_next = 0
        self._lock = threading.Lock()

    def _fetch(self, url: str) -> bytes:
        """The body of GET `url`, within 4 * timeout_s in all (`http_deadline.exchange`: each connect, send and read
        waits at most timeout_s, and none starts past the deadline), so a server trickling a byte a second ends the
        poll with a TimeoutError and leaves no thread or socket behind."""
        reply = exchange("GET", url, timeout_s=self.timeout_s, total_s=4 * self.timeout_s,
                         max_body_bytes=self.MAX_REPLY_BYTES)
        if reply.status != 200:
            raise urllib.error.HTTPError(url, reply.status, reply.reason, reply.headers, None)
        return reply.body

    def lines_since(self, n: int) -> tuple[list[dict], int]:
        with self._lock:
            url = f"{self.url}/api/snapshots?since={self._remote_next}"
            try:
                reply = self._fetch(url)
                if len(reply) > self.MAX_REPLY_BYTES:
                    raise ValueError(f"a reply over {self.MAX_REPLY_BYTES} bytes")
                body = json.loads(reply)
            except (urllib.error.URLError, OSError, ValueError, RecursionError, RuntimeError,
                    http.client.HTTPException) as exc:
                # a reason phrase or a bad status line is the server's: no escape sequence of it reaches a terminal
                detail = getattr(exc, "reason", None) or type(exc).__name__ + ": " + str(exc)
                raise SourceError(f"{url}: {shown(detail)[:self.MAX_DETAIL_CHARS]}") from None
            if (not isinstance(body, dict) or not isinstance(body.get("lines"), list)
                    or isinstance(body.get("next"), bool) or not isinstance(body.get("next"), int)):
                raise SourceError(f"{url}: not a tierkv metrics endpoint (no list 'lines' and integer 'next' in the "
                                  "reply)")
            # all checked before any is kept: a bad line kept those before it, fetched (and added) again each poll
            self._lines += [check_line(line, f"{url} line {i}") for i, line in enumerate(body["lines"])]
            self._remote_next = body["next"]
            self._first, self._lines = _newest(self._first, self._lines, self.keep_lines)
            return self._lines[max(n - self._first, 0) :], self._first + len(self._lines)


class RecorderSource:
    def __init__(self, recorder):
        self.recorder = recorder
        self.description = f"this process (run {recorder.run_id})"

    def lines_since(self, n: int) -> tuple[list[dict], int]:
        return self.recorder.lines_since(n)

    def encoded_lines_since(self, n: int, max_lines: int) -> tuple[list[bytes], int]:
        """The newest `max_lines` lines numbered >= n as compact JSON (served as they are, never decoded)."""
        return self.recorder.encoded_lines_since(n, max_lines)


def open_source(*, jsonl: str | None = None, endpoint: str | None = None):
    if (jsonl is None) == (endpoint is None):
        raise SourceError("give exactly one of a JSONL file or an endpoint URL")
    return JsonlSource(jsonl) if jsonl is not None else EndpointSource(endpoint)
