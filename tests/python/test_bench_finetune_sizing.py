"""bench_offload.py --gpu's sizing and its CPU checks (benchmarks/finetune_sizing.py,
offload_finetune.py): the RAM tier under a --cpu-budget below two generations runs the
overlap's spare path, a budget below one generation is refused before any case starts, the
plan counts the pinned state at its size, the NVMe step is set against the disk bandwidth of a
bench_io.py result, and a tierlift step against its longest leg; deepspeed-nvme's disk and pinned
bytes are checked before any case starts, its bytes counted at DeepSpeed's aio handle, and each
case's files removed before the next starts (offload_deepspeed.py; DeepSpeed itself runs in
test_bench_deepspeed.py)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import tierlift
from tierlift import _peak_rss

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]
import finetune_sizing as fs  # noqa: E402
import offload_deepspeed as ods  # noqa: E402
import offload_finetune as of  # noqa: E402

del sys.path[:2]

needs_ext = pytest.mark.skipif(not tierlift._extension.available(),
                               reason="compiled extension not loaded")


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--plot", default=None)
    of.add_finetune_args(ap)
    return ap.parse_args(list(argv))


@needs_ext
def test_overlap_under_a_budget_below_two_generations_steps_spare_chunks_ahead():
    """The tiny model's tierlift case, as --finetune-check runs it, with 34 chunks of 16 KiB
    and a budget of one generation plus room for about half of them: spare blocks exist, the
    warning for none is not raised, and the last step kept chunks stepped during backward."""
    args = parse("--finetune-check", "--tier", "cpu", "--overlap", "--cpu-budget", "0.0023",
                 "--chunk-bytes", "16384", "--max-grad-norm", "0", "--steps", "2",
                 "--warmup", "1", "--seq-len", "32", "--batch-size", "2")
    n = fs.config("tiny", 32).num_params()
    assert 12 * n < args.cpu_budget * fs.GiB < 24 * n  # one generation, not two
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "no spare chunk beside it" would fail here
        out = of.run_tierlift(args, {"model": "tiny", "tier": "cpu"}, torch.device("cpu"))
    assert out["generations"] == 1
    assert 0 < out["spare_chunks"] < out["chunks"], out
    st = out["stats"]
    assert st["overlap_kept_chunks"] > 0 and st["overlap_redone_chunks"] == 0, st
    # the chunks without a block were left to step(), which stepped them in place
    assert st["overlap_no_room_chunks"] > 0 and st["ram_chunks"] > 0, st
    assert out["step_s"] > 0 and out["cpu_budget"] == int(args.cpu_budget * fs.GiB)
    note = of.case_note(out)
    assert f"one generation and {out['spare_chunks']} spare blocks" in note, note
    assert f"{st['overlap_kept_chunks']:.0f} chunks stepped during backward and kept" in note


@needs_ext
def test_compact_state_holds_two_generations_where_fp32_holds_one():
    """--state-dtype bf16 (tierlift's compact state, 7.02 B/param): the budget under which the
    test above holds one fp32 generation and spare blocks holds two compact ones, so every
    chunk is stepped during backward and kept; the sizing counts it at the layout's bytes."""
    from tierlift.offload.layout import chunk_bytes, state_kinds

    per = chunk_bytes(state_kinds(False, "bf16"), 1 << 20, aligned=False) / (1 << 20)
    assert fs.STATE_BYTES == {"fp32": 12, "bf16": per}
    args = parse("--finetune-check", "--tier", "cpu", "--overlap", "--cpu-budget", "0.0023",
                 "--chunk-bytes", "16384", "--max-grad-norm", "0", "--steps", "2",
                 "--warmup", "1", "--seq-len", "32", "--batch-size", "2", "--state-dtype", "bf16")
    n = fs.config("tiny", 32).num_params()
    assert 2 * per * n < args.cpu_budget * fs.GiB < 24 * n  # two compact generations, one fp32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = of.run_tierlift(args, {"model": "tiny", "tier": "cpu"}, torch.device("cpu"))
    assert out["generations"] == 2 and out["spare_chunks"] == 0, out
    assert out["state_dtype"] == "bf16" and out["case"].endswith("state_dtype=bf16")
    st = out["stats"]
    assert st["overlap_kept_chunks"] == out["chunks"] and st["overlap_redone_chunks"] == 0, st
    assert st.get("overlap_no_room_chunks", 0) == 0, st
    # 7B: two compact generations (88.1 GiB pinned) fit 128 GiB, where fp32's 24 B/param do not
    got = fs.plan(parse("--gpu", "--model", "7b", "--tier", "cpu", "--overlap",
                        "--state-dtype", "bf16", "--batch-size", "4", "--gpu-mem", "140"))
    n7 = got["params"]
    assert got["ram_tier_bytes"] == 2 * int(per * n7) and got["spare_share"] is None
    assert got["ram_tier_pinned_bytes"] == 2 * int(per * n7) + fs.STAGING


def no_case(*_a, **_k):
    raise AssertionError("a case started")


@pytest.mark.parametrize("argv, match", [
    (("--finetune-check", "--tier", "cpu", "--overlap", "--cpu-budget", "0.001"),
     "below one generation"),
    (("--finetune-check", "--tier", "nvme", "--cpu-budget", "1"), "--nvme-budget"),
    (("--gpu", "--plan-only", "--model", "7b", "--tier", "cpu", "--overlap", "--cpu-budget",
      "70", "--batch-size", "4", "--gpu-mem", "140"), "below one generation"),
    (("--finetune-check", "--tier", "cpu", "--disk-json", "x.json"), "NVMe tier"),
    (("--finetune-check", "--tier", "cpu", "--overlap", "--state-dtype", "bf16",
      "--device-fraction", "0.3"), "not a measured combination"),
    (("--finetune-check", "--tier", "cpu", "--overlap", "--state-dtype", "bf16",
      "--cpu-budget", "0.0008"), r"7\.016 B/param .* \(compact state\)"),
])
def test_refused_before_any_case_starts(argv, match, monkeypatch):
    monkeypatch.setattr(of, "_run_case_process", no_case)
    with pytest.raises(SystemExit, match=match):
        of.finetune(parse(*argv))


def test_plan_counts_the_pinned_state_at_its_size():
    # 7B under a 100 GiB budget: one generation (27 GB per kind, 75.3 GiB) plus ~32% of the
    # chunks spare, pinned at their size (tierlift._pinned) beside the staging slots; a budget
    # past --cpu-mem x FIT (108.8 GiB) is refused.
    got = fs.plan(parse("--gpu", "--model", "7b", "--tier", "cpu", "--overlap",
                        "--cpu-budget", "100", "--batch-size", "4", "--gpu-mem", "140"))
    n = got["params"]
    assert got["tokens_per_step"] == 8192 and got["ram_tier_bytes"] == 100 * fs.GiB
    assert got["ram_tier_pinned_bytes"] == 100 * fs.GiB + fs.STAGING
    assert 0.28 < got["spare_share"] < 0.36
    assert got["deepspeed_fits"] and not got["torch_cpu_fits"]  # 16 vs 18 B/param
    assert got["gpu_bytes"] == 4 * n + fs.activation_bytes(fs.config("7b", 2048), 8192)
    with pytest.raises(SystemExit, match="does not fit"):
        fs.plan(parse("--gpu", "--model", "7b", "--tier", "cpu", "--overlap",
                      "--cpu-budget", "109", "--batch-size", "4", "--gpu-mem", "140"))
    # without a budget the overlap's two generations (24 B/param) do not fit 128 GiB
    with pytest.raises(SystemExit, match="does not fit"):
        fs.plan(parse("--gpu", "--model", "7b", "--tier", "cpu", "--overlap",
                      "--batch-size", "4", "--gpu-mem", "140"))
    one_b = fs.plan(parse("--gpu", "--model", "1b", "--tier", "cpu", "--overlap",
                          "--batch-size", "8", "--gpu-mem", "140"))
    assert one_b["tokens_per_step"] == 16384 and one_b["spare_share"] is None
    assert one_b["ram_tier_bytes"] == 24 * one_b["params"]


def write_bench_io(path: Path, gbps: dict) -> Path:
    path.write_text(json.dumps({"config": {}, "gbps": gbps}))
    return path


def test_nvme_roofline_from_a_bench_io_result(tmp_path):
    disk = fs.read_disk_json(str(write_bench_io(tmp_path / "io.json", {
        "tierlift uring": {"write": 2.0, "read": 4.0},
        "tensor uring": {"write": 2.5, "read": 3.0}})))
    assert disk["read_Bps"] == 4e9 and disk["write_Bps"] == 2.5e9  # the fastest row of each
    assert (disk["read_row"], disk["write_row"]) == ("tierlift uring", "tensor uring")
    r = fs.nvme_roofline({"nvme_read_bytes": 8e9, "nvme_write_bytes": 5e9}, 5.0, disk)
    assert r["roofline_s"] == pytest.approx(8e9 / 4e9 + 5e9 / 2.5e9)  # 4 s
    assert r["ratio"] == pytest.approx(1.25) and r["met"]
    assert not fs.nvme_roofline({"nvme_read_bytes": 8e9, "nvme_write_bytes": 5e9}, 5.2,
                                disk)["met"]
    with pytest.raises(ValueError, match="no state bytes"):
        fs.nvme_roofline({}, 1.0, disk)
    for bad in ({"x": {"read": 1.0}}, {}):
        with pytest.raises(SystemExit, match="no row"):
            fs.read_disk_json(str(write_bench_io(tmp_path / "bad.json", bad)))
    with pytest.raises(SystemExit, match="no bench_io.py result"):
        fs.read_disk_json(str(tmp_path / "missing.json"))


def case_in_process(cmd, timeout, label):
    """finetune()'s case process, run here: the same argv through the same parser and
    run_case, its RESULT line captured (a second torch process would take most of the test)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        of.run_case(parse(*cmd[2:]), cmd[cmd.index("--finetune-case") + 1])
    return 0, out.getvalue(), [], []


@needs_ext
def test_finetune_check_sets_the_nvme_step_against_the_disk(tmp_path, monkeypatch, capsys):
    """--finetune-check --tier nvme --disk-json: the tiny model's NVMe step, its state bytes
    and the ratio to the roofline of a synthetic 1 GB/s disk, printed with the target. Without
    clipping every chunk is read and written once (a clipped step redoes the overlap's chunks:
    their I/O twice)."""
    disk = write_bench_io(tmp_path / "io.json", {"tierlift threads": {"write": 1.0, "read": 1.0}})
    monkeypatch.setattr(of, "_run_case_process", case_in_process)
    assert of.finetune(parse("--finetune-check", "--tier", "nvme", "--contenders", "tierlift",
                             "--disk-json", str(disk), "--dir", str(tmp_path),
                             "--max-grad-norm", "0")) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("NVMe roofline:"))
    m = re.match(r"NVMe roofline: ([0-9.e-]+) GB read \+ ([0-9.e-]+) GB written per step at "
                 r"1\.00 / 1\.00 GB/s .* = ([0-9.e-]+) s; step ([0-9.e-]+) s = ([0-9.]+)x the "
                 r"roofline \(target <= 1\.25x: (met|NOT met)\)", line)
    assert m, line
    read, written, roof, step, ratio = (float(x) for x in m.groups()[:5])
    state = 12 * fs.config("tiny", 32).num_params() / 1e9  # fp32 master, m, v, each way
    assert state <= read < 1.1 * state and state <= written < 1.1 * state, line
    assert roof == pytest.approx(read + written, rel=1e-3)  # at 1 GB/s each way
    assert ratio == pytest.approx(step / roof, rel=0.01)


@pytest.mark.parametrize("rc", [None, -11])
def test_a_result_printed_before_the_cut_off_stands(rc, monkeypatch, capsys):
    """A case that printed its RESULT and was then killed at its --timeout (or crashed on its
    way out) keeps its row, with what happened after it; one without a RESULT is an error row
    with the steps it timed."""
    row = {"case": "torch AdamW on CPU (fp32 master, pinned)", "params": 100, "step_s": 0.5,
           "tflops": 1.0, "tokens_per_step": 64, "tokens_per_s": 128.0, "grad_norm": 1.0}
    cases = {"torch-cpu": (rc, "RESULT " + json.dumps(row) + "\n", ["teardown"], [0.9, 0.5]),
             "tierlift": (None, "", ["step 1: 0.40 s"], [1.0, 0.4])}
    monkeypatch.setattr(of, "_run_case_process", lambda cmd, t, which: cases[which])
    rows = []
    monkeypatch.setattr(of, "print_table", lambda r, *a, **k: rows.extend(r))
    assert of.finetune(parse("--finetune-check", "--contenders", "tierlift,torch-cpu",
                             "--timeout", "5")) == 0  # one contender measured
    out = capsys.readouterr().out
    why = "timed out after 5 s" if rc is None else "failed (exit -11)"
    assert f"torch-cpu: {why} after printing its result; the result stands" in out
    assert [r["case"] for r in rows] == [row["case"]]
    assert "tierlift: timed out after 5 s; 1 timed step(s) done, 0.400 s/step" in out


def test_step_against_its_longest_leg():
    legs = {"adam": {"total_s": 0.40}, "d2h": {"total_s": 0.10}, "h2d": {"total_s": 0.05},
            "other": {"total_s": 0.9}}  # not a leg that can hide the others: left out
    got = of.leg_bound({"step_s": 0.5, "last_step_s": 0.44, "legs": legs, "compute_s": 0.30})
    assert got["leg"] == "adam" and got["met"] and abs(got["ratio"] - 1.1) < 1e-9
    got = of.leg_bound({"step_s": 0.5, "last_step_s": 0.75, "legs": legs, "compute_s": 0.5})
    assert got["leg"] == "forward+backward" and not got["met"] and got["ratio"] == 1.5
    assert got["step_s"] == 0.75
    assert of.leg_bound({"step_s": 1.0, "last_step_s": 1.0, "legs": {}}) is None
    # the legs are the last step's: without its own time there is no bound (the mean of the
    # steps set against them gave a step shorter than its own forward + backward)
    assert of.leg_bound({"step_s": 1.0, "legs": legs, "compute_s": 1.2}) is None


def test_time_steps_keeps_each_timed_step():
    """The last timed step's own time, which leg_bound sets against that step's legs, differs
    from the mean when the steps differ."""
    pauses = iter([0.0, 0.0, 0.05])  # warmup, then a short and a long timed step
    each: list[float] = []
    mean = of._time_steps(lambda: time.sleep(next(pauses)), 2, 1, torch.device("cpu"), each)
    assert len(each) == 2 and each[-1] >= 0.05 > each[0]
    assert mean < each[-1]


@needs_ext
def test_tierlift_row_bounds_its_last_step_by_that_steps_legs():
    """run_tierlift's row: the last step's own time beside its legs, and every leg of a step
    inside that step (the ratio is at least 1); the page-locked bytes read while the
    optimizer held them."""
    args = parse("--finetune-check", "--tier", "cpu", "--overlap", "--max-grad-norm", "0",
                 "--chunk-bytes", "16384", "--steps", "2", "--warmup", "1", "--seq-len", "32",
                 "--batch-size", "2")
    out = of.run_tierlift(args, {"model": "tiny", "tier": "cpu"}, torch.device("cpu"))
    bound = of.leg_bound(out)
    assert bound is not None and bound["step_s"] == out["last_step_s"]
    assert bound["ratio"] >= 1.0, (bound, out["step_s"])
    assert out["registered_pinned_bytes"] >= 0


def test_device_fraction_from_an_earlier_result(tmp_path):
    """The tierlift row's exposed share of its CPU Adam, rounded down to 0.05, at most 0.9;
    rows with device_fraction, other contenders and rows without the leg are passed over."""
    def result(*rows):
        path = tmp_path / "r.json"
        path.write_text(json.dumps({"results": list(rows)}))
        return str(path)

    adam = lambda exposed, total: {"legs": {"adam": {"exposed_s": exposed, "total_s": total}}}  # noqa: E731
    path = result({"case": "torch-cpu", **adam(1.0, 1.0)},
                  {"case": "tierlift offload=cpu overlap device_fraction=0.3", **adam(0.1, 1.0)},
                  {"case": "tierlift offload=cpu overlap", **adam(0.449, 0.5)})
    f, why = fs.device_fraction_from(path)
    assert f == 0.85 and "90%" in why  # 0.898 -> 0.85
    assert fs.device_fraction_from(result({"case": "tierlift offload=cpu", **adam(1, 1)}))[0] == 0.9
    assert fs.device_fraction_from(result({"case": "tierlift offload=cpu", **adam(0, 1)}))[0] == 0
    with pytest.raises(SystemExit, match="no tierlift row"):
        fs.device_fraction_from(result({"case": "tierlift offload=cpu"}))
    with pytest.raises(SystemExit, match="cannot read"):
        fs.device_fraction_from(str(tmp_path / "missing.json"))
    # the sizing alone (gpu_check's dry run) goes on with the stand-in
    assert fs.device_fraction_from(str(tmp_path / "missing.json"), plan_only=True)[0] == \
        fs.FRACTION_STANDIN


def test_device_fraction_from_reaches_the_plan(tmp_path, capsys):
    args = parse("--gpu", "--plan-only", "--model", "1b", "--tier", "cpu", "--overlap",
                 "--gpu-mem", "140", "--device-fraction-from", str(tmp_path / "none.json"))
    assert of.finetune(args) == 0
    out = capsys.readouterr().out
    assert f"device_fraction {fs.FRACTION_STANDIN:g}:" in out and args.device_fraction == 0.5


def test_a_device_fraction_from_a_result_is_lowered_to_fit_the_gpu(tmp_path, capsys):
    """7B at batch 4 leaves ~50 GB of 140 GiB: a read fraction of 0.9 (68 GB) comes down to
    what fits, and the plan then passes."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": [{"case": "tierlift offload=cpu overlap", "legs": {
        "adam": {"exposed_s": 1.0, "total_s": 1.0}}}]}))
    args = parse("--gpu", "--plan-only", "--model", "7b", "--tier", "cpu", "--overlap",
                 "--cpu-budget", "100", "--batch-size", "4", "--gpu-mem", "140",
                 "--device-fraction-from", str(path))
    assert of.finetune(args) == 0
    out = capsys.readouterr().out
    assert "device_fraction 0.9 ->" in out and 0 < args.device_fraction < 0.9
    gpu = fs.needs("7b", args)["gpu_bytes"]
    assert gpu <= 140 * fs.GiB * fs.FIT
    args.device_fraction = round(args.device_fraction + fs.FRACTION_STEP, 2)
    assert fs.needs("7b", args)["gpu_bytes"] > 140 * fs.GiB * fs.FIT  # the largest that fits


