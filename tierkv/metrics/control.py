"""The control endpoint: POST /api/gpu_budget resizes a running TieredLLM's GPU KV budget.

Primitives: `BudgetControl` (`from_config`, `handle`), `CONTROL_TOKEN_ENV`, `MAX_BODY_BYTES`.

Off unless `metrics.control_enabled`; then every request passes, in this order:

    POST                                      405 otherwise
    Authorization: Bearer <token>             401 (token from metrics.control_token or TIERKV_CONTROL_TOKEN,
                                              compared with hmac.compare_digest)
    Content-Type: application/json            415 (a cross-site form or text/plain POST cannot send it
                                              without a CORS preflight, which this server never grants)
    Content-Length <= MAX_BODY_BYTES          411 without one, 413 above (the body is never read then)
    {"budget": "1GiB" | bytes}                400 naming what is wrong
    the change itself                         400 (bad size, sinks + window do not fit), 409 (refused:
                                              beyond the device, or the allocation failed), 202 with
                                              "pending" (not applied within the wait: it applies later)

Host and Origin are checked before any of this (tierkv.dashboard.guard), for every path.
"""
from __future__ import annotations

import hmac
import json
import os
from typing import Callable

from tierkv.budget_change import BudgetRefused
from tierkv.config import ConfigError, MetricsConfig
from tierkv.config.env_vars import ENV_CONTROL_TOKEN
from tierkv.config.fields import control_token_problem

ANSWERING = "tierkv.answering"  # WSGI environ key: called once the whole request is read (dashboard.app's server
                                # then never hangs the connection up for a slow client's place)

CONTROL_TOKEN_ENV = ENV_CONTROL_TOKEN
MAX_BODY_BYTES = 4096


class BudgetControl:
    def __init__(self, set_gpu_budget: Callable, token: str):
        problem = control_token_problem(token)  # the config's checks, for a token from TIERKV_CONTROL_TOKEN too
        if problem is not None:
            raise ConfigError("metrics.control_token", "<hidden>", problem)
        self._set_gpu_budget = set_gpu_budget
        self._token = token.encode()

    @classmethod
    def from_config(cls, config: MetricsConfig, set_gpu_budget: Callable | None,
                    env=os.environ) -> "BudgetControl | None":
        """None when the control is off (or nothing can be resized); ConfigError when on without a token."""
        if not config.control_enabled or set_gpu_budget is None:
            return None
        token = config.control_token or env.get(CONTROL_TOKEN_ENV)
        if not token:
            raise ConfigError("metrics.control_enabled", True,
                              f"the control endpoint needs a token: set metrics.control_token or {CONTROL_TOKEN_ENV}")
        return cls(set_gpu_budget, token)

    def handle(self, environ, start_response) -> list[bytes]:
        """The WSGI response for POST /api/gpu_budget."""
        status, body = self._decide(environ)
        data = json.dumps(body).encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data))), ("Cache-Control", "no-store")]
        if status.startswith("401"):
            headers.append(("WWW-Authenticate", 'Bearer realm="tierkv"'))
        start_response(status, headers)
        return [data]

    def _decide(self, environ) -> tuple[str, dict]:
        if environ.get("REQUEST_METHOD") != "POST":
            return "405 Method Not Allowed", {"error": "POST {\"budget\": \"1GiB\"} to resize the GPU KV budget"}
        scheme, _, given = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            return "401 Unauthorized", {"error": f"a bearer token is needed (metrics.control_token or {CONTROL_TOKEN_ENV})"}
        content_type = environ.get("CONTENT_TYPE", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return "415 Unsupported Media Type", {"error": f"Content-Type must be application/json, got {content_type!r}"}
        raw_length = environ.get("CONTENT_LENGTH") or ""
        if not raw_length:
            return "411 Length Required", {"error": "a Content-Length is needed"}
        if not (raw_length.isascii() and raw_length.isdigit()):
            return "400 Bad Request", {"error": f"Content-Length: got {raw_length[:40]!r}; expected digits"}
        length = int(raw_length[:20])
        if len(raw_length) > 20 or length > MAX_BODY_BYTES:
            return "413 Content Too Large", {"error": f"the body is {raw_length[:40]} bytes; at most {MAX_BODY_BYTES}"}
        try:
            raw = environ["wsgi.input"].read(length)  # the server's read timeout bounds a body that never comes
        except OSError as exc:
            return "408 Request Timeout", {"error": f"the body did not arrive ({type(exc).__name__})"}
        if len(raw) < length:
            return "400 Bad Request", {"error": f"the body ended after {len(raw)} of its {length} bytes"}
        try:
            body = json.loads(raw or b"null")
        except (ValueError, RecursionError) as exc:
            return "400 Bad Request", {"error": f"the body is not JSON ({type(exc).__name__})"}
        if not isinstance(body, dict) or "budget" not in body:
            return "400 Bad Request", {"error": "the body must be a JSON object with 'budget' (bytes or a size such as '1GiB')"}
        environ.get(ANSWERING, lambda: None)()  # read whole and authorised: the server never hangs it up while it waits
        return self._apply(body["budget"])

    def _apply(self, budget) -> tuple[str, dict]:
        try:
            self._set_gpu_budget(budget)
        except BudgetRefused as exc:
            return "409 Conflict", {"error": str(exc)}
        except ValueError as exc:  # ConfigError included: sinks + window do not fit
            return "400 Bad Request", {"error": str(exc)}
        except TimeoutError as exc:  # the change stays pending (the message says so): 202, not a failure
            return "202 Accepted", {"pending": str(exc), "budget": budget}
        return "200 OK", {"budget": budget}
