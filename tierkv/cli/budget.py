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

from tierkv.metrics.http_deadline import HttpReply, exchange
from tierkv.metrics.sources import shown

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


def _body(reply: HttpReply, url: str) -> bytes:
    if len(reply.body) > _MAX_REPLY_BYTES:
        raise RuntimeError(f"not a tierkv endpoint: {url} (a reply over {_MAX_REPLY_BYTES} bytes)")
    return reply.body


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


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float, endpoint: str) -> HttpReply:
    """POST to the endpoint itself (no proxy from the environment, no redirect followed), within `timeout_s` in all:
    the socket carries the deadline, so nothing (no thread, no socket) is left behind when a server trickles."""
    try:
        return exchange("POST", url, body=body, headers=headers, timeout_s=timeout_s, total_s=timeout_s,
                        max_body_bytes=_MAX_REPLY_BYTES)
    except TimeoutError:
        raise RuntimeError(f"{url}: no complete reply within --timeout {timeout_s:g} s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise RuntimeError(f"cannot reach {endpoint}: {_shown(exc)}") from None


def _refused(reply: HttpReply, url: str, size: str, token_from: str | None) -> None:
    """The error for a reply that is not a 2xx: UsageError for what the user can change (the token, the size).
    token_from: where the token sent came from (--token or the variable), None when none was sent."""
    from tierkv.cli.errors import UsageError

    code = reply.status
    if 300 <= code < 400:  # followed, the Authorization header would go to the new host
        raise RuntimeError(f"{url}: HTTP {code}, a redirect to {_shown(repr(reply.headers.get('Location')))}, not "
                           "followed (the token would go with it): give the metrics server's own address")
    raw = _body(reply, url)
    try:
        detail = _shown(_reply(raw, url).get("error", reply.reason))
    except RuntimeError:  # an error page that is not JSON: a 401 (a proxy's, say) still asks for the token
        if code != 401:
            raise
        detail = _shown(reply.reason)
    if code == 401 and token_from is not None:  # sent and refused: a wrong token, not a missing one
        raise UsageError(f"{url}: the endpoint refused the token from {token_from}: it is not the server's "
                         f"metrics.control_token ({detail})")
    if code == 401:
        raise UsageError(f"{url}: the endpoint needs its token: pass --token or set {TOKEN_ENV} ({detail})")
    if code in (400, 409):
        raise UsageError(f"the endpoint refused {size}: {detail}")
    raise RuntimeError(f"{url}: HTTP {code}: {detail}")


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
    reply = _post(url, json.dumps({"budget": num_bytes}).encode(), headers, args.timeout, args.endpoint)
    if not 200 <= reply.status < 300:
        _refused(reply, url, args.size, (None if not token else "--token" if args.token is not None else TOKEN_ENV))
    body = _reply(_body(reply, url), url)
    if reply.status == 202:  # not applied yet: pending, not failed
        print(f"GPU KV budget change to {args.size} ({num_bytes} bytes) is pending: {_shown(body.get('pending', ''))}")
        return 0
    print(f"GPU KV budget set to {args.size} ({num_bytes} bytes)")
    return 0