def test_deepspeed_nvme_needs_and_refusals(monkeypatch, capsys):
    """deepspeed-nvme at 1.1B: fp32 master, m, v and gradient on the disk (16 B/param, 17.7 GB,
    below tierlift's 24 B), 4 pinned swap buffers of the largest sub-group (1e9 parameters plus
    at most the largest one, the 65.5M embedding); in the plan line, and refused before any case
    where --disk or --cpu-mem cannot hold them."""
    n = fs.config("1b", 2048).num_params()
    need = ods.deepspeed_nvme_needs("1b", 2048)
    assert need["deepspeed_nvme_disk_bytes"] == 16 * n
    assert need["deepspeed_nvme_pinned_bytes"] == 4 * 4 * (10**9 + 32000 * 2048)
    monkeypatch.setattr(of, "_run_case_process", no_case)
    ft = ("--gpu", "--plan-only", "--model", "1b", "--tier", "cpu", "--batch-size", "8",
          "--gpu-mem", "140", "--contenders", "tierlift,deepspeed-nvme")
    assert of.finetune(parse(*ft)) == 0
    plan_line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("plan:"))
    assert json.loads(plan_line[len("plan: "):])["deepspeed_nvme_disk_bytes"] == 16 * n
    with pytest.raises(SystemExit, match=r"deepspeed-nvme: 16\.5 GiB of swap files"):
        of.finetune(parse(*ft, "--disk", "19"))  # 19 x 0.85 = 16.2 GiB
    with pytest.raises(SystemExit, match="deepspeed-nvme: .* pinned swap buffers"):
        of.finetune(parse(*ft, "--cpu-mem", "18"))
    assert of.finetune(parse(*ft, "--disk", "19", "--no-deepspeed")) == 0  # not run: not sized


