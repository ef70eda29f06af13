"""Wrapping a private torch method where torch offers no hook (GradScaler's inf check): once per
process, and only where the method still takes the parameters the wrapper was written for, so
a torch that changed it keeps its own."""

from __future__ import annotations

import functools
import inspect


def wrap_method(cls, name: str, params: list[str], wrap) -> None:
    """Replaces cls.name by wrap(original) (functools.wraps: `__wrapped__` is the original)."""
    original = getattr(cls, name, None)
    if original is None or getattr(original, "_tierlift_wrapped", False) or \
            list(inspect.signature(original).parameters) != params:
        return
    wrapper = functools.wraps(original)(wrap(original))
    wrapper._tierlift_wrapped = True
    setattr(cls, name, wrapper)
