"""tierlift.activations as users of torch's own saved-tensor tools use it: what autograd
accepts without offload (nested tensors, ...) runs inside the context too, with the same
gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tierlift
from tierlift.activations import offload

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

TIERS = {
    "ram": lambda tmp: offload(cpu_budget=1 << 30, min_bytes=0),
    "nvme": lambda tmp: offload(cpu_budget=0, nvme_path=tmp, min_bytes=0),
}


def nested_softmax(ctx):
    torch.manual_seed(0)
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(5, 4, requires_grad=True)
    with ctx:
        nt = torch.nested.as_nested_tensor([a * 2, b * 2])  # strided layout: no sizes
        out = torch.nn.functional.softmax(nt * nt, dim=-1)
        loss = torch.nested.to_padded_tensor(out, 0.0).pow(2).sum()
    loss.backward()
    return a.grad, b.grad


@pytest.mark.parametrize("tier", TIERS)
def test_nested_tensors_are_left_in_place_with_exact_gradients(tmp_path, tier):
    ctx = TIERS[tier](tmp_path)
    got = nested_softmax(ctx)
    want = nested_softmax(contextlib.nullcontext())
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert ctx.last_stats["tensors"] > 0  # the dense tensors of the same forward still moved
