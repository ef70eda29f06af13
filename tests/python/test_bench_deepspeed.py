"""DeepSpeed's contenders of the offload fine-tune (benchmarks/offload_deepspeed.py: ZeRO-3 and
ZeRO-2 with offload_optimizer=cpu, ZeRO-3 with offload_optimizer=nvme; deepspeed_modes.py:
SuperOffload and the partial offload's ratio) run here on the CPU, as the GPU machine runs them,
so a change that breaks them is found in CI and not with the GPU's minutes:
--deepspeed-check (the configs read back by DeepSpeed, its CPU Adam and async_io ops built, bytes
moved through the latter) and --finetune-check with every DeepSpeed contender, with clipping off
and at 1.0, each DeepSpeed row with its step time and, clipped, the gradients its CPU Adam stepped
with at the clipping norm; deepspeed-nvme's row with the bytes it read and wrote, which are its
swap files' (each read and written once a step), against a disk roofline; an aio key DeepSpeed
would ignore and a "NVMe" step that swapped nothing are refused; bench_io.py's DeepSpeed row
measures, or says why not. SuperOffload (CUDA only) is refused with its reason in its row while
the others in the same command run; the ratio contender runs on DeepSpeed's CPU accelerator (its
sub-groups and config, every sub-group stepping on the CPU there), its mapping of tierlift's
device_fraction is checked against DeepSpeed's own sub-grouping, and without a device fraction
it is refused before anything runs.

DeepSpeed comes from build/deepspeed-site (scripts/setup_deepspeed.sh, run by scripts/setup.sh),
on PYTHONPATH in the subprocesses only. Its ops (cpu_adam, the CPU accelerator's shm comm) are
JIT-built into build/torch-extensions through ccache, so a fresh clone pays their compiles once
per ccache: on the 2-core VM this file took 134 s with an empty ccache and 46 s with a warm one
(rm -rf build/torch-extensions; CCACHE_DIR=<empty dir, then the same again> python3 -m pytest
tests/python/test_bench_deepspeed.py) before the async_io op (libaio-dev; 12 translation units
and its pin_memory op: 462 s of CPU with an empty ccache) and the NVMe tests were added.
Without that site the tests skip, naming the setup; where the setup ran and could not install
DeepSpeed (CI without PyPI), they fail with its reason.
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
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "build" / "deepspeed-site"
FAILED = ROOT / "build" / "deepspeed-site.failed"
# one folder per Python and torch: another's builds there would be loaded (and its locks cleared)
EXTENSIONS = (ROOT / "build" / "torch-extensions"
              / f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}")
BENCH = ROOT / "benchmarks" / "bench_offload.py"
CCACHE_CXX = Path("/usr/lib/ccache/c++")  # Debian's ccache masquerade: torch accepts it as g++

sys.path.insert(0, str(ROOT / "scripts"))

import deepspeed_need  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _building_in(folder: Path) -> bool:
    """Whether a live process works in `folder`: torch's build lock names no owner, but the
    build that holds it runs ninja and the compilers there (another test session's, say)."""
    folder = folder.resolve()
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if Path(os.readlink(cwd)) == folder:
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


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
        if not _building_in(lock.parent):
            lock.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([env["PATH"], str(SITE / "bin")])
    env["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS)
    if "CXX" not in env and CCACHE_CXX.exists():
        # Through ccache on every supported torch: the newer ones would prepend ccache on their
        # own (TORCH_NO_COMPILER_WRAPPER turns that off), the older ones only honour CXX.
        env.update(CXX=str(CCACHE_CXX), TORCH_NO_COMPILER_WRAPPER="1")
        # Paths under the checkout hashed relative to it, the working directory not at all: a
        # fresh clone elsewhere (CI's) hits what an earlier checkout compiled (DeepSpeed's
        # async_io op alone is ~460 s of CPU cold on 2 cores).
        env.setdefault("CCACHE_BASEDIR", str(ROOT))
        env.setdefault("CCACHE_NOHASHDIR", "1")
    env["MASTER_PORT"] = str(_free_port())  # gloo's store: not the benchmark's fixed default
    return env


def _run(args: list[str], env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def _contenders_args(max_grad_norm: float) -> list[str]:
    ratio = bool(max_grad_norm)
    return ["--finetune-check", "--tier", "cpu", "--overlap", "--contenders",
            "tierlift,deepspeed-super,deepspeed,deepspeed-zero2"
            + (",deepspeed-ratio" if ratio else ""),
            *(["--device-fraction", "0.3"] if ratio else []),
            "--max-grad-norm", str(max_grad_norm), "--timeout", "600"]


def _nvme_args(folder: Path) -> list[str]:
    disk = folder / "io.json"
    disk.write_text(json.dumps({"gbps": {"fio": {"read": 1.0, "write": 1.0}}}))
    return ["--finetune-check", "--tier", "nvme", "--contenders", "tierlift,deepspeed-nvme",
            "--max-grad-norm", "0", "--disk-json", str(disk), "--dir", str(folder),
            "--timeout", "600"]


class _Started:
    """One bench_offload.py command started in the background, its output in a file."""

    def __init__(self, args: list[str], env: dict[str, str], timeout: float, log: Path):
        self.args, self.timeout, self.log = args, timeout, log
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, str(BENCH), *args], cwd=ROOT, env=env,
                                         stdout=f, stderr=subprocess.STDOUT)
        self.deadline = time.monotonic() + timeout

    def output(self) -> str:
        """_run's answer: waits for the command (within its timeout from its start) and fails
        the test unless it exited 0."""
        try:
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise subprocess.TimeoutExpired(self.args, self.timeout) from None
        out = self.log.read_text(errors="replace")
        assert self.proc.returncode == 0, \
            f"{self.args} exited {self.proc.returncode}:\n{out[-6000:]}"
        return out


@pytest.fixture(scope="module")
def finetune_checks(ds_env, tmp_path_factory, request):
    """The finetune-check commands of the three tests below, started together when the first of
    them runs: each runs its cases one after another and keeps about one core busy (imports,
    DeepSpeed's set-up: 24 s of CPU in 25 s for the unclipped one), so on the 2-core CI machine
    they overlap (91 s one after another, 72 s together, on the VM beside another test run).
    Each command is the one its test ran alone, with a MASTER_PORT of its own; each test waits
    for its own and checks it alone. Only the selected tests' commands start."""
    selected = {(item.originalname, getattr(getattr(item, "callspec", None), "params", {})
                 .get("max_grad_norm")) for item in request.session.items
                if item.module is request.module}
    started: dict[object, _Started] = {}
    logs = tmp_path_factory.mktemp("finetune-logs")
    for norm in (0.0, 1.0):
        if ("test_finetune_check_deepspeed_contenders", norm) in selected:
            started[norm] = _Started(_contenders_args(norm), {**ds_env, "MASTER_PORT": str(
                _free_port())}, 1500, logs / f"contenders-{norm}.log")
    if ("test_finetune_check_deepspeed_nvme", None) in selected:
        folder = tmp_path_factory.mktemp("nvme")
        started["nvme"] = _Started(_nvme_args(folder), {**ds_env, "MASTER_PORT": str(
            _free_port())}, 900, logs / "nvme.log")
        started["nvme"].folder = folder
    yield started
    for s in started.values():
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


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
def test_deepspeed_check_reads_configs_and_builds_its_ops(ds_env, tmp_path):
    ok = tmp_path / "aio-ok"
    ok.write_text("an earlier run's\n")  # removed first: it must not stand for this run
    out = _run(["--deepspeed-check", "--aio-ok", str(ok), "--dir", str(tmp_path)], ds_env,
               timeout=1500)
    assert "deepspeed 0.19.8 imported" in out and "accelerator cpu" in out, out
    for config in ("ZeRO-3", "ZeRO-2", "ZeRO-3 NVMe", "ZeRO-3 deepspeed-super",
                   "ZeRO-3 deepspeed-ratio"):
        assert f"{config} config: every setting read back as meant" in out, out
    assert re.search(r"DeepSpeedCPUAdam op \(cpu_adam\) built or loaded in [0-9.]+ s", out), out
    assert re.search(r"DeepSpeed async_io op built or loaded in [0-9.]+ s; 8 MiB written and "
                     r"read back through it in ", out), out
    assert ok.read_text() == "0.19.8\n"
    assert [p.name for p in tmp_path.iterdir()] == ["aio-ok"]  # the round trip's file is gone
    for op in ("cpu_adam", "async_io"):
        assert (EXTENSIONS / op).is_dir()
        if ds_env.get("CXX") == str(CCACHE_CXX):  # a fresh clone's build is cheap with ccache's
            ninja = (EXTENSIONS / op / "build.ninja").read_text()
            assert f"cxx = {CCACHE_CXX}\n" in ninja, ninja


@pytest.mark.slow
def test_deepspeed_check_without_libaio_passes_for_the_others(ds_env, tmp_path):
    """Where libaio cannot be compiled against (a C compiler that fails stands in for a missing
    libaio-dev: DeepSpeed probes it by compiling a call to io_submit), the async_io op is not
    built, says why, and --aio-ok is not written; the check passes for the CPU Adam contenders."""
    ok = tmp_path / "aio-ok"
    out = _run(["--deepspeed-check", "--aio-ok", str(ok)], {**ds_env, "CC": "/bin/false"},
               timeout=900)
    assert "DeepSpeed async_io op NOT built: libaio's header and library are not found" in out
    assert "DeepSpeedCPUAdam op (cpu_adam) built or loaded" in out and not ok.exists()


def test_deepspeed_check_can_leave_the_async_io_build_for_later(ds_env, tmp_path):
    """--aio-timeout 0 (gpu_check's build beside tierlift's): the CPU Adam builds, async_io does
    not, and an --aio-ok file left by an earlier run is removed, not taken for this one."""
    ok = tmp_path / "aio-ok"
    ok.write_text("stale\n")
    out = _run(["--deepspeed-check", "--aio-timeout", "0", "--aio-ok", str(ok)], ds_env,
               timeout=900)
    assert "DeepSpeed async_io op not built here (--aio-timeout 0)" in out
    # the new modes' keys, each read back from DeepSpeed's parsed config (1b's stand-in split)
    assert ("ZeRO-3 deepspeed-super config: every setting read back as meant (super_offload "
            "True, cpuadam_cores_perc 0.8, ratio 1.0, zero sub_group_size 400000000, zero "
            "reduce_bucket_size 400000000, zero overlap_comm False)") in out, out
    assert ("ZeRO-3 deepspeed-ratio config: every setting read back as meant (ratio 0.710825, "
            "zero sub_group_size 319311872)") in out, out
    assert "DeepSpeedCPUAdam op (cpu_adam) built or loaded" in out and not ok.exists()


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


RATIO_CASE = "deepspeed zero3 offload_optimizer=cpu ratio=0.625 (device_fraction 0.3)"


@pytest.mark.slow
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_finetune_check_deepspeed_contenders(finetune_checks, max_grad_norm):
    """The DeepSpeed contenders in one command: SuperOffload (CUDA only) refused in its row
    before its process starts, the others measured after it; clipped, ratio too, beside
    tierlift's split (once: its step is ZeRO-3's, ~15 s of this VM)."""
    ratio = bool(max_grad_norm)
    out = finetune_checks[max_grad_norm].output()
    errors = re.findall(r"^(?:tierlift|deepspeed|deepspeed-zero2|deepspeed-ratio): (?:timed "
                        r"out|failed|exited without).*$", out, re.M)
    assert not errors, f"{errors}\n{out[-6000:]}"
    assert re.search(r"^deepspeed-super: refused: SuperOffload runs on CUDA GPUs only \(DeepSpeed "
                     r"0\.19\.8 asserts it: .*\); this run has no --gpu$", out, re.M), out
    assert "[deepspeed-super]" not in out  # no process started for it
    rows = _rows(out)
    tierlift = "tierlift offload=cpu overlap" + (" device_fraction=0.3" if ratio else "")
    assert rows.get(tierlift, {}).get("step_s", 0) > 0, out
    # the same 7 parameters' state kept off the offload by both (on the CPU accelerator
    # DeepSpeed's "device" is the CPU: the split is configured and read back, not exercised)
    split = ("tierlift's device_fraction 0.3 keeps the first 7 parameters (28800 elements, "
             "21.9%); DeepSpeed's ratio 0.625 keeps the first 1 of its 4 sub-groups "
             "(sub_group_size 28800), the same elements; DeepSpeed's sub-groups read back: 4, 0 "
             "elements' state off the CPU (DeepSpeed's CPU accelerator")
    assert not ratio or split in out, out
    for case in ("deepspeed zero3 offload_optimizer=cpu", "deepspeed zero2 offload_optimizer=cpu",
                 *([RATIO_CASE] if ratio else [])):
        row = rows.get(case)
        assert row and row.get("step_s", 0) > 0 and "stepped_grad_norm" in row, \
            f"no {case} row with a step time and its norms:\n{out[-6000:]}"
        assert row["gradient_clipping"] == max_grad_norm
        if max_grad_norm:
            # the tiny model's norm is above 1.0, so clipping has work to do
            assert row["grad_norm"] > 1.2 * max_grad_norm, row
            assert row["stepped_grad_norm"] == pytest.approx(max_grad_norm, rel=1e-4), row
        else:  # unclipped: the CPU Adam got DeepSpeed's own norm (printed to 3 digits)
            assert row["stepped_grad_norm"] == pytest.approx(row["grad_norm"], rel=6e-3), row
    print(json.dumps(rows, indent=1))


def test_deepspeed_ratio_without_a_device_fraction_is_refused_before_anything_runs(ds_env):
    proc = subprocess.run([sys.executable, str(BENCH), "--finetune-check", "--tier", "cpu",
                           "--contenders", "tierlift,deepspeed-ratio"], cwd=ROOT, env=ds_env,
                          timeout=300, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "--contenders deepspeed-ratio needs --device-fraction (or --device-fraction-from)" in out
    assert "plan:" not in out and "[tierlift]" not in out, out  # nothing ran


def test_ccache_masquerade_is_what_torch_accepts():
    """CXX=/usr/lib/ccache/c++ builds the ops through ccache without torch's compiler warning (a
    'ccache c++' CXX is not found by shutil.which and is reported as an unknown compiler)."""
    if not CCACHE_CXX.exists() or shutil.which("ccache") is None:
        pytest.skip("no ccache here (scripts/setup.sh installs it)")
    from torch.utils.cpp_extension import check_compiler_ok_for_platform

    assert check_compiler_ok_for_platform(str(CCACHE_CXX))


def _bench_env(env: dict[str, str]) -> dict[str, str]:
    """The benchmarks' imports (llama_model) for code run beside them, as bench_offload.py
    finds them."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), env["PYTHONPATH"]])}


def _python(code: str, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "benchmarks",
                          env=_bench_env(env), timeout=timeout, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def test_an_aio_key_deepspeed_would_ignore_is_refused(ds_env):
    """DeepSpeed's docs name the aio thread count thread_count; 0.19.8 reads intra_op_parallelism
    and ignores any other key of its aio section, so the check refuses one it does not know."""
    out = _python(
        "import argparse, offload_deepspeed as ods\n"
        "args = argparse.Namespace(batch_size=2, max_grad_norm=0.0)\n"
        "got = ods.check_deepspeed_config(args, 3, nvme=True)\n"
        "print('READ', got['aio queue_depth'], got['aio intra_op_parallelism'],\n"
        "      got['buffer_count'])\n"
        "ods.AIO['thread_count'] = ods.AIO.pop('intra_op_parallelism')\n"
        "try:\n"
        "    ods.check_deepspeed_config(args, 3, nvme=True)\n"
        "except SystemExit as e:\n"
        "    print('REFUSED', e)\n", ds_env)
    assert "READ 8 1 4" in out, out
    assert "REFUSED DeepSpeed knows no config key ['aio.thread_count'] (it would ignore it)" in out


def test_ratio_keeps_what_device_fraction_keeps(ds_env):
    """deepspeed-ratio's plan against DeepSpeed's own code: its ZeRO-3 optimizer's sub-grouping
    (_create_fp16_sub_groups, run on the 1.1B model's parameter sizes) and stage3's
    `i >= int((1 - ratio) * count)` for the sub-groups left on the CPU; the sub-groups kept on
    the device hold exactly the parameters tierlift's device_fraction keeps."""
    out = _python(
        "import types, deepspeed_modes as m\n"
        "from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S3\n"
        "from tierlift.offload.device_part import choose\n"
        "params = m._params('1b', 2048)\n"
        "class P:\n"
        "    def __init__(self, n): self.n = n\n"
        "    def partition_numel(self): return self.n\n"
        "for base in (m.DEFAULT_SUB_GROUP, m.SUPER_ZERO['sub_group_size']):\n"
        "    for f in (0.1, 0.3, 0.45, 0.9):\n"
        "        plan = m.ratio_plan('1b', 2048, f, base)\n"
        "        me = types.SimpleNamespace(sub_group_size=plan['sub_group_size'])\n"
        "        groups = S3._create_fp16_sub_groups(me, [P(p.numel()) for p in params])\n"
        "        count = len(groups)\n"
        "        gpu = [i for i in range(count) if not i >= int((1 - plan['ratio']) * count)]\n"
        "        elems = sum(q.n for i in gpu for q in groups[i])\n"
        "        kept = sum(params[i].numel() for i in choose([{'params': params}], f)[0])\n"
        "        assert gpu == list(range(plan['device_sub_groups'])), (plan, gpu)\n"
        "        assert elems == kept == plan['device_elems'] and count == plan['sub_groups']\n"
        "        print('OK', base, f, round(plan['ratio'], 4), plan['sub_group_size'], count)\n",
        ds_env)
    assert out.count("OK ") == 8, out


@pytest.mark.slow
def test_finetune_check_deepspeed_nvme(finetune_checks):
    """deepspeed-nvme beside tierlift's NVMe tier: its last step read and wrote exactly its swap
    files (fp32 master, m, v and the gradient pieces of 4 KiB and more: the check's lowered least
    swap size), 12 to 16 B/param each way, through the aio settings meant, and the step against
    the roofline of a synthetic 1 GB/s disk for those bytes."""
    started = finetune_checks["nvme"]
    out = started.output()
    case = "deepspeed zero3 offload_optimizer=nvme (check: least swap size lowered)"
    assert _rows(out).get(case, {}).get("step_s", 0) > 0, out[-6000:]
    m = re.search(re.escape(case) + r": last step read ([0-9.e+-]+) GB and wrote ([0-9.e+-]+) GB "
                  r"through DeepSpeed's aio handle \(counted there; DeepSpeed reports none\), "
                  r"([0-9.e+-]+) GB of swap files, ([0-9.e+-]+) GB of pinned swap buffers, aio "
                  r"block_size 1048576, queue_depth 8, intra_op_parallelism 1, single_submit "
                  r"False, overlap_events True; roofline ([0-9.e+-]+) s, step ([0-9.e+-]+) s = "
                  r"([0-9.]+)x$", out, re.M)
    assert m, out[-6000:]
    read, written, files, buffers, roof, step, ratio = (float(x) for x in m.groups())
    n = 131392  # the tiny model's parameters
    assert read == written == files, m.group(0)  # every swap file read and written once a step
    assert 12 * n <= read * 1e9 <= 16 * n * 1.01, m.group(0)
    assert buffers * 1e9 >= 4 * 4 * n
    assert roof == pytest.approx(read + written, rel=2e-3)  # 1 GB/s each way
    assert ratio == pytest.approx(step / roof, rel=0.01)
    # each case's folder removed after it
    assert list(started.folder.iterdir()) == [started.folder / "io.json"]


@pytest.mark.slow
def test_deepspeed_nvme_that_swaps_nothing_is_refused(ds_env, tmp_path):
    """At DeepSpeed's own least swap size (1 MiB) the tiny model's 0.5 MB of state stays in RAM:
    the case would time a step that never touched the disk, so it fails instead of reporting."""
    info = json.dumps({"model": "tiny", "tier": "nvme"})
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys, offload_deepspeed as ods\n"
         "ods.CHECK_MIN_SWAP_BYTES = 1 << 20\n"
         "sys.argv = ['bench_offload.py'] + sys.argv[1:]\n"
         "import runpy; runpy.run_path('bench_offload.py', run_name='__main__')\n",
         "--finetune-case", "deepspeed-nvme", "--info", info, "--seq-len", "32",
         "--batch-size", "2", "--steps", "1", "--warmup", "0", "--max-grad-norm", "0",
         "--dir", str(tmp_path)],
        cwd=ROOT / "benchmarks", env=_bench_env(ds_env), timeout=600, capture_output=True,
        text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "RESULT" not in proc.stdout, out[-6000:]
    assert "deepspeed-nvme: its last step read 0 and wrote 0 bytes through the aio handle: not " \
           "an NVMe step" in out, out[-6000:]
    assert list(tmp_path.iterdir()) == []  # its swap folder removed on the way out


def test_bench_io_deepspeed_row_measures_or_says_why(ds_env, tmp_path):
    """bench_io.py's DeepSpeed aio row: an error (not a crash) where the op cannot load (a C
    compiler that fails stands in for a missing libaio-dev) or where --deepspeed-check wrote no
    --aio-ok file; otherwise GB/s both ways, the bytes read back equal to those written."""
    out = _python(
        "import os, sys\n"
        "sys.path.insert(0, '.')\n"
        "import bench_io\n"
        f"path, ok = {str(tmp_path / 'f.bin')!r}, {str(tmp_path / 'ok')!r}\n"
        "os.environ['CC'] = '/bin/false'\n"
        "print('NOLIB', bench_io.bench_deepspeed(path, 4 << 20, 1 << 20, 8, 1))\n"
        "del os.environ['CC']\n"
        "print('NOSTAMP', bench_io.bench_deepspeed(path, 4 << 20, 1 << 20, 8, 1, ok))\n"
        "open(ok, 'w').close()\n"
        "row = bench_io.bench_deepspeed(path, 4 << 20, 1 << 20, 8, 2, ok)\n"
        "print('ROW', row['write'] > 0, row['read'] > 0, row['aio']['queue_depth'])\n",
        ds_env)
    assert re.search(r"NOLIB \{'error': 'RuntimeError: Unable to JIT load the async_io op",
                     out), out
    assert re.search(r"NOSTAMP \{'error': .not measured: no ", out), out
    assert "ROW True True 8" in out, out
