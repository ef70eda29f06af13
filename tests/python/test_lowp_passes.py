"""Passes over memory of Float8Linear's forward + backward (tierlift.lowp.passes): each recipe
makes exactly the minimal passes (docs/lowp.md, "Passes over memory"), so a change that adds a
quantize, copy, cast or elementwise pass over a layer-sized tensor fails here; the gradients a
step skips (frozen weight, input without grad) change no bit of the ones it computes; and the
counter itself counts what it claims (views free, copies and casts caught, expanded tensors by
their distinct bytes, no guessing for ops it has no read model for)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import tierlift
from tierlift import ops
from tierlift.lowp import RECIPES, float8_linear, gemm
from tierlift.lowp.linear import GatheredFloat8Weight
from tierlift.lowp.passes import ROW_REGISTER_LIMIT, count_passes, fp8_quantize_reads

ROOT = Path(__file__).resolve().parents[2]
needs_ext = pytest.mark.skipif(not tierlift._extension.available(),
                               reason="compiled extension not loaded")
M, K, N = 64, 128, 96  # x [M, K], W [N, K], y [M, N]: distinct, so shapes name the operand
BIG = min(M * K, N * K, M * N)
Q, QD, GEMM, MM = ("tierlift::fp8_quantize", "tierlift::fp8_quantize_dual",
                   "tierlift.lowp.scaled_mm", "aten::mm")


def step(recipe, *, x_grad=True, w_grad=True, bias=False, gathered=None, seed=0):
    """One fwd+bwd of float8_linear on bf16 tensors with a contiguous grad_output, under the
    counter: (count, y, x.grad, w.grad)."""
    torch.manual_seed(seed)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=x_grad)
    w = torch.randn(N, K, dtype=torch.bfloat16, requires_grad=w_grad)
    b = torch.randn(N, dtype=torch.bfloat16, requires_grad=True) if bias else None
    g = torch.randn(M, N, dtype=torch.bfloat16)
    with count_passes(BIG) as count:
        y = float8_linear(x, w, b, recipe, gathered)
        if y.requires_grad:
            y.backward(g)
    return count, y, x.grad, w.grad


def quantize_bytes(rows, cols, reads, outputs, scales):
    """bf16 [rows, cols] read `reads` times, `outputs` FP8 copies and `scales` fp32 scales out."""
    return reads * rows * cols * 2 + outputs * rows * cols + 4 * scales


@needs_ext
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fwd_bwd_makes_the_minimal_passes(recipe):
    r = RECIPES[recipe]
    count, *_ = step(recipe)
    if r.grad_weight_high_precision:  # x^T is never quantized: the wgrad reads bf16 x and g
        want = [("forward", Q), ("forward", QD), ("forward", GEMM),
                ("backward", MM), ("backward", Q), ("backward", GEMM)]
        shapes = [((M, K),), ((N, K),), ((M, N),)]
    else:  # x, W and g once each, each with its transposed copy from the same reads
        want = [("forward", QD), ("forward", QD), ("forward", GEMM),
                ("backward", QD), ("backward", GEMM), ("backward", GEMM)]
        shapes = [((M, K),), ((N, K),), ((M, N),)]
    assert count.ops() == want
    assert [p.shapes for p in count.passes if p.kind == "quantize"] == shapes
    assert count.small_ops == 0  # no stray op on the scales outside the GEMM wrapper
    s = count.summary()
    assert (s["passes"], s["quantize"], s["gemms"]) == (3, 3, 3)
    assert s["layout"] == s["cast"] == s["other"] == 0
    rows = r.scaling == "row"  # scales: one per row of each output, else one per copy

    def dual(a, b):  # 2 reads (amax, cast), q and q^T
        return quantize_bytes(a, b, 2, 2, (a + b) if rows else 2)

    def single_row(a, b):  # the fused row kernel: one read (rows <= ROW_REGISTER_LIMIT)
        return quantize_bytes(a, b, 1, 1, a)

    if r.grad_weight_high_precision:
        want_bytes = single_row(M, K) + dual(N, K) + single_row(M, N)
    else:
        want_bytes = dual(M, K) + dual(N, K) + dual(M, N)
    assert s["bytes"] == want_bytes


@needs_ext
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_frozen_weight_or_input_without_grad_skips_what_nobody_reads(recipe):
    """A frozen weight (LoRA) needs no x^T, no g^T and no wgrad GEMM; an input without grad no
    W^T and no dgrad GEMM (g^T alone is quantized from g's transposed view); under no_grad the
    forward quantizes x and W once each, single."""
    hp = RECIPES[recipe].grad_weight_high_precision
    count, *_ = step(recipe, w_grad=False)
    assert count.ops() == [("forward", Q), ("forward", QD), ("forward", GEMM),
                           ("backward", Q), ("backward", GEMM)]
    count, *_ = step(recipe, x_grad=False)
    if hp:
        assert count.ops() == [("forward", Q), ("forward", Q), ("forward", GEMM),
                               ("backward", MM)]
    else:
        assert count.ops() == [("forward", QD), ("forward", Q), ("forward", GEMM),
                               ("backward", Q), ("backward", GEMM)]
        assert count.passes[3].shapes == ((N, M),)  # g^T, a view: no transposing copy
    with torch.no_grad():
        count, *_ = step(recipe)
    assert count.ops() == [("forward", Q), ("forward", Q), ("forward", GEMM)]


@needs_ext
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_skipped_gradients_leave_the_others_bit_identical(recipe):
    _, y, gx, gw = step(recipe, seed=3)
    _, y_frozen, gx_frozen, gw_frozen = step(recipe, w_grad=False, seed=3)
    _, y_const, gx_const, gw_const = step(recipe, x_grad=False, seed=3)
    assert gw_frozen is None and gx_const is None
    for a, b in ((y, y_frozen), (y, y_const), (gx, gx_frozen), (gw, gw_const)):
        assert torch.equal(a, b)


@needs_ext
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_separate_transposed_copies_give_the_same_bits_with_their_own_passes(recipe):
    """Float8Recipe.transposed_copy="separate": q first, then q^T as the transposed codes
    (tensorwise: one layout pass each) or the quantization of the transposed view (rowwise: a
    second quantize), for the GPU to time against the dual quantizer. Same outputs, bit for bit."""
    r = RECIPES[recipe]
    separate = dataclasses.replace(r, transposed_copy="separate")
    dual_count, y, gx, gw = step(r, seed=5)
    count, y_sep, gx_sep, gw_sep = step(separate, seed=5)
    for a, b in ((y, y_sep), (gx, gx_sep), (gw, gw_sep)):
        assert torch.equal(a, b)
    transposed = 1 if r.grad_weight_high_precision else 3  # W^T; and x^T, g^T for an FP8 wgrad
    kinds = Counter(p.kind for p in count.passes)
    dual_kinds = Counter(p.kind for p in dual_count.passes)
    if r.scaling == "tensor":
        assert kinds == dual_kinds + Counter(layout=transposed)
        assert [p.op for p in count.passes if p.kind == "layout"] == ["aten::clone"] * transposed
    else:
        assert kinds == dual_kinds + Counter(quantize=transposed)
    assert QD not in [p.op for p in count.passes]
    with pytest.raises(ValueError, match="transposed_copy"):
        dataclasses.replace(r, transposed_copy="fused")


@needs_ext
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_bias_costs_its_add_and_its_reduction(recipe):
    """y + bias is one pass over y (rounding y to bf16 first, as before: fusing it into the
    GEMM's epilogue would round once and change the numbers) and grad_bias one reduction of g."""
    count, *_ = step(recipe, bias=True)
    other = [(p.phase, p.op) for p in count.passes if p.kind == "other"]
    assert other == [("forward", "aten::add"), ("backward", "aten::sum")]
    assert count.summary()["passes"] == 5


@needs_ext
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise"])
def test_gathered_weight_makes_its_dgrad_operand_once_without_a_code_transpose(recipe):
    """ZeRO-3's FP8 weight: the forward quantizes only x; the dgrad operand is made on the first
    backward and reused. Tensorwise transposes the gathered bytes (one layout pass); rowwise
    dequantizes (cast + divide) and requantizes W's transposed view: no layout pass."""
    r = RECIPES[recipe]
    torch.manual_seed(1)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    gathered = GatheredFloat8Weight(data=(qs := ops.fp8_quantize(w, r.scaling, r.forward_dtype,
                                                                 r.pow2_scale))[0],
                                    scale=qs[1], recipe=r)
    first, *_ = step(recipe, gathered=gathered)
    again, *_ = step(recipe, gathered=gathered)
    want = [("forward", QD), ("forward", GEMM), ("backward", QD), ("backward", GEMM),
            ("backward", GEMM)]
    assert again.ops() == want
    made = [(p.phase, p.kind, p.op) for p in first.passes if (p.phase, p.op) not in want]
    if r.scaling == "tensor":
        assert made == [("forward", "layout", "aten::clone")]
    else:
        assert made == [("forward", "cast", "aten::_to_copy"), ("forward", "other", "aten::div"),
                        ("forward", "quantize", Q)]
    wtq, wts = gathered.transposed()
    assert wtq.shape == (K, N) and wtq.is_contiguous()
    assert wts.shape == ((1, 1) if r.scaling == "tensor" else (K, 1))


@needs_ext
def test_delayed_layer_reads_x_and_g_once_once_its_history_holds():
    """fp8-tensorwise-delayed's Float8Linear: the quantizes of x and g take a scale chosen ahead,
    one read each (two on the first step, whose never-filled history makes them take x's own
    scale, and where a jump in range would clip); W stays just in time (dual, 2 reads)."""
    from tierlift.lowp import Float8Linear
    from tierlift.lowp.passes import HISTORY_QUANTIZER as DQ

    torch.manual_seed(0)
    layer = Float8Linear(K, N, bias=False, recipe="fp8-tensorwise-delayed", dtype=torch.bfloat16)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    g = torch.randn(M, N, dtype=torch.bfloat16)
    counts = []
    for c in (1.0, 0.5, 4.0):  # never filled, from the history, a jump
        xc, gc = (x * c).requires_grad_(), g * c
        layer.weight.grad = None
        with count_passes(BIG) as count:
            layer(xc).backward(gc)
        counts.append(count)
    want = [("forward", DQ), ("forward", QD), ("forward", GEMM),
            ("backward", DQ), ("backward", GEMM), ("backward", GEMM)]
    w_dual = quantize_bytes(N, K, 2, 2, 2)

    def delayed_dual(rows, cols, reads):  # q and q^T, the scale used and the amax
        return quantize_bytes(rows, cols, reads, 2, 2)

    for count, reads in zip(counts, (2, 1, 2), strict=True):
        assert count.ops() == want
        quantized = sum(p.read_bytes + p.write_bytes for p in count.passes if p.kind == "quantize")
        assert quantized == delayed_dual(M, K, reads) + w_dual + delayed_dual(M, N, reads)


@needs_ext
def test_the_counter_catches_copies_casts_and_elementwise_passes_and_skips_views():
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    with count_passes(64 * 32) as count:
        v = x.t().reshape(-1)  # a transpose view, then the copy flattening it takes
        x.float()
        x * 2
        x.t()
        x[:, :4].sum()  # a small op
    assert [(p.kind, p.op) for p in count.passes] == [
        ("layout", "aten::clone"), ("cast", "aten::_to_copy"), ("other", "aten::mul")]
    assert [p.read_bytes + p.write_bytes for p in count.passes] == [
        2 * 64 * 32 * 2, 64 * 32 * (2 + 4), 2 * 64 * 32 * 2]
    assert count.small_ops == 1 and v.shape == (64 * 32,)
    ones = torch.ones((), dtype=torch.bfloat16).expand(64, 32)  # autograd's grad of sum()
    with count_passes(64 * 32) as count:
        ones.contiguous()
    assert [(p.op, p.read_bytes, p.write_bytes) for p in count.passes] == [
        ("aten::clone", 2, 64 * 32 * 2)]
    dst = torch.empty(64, 32)
    with count_passes(64 * 32) as count:
        dst.copy_(x)  # the destination is written, not read
    assert [(p.kind, p.read_bytes, p.write_bytes) for p in count.passes] == [
        ("cast", 64 * 32 * 2, 64 * 32 * 4)]


@needs_ext
def test_sum_backward_step_adds_its_own_passes():
    """What bench_lowp's 'sum' step adds to every contender: the sum, a copy of its expanded
    grad_output, and two gradient additions once gradients accumulate."""
    torch.manual_seed(0)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, dtype=torch.bfloat16, requires_grad=True)
    float8_linear(x, w, None, "fp8-tensorwise").sum().backward()
    with count_passes(BIG) as count:
        float8_linear(x, w, None, "fp8-tensorwise").sum().backward()
    extra = [(p.phase, p.kind, p.op) for p in count.passes if p.kind not in ("quantize", "gemm")]
    assert extra == [("forward", "other", "aten::sum"), ("backward", "layout", "aten::clone"),
                     ("backward", "other", "aten::add_"), ("backward", "other", "aten::add_")]


@needs_ext
def test_refuses_what_it_cannot_count_and_restores_the_gemm():
    real = gemm._scaled_mm
    with pytest.raises(ValueError, match="min_numel"):
        with count_passes(0):
            pass
    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match="no read model for tierlift::fp4_quantize"):
        with count_passes(64 * 64):
            ops.fp4_quantize(x, "floor")
    assert gemm._scaled_mm is real


