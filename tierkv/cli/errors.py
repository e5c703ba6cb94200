"""The command line's usage error (exit code 2), apart from `tierkv.cli` so that every subcommand
can raise it without importing the package that imports the subcommands.

Primitives: `UsageError`, `check_positive`.
"""


class UsageError(Exception):
    """Bad arguments or inputs the user named: exit code 2."""



def check_positive(flag: str, value: float) -> float:
    """`value` of `flag` when a finite number > 0; UsageError naming the flag otherwise (nan, inf, 0, < 0)."""
    import math

    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{flag}: got {value}; must be a finite number > 0")
    return value
