"""What every response of tierkv's HTTP servers goes through: Host and Origin checks, security headers.

Primitives: `guarded(app, bind_host)`, `allowed_host_names`, `SECURITY_HEADERS`.

    Host    must name this server: the configured address, or (bound to loopback or to every
            address) localhost or an IP literal. A page whose DNS name was re-pointed at this
            machine (DNS rebinding) sends its own name: 421, so it can read nothing.
    Origin  when sent (browsers send it on cross-origin requests and on every POST), must be
            http(s)://<the request's Host>: a page elsewhere gets 403.
    headers X-Content-Type-Options nosniff, X-Frame-Options DENY, a Content-Security-Policy
            (an app's own, where it sets one, wins) and Referrer-Policy no-referrer, on every response.
"""
from __future__ import annotations

import ipaddress
import json
from typing import Callable, Iterable
from urllib.parse import urlsplit

WsgiApp = Callable[[dict, Callable], Iterable[bytes]]

DEFAULT_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Content-Security-Policy", DEFAULT_CSP),
)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def allowed_host_names(bind_host: str) -> tuple[frozenset[str], bool]:
    """(names a Host header may carry, whether any IP literal is allowed too) for a server bound to `bind_host`."""
    name = bind_host.strip("[]").lower()
    loopback = name == "localhost" or (_is_ip(name) and ipaddress.ip_address(name).is_loopback)
    names = {name} | (LOOPBACK_NAMES if loopback or _is_wildcard(name) else set())
    return frozenset(names), _is_wildcard(name)


def _host_name(host_header: str) -> str | None:
    """'example.com:80' -> 'example.com', '[::1]:9400' -> '::1'; None when malformed."""
    try:
        parts = urlsplit(f"//{host_header}")
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return None
    return parts.hostname


def _refuse(start_response, status: str, message: str) -> list[bytes]:
    body = json.dumps({"error": message}).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store")])
    return [body]


def guarded(app: WsgiApp, bind_host: str) -> WsgiApp:
    """`app` behind the Host and Origin checks, every response with the security headers."""
    names, any_ip = allowed_host_names(bind_host)

    def guarded_app(environ, start_response):
        def start(status, headers, exc_info=None):
            present = {key.lower() for key, _ in headers}
            extra = [(key, value) for key, value in SECURITY_HEADERS if key.lower() not in present]
            return start_response(status, list(headers) + extra, exc_info)

        host = environ.get("HTTP_HOST")
        name = _host_name(host) if host else None
        if name is None or not (name in names or (any_ip and _is_ip(name))):
            return _refuse(start, "421 Misdirected Request",
                           f"Host {host!r} does not name this server (allowed: {', '.join(sorted(names))}"
                           f"{' or an IP address' if any_ip else ''}); set metrics.host to the name clients use")
        origin = environ.get("HTTP_ORIGIN")
        if origin is not None:
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
                return _refuse(start, "403 Forbidden", f"Origin {origin!r} is not this server ({host})")
        return app(environ, start)

    return guarded_app
