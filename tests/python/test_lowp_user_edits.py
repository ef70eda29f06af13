"""What users do to models around tierlift.lowp.convert: hooks that replace a layer's forward
(accelerate's), reentrant activation checkpointing, Linears that share one weight. Each either
runs exactly what a fresh conversion runs or is kept in high precision with the reason in the
report."""

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierlift.lowp import RECIPES, Float8Linear, FP4Linear, convert, float8_linear, fp4_linear


def _mlp():
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))


def _step(model, x, seed=3):
    """Output, input grad and parameter grads of one forward + backward (seeded: FP4's draws)."""
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = model(x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _equal(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def _hook_forward(module: nn.Module) -> None:
    """What accelerate's add_hook_to_module does (dispatch_model, a device_map with offload):
    the bound forward is saved and the instance's forward replaced by a wrapper calling it."""
    def new_forward(module, *args, **kwargs):
        return module._old_forward(*args, **kwargs)

    module._old_forward = module.forward
    module.forward = functools.update_wrapper(functools.partial(new_forward, module),
                                              module._old_forward)


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp4-rtn"])
def test_a_linear_whose_forward_a_hook_replaced_is_kept_and_says_why(recipe, one_thread):
    # The class swap never reached the saved nn.Linear forward: the layer was reported converted
    # and ran nn.Linear's bits (a 64-wide layer 3.5% (FP8) to 20% (FP4) off its converted self).
    torch.manual_seed(0)
    plain = _mlp()
    hooked = copy.deepcopy(plain)
    _hook_forward(hooked[0])
    report = convert(hooked, recipe, lambda mod, fqn: True)  # even when the filter asks for it
    assert report.converted == ["2"] and "accelerate hook" in report.skipped["0"]
    assert type(hooked[0]) is nn.Linear
    want = copy.deepcopy(plain)  # what the report says: layer 0 high precision, layer 2 low
    convert(want, recipe, lambda mod, fqn: fqn == "2")
    x = torch.randn(8, 64)
    assert _equal(_step(hooked, x), _step(want, x))
    # Hooked after conversion the saved forward is the low precision one: exact.
    low = copy.deepcopy(plain)
    convert(low, recipe, min_features=0)
    hooked_after = copy.deepcopy(low)
    _hook_forward(hooked_after[0])
    assert _equal(_step(hooked_after, x), _step(low, x))


class Reentrant(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=True)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp8_reentrant_checkpointing_matches_bit_for_bit(recipe, one_thread):
    # use_reentrant=True (transformers 4.x's default, still passed by many scripts): the first
    # forward runs under no_grad (x and W quantized without their transposed copies), the
    # recompute with them; the layers after it see the first forward's outputs, the gradients
    # flow through the recompute's, so the two must be the same bits.
    torch.manual_seed(0)
    model = _mlp()
    convert(model, recipe, min_features=0)
    ckpt = Reentrant(copy.deepcopy(model))
    x = torch.randn(2, 12, 64)
    assert _equal(_step(ckpt, x), _step(model, x))


class TwoHeads(nn.Module):
    """Two Linears holding one weight Parameter (a shared projection applied twice)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(64, 64, bias=False)
        self.second = nn.Linear(64, 64)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "mxfp4-quartet"])
@pytest.mark.parametrize("which", ["both", "second"])
def test_linears_sharing_one_weight_keep_one_parameter_and_sum_its_gradients(recipe, which,
                                                                             one_thread):
    torch.manual_seed(0)
    model = TwoHeads()
    report = convert(model, recipe, lambda mod, fqn: which == "both" or fqn == "second")
    assert report.converted == (["first", "second"] if which == "both" else ["second"])
    assert model.first.weight is model.second.weight
    assert len(list(model.parameters())) == 2  # the optimizer sees the shared weight once
    x = torch.randn(16, 64)
    got = _step(model, x, seed=1)
    # untied copies through the functional layers: the shared gradient is their sum
    low = float8_linear if recipe in RECIPES else fp4_linear
    w1, w2 = (model.first.weight.detach().clone().requires_grad_() for _ in range(2))
    b2 = model.second.bias.detach().clone().requires_grad_()
    xr = x.clone().requires_grad_()
    torch.manual_seed(1)
    h = low(xr, w1, None, recipe) if which == "both" else nn.functional.linear(xr, w1)
    y = low(torch.tanh(h), w2, b2, recipe)
    y.square().sum().backward()
    assert _equal(got, [y.detach(), xr.grad, w1.grad + w2.grad, b2.grad])
    cls = Float8Linear if recipe in RECIPES else FP4Linear
    assert isinstance(model.second, cls) and isinstance(model.first, cls) == (which == "both")
