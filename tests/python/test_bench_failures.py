"""The GPU kernel benchmarks keep what they measured when part of them fails: a contender, step
kind, quantizer, variant or size that raises keeps its error in its row and the run goes on; a
section that raises keeps `<section>_error`; the JSON is rewritten after every row, through a
rename (never truncated). Their GPU code runs here on the CPU (the device is a parameter), with
failures injected the way an API missing from an older torch would raise."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tierlift

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402

needs_ext = pytest.mark.skipif(not tierlift._extension.available(),
                               reason="compiled extension not loaded")


class Drifted(torch.nn.Linear):
    """A contender whose forward hits an API this torch lacks."""

    def forward(self, x):
        raise AttributeError("module 'torch' has no attribute '_scaled_mm_v3'")


class Saver:
    """save() for a section: records a JSON round trip of `result` at every call."""

    def __init__(self, result: dict, path: Path):
        self.result, self.path, self.snapshots = result, path, []

    def __call__(self):
        common.dump_json(self.path, self.result)
        self.snapshots.append(json.loads(self.path.read_text()))


def test_dump_json_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "r.json"
    common.dump_json(path, {"rows": [1]})
    with pytest.raises(TypeError):  # not serializable: the earlier file stays as it was
        common.dump_json(path, {"rows": [object()]})
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_run_section_records_the_error_and_returns(capsys):
    result, saved = {}, []

    def broken():
        raise AttributeError("module 'torch.cuda' has no attribute 'host_memory_stats'")

    assert common.run_section(result, "quantize", lambda: saved.append(dict(result)),
                              broken) is None
    assert result == {"quantize_error": "AttributeError: module 'torch.cuda' has no attribute "
                                        "'host_memory_stats'"}
    assert saved == [result]
    assert "section quantize: FAILED" in capsys.readouterr().out


@pytest.fixture
def bench_lowp(monkeypatch):
    import bench_lowp

    monkeypatch.setattr(bench_lowp, "torchao_float8", lambda: None)  # tierlift's contenders only
    return bench_lowp


def with_drifted(bench_lowp, monkeypatch):
    real = bench_lowp.contenders

    def contenders(size, device):
        x, mods = real(size, device)
        mods["drifted"] = Drifted(size, size, bias=False, dtype=torch.bfloat16)
        return x, mods

    monkeypatch.setattr(bench_lowp, "contenders", contenders)


@needs_ext
def test_linear_keeps_every_contender_but_the_one_that_fails(bench_lowp, monkeypatch, tmp_path):
    with_drifted(bench_lowp, monkeypatch)
    rows = []
    save = Saver({"linear": rows}, tmp_path / "lowp.json")
    bench_lowp.bench_gpu_linear(SimpleNamespace(sizes=[32, 64], repeat=1), rows, save,
                                device="cpu")
    assert [r["size"] for r in rows] == [32, 64]
    for r in rows:
        assert r["drifted_error"].startswith("AttributeError: module 'torch' has no attribute")
        assert r["drifted_sum_error"].startswith("AttributeError")
        for recipe in bench_lowp.RECIPES:
            assert r[f"{recipe}_speedup"] > 0 and r[f"{recipe}_sum_speedup"] > 0
            assert f"{recipe}/separate_speedup" in r
        assert "drifted_speedup" not in r and "error" not in r
    # written as the rows fill: the first size's row is on disk before the second size starts
    first_full = next(s for s in save.snapshots if "drifted_error" in s["linear"][0])
    assert len(first_full["linear"]) == 1
    assert save.snapshots[-1]["linear"] == rows


@needs_ext
def test_linear_size_whose_baseline_fails_keeps_its_error(bench_lowp, monkeypatch, tmp_path):
    real = bench_lowp.contenders

    def contenders(size, device):
        if size == 32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real(size, device)

    monkeypatch.setattr(bench_lowp, "contenders", contenders)
    rows = []
    save = Saver({"linear": rows}, tmp_path / "lowp.json")
    bench_lowp.bench_gpu_linear(SimpleNamespace(sizes=[32, 64], repeat=1), rows, save,
                                device="cpu")
    assert rows[0] == {"size": 32, "error": "OutOfMemoryError: CUDA out of memory. Tried to "
                                            "allocate 8.00 GiB"}
    assert rows[1]["fp8-rowwise_speedup"] > 0


@needs_ext
def test_quantize_keeps_the_quantizers_that_work(bench_lowp, monkeypatch, tmp_path):
    real = bench_lowp.ops.fp8_quantize_dual

    def dual(x, scaling, *args):
        if scaling == "row":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(x, scaling, *args)

    monkeypatch.setattr(bench_lowp.ops, "fp8_quantize_dual", dual)
    rows = []
    save = Saver({"quantize": rows}, tmp_path / "lowp.json")
    bench_lowp.bench_gpu_quantize(SimpleNamespace(repeat=1), rows, save, device="cpu", n=256)
    by = {(r["scaling"], r["dual"]): r for r in rows}
    assert len(rows) == 2 * 5 + 2 + 3 and len(save.snapshots) == len(rows)
    assert by[("row", True)] == {"scaling": "row", "dual": True, "error": "RuntimeError: CUDA "
                                 "error: an illegal memory access was encountered"}
    for key, r in by.items():
        if key != ("row", True):
            assert r["gbs"] > 0 and r["of_copy"] == pytest.approx(r["gbs"] / r["copy_gbs"])


@needs_ext
def test_split_keeps_the_other_contenders_and_their_counts(bench_lowp, monkeypatch, tmp_path):
    """A forward that raises ends that contender's split and pass counts, not the run (the train
    step's grad_output is drawn with a forward, which used to run outside the guard)."""
    with_drifted(bench_lowp, monkeypatch)
    out = tmp_path / "lowp.json"
    monkeypatch.setattr(sys, "argv", ["bench_lowp.py", "--device", "cpu", "--sizes", "32",
                                      "--parts", "split", "--split-steps", "1", "--repeat", "1",
                                      "--json", str(out)])
    bench_lowp.main()
    split = json.loads(out.read_text())["split"]
    assert split["contenders"]["drifted"]["error"].startswith("AttributeError")
    assert all("error" in split["passes"]["drifted"][kind] for kind in bench_lowp.STEPS)
    assert split["contenders"]["fp8-rowwise"]["timed_ms"] > 0
    assert split["passes"]["fp8-rowwise"]["train"]["gemms"] == 3


