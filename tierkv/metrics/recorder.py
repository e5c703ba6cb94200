"""`MetricsRecorder`: turns a `stats()` source into snapshot lines, kept in memory and in a JSONL file.

Primitives: `MetricsRecorder` (`measure`, `snapshot`, `record_request`, `lines_since`, `encoded_lines_since`,
`start`, `close`), `runtime_reads`.

    recorder = MetricsRecorder(llm.stats, jsonl_path="run.jsonl", live_reads=runtime_reads(llm.runtime))
    recorder.start(interval_s=1.0)          # a line every second, on a daemon thread
    recorder.record_request(out.stats)      # a line after each request, with its figures
    recorder.close()                        # a last line, then the file is closed

The line format is in `tierkv.metrics.snapshot`; the lines kept in memory are bounded in bytes
(`tierkv.metrics.history`, metrics.history_bytes). GPU block reads (tier "gpu") come from the
sequences themselves: `live_reads` returns (sequence id, its read_stats()) for the running
sequence; a sequence's last figures are folded into the totals when the next one starts.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Callable, Mapping

from tierkv.metrics.history import DEFAULT_HISTORY_BYTES, History
from tierkv.metrics.regular_file import open_regular
from tierkv.metrics.snapshot import SCHEMA, derive_rates, flatten_stats

logger = logging.getLogger(__name__)

LiveReads = Callable[[], "tuple[str, Mapping] | None"]


def runtime_reads(runtime) -> LiveReads:
    """`live_reads` for a KVRuntime: the running (or last) sequence's attention block reads."""

    def reads():
        seq = runtime.active
        return None if seq is None else (seq.seq_id, seq.read_stats())

    return reads


