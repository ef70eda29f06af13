"""Float8Linear / FP4Linear take the dtypes nn.Linear takes: outside autocast an input whose
dtype differs from the layer's is refused with nn.Linear's error (it used to run and return the
input's dtype); under autocast the output has nn.Linear's dtype and its values. convert() also
converts a model that is itself an nn.Linear, in place."""

import pytest
import torch
from torch import nn

from tierlift.lowp import Float8Linear, FP4Linear, convert

LAYERS = [(Float8Linear, "fp8-rowwise"), (Float8Linear, "fp8-tensorwise"),
          (FP4Linear, "mxfp4-rtn"), (FP4Linear, "nvfp4")]


def _pair(cls, recipe, dtype=torch.float32, bias=True):
    torch.manual_seed(0)
    ref = nn.Linear(64, 32, bias=bias).to(dtype)
    low = cls.from_linear(nn.Linear(64, 32, bias=bias).to(dtype), recipe)
    low.load_state_dict(ref.state_dict())
    return ref, low


def _error(fn, *args) -> str:
    with pytest.raises(RuntimeError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize(("cls", "recipe"), LAYERS)
@pytest.mark.parametrize(("x_dtype", "layer_dtype"), [(torch.float32, torch.bfloat16),
                                                       (torch.bfloat16, torch.float32),
                                                       (torch.float64, torch.float32)])
def test_a_mismatched_input_dtype_is_refused_as_nn_linear_refuses_it(cls, recipe, x_dtype,
                                                                     layer_dtype):
    ref, low = _pair(cls, recipe, layer_dtype)
    x = torch.randn(4, 64, dtype=x_dtype)
    assert _error(ref, x) in _error(low, x)


@pytest.mark.parametrize(("cls", "recipe"), LAYERS)
def test_a_bias_of_another_dtype_is_refused_as_nn_linear_refuses_it(cls, recipe):
    ref, low = _pair(cls, recipe)
    for mod in (ref, low):
        mod.bias.data = mod.bias.data.bfloat16()
    x = torch.randn(4, 64)
    assert _error(ref, x) in _error(low, x)


@pytest.mark.parametrize(("cls", "recipe"), LAYERS)
@pytest.mark.parametrize(("x_dtype", "layer_dtype"), [(torch.float32, torch.float32),
                                                       (torch.float32, torch.bfloat16),
                                                       (torch.bfloat16, torch.float32)])
def test_autocast_gives_nn_linears_dtypes_and_values(cls, recipe, x_dtype, layer_dtype):
    ref, low = _pair(cls, recipe, layer_dtype)
    x = torch.randn(16, 64, dtype=x_dtype)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, y = ref(xs[0]), low(xs[1])
    assert y.dtype == y_ref.dtype == torch.bfloat16
    # the quantization error only: FP8 within a few percent, FP4 within a few tens of percent
    tol = 0.05 if cls is Float8Linear else 0.35
    err = (y.float() - y_ref.float()).norm() / y_ref.float().norm()
    assert err < tol, float(err)
    y_ref.float().sum().backward()
    y.float().sum().backward()
    assert xs[1].grad.dtype == xs[0].grad.dtype == x_dtype
    assert low.weight.grad.dtype == ref.weight.grad.dtype == layer_dtype
    assert low.bias.grad.dtype == ref.bias.grad.dtype == layer_dtype


@pytest.mark.parametrize(("cls", "recipe"), LAYERS[:1] + LAYERS[2:3])
def test_autocast_refuses_an_fp64_input_as_nn_linear_does(cls, recipe):
    ref, low = _pair(cls, recipe)  # autocast casts the fp32 weight, never the fp64 input
    x = torch.randn(4, 64, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _error(ref, x) in _error(low, x)


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp4-rtn"])
def test_convert_converts_a_model_that_is_itself_a_linear(recipe):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    expected = nn.Sequential(nn.Linear(64, 64))
    expected[0].load_state_dict(model.state_dict())
    report = convert(model, recipe, min_features=0)
    assert report.converted == [""] and isinstance(model, (Float8Linear, FP4Linear))
    convert(expected, recipe, min_features=0)
    x = torch.randn(8, 64)
    torch.manual_seed(1)
    y = model(x)
    torch.manual_seed(1)
    torch.testing.assert_close(y, expected(x), rtol=0, atol=0)
    again = convert(model, recipe, min_features=0)
    assert again.converted == [] and list(again.already_converted) == [""]
    assert "(the model itself)" in str(again)
    small = nn.Linear(8, 8)
    report = convert(small, recipe)
    assert type(small) is nn.Linear and list(report.skipped) == [""]
    assert "kept (the model itself):" in str(report)
