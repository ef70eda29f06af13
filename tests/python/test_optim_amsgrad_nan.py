"""amsgrad with NaN gradients: torch's AdamW keeps max_exp_avg_sq = torch.maximum(max_exp_avg_sq,
exp_avg_sq), NaN where either is, so a NaN gradient turns that element's running max NaN for
good. tierlift's state dict must hold the same NaNs (on every SIMD path, offloaded or not) and
the same finite values elsewhere."""

from __future__ import annotations

import pytest
import torch

import tierlift
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

SHAPES = [(1,), (17,), (33, 65), (1031,)]


def grads(step: int) -> list[torch.Tensor]:
    """Finite at step 0; then NaN (and an inf) at positions that move from step to step."""
    g = torch.Generator().manual_seed(10 + step)
    out = []
    for shape in SHAPES:
        t = torch.randn(shape, generator=g) * 0.1
        if step:
            flat = t.view(-1)
            flat[step % 3::7] = float("nan")
            flat[(step + 1) % 5::11] = float("inf") if step % 2 else -float("inf")
        out.append(t)
    return out


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_state_dict_matches_torch_after_nan_gradients(simd_path, offload):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, offload=offload)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=False)
    for step in range(4):
        for p, r, g in zip(params, ref_params, grads(step), strict=True):
            p.grad, r.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    got, want = ours.state_dict()["state"], ref.state_dict()["state"]
    nan_max = 0
    for i, (p, r) in enumerate(zip(params, ref_params, strict=True)):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-6, equal_nan=True)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            torch.testing.assert_close(got[i][key], want[i][key], rtol=1e-6, atol=1e-6,
                                       equal_nan=True, msg=lambda m, k=key, n=i: f"{k}[{n}]: {m}")
        nan_max += int(want[i]["max_exp_avg_sq"].isnan().sum())
    assert nan_max > 0  # the case is reached: some running max turned NaN
