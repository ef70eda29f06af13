"""The command lines of README.md and docs/*.md, run as written, and what the text says they print.

test_docs_snippets.py runs the ```python blocks; this file covers the shell lines around them:
`python -m tierlift plan` and `python -m tierlift.checkpoint` commands whose output (or refusal)
a page quotes, run in this process through the same main() the command line calls, the quote
read from the page itself so that a changed planner or a changed page fails here; and every
`--flag` a documented command passes, which the script it runs must define. The GPU machine's
page (docs/gpu.md) is left out: its commands need a GPU."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tierlift

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def page(rel: str) -> str:
    return (ROOT / rel).read_text()


def flat(text: str) -> str:
    """Whitespace as one space: a page wraps what a terminal prints on one line."""
    return " ".join(text.split())


def fenced(rel: str, starting: str) -> str:
    """The fenced block of `rel` whose first line starts with `starting` (exactly one)."""
    found = [body for _, body in _FENCE.findall(page(rel)) if body.startswith(starting)]
    assert len(found) == 1, f"{rel}: {len(found)} blocks start with {starting!r}"
    return found[0]


def command(line: str, prog: str) -> list[str]:
    """argv after `python -m <prog>` in a documented line (continuations joined)."""
    words = line.replace("\\\n", " ").split()
    i = words.index(prog)
    return words[i + 1:]


def cli(main, argv: list[str]) -> tuple[int, str, str]:
    """A command's main() as `python -m` runs it: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's error(): status 2
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def plan(argv: list[str]) -> tuple[int, str, str]:
    from tierlift.__main__ import main

    return cli(main, argv)


# ---- python -m tierlift ----
def test_info_is_build_info():
    rc, out, _ = plan(["info"])  # README: tierlift.build_info() "(also: python -m tierlift info)"
    assert rc == 0 and json.loads(out) == tierlift.build_info()


def test_host_tier_plan_prints_the_quoted_layout(tmp_path, monkeypatch):
    """offload-plan.md: the 8e9-parameter plan on an 80 GB GPU and 128 GB of host memory."""
    monkeypatch.chdir(tmp_path)
    text = page("docs/offload-plan.md")
    quoted = fenced("docs/offload-plan.md", "offload='cpu': optimizer state in pinned host")
    before = text[:text.index(quoted)]
    line = re.findall(r"`(python -m tierlift plan [^`]*)`", before)[-1]  # the prose's command
    rc, out, err = plan(command(line, "tierlift"))
    assert rc == 0, err
    assert flat(quoted) in flat(out.split("\n\n")[0])


def test_hybrid_plan_prints_the_quoted_layout(tmp_path, monkeypatch):
    """offload-plan.md: 13e9 parameters with a 64 GB drive (the block: command, then output)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()  # the page's placeholder, kept: the output names it
    line, quoted = fenced("docs/offload-plan.md", "python -m tierlift plan --params 13e9").split(
        "\n", 1)
    rc, out, err = plan(command(line, "tierlift"))
    assert rc == 0, err
    assert flat(quoted) in flat(out)


def test_host_budget_refusal_is_the_quoted_one():
    """offload-plan.md: `--cpu-budget 96.1e9` for 8e9 parameters is refused with the quote."""
    text = flat(page("docs/offload-plan.md"))
    budget, quoted = re.search(r"\(`(--cpu-budget \S+)` for 8e9 parameters: `([^`]*)`\)",
                               text).groups()
    box = re.search(r"`(python -m tierlift plan --params 8e9 --gpu-mem 80G --cpu-mem 128G)`",
                    text).group(1)
    rc, out, err = plan(command(box, "tierlift") + budget.split())
    assert rc == 2 and out == ""
    assert quoted in flat(err)


def test_largest_model_on_the_box_is_the_tables(tmp_path, monkeypatch):
    """offload-plan.md's bold cell: compact state, parameters in RAM, bf16 gradients."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()
    text = page("docs/offload-plan.md")
    # the row "`cpu`, bf16, auto": bf16 gradients (`--grad-dtype bf16`), device shards as fit
    compact = re.search(r"\| `cpu`, bf16, auto \| [\d.]+B \| \*\*([\d.]+)B\*\*", text).group(1)
    line = re.search(r"`(python -m tierlift plan --max-params [^`]*--offload-params) \.\.\.`",
                     flat(text)).group(1)
    argv = command(line, "tierlift") + ["cpu", "--grad-dtype", "bf16", "--state-dtype", "bf16"]
    rc, out, err = plan(argv)
    assert rc == 0, err
    assert out.startswith(f"largest model that fits: {compact}B parameters")


def test_activation_policy_is_the_commented_one(tmp_path, monkeypatch):
    """activations.md: the command's comment says the policy it prints. The 2 GB blocks cost
    ~0.8 s out and back on the pages' disk against 0.15 s of compute: recomputation wins on
    any disk below ~25 GB/s, so the measured bandwidth does not change the answer."""
    monkeypatch.chdir(tmp_path)
    block = fenced("docs/activations.md", "python -m tierlift plan --params 1e9")
    cmd = "\n".join(ln for ln in block.splitlines() if not ln.startswith("#"))
    said = flat(" ".join(ln.lstrip("# ") for ln in block.splitlines() if ln.startswith("#")))
    rc, out, err = plan(command(cmd, "tierlift"))
    assert rc == 0, err
    assert said in flat(out)