def test_counting_handle_counts_what_is_asked_of_the_disk():
    """DeepSpeed reports no byte counts: each read and write through its aio handle is counted
    at the tensor's size (DeepSpeed's aligned swap buffer), the rest passes through."""
    calls = []

    class Handle:
        def async_pread(self, buf, path, offset=0):
            calls.append(("r", path, offset))
            return 0

        def async_pwrite(self, buf, path, offset=0):
            calls.append(("w", path, offset))
            return 0

        def wait(self):
            return len(calls)

    h = ods.CountingHandle(Handle())
    assert h.async_pread(torch.empty(256), "a") == 0
    assert h.async_pwrite(torch.empty(3, 256, dtype=torch.bfloat16), "b", 4096) == 0
    assert h.async_pwrite(torch.empty(10, dtype=torch.uint8), "c") == 0
    assert (h.read_bytes, h.write_bytes) == (1024, 3 * 256 * 2 + 10)
    assert h.wait() == 3 and calls[1] == ("w", "b", 4096)


def test_each_case_runs_in_a_folder_of_its_own_removed_after_it(tmp_path, monkeypatch):
    """Under --dir each case gets its own folder, gone before the next case starts, also when
    the case was killed at its --timeout with its files in place (tierlift's NVMe state and
    DeepSpeed's swap files must not share the disk)."""
    seen = []

    def case(cmd, timeout, which):
        folder = Path(cmd[cmd.index("--dir") + 1])
        assert folder.parent == tmp_path and folder.is_dir()
        assert not any(tmp_path.glob("finetune-tierlift-*")) or which == "tierlift"
        (folder / "state.bin").write_bytes(b"x" * 4096)
        seen.append(folder)
        return None, "", ["killed"], []  # cut off at its timeout

    monkeypatch.setattr(of, "_run_case_process", case)
    assert of.finetune(parse("--finetune-check", "--tier", "cpu", "--dir", str(tmp_path),
                             "--contenders", "tierlift,torch-cpu", "--timeout", "1")) == 1
    assert len(seen) == 2 and seen[0] != seen[1]
    assert not any(p.exists() for p in seen) and list(tmp_path.iterdir()) == []


