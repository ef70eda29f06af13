"""--plot everywhere: each benchmark's figure from its committed JSON (and from tiny runs where
cheap), the plan's bytes per tier, the examples' training curves. Each writes a PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "examples"))
import plot_all  # noqa: E402
import plots  # noqa: E402


def needs_matplotlib():
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")


def assert_png(path) -> None:
    data = Path(path).read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC, path


def run(script, *flags, timeout=120) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script), *map(str, flags)], capture_output=True,
                         text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def test_missing_matplotlib_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plots.pyplot()


def test_plot_all_draws_every_committed_json(tmp_path, capsys):
    needs_matplotlib()
    assert plot_all.main(["--out", str(tmp_path)]) == 0
    committed = {p.stem for pattern, _, _ in plot_all.FIGURES
                 for p in (BENCH / "results").glob(pattern)}
    assert committed >= {"bench_optim-cpu", "bench_io", "bench_gather_cpu", "bench_offload-cpu",
                         "zero_offload", "bench_zero-cpu", "bench_checkpoint-cpu",
                         "bench_zero_load-cpu"}
    for stem in committed:
        assert_png(tmp_path / f"{stem}.png")
        assert (tmp_path / f"{stem}.png").stat().st_size < 100_000  # small enough to commit
    out = capsys.readouterr().out
    if not list((BENCH / "results").glob("bench_lowp-*.json")):
        assert "skip bench_lowp-*.json" in out


def test_plots_of_gpu_shaped_json(tmp_path):
    """The GPU variants, which the committed CPU JSON does not exercise (shapes as the benches
    write them)."""
    needs_matplotlib()
    gather = {"machine": {"gpu": "H100"}, "results": [
        {"row_bytes": rb, "rows_gathered": 1, "tierlift_gbs": g, "pinned_copy_gbs": 25.0,
         "cpu_path_gbs": 3.0, "fraction_of_copy": g / 25, "speedup_vs_cpu_path": g / 3}
        for rb, g in ((64, 5.0), (512, 15.0), (4096, 22.0))]}
    lowp_gpu = {"machine": "x86_64", "device": "cuda", "gpu": "H100", "quantize": [
        {"scaling": s, "dual": d, "gbs": 2000.0, "copy_gbs": 3000.0, "of_copy": 0.66}
        for s in ("tensor", "row") for d in (False, True)],
        "linear": [{"size": n, "bf16_ms": 1.0, "fp8-rowwise_speedup": 1.3,
                    "fp8-tensorwise_speedup": 1.4} for n in (2048, 4096)]}
    lowp_cpu = {"machine": "x86_64", "device": "cpu", "threads": 2, "quantize": [
        {"shape": [1024, 1024], "scaling": "row", "dual": d, "cpp_ms": 1.0, "ref_ms": 5.0,
         "speedup": 5.0} for d in (False, True)]}
    optim_cuda = {"machine": {"gpu": "H100"}, "rows": [
        {"case": "cuda-float32", "params": f"{n:.0e}", "tierlift Mparam/s": 9e4,
         "vs torch-fused": 1.1} for n in (1e7, 1e8)]}
    finetune = {"machine": {"gpu": "H100"}, "plan": {"model": "8b"}, "results": [
        {"case": "tierlift", "step_s": 2.0, "tflops": 300.0},
        {"case": "deepspeed", "error": "timed out"}]}
    # rows and contenders that failed there carry an error instead of their number (the benches
    # record it and go on): left out of the plot
    gather["results"].append({"row_bytes": 8192, "rows_gathered": 1, "pinned_copy_gbs": 25.0,
                              "tierlift_error": "RuntimeError: boom"})
    gather["results"].insert(0, {"row_bytes": 32, "error": "RuntimeError: boom"})
    lowp_gpu["quantize"].append({"scaling": "tensor", "dual": True, "error": "boom"})
    lowp_gpu["linear"].append({"size": 8192, "bf16_ms": 1.0, "fp8-rowwise_error": "boom",
                               "fp8-tensorwise_speedup": 1.5})
    optim_cuda["rows"].append({"case": "cuda-float32", "params": "1e+09",
                               "tierlift error": "boom"})
    for plot, data in ((plots.plot_gather, gather), (plots.plot_lowp, lowp_gpu),
                       (plots.plot_lowp, lowp_cpu), (plots.plot_optim, optim_cuda),
                       (plots.plot_offload, finetune)):
        assert_png(plot(data, tmp_path / f"{plot.__name__}-{id(data)}.png"))


def test_plot_lowp_draws_the_sections_a_run_wrote(tmp_path, monkeypatch):
    """A bench_lowp run with --parts that skipped quantize (and linear, CPU): the split is drawn
    and the figure names what the run left out; a JSON with no section is refused."""
    needs_matplotlib()
    cats = ("quantize", "gemm", "layout", "amax/scale", "other", "gaps")
    split = {"size": 64, "device": "cpu", "steps": 2, "contenders": {
        name: {"step_ms": 6.0, "timed_ms": 5.0, "categories": {
            c: {"ms": 1.0, "pct": 100 / 6, "calls": 1, "arg_mb": 0.1, "names": []} for c in cats}}
        for name in ("bf16 nn.Linear", "fp8-rowwise")}}
    split["contenders"]["torchao-rowwise"] = {"error": "ImportError: no torchao"}
    notes = []
    real_save = plots._save

    def save(fig, path):
        notes.extend(t.get_text() for t in fig.texts)
        notes.extend(ax.get_title() for ax in fig.axes)
        return real_save(fig, path)

    monkeypatch.setattr(plots, "_save", save)
    data = {"machine": "x86_64", "device": "cpu", "threads": 2, "split": split}
    assert_png(plots.plot_lowp(data, tmp_path / "split.png"))
    assert "not in this run: quantize, linear" in notes
    assert "where a step goes, M=N=K=64\nfailed: torchao-rowwise" in notes
    notes.clear()
    data["quantize"] = [{"shape": [64, 64], "scaling": "row", "dual": False, "cpp_ms": 1.0,
                         "ref_ms": 5.0, "speedup": 5.0}]
    assert_png(plots.plot_lowp(data, tmp_path / "both.png"))
    assert "not in this run: linear" in notes and "FP8 quantize" in notes
    with pytest.raises(ValueError, match="none of the sections quantize, linear, split"):
        plots.plot_lowp({"machine": "x86_64", "device": "cpu", "quantize": []},
                        tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_bench_io_plot_from_a_tiny_run(tmp_path):
    needs_matplotlib()
    out = run(BENCH / "bench_io.py", "--dir", tmp_path, "--size-mib", 8, "--buffer-mib", 4,
              "--repeat", 1, "--out", tmp_path / "io.json", "--plot", tmp_path / "io.png")
    assert f"wrote {tmp_path / 'io.png'}" in out
    assert_png(tmp_path / "io.png")
    assert "tensor threads" in json.loads((tmp_path / "io.json").read_text())["gbps"]


def test_bench_zero_offload_plot_from_a_tiny_run(tmp_path):
    needs_matplotlib()
    run(BENCH / "bench_zero_offload.py", "--dim", 32, "--layers", 2, "--batch", 4, "--repeats", 1,
        "--out", tmp_path / "zo.json", "--plot", tmp_path / "zo.png")
    assert_png(tmp_path / "zo.png")


def test_plan_plot(tmp_path, capsys):
    needs_matplotlib()
    from tierlift.__main__ import main

    png = tmp_path / "plan.png"
    assert main(["plan", "--params", "2e8", "--gpu-mem", "2G", "--cpu-mem", "1G", "--nvme",
                 str(tmp_path), "--probe-mib", "4", "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert_png(png)


def test_train_gpt_plot_and_recipes_on_one_chart(tmp_path):
    needs_matplotlib()
    from plot_run import save_run

    first = tmp_path / "fp32.png"
    run(ROOT / "examples" / "train_gpt.py", "--steps", 12, "--layers", 1, "--dim", 32,
        "--seq-len", 32, "--batch-size", 4, "--data-mb", 0.5, "--compare-steps", 0,
        "--device", "cpu", "--plot", first)
    assert_png(first)
    saved = json.loads(first.with_suffix(".json").read_text())
    assert saved["label"] == "fp32 tierlift" and len(saved["loss"]) == len(saved["step"]) >= 2
    assert saved["val_loss"] and saved["tokens_per_s"][-1] > 0
    # A second recipe drawn over the first (what --plot-with does at the end of a run).
    other = dict(saved, label="fp8-rowwise tierlift")
    assert_png(save_run(other, tmp_path / "both.png", [first.with_suffix(".json")]))


def test_finetune_offload_plot(tmp_path):
    needs_matplotlib()
    png = tmp_path / "ft.png"
    run(ROOT / "examples" / "finetune_offload.py", "--layers", 1, "--dim", 64, "--heads", 2,
        "--seq-len", 32, "--batch-size", 4, "--data-mb", 0.5, "--no-progress", "--steps", 6,
        "--nvme-path", tmp_path, "--plot", png)
    assert_png(png)
    saved = json.loads(png.with_suffix(".json").read_text())
    assert len(saved["step"]) == 6 and saved["breakdown"]["CPU Adam"]
