"""scripts/gpu_report.py on an OUT_DIR laid out as scripts/gpu_check.sh leaves it: the committed
GPU results (H200, H100) with their gpu_check logs, plus results of the current schemas from this
CPU machine (tests/python/data/gpu_report: `bench_offload.py --finetune-check --tier cpu
--overlap --contenders tierlift,torch-cpu,torch-gpu --max-grad-norm 0`, the same with `--tier
nvme --contenders tierlift --disk-json` of a 1 GB/s disk, written by running finetune() with the
check flag cleared once its plan was made, as --finetune-check itself writes no JSON;
`bench_lowp.py --device cpu --sizes 256 --parts split`, its pass counts and kernel names cut; and
`bench_io.py --dir /tmp/bio --size-mib 64 --repeat 1 --out .../bench_io-disk.json`, without
DeepSpeed). The numbers must land in their rows, targets be judged by them, each table be
followed by its command, failed rows show their error and an unknown JSON be listed as not
summarized."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DATA = Path(__file__).resolve().parent / "data" / "gpu_report"
_spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "scripts" / "gpu_report.py")
gpu_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_report)

COMMITTED = ["bench_offload_finetune-gpu-NVIDIA_H200.json",
             "bench_offload_finetune-gpu-NVIDIA_H100_80GB_HBM3.json",
             "bench_optim-gpu-NVIDIA_H200.json", "bench_lowp-cuda-gpu-NVIDIA_H100_80GB_HBM3.json",
             "bench_gather_gpu-gpu-NVIDIA_H100_80GB_HBM3.json",
             "bench_checkpoint-gpu-NVIDIA_H200.json"]
SUMMARY = """NVIDIA H200, 143771 MiB, 580.159.04
host: 16 cores, 125 GiB RAM, /dev/shm 63G (63G free)
optim: ok (13 s)
gather: skipped (GPU_CHECK_SKIP)
checkpoint: TIMED OUT after 70 s (see bench.log)
offload 1B ram: FAILED rc=1 (12 s, see bench.log)
"""
# the commands that wrote the CPU results, as gpu_check.sh logs a part's command
BENCH_LOG = """===== offload check ram (limit 60s): python benchmarks/bench_offload.py \
--finetune-check --tier cpu --overlap --contenders tierlift,torch-cpu,torch-gpu \
--max-grad-norm 0 --json-suffix check-ram
step 0: 0.11 s (0 s in)
===== offload check nvme (limit 60s): python benchmarks/bench_offload.py --finetune-check \
--tier nvme --contenders tierlift --max-grad-norm 0 --disk-json /tmp/io.json --dir /tmp/nvme \
--json-suffix check-nvme
===== lowp split (limit 60s): python benchmarks/bench_lowp.py --device cpu --sizes 256 --parts \
split --json /tmp/bench_lowp-split.json
===== disk (limit 30s): python benchmarks/bench_io.py --dir /tmp/bio --size-mib 64 --repeat 1 \
--out tests/python/data/gpu_report/bench_io-disk.json
"""


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_out")
    (out / "results").mkdir()
    for name in COMMITTED:
        shutil.copy(RESULTS / name, out / "results" / name)
    for log in RESULTS.glob("gpu_check-stage2-*.log"):
        shutil.copy(log, out / log.name)
    for path in DATA.glob("*.json"):
        shutil.copy(path, out / "results" / path.name)
    (out / "summary.txt").write_text(SUMMARY)
    (out / "bench.log").write_text(BENCH_LOG)
    # the fine-tune's failures: a peer cut off at its --timeout after two timed steps, one
    # refused before it ran, a result that stands though its process was then killed
    ram = json.loads((DATA / "bench_offload_finetune-check-ram-cpu.json").read_text())
    ram["results"][0]["after_result"] = "timed out after 75 s"
    ram["results"][0]["overlap_threads"] = 14  # a newer JSON: CPU Adam's threads in backward
    ram["results"][0]["peak_host_bytes"] = 31.46e9  # and its peak RSS, workers included
    for r in ram["results"][:2]:  # a current JSON keeps the FLOP count its TFLOPS divide
        r["flops_per_step"] = r["tflops"] * 1e12 * r["step_s"]
    ram["results"][2] = {"contender": "torch-gpu", "case": "torch-gpu",
                         "error": "does not fit: 20 B/param + activations, 112 GiB of --gpu-mem"}
    ram["results"] += [
        {"contender": "deepspeed-super", "case": "deepspeed-super",
         "error": "timed out after 75 s", "step_times": [9.1, 1.52, 1.48],
         "timed_step_times": [1.52, 1.48], "stderr_tail": ["step 2: 1.48 s (12 s in)"]},
        {"contender": "deepspeed-zero2", "case": "deepspeed-zero2",
         "error": "/dev/shm holds 8.0 GB, SuperOffload moves 8.8 GB through it"}]
    (out / "results" / "bench_offload_finetune-failures-cpu.json").write_text(json.dumps(ram))
    # the disk as gpu_check.sh names it, where DeepSpeed's aio op was not built
    disk = json.loads((DATA / "bench_io-disk.json").read_text())
    disk["errors"]["deepspeed aio"] = "not measured: no /tmp/ds_aio_ok (its op did not build)"
    (out / "results" / "bench_io-disk-gpu-NVIDIA_H200.json").write_text(json.dumps(disk))
    (out / "results" / "bench_zero-gpu-NVIDIA_H200.json").write_text('{"rows": []}')
    (out / "results" / "bench_optim-gpu-BROKEN.json").write_text('{"rows": [')
    return out


@pytest.fixture(scope="module")
def report(out_dir) -> str:
    return gpu_report.report(out_dir)


def section(report: str, name: str) -> str:
    """The section of one result file, from its heading to the next."""
    start = report.index(f"`{name}`\n")
    end = report.find("\n### ", start)
    return report[start:] if end < 0 else report[start:end]


def row(text: str, *first: str) -> list[str]:
    """The cells of the one table row whose first cells are `first`."""
    rows = [[c.strip() for c in line.strip()[1:-1].split(" | ")]
            for line in text.splitlines() if line.startswith("| ")]
    found = [r for r in rows if r[: len(first)] == list(first)]
    assert len(found) == 1, (first, found)
    return found[0]


def test_parts_table_from_summary(report):
    parts = report[report.index("### Parts"):report.index("\n### ", report.index("### Parts"))]
    assert row(parts, "optim") == ["optim", "ok (13 s)", "13"]
    assert row(parts, "checkpoint") == ["checkpoint", "TIMED OUT after 70 s (see bench.log)", "70"]
    assert row(parts, "offload 1B ram")[1:] == ["FAILED rc=1 (12 s, see bench.log)", "12"]
    assert row(parts, "gather")[2] == "—"
    assert "- NVIDIA H200, 143771 MiB, 580.159.04" in parts  # not a part: listed beneath


@pytest.mark.parametrize("params, fp32, bf16_mixed", [
    ("8e+07", 0.52, 0.52), ("2e+08", 0.70, 0.75), ("8e+08", 0.81, 0.87)])
def test_adamw_rows_as_docs_read_them_and_below_target(report, params, fp32, bf16_mixed):
    """docs/gpu.md's H200 ratios, read by hand from the same JSON: all short of 1.0x / 1.3x."""
    text = section(report, "bench_optim-gpu-NVIDIA_H200.json")
    header = row(text, "case")
    got = dict(zip(header, row(text, "cuda-float32", params)))
    assert round(float(got["vs torch-fused"].rstrip("x")), 2) == fp32
    assert (got["target"], got["met"]) == ("vs torch-fused >= 1.0x", "not met")
    got = dict(zip(header, row(text, "cuda-bfloat16", params)))
    assert round(float(got["vs torch-fused-mixed"].rstrip("x")), 2) == bf16_mixed
    assert (got["target"], got["met"]) == ("vs torch-fused-mixed >= 1.3x", "not met")
    assert text.rstrip().endswith("Command (part `optim`, gpu_check-stage2-NVIDIA_H200.log): "
                                  "`python3 benchmarks/bench_optim.py --gpu-only --cuda-sizes "
                                  "1e8,3e8,1e9`")


