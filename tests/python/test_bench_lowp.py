"""benchmarks/bench_lowp.py's split of one fwd+bwd (lowp_split.py): on a tiny CPU run every
contender's categories add up to its step and 'other' names what fell into it; the rules put
units where the table says (innermost op first); and the GPU path, fed a synthetic Chrome trace
of the shape torch.profiler writes with CUDA activity, links kernels to their launching ops."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import tierlift

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lowp_split  # noqa: E402

needs_ext = pytest.mark.skipif(not tierlift._extension.available(),
                               reason="compiled extension not loaded")


@needs_ext
def test_split_on_a_tiny_cpu_run_adds_up(tmp_path, monkeypatch, capsys):
    import bench_lowp

    out, png = tmp_path / "lowp.json", tmp_path / "lowp.png"
    plot = importlib.util.find_spec("matplotlib") is not None  # --plot draws the split alone
    monkeypatch.setattr(sys, "argv", ["bench_lowp.py", "--device", "cpu", "--sizes", "64",
                                      "--parts", "split", "--split-steps", "2", "--repeat", "1",
                                      "--json", str(out)] + (["--plot", str(png)] if plot else []))
    bench_lowp.main()
    printed = capsys.readouterr().out
    if plot:
        assert f"wrote {png}" in printed and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    split = json.loads(out.read_text())["split"]
    assert split["size"] == 64 and split["device"] == "cpu"
    rows = split["contenders"]
    assert {"bf16 nn.Linear", "fp8-tensorwise", "fp8-rowwise"} <= set(rows)
    for name, r in rows.items():
        assert "error" not in r, (name, r)
        cats = r["categories"]
        assert list(cats) == list(lowp_split.CATEGORIES)
        assert all(c["ms"] >= 0 and c["calls"] >= 0 and c["arg_mb"] >= 0 for c in cats.values())
        total = sum(c["ms"] for c in cats.values())
        assert total == pytest.approx(r["step_ms"], rel=0.01, abs=1e-3), (name, total, r)
        assert sum(c["pct"] for c in cats.values()) == pytest.approx(100, abs=1)
        assert cats["gemm"]["ms"] > 0 and cats["gemm"]["calls"] > 0, name
        other = cats["other"]["names"]
        assert other and all(isinstance(n, str) and ms >= 0 for n, ms in other), (name, other)
        assert r["timed_ms"] > 0
        if name.startswith("fp8"):  # tierlift's quantize ops, found by the rules
            assert cats["quantize"]["calls"] > 0 and cats["quantize"]["arg_mb"] > 0, name
    assert rows["bf16 nn.Linear"]["categories"]["quantize"]["calls"] == 0
    assert "fell through to 'other'" in printed and "fp8-rowwise:" in printed
    for cat in lowp_split.CATEGORIES:
        assert cat in printed


@needs_ext
def test_the_gemm_opens_its_profiler_range_only_under_a_profiler(monkeypatch):
    """lowp/gemm.py's scaled_mm opens the range the split groups by itself (nothing patched):
    one fwd+bwd of Float8Linear under torch.profiler holds one range per GEMM (y, grad_x,
    grad_w), each around the CPU emulation's matmul. With no profiler running it opens none: a
    range costs microseconds even then."""
    from torch.profiler import profile

    from tierlift.lowp import Float8Linear, gemm

    torch.manual_seed(0)
    mod = Float8Linear.from_linear(torch.nn.Linear(32, 32, bias=False), "fp8-rowwise")
    x = torch.randn(16, 32, requires_grad=True)
    opened = []
    real = torch.profiler.record_function

    def counted(name, *args):
        opened.append(name)
        return real(name, *args)

    monkeypatch.setattr(torch.profiler, "record_function", counted)
    mod(x).sum().backward()
    assert opened == []
    with profile() as prof:
        mod(x).sum().backward()
    assert opened == [gemm.PROFILER_RANGE] * 3
    ranges = [e for e in prof.events() if e.name == gemm.PROFILER_RANGE]
    assert len(ranges) == 3
    for r in ranges:
        assert [c.name for c in r.cpu_children].count("aten::mm") == 1, r.cpu_children
    assert lowp_split.GEMM_RANGE == gemm.PROFILER_RANGE
    assert lowp_split.classify("aten::copy_", ["aten::copy_", gemm.PROFILER_RANGE]) == "gemm"


@pytest.mark.parametrize("name, around, expected", [
    # tierlift's amax pass inside its quantize op: the kernel's own name decides
    ("void tierlift::cuda::amax_tiles_kernel<4>(...)", ["tierlift::fp8_quantize_dual"],
     "amax/scale"),
    ("void tierlift::cuda::row_kernel<8>(...)", ["tierlift::fp8_quantize_dual"], "quantize"),
    ("nvjet_sm90_qqtst_128x256_64x4_2x1_v_bz_coopA_TNT", ["aten::_scaled_mm"], "gemm"),
    # a copy in a cast in tierlift's GEMM wrapper (the CPU emulation): casts match nothing
    ("aten::copy_", ["aten::copy_", "aten::_to_copy", "aten::to", "tierlift.lowp.scaled_mm"],
     "gemm"),
    # innermost first: the clone torchao's amax makes is a layout copy
    ("aten::copy_", ["aten::copy_", "aten::clone", "aten::contiguous", "aten::max"], "layout"),
    ("aten::abs", ["aten::abs", "matmul_with_hp_or_float8_args"], "amax/scale"),
    ("aten::copy_", ["aten::copy_", "aten::_to_copy", "aten::to", "_ToFloat8ConstrFunc"],
     "quantize"),
    # views are not layout copies
    ("aten::transpose", ["aten::transpose", "aten::t"], "other"),
    ("void at::native::reduce_kernel<512, 1>(...)", ["aten::sum"], "other"),
    ("some_new_kernel", [], "other"),
])
def test_rules(name, around, expected):
    assert lowp_split.classify(name, around) == expected


def op(name, ts, dur, tid, ext, dims=(), types=()):
    return dict(ph="X", cat="cpu_op", name=name, ts=ts, dur=dur, pid=1, tid=tid,
                args={"External id": ext, "Input Dims": [list(d) for d in dims],
                      "Input type": list(types)})


def kernel(name, ts, dur, ext, cat="kernel", **args):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=0, tid=7,
                args={"External id": ext, "device": 0, "stream": 7, **args})


def test_device_split_links_kernels_to_their_ops():
    """One step of 100 us: kernels launched from the main thread and from autograd's device
    thread (tid 3), one memcpy tied to no op; the GPU idles 30 us."""
    ev = [
        dict(ph="X", cat="user_annotation", name=lowp_split.STEP_RANGE, ts=0, dur=100, pid=1,
             tid=1, args={"External id": 1}),
        op("tierlift::fp8_quantize_dual", 1, 5, 1, 2, dims=[(64, 64), ()],
           types=["c10::BFloat16", "Scalar"]),
        op("aten::empty", 2, 1, 1, 3),
        op("aten::_scaled_mm", 7, 4, 1, 4, dims=[(64, 64), (64, 64)],
           types=["c10::Float8_e4m3fn", "c10::Float8_e4m3fn"]),
        op("aten::sum", 12, 3, 1, 5, dims=[(64, 64)], types=["c10::BFloat16"]),
        op("aten::contiguous", 20, 10, 3, 6),
        op("aten::clone", 21, 8, 3, 7),
        op("aten::copy_", 22, 6, 3, 8, dims=[(64, 64), (64, 64)],
           types=["c10::BFloat16", "c10::BFloat16"]),
        kernel("void tierlift::cuda::(anonymous namespace)::amax_tiles_kernel<4>(float*)", 10, 5,
               2),
        kernel("void tierlift::cuda::(anonymous namespace)::cast_tiles_kernel<4>(float*)", 15,
               10, 2),
        kernel("nvjet_sm90_qqtst_128x256", 25, 30, 4),
        kernel("void at::native::reduce_kernel<512, 1>(at::native::ReduceOp<float>)", 55, 5, 5),
        kernel("void at::native::elementwise_kernel<128, 4>(direct_copy_kernel_cuda)", 60, 8, 8),
        kernel("Memcpy DtoD (Device -> Device)", 68, 2, 0, cat="gpu_memcpy", bytes=4096),
        kernel("late_kernel_of_another_step", 150, 5, 0),
    ]
    split = lowp_split.split_trace(ev, "cuda")
    cats = split["categories"]
    assert split["steps"] == 1 and split["step_ms"] == pytest.approx(0.1)
    ms = {c: round(v["ms"] * 1e3, 6) for c, v in cats.items()}
    assert ms == {"quantize": 10, "gemm": 30, "layout": 10, "amax/scale": 5, "other": 5,
                  "gaps": 40}
    assert sum(ms.values()) == 100
    assert {c: v["calls"] for c, v in cats.items()} == {
        "quantize": 1, "gemm": 1, "layout": 2, "amax/scale": 1, "other": 1, "gaps": 0}
    # arg bytes: each launching op once, with its longest kernel; the memcpy's own bytes
    assert cats["quantize"]["arg_mb"] * 1e6 == 64 * 64 * 2
    assert cats["amax/scale"]["arg_mb"] == 0
    assert cats["gemm"]["arg_mb"] * 1e6 == 2 * 64 * 64
    assert cats["layout"]["arg_mb"] * 1e6 == 2 * 64 * 64 * 2 + 4096
    assert cats["other"]["names"] == [["at::native::reduce_kernel < aten::sum", 0.005]]
    assert cats["layout"]["names"][0][0] == "at::native::elementwise_kernel < aten::copy_"


def test_a_trace_without_the_step_range_is_an_error():
    with pytest.raises(RuntimeError, match=lowp_split.STEP_RANGE):
        lowp_split.split_trace([op("aten::mm", 0, 1, 1, 1)], "cpu")


def test_host_split_reports_the_median_step():
    """CPU: ops' self times, the step's own self time as 'gaps'; of three steps (10, 50 and 20 us)
    the 20 us one is reported; an op's bytes count where no data-reading op is below it."""
    def step(ts, dur, ext):
        return dict(ph="X", cat="user_annotation", name=lowp_split.STEP_RANGE, ts=ts, dur=dur,
                    pid=1, tid=1, args={"External id": ext})

    bf16 = ["c10::BFloat16", "c10::BFloat16"]
    ev = [step(0, 10, 1), op("aten::mm", 1, 8, 1, 2, dims=[(8, 8), (8, 8)], types=bf16),
          step(100, 50, 3), op("aten::mm", 101, 45, 1, 4),
          step(200, 20, 5),
          op("tierlift::fp8_quantize_dual", 201, 6, 1, 6, dims=[(16, 16)], types=bf16[:1]),
          op("aten::empty", 202, 1, 1, 7),
          op("aten::contiguous", 208, 5, 1, 8),
          op("aten::clone", 208.5, 4, 1, 9),
          op("aten::copy_", 209, 3, 1, 10, dims=[(8, 8), (8, 8)], types=bf16),
          op("aten::sum", 214, 4, 1, 11, dims=[(8, 8)], types=bf16[:1])]
    split = lowp_split.split_trace(ev, "cpu")
    assert split["steps"] == 3 and split["step_ms_all"] == [0.01, 0.05, 0.02]
    cats = split["categories"]
    ms = {c: round(v["ms"] * 1e3, 6) for c, v in cats.items()}
    assert ms == {"quantize": 6, "gemm": 0, "layout": 5, "amax/scale": 0, "other": 4, "gaps": 5}
    assert split["step_ms"] == 0.02 and sum(ms.values()) == 20
    assert cats["quantize"]["calls"] == 2 and cats["layout"]["calls"] == 3
    assert cats["quantize"]["arg_mb"] * 1e6 == 16 * 16 * 2  # aten::empty below reads nothing
    assert cats["layout"]["arg_mb"] * 1e6 == 2 * 8 * 8 * 2  # the copy_, not clone/contiguous
    assert cats["other"]["names"] == [["aten::sum < tierlift_bench_step", 0.004]]
