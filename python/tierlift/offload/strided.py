"""Non-contiguous parameters under offload (a model converted with
model.to(memory_format=torch.channels_last), a transposed weight): the tiers hold every state
kind in the parameter's logical (row-major) order, as a state dict and a checkpoint hold it, and
read and write the parameter as flat memory. A strided parameter is therefore swapped for a
contiguous copy of its data while the offloader reads or writes it (a step, a load), and the
result is copied back into its own memory, which keeps its layout (torch's AdamW keeps
channels_last too). Its master weights are always kept in the tiers (never the parameter
itself), so a checkpoint or a state dict never reads the parameter's memory as flat; a durable
reopen writes it through the copy too. The overlap's worker, stepping chunks during backward,
only reads such a parameter (one copy in logical order per pass, logical_flats); its new weights
are published inside step()."""

from __future__ import annotations

import contextlib

import torch


def laid_out_strided(groups: list[dict]) -> set[int]:
    """id(p) of the parameters non-contiguous when the state was laid out: their masters are
    in the tiers, so they may take any layout later (a parameter laid out contiguous and fp32
    may be its own master, read as flat memory by checkpoints: it must stay contiguous)."""
    return {id(p) for g in groups for p in g["params"] if not p.is_contiguous()}


def check_strided(groups: list[dict]) -> None:
    """At construction, before anything is laid out: a strided parameter's memory can be written
    back (no two elements share memory: in-place updates of those fail in torch too)."""
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            if not p.is_contiguous():
                _check_writable(f"param_groups[{gi}]['params'][{pi}]", p)


def logical_flats(params: list):
    """flat(pi): params[pi] as one flat tensor in logical order, to read: a view where it is
    contiguous, else a copy, made once per call of this (the overlap's worker reads parameters
    during backward, while a strided one is not swapped)."""
    cache: dict = {}

    def flat(pi: int) -> torch.Tensor:
        got = cache.get(pi)
        if got is None:
            p = params[pi].detach()
            got = cache[pi] = p.view(-1) if p.is_contiguous() else p.reshape(-1)
        return got

    return flat


def _check_writable(name: str, p: torch.Tensor) -> None:
    if torch._debug_has_internal_overlap(p) != 0:
        raise ValueError(
            f"{name} (shape {tuple(p.shape)}, stride {p.stride()}) has elements that share "
            "memory (an expanded tensor): no optimizer can update it in place. Make it a tensor "
            "of its own (p.contiguous())")


@contextlib.contextmanager
def contiguous_data(groups: list[dict], strided: set[int], write_back: bool = True):
    """Within: each parameter laid out strided (`strided`) that is not contiguous now has a
    contiguous copy of its data as p.data, so p.detach().view(-1) is its logical order. On exit
    its own memory takes the copy's values (`write_back`) and becomes p.data again. Refuses,
    before any change, one whose elements share memory (the copy back could not be done)."""
    todo = [(gi, pi, p) for gi, g in enumerate(groups) for pi, p in enumerate(g["params"])
            if id(p) in strided and not p.is_contiguous()] if strided else []
    for gi, pi, p in todo:
        _check_writable(f"param_groups[{gi}]['params'][{pi}]", p)
    swapped = []
    for _, _, p in todo:
        own = p.data
        p.data = own.contiguous()
        swapped.append((p, own))
    try:
        yield
    finally:
        for p, own in swapped:
            if write_back:
                own.copy_(p.data)
            p.data = own