def test_finetune_rows_targets_and_legs(report):
    text = section(report, "bench_offload_finetune-check-ram-cpu.json")
    res = json.loads((DATA / "bench_offload_finetune-check-ram-cpu.json").read_text())["results"]
    mine = row(text, "tierlift offload=cpu overlap")
    # s/step, tokens, tokens/s, TFLOPS: the fixture predates the FLOP count without the input
    # embedding, and its TFLOPS say so
    assert mine[1:5] == ["0.0864", "64", "741", "0.000621 (older count)"]
    assert "TFLOPS marked (older count): written when the FLOPs per step counted the input " \
           "embedding" in text
    assert mine[8:12] == ["1 / 0", "1.07x (forward+backward)", "<= 1.15x", "met"]
    assert res[0]["leg_bound"]["leg"] == "forward+backward"
    assert round(res[0]["leg_bound"]["ratio"], 2) == 1.07
    assert row(text, "torch AdamW on CPU (fp32 master, pinned)")[-1] == "grad norm 1.87"
    ratio = res[0]["tflops"] / res[1]["tflops"]
    got = dict(zip(row(text, "case"), row(text, "tierlift / torch-cpu (TFLOPS)")))
    assert (got["TFLOPS"], got["target"], got["met"]) == (f"{ratio:.2f}x", ">= 2.0x", "met")
    # the ceiling: the same model with nothing offloaded, its ratio without a target
    assert res[2]["contender"] == "torch-gpu"
    assert row(text, "torch AdamW on the CPU (fp32 master, no offload)")[1:3] == ["0.134", "64"]
    got = dict(zip(row(text, "case"), row(text, "tierlift / torch-gpu (TFLOPS)")))
    assert (got["TFLOPS"], got["target"], got["met"]) == (
        f"{res[0]['tflops'] / res[2]['tflops']:.2f}x", "none: the ceiling, nothing offloaded", "")
    assert round(res[0]["compute_vs_ceiling"], 2) == 0.97
    assert mine[-1] == "2 generation(s) of 1 chunks; forward+backward 0.97x the ceiling's"
    assert row(text, "adam") == ["adam", "0.000250", "0"]  # the last step's legs
    assert row(text, "other") == ["other", "0.00164", "0.00102"]
    assert text.rstrip().endswith("--max-grad-norm 0 --json-suffix check-ram`")
    nvme = section(report, "bench_offload_finetune-check-nvme-cpu.json")
    assert row(nvme, "tierlift offload=nvme overlap", "0.0756")[9:12] == [
        "2.29x (forward+backward)", "<= 1.15x", "not met"]
    assert row(nvme, "tierlift offload=nvme overlap", "0.00163")[1:] == [
        "0.00163", "0.00163", "1.00", "1.00", "0.00327", "0.0756", "23.1x", "<= 1.25x",
        "not met"]  # the NVMe roofline, 12 B/param each way of the tiny model
    assert "--json-suffix check-nvme`" in nvme


