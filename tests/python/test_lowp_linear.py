"""Float8Linear and tierlift.lowp.convert: numerics, autograd, torch.compile, checkpointing."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tierlift
from tierlift.lowp import RECIPES, Float8Linear, convert, float8_linear
from tierlift.reference import lowp as ref

RECIPE_NAMES = sorted(RECIPES)


def emulated_fp8_linear(x, w, recipe):
    """Plain-PyTorch FP8 forward + backward (reference quantizers, dequantize, fp32 matmul)."""
    r = RECIPES[recipe]
    sc, p2 = r.scaling, r.pow2_scale

    def mm(a, b_t, da, db):  # a @ b_t^T with a, b_t quantized along their last dim
        qa, sa = ref.fp8_quantize(a, sc, da, p2)
        qb, sb = ref.fp8_quantize(b_t, sc, db, p2)
        return (qa.float() * sa.reciprocal()) @ (qb.float() * sb.reciprocal()).t()

    e4, e5 = r.forward_dtype, r.grad_dtype
    y = mm(x, w, e4, e4)

    def backward(g):
        gx = mm(g, w.t().contiguous(), e5, e4)
        gw = g.t() @ x if r.grad_weight_high_precision else mm(g.t().contiguous(),
                                                               x.t().contiguous(), e5, e4)
        return gx, gw

    return y, backward


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_matches_plain_pytorch_fp8_emulation(recipe):
    # The flash-attention rule against the same-precision plain-PyTorch computation.
    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(96, 128, requires_grad=True)
    g = torch.randn(64, 96)
    y = float8_linear(x, w, None, recipe)
    y.backward(g)
    y_emu, backward = emulated_fp8_linear(x.detach(), w.detach(), recipe)
    gx_emu, gw_emu = backward(g)
    y32, gx32, gw32 = x @ w.t(), g @ w, g.t() @ x
    for ours, emu, exact in ((y, y_emu, y32), (x.grad, gx_emu, gx32), (w.grad, gw_emu, gw32)):
        assert rel_err(ours, exact) <= 2 * rel_err(emu, exact) + 1e-7
        torch.testing.assert_close(ours, emu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_error_vs_bf16_linear(recipe, record_property):
    """FP8 (3 mantissa bits) against bf16 nn.Linear (8 bits), both vs an fp32 reference.

    The issue's bound (FP8 error <= 2x bf16's) cannot hold: E4M3 rounding is 2^4 and E5M2's 2^5
    times bf16's. What is checked is the ratio FP8 rounding predicts (<= 32x; measured 13x for y,
    20x for the E5M2 gradients) so a regression (e.g. a wrong scale) shows; the ratios are
    recorded as test properties for the report.
    """
    torch.manual_seed(1)
    x = torch.randn(256, 512, dtype=torch.float64)
    w = torch.randn(384, 512, dtype=torch.float64) / 512**0.5
    g = torch.randn(256, 384, dtype=torch.float64)
    exact = (x @ w.t(), g @ w, g.t() @ x)
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    yb = xb @ wb.t()
    yb.backward(g.bfloat16())
    bf16 = (yb, xb.grad, wb.grad)
    x8, w8 = x.float().requires_grad_(), w.float().requires_grad_()
    y8 = float8_linear(x8, w8, None, recipe)
    y8.backward(g.float())
    fp8 = (y8, x8.grad, w8.grad)
    for what, ours, base, ex in zip(("y", "grad_x", "grad_w"), fp8, bf16, exact, strict=True):
        ratio = rel_err(ours, ex) / rel_err(base, ex)
        record_property(f"{recipe}-{what}-ratio", round(ratio, 2))
        limit = 4.0 if (what == "grad_w" and RECIPES[recipe].grad_weight_high_precision) else 32.0
        assert ratio <= limit, (what, ratio)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_in_input_or_grad_shows_in_output(recipe, bad):
    # A NaN/Inf in x reaches exactly the outputs that depend on it: row 3 of y and column 5 of
    # grad_w (E4M3 carries Inf as NaN); one in grad_output row 2 / column 7 reaches row 2 of
    # grad_x and row 7 of grad_w. Everything else stays finite: the scales ignore it.
    torch.manual_seed(0)
    w = torch.randn(32, 64, requires_grad=True)
    x = torch.randn(16, 64)
    x[3, 5] = bad
    x.requires_grad_()
    y = float8_linear(x, w, None, recipe)
    others = torch.arange(16) != 3
    assert torch.isnan(y[3]).all() and torch.isfinite(y[others]).all()
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad).all()
    assert (~torch.isfinite(w.grad[:, 5])).all()
    assert torch.isfinite(w.grad[:, torch.arange(64) != 5]).all()

    x2 = torch.randn(16, 64, requires_grad=True)
    w.grad = None
    g = torch.ones(16, 32)
    g[2, 7] = bad
    float8_linear(x2, w, None, recipe).backward(g)
    assert (~torch.isfinite(x2.grad[2])).all()
    assert torch.isfinite(x2.grad[torch.arange(16) != 2]).all()
    assert (~torch.isfinite(w.grad[7])).all()
    assert torch.isfinite(w.grad[torch.arange(32) != 7]).all()


def test_module_shapes_bias_dtypes_and_from_linear():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    f8 = Float8Linear.from_linear(lin, "fp8-tensorwise")
    assert f8.weight is lin.weight and f8.bias is lin.bias
    x = torch.randn(2, 5, 64)
    y = f8(x)
    assert y.shape == (2, 5, 32)
    torch.testing.assert_close(y, lin(x), rtol=0.1, atol=0.1)
    y.sum().backward()
    assert lin.weight.grad.shape == (32, 64) and lin.bias.grad.shape == (32,)
    yb = f8.bfloat16()(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    assert "fp8-tensorwise" in repr(f8)


def test_bad_input():
    with pytest.raises(ValueError, match="recipe"):
        Float8Linear(32, 32, recipe="fp8-columnwise")
    with pytest.raises(ValueError, match="features"):
        Float8Linear(32, 16)(torch.randn(4, 31))
    with pytest.raises(ValueError, match="min_features"):
        convert(nn.Sequential(nn.Linear(16, 16)), min_features=-1)
    with pytest.raises(TypeError, match="model"):
        convert("not a model")


def test_convert_reports_what_stays_high_precision():
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1000),
                          nn.Sequential(nn.Linear(64, 64)), nn.Linear(2048, 2048))
    report = convert(model, "fp8-rowwise")
    assert report.converted == ["0", "4"]
    assert set(report.skipped) == {"2", "3.0"}
    assert "multiples of 16" in report.skipped["2"] and "too small" in report.skipped["3.0"]
    assert isinstance(model[0], Float8Linear) and type(model[2]) is nn.Linear
    assert "kept 2" in str(report)
    model2 = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    report2 = convert(model2, "fp8-tensorwise", module_filter_fn=lambda m, fqn: fqn == "1")
    assert report2.converted == ["1"] and report2.skipped == {"0": "excluded by module_filter_fn"}


def _mlp(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    convert(model, recipe, min_features=0)
    return model


# mxfp4-rtn: the FP4 recipe without random draws, so eager and compiled runs can match bit for bit.
# fp32 activations: the emulated GEMMs' output needs no cast, which torch 2.11's torch.compile
# turned into zero gradients when the forward returned a no-op .to() (gemm.as_dtype).
@pytest.mark.parametrize("recipe", RECIPE_NAMES + ["mxfp4-rtn"])
def test_torch_compile_matches_eager(recipe):
    if not tierlift._extension.available():
        pytest.skip("compiled extension not loaded")
    model = _mlp(recipe)
    x = torch.randn(16, 32)
    y = model(x)
    y.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # a delayed layer's history queue is host state: it runs eagerly (a graph break)
    delayed = recipe in RECIPES and RECIPES[recipe].delayed
    compiled = torch.compile(model, backend="aot_eager", fullgraph=not delayed)
    yc = compiled(x)
    yc.sum().backward()
    torch.testing.assert_close(yc, y, rtol=0, atol=0)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_activation_checkpointing_matches(recipe):
    model = _mlp(recipe)
    x = torch.randn(16, 32, requires_grad=True)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    checkpoint(model, x, use_reentrant=False).sum().backward()
    for a, b in zip([p.grad for p in model.parameters()] + [x.grad], grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_gpu_scaled_mm_close_to_emulation(recipe):
    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = float8_linear(x, w, None, recipe)
    y.float().square().sum().backward()
    xc, wc = x.detach().cpu().requires_grad_(), w.detach().cpu().requires_grad_()
    yc = float8_linear(xc, wc, None, recipe)
    yc.float().square().sum().backward()
    # Same FP8 operands; only the GEMM's accumulation order and bf16 output rounding differ.
    for a, b in ((y, yc), (x.grad, xc.grad), (w.grad, wc.grad)):
        assert rel_err(a.cpu(), b) < 2e-2
