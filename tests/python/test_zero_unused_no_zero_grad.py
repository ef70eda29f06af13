"""Gradients summed over optimizer steps (zero_grad only now and then): a parameter that got a
gradient before the last step keeps it, so torch steps it again even where the backward since
gave it none; so does zero_grad(set_to_none=False), which leaves it a zero gradient. The
unit's flags for such a parameter must stay set (zero/unused.py settle())."""

from __future__ import annotations

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
