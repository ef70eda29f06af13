"""tierlift.lowp.convert keeps everything an unconverted model has (hooks, buffers, attributes,
training flag, every path to a layer); FP8/FP4 layers refuse a second derivative and take an
empty batch as nn.Linear does."""

import io

import pytest
import torch
from torch import nn

from tierlift.lowp import FP4_RECIPES, RECIPES, Float8Linear, FP4Linear, convert

ALL_RECIPES = sorted(RECIPES) + sorted(FP4_RECIPES)


def _layer_cls(recipe):
    return Float8Linear if recipe in RECIPES else FP4Linear


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp4-rtn"])
def test_convert_keeps_the_module_its_hooks_buffers_and_flags(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    lin = model[0]
    lin.register_buffer("extra", torch.arange(3.0))
    lin.tag = "kept"
    calls = []
    lin.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))  # the output is the bias
    lin.register_forward_hook(lambda mod, args, out: calls.append(mod))
    model.eval()
    keys = list(model.state_dict())
    report = convert(model, recipe, min_features=0)
    assert report.converted == ["0", "1"]
    assert model[0] is lin and isinstance(lin, _layer_cls(recipe))
    assert list(model.state_dict()) == keys and lin.tag == "kept"
    assert not any(m.training for m in model.modules())
    y = lin(torch.randn(4, 64))
    assert calls == [lin]
    torch.testing.assert_close(y, lin.bias.detach().expand(4, 64), rtol=0, atol=0)


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "nvfp4"])
def test_convert_reaches_a_layer_at_every_path(recipe):
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = self.b = nn.Linear(64, 64)

        def forward(self, x):
            return self.b(self.a(x))

    model = Shared()
    outside = model.a  # a reference held elsewhere (a hook, an lm_head getter)
    report = convert(model, recipe, min_features=0)
    assert report.converted == ["a"]
    assert model.b is model.a is outside and isinstance(outside, _layer_cls(recipe))


def test_convert_keeps_weight_norm_working():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), torch.nn.utils.weight_norm(nn.Linear(64, 64)))
    convert(model, "fp8-rowwise", min_features=0)
    assert isinstance(model[1], Float8Linear)
    model(torch.randn(4, 64)).sum().backward()
    assert model[1].weight_g.grad is not None and model[1].weight_v.grad is not None


def test_convert_reports_subclasses_and_earlier_conversions():
    layer = nn.TransformerEncoderLayer(64, 4, 64, batch_first=True)
    report = convert(layer, "fp8-rowwise", min_features=0)
    assert report.converted == ["linear1", "linear2"]
    assert "subclass" in report.skipped["self_attn.out_proj"]
    again = convert(layer, "mxfp4-rtn", min_features=0)
    assert again.converted == [] and set(again.already_converted) == {"linear1", "linear2"}
    assert "fp8-rowwise" in str(again) and layer.linear1.recipe.name == "fp8-rowwise"


def test_convert_decides_every_layer_before_changing_any():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))

    def fails_on_second(mod, fqn):
        if fqn == "1":
            raise RuntimeError("filter failed")
        return True

    with pytest.raises(RuntimeError, match="filter failed"):
        convert(model, "fp8-rowwise", fails_on_second)
    assert all(type(m) is nn.Linear for m in model)


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_second_derivative_is_refused_not_zero(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    convert(model, recipe, min_features=0)
    x = torch.randn(8, 64, requires_grad=True)
    (gx,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.square().sum().backward()  # a gradient penalty: it used to give the weights zeros


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_empty_batch_matches_linear(recipe):
    model = nn.Sequential(nn.Linear(64, 64))
    convert(model, recipe, min_features=0)
    x = torch.randn(0, 3, 64, requires_grad=True)
    y = model(x)
    y.sum().backward()
    assert y.shape == (0, 3, 64) and x.grad.shape == x.shape
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "nvfp4"])
def test_state_dict_moves_between_plain_and_converted_models(recipe):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    low = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    convert(low, recipe, min_features=0)
    low.load_state_dict(plain.state_dict())  # a plain checkpoint into a converted model
    back = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    back.load_state_dict(low.state_dict())  # and out again: the same keys and tensors
    x = torch.randn(8, 64)
    assert torch.equal(back(x), plain(x))
    buf = io.BytesIO()
    torch.save(low, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded[0]) is _layer_cls(recipe) and loaded[0].recipe == low[0].recipe
    torch.manual_seed(1)
    y = low(x)
    torch.manual_seed(1)
    assert torch.equal(loaded(x), y)