# ---- python -m tierlift.checkpoint ----
def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=32))


def test_hand_off_commands_as_written(tmp_path, monkeypatch):
    """zero-checkpoints.md, "Hand-off to other tools": a DCP save imported, then exported for
    from_pretrained, which loads it "bit for bit"; the page's intro: a plain state dict, and an
    output name ending in / refused before anything is written."""
    pytest.importorskip("transformers")
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from tierlift.checkpoint.__main__ import main

    monkeypatch.chdir(tmp_path)
    model = _llama()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model.config.save_pretrained(".")  # config.json
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model.state_dict(), "optim": {"step": torch.tensor(3.0)}},
                 checkpoint_id="DCP_DIR")
    export, import_dcp = fenced("docs/zero-checkpoints.md",
                                "python -m tierlift.checkpoint export CKPT").splitlines()
    rc, _, err = cli(main, command(import_dcp, "tierlift.checkpoint"))  # writes CKPT
    assert rc == 0, err
    rc, _, err = cli(main, command(export, "tierlift.checkpoint"))  # CKPT -> hf_out
    assert rc == 0, err
    back = AutoModelForCausalLM.from_pretrained("hf_out").state_dict()
    assert back.keys() == want.keys()
    assert all(torch.equal(back[k], v) for k, v in want.items())

    intro = flat(page("docs/zero-checkpoints.md"))
    plain = re.search(r"`python -m (tierlift\.checkpoint export CKPT out\.pt)`", intro).group(1)
    assert "an output name ending in `/` is refused before anything is written" in intro
    rc, _, err = cli(main, plain.split()[1:])
    assert rc == 0, err
    sd = torch.load("out.pt")
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], v) for k, v in want.items())
    rc, _, err = cli(main, plain.replace("out.pt", "out2/").split()[1:])
    assert rc == 2 and "out2/" in err and not os.path.exists("out2")


# ---- flags of every documented command ----
_PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")
                                if p.name != "gpu.md")  # the GPU machine's own commands
_SCRIPT = re.compile(r"(?:python3?|torchrun[^`\n]*?)\s+((?:benchmarks|examples)/\w+\.py)"
                     r"([^`\n#]*)")
_MODULE = re.compile(r"python3? -m (tierlift(?:\.\w+)*)([^`\n#]*)")
# where each `python -m` module's arguments are defined
_MODULE_SOURCES = {
    "tierlift": ["python/tierlift/__main__.py", "python/tierlift/plan/cli.py"],
    "tierlift.checkpoint": ["python/tierlift/checkpoint/__main__.py"],
    "tierlift.hf.launch": ["python/tierlift/hf/launch.py"],
}


def _with_local_imports(script: Path) -> str:
    """A script's text and that of the modules it imports from its own folder (a benchmark's
    flags live partly in helpers such as offload_finetune.py)."""
    text = script.read_text()
    for name in re.findall(r"^\s*from (\w+) import", text, re.M):
        helper = script.parent / f"{name}.py"
        if helper.exists():
            text += helper.read_text()
    return text


def documented_commands() -> list[tuple[str, str, str]]:
    """(page, what runs, its flags) for every documented command line."""
    found = []
    for rel in _PAGES:
        text = page(rel).replace("\\\n", " ")
        for m in _SCRIPT.finditer(text):
            found.append((rel, m.group(1), m.group(2)))
        for m in _MODULE.finditer(text):
            found.append((rel, m.group(1), m.group(2)))
    return found


def test_documented_flags_exist():
    missing = []
    for rel, what, args in documented_commands():
        if what.endswith(".py"):
            source = _with_local_imports(ROOT / what)
        else:
            assert what in _MODULE_SOURCES, f"{rel}: python -m {what}: where are its flags?"
            source = "".join((ROOT / f).read_text() for f in _MODULE_SOURCES[what])
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", args):
            if f'"{flag}"' not in source and flag != "--help":
                missing.append((rel, what, flag))
    assert missing == []
    assert len(documented_commands()) > 40  # the scan still finds the pages' commands


# ---- a sharded script's exit ----
_ENDS_WITHOUT_DESTROY = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, tierlift
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
    torch.manual_seed(0)
    model = tierlift.zero.shard(torch.nn.Linear(8, 8), stage=3)
    model(torch.randn(2, 8)).sum().backward()
    print("trained", flush=True)
""")  # as the README's torchrun lines and the hf launcher's stock scripts end (one rank is enough)


def test_sharded_script_exits_cleanly(tmp_path):
    """tierlift's process-group pre-hooks are dropped at exit: torch frees a group the script
    never destroyed after Python has gone, and freeing a Python hook then was a SIGSEGV."""
    from zero_model import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _ENDS_WITHOUT_DESTROY,
                          f"tcp://127.0.0.1:{free_port()}"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert "trained" in run.stdout, run.stderr
    assert run.returncode == 0, run.stderr[-2000:]
