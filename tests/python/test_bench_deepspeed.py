"""DeepSpeed's contenders of the offload fine-tune (benchmarks/offload_finetune.py: ZeRO-3 and
ZeRO-2 with offload_optimizer=cpu) run here on the CPU, as the GPU machine runs them, so a change
that breaks them is found in CI and not with the GPU's minutes: --deepspeed-check (the configs read
back by DeepSpeed, its CPU Adam built) and --finetune-check with every DeepSpeed contender, with
clipping off and at 1.0, each DeepSpeed row with its step time and, clipped, the gradients its
CPU Adam stepped with at the clipping norm.

DeepSpeed comes from build/deepspeed-site (scripts/setup_deepspeed.sh, run by scripts/setup.sh),
on PYTHONPATH in the subprocesses only. Its ops (cpu_adam, the CPU accelerator's shm comm) are
JIT-built into build/torch-extensions through ccache, so a fresh clone pays their compiles once
per ccache: on the 2-core VM this file took 134 s with an empty ccache and 46 s with a warm one
(rm -rf build/torch-extensions; CCACHE_DIR=<empty dir, then the same again> python3 -m pytest
tests/python/test_bench_deepspeed.py). Without that site the tests skip, naming the setup; where
the setup ran and could not install DeepSpeed (CI without PyPI), they fail with its reason.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "build" / "deepspeed-site"
FAILED = ROOT / "build" / "deepspeed-site.failed"
EXTENSIONS = ROOT / "build" / "torch-extensions"
BENCH = ROOT / "benchmarks" / "bench_offload.py"
CCACHE_CXX = Path("/usr/lib/ccache/c++")  # Debian's ccache masquerade: torch accepts it as g++

sys.path.insert(0, str(ROOT / "scripts"))

import deepspeed_need  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ds_env() -> dict[str, str]:
    if FAILED.exists():
        pytest.fail("scripts/setup.sh could not install DeepSpeed into build/deepspeed-site: "
                    + FAILED.read_text().strip())
    if not (SITE / "INSTALLED").exists():
        pytest.skip("DeepSpeed is not installed in build/deepspeed-site: run bash scripts/setup.sh")
    EXTENSIONS.mkdir(parents=True, exist_ok=True)
    # A build cut off (a killed run) leaves its lock, and the next build would wait on it forever.
    for lock in EXTENSIONS.glob("*/lock"):
        lock.unlink()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([env["PATH"], str(SITE / "bin")])
    env["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS)
    if "CXX" not in env and CCACHE_CXX.exists():
        # Through ccache on every supported torch: the newer ones would prepend ccache on their
        # own (TORCH_NO_COMPILER_WRAPPER turns that off), the older ones only honour CXX.
        env.update(CXX=str(CCACHE_CXX), TORCH_NO_COMPILER_WRAPPER="1")
    env["MASTER_PORT"] = str(_free_port())  # gloo's store: not the benchmark's fixed default
    return env


def _run(args: list[str], env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def test_need_refuses_what_would_shadow_this_python():
    def report(*names):
        return {"install": [{"metadata": {"name": n, "version": "99.0"}} for n in names]}

    absent = "tierlift-no-such-distribution"
    assert deepspeed_need.need(report("deepspeed", absent)) == [
        "deepspeed==99.0", f"{absent}==99.0"]
    with pytest.raises(SystemExit, match=r"numpy .* here, DeepSpeed wants 99\.0"):
        deepspeed_need.need(report("deepspeed", "numpy"))
    with pytest.raises(SystemExit, match="torch comes from scripts/setup.sh"):
        deepspeed_need.need(report("deepspeed", "torch"))
    with pytest.raises(SystemExit, match="no deepspeed"):
        deepspeed_need.need(report(absent))


def test_site_shadows_nothing_this_python_has(ds_env):
    here = [p for p in sys.path if Path(p or ".").resolve() != SITE.resolve()]
    in_site = {d.metadata["Name"] for d in md.distributions(path=[str(SITE)])}
    assert "deepspeed" in in_site
    assert "torch" not in in_site
    shadowed = sorted(n for n in in_site if any(True for _ in md.distributions(name=n, path=here)))
    assert not shadowed, f"build/deepspeed-site shadows this Python's {shadowed}"


@pytest.mark.slow
def test_deepspeed_check_reads_configs_and_builds_cpu_adam(ds_env):
    out = _run(["--deepspeed-check"], ds_env, timeout=900)
    assert "deepspeed 0.19.8 imported" in out and "accelerator cpu" in out, out
    for stage in (3, 2):
        assert f"ZeRO-{stage} config: every setting read back as meant" in out, out
    assert re.search(r"DeepSpeedCPUAdam op \(cpu_adam\) built or loaded in [0-9.]+ s", out), out
    assert (EXTENSIONS / "cpu_adam").is_dir()
    if ds_env.get("CXX") == str(CCACHE_CXX):  # a fresh clone's build is cheap with ccache's
        ninja = (EXTENSIONS / "cpu_adam" / "build.ninja").read_text()
        assert f"cxx = {CCACHE_CXX}\n" in ninja, ninja


def _rows(out: str) -> dict[str, dict]:
    """The printed result of each case (the check writes no JSON): its step time and note."""
    rows = {}
    for m in re.finditer(r"^(.+?): ([0-9.]+) s/step, .* TFLOPS$", out, re.M):
        rows[m.group(1)] = {"step_s": float(m.group(2))}
    for m in re.finditer(r"^(deepspeed zero\d [^:]+): grad norm ([0-9.e+-]+); stepped with norm "
                         r"([0-9.e+-]+) \(gradient_clipping ([0-9.e+-]+)\)$", out, re.M):
        rows.setdefault(m.group(1), {}).update(
            grad_norm=float(m.group(2)), stepped_grad_norm=float(m.group(3)),
            gradient_clipping=float(m.group(4)))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_finetune_check_deepspeed_contenders(ds_env, max_grad_norm):
    out = _run(["--finetune-check", "--tier", "cpu", "--overlap", "--contenders",
                "tierlift,deepspeed,deepspeed-zero2", "--max-grad-norm", str(max_grad_norm),
                "--timeout", "600"], ds_env, timeout=1500)
    errors = re.findall(r"^(?:tierlift|deepspeed|deepspeed-zero2): (?:timed out|failed|exited "
                        r"without).*$", out, re.M)
    assert not errors, f"{errors}\n{out[-6000:]}"
    rows = _rows(out)
    assert rows.get("tierlift offload=cpu overlap", {}).get("step_s", 0) > 0, out
    for stage in (3, 2):
        row = rows.get(f"deepspeed zero{stage} offload_optimizer=cpu")
        assert row and row.get("step_s", 0) > 0 and "stepped_grad_norm" in row, \
            f"no DeepSpeed ZeRO-{stage} row with a step time and its norms:\n{out[-6000:]}"
        assert row["gradient_clipping"] == max_grad_norm
        if max_grad_norm:
            # the tiny model's norm is above 1.0, so clipping has work to do
            assert row["grad_norm"] > 1.2 * max_grad_norm, row
            assert row["stepped_grad_norm"] == pytest.approx(max_grad_norm, rel=1e-4), row
        else:  # unclipped: the CPU Adam got DeepSpeed's own norm (printed to 3 digits)
            assert row["stepped_grad_norm"] == pytest.approx(row["grad_norm"], rel=6e-3), row
    print(json.dumps(rows, indent=1))


def test_ccache_masquerade_is_what_torch_accepts():
    """CXX=/usr/lib/ccache/c++ builds the ops through ccache without torch's compiler warning (a
    'ccache c++' CXX is not found by shutil.which and is reported as an unknown compiler)."""
    if not CCACHE_CXX.exists() or shutil.which("ccache") is None:
        pytest.skip("no ccache here (scripts/setup.sh installs it)")
    from torch.utils.cpp_extension import check_compiler_ok_for_platform

    assert check_compiler_ok_for_platform(str(CCACHE_CXX))
