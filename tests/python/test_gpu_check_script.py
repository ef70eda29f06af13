"""scripts/gpu_check.sh runs on a GPU machine only at times, with minutes of device time: its dry
run (no GPU, no build) must pass here, so a device call cannot fail on a typo in a path or flag,
and the checker behind it must catch such typos."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run(cmd, tmp_path, **env):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_SCRATCH": str(tmp_path / "s"),
           **env}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("stage", ["1", "2"])
def test_dry_run_checks_every_command(stage, tmp_path):
    proc = run(["bash", str(SCRIPT), stage], tmp_path, GPU_CHECK_DRY="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 problem(s)" in proc.stdout
    checked = int(proc.stdout.split(" commands checked")[0].split()[-1])
    assert checked >= 5  # stage 1: pytest + 4 examples; stage 2: 5 benchmarks
    assert not (tmp_path / "out" / "dry_commands.txt").exists()


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
        "python3 -m torch.distributed.run --standalone --nproc-per-node 1 "
        "examples/train_gpt.py --zero 3",                           # fine
    ]) + "\n")
    proc = subprocess.run([sys.executable, "scripts/gpu_check_argv.py", str(commands)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    out = proc.stdout
    assert "6 commands checked, 4 problem(s)" in out, out
    assert "unknown flags ['--stepz']" in out
    assert "invalid choice: 'fp9'" in out
    assert "bench_nothing.py: no such file" in out
    assert "no such path tests/python/test_nothing.py" in out
