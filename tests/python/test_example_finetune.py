"""examples/finetune_offload.py end to end (quick sizes): it fine-tunes with the optimizer state
on "NVMe" under a budget a quarter of its size, prints the breakdown, and a run killed with
SIGKILL resumes from its last checkpoint (or, with --durable, from the optimizer's own durable
state) to exactly the weights of an uninterrupted run."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune_offload.py"
TINY = ["--layers", "1", "--dim", "64", "--heads", "2", "--seq-len", "32", "--batch-size", "4",
        "--data-mb", "0.5", "--no-progress"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    return env


def run(*flags, timeout=180) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), *TINY, *flags], capture_output=True,
                         text=True, timeout=timeout, env=_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_finetune_learns_prints_breakdown_and_starts_from_pretrained(tmp_path):
    base = tmp_path / "base.pt"
    out = run("--steps", "30", "--nvme-path", str(tmp_path), "--save-final", str(base))
    assert "random init" in out, out
    assert re.search(r"cpu_budget .* \(4\.0x smaller than the state\)", out), out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, out
    for leg in ("compute (fwd+bwd)", "CPU Adam", "NVMe read wait", "NVMe write wait",
                "step(), blocking"):
        assert leg in out, out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tierlift-offload-")]

    out = run("--steps", "3", "--pretrained", str(base), "--nvme-path", str(tmp_path))
    assert f"pretrained weights: {base}" in out, out
    start = float(re.search(r"loss ([\d.]+) ->", out).group(1))
    assert start < first - 0.5, out  # starts from the fine-tuned weights, not from scratch


def test_finetune_bad_flags_are_refused():
    out = subprocess.run([sys.executable, str(SCRIPT), "--budget-fraction", "2"],
                         capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode != 0 and "--budget-fraction" in out.stderr


def test_killed_run_resumes_with_nothing_lost(tmp_path):
    steps = ["--steps", "30", "--checkpoint-every", "6"]
    full = tmp_path / "full.pt"
    run(*steps, "--nvme-path", str(tmp_path), "--save-final", str(full))

    ckpt, nvme, resumed = tmp_path / "ckpt", tmp_path / "nvme", tmp_path / "resumed.pt"
    nvme.mkdir()
    flags = [*TINY, *steps, "--checkpoint-dir", str(ckpt), "--nvme-path", str(nvme),
             "--save-final", str(resumed)]
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=_env())
    try:
        for line in proc.stdout:
            if "checkpoint saved at step 12" in line:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not resumed.exists()
    # a tierlift.checkpoint directory: progress in metadata.json, the optimizer state streamed
    latest = ckpt / "latest" if (ckpt / "latest").exists() else ckpt / "latest.old"
    meta = json.loads((latest / "metadata.json").read_text())
    assert meta["layout"] == "replicated" and meta["optimizer_state"] == "offloaded"
    assert meta["extra"]["step"] >= 12 and len(meta["extra"]["losses"]) == meta["extra"]["step"]
    assert (latest / "optim" / "state.json").is_file()
    stale = [p for p in nvme.iterdir() if p.name.startswith("tierlift-offload-")]
    assert stale, "the killed run should have left its state folder behind"

    out = run(*steps, "--checkpoint-dir", str(ckpt), "--nvme-path", str(nvme), "--save-final",
              str(resumed))
    match = re.search(r"resumed from .* at step (\d+)", out)
    assert match and int(match.group(1)) >= 12, out
    assert not any(p.exists() for p in stale), "the dead run's state folder was not removed"
    a, b = torch.load(full, weights_only=True), torch.load(resumed, weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k



def _committed(state: Path) -> int:
    """The committed step count in a durable state's manifest.json (a CRC line, then JSON; it
    is replaced by a rename, so it is read whole), -1 while there is none."""
    try:
        return json.loads((state / "manifest.json").read_bytes().partition(b"\n")[2])["seq"]
    except (FileNotFoundError, ValueError):
        return -1


def test_killed_durable_run_goes_on_from_its_last_step(tmp_path):
    """--durable, no checkpoint: kill -9 mid-run, run again with the same arguments; it goes on
    from the optimizer's committed step to the weights of a run that was never killed."""
    steps = ["--steps", "30"]
    plain, full = tmp_path / "plain.pt", tmp_path / "full.pt"
    run(*steps, "--nvme-path", str(tmp_path), "--save-final", str(plain))
    out = run(*steps, "--durable", "--nvme-path", str(tmp_path), "--save-final", str(full))
    assert "durable optimizer state: " in out and "reopened" not in out, out
    assert "all 30 steps done: removed the durable optimizer state" in out, out
    assert not (tmp_path / "tierlift-durable-rank0").exists()

    nvme, resumed = tmp_path / "nvme", tmp_path / "resumed.pt"
    nvme.mkdir()
    state = nvme / "tierlift-durable-rank0"
    flags = [*steps, "--durable", "--nvme-path", str(nvme), "--save-final", str(resumed)]
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *TINY, *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    try:
        deadline = time.monotonic() + 120
        while (seen := _committed(state)) < 6 and proc.poll() is None:
            assert time.monotonic() < deadline, "the run committed no step in 120 s"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)  # anywhere in the step after `seen`
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not resumed.exists() and 6 <= seen < 30
    assert (state / "manifest.json").is_file(), "the killed run's durable state is gone"

    out = run(*flags)
    match = re.search(r"reopened the durable optimizer state .* after (\d+) committed steps: "
                      r"resuming at step (\d+)", out)
    assert match, out
    at = int(match.group(2))
    assert int(match.group(1)) == at and seen <= at < 30, (seen, out)  # not from step 0
    assert not state.exists(), "the finished run's durable state was kept"
    a, b, c = (torch.load(f, weights_only=True) for f in (plain, full, resumed))
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # durable=True steps to the same bits
        assert torch.equal(b[k], c[k]), k  # and so does the killed and resumed run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_finetune_on_gpu_bf16(tmp_path):
    out = run("--steps", "20", "--device", "cuda", "--dtype", "bf16", "--nvme-path",
              str(tmp_path))
    assert "cuda bfloat16" in out, out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.3, out


