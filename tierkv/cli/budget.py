"""`tierkv budget`: resize a running TieredLLM's GPU KV budget through its metrics endpoint.

    tierkv budget --endpoint http://127.0.0.1:9400 1GiB

The process must serve metrics (`metrics.prometheus_port`); the change takes effect between
forward steps, and the command returns once it has (outputs do not change).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def add_parser(commands) -> None:
    p = commands.add_parser("budget", help="resize a running TieredLLM's GPU KV budget",
                            description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", metavar="URL", required=True, help="a TieredLLM's metrics server, http://host:port")
    p.add_argument("size", help="the new GPU KV budget: bytes or a size such as 1GiB")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the change (default 120)")
    p.set_defaults(handler=run_budget)


def run_budget(args) -> int:
    from tierkv.cli import UsageError
    from tierkv.units import parse_bytes

    try:
        num_bytes = parse_bytes(args.size)
    except ValueError as exc:
        raise UsageError(f"size: {exc}") from None
    if num_bytes <= 0:
        raise UsageError(f"size: got {args.size!r}; must be positive")
    request = urllib.request.Request(
        f"{args.endpoint.rstrip('/')}/api/gpu_budget", data=json.dumps({"budget": num_bytes}).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = json.loads(exc.read() or b"{}").get("error", exc.reason)
        if exc.code == 400:
            raise UsageError(f"the endpoint refused {args.size}: {detail}") from None
        raise RuntimeError(f"{args.endpoint}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"cannot reach {args.endpoint}: {getattr(exc, 'reason', exc)}") from None
    print(f"GPU KV budget set to {args.size} ({num_bytes} bytes)")
    return 0
