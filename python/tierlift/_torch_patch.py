"""Wrapping a private torch method where torch offers no hook (GradScaler's inf check): once per
process, and only where the method still takes the parameters the wrapper was written for, so
a torch that changed it keeps its own."""

from __future__ import annotations

import functools
import inspect


def wrap_method(cls, name: str, params: list[str] | None, wrap) -> None:
    """Replaces cls.name by wrap(original) (functools.wraps: `__wrapped__` is the original).

    Several wrappers may stack on one method, each once: a wrapper carries the names of the
    `wrap`s below it and its own (functools.wraps copies them up). params=None skips the
    signature check, for a builtin, whose signature cannot be read."""
    original = getattr(cls, name, None)
    mark = f"{wrap.__module__}.{wrap.__qualname__}"
    if original is None or mark in getattr(original, "_tierlift_wraps", ()):
        return
    if params is not None and list(inspect.signature(original).parameters) != params:
        return
    wrapper = functools.wraps(original)(wrap(original))
    wrapper._tierlift_wrapped = True
    wrapper._tierlift_wraps = (*getattr(original, "_tierlift_wraps", ()), mark)
    setattr(cls, name, wrapper)
