"""Wording shared by error messages."""

from __future__ import annotations


def first_names(names: list[str], n: int = 4) -> str:
    """The first `n` of `names`, comma-separated, then "and K more" for the rest."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