@needs_ext
def test_a_failing_section_leaves_the_next_one(bench_lowp, monkeypatch, tmp_path):
    def broken(args, result, save):
        raise AttributeError("module 'torch.utils._python_dispatch' has no attribute "
                             "'TorchDispatchMode'")

    monkeypatch.setattr(bench_lowp, "bench_passes", broken)
    out = tmp_path / "lowp.json"
    monkeypatch.setattr(sys, "argv", ["bench_lowp.py", "--device", "cpu", "--sizes", "32",
                                      "--parts", "passes", "split", "--split-steps", "1",
                                      "--repeat", "1", "--json", str(out)])
    bench_lowp.main()
    result = json.loads(out.read_text())
    assert result["passes_error"].startswith("AttributeError: module 'torch.utils.")
    assert result["split"]["contenders"]["fp8-tensorwise"]["timed_ms"] > 0


def test_a_torchao_that_does_not_import_is_each_torchao_rows_error(monkeypatch):
    """Installed but broken (e.g. it needs a torch API this torch lacks): not taken for 'not
    installed', so the JSON says why its rows are missing."""
    import importlib.util

    import bench_lowp

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    for name in ("torchao", "torchao.float8"):  # present, but without the float8 API
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    ao = bench_lowp.torchao_float8()
    assert isinstance(ao, str)
    assert ao.startswith("torchao.float8 did not import: ImportError: cannot import name")
    _, mods = bench_lowp.contenders(32, "cpu")
    assert {mods[f"torchao-{r}"] for r in bench_lowp.TORCHAO_RECIPES} == {ao}


