"""tierlift.activations against autograd's own rules on what a saved tensor may be: one
modified in place after it was saved is refused at backward, as without offload (autograd skips
its version check for tensors that saved_tensors_hooks packed), and an expanded one (elements
sharing memory) comes back as autograd would give it."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tierlift
from tierlift.activations import offload

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

TIERS = {
    "kept": lambda tmp: offload(cpu_budget=1 << 30),  # min_bytes: left in place
    "ram": lambda tmp: offload(cpu_budget=1 << 30, min_bytes=0),
    "nvme": lambda tmp: offload(cpu_budget=0, nvme_path=tmp, min_bytes=0),
}


def modified_after_save(ctx):
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    with ctx:
        h = torch.randn(8, 4) @ w
        loss = (h * h).sum()  # saves h
        h.add_(1)
    loss.backward()


@pytest.mark.parametrize("tier", TIERS)
def test_a_saved_tensor_modified_in_place_is_refused(tmp_path, tier):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        modified_after_save(contextlib.nullcontext())
    # (nvme: already in forward, by the write-behind's own check)
    with pytest.raises(RuntimeError, match="modified by an inplace operation|modified in place"):
        modified_after_save(TIERS[tier](tmp_path))


def step_before_backward(ctx):
    w = torch.randn(4, 4, requires_grad=True)
    with ctx:
        loss = (torch.randn(8, 4, requires_grad=True) @ w).pow(2).sum()  # saves w
    with torch.no_grad():
        w.mul_(2)  # as an optimizer step before this backward would
    loss.backward()


@pytest.mark.parametrize("tier", TIERS)
def test_a_parameter_modified_before_backward_is_refused(tmp_path, tier):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step_before_backward(contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step_before_backward(TIERS[tier](tmp_path))


def expanded(w, x):
    row = (x @ w)[:1].expand(32, 64)  # stride 0: one row's memory for 32 rows
    return (row * (x @ w)).sum()


@pytest.mark.parametrize("tier", TIERS)
def test_an_expanded_saved_tensor_is_exact(tmp_path, tier):
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    expanded(w, x).backward()
    want, w.grad = w.grad, None
    with TIERS[tier](tmp_path):
        loss = expanded(w, x)
    loss.backward()
    assert torch.equal(w.grad, want)
