"""The command line's usage error (exit code 2), apart from `tierkv.cli` so that every subcommand
can raise it without importing the package that imports the subcommands.

Primitives: `UsageError`, `check_positive`, `check_endpoint`.
"""


class UsageError(Exception):
    """Bad arguments or inputs the user named: exit code 2."""


def check_positive(flag: str, value: float) -> float:
    """`value` of `flag` when a finite number > 0; UsageError naming the flag otherwise (nan, inf, 0, < 0)."""
    import math

    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{flag}: got {value}; must be a finite number > 0")
    return value


def check_endpoint(flag: str, url: str) -> str:
    """`url` of `flag` when http(s)://host[:port] (`metrics.sources.endpoint_problem`), UsageError naming the flag
    otherwise: one check for every command that takes an endpoint (no scheme is guessed: 'notaurl' is refused)."""
    from tierkv.metrics.sources import endpoint_problem

    problem = endpoint_problem(url)
    if problem:
        raise UsageError(f"{flag}: got {url!r}; {problem}")
    return url
