"""The FP8 quantize op that takes its scale from an amax history (fp8_quantize_from_history):
bit for bit the composition delayed scaling ran as torch ops (reference.lowp.history_scale, then
fp8_quantize_delayed, then the scale set to 1 where amax is 0) and tierlift.reference.lowp, on
never-filled, zero, tiny, huge, partly filled and strided histories and on nasty, zero, non-finite,
empty and strided inputs; its refusals (op, reference and fake kernel alike); opcheck and
torch.compile; CUDA against CPU on a GPU."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tierlift
from tierlift import ops
from tierlift.reference import lowp as ref

needs_ext = pytest.mark.skipif(not tierlift._extension.available(), reason="no compiled extension")

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
F32_MAX = ref.F32_MAX
SUBNORMAL = ref.SMALLEST_AMAX


def histories():
    """Histories of every kind a layer holds or a load may bring, NaN- and Inf-free."""
    threshold = ref.FP8_MAX[E4] / F32_MAX  # where the never-filled scale stops clipping
    return {
        "never-filled": torch.full((4,), -1.0),
        "zeros": torch.zeros(3),
        "negative-zero": torch.tensor([-0.0, -1.0]),
        "one-entry": torch.tensor([2.5]),
        "partly-filled": torch.tensor([3.0, -1.0, -1.0, -1.0]),
        "subnormal": torch.tensor([SUBNORMAL, -1.0]),
        "tiny": torch.tensor([1e-40, 1e-30, 0.0]),
        "threshold": torch.tensor([threshold, -1.0]),
        "huge": torch.tensor([F32_MAX, 1.0]),
        "large": torch.tensor([1e30, 7.0, 1e-3]),
        "typical": torch.rand(16, generator=torch.Generator().manual_seed(1)) * 5,
        "strided": torch.tensor([0.5, 100.0, 2.0, 100.0, 0.25, 100.0])[::2],
    }


def inputs():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(70, 37, generator=g) * torch.exp2(torch.randint(-15, 15, (70, 37),
                                                                        generator=g))
    wide.view(-1)[[3, 7, 11]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    small = torch.randn(5, 3, generator=g) * 1e-3
    return {
        "wide-fp32": wide,
        "wide-bf16": wide.bfloat16(),
        "small-fp16": small.half(),
        "one": torch.tensor([[300.0]]),
        "tiny": torch.full((2, 4), 1e-38),
        "zeros": torch.zeros(3, 8),
        "non-finite": torch.tensor([[float("nan"), float("inf")], [-0.0, 0.0]]),
        "empty": torch.empty(0, 16),
        "transposed": wide.t(),
    }


def bits(t):
    return None if t is None else t.view(torch.uint8 if t.element_size() == 1 else torch.int32)


def assert_same(got, want):
    assert len(got) == len(want) == 4
    q, s, qt, a = got
    assert s.shape == (1, 1) and a.shape == (1,) and s.dtype == a.dtype == torch.float32
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(bits(g), bits(w))


def composition(x, history, fp8_dtype, dual, pow2):
    """What delayed scaling computes with torch ops around fp8_quantize_delayed."""
    given = ref.history_scale(history, fp8_dtype, pow2)
    q, used, qt, amax = ops.fp8_quantize_delayed(x, given.to(x.device), fp8_dtype, dual, pow2)
    s = used.reshape(1, 1).masked_fill(amax.reshape(1, 1) == 0, 1.0)  # no finite non-zero value
    return q, s, qt, amax


@needs_ext
@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=str)
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_op_is_the_composition_bit_for_bit(fp8_dtype, pow2):
    for hname, history in histories().items():
        for xname, x in inputs().items():
            for dual in (False, True):
                got = torch.ops.tierlift.fp8_quantize_from_history(x, history, fp8_dtype, dual,
                                                                   pow2)
                try:
                    assert_same(got, composition(x, history, fp8_dtype, dual, pow2))
                    assert_same(got, ref.fp8_quantize_from_history(x, history, fp8_dtype, dual,
                                                                   pow2))
                except AssertionError as e:
                    raise AssertionError(f"history {hname}, x {xname}, dual {dual}") from e


@needs_ext
def test_scales_it_chooses():
    x = torch.tensor([[1.0, -2.0], [0.5, 0.0]])
    one = torch.tensor([[1.0]])
    # a never-filled history: x's own scale (the format's largest clips any finite value)
    _, s, _, _ = ops.fp8_quantize_from_history(x, torch.full((3,), -1.0))
    assert s.item() == torch.tensor(448.0 / 2.0).item()
    # a history whose scale fits is kept; one that would clip gives x's own
    assert ops.fp8_quantize_from_history(x, torch.tensor([4.0, -1.0]))[1].item() == 112.0
    assert ops.fp8_quantize_from_history(x, torch.tensor([0.5]))[1].item() == 224.0
    # nothing finite and non-zero in x: scale 1, whatever the history
    for zero_like in (torch.zeros(2, 2), torch.full((1, 3), float("nan")), torch.empty(0, 4)):
        assert torch.equal(ops.fp8_quantize_from_history(zero_like, torch.tensor([4.0]))[1], one)
    # a NaN entry: torch's max is NaN, whose scale is 1 (as the composition gives)
    nan_history = torch.tensor([2.0, float("nan")])
    got = ops.fp8_quantize_from_history(x, nan_history, E5, True, True)
    assert got[1].item() == 1.0
    assert_same(got, composition(x, nan_history, E5, True, True))
    assert_same(got, ref.fp8_quantize_from_history(x, nan_history, E5, True, True))


BAD_HISTORIES = [
    (torch.ones(2, 2), "1-D"),
    (torch.ones(3, dtype=torch.float64), "float32"),
    (torch.ones(3, dtype=torch.bfloat16), "float32"),
    (torch.empty(0), "at least one entry"),
    (torch.ones(3, device="meta"), "x's device"),
]


@needs_ext
@pytest.mark.parametrize("history, match", BAD_HISTORIES,
                         ids=["2-D", "fp64", "bf16", "empty", "other-device"])
def test_bad_history_is_refused_by_op_reference_and_fake(history, match):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=match):
        torch.ops.tierlift.fp8_quantize_from_history(x, history, E4, False, False)
    with pytest.raises(ValueError, match=match):
        ref.fp8_quantize_from_history(x, history, E4)
    with FakeTensorMode() as mode:
        fx, fh = mode.from_tensor(x), mode.from_tensor(history)
        with pytest.raises(ValueError, match=match):
            torch.ops.tierlift.fp8_quantize_from_history(fx, fh, E4, False, False)


@needs_ext
def test_inf_in_the_history_is_refused_on_cpu():
    # its scale would be 0 (448 / inf): the composition's fp8_quantize_delayed refuses it too
    x, history = torch.randn(4, 8), torch.tensor([1.0, float("inf")])
    for quantize in (ops.fp8_quantize_from_history, ref.fp8_quantize_from_history):
        with pytest.raises(ValueError, match=r"\+Inf"):
            quantize(x, history)
    with pytest.raises(ValueError, match="finite and > 0"):
        composition(x, history, E4, False, False)


@needs_ext
def test_bad_x_and_format_are_refused():
    history = torch.tensor([1.0])
    with pytest.raises(ValueError, match="2-D"):
        ops.fp8_quantize_from_history(torch.randn(2, 3, 4), history)
    with pytest.raises(TypeError, match="x must be"):
        ops.fp8_quantize_from_history(torch.ones(4, 4, dtype=torch.int32), history)
    with pytest.raises(TypeError, match="fp8_dtype"):
        ops.fp8_quantize_from_history(torch.randn(4, 4), history, torch.float16)


@needs_ext
def test_opcheck():
    op = torch.ops.tierlift.fp8_quantize_from_history.default
    x = torch.randn(70, 130)
    for dual, pow2 in ((False, False), (True, True)):
        torch.library.opcheck(op, (x, torch.tensor([2.0, -1.0]), E4, dual, pow2))
        torch.library.opcheck(op, (x.bfloat16().t(), torch.full((5,), -1.0), E5, dual, pow2))


@needs_ext
def test_compiles():
    def step(x, history):
        q, s, qt, amax = ops.fp8_quantize_from_history(x * 2, history, dual=True)
        return q.float().sum() / s.squeeze() + qt.float().sum(), amax

    f = torch.compile(step, backend="eager", fullgraph=True)
    x, history = torch.randn(32, 64), torch.tensor([4.0, -1.0, 3.0])
    got, want = f(x, history), step(x, history)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=str)
def test_cuda_matches_cpu_bitwise(fp8_dtype):
    tierlift._extension.require("cuda")
    cases = dict(inputs(), big=torch.randn(1024, 4096) * 3)
    for history in histories().values():
        for x in cases.values():
            for dual in (False, True):
                for pow2 in (False, True):
                    cpu = torch.ops.tierlift.fp8_quantize_from_history(x, history, fp8_dtype,
                                                                       dual, pow2)
                    gpu = torch.ops.tierlift.fp8_quantize_from_history(
                        x.cuda(), history.cuda(), fp8_dtype, dual, pow2)
                    assert_same([None if t is None else t.cpu() for t in gpu], cpu)


@pytest.mark.gpu
def test_cuda_inf_history_gives_x_own_scale_as_the_composition_does():
    # refusing it on the GPU would need a host sync; the scale 0 is treated as one that clips
    tierlift._extension.require("cuda")
    x, history = torch.randn(100, 200, device="cuda"), torch.tensor([1.0, float("inf")],
                                                                    device="cuda")
    got = ops.fp8_quantize_from_history(x, history, dual=True)
    assert_same(got, composition(x, history, E4, True, False))
    own_q, own_s = ops.fp8_quantize(x, "tensor")
    assert torch.equal(got[1], own_s) and torch.equal(bits(got[0]), bits(own_q))
