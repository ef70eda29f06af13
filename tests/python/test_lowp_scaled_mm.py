"""lowp/gemm.py's call of torch._scaled_mm: the argument layout it passes (tensorwise 0-dim
inverse scales, rowwise [M, 1] and [1, N]) is accepted and gives the emulation's numbers; a
refusal (RuntimeError from TORCH_CHECK, ValueError from TORCH_CHECK_VALUE) falls back to the
emulation, warned once per GEMM kind and counted per call (benchmarks read the count); a
TypeError, a changed signature, is not hidden. The GPU's own check is test_lowp_linear's
test_gpu_scaled_mm_close_to_emulation."""

from __future__ import annotations

import warnings

import pytest
import torch

from tierlift import ops
from tierlift.lowp import gemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def operands(scaling: str, b_dtype: torch.dtype):
    torch.manual_seed(0)
    x, w = torch.randn(32, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    return (*ops.fp8_quantize(x, scaling, E4M3, True), *ops.fp8_quantize(w, scaling, b_dtype, True))


def emulated(a_q, a_s, b_q, b_s):
    return (a_q.float() / a_s @ (b_q.float() / b_s).t()).bfloat16()


@pytest.fixture
def clean_state(monkeypatch):
    monkeypatch.setattr(gemm, "_warned", set())
    monkeypatch.setattr(gemm, "_fallbacks", type(gemm._fallbacks)())


def cpu_scaled_mm_works(rowwise: bool = False) -> bool:
    a = torch.zeros(16, 16).to(E4M3)
    sa, sb = (torch.ones(16, 1), torch.ones(1, 16)) if rowwise else (torch.tensor(1.0),) * 2
    try:
        torch._scaled_mm(a, a.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return False
    return True


@pytest.mark.skipif(not cpu_scaled_mm_works(), reason="this torch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("b_dtype", [E4M3, E5M2])
def test_the_call_torch_scaled_mm_gets_is_accepted_and_exact(monkeypatch, clean_state, scaling,
                                                             b_dtype):
    """Forced onto torch._scaled_mm on the CPU (whose scale-shape checks are torch's own): no
    fallback happens and the numbers are the emulation's."""
    if scaling == "row" and not cpu_scaled_mm_works(rowwise=True):
        pytest.skip("this torch's CPU torch._scaled_mm takes per-tensor scales only (2.11)")
    a_q, a_s, b_q, b_s = operands(scaling, b_dtype)
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append({k: tuple(v.shape) for k, v in kwargs.items() if torch.is_tensor(v)})
        return real(*args, **kwargs)

    monkeypatch.setattr(gemm, "_use_scaled_mm", lambda a, b: True)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        y = gemm.scaled_mm(a_q, a_s, b_q, b_s, torch.bfloat16)
    expect = {"scale_a": (), "scale_b": ()} if scaling == "tensor" else {
        "scale_a": (32, 1), "scale_b": (1, 48)}
    assert calls == [expect]
    assert gemm.scaled_mm_fallbacks() == {}
    assert torch.equal(y, emulated(a_q, a_s, b_q, b_s))


@pytest.mark.parametrize("error", [
    ValueError("Only bf16, fp16, and fp32 high precision output types are supported for row-wise "
               "scaling."),
    RuntimeError("Invalid scaling configuration.\n- For TensorWise scaling, ..."),
    NotImplementedError("DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90"),
])
def test_a_refusal_is_emulated_warned_once_and_counted(monkeypatch, clean_state, error):
    a_q, a_s, b_q, b_s = operands("row", E5M2)

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(gemm, "_use_scaled_mm", lambda a, b: True)
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.warns(RuntimeWarning, match="rejected this GEMM"):
        y = gemm.scaled_mm(a_q, a_s, b_q, b_s, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same kind again: counted, not warned
        gemm.scaled_mm(a_q, a_s, b_q, b_s, torch.bfloat16)
    assert torch.equal(y, emulated(a_q, a_s, b_q, b_s))
    first_line = str(error).splitlines()[0]
    kind = "torch.float8_e4m3fn-torch.float8_e5m2-torch.bfloat16-rowwise"
    assert gemm.scaled_mm_fallbacks() == {f"{kind}: {first_line}": 2}


def test_a_changed_signature_is_not_hidden(monkeypatch, clean_state):
    a_q, a_s, b_q, b_s = operands("tensor", E4M3)

    def old_signature(a, b, scale_a=None, scale_b=None):
        return torch.mm(a.float(), b.float())

    monkeypatch.setattr(gemm, "_use_scaled_mm", lambda a, b: True)
    monkeypatch.setattr(torch, "_scaled_mm", old_signature)
    with pytest.raises(TypeError, match="out_dtype"):
        gemm.scaled_mm(a_q, a_s, b_q, b_s, torch.bfloat16)
    assert gemm.scaled_mm_fallbacks() == {}
