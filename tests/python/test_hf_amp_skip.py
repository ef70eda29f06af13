"""accelerate with a GradScaler: a step skipped for inf/NaN gradients must count as skipped for a
tierlift optimizer (whose step() runs and unscales inside) as it does for torch's (whose step()
GradScaler does not call), or the learning-rate scheduler advances on it."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import tierlift  # noqa: E402
from tierlift.hf import Accelerator  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    accelerate.state.AcceleratorState._reset_state(True)
    yield
    accelerate.state.AcceleratorState._reset_state(True)


def train(accelerator_cls, make_opt, bad_steps=(1,), steps=5):
    """A few steps under accelerate with a GradScaler (what mixed_precision="fp16" sets up on a
    GPU; here on the CPU), the loss made infinite at `bad_steps`. Returns the learning rate
    after each step, accelerate's skipped flags, and the final weights."""
    accelerate.state.AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = accelerator_cls(cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    model, opt, sched = acc.prepare(model, opt, sched)
    data = torch.randn(steps, 16, 8, generator=torch.Generator().manual_seed(1))
    lrs, skipped = [], []
    for i in range(steps):
        loss = model(data[i]).square().mean()
        if i in bad_steps:
            loss = loss * float("inf")
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
        skipped.append(acc.optimizer_step_was_skipped)
    return lrs, skipped, [p.detach().clone() for p in model.parameters()]


def test_skipped_step_holds_the_scheduler_like_torch():
    want = train(Accelerator, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    got = train(Accelerator, lambda ps: tierlift.optim.AdamW(ps, lr=1e-2))
    assert want[1] == [False, True, False, False, False]
    assert got[1] == want[1]
    assert got[0] == want[0]
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_plain_accelerate_would_advance_the_scheduler():
    """What the override fixes: accelerate's own AcceleratedOptimizer sees the step() call and
    reports the step as taken."""
    _, skipped, _ = train(accelerate.Accelerator, lambda ps: tierlift.optim.AdamW(ps, lr=1e-2))
    assert skipped == [False] * 5


def test_optimizer_reports_the_skip():
    p = torch.nn.Parameter(torch.ones(3))
    opt = tierlift.optim.AdamW([p], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # sets up its scale, as scaling the loss does
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    scaler.step(opt)
    assert opt.amp_skipped_last_step
    assert torch.equal(p.detach(), torch.ones(3))
    scaler.update()
    scaler.scale(torch.ones(()))
    p.grad = torch.ones(3)
    scaler.step(opt)
    assert not opt.amp_skipped_last_step
    opt.step()  # without GradScaler
    assert not opt.amp_skipped_last_step
