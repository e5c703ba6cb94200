"""What a snapshot line a viewer reads must be (from a JSONL another process or user may write, or an endpoint):
the schema, numbers a viewer can draw (no NaN or Infinity, which the page's JSON.parse refuses; none past a
float), histograms, prefetch detail and request figures of the right shape. A line that is not gets a
`SourceError` naming where it was read.

Primitives: `SourceError`, `parse_line`, `check_line`.
"""
from __future__ import annotations

import json
import math

from tierkv.metrics.snapshot import SCHEMA


class SourceError(RuntimeError):
    """A source cannot be read: missing or malformed file, unreachable or wrong endpoint."""


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
