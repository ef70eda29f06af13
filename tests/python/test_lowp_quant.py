"""FP8 quantizers: compiled CPU op (csrc/core/lowp) vs tierlift.reference.lowp bit for bit, the
codec vs torch's own float8 casts, CUDA vs CPU (GPU only), fake kernels, and bad input."""

import pytest
import torch

import tierlift
from tierlift import ops
from tierlift.reference import lowp as ref

needs_ext = pytest.mark.skipif(not tierlift._extension.available(), reason="no compiled extension")

SCALINGS = ref.SCALINGS
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (5, 3), (130, 257), (256, 128), (64, 1000)]


def nasty(shape, dtype, seed=0):
    """Random values over ~30 binades plus NaN, +-Inf, zeros and a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-15, 15, shape, generator=g))
    flat = x.view(-1)
    if flat.numel() > 16:
        flat[3], flat[7], flat[11], flat[12] = float("nan"), float("inf"), -float("inf"), 0.0
        x[-1].zero_()
    return x.to(dtype)


def bits(t):
    return t.view(torch.uint8)


def assert_same(actual, expected):
    (q, s), (qe, se) = actual[:2], expected[:2]
    torch.testing.assert_close(s, se, rtol=0, atol=0)
    assert torch.equal(bits(q), bits(qe))
    if len(actual) == 4:
        torch.testing.assert_close(actual[3], expected[3], rtol=0, atol=0)
        assert torch.equal(bits(actual[2]), bits(expected[2]))


@needs_ext
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_cpu_op_matches_reference_bitwise(shape, in_dtype, fp8_dtype, scaling):
    x = nasty(shape, in_dtype)
    for pow2 in (False, True):
        got = torch.ops.tierlift.fp8_quantize(x, scaling, fp8_dtype, pow2)
        assert_same(got, ref.fp8_quantize(x, scaling, fp8_dtype, pow2))
        dual = torch.ops.tierlift.fp8_quantize_dual(x, scaling, fp8_dtype, pow2)
        assert_same(dual, ref.fp8_quantize_dual(x, scaling, fp8_dtype, pow2))
        assert dual[2].shape == (shape[1], shape[0])


@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_codec_matches_torch_cast(fp8_dtype):
    # amax == fp8 max and a power-of-two scale make scale exactly 1, so q must be torch's own cast
    # of x for every in-range value: normals, subnormals, exact midpoints (ties to even), zeros.
    fmax = ref.FP8_MAX[fp8_dtype]
    every = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    every = every[torch.isfinite(every)].sort().values
    mids = (every[:-1] + every[1:]) / 2
    g = torch.Generator().manual_seed(1)
    rand = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-20, 16, (4000,), generator=g))
    x = torch.cat([every, mids, torch.nextafter(mids, every[1:]), rand.clamp(-fmax, fmax),
                   torch.tensor([fmax, -0.0])]).view(1, -1)
    q, s = ops.fp8_quantize(x, "tensor", fp8_dtype, pow2_scale=True)
    assert s.item() == 1.0
    assert torch.equal(bits(q), bits(x.to(fp8_dtype)))
    assert torch.equal(bits(ref.fp8_quantize(x, "tensor", fp8_dtype, True)[0]), bits(q))


@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_nan_inf_stay_non_finite_and_zeros(fp8_dtype):
    fmax = ref.FP8_MAX[fp8_dtype]
    x = torch.tensor([[1.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 0.0]])
    for quantize in (ops.fp8_quantize, ref.fp8_quantize):
        q, s = quantize(x, "tensor", fp8_dtype)
        # Non-finite values do not enter amax: the scale is set by 1.0 (not 448 / inf = 0).
        assert s.item() == fmax
        assert q.float()[0, 0] == fmax and q.float()[0, 5] == 0
        # NaN: the canonical code; +-inf: +-inf in E5M2, NaN in E4M3 (which has no inf).
        want = [0x7C, 0xFC] if fp8_dtype == torch.float8_e5m2 else [0x7F, 0x7F]
        assert bits(q)[0, 1:5].tolist() == want + [0x7F, 0x7F]
    zero_q, zero_s = ops.fp8_quantize(torch.zeros(4, 256), "1x128", fp8_dtype, pow2_scale=True)
    assert torch.isfinite(zero_s).all() and (zero_s > 0).all()
    assert (zero_q.float() == 0).all()
    tiny_q, tiny_s = ops.fp8_quantize(torch.full((2, 2), 1e-40), "row", fp8_dtype)
    assert torch.isfinite(tiny_s).all()
    assert torch.isfinite(ref.fp8_dequantize(tiny_q, tiny_s, "row")).all()


@needs_ext
def test_strided_input_and_dual_is_transpose():
    x = nasty((300, 200), torch.bfloat16, seed=3)
    xt = x.t()  # non-contiguous view
    for scaling in SCALINGS:
        assert_same(torch.ops.tierlift.fp8_quantize(xt, scaling, torch.float8_e4m3fn, False),
                    ref.fp8_quantize(xt.contiguous(), scaling, torch.float8_e4m3fn, False))
        q, s, qt, st = ops.fp8_quantize_dual(x, scaling)
        assert_same((qt, st), ops.fp8_quantize(xt.contiguous(), scaling))


@needs_ext
@pytest.mark.parametrize("shape", [(0, 16), (16, 0), (0, 0)], ids=str)
def test_empty_inputs_get_safe_scales(shape):
    x = torch.randn(shape)
    for scaling in SCALINGS:
        got = torch.ops.tierlift.fp8_quantize_dual(x, scaling, torch.float8_e4m3fn, False)
        want = ref.fp8_quantize_dual(x, scaling, torch.float8_e4m3fn, False)
        assert [t.shape for t in got] == [t.shape for t in want]
        assert_same(got, want)
        assert torch.isfinite(got[1]).all() and torch.isfinite(got[3]).all()


@needs_ext
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_non_finite_inputs_show_in_the_dequantized_output(scaling, fp8_dtype):
    # A NaN/Inf comes back non-finite at its own position (Inf: as Inf in E5M2, NaN in E4M3);
    # its finite neighbours keep their usual FP8 precision (their scale ignores it).
    x = torch.randn(130, 257)
    x[3, 5], x[10, 7], x[129, 256] = float("nan"), float("inf"), -float("inf")
    for quantize in (torch.ops.tierlift.fp8_quantize_dual, ref.fp8_quantize_dual):
        q, s, qt, st = quantize(x, scaling, fp8_dtype, False)
        for deq, want in ((ref.fp8_dequantize(q, s, scaling), x),
                          (ref.fp8_dequantize(qt, st, scaling), x.t())):
            assert torch.equal(~torch.isfinite(deq), ~torch.isfinite(want))
            if fp8_dtype == torch.float8_e5m2:
                assert torch.equal(torch.isinf(deq), torch.isinf(want))
                assert torch.equal(deq[torch.isinf(deq)], want[torch.isinf(want)])
            else:
                assert torch.isnan(deq[~torch.isfinite(want)]).all()
            fin = torch.isfinite(want)
            err = (deq[fin] - want[fin]).abs()
            assert (err <= want[fin].abs() / 8 + 1e-3).all()


def test_dequantize_error_is_within_fp8_precision():
    x = torch.randn(256, 512)
    for scaling in SCALINGS:
        q, s = ops.fp8_quantize(x, scaling)
        err = (ref.fp8_dequantize(q, s, scaling) - x).abs()
        assert (err <= x.abs() / 16 + 1e-3).all(), scaling


@needs_ext
def test_bad_input_names_the_argument():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="scaling"):
        ops.fp8_quantize(x, "rows")
    with pytest.raises(TypeError, match="fp8_dtype"):
        ops.fp8_quantize(x, "row", torch.float16)
    with pytest.raises(ValueError, match="2-D"):
        ops.fp8_quantize(torch.randn(2, 3, 4), "row")
    with pytest.raises(TypeError, match="x must be"):
        ops.fp8_quantize(torch.ones(4, 4, dtype=torch.int32), "row")
    with pytest.raises(ValueError, match="scaling"):
        ref.fp8_quantize(x, "rows")


@needs_ext
@pytest.mark.parametrize("scaling", SCALINGS)
def test_opcheck(scaling):
    x = torch.randn(130, 140)
    t = torch.ops.tierlift
    for op in (t.fp8_quantize.default, t.fp8_quantize_dual.default):
        torch.library.opcheck(op, (x, scaling, torch.float8_e4m3fn, True))
        torch.library.opcheck(op, (x.bfloat16().t(), scaling, torch.float8_e5m2, False))


@needs_ext
def test_compiles():
    f = torch.compile(lambda x: ops.fp8_quantize(x * 2, "row")[0].float().sum(), backend="eager",
                      fullgraph=True)
    x = torch.randn(32, 64)
    assert f(x) == ops.fp8_quantize(x * 2, "row")[0].float().sum()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(4096, 4096), (1, 5000), (300, 129), (0, 16)], ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_cuda_matches_cpu_bitwise(shape, in_dtype, fp8_dtype, scaling):
    tierlift._extension.require("cuda")
    x = nasty(shape, in_dtype, seed=5)
    for pow2 in (False, True):
        cpu = torch.ops.tierlift.fp8_quantize(x, scaling, fp8_dtype, pow2)
        gpu = torch.ops.tierlift.fp8_quantize(x.cuda(), scaling, fp8_dtype, pow2)
        assert_same([t.cpu() for t in gpu], cpu)
        cpu = torch.ops.tierlift.fp8_quantize_dual(x, scaling, fp8_dtype, pow2)
        gpu = torch.ops.tierlift.fp8_quantize_dual(x.cuda(), scaling, fp8_dtype, pow2)
        assert_same([t.cpu() for t in gpu], cpu)
        # Transposed (tiled path) and offset rows (unaligned: the scalar fused path).
        for view in (lambda t: t.t(), lambda t: t[:, 1:]):
            got = torch.ops.tierlift.fp8_quantize(view(x.cuda()), scaling, fp8_dtype, pow2)
            want = torch.ops.tierlift.fp8_quantize(view(x), scaling, fp8_dtype, pow2)
            assert_same([t.cpu() for t in got], want)
