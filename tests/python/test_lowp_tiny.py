"""Tiny and far-from-1 tensors in every low-precision format: FP8 (every scaling), MXFP4 (floor,
rceil, quest) and NVFP4 keep their precision at 1e-20 and 1e-30 (scales are not clamped at a
minimum amax), quantization is invariant under power-of-two rescaling while the scales stay in
range, all-zero tensors stay exact, NVFP4 blocks far below the tensor amax are kept (smallest
E4M3 block scale instead of 0), and MX exponents equal an exact oracle near fp32's smallest
normal and on bf16 subnormals. The compiled CPU op equals the pure-torch reference bit for bit
throughout."""

import math

import pytest
import torch

from tierlift import _extension
from tierlift.reference import lowp as ref8
from tierlift.reference import lowp_fp4 as ref4

HAVE_EXT = _extension.available()
E2M1 = ref4.E2M1_VALUES


def _randn(rows, cols, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _rel_err(back, x):
    # Relative to the largest element: norms of 1e-30 values underflow in fp32.
    m = x.abs().max().double()
    return ((back.double() - x.double()) / m).norm().item() / (x.double() / m).norm().item()


def _fp8(x, scaling, dtype, pow2):
    got = ref8.fp8_quantize(x, scaling, dtype, pow2)
    if HAVE_EXT:
        op = torch.ops.tierlift.fp8_quantize(x, scaling, dtype, pow2)
        assert torch.equal(op[1], got[1])
        assert torch.equal(op[0].view(torch.uint8), got[0].view(torch.uint8))
    return got


def _fp4(x, rule, had=0, signs=0, b2=False):
    got = ref4.fp4_quantize(x, rule, had, signs, False, 0, 0, b2, True)
    if HAVE_EXT:
        op = torch.ops.tierlift.fp4_quantize(x, rule, had, signs, False, 0, 0, b2, True)
        for a, b in zip(op, got):
            assert torch.equal(a, b)
    return got


@pytest.mark.parametrize("mag", [1e-20, 1e-30])
@pytest.mark.parametrize("scaling", ref8.SCALINGS)
def test_fp8_tiny_tensors_keep_precision(scaling, mag):
    for in_dtype in (torch.float32, torch.bfloat16):
        x = (_randn(40, 257) * mag).to(in_dtype)
        for dtype, bound in ((torch.float8_e4m3fn, 0.04), (torch.float8_e5m2, 0.08)):
            for pow2 in (False, True):
                q, s = _fp8(x, scaling, dtype, pow2)
                assert torch.isfinite(s).all() and (s > 0).all()
                assert _rel_err(ref8.fp8_dequantize(q, s, scaling), x.float()) < bound


@pytest.mark.parametrize("scaling", ref8.SCALINGS)
def test_fp8_power_of_two_rescaling_keeps_codes(scaling):
    x = _randn(64, 200, seed=1) * 3
    for dtype in ref8.FP8_DTYPES:
        for pow2 in (False, True):
            q, s = _fp8(x, scaling, dtype, pow2)
            for j in (66, 100):  # 1e-20 and 1e-30: the codes are those of x, the scales 2^j larger
                qj, sj = _fp8(x * 2.0**-j, scaling, dtype, pow2)
                assert torch.equal(qj.view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(sj, s * 2.0**j)


def test_fp8_zero_and_subnormal_amax_scales():
    for dtype in ref8.FP8_DTYPES:
        fmax = ref8.FP8_MAX[dtype]
        zero_q, zero_s = _fp8(torch.zeros(3, 130), "1x128", dtype, False)
        assert (zero_s == 1).all() and (zero_q.float() == 0).all()
        # 448 / 1e-40 overflows fp32: capped at FLT_MAX (2^127 as a power of two), still finite.
        for pow2, cap in ((False, ref8.F32_MAX), (True, 2.0**127)):
            q, s = _fp8(torch.full((2, 2), 1e-40), "tensor", dtype, pow2)
            assert s.item() == cap
            assert (q.float() > 0).all()
        q, s = _fp8(torch.tensor([[1e-30, -5e-31, 0.0]]), "tensor", dtype, False)
        assert s.item() == torch.tensor(fmax) / torch.tensor(1e-30)
        assert q.float()[0].tolist() == [fmax, -fmax / 2, 0.0]


@pytest.mark.parametrize("mag", [1e-20, 1e-30])
@pytest.mark.parametrize("rule", ref4.RULES)
def test_fp4_tiny_tensors_keep_precision(rule, mag):
    for in_dtype in (torch.float32, torch.bfloat16):
        x = (_randn(32, 128, seed=2) * mag).to(in_dtype)
        for had, b2 in ((0, False), (32, False), (16, rule == "nv")):
            codes, scales, ts, mask = _fp4(x, rule, had, 0x1234 if had else 0, b2)
            back = ref4.fp4_dequantize(codes, scales, ts, rule, b2)
            want = ref4.hadamard(x, had, 0x1234) if had else x.float()
            assert _rel_err(back, want) < 0.2, (had, b2)
            assert mask.float().mean() > 0.9


@pytest.mark.parametrize("rule", ref4.RULES)
def test_fp4_power_of_two_rescaling_keeps_codes(rule):
    x = _randn(32, 128, seed=3) * 3
    codes, scales, ts, mask = _fp4(x, rule)
    for j in (66, 100, -60):  # 1e-20, 1e-30 and 1e18 (whose squares overflow fp32)
        cj, sj, tsj, mj = _fp4(x * 2.0**-j, rule)
        assert torch.equal(cj, codes) and torch.equal(mj, mask)
        if rule == "nv":
            assert torch.equal(sj, scales) and torch.equal(tsj, ts * 2.0**j)
        else:
            assert torch.equal(sj.long(), scales.long() - j) and tsj.item() == 1.0


def test_nvfp4_tensor_scale_rule():
    zero = _fp4(torch.zeros(2, 32), "nv")
    assert zero[2].item() == 1.0 and (zero[1] == 0).all() and (zero[0] == 0).all()
    st = _fp4(torch.full((1, 16), 1e-30), "nv")[2]
    assert st.item() == torch.tensor(2688.0) / torch.tensor(1e-30)
    # Below amax 4e-33 the tensor scale is capped so that s_t / 2^-9 stays finite.
    x = _randn(1, 32, seed=4) * 1e-37
    codes, scales, st, _ = _fp4(x, "nv")
    assert st.item() == ref4.NV_MAX_TENSOR_SCALE
    back = ref4.fp4_dequantize(codes, scales, st, "nv")
    assert torch.isfinite(back).all() and _rel_err(back, x) < 0.3


def test_nvfp4_block_far_below_tensor_amax_is_kept():
    # Block 1's ideal scale (448 * 1e-6 = 4.5e-4) is under half the smallest E4M3 subnormal
    # (2^-10): rounding would make it 0 and zero the block; it gets 2^-9 (code 1) instead.
    x = torch.zeros(1, 48)
    x[0, :16] = torch.linspace(-1, 1, 16)
    x[0, 16:32] = torch.linspace(-1e-6, 1e-6, 16)
    codes, scales, st, _ = _fp4(x, "nv")
    assert scales[0].tolist() == [0x7E, 1, 0]  # 448, 2^-9, the all-zero block 0
    back = ref4.fp4_dequantize(codes, scales, st, "nv")
    assert _rel_err(back[:, 16:32], x[:, 16:32]) < 0.5
    assert torch.equal(back[:, 32:], x[:, 32:])


def _e2m1_rne(v):
    a = min(abs(v), 6.0)
    k = min(range(8), key=lambda i: (abs(a - E2M1[i]), i % 2))  # nearest, ties to even code
    return math.copysign(E2M1[k], v)


def _mx_oracle(x, rule):
    """(E8M0 codes, dequantized values) of float64 rows of 32 exact fp32 values, exactly."""
    codes, out = [], []
    for block in x.double().reshape(-1, 32).tolist():
        amax = max(abs(v) for v in block)
        if amax == 0:
            e = -127
        elif rule == "floor":
            e = math.frexp(amax)[1] - 1 - 2
        else:  # smallest e with amax <= 6 * 2^e
            e = -160
            while amax > math.ldexp(6.0, e):
                e += 1
        e = max(-127, min(127, e))
        codes.append(e + 127)
        out += [math.ldexp(_e2m1_rne(math.ldexp(v, -e)), e) for v in block]
    return codes, out


def _near_min_normal_blocks(dtype):
    """Rows of 32 whose amax sits near fp32's smallest normal 2^-126: around 6 * 2^-127 (where
    amax / 6 is an fp32 subnormal that rounds onto 2^-127), 2^-126 itself, bf16 subnormals."""
    tiny = 2.0**-126
    if dtype == torch.float32:
        amaxes = [3 * tiny + k * 2.0**-148 for k in range(4)]
        amaxes += [tiny, tiny - 2.0**-149, tiny + 2.0**-149, 6 * tiny + 2.0**-147, 2.0**-149]
    else:  # bf16: 7 mantissa bits; subnormals are k * 2^-133
        amaxes = [3 * tiny, 3 * tiny + 2.0**-132, 1.5 * tiny, tiny, 127 * 2.0**-133,
                  64 * 2.0**-133, 3 * 2.0**-133, 2.0**-133]
    rows = []
    for a in amaxes:
        row = [a * (-1) ** j * (31 - j) / 31 for j in range(32)]
        row[7] = a * 0.25  # a tie between E2M1 codes 0 and 0.5 under the floor rule
        rows.append(row)
    x = torch.tensor(rows, dtype=torch.float64).to(dtype)
    assert torch.equal(x.abs().amax(dim=1).double(), torch.tensor(amaxes, dtype=torch.float64))
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mx_matches_exact_oracle_near_min_normal_and_bf16_subnormals(rule, dtype):
    x = _near_min_normal_blocks(dtype)
    want_codes, want = _mx_oracle(x, rule)
    codes, scales, ts, _ = _fp4(x, rule)
    assert scales.flatten().tolist() == want_codes
    back = ref4.fp4_dequantize(codes, scales, ts, rule)
    assert torch.equal(back.double().flatten(), torch.tensor(want, dtype=torch.float64))
