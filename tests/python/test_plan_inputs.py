"""python -m tierlift plan: inputs that cannot be planned are one-line errors naming the argument
(parser.error, exit status 2), never a traceback or a plan for a machine that does not exist."""

from __future__ import annotations

import collections
import os
import shutil

import pytest
from tmpfs import mounted_tmpfs

import tierlift
from tierlift.__main__ import main
from tierlift.plan import Bandwidths, PlanInput, max_params

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

G = 1 << 30
BW = Bandwidths(memory_bps=10e9, adam_elems_per_s=1e9, disk_read_bps=2e9, disk_write_bps=1e9)


def _refused(capsys, *argv, probe="4") -> str:
    """The one-line error main() exits with for `plan argv`."""
    args = ["plan", *argv]
    for flag, value in (("--gpu-mem", "80G"), ("--cpu-mem", "64G"), ("--probe-mib", probe)):
        if flag not in args:
            args += [flag, value]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m tierlift: error: ")
    return err[-1].removeprefix("python -m tierlift: error: ")


@pytest.mark.parametrize("argv,message", [
    (["--params", "1e308"], "--params must be at most 2**53 (9.007e+15)"),
    (["--params", "8e9", "--cpu-mem", "128G", "--cpu-budget", "1T"],
     "--cpu-budget 1T is more than --cpu-mem 128G"),
    (["--params", "1e8", "--act-blocks", "1000000000", "--act-block-bytes", "1G"],
     "--act-blocks must be in [1, 1000000]"),
    (["--params", "1e8", "--act-blocks", "0", "--act-block-bytes", "1G"],
     "--act-blocks must be in [1, 1000000]"),
    (["--params", "1e8", "--act-blocks", "4", "--act-block-bytes", "1G",
      "--act-block-forward-ms", "-1"], "--act-block-forward-ms (one block's forward time) must "
                                       "be a finite number >= 0, got -1.0"),
    (["--params", "1e8", "--act-blocks", "4", "--act-block-bytes", "1G",
      "--act-block-forward-ms", "nan"], "--act-block-forward-ms (one block's forward time)"),
    (["--params", "1e8", "--act-blocks", "4", "--act-block-bytes", "1G",
      "--act-cpu-budget", "1T"], "--act-cpu-budget 1T is more than --cpu-mem 64G"),
    (["--params", "1e8", "--cpu-budget", "40G", "--act-blocks", "4", "--act-block-bytes", "1G",
      "--act-cpu-budget", "30G"], "--cpu-budget 40G plus --act-cpu-budget 30G is more than "
                                  "--cpu-mem 64G"),
    (["--params", "1e8", "--act-blocks", "4", "--act-block-bytes", "1G",
      "--act-gpu-budget", "81G"], "--act-gpu-budget 81G is more than --gpu-mem 80G"),
    (["--params", "8e9", "--offload-params", "cpu", "--device-params", "inf"],
     "--device-params must be auto or a count"),
    (["--params", "1e8", "--nodes", "2", "--gpus-per-node", "8", "--inter-node-gbps", "inf"],
     "--inter-node-gbps must be a finite number > 0, got inf"),
    (["--max-params", "--gpu-mem", "1e300", "--cpu-mem", "1e300"],
     "these budgets hold more than 2**53"),
    # 96e9 bytes of state fit, not with the overlapped tier's 384 MiB of staging beside them
    (["--params", "8e9", "--cpu-mem", "128G", "--cpu-budget", "96.1e9"],
     "offload='cpu' with overlap=True needs one generation of the optimizer state (89.4 GiB) "
     "and the staging of device gradients and weights (383.9 MiB) in host memory, which has "
     "89.5 GiB for it (96100000000 bytes; short by 297.4 MiB); give --nvme PATH"),
])
def test_cli_refuses_inputs_it_cannot_plan(argv, message, capsys):
    assert message in _refused(capsys, *argv)


def test_plan_input_and_max_params_refuse_what_they_cannot_count():
    with pytest.raises(ValueError, match=r"params must be at most 2\*\*53"):
        PlanInput(params=1e308, gpu_mem=G, cpu_mem=G)
    with pytest.raises(ValueError, match="cpu_budget .* is more than cpu_mem"):
        PlanInput(params=1e9, gpu_mem=G, cpu_mem=G, cpu_budget=2 * G)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 4096"):
        PlanInput(params=1e9, gpu_mem=G, cpu_mem=G, chunk_bytes=5000)
    with pytest.raises(ValueError, match="overlap must be True, False or None"):
        PlanInput(params=1e9, gpu_mem=G, cpu_mem=G, overlap="yes")
    # Not "the largest model that fits is 2**53": the budgets hold more than it can count.
    with pytest.raises(ValueError, match="hold more than 2"):
        max_params(PlanInput(params=1, gpu_mem=10**300, cpu_mem=10**300), BW)
    assert max_params(PlanInput(params=1, gpu_mem=80 * G, cpu_mem=128 * G), BW)[0] > 1e9


def test_probe_larger_than_memory_is_refused_before_it_is_allocated(capsys):
    message = _refused(capsys, "--params", "8e9", probe=str(1 << 40))
    assert message.startswith(f"--probe-mib {1 << 40}: the bandwidth probes take two buffers")
    assert "give a smaller --probe-mib" in message


def test_probe_the_allocator_refuses_is_a_clear_error(capsys, monkeypatch):
    """Where the available memory cannot be read, the allocation itself fails: 2**60 bytes are
    beyond any address space."""
    monkeypatch.setattr("tierlift.plan.cli.host_memory_available", lambda: None)
    message = _refused(capsys, "--params", "8e9", probe=str(1 << 40))
    assert message.startswith(f"--probe-mib {1 << 40}: could not allocate a {1 << 60}-byte "
                              "bandwidth probe in host memory")


def test_plot_under_a_file_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr("tierlift.plan.cli.measure", lambda *a: pytest.fail("measured"))
    message = _refused(capsys, "--params", "1e8", "--plot", str(tmp_path / "file" / "a" / "p.png"))
    assert message == f"--plot '{tmp_path}/file/a/p.png': '{tmp_path}/file' is a file, not a " \
                      "directory"
    assert "is a directory" in _refused(capsys, "--params", "1e8", "--plot", str(tmp_path))
    assert (tmp_path / "file").read_text() == "x"


@pytest.fixture
def small_drive(tmp_path):
    """A 1 MiB tmpfs (tmpfs.py)."""
    with mounted_tmpfs(tmp_path, "1m") as path:
        yield path


def test_disk_probe_on_a_too_small_drive(small_drive, capsys, monkeypatch):
    message = _refused(capsys, "--params", "1e8", "--nvme", small_drive)
    assert message.startswith(f"--nvme '{small_drive}': the disk probe needs a 4194304-byte "
                              f"file under '{small_drive}', which has ")
    assert os.listdir(small_drive) == []
    # A drive that reports room it does not have: the write's ENOSPC, said the same way.
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(64 * G, 0, 64 * G))
    message = _refused(capsys, "--params", "1e8", "--nvme", small_drive)
    assert message.startswith(f"--nvme '{small_drive}': the disk probe (4194304 bytes) under "
                              f"'{small_drive}' failed: ")
    assert "No space left on device" in message
    assert os.listdir(small_drive) == []  # the probe file is gone