_HOLDER = """
import sys, time, torch, tierlift
p = torch.nn.Parameter(torch.zeros(4096))
opt = tierlift.optim.AdamW([p], offload="nvme", nvme_path=sys.argv[1])
print("ready", flush=True)
time.sleep(120)
"""


def _holder(path):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE,
                            text=True, env=_env())
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_stale_state_folders_of_dead_processes_are_removed(tmp_path):
    from tierlift.offload.tiers import OWNER_FILE, remove_stale_dirs

    dead, live = _holder(tmp_path), None
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        (left,) = [p for p in tmp_path.iterdir() if p.name.startswith("tierlift-offload-")]
        assert (left / OWNER_FILE).is_file()
        live = _holder(tmp_path)  # its start removes the dead one's folder, not its own
        (own,) = [p for p in tmp_path.iterdir() if p.name.startswith("tierlift-offload-")]
        assert own != left and not left.exists()
        foreign = tmp_path / "tierlift-offload-foreign"  # another host's: never touched
        foreign.mkdir()
        (foreign / OWNER_FILE).write_text('{"pid": 1, "host": "elsewhere"}')
        other_ns = tmp_path / "tierlift-offload-otherns"  # another container's: never touched
        other_ns.mkdir()
        (other_ns / OWNER_FILE).write_text(json.dumps(
            {"pid": dead.pid, "host": socket.gethostname(), "pidns": "pid:[1]"}))
        (tmp_path / "tierlift-offload-noowner").mkdir()  # unknown owner: never touched
        assert remove_stale_dirs(str(tmp_path)) == []
        assert own.exists() and foreign.exists() and other_ns.exists()
    finally:
        for proc in (dead, live):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=30)


_NO_ROOM = """
import resource, sys, torch, tierlift
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
p = torch.nn.Parameter(torch.zeros(200_000))
try:
    tierlift.optim.AdamW([p], offload="nvme", nvme_path=sys.argv[1])
except OSError as e:
    print("ERROR:", e)
"""


def test_drive_too_small_for_the_state_is_refused_up_front(tmp_path):
    out = subprocess.run([sys.executable, "-c", _NO_ROOM, str(tmp_path)], capture_output=True,
                         text=True, timeout=60, env=_env())
    assert out.returncode == 0, out.stderr
    assert "nvme_path has no room for the optimizer state" in out.stdout, out.stdout
    assert "bytes are needed" in out.stdout and "File too large" in out.stdout
    assert not list(tmp_path.iterdir()), "a refused optimizer must leave nothing behind"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_bench_gpu_mode_without_a_gpu_says_so_and_plans():
    bench = str(ROOT / "benchmarks" / "bench_offload.py")
    out = subprocess.run([sys.executable, bench, "--gpu"], capture_output=True, text=True,
                         timeout=60, env=_env())
    assert out.returncode != 0 and "--gpu needs a CUDA GPU" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, bench, "--gpu", "--plan-only"], capture_output=True,
                         text=True, timeout=60, env=_env())
    assert out.returncode == 0 and '"model": "8b"' in out.stdout, out.stdout + out.stderr