def test_the_ceiling_is_measured_only_where_it_fits():
    """torch-gpu (nothing offloaded) needs 20 B/param on the GPU beside the activations: the
    1.1B at batch 8 fits the H200's 140 GiB, the 7B at batch 4 does not, and its row says why
    without running a case."""
    one = fs.plan(parse("--gpu", "--model", "1b", "--tier", "cpu", "--overlap",
                        "--batch-size", "8", "--gpu-mem", "140"))
    act = fs.activation_bytes(fs.config("1b", 2048), 8 * 2048)
    assert one["torch_gpu_fits"] and one["torch_gpu_bytes"] == 20 * one["params"] + act
    seven = fs.plan(parse("--gpu", "--model", "7b", "--tier", "cpu", "--overlap",
                          "--cpu-budget", "100", "--batch-size", "4", "--gpu-mem", "140"))
    assert not seven["torch_gpu_fits"]


def test_tierlift_compute_is_set_against_the_ceiling(monkeypatch, capsys):
    """Each tierlift row's forward + backward over torch-gpu's (compute_vs_ceiling), and the
    ceiling's TFLOPS ratio labelled as having no target; a ceiling that does not fit is a row
    with its reason and no case run."""
    def row(case, step, compute):
        return {"case": case, "params": 100, "step_s": step, "last_step_s": step,
                "tflops": 1.0 / step, "tokens_per_step": 64, "tokens_per_s": 64 / step,
                "compute_s": compute}
    cases = {"tierlift": row("tierlift offload=cpu overlap", 0.5, 0.33),
             "torch-gpu": row("torch AdamW on the GPU (fp32 master, no offload)", 0.31, 0.30)}
    ran = []

    def fake(cmd, timeout, which):
        ran.append(which)
        return 0, "RESULT " + json.dumps(cases[which]) + "\n", [], [0.5]
    monkeypatch.setattr(of, "_run_case_process", fake)
    rows = []
    monkeypatch.setattr(of, "print_table", lambda r, *a, **k: rows.extend(r))
    assert of.finetune(parse("--finetune-check", "--contenders", "tierlift,torch-gpu")) == 0
    out = capsys.readouterr().out
    assert "forward+backward 330 ms, 1.10x the ceiling's (300 ms, nothing offloaded)" in out
    ratio = next(r for r in rows if r["case"] == "tierlift / torch-gpu")
    assert ratio["TFLOPS"] == "0.62x" and ratio["target"].startswith("none: the ceiling")
    # where it does not fit (the 7B), no case runs and its row says why
    ran.clear()
    saved = []
    monkeypatch.setattr(of, "write_json", lambda name, data: saved.append(data))
    assert of.finetune(parse("--model", "7b", "--tier", "cpu", "--overlap", "--cpu-budget",
                             "100", "--batch-size", "4", "--gpu-mem", "140",
                             "--contenders", "torch-gpu")) == 1
    assert ran == [] and "torch-gpu: left out, it does not fit: 20 B/param" in \
        capsys.readouterr().out
    assert saved[-1]["results"] == [{"contender": "torch-gpu", "case": "torch-gpu",
                                     "error": saved[-1]["results"][0]["error"]}]