def test_finetune_failures_show_as_such(report):
    text = section(report, "bench_offload_finetune-failures-cpu.json")
    assert row(text, "deepspeed-super")[1] == "failed"
    assert row(text, "deepspeed-super")[-1] == (
        "error: timed out after 75 s; 2 timed step(s) done: 1.52, 1.48 s")
    assert row(text, "deepspeed-zero2")[-1] == (
        "error: /dev/shm holds 8.0 GB, SuperOffload moves 8.8 GB through it")
    assert row(text, "tierlift offload=cpu overlap")[-1] == (
        "timed out after 75 s after its result (the result stands); 2 generation(s) of 1 chunks; "
        "CPU Adam on 14 threads during backward; forward+backward 0.97x the ceiling's")
    assert row(text, "tierlift offload=cpu overlap")[7] == "31.5"  # peak host GB
    assert row(text, "tierlift offload=cpu overlap")[4] == "0.000621"  # the current count
    assert "older count" not in text
    assert row(text, "torch-gpu")[1::11] == [
        "left out", "error: does not fit: 20 B/param + activations, 112 GiB of --gpu-mem"]
    assert "tierlift / deepspeed-super" not in text  # no ratio without a result
    assert "tierlift / torch-gpu" not in text
    assert "Command: not found in OUT_DIR's logs." in text
    h200 = section(report, "bench_offload_finetune-gpu-NVIDIA_H200.json")
    assert row(h200, "tierlift")[1:2] + row(h200, "tierlift")[-1:] == [
        "failed", "error: timed out after 80 s"]
    assert row(h200, "torch AdamW on CPU (fp32 master, pinned)")[1:6] == [
        "1.09", "—", "—", "13.9 (older count)", "6.99"]  # an older JSON: no tokens recorded
    assert "--steps 6 " in h200  # from the H200's log, the H100's from its own
    assert "--steps 10 " in section(report, "bench_offload_finetune-gpu-NVIDIA_H100_80GB_HBM3.json")


def test_lowp_quantize_linear_and_split(report):
    text = section(report, "bench_lowp-cuda-gpu-NVIDIA_H100_80GB_HBM3.json")
    assert "D2D copy 2345 GB/s" in text
    assert row(text, "FP8 rowwise")[1:5] == ["1099", "47%", ">= 85%", "not met"]
    assert row(text, "FP8 rowwise + transposed (dual)")[1:5] == ["228", "10%", ">= 60%", "not met"]
    assert row(text, "NVFP4")[1:5] == ["75.5", "3%", ">= 50%", "not met"]
    assert row(text, "8192", "4.56", "fp8-tensorwise")[3:7] == [
        "0.967x", "—", ">= 1.35x", "not met"]  # an older JSON: one step kind
    assert row(text, "8192", "4.56", "fp8-rowwise")[5:7] == [">= 1.2x", "not met"]
    assert row(text, "8192", "4.56", "fp8-rowwise-gw-hp")[5:7] == ["", ""]  # no target
    assert "`python3 benchmarks/bench_lowp.py --device cuda --sizes 8192`" in text
    split = section(report, "bench_lowp-split-cpu.json")
    cells = dict(zip(row(split, "contender"), row(split, "fp8-tensorwise")))
    assert (cells["timed ms"], cells["vs bf16"], cells["gemm"]) == ("2.80", "8.55x", "166 (99%)")
    assert "M=N=K=256, train step" in split and "--parts split" in split


