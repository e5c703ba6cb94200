"""The command line's usage error (exit code 2), apart from `tierkv.cli` so that every subcommand
can raise it without importing the package that imports the subcommands.

Primitives: `UsageError`.
"""


class UsageError(Exception):
    """Bad arguments or inputs the user named: exit code 2."""
