"""`tierkv budget`: resize a running TieredLLM's GPU KV budget through its metrics endpoint.

    TIERKV_CONTROL_TOKEN=... tierkv budget --endpoint http://127.0.0.1:9400 1GiB

The process must serve metrics (`metrics.prometheus_port`) with the control on
(`metrics.control_enabled` and a token); the token comes from --token or TIERKV_CONTROL_TOKEN.
The change takes effect between forward steps, and the command returns once it has (outputs do
not change), or says it is pending when the endpoint did not see it applied in time (HTTP 202: it applies
once the running requests allow, unless a later change replaces it). The URL is checked as `top` and `dashboard`
check theirs: http(s)://host:port, no scheme guessed.
"""
from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.request

from tierkv.metrics.sources import shown, within_deadline

TOKEN_ENV = "TIERKV_CONTROL_TOKEN"


def add_parser(commands) -> None:
    p = commands.add_parser("budget", help="resize a running TieredLLM's GPU KV budget",
                            description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", metavar="URL", required=True, help="a TieredLLM's metrics server, http://host:port")
    p.add_argument("size", help="the new GPU KV budget: bytes or a size such as 1GiB")
    p.add_argument("--token", help=f"the control endpoint's bearer token (default: ${TOKEN_ENV})")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the change (default 120)")
    p.set_defaults(handler=run_budget)


_MAX_REPLY_BYTES = 64 << 10  # the endpoint's replies are a few hundred bytes


def _read_reply(response) -> bytes:
    raw = response.read(_MAX_REPLY_BYTES + 1)
    if len(raw) > _MAX_REPLY_BYTES:
        raise RuntimeError(f"not a tierkv endpoint: {response.geturl()} (a reply over {_MAX_REPLY_BYTES} bytes)")
    return raw


def _reply(raw: bytes, url: str) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RuntimeError(f"not a tierkv endpoint: {url} (its reply is not JSON: {exc})") from None
    if not isinstance(body, dict):
        raise RuntimeError(f"not a tierkv endpoint: {url} (its reply is not a JSON object)")
    return body


def _shown(text: object) -> str:
    """A server's words for the terminal (`metrics.sources.shown`: escape sequences, newlines, bidi controls as
    '?'), at most 300 characters."""
    return shown(text)[:300]


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: urllib would send the Authorization header to the new host, as a GET."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # urllib then raises the 3xx as an HTTPError


_OPENER = urllib.request.build_opener(_NoRedirects)


def _refused(exc: urllib.error.HTTPError, raw: bytes, url: str, size: str, token_from: str | None) -> None:
    """The error for an HTTP error reply: UsageError for what the user can change (the token, the size).
    token_from: where the token sent came from (--token or the variable), None when none was sent."""
    from tierkv.cli.errors import UsageError

    if 300 <= exc.code < 400:
        raise RuntimeError(f"{url}: HTTP {exc.code}, a redirect to {_shown(repr(exc.headers.get('Location')))}, not "
                           "followed (the token would go with it): give the metrics server's own address")
    try:
        detail = _shown(_reply(raw, url).get("error", exc.reason))
    except RuntimeError:  # an error page that is not JSON: a 401 (a proxy's, say) still asks for the token
        if exc.code != 401:
            raise
        detail = _shown(exc.reason)
    if exc.code == 401 and token_from is not None:  # sent and refused: a wrong token, not a missing one
        raise UsageError(f"{url}: the endpoint refused the token from {token_from}: it is not the server's "
                         f"metrics.control_token ({detail})")
    if exc.code == 401:
        raise UsageError(f"{url}: the endpoint needs its token: pass --token or set {TOKEN_ENV} ({detail})")
    if exc.code in (400, 409):
        raise UsageError(f"the endpoint refused {size}: {detail}")
    raise RuntimeError(f"{url}: HTTP {exc.code}: {detail}")


def _sendable_token(token: str, source: str) -> str:
    """The token as a header carries it: stripped at both ends (as the server reads it: a token file's CRLF),
    UsageError naming `source` when what is left cannot be sent (never the token itself)."""
    from tierkv.cli.errors import UsageError
    from tierkv.config.fields import control_token_problem

    token = token.strip()
    problem = control_token_problem(token)
    if problem is not None:
        raise UsageError(f"the control token from {source}: {problem}")
    return token


def run_budget(args) -> int:
    from tierkv.budget_change import parse_budget
    from tierkv.cli.errors import UsageError, check_endpoint, check_positive

    check_positive("--timeout", args.timeout)
    try:
        num_bytes = parse_budget(args.size)
    except ValueError as exc:
        raise UsageError(f"size: {exc}") from None
    url = f"{check_endpoint('--endpoint', args.endpoint).rstrip('/')}/api/gpu_budget"
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV)
    if token:
        token = _sendable_token(token, "--token" if args.token is not None else TOKEN_ENV)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=json.dumps({"budget": num_bytes}).encode(), headers=headers, method="POST")
    def exchange() -> tuple[int, bytes, urllib.error.HTTPError | None]:
        try:
            with _OPENER.open(request, timeout=args.timeout) as response:
                return response.status, _read_reply(response), None
        except urllib.error.HTTPError as exc:
            return exc.code, (b"" if 300 <= exc.code < 400 else _read_reply(exc)), exc

    try:
        status, raw, error = within_deadline(args.timeout, exchange, f"{url}: no complete reply within --timeout {args.timeout:g} s")
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise RuntimeError(f"cannot reach {args.endpoint}: {_shown(getattr(exc, 'reason', None) or exc)}") from None
    if error is None:
        reply = _reply(raw, url)
        if status == 202:  # not applied yet: pending, not failed
            print(f"GPU KV budget change to {args.size} ({num_bytes} bytes) is pending: "
                  f"{_shown(reply.get('pending', ''))}")
            return 0
    else:
        _refused(error, raw, url, args.size, (None if not token else "--token" if args.token is not None else TOKEN_ENV))
    print(f"GPU KV budget set to {args.size} ({num_bytes} bytes)")
    return 0
