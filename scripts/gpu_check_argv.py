"""Checks the commands that scripts/gpu_check.sh would run on the GPU machine (its dry run,
GPU_CHECK_DRY=1, writes them one per line), so that a device call cannot fail on a typo.

In one process (torch is imported once): each Python script runs with --help appended, so
argparse checks every value before it (choices, types) and exits without doing any work; then
every --flag of the command must appear in that help (a misspelt flag would otherwise be
swallowed by --help). torchrun's own options go through its parser; pytest's paths must exist.

    python3 scripts/gpu_check_argv.py COMMANDS_FILE     # exit 1 and one line per problem
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import shlex
import sys


def check_script(script: str, args: list[str]) -> str | None:
    if not os.path.isfile(script):
        return f"{script}: no such file"
    out = io.StringIO()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args, "--help"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python3 script.py` does
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    if code not in (0, None):
        return f"{script} {shlex.join(args)}: exit {code}: {out.getvalue().strip()[-300:]}"
    text = out.getvalue()
    if "usage:" not in text:
        return f"{script}: --help printed no usage (did it run instead?)"
    missing = [a.split("=", 1)[0] for a in args
               if a.startswith("--") and a.split("=", 1)[0] not in text]
    return f"{script}: unknown flags {missing}" if missing else None


def check_pytest(args: list[str]) -> str | None:
    for a in args:
        if not a.startswith("-") and ("/" in a or a.endswith(".py")) and not os.path.exists(a):
            return f"pytest: no such path {a}"
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


def main() -> int:
    with open(sys.argv[1]) as f:
        commands = [shlex.split(line) for line in f if line.strip()]
    problems = [p for p in (check(c) for c in commands) if p]
    for p in problems:
        print(f"dry run: {p}")
    print(f"dry run: {len(commands)} commands checked, {len(problems)} problem(s)")
    return 1 if problems or not commands else 0


if __name__ == "__main__":
    raise SystemExit(main())
