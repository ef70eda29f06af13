"""The delayed-scaling FP8 quantize op (tensor scaling with a scale chosen ahead): the compiled CPU
op against tierlift.reference.lowp.fp8_quantize_delayed bit for bit (a scale that fits, one that
would clip and so falls back to x's own scale, the boundary between them, NaN/Inf, zeros, empty
inputs, strided views, dual), its argument errors, the fake kernel (opcheck, torch.compile), and
CUDA against CPU on a GPU."""

import pytest
import torch

import tierlift
from tierlift import ops
from tierlift.reference import lowp as ref

needs_ext = pytest.mark.skipif(not tierlift._extension.available(), reason="no compiled extension")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (5, 3), (70, 37), (130, 257)]


def nasty(shape, dtype, seed=0):
    """Values over ~30 binades plus NaN, +-Inf, a zero and a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-15, 15, shape, generator=g))
    flat = x.view(-1)
    if flat.numel() > 16:
        flat[3], flat[7], flat[11], flat[12] = float("nan"), float("inf"), -float("inf"), 0.0
        x[-1].zero_()
    return x.to(dtype)


def bits(t):
    return t.view(torch.uint8)


def assert_same(got, want):
    q, s, qt, a = got
    qe, se, qte, ae = want
    assert s.shape == (1, 1) and a.shape == (1,) and s.dtype == a.dtype == torch.float32
    assert torch.equal(s.view(torch.int32), se.view(torch.int32)), (s, se)
    assert torch.equal(a.view(torch.int32), ae.view(torch.int32)), (a, ae)
    assert q.shape == qe.shape and q.dtype == qe.dtype and torch.equal(bits(q), bits(qe))
    assert (qt is None) == (qte is None)
    if qt is not None:
        assert qt.shape == qte.shape and torch.equal(bits(qt), bits(qte))


def finite_amax(x):
    a = x.float().abs()
    return a[torch.isfinite(a)].max().item() if torch.isfinite(a).any() else 0.0


def scales_for(x, fp8_dtype):
    """A scale that fits (half of x's own), x's own, and one that would clip (4x x's own)."""
    own = ref.scale_from_amax(torch.tensor([finite_amax(x)]), fp8_dtype, False).item()
    return {"fits": own / 2, "own": own, "clips": own * 4}


@needs_ext
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_cpu_op_matches_reference_bitwise(shape, in_dtype, fp8_dtype):
    x = nasty(shape, in_dtype, seed=shape[0])
    for name, s in scales_for(x, fp8_dtype).items():
        scale = torch.tensor([s], dtype=torch.float32)
        for dual in (False, True):
            for pow2 in (False, True):
                got = torch.ops.tierlift.fp8_quantize_delayed(x, scale, fp8_dtype, dual, pow2)
                want = ref.fp8_quantize_delayed(x, scale, fp8_dtype, dual, pow2)
                assert_same(got, want)
        redo = ops.fp8_quantize_delayed(x, scale, fp8_dtype)[1].item() != s
        assert redo == (name == "clips" and finite_amax(x) > 0), name


@needs_ext
def test_redo_uses_x_own_scale_and_a_fitting_scale_is_kept():
    x = torch.randn(64, 96) * 3
    x[5, 7] = float("nan")
    own, _ = ops.fp8_quantize(x, "tensor")
    for pow2 in (False, True):
        own, own_s = ops.fp8_quantize(x, "tensor", pow2_scale=pow2)
        q, s, qt, amax = ops.fp8_quantize_delayed(x, own_s * 8, dual=True, pow2_scale=pow2)
        assert torch.equal(s, own_s) and torch.equal(bits(q), bits(own))
        assert torch.equal(bits(qt), bits(q.t().contiguous()))
        assert amax.item() == finite_amax(x)
    given = torch.tensor([[1.25]])
    q, s, qt, _ = ops.fp8_quantize_delayed(x, given)
    assert s.item() == 1.25 and qt is None
    assert torch.equal(bits(q), bits(ref.cast_to_fp8(x * 1.25, torch.float8_e4m3fn)))


@needs_ext
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_boundary_of_the_clip_test(fp8_dtype):
    # fl(amax * scale) == max is kept; one ulp more scale, whose product rounds above max, is not.
    fmax = ref.FP8_MAX[fp8_dtype]
    amax = 3.0
    x = torch.tensor([[amax, -1.0, 0.5]])
    s = torch.tensor([fmax / amax], dtype=torch.float32)
    while (s * amax).item() > fmax:
        s = torch.nextafter(s, torch.zeros(1))
    up = s
    while (up * amax).item() <= fmax:
        up = torch.nextafter(up, torch.full((1,), float("inf")))
    for scale, redo in ((s, False), (up, True)):
        got = torch.ops.tierlift.fp8_quantize_delayed(x, scale, fp8_dtype, True, False)
        assert_same(got, ref.fp8_quantize_delayed(x, scale, fp8_dtype, True, False))
        assert (got[1].item() != scale.item()) == redo


@needs_ext
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_zeros_non_finite_and_empty(fp8_dtype):
    scale = torch.tensor([1e30])  # clips any nonzero finite value
    zeros = torch.zeros(3, 40)
    for x in (zeros, torch.full((2, 5), float("nan")), torch.tensor([[float("inf"), -0.0]])):
        got = torch.ops.tierlift.fp8_quantize_delayed(x, scale, fp8_dtype, True, True)
        assert_same(got, ref.fp8_quantize_delayed(x, scale, fp8_dtype, True, True))
        assert torch.equal(got[1], scale.view(1, 1)) and got[3].item() == 0.0  # nothing to clip
    for shape in ((0, 16), (16, 0), (0, 0)):
        x = torch.randn(shape, dtype=torch.bfloat16)
        got = torch.ops.tierlift.fp8_quantize_delayed(x, scale, fp8_dtype, True, False)
        assert_same(got, ref.fp8_quantize_delayed(x, scale, fp8_dtype, True, False))
        assert got[2].shape == (shape[1], shape[0])


@needs_ext
def test_strided_views():
    x = nasty((90, 140), torch.bfloat16, seed=4)
    for view in (x.t(), x[:, 3:], x[::2, ::3]):
        for s in scales_for(view, torch.float8_e4m3fn).values():
            scale = torch.tensor([s])
            got = torch.ops.tierlift.fp8_quantize_delayed(view, scale, torch.float8_e4m3fn, True,
                                                          False)
            assert_same(got, ref.fp8_quantize_delayed(view.contiguous(), scale,
                                                      torch.float8_e4m3fn, True, False))


@needs_ext
@pytest.mark.parametrize("scale, exc, match", [
    (torch.tensor([1.0, 2.0]), ValueError, "one element"),
    (torch.tensor([1.0], dtype=torch.float64), TypeError, "scale must be Float"),
    (torch.tensor([0.0]), ValueError, "finite and > 0"),
    (torch.tensor([-2.0]), ValueError, "finite and > 0"),
    (torch.tensor([float("inf")]), ValueError, "finite and > 0"),
    (torch.tensor([float("nan")]), ValueError, "finite and > 0"),
], ids=["two-elements", "fp64", "zero", "negative", "inf", "nan"])
def test_bad_scale_is_refused(scale, exc, match):
    with pytest.raises(exc, match=match):
        ops.fp8_quantize_delayed(torch.randn(4, 8), scale)


@needs_ext
def test_bad_x_and_format_are_refused():
    one = torch.tensor([1.0])
    with pytest.raises(ValueError, match="2-D"):
        ops.fp8_quantize_delayed(torch.randn(2, 3, 4), one)
    with pytest.raises(TypeError, match="x must be"):
        ops.fp8_quantize_delayed(torch.ones(4, 4, dtype=torch.int32), one)
    with pytest.raises(TypeError, match="fp8_dtype"):
        ops.fp8_quantize_delayed(torch.randn(4, 4), one, torch.float16)


@needs_ext
def test_opcheck():
    op = torch.ops.tierlift.fp8_quantize_delayed.default
    x = torch.randn(70, 130)
    for dual, pow2 in ((False, False), (True, True)):
        torch.library.opcheck(op, (x, torch.tensor([2.0]), torch.float8_e4m3fn, dual, pow2))
        torch.library.opcheck(op, (x.bfloat16().t(), torch.tensor([[1e6]]), torch.float8_e5m2,
                                   dual, pow2))


@needs_ext
def test_compiles():
    def step(x, scale):
        q, s, qt, amax = ops.fp8_quantize_delayed(x * 2, scale, dual=True)
        return q.float().sum() / s.squeeze() + qt.float().sum(), amax

    f = torch.compile(step, backend="eager", fullgraph=True)
    x, scale = torch.randn(32, 64), torch.tensor([4.0])
    got, want = f(x, scale), step(x, scale)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(4096, 4096), (300, 129), (0, 16)], ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_cuda_matches_cpu_bitwise(shape, in_dtype, fp8_dtype):
    tierlift._extension.require("cuda")
    x = nasty(shape, in_dtype, seed=5)
    for s in scales_for(x, fp8_dtype).values():
        scale = torch.tensor([s])
        for dual in (False, True):
            for pow2 in (False, True):
                cpu = torch.ops.tierlift.fp8_quantize_delayed(x, scale, fp8_dtype, dual, pow2)
                for view in (lambda t: t, lambda t: t.t().contiguous().t()):
                    gpu = torch.ops.tierlift.fp8_quantize_delayed(view(x.cuda()), scale.cuda(),
                                                                  fp8_dtype, dual, pow2)
                    assert_same([None if t is None else t.cpu() for t in gpu], cpu)


@pytest.mark.gpu
def test_cuda_invalid_scale_falls_back_to_x_own_scale():
    # A bad scale cannot be refused on the GPU without a host sync: it is treated as one that
    # would clip, so the codes are x's own tensorwise quantization, never cast with it.
    tierlift._extension.require("cuda")
    x = torch.randn(100, 200, device="cuda")
    own, own_s = ops.fp8_quantize(x, "tensor")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        q, s, _, _ = ops.fp8_quantize_delayed(x, torch.tensor([bad], device="cuda"))
        assert torch.equal(s, own_s) and torch.equal(bits(q), bits(own))
