"""Checks the commands that scripts/gpu_check.sh would run on the GPU machine (its dry run,
GPU_CHECK_DRY=1, writes them one per line), so that a device call cannot fail on a typo.

In one process (torch is imported once): each Python script runs with --help appended, so
argparse checks every value before it (choices, types) and exits without doing any work; then
every --flag of the command must appear in that help (a misspelt flag would otherwise be
swallowed by --help). A fine-tune (bench_offload.py --gpu) also runs with --plan-only: its
sizing (model, batch, --cpu-budget against the GPU's and host's memory) must pass. torchrun's
own options go through its parser; pytest's paths must exist.

With --wheels DIR (stages 2 and 3: .devdeps/deepspeed), DeepSpeed's carried wheels must resolve
offline for the GPU machine's Python (3.12, x86_64 Linux): every requirement of the DeepSpeed
wheel but torch and numpy (there already), with their own requirements, from DIR alone. No
DeepSpeed wheel there is a warning, not a problem (CI carries none; the GPU run then leaves
DeepSpeed out).

    python3 scripts/gpu_check_argv.py COMMANDS_FILE [--wheels DIR]   # exit 1, a line per problem
"""

from __future__ import annotations

import contextlib
import email.parser
import glob
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import zipfile

# The GPU machine's Python (docs/gpu.md) and the wheel tags pip may pick for it.
TARGET = ["--implementation", "cp", "--python-version", "3.12", "--abi", "cp312", "--abi", "abi3",
          "--abi", "none", "--platform", "manylinux_2_28_x86_64", "--platform",
          "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any"]
THERE_ALREADY = {"torch", "numpy"}  # installed on the GPU machine, never carried


def run_script(script: str, args: list[str]) -> tuple[object, str]:
    """(exit code, output) of `python3 script args` run in this process."""
    out = io.StringIO()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python3 script.py` does
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return code, out.getvalue()


def check_script(script: str, args: list[str]) -> str | None:
    if not os.path.isfile(script):
        return f"{script}: no such file"
    code, text = run_script(script, [*args, "--help"])
    if code not in (0, None):
        return f"{script} {shlex.join(args)}: exit {code}: {text.strip()[-300:]}"
    if "usage:" not in text:
        return f"{script}: --help printed no usage (did it run instead?)"
    missing = [a.split("=", 1)[0] for a in args
               if a.startswith("--") and a.split("=", 1)[0] not in text]
    if missing:
        return f"{script}: unknown flags {missing}"
    if os.path.basename(script) == "bench_offload.py" and "--gpu" in args:
        # the fine-tune's sizing needs no GPU: a model, batch or budget that does not fit (or a
        # --cpu-budget below one generation) is refused here, not on the device
        code, text = run_script(script, [*args, "--plan-only"])
        if code not in (0, None) or "plan:" not in text:
            return f"{script} {shlex.join(args)} --plan-only: exit {code}: {text.strip()[-300:]}"
    return None


def check_pytest(args: list[str]) -> str | None:
    for a in args:
        path = a.split("::")[0]  # a node id: file::test
        if not a.startswith("-") and ("/" in a or ".py" in path) and not os.path.exists(path):
            return f"pytest: no such path {a}"
        if "::" in a and not a.startswith("-"):
            with open(path) as f:
                if f"def {a.split('::')[-1]}(" not in f.read():
                    return f"pytest: no test {a}"
    if any(a.startswith("--timeout") for a in args):
        try:
            import pytest_timeout  # noqa: F401
        except ImportError:
            return "pytest: --timeout given but pytest-timeout is not importable"
    return None


def check(argv: list[str]) -> str | None:
    while argv and (argv[0] == "env" or "=" in argv[0]):  # env VAR=value ...
        argv = argv[1:]
    if not argv or "python" not in os.path.basename(argv[0]):
        return f"not a python command: {shlex.join(argv)}"
    argv = argv[1:]
    if argv[:2] == ["-m", "pytest"]:
        return check_pytest(argv[2:])
    if argv[:2] == ["-m", "torch.distributed.run"]:
        from torch.distributed.run import get_args_parser

        launcher = get_args_parser().parse_args(argv[2:])  # exits on a bad launcher option
        return check_script(launcher.training_script, launcher.training_script_args)
    if argv and argv[0].endswith(".py"):
        return check_script(argv[0], argv[1:])
    return f"cannot check: {shlex.join(argv)}"


def wheel_requirements(wheel: str) -> list[str]:
    """The Requires-Dist entries of a wheel that no extra asks for."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return [r for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r]


def check_wheels(folder: str) -> tuple[list[str], list[str]]:
    """(warnings, problems) for the DeepSpeed wheels carried in folder."""
    found = sorted(glob.glob(os.path.join(folder, "deepspeed-*.whl")))
    if not found:
        return [f"no DeepSpeed wheel in {folder}: the GPU run leaves DeepSpeed out (fetch it as "
                "scripts/gpu_check.sh's top says)"], []
    reqs = [r.split(";")[0].strip() for r in wheel_requirements(found[-1])]
    reqs = [r for r in reqs if re.match(r"[A-Za-z0-9._-]+", r)[0].lower() not in THERE_ALREADY]
    with tempfile.TemporaryDirectory() as target:  # --dry-run: nothing is written there
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
             "--no-index", "--find-links", folder, "--only-binary=:all:", "--target", target,
             *TARGET, *reqs], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        err = [ln for ln in proc.stderr.splitlines() if ln.strip()] or ["(no output)"]
        return [], [f"{folder}: {os.path.basename(found[-1])}'s requirements do not resolve "
                    f"offline for Python 3.12 from the carried wheels: {err[-1]}"]
    names = [i["metadata"]["name"] for i in json.loads(proc.stdout)["install"]]
    print(f"dry run: {os.path.basename(found[-1])} and {len(names)} carried dependencies resolve "
          f"offline for Python 3.12 ({', '.join(names)})")
    return [], []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    warnings, problems = [], []
    if "--wheels" in argv:
        at = argv.index("--wheels")
        warnings, problems = check_wheels(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    with open(argv[0]) as f:
        commands = [shlex.split(line) for line in f if line.strip()]
    problems += [p for p in (check(c) for c in commands) if p]
    for w in warnings:
        print(f"dry run: warning: {w}")
    for p in problems:
        print(f"dry run: {p}")
    print(f"dry run: {len(commands)} commands checked, {len(problems)} problem(s)")
    return 1 if problems or not commands else 0


if __name__ == "__main__":
    raise SystemExit(main())