def test_peak_host_memory_counts_the_case_and_its_worker_processes():
    """A row's peak_host_bytes: the case process's peak RSS plus its live children's (a
    contender's CPU Adam worker process holds its state there, as DeepSpeed SuperOffload's)."""
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(256 << 20); "
                              "import sys; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        own = _peak_rss.status("VmHWM:")
        assert child.pid in _peak_rss.descendants(os.getpid())
        assert _peak_rss.peak_with_children() >= own + (256 << 20)
    finally:
        child.communicate("")
    assert child.pid not in _peak_rss.descendants(os.getpid())  # gone: counts nothing


class _Worker:
    """Stands in for SuperOffload's CPU Adam worker process (a child holding 256 MiB), which
    DeepSpeed's engine.optimizer.superoffload_cpu_optimizer.close() ends."""

    def __init__(self):
        import subprocess
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "b = bytearray(256 << 20); import sys; "
             "print('ready', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def close(self):
        self.proc.communicate("")


def test_deepspeed_row_counts_its_worker_process_before_the_case_ends_it(monkeypatch, capsys):
    """run_deepspeed closes SuperOffload's worker process on its way out (close_super): the
    row's peak_host_bytes is read before that, so the worker's memory counts (read after it,
    in run_case, a GPU run's deepspeed-super row left its CPU Adam's state out). DeepSpeed's
    engine is a stand-in here: the order is what is checked."""
    import types

    class Engine:
        def __init__(self, model):
            self.model = model
            inner = torch.optim.SGD(model.parameters(), lr=1e-3)
            self.optimizer = types.SimpleNamespace(optimizer=inner,
                                                   superoffload_cpu_optimizer=_Worker())

        def __call__(self, x, y):
            return self.model(x, y)

        def backward(self, loss):
            loss.backward()

        def step(self):
            self.optimizer.optimizer.step()
            self.optimizer.optimizer.zero_grad(set_to_none=True)

        def get_global_grad_norm(self):
            return None

        def gradient_clipping(self):
            return 0.0

    engines = []

    def initialize(model, model_parameters, config):
        engines.append(Engine(model))
        return engines[-1], None, None, None

    fake = types.ModuleType("deepspeed")
    fake.__version__, fake.init_distributed, fake.initialize = "stand-in", lambda **kw: None, \
        initialize
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    monkeypatch.setattr(ods.modes, "check_accelerator", lambda which: None)
    monkeypatch.setattr(ods, "check_deepspeed_config", lambda *a, **k: {})
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29517"}.items():  # run_deepspeed's, gone after the test
        monkeypatch.setenv(k, v)
    args = parse("--finetune-check", "--max-grad-norm", "0", "--steps", "1", "--warmup", "0",
                 "--seq-len", "32", "--batch-size", "2",
                 "--info", json.dumps({"model": "tiny", "tier": "cpu"}))
    own = _peak_rss.status("VmHWM:")
    of.run_case(args, "deepspeed")
    res = json.loads(next(ln for ln in capsys.readouterr().out.splitlines()
                          if ln.startswith("RESULT "))[len("RESULT "):])
    assert engines[0].optimizer.superoffload_cpu_optimizer.proc.poll() is not None  # closed
    assert res["peak_host_bytes"] >= own + (256 << 20), res["peak_host_bytes"] - own