class MetricsRecorder:
    def __init__(self, source: Callable[[], Mapping], *, jsonl_path: str | Path | None = None,
                 history_bytes: int = DEFAULT_HISTORY_BYTES, history: int | None = None,
                 live_reads: LiveReads | None = None, clock: Callable[[], float] = time.time):
        """Keeps the latest lines, as compact JSON, within `history_bytes` (the newest line always)
        and, when given, `history` lines."""
        self._source = source
        self._live_reads = live_reads
        self._clock = clock
        self.run_id = uuid.uuid4().hex[:12]
        self.jsonl_path = Path(jsonl_path).expanduser() if jsonl_path is not None else None
        self._lock = threading.RLock()
        self._history = History(history_bytes, history)
        self._seq = 0
        self._previous: dict | None = None
        self._start_t = clock()
        self._reads_done = Counter()           # finished sequences: resident / streamed block reads
        self._reads_current: tuple[str, Counter] | None = None
        self._prefix_blocks: Counter = Counter()
        self._next_chunk_n = 0                 # prefetch chunks numbered below it are in a line already
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.sampling_errors: list[str] = []
        self.is_closed = False
        self._file = None
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = _open_for_appending(self.jsonl_path)

    # -- measuring -----------------------------------------------------------------------------
    def measure(self) -> tuple[dict, dict, dict, dict | None]:
        """(figures, latency, info, prefetch detail: see flatten_stats) now, without recording a line."""
        with self._lock:
            figures, latency, info, prefetch = flatten_stats(self._source())
            self._add_gpu_reads(figures)
            for tier, num_blocks in sorted(self._prefix_blocks.items()):
                figures[f"requests.prefix_blocks.{tier}"] = num_blocks
            return figures, latency, info, prefetch

    def _add_gpu_reads(self, figures: dict) -> None:
        live = self._live_reads() if self._live_reads is not None else None
        if live is not None:
            seq_id, read_stats = live
            if self._reads_current is not None and self._reads_current[0] != seq_id:
                self._reads_done += self._reads_current[1]
            current = Counter(resident=read_stats["resident_block_reads"], streamed=read_stats["streamed_block_reads"])
            self._reads_current = (seq_id, current)
        total = self._reads_done + (self._reads_current[1] if self._reads_current else Counter())
        if live is None and not total:
            return  # no sequence seen: no GPU figures rather than invented zeros
        hits, misses = total["resident"], total["streamed"]
        figures.update({"tier.gpu.lookups": hits + misses, "tier.gpu.hits": hits, "tier.gpu.misses": misses,
                        "tier.gpu.hit_rate": hits / (hits + misses) if hits + misses else None})

    # -- recording -----------------------------------------------------------------------------
    def snapshot(self, kind: str = "interval", request: Mapping | None = None) -> dict:
        """Measure, record one line (memory and file) and return it."""
        with self._lock:
            if self.is_closed:
                raise RuntimeError("the metrics recorder is closed")
            figures, latency, info, prefetch = self.measure()
            t = self._clock()
            line = {
                "schema": SCHEMA, "run_id": self.run_id, "seq": self._seq, "kind": kind,
                "t": t, "elapsed_s": t - self._start_t, "figures": figures,
                "rates": derive_rates(self._previous, figures, latency, t), "latency": latency, "info": info,
            }
            if request is not None:
                line["request"] = dict(request)
            if prefetch is not None:
                self._add_prefetch_detail(line, prefetch)
            self._seq += 1
            self._previous = line
            encoded = json.dumps(_finite(line), default=str, allow_nan=False)  # NaN/Infinity: null (JSON has neither)
            self._history.append(line["seq"], encoded.encode())
            if self._file is not None:
                self._file.write(encoded + "\n")
                self._file.flush()
            return line

    def _add_prefetch_detail(self, line: dict, detail: Mapping) -> None:
        """Per-layer totals, and the chunks consumed since the previous line (each line's are new)."""
        if "layers" in detail:
            line["prefetch_layers"] = detail["layers"]
        recent = detail.get("recent_chunks")
        if recent:
            new = [i for i, n in enumerate(recent["n"]) if n >= self._next_chunk_n]
            if new:
                line["prefetch_chunks"] = {key: [values[i] for i in new] for key, values in recent.items()}
                self._next_chunk_n = recent["n"][-1] + 1

    def record_request(self, request_stats: Mapping) -> dict:
        """One finished request: its figures go into the line, its prefix reuse into the totals."""
        with self._lock:
            for tier, num_blocks in request_stats.get("prefix_blocks_by_tier", {}).items():
                self._prefix_blocks[tier] += num_blocks
            return self.snapshot("request", request_stats)

    def lines_since(self, seq: int) -> tuple[list[dict], int]:
        """Lines numbered >= seq still in memory, and the number to ask from next time."""
        encoded, next_seq = self.encoded_lines_since(seq)
        return [json.loads(line) for line in encoded], next_seq  # decoded outside the lock the engine takes

    def encoded_lines_since(self, seq: int, max_lines: int | None = None) -> tuple[list[bytes], int]:
        """`lines_since` as compact JSON, only the newest `max_lines` when given. The lock is held only to copy
        references: a reader polling the whole history (MBs) never holds up `snapshot` (the engine) for long."""
        with self._lock:
            return self._history.encoded_since(seq, max_lines), self._seq

    @property
    def latest(self) -> dict | None:
        with self._lock:
            return self._history.latest()

    @property
    def history_bytes(self) -> int:
        """Bytes the kept lines take (their compact JSON)."""
        with self._lock:
            return self._history.num_bytes

    # -- sampling thread -----------------------------------------------------------------------
    def start(self, interval_s: float) -> None:
        """A line every `interval_s` seconds on a daemon thread, until `close()`."""
        if self._thread is not None:
            raise RuntimeError("the sampling thread is already running")
        self._thread = threading.Thread(target=self._sample, args=(interval_s,), name="tierkv-metrics", daemon=True)
        self._thread.start()

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.snapshot("interval")
            except Exception as exc:  # kept and logged; sampling goes on (the next line may succeed)
                message = f"{type(exc).__name__}: {exc}"
                self.sampling_errors.append(message)
                del self.sampling_errors[:-10]
                logger.warning("tierkv metrics: snapshot failed: %s", message)

    def close(self) -> None:
        """Stop sampling, record a last line, close the file. Safe to call twice."""
        if self.is_closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            try:
                self.snapshot("final")
            finally:
                self.is_closed = True
                if self._file is not None:
                    self._file.close()


def _open_for_appending(path: Path):
    """The JSONL opened to append: made private (0600) when new, never through a symbolic link (one put there
    would choose the file written to), never a FIFO or device. ValueError naming the path otherwise."""
    try:
        fd = open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)  # (read: its last byte)
    except OSError as exc:
        why = ("it is a symbolic link" if exc.errno == errno.ELOOP else
               "not a regular file" if exc.errno == errno.EINVAL else exc.strerror)
        raise ValueError(f"metrics.jsonl_path {str(path)!r}: cannot append to it ({why})") from None
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        os.write(fd, b"\n")  # a run killed mid-line left a torn tail: this run's lines start on a line of their own
    return os.fdopen(fd, "a", encoding="utf-8")


def _finite(value):
    """`value` with every non-finite float (a rate over no time) as None: a viewer's JSON.parse refuses NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
