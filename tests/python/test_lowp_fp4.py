"""FP4 quantizers: the compiled op (CPU, and CUDA on a GPU) against the pure-torch reference bit
for bit, the E2M1/E8M0/E4M3 edge cases, the Hadamard transform, stochastic rounding's bias, the
fake kernel (opcheck), bad-argument errors and FP4Linear's gradients."""

import math

import pytest
import torch
from torch import nn

from tierlift import _extension, ops
from tierlift.lowp import FP4_RECIPES, FP4Linear, FP4Recipe, convert, fp4_linear
from tierlift.reference import lowp_fp4 as ref

needs_ext = pytest.mark.skipif(not _extension.available(), reason="compiled extension missing")

CASES = [(rule, h, signs, sr, b2) for rule in ref.RULES for h, signs in ((0, 0), (16, 0x8421),
                                                                          (32, 0xDEADBEEF))
         for sr in (False, True) for b2 in ((False, True) if rule == "nv" else (False,))]


def _input(rows=37, cols=128, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g) * 3
    x[0, 3], x[2, 5], x[3, 7], x[4, :32] = 100.0, float("nan"), float("inf"), 0.0
    x[5, 64:96] = 1e-40  # subnormal block
    return x.to(dtype=dtype, device=device)


@needs_ext
@pytest.mark.parametrize("rule", ref.RULES)
@pytest.mark.parametrize("shape", [(0, 32), (0, 0)])
def test_cpu_op_empty_input_matches_reference(rule, shape):
    # Empty tensors have null data pointers: the op must still return empty codes and scales and
    # the reference's tensor scale (it used to refuse them as "null output").
    x = torch.empty(shape)
    a = torch.ops.tierlift.fp4_quantize(x, rule, 0, 0, False, 0, 0, False, True)
    b = ref.fp4_quantize(x, rule, 0, 0, False, 0, 0, False, True)
    for got, want in zip(a, b):
        assert torch.equal(got, want)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule,had,signs,sr,b2", CASES)
def test_cpu_op_matches_reference_bitwise(rule, had, signs, sr, b2, dtype):
    x = _input(dtype=dtype)
    a = torch.ops.tierlift.fp4_quantize(x, rule, had, signs, sr, 1234567, 11, b2, True)
    b = ref.fp4_quantize(x, rule, had, signs, sr, 1234567, 11, b2, True)
    for got, want in zip(a, b):
        assert torch.equal(got, want)


@needs_ext
def test_strided_input_matches_contiguous():
    x = _input(64, 96 * 2)[:, ::2]
    a = ops.fp4_quantize(x, "quest", 32, 5, True, 9, 0, False, True)
    b = ops.fp4_quantize(x.contiguous(), "quest", 32, 5, True, 9, 0, False, True)
    for got, want in zip(a, b):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rule,had,signs,sr,b2", CASES)
def test_cuda_matches_cpu_bitwise(rule, had, signs, sr, b2):
    for dtype in (torch.float32, torch.bfloat16):
        x = _input(rows=67, cols=256, dtype=dtype)
        a = ops.fp4_quantize(x.cuda(), rule, had, signs, sr, 42, 3, b2, True)
        b = ops.fp4_quantize(x, rule, had, signs, sr, 42, 3, b2, True)
        for got, want in zip(a, b):
            assert torch.equal(got.cpu(), want)


def test_every_e2m1_code_decodes():
    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    v = ref.e2m1_decode(codes).reshape(256, 2)
    grid = torch.tensor(ref.E2M1_VALUES)
    for byte in range(256):
        for nib, val in ((byte & 15, v[byte, 0]), (byte >> 4, v[byte, 1])):
            assert abs(val.item()) == grid[nib & 7].item()
            assert math.copysign(1.0, val.item()) == (-1.0 if nib & 8 else 1.0)
    low = ref.e2m1_decode(codes)[:, ::2]  # each byte's first element
    assert torch.equal(ref.e2m1_encode_rne(low).flatten(), (torch.arange(256) & 15).to(torch.uint8))


def test_interoperates_with_torch_float4_layout():
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    x = torch.tensor([[0.5, -6.0] * 16])
    codes, _, _, _ = ref.fp4_quantize(x, "rceil")
    assert codes[0, 0].item() == (0x1 | (0xF << 4))  # first element in the low nibble
    codes.view(torch.float4_e2m1fn_x2)  # same byte layout, viewable


