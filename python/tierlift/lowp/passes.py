"""Count the passes over memory that a step of low-precision layers makes.

    with count_passes(min_numel=8192 * 8192) as count:
        layer(x).backward(grad_out)
    print(count.summary())    # quantize / layout / cast / other passes, GEMMs, bytes moved

Every op dispatched during the step (aten ops and tierlift's, seen below autograd by a
TorchDispatchMode, backward included) that reads or writes a tensor of at least `min_numel`
elements is one pass over memory; views and allocations are none. tierlift's GEMM wrapper
(lowp/gemm.py's `_scaled_mm`) counts as one GEMM whatever it runs inside (the inverse scales, and
off the FP8 tensor cores the dequantize + fp32 matmul emulation), so a CPU run counts what a GPU
run launches; plain aten GEMMs (mm, addmm, _scaled_mm, ...) count as GEMMs too.

Bytes are those the op moves over the tensors it touches: its tensor inputs read once (an
expanded input only its distinct elements; the destination of copy_/fill_/zero_ and out=
arguments are written, not read) and its outputs written once. For the FP8 quantizers the
input is read as many times as the CUDA kernels read it (`fp8_quantize_reads`, whatever device
the count runs on): they are the ops whose reads the op's signature does not show. The quantize
with a scale chosen ahead (delayed scaling, `tierlift::fp8_quantize_delayed`) reads its input
once, twice where the given scale would clip (`fp8_quantize_delayed_reads`). Other tierlift ops
have no such model and are refused. GEMM bytes are operands read once and the
output written once: the ideal, not what a tiled GEMM moves.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tierlift.lowp import gemm

KINDS = ("quantize", "layout", "cast", "other")  # the passes that are not GEMMs

_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_grouped_mm", "addmv", "mv"}
_LAYOUT = {"clone", "copy_", "_to_copy", "t_copy", "transpose_copy", "permute_copy",
           "contiguous"}  # same-dtype copies; across dtypes they are casts
# allocations, and the view whose schema does not say it aliases (reshape's of a fresh copy)
_NO_DATA = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
            "_unsafe_view"}
_WRITE_ONLY_SELF = {"copy_", "fill_", "zero_"}
_FP8_QUANTIZERS = {"tierlift::fp8_quantize", "tierlift::fp8_quantize_dual"}
DELAYED_QUANTIZER = "tierlift::fp8_quantize_delayed"
HISTORY_QUANTIZER = "tierlift::fp8_quantize_from_history"  # the same kernels, scale from history
ROW_REGISTER_LIMIT = 16384  # csrc/cuda/fp8_quant.cu: kRowRegs * kRowThreads


def fp8_quantize_reads(x: torch.Tensor, scaling: str, dual: bool) -> int:
    """How many times the CUDA FP8 quantizer reads x (csrc/cuda/fp8_quant.cu, run()): the fused
    kernel takes row and 1x128 scaling of a row-contiguous input with a single output and reads
    it once (a row longer than the registers hold twice); everything else is the tiled path, an
    amax pass then a cast pass."""
    if x.numel() == 0:
        return 0
    fused = not dual and x.stride(1) == 1 and scaling in ("row", "1x128")
    if not fused:
        return 2
    return 2 if scaling == "row" and x.shape[1] > ROW_REGISTER_LIMIT else 1


def fp8_quantize_delayed_reads(x: torch.Tensor, scale: torch.Tensor,
                               scale_used: torch.Tensor) -> int:
    """How many times the delayed quantizer reads x: once (the amax for the next scale comes out
    of the cast pass), twice where the given scale would clip and x's own is taken instead. On
    fake tensors (no values) the given scale is taken to hold: the steady state."""
    if x.numel() == 0:
        return 0
    if isinstance(scale_used, FakeTensor):
        return 1
    return 1 if torch.equal(scale_used.reshape(()), scale.float().reshape(())) else 2


def fp8_quantize_from_history_reads(x: torch.Tensor, history: torch.Tensor,
                                    fp8_dtype: torch.dtype, pow2_scale: bool,
                                    scale: torch.Tensor, amax: torch.Tensor) -> int:
    """fp8_quantize_delayed_reads for the op that takes the history: the given scale is the
    history's (reference.lowp.history_scale); the scale it returns is 1 where x has no finite
    non-zero value (amax 0), which is no recast."""
    if x.numel() == 0:
        return 0
    if isinstance(scale, FakeTensor):
        return 1
    from tierlift.reference.lowp import history_scale

    given = history_scale(history, fp8_dtype, pow2_scale)
    return 1 if amax.item() == 0 or torch.equal(scale.reshape(()), given.reshape(())) else 2


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of t's distinct elements (an expanded, stride-0 dimension counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


@dataclass(frozen=True, kw_only=True)
class Pass:
    phase: str  # "forward" or "backward" (an autograd node was running)
    kind: str  # "gemm" or one of KINDS
    op: str  # "tierlift::fp8_quantize_dual", "aten::copy_", "tierlift.lowp.scaled_mm", ...
    shapes: tuple[tuple[int, ...], ...]  # the op's tensor inputs
    read_bytes: int
    write_bytes: int
    inner_ops: tuple[str, ...] = ()  # a GEMM wrapper: the ops it ran (inverse scales, GEMM)


@dataclass(kw_only=True)
class PassCount:
    min_numel: int
    passes: list[Pass] = field(default_factory=list)  # in dispatch order, GEMMs included
    small_ops: int = 0  # ops on small tensors only (scales): one kernel launch each on a GPU

    def ops(self, kind: str | None = None) -> list[tuple[str, str]]:
        """(phase, op) of every pass (of one kind), in order."""
        return [(p.phase, p.op) for p in self.passes if kind is None or p.kind == kind]

    def emulated_gemms(self) -> int:
        """tierlift GEMMs that did not reach torch._scaled_mm (the CPU, or a fallback)."""
        return sum(1 for p in self.passes if p.op == "tierlift.lowp.scaled_mm"
                   and "aten::_scaled_mm" not in p.inner_ops)

    def summary(self) -> dict:
        """Counts per kind, GEMMs, and bytes: `bytes` is what the non-GEMM passes move."""
        kinds = Counter(p.kind for p in self.passes)
        other = [p for p in self.passes if p.kind != "gemm"]
        gemms = [p for p in self.passes if p.kind == "gemm"]
        return dict(passes=len(other), **{k: kinds.get(k, 0) for k in KINDS},
                    gemms=len(gemms), small_ops=self.small_ops,
                    bytes=sum(p.read_bytes + p.write_bytes for p in other),
                    gemm_bytes=sum(p.read_bytes + p.write_bytes for p in gemms))


def _phase() -> str:
    return "backward" if torch._C._current_autograd_node() is not None else "forward"


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _PassMode(TorchDispatchMode):
    def __init__(self, count: PassCount):
        super().__init__()
        self.count = count
        self.gemm_stack: list[list[str]] = []  # the ops run inside the open GEMM wrappers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        short = name.split("::", 1)[1]
        if func.is_view or short in _NO_DATA or name.startswith("prim::"):
            return out  # prim:: are metadata queries (a fake or subclass tensor's .device)
        if self.gemm_stack:
            self.gemm_stack[-1].append(name)
            return out
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        if not any(t.numel() >= self.count.min_numel for t in ins + outs):
            self.count.small_ops += 1
            return out
        self.count.passes.append(self._pass(func, name, short, args, kwargs, ins, outs))
        return out

    def _pass(self, func, name, short, args, kwargs, ins, outs) -> Pass:
        read = _tensors(args[1:]) if short in _WRITE_ONLY_SELF else _tensors(args)
        read += _tensors({k: v for k, v in kwargs.items() if k != "out"})
        shapes = tuple(tuple(t.shape) for t in ins)
        if name in (DELAYED_QUANTIZER, HISTORY_QUANTIZER):
            if name == DELAYED_QUANTIZER:
                reads = fp8_quantize_delayed_reads(args[0], args[1], outs[1])
            else:
                reads = fp8_quantize_from_history_reads(args[0], args[1], args[2], args[4],
                                                        outs[1], outs[-1])
            return Pass(phase=_phase(), kind="quantize", op=name, shapes=shapes,
                        read_bytes=reads * tensor_bytes(args[0]),
                        write_bytes=sum(tensor_bytes(t) for t in outs))
        if name.startswith("tierlift::"):
            if name not in _FP8_QUANTIZERS:
                raise ValueError(f"count_passes has no read model for {name} (only the FP8 "
                                 "quantizers'): its bytes would be a guess")
            reads = fp8_quantize_reads(args[0], args[1], name.endswith("_dual"))
            return Pass(phase=_phase(), kind="quantize", op=name, shapes=shapes,
                        read_bytes=reads * tensor_bytes(args[0]),
                        write_bytes=sum(tensor_bytes(t) for t in outs))
        if short in _GEMMS:
            kind = "gemm"
        elif short in _LAYOUT:
            kind = "layout" if len({t.dtype for t in ins + outs}) == 1 else "cast"
        else:
            kind = "other"
        return Pass(phase=_phase(), kind=kind, op=name, shapes=shapes,
                    read_bytes=sum(tensor_bytes(t) for t in read),
                    write_bytes=sum(tensor_bytes(t) for t in outs))

    def gemm(self, real):
        """tierlift's GEMM wrapper, recorded as one GEMM pass."""
        def wrapped(a_q, a_s, b_q, b_s, out_dtype):
            inner: list[str] = []
            self.gemm_stack.append(inner)
            try:
                y = real(a_q, a_s, b_q, b_s, out_dtype)
            finally:
                self.gemm_stack.pop()
            if not self.gemm_stack:
                ins = (a_q, a_s, b_q, b_s)
                self.count.passes.append(Pass(
                    phase=_phase(), kind="gemm", op="tierlift.lowp.scaled_mm",
                    shapes=tuple(tuple(t.shape) for t in ins),
                    read_bytes=sum(tensor_bytes(t) for t in ins), write_bytes=tensor_bytes(y),
                    inner_ops=tuple(inner)))
            return y
        return wrapped


@contextlib.contextmanager
def count_passes(min_numel: int) -> Iterator[PassCount]:
    """Record the passes over tensors of >= min_numel elements made inside the block (eager
    mode; one thread's step at a time: tierlift's GEMM wrapper is swapped while it runs)."""
    if min_numel < 1:
        raise ValueError(f"min_numel must be >= 1, got {min_numel}")
    count = PassCount(min_numel=min_numel)
    mode = _PassMode(count)
    real = gemm._scaled_mm
    gemm._scaled_mm = mode.gemm(real)
    try:
        with mode:
            yield count
    finally:
        gemm._scaled_mm = real
