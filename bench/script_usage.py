"""The usage line of a bench script that reads ``sys.argv`` by hand: ``--help`` (or too few
positional arguments) prints the script's docstring instead of an IndexError."""

from __future__ import annotations

import sys


def check_usage(doc: str | None, positional: int) -> None:
    """Exit with the docstring on ``-h``/``--help`` (status 0) or with fewer than ``positional``
    arguments that are not ``--`` options (status 2)."""
    args = sys.argv[1:]
    if "-h" in args or "--help" in args:
        print((doc or "").strip())
        raise SystemExit(0)
    given = sum(1 for arg in args if not arg.startswith("--"))
    if given < positional:
        print((doc or "").strip(), file=sys.stderr)
        raise SystemExit(f"{sys.argv[0]}: {positional} positional argument(s) needed, got {given}")
