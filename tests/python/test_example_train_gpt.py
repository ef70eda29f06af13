"""The README's main example runs end to end and learns (small and short here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


SMALL = ["--steps", "30", "--layers", "2", "--dim", "64", "--seq-len", "64", "--batch-size", "8",
         "--data-mb", "1", "--compare-steps", "3"]


def run_example(*flags: str, launcher=(sys.executable,)) -> str:
    cmd = [*launcher, str(ROOT / "examples" / "train_gpt.py"), *SMALL, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_train_gpt_loss_falls_and_compares_optimizers():
    out = run_example()
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, out
    assert re.search(r"optimizer step on .* tierlift .* ms, torch.optim.AdamW .* ms", out), out


def test_train_gpt_bf16_params_with_master_weights():
    out = run_example("--dtype", "bf16")
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, out


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp4-quartet"])
def test_train_gpt_low_precision(recipe):
    out = run_example("--lowp", recipe, "--lowp-min-features", "0")
    assert re.search(rf"lowp {recipe}: (\d+) layers converted", out).group(1) != "0", out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, out


@pytest.mark.parametrize("stage", [2, 3])
def test_train_gpt_under_torchrun_with_zero(stage):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"]
    out = run_example("--zero", str(stage), "--device", "cpu", launcher=torchrun)
    assert f"ranks: 2 | zero: {stage}" in out, out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, out


@pytest.mark.parametrize("stage,extra", [(2, ()), (3, ("--fp8-all-gather",))],
                         ids=["zero2", "zero3-fp8-all-gather"])
def test_train_gpt_fp8_under_torchrun_with_zero(stage, extra):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"]
    out = run_example("--zero", str(stage), "--device", "cpu", "--dtype", "bf16", "--lowp",
                      "fp8-rowwise", "--lowp-min-features", "0", *extra, launcher=torchrun)
    assert f"ranks: 2 | zero: {stage}" in out, out
    assert re.search(r"lowp fp8-rowwise: (\d+) layers converted", out).group(1) != "0", out
    assert re.search(r"all-gathered per step \(this rank\): [\d,]+ bytes", out), out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, out


def test_train_gpt_fp8_all_gather_needs_zero3():
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--fp8-all-gather"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--fp8-all-gather needs --zero 3" in out.stderr, out.stderr


def test_train_gpt_with_nvme_offload(tmp_path):
    out = run_example("--offload", "nvme", "--nvme-path", str(tmp_path), "--compare-steps", "0")
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, out
    assert "last optimizer step breakdown" in out, out


def test_train_gpt_zero_infinity_under_torchrun(tmp_path):
    """ZeRO-2 + NVMe optimizer state under torchrun; then ZeRO-3 with the parameters in host
    memory as well. The overlapped chunk steps are kept (the optimizer clips)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"]
    for extra in (["--zero", "2"], ["--zero", "3", "--offload-params", "cpu"]):
        out = run_example(*extra, "--offload", "nvme", "--nvme-path", str(tmp_path),
                          "--device", "cpu", "--steps", "12", launcher=torchrun)
        assert f"ranks: 2 | zero: {extra[1]}" in out, out
        first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
        assert last < first, out
        assert "'overlap_kept_chunks'" in out, out
        if "--offload-params" in extra:
            assert re.search(r"'h2d_bytes': [1-9]", out), out
        # The example closes the optimizer before its os._exit: no state folder is left.
        assert not list(tmp_path.glob("tierlift-offload-*")), list(tmp_path.iterdir())


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_train_gpt_with_offloaded_activations(tmp_path, tier):
    # With the optimizer comparison, which deep-copies the model (its blocks are wrapped).
    out = run_example("--offload-activations", tier, "--nvme-path", str(tmp_path))
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, out
    ram, nvme = map(float, re.search(r"activations offloaded per step: ([\d.]+) MB to RAM, "
                                     r"([\d.]+) MB to NVMe", out).groups())
    assert (ram if tier == "ram" else nvme) > 0 and (nvme if tier == "ram" else ram) == 0, out
    assert list(tmp_path.iterdir()) == []  # the NVMe file never had a name
    assert re.search(r"optimizer step on .* tierlift .* ms", out), out


def test_train_gpt_offloaded_activations_under_torchrun_with_zero3(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"]
    out = run_example("--zero", "3", "--device", "cpu", "--steps", "12", "--offload-activations",
                      "nvme", "--nvme-path", str(tmp_path), launcher=torchrun)
    assert "ranks: 2 | zero: 3" in out, out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first, out
    assert float(re.search(r"([\d.]+) MB to NVMe", out).group(1)) > 0, out


def test_train_gpt_offload_activations_nvme_needs_a_path():
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--offload-activations",
           "nvme"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "needs --nvme-path" in out.stderr, out.stderr
