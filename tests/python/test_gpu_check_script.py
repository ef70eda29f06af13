"""scripts/gpu_check.sh runs on a GPU machine only at times, with minutes of device time: its dry
run (no GPU, no build) must pass here, so a device call cannot fail on a typo in a path or flag,
and the checker behind it must catch such typos."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run(cmd, tmp_path, **env):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_SCRATCH": str(tmp_path / "s"),
           **env}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


# stage 1: pytest + 4 examples; stage 2: DeepSpeed's build check + the offload tests + the 1.1B
# runs (RAM, split, disk, NVMe, the split's DeepSpeed peers; DeepSpeed's async_io build and its
# NVMe row); stage 3: the DeepSpeed check + 7B, the kernel rows, 7B DeepSpeed, 7B split, 1.1B
# clipped, the checkpoint
@pytest.mark.parametrize("stage, commands", [("1", 5), ("2", 9), ("3", 8)])
def test_dry_run_checks_every_command(stage, commands, tmp_path):
    proc = run(["bash", str(SCRIPT), stage], tmp_path, GPU_CHECK_DRY="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 problem(s)" in proc.stdout
    checked = int(proc.stdout.split(" commands checked")[0].split()[-1])
    assert checked >= commands
    assert not (tmp_path / "out" / "dry_commands.txt").exists()
    if stage != "1":  # the carried DeepSpeed wheels: checked when there, a warning when not
        assert ("resolve offline for Python 3.12" in proc.stdout
                or "warning: no DeepSpeed wheel" in proc.stdout), proc.stdout


def test_usage_without_a_stage(tmp_path):
    proc = run(["bash", str(SCRIPT)], tmp_path, GPU_CHECK_DRY="1")
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_checker_catches_typos(tmp_path):
    commands = tmp_path / "commands.txt"
    commands.write_text("\n".join([
        "python3 examples/train_gpt.py --steps 2",                 # fine
        "python3 examples/train_gpt.py --stepz 2",                 # misspelt flag
        "python3 examples/train_gpt.py --lowp fp9",                # value not among the choices
        "python3 benchmarks/bench_nothing.py --x 1",               # no such script
        "python3 -m pytest -m gpu tests/python/test_nothing.py",   # no such test file
        "python3 -m pytest -m gpu tests/python/test_optim.py::test_nothing",  # no such test
        "python3 -m pytest -m gpu "
        "tests/python/test_optim.py::test_cuda_kernel_matches_cpu_kernel",  # fine
        "python3 -m torch.distributed.run --standalone --nproc-per-node 1 "
        "examples/train_gpt.py --zero 3",                           # fine
    ]) + "\n")
    proc = subprocess.run([sys.executable, "scripts/gpu_check_argv.py", str(commands)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    out = proc.stdout
    assert "8 commands checked, 5 problem(s)" in out, out
    assert "unknown flags ['--stepz']" in out
    assert "invalid choice: 'fp9'" in out
    assert "bench_nothing.py: no such file" in out
    assert "no such path tests/python/test_nothing.py" in out
    assert "no test tests/python/test_optim.py::test_nothing" in out



def test_checker_runs_the_fine_tune_sizing(tmp_path):
    """A fine-tune command runs with --plan-only too: a --cpu-budget whose pinned state would not
    fit the host is caught here, not on the device."""
    ft = "python3 benchmarks/bench_offload.py --gpu --gpu-mem 140 --model 7b --tier cpu --overlap"
    commands = tmp_path / "commands.txt"
    commands.write_text(f"{ft} --cpu-budget 100 --batch-size 4\n"     # fits 85% of 128 GiB
                        f"{ft} --cpu-budget 109 --batch-size 4\n")    # does not
    proc = subprocess.run([sys.executable, "scripts/gpu_check_argv.py", str(commands)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 commands checked, 1 problem(s)" in proc.stdout, proc.stdout
    assert "--cpu-budget 109 --batch-size 4 --plan-only" in proc.stdout
    assert "does not fit" in proc.stdout


def make_wheel(folder: Path, name: str, requires: list[str]) -> None:
    """A minimal pure-Python wheel: enough for pip to resolve it."""
    info = f"{name}-1.0.dist-info"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                                    "true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def test_wheel_check_warns_when_absent_and_names_what_is_missing(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check_argv
    finally:
        sys.path.pop(0)
    warnings, problems = gpu_check_argv.check_wheels(str(tmp_path / "none"))
    assert problems == [] and "no DeepSpeed wheel" in warnings[0]
    # torch and numpy are on the GPU machine; hjson must be carried, extras are not needed
    make_wheel(tmp_path, "deepspeed", ["torch>=2.0.0", "numpy", "hjson",
                                       'sphinx; extra == "dev"'])
    warnings, problems = gpu_check_argv.check_wheels(str(tmp_path))
    assert warnings == [] and len(problems) == 1 and "hjson" in problems[0], problems
    make_wheel(tmp_path, "hjson", [])
    assert gpu_check_argv.check_wheels(str(tmp_path)) == ([], [])


def finetune_module():
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]
    try:
        import offload_finetune
    finally:
        del sys.path[:2]
    return offload_finetune


def test_a_case_cut_off_still_reports_its_steps(capsys):
    """The fine-tune bench passes each case's step lines on as they come, and a case stopped by
    its timeout still yields the steps it finished."""
    code = ("import sys, time\n"
            "for i in range(3):\n"
            "    print(f'{\"warmup\" if i == 0 else \"step\"} {i}: 0.{i + 1}0 s ({i} s in)',"
            " file=sys.stderr, flush=True)\n"
            "print('RESULT {}', flush=True)\n"
            "time.sleep(60)\n")
    of = finetune_module()
    rc, stdout, tail, steps = of._run_case_process([sys.executable, "-c", code], 3, "case")
    assert rc is None  # killed at the timeout
    assert steps == [0.1, 0.2, 0.3]
    assert "RESULT {}" in stdout and tail[-1] == "step 2: 0.30 s (2 s in)"
    assert "[case] step 1: 0.20 s" in capsys.readouterr().err


def test_finetune_check_compares_contenders_on_cpu(tmp_path):
    """The --gpu code path on CPU with a tiny model: two contenders side by side, each step
    passed on as it finishes, and the ratio with its target."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_offload.py", "--finetune-check", "--tier", "cpu",
         "--contenders", "tierlift,torch-cpu", "--timeout", "120"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "[torch-cpu] step 2:" in proc.stderr
    assert "tierlift / torch-cpu" in proc.stdout and ">= 2.0x" in proc.stdout


def test_deepspeed_config_reads_back_as_meant():
    """The ZeRO-3 config given to DeepSpeed, checked by DeepSpeed's own config classes; a
    misspelt top-level key (which DeepSpeed would ignore) is an error. Where DeepSpeed is not
    installed (CI) this skips; scripts/gpu_check.sh runs the same check before the GPU run."""
    pytest.importorskip("deepspeed")
    import argparse

    of = finetune_module()
    ods = sys.modules["offload_deepspeed"]  # where the DeepSpeed parts live
    got = of.check_deepspeed_config(argparse.Namespace(batch_size=1))
    assert got["zero stage"] == 3 and got["bf16"] is True
    original = ods.deepspeed_config

    def misspelt(*args):
        cfg = original(*args)
        cfg["gradient_cliping"] = cfg.pop("gradient_clipping")
        return cfg

    ods.deepspeed_config = misspelt
    try:
        with pytest.raises(SystemExit, match="gradient_cliping"):
            of.check_deepspeed_config(argparse.Namespace(batch_size=1))
    finally:
        ods.deepspeed_config = original