def test_gather_and_checkpoint_rows(report):
    text = section(report, "bench_gather_gpu-gpu-NVIDIA_H100_80GB_HBM3.json")
    assert row(text, "256") == ["256", "25.9", "—", "52.3", "50%", "4.15x", ">= 80%", "not met",
                                ""]
    assert row(text, "2048")[4:8] == ["91%", "6.60x", ">= 80%", "met"]
    assert row(text, "128")[6:8] == ["", ""]  # below 256 B: no target
    assert "Kernel variants" not in text  # that JSON predates them
    text = section(report, "bench_checkpoint-gpu-NVIDIA_H200.json")
    assert row(text, "1", "optim in RAM", "tierlift save(blocking=False)")[3:7] == [
        "0.459", "9.96", "12.0", "1.21"]
    assert "--out benchmarks/results/bench_checkpoint.json`" in text


def test_disk_rows_and_errors(report):
    text = section(report, "bench_io-disk.json")
    gbps = json.loads((DATA / "bench_io-disk.json").read_text())["gbps"]
    assert "64 MiB file in /tmp/bio, block 1024 KiB, queue depth 32, median of 1 round(s)" in text
    assert row(text, "fio")[1:6] == ["1.53", "1.34", "1.00x", "1.00x", "—"]
    assert row(text, "tierlift uring")[1:6] == ["2.12", "3.05", "1.39x", "2.27x", "direct 100%"]
    assert row(text, "tensor threads")[1:6] == ["2.31", "0.740", "1.51x", "0.551x", "staged 100%"]
    # the NVMe roofline's bandwidths: the fastest read and the fastest write, whichever rows
    assert max(gbps, key=lambda k: gbps[k]["read"]) == "tensor threads"
    assert row(text, "tensor threads")[-1] == "the fastest read, the NVMe roofline's"
    assert row(text, "tierlift threads")[-1] == "the fastest write, the NVMe roofline's"
    assert "deepspeed aio" not in text  # not installed where the fixture was made
    assert "--out tests/python/data/gpu_report/bench_io-disk.json`" in text
    h200 = section(report, "bench_io-disk-gpu-NVIDIA_H200.json")
    assert row(h200, "deepspeed aio") == ["deepspeed aio", "—", "—", "—", "—", "—", (
        "error: not measured: no /tmp/ds_aio_ok (its op did not build)")]
    assert "GPU: none recorded; CPU: ? (2 cores); torch ?." in h200  # bench_io's machine


def test_unknown_and_broken_json_are_listed_not_summarized(report):
    assert "not summarized: bench_zero-gpu-NVIDIA_H200.json\n" in report
    assert "not summarized: bench_optim-gpu-BROKEN.json (JSONDecodeError: " in report


def test_command_line_prints_or_writes_the_same(out_dir, report, tmp_path):
    script = str(ROOT / "scripts" / "gpu_report.py")
    printed = subprocess.run([sys.executable, script, str(out_dir)], capture_output=True,
                             text=True, check=True).stdout
    subprocess.run([sys.executable, script, str(out_dir), "--out", str(tmp_path / "r.md")],
                   check=True)
    assert printed == (tmp_path / "r.md").read_text() == report


def test_a_target_the_benchmark_no_longer_defines_is_an_error():
    with pytest.raises(SystemExit, match="no longer defines NO_SUCH"):
        gpu_report.benchmark_constant("offload_finetune.py", "NO_SUCH")


def test_a_linear_row_with_emulated_gemms_gets_no_verdict():
    """Its GEMMs ran in the emulation (torch._scaled_mm refused them): not an FP8 speed, so
    neither met nor not met."""
    import gpu_report_kernels  # on sys.path once gpu_report is loaded
    row_ = {"size": 256, "bf16_ms": 1.0, "fp8-tensorwise_speedup": 2.0,
            "fp8-tensorwise_emulated_gemms": 3, "fp8-rowwise_speedup": 2.0}
    text = "\n".join(gpu_report_kernels.linear_table([row_]))
    assert row(text, "256", "1.00", "fp8-tensorwise")[5:7] == [">= 1.35x", ""]
    assert row(text, "256", "1.00", "fp8-rowwise")[5:7] == [">= 1.2x", "met"]