@needs_ext
def test_gather_variant_that_fails_or_gathers_wrong_rows_is_left_out(monkeypatch, capsys):
    """bench_gather's GPU row on the CPU: 'grouped' raises, 'warp_sorted' writes a wrong row; the
    others are timed, and neither gets numbers."""
    import bench_gather

    real = bench_gather.ops.gather_rows

    def gather_rows(table, index, out, *, kernel="auto", locality="index", **kw):
        if kernel == "grouped" and locality == "index":
            raise RuntimeError("CUDA error: too many resources requested for launch")
        real(table, index, out, kernel=kernel, locality=locality, **kw)
        if kernel == "warp" and locality == "sorted":
            out[3] += 1

    monkeypatch.setattr(bench_gather.ops, "gather_rows", gather_rows)
    row = bench_gather.bench_gpu(torch.randn(64 << 10), 256, 64 << 10, 2, device="cpu")
    assert row["grouped_error"] == ("RuntimeError: CUDA error: too many resources requested for "
                                    "launch")
    assert row["warp_sorted_error"] == "wrong rows: the output differs from table[index]"
    for name in ("grouped", "warp_sorted"):
        assert f"{name}_gbs" not in row and f"{name}_mrows_s" not in row
    for name in ("warp", "grouped_sorted"):
        assert row[f"{name}_gbs"] > 0 and row[f"{name}_of_copy"] > 0
    assert row["tierlift_gbs"] > 0 and row["pinned_copy_gbs"] > 0 and row["sort_ms"] > 0
    assert row["fraction_of_copy"] == pytest.approx(row["tierlift_gbs"] / row["pinned_copy_gbs"])
    bench_gather.print_gpu_table([row, {"row_bytes": 512, "error": "OutOfMemoryError: ..."}])
    printed = capsys.readouterr().out
    assert "grouped | failed: RuntimeError: CUDA error" in printed
    assert "512 | failed: OutOfMemoryError" in printed


@needs_ext
def test_gather_row_size_that_fails_keeps_its_error_and_the_json(monkeypatch, tmp_path):
    import bench_gather

    real = bench_gather.bench_cpu

    def bench_cpu(row_bytes, *args):
        if row_bytes == 256:
            raise MemoryError("out of memory")
        return real(row_bytes, *args)

    monkeypatch.setattr(bench_gather, "bench_cpu", bench_cpu)
    monkeypatch.setattr(bench_gather, "ROW_BYTES", [128, 256, 512])
    monkeypatch.setattr(sys, "argv", ["bench_gather.py", "--cpu-only", "--table-mib", "1",
                                      "--out-mib", "1", "--repeats", "1",
                                      "--out-dir", str(tmp_path)])
    bench_gather.main()
    rows = json.loads((tmp_path / "bench_gather_cpu.json").read_text())["results"]
    assert [r["row_bytes"] for r in rows] == [128, 256, 512]
    assert rows[1] == {"row_bytes": 256, "error": "MemoryError: out of memory"}
    assert rows[0]["tierlift_gbs"] > 0 and rows[2]["tierlift_gbs"] > 0


@needs_ext
def test_optim_cuda_rows_keep_the_contenders_that_run(monkeypatch, tmp_path):
    """bench_optim's CUDA rows on the CPU: torch's fused-mixed recipe raises at every size, and
    tierlift itself at the second size's bf16 row (which then has no Mparam/s and no ratios)."""
    import bench_optim

    real = bench_optim.cuda_contender
    sizes = [64 * 256, 64 * 512]

    def cuda_contender(name, shapes, dtype, device):
        if name == "torch-fused-mixed":
            raise AttributeError("module 'torch' has no attribute '_foreach_copy_'")
        if name == "tierlift" and dtype == torch.bfloat16 and shapes[0][0] == sizes[1] // 64:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(name, shapes, dtype, device)

    monkeypatch.setattr(bench_optim, "cuda_contender", cuda_contender)
    rows = []
    save = Saver({"rows": rows}, tmp_path / "optim.json")
    bench_optim.cuda_rows(sizes, 1, rows, save, device="cpu")
    assert [r["case"] for r in rows] == ["cpu-float32", "cpu-bfloat16"] * 2
    assert len(save.snapshots) == 4 and save.snapshots[-1]["rows"] == rows
    for r in rows[:3]:
        assert r["tierlift Mparam/s"] > 0 and r["vs torch-fused"] > 0
    assert rows[1]["torch-fused-mixed error"].startswith("AttributeError: module 'torch'")
    assert "vs torch-fused-mixed" not in rows[1]
    last = rows[3]
    assert last["tierlift error"] == ("RuntimeError: CUDA error: an illegal memory access was "
                                      "encountered")
    assert "tierlift Mparam/s" not in last and not any(k.startswith("vs ") for k in last)
    assert "torch-fused error" not in last  # it ran; only the ratio to tierlift is missing