def test_read_model_follows_the_cuda_dispatch():
    src = (ROOT / "csrc/cuda/fp8_quant.cu").read_text()
    threads = int(re.search(r"constexpr int kRowThreads = (\d+);", src).group(1))
    regs = int(re.search(r"constexpr int kRowRegs = (\d+);", src).group(1))
    assert threads * regs == ROW_REGISTER_LIMIT
    x = torch.empty(16, ROW_REGISTER_LIMIT)
    assert fp8_quantize_reads(x, "row", False) == 1  # fused, in registers
    assert fp8_quantize_reads(x, "1x128", False) == 1
    assert fp8_quantize_reads(torch.empty(4, ROW_REGISTER_LIMIT + 8), "row", False) == 2
    assert fp8_quantize_reads(torch.empty(4, ROW_REGISTER_LIMIT + 8), "1x128", False) == 1
    for scaling in ("tensor", "col", "128x128"):  # tiled: amax pass, cast pass
        assert fp8_quantize_reads(x, scaling, False) == 2
    assert fp8_quantize_reads(x, "row", True) == 2  # dual: tiled
    assert fp8_quantize_reads(x.t(), "row", False) == 2  # strided: tiled
    assert fp8_quantize_reads(torch.empty(0, 8), "row", False) == 0


@needs_ext
def test_bench_prints_the_passes_per_contender(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_lowp

    out = tmp_path / "lowp.json"
    monkeypatch.setattr(sys, "argv", ["bench_lowp.py", "--device", "cpu", "--sizes", "64",
                                      "--parts", "split", "--split-steps", "1", "--repeat", "1",
                                      "--json", str(out)])
    bench_lowp.main()
    printed = capsys.readouterr().out
    split = json.loads(out.read_text())["split"]
    assert split["step"] == "train" and split["copy_gbs"] > 0
    passes = split["passes"]
    for name in RECIPES:
        train, summed = passes[name]["train"], passes[name]["sum"]
        assert (train["passes"], train["quantize"], train["gemms"]) == (3, 3, 3)
        assert (summed["layout"], summed["other"]) == (1, 3)
        assert train["emulated_gemms"] == (2 if RECIPES[name].grad_weight_high_precision else 3)
        assert f"{name} train" in printed
    bf16 = passes["bf16 nn.Linear"]["train"]
    assert (bf16["passes"], bf16["gemms"], bf16["bytes"]) == (0, 3, 0)
    assert "non-GEMM MB" in printed


@needs_ext
def test_bench_counts_8192_on_fake_tensors(tmp_path, monkeypatch, capsys):
    """docs/lowp.md's byte counts at M = N = K = 8192, from the count on fake tensors."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_lowp

    out, n = tmp_path / "passes.json", 8192
    monkeypatch.setattr(sys, "argv", ["bench_lowp.py", "--device", "cpu", "--parts", "passes",
                                      "--sizes", str(n), "--json", str(out)])
    bench_lowp.main()
    got = json.loads(out.read_text())["passes"][str(n)]["passes"]
    dual_tensor, dual_row, single_row = 6 * n * n + 8, 6 * n * n + 8 * n, 3 * n * n + 4 * n
    assert got["fp8-tensorwise"]["train"]["bytes"] == 3 * dual_tensor == 1_207_959_576
    assert got["fp8-rowwise"]["train"]["bytes"] == 3 * dual_row
    assert got["fp8-rowwise-gw-hp"]["train"]["bytes"] == 2 * single_row + dual_row == 805_437_440
    # delayed: x and g read once each (2 bytes), q and q^T written, scale and amax out; W as
    # tensorwise (on fake tensors the history's scale is taken to hold: no second read)
    delayed_dual = 4 * n * n + 8
    assert got["fp8-tensorwise-delayed"]["train"]["bytes"] == 2 * delayed_dual + dual_tensor \
        == 939_524_120
    # separate: tensorwise q (2 reads, 1 write) + transposed codes (1 read, 1 write); rowwise
    # the fused row kernel (1 read, 1 write) + the transposed view's (tiled: 2 reads, 1 write)
    assert got["fp8-tensorwise/separate"]["train"]["bytes"] == 21 * n * n + 12 == 1_409_286_156
    assert got["fp8-rowwise/separate"]["train"]["bytes"] == 24 * n * n + 24 * n == 1_610_809_344
    assert got["fp8-rowwise-gw-hp/separate"]["train"]["bytes"] == 14 * n * n + 16 * n
    # the sum step: sum (read), two gradient additions (2 reads, 1 write), FP8's grad copy
    sum_extra = 2 * n * n + 2 * 3 * 2 * n * n
    assert got["bf16 nn.Linear"]["sum"]["bytes"] == sum_extra + 2  # + the 0-d sum's output
    assert got["fp8-tensorwise"]["sum"]["bytes"] == 3 * dual_tensor + sum_extra + 2 + 2 * n * n + 2
    assert "fp8-rowwise-gw-hp train" in capsys.readouterr().out