def test_scale_rules_edges():
    s = torch.tensor([6.0, 8.0, 7.99, 6.01, 3.0, 0.0, 1e-45, 3.4e38])
    assert ref.mx_exponent(s, "floor").tolist() == [0, 1, 0, 0, -1, -127, -127, 125]
    assert ref.mx_exponent(s, "rceil").tolist() == [0, 1, 1, 1, -1, -127, -127, 126]
    assert ref.pow2(torch.tensor([-127, -126, 0, 127])).tolist() == [2.0**-127, 2.0**-126, 1.0,
                                                                      2.0**127]
    # OCP floor rule: a block whose amax is 1.5 gets scale 2^-2, values land on the grid.
    x = torch.tensor([[1.5, -0.25, 0.125, 0.0] * 8])
    codes, scales, ts, _ = ref.fp4_quantize(x, "floor")
    assert scales.item() == 125 and ts.item() == 1.0
    assert torch.equal(ref.fp4_dequantize(codes, scales, ts, "floor"), x)


@pytest.mark.parametrize("rule,had,b2", [(r, h, b2) for r in ref.RULES for h in (0, 32)
                                         for b2 in ((False, True) if r == "nv" else (False,))])
def test_non_finite_blocks_dequantize_to_nan(rule, had, b2):
    # A block holding a NaN or Inf gets the NaN scale (E8M0 0xFF / E4M3 0x7F), codes 0 and mask
    # 0, and dequantizes to all NaN; every other block and the NVFP4 tensor scale are unaffected.
    x = torch.randn(40, 128)
    x[1, 5], x[2, 70], x[35, 127] = float("nan"), float("inf"), -float("inf")
    block = ref.block_size(rule)
    span = max(block, had)  # a rotation spreads the NaN over its Hadamard block
    bad = torch.zeros(40, 128, dtype=torch.bool)
    for i, j in ((1, 5), (2, 70), (35, 127)):
        rows = slice(i // 16 * 16, i // 16 * 16 + 16) if b2 else slice(i, i + 1)
        bad[rows, j // span * span:(j // span + 1) * span] = True
    clean = x.nan_to_num(0.0, 0.0, 0.0)
    for quantize in ([ops.fp4_quantize] if _extension.available() else []) + [ref.fp4_quantize]:
        codes, scales, ts, mask = quantize(x, rule, had, 0, False, 0, 0, b2, True)
        back = ref.fp4_dequantize(codes, scales, ts, rule, b2)
        assert torch.equal(torch.isnan(back), bad) and torch.isfinite(back[~bad]).all()
        assert not mask[bad].any()
        nan_code = 0x7F if rule == "nv" else 0xFF
        s = scales.repeat_interleave(16 if b2 else 1, 0)[:40].repeat_interleave(block, 1)
        assert torch.equal(s == nan_code, bad)
        assert (ref.e2m1_decode(codes)[bad] == 0).all()
        # The blocks without NaN/Inf quantize exactly as they would without them.
        c0, s0, ts0, _ = quantize(clean, rule, had, 0, False, 0, 0, b2, True)
        assert torch.equal(back[~bad], ref.fp4_dequantize(c0, s0, ts0, rule, b2)[~bad])
        assert torch.equal(ts, ts0)


def test_nvfp4_roundtrip_and_tensor_scale():
    x = _input(32, 64).nan_to_num(0.0, 0.0, 0.0)
    for b2 in (False, True):
        codes, scales, ts, mask = ref.fp4_quantize(x, "nv", block_2d=b2, want_mask=True)
        assert ts.item() == pytest.approx(2688.0 / x.abs().max().item(), rel=1e-6)
        back = ref.fp4_dequantize(codes, scales, ts, "nv", b2)
        rel = ((back - x).norm() / x.norm()).item()
        assert rel < (0.3 if b2 else 0.15)
        # E4M3 rounds a block scale down at most 1/16: only elements near amax may saturate.
        assert mask.float().mean() > 0.95


def test_hadamard_orthogonal_and_self_inverse():
    for n in (16, 32):
        eye = torch.eye(n)
        h = ref.hadamard(eye, n)
        assert torch.allclose(h @ h.t(), eye, atol=1e-6)
        assert torch.allclose(h, h.t())
        x = torch.randn(8, 4 * n)
        assert torch.allclose(ref.hadamard(ref.hadamard(x, n), n), x, atol=1e-5)
        hs = ref.hadamard(eye, n, signs=0b1011)  # D then H: still orthogonal
        assert torch.allclose(hs @ hs.t(), eye, atol=1e-6)


def test_philox_known_answer():
    u = ref.philox_uniform(0, 0, torch.arange(4))
    words = [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]  # Random123 KAT, key 0, ctr 0
    assert u.tolist() == [(w >> 8) * 2.0**-24 for w in words]


def test_stochastic_rounding_is_unbiased():
    # n draws per value: the mean's std dev is <= step / (2 sqrt n); we allow 5 of those.
    n = 100_000
    vals = torch.tensor([0.1, 0.7, 1.3, 2.2, 3.9, 5.5, -4.6])
    v = vals.repeat_interleave(n)
    u = ref.philox_uniform(2024, 0, torch.arange(v.numel()))
    codes = ref.e2m1_encode_sr(v, u)  # one code per byte: decode the low nibble
    dec = ref.e2m1_decode(codes.reshape(-1, 1))[:, 0].reshape(vals.numel(), n)
    step = torch.where(vals.abs() < 2, 0.5, torch.where(vals.abs() < 4, 1.0, 2.0))
    bound = 5 * step / (2 * math.sqrt(n))
    assert ((dec.mean(1) - vals).abs() <= bound).all(), (dec.mean(1), vals)


@needs_ext
def test_opcheck():
    x = torch.randn(32, 64)
    for args in (("quest", 32, 7, True, 1, 0, False, True),
                 ("nv", 16, 0, False, 0, 0, True, False)):
        torch.library.opcheck(torch.ops.tierlift.fp4_quantize.default, (x, *args))


@pytest.mark.parametrize("bad,exc,match", [
    (dict(x=torch.randn(4, 48)), ValueError, "multiple of the block"),
    (dict(scale_rule="ceil"), ValueError, "scale_rule"),
    (dict(hadamard=8), ValueError, "hadamard"),
    (dict(block_2d=True), ValueError, "block_2d"),
    (dict(x=torch.randn(64)), ValueError, "2-D"),
    (dict(x=torch.randn(4, 64).to(torch.float64)), TypeError, "float32"),
])
def test_bad_arguments_name_the_argument(bad, exc, match):
    args = dict(x=torch.randn(4, 64), scale_rule="floor", hadamard=0, block_2d=False)
    args.update(bad)
    with pytest.raises(exc, match=match):
        ops.fp4_quantize(args["x"], args["scale_rule"], args["hadamard"], 0, False, 0, 0,
                         args["block_2d"])
    with pytest.raises(exc, match=match):
        ref.fp4_quantize(args["x"], args["scale_rule"], args["hadamard"], 0, False, 0, 0,
                         args["block_2d"])


@pytest.mark.parametrize("name", sorted(FP4_RECIPES))
def test_fp4_linear_close_to_linear(name):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    x = torch.randn(4, 16, 64, requires_grad=True)
    ref_y = lin(x)
    ref_y.square().sum().backward()
    gx, gw = x.grad.clone(), lin.weight.grad.clone()
    x.grad, lin.weight.grad = None, None
    fp4 = FP4Linear.from_linear(lin, name)
    y = fp4(x)
    y.square().sum().backward()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, ref_y) < 0.2
    assert rel(x.grad, gx) < 0.5 and rel(lin.weight.grad, gw) < 0.5


@pytest.mark.parametrize("name", sorted(FP4_RECIPES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fp4_linear_nan_in_input_or_grad_shows_in_output(name, bad):
    torch.manual_seed(0)
    lin = FP4Linear(64, 96, bias=False, recipe=name)
    x = torch.randn(32, 64)
    x[3, 5] = bad
    x.requires_grad_()
    y = lin(x)
    assert torch.isnan(y[3]).all()  # x[3]'s block is NaN: every output of row 3
    assert torch.isfinite(torch.cat([y[:3], y[4:]])).all()
    y.backward(torch.ones_like(y))
    assert torch.isnan(lin.weight.grad).any()  # grad_w = g^T x sees x[3, 5]

    lin.weight.grad = None
    x2 = torch.randn(32, 64, requires_grad=True)
    g = torch.ones(32, 96)
    g[2, 7] = bad
    lin(x2).backward(g)
    assert torch.isnan(x2.grad[2]).all()  # grad_x = g W: row 2 of g
    assert torch.isnan(lin.weight.grad[7]).any()  # grad_w = g^T x: row 7 of g^T


def test_fp4_linear_rejects_bad_shapes_and_recipes():
    with pytest.raises(ValueError, match="multiples of 32"):
        FP4Linear(48, 64)
    with pytest.raises(ValueError, match="recipe"):
        FP4Linear(64, 64, recipe="fp4-magic")
    with pytest.raises(ValueError, match="features"):
        fp4_linear(torch.randn(2, 32), torch.randn(64, 64), None)
    with pytest.raises(ValueError, match="forward_rule"):
        FP4Recipe(name="x", forward_rule="round", forward_hadamard=0, weight_2d=False,
                  clip_mask=False, backward_rule="floor", dgrad_hadamard=0, wgrad_hadamard=0,
                  random_signs=False, stochastic_grad=False, stochastic_other=False)


def test_convert_fp4_recipes():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 48))
    report = convert(model, "mxfp4-quartet", min_features=0)
    assert report.converted == ["0"] and "multiples of 32" in report.skipped["2"]
    assert isinstance(model[0], FP4Linear) and model[0].recipe.name == "mxfp4-quartet"
    with pytest.raises(ValueError, match="recipe must be one of"):
        convert(nn.Sequential(nn.Linear(64, 64)), "mxfp5")
