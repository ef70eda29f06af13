"""Backwards summed onto a gradient the unit's flags were already settled for: a second backward
of a gradient accumulation (no no_sync()), a step without zero_grad since the last, or
zero_grad(set_to_none=False), which leaves a zero gradient. A parameter the earlier backward
reached keeps its gradient, so torch steps it even where the later backward gave it none; the
unit's flags for it must stay set (zero/unused.py settle())."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_zero_unused import OPT, _make, _max_rel

import tierlift

pytestmark = pytest.mark.usefixtures("one_thread")

# Which Two's `extra` each backward uses (l1, l2); zero_grad only before the first.
PLAN = [(True, True), (False, False), (False, True)]


def _run(model, opt) -> None:
    g = torch.Generator().manual_seed(1)
    opt.zero_grad()
    for use in PLAN:
        model(torch.randn(8, 8, generator=g), use).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("optim", [torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_kept_since_last_step_is_stepped_as_torch(stage, optim):
    kw = OPT if optim is torch.optim.AdamW else dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    ref = _make()
    _run(ref, optim(ref.parameters(), **kw))
    model = tierlift.zero.shard(_make(), stage=stage, units=["l1", "l2", "head"])
    _run(model, optim(model.parameters(), **kw))
    assert _max_rel(tierlift.zero.full_state_dict(model), ref.state_dict()) < 1e-6


@pytest.mark.parametrize("optim", [torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_keeping_zeros_steps_as_torch(stage, optim):
    """zero_grad(set_to_none=False): a parameter that had a gradient keeps a zero one, which
    torch steps (weight decay, moments); one that never had one stays None and is skipped."""
    kw = OPT if optim is torch.optim.AdamW else dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    plan = [(False, True), (True, True), (False, False), (True, False)]

    def run(model, opt) -> None:
        g = torch.Generator().manual_seed(1)
        for use in plan:
            opt.zero_grad(set_to_none=False)
            model(torch.randn(8, 8, generator=g), use).pow(2).mean().backward()
            opt.step()

    ref = _make()
    run(ref, optim(ref.parameters(), **kw))
    model = tierlift.zero.shard(_make(), stage=stage, units=["l1", "l2", "head"])
    run(model, optim(model.parameters(), **kw))
    assert _max_rel(tierlift.zero.full_state_dict(model), ref.state_dict()) < 1e-6


@pytest.mark.parametrize("no_sync", [False, True], ids=["synced", "no_sync"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulated_backwards_step_what_any_of_them_reached(stage, no_sync):
    """Two backwards per step (gradient accumulation, the first inside no_sync() or not): a
    parameter only the first reached has a gradient, which torch steps."""
    groups = [[(True, True), (False, False)], [(False, True), (True, False)]]

    def run(model, opt, zero: bool) -> None:
        g = torch.Generator().manual_seed(1)
        for group in groups:
            opt.zero_grad()
            for k, use in enumerate(group):
                first = zero and no_sync and k == 0
                with model.no_sync() if first else contextlib.nullcontext():
                    model(torch.randn(8, 8, generator=g), use).pow(2).mean().backward()
            opt.step()

    ref = _make()
    run(ref, torch.optim.AdamW(ref.parameters(), **OPT), False)
    model = tierlift.zero.shard(_make(), stage=stage, units=["l1", "l2", "head"])
    run(model, torch.optim.AdamW(model.parameters(), **OPT), True)
    assert _max_rel(tierlift.zero.full_state_dict(model), ref.state_dict()) < 1e-6
