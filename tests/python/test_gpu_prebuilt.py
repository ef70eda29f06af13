"""scripts/gpu_prebuilt.py decides whether an extension built ahead on this machine may stand in
for building one on the GPU machine: a stale or mismatched one must never be used, since the GPU
run would then test and measure other code than the tree's."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_prebuilt  # noqa: E402


def fake_tree(root: Path) -> Path:
    (root / "csrc" / "cuda").mkdir(parents=True)
    (root / "setup.py").write_text("flags = ['-O3']\n")
    (root / "csrc" / "cuda" / "adam.cu").write_text("__global__ void k() {}\n")
    (root / "csrc" / "adam.h").write_text("#pragma once\n")
    return root


def record(tree: Path, folder: Path, **overrides) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / gpu_prebuilt.MANIFEST).write_text(
        json.dumps({**gpu_prebuilt.manifest(str(tree)), **overrides}))


def test_a_build_of_this_tree_for_this_python_fits(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    record(tree, tmp_path / "pre")
    ok, why = gpu_prebuilt.check(str(tmp_path / "pre"), str(tree))
    assert ok, why
    assert why.startswith("sources ")


def test_any_change_to_a_build_input_makes_it_stale(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    record(tree, tmp_path / "pre")
    for change in (lambda: (tree / "csrc" / "adam.h").write_text("#pragma once\n// edit\n"),
                   lambda: (tree / "csrc" / "new.cc").write_text(""),
                   lambda: (tree / "setup.py").write_text("flags = ['-O2']\n")):
        before = gpu_prebuilt.source_digest(str(tree))
        change()
        assert gpu_prebuilt.source_digest(str(tree)) != before
        ok, why = gpu_prebuilt.check(str(tmp_path / "pre"), str(tree))
        assert not ok and "the sources changed" in why, why
        ok, _ = gpu_prebuilt.check(str(tmp_path / "pre"), str(tree), sources_only=True)
        assert not ok


def test_a_renamed_file_is_a_change_too(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    before = gpu_prebuilt.source_digest(str(tree))
    (tree / "csrc" / "adam.h").rename(tree / "csrc" / "adam2.h")
    assert gpu_prebuilt.source_digest(str(tree)) != before


def test_another_python_or_torch_does_not_fit(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    record(tree, tmp_path / "py", python="cp312" if sys.version_info[:2] != (3, 12) else "cp311")
    ok, why = gpu_prebuilt.check(str(tmp_path / "py"), str(tree))
    assert not ok and why.startswith("python: built for cp3"), why
    record(tree, tmp_path / "torch", torch="1.0.0")
    ok, why = gpu_prebuilt.check(str(tmp_path / "torch"), str(tree))
    assert not ok and "torch: built for 1.0.0" in why, why
    # a dry run on this machine (not the GPU's) compares the sources alone
    assert gpu_prebuilt.check(str(tmp_path / "torch"), str(tree), sources_only=True)[0]


def test_no_manifest_does_not_fit(tmp_path):
    ok, why = gpu_prebuilt.check(str(tmp_path), str(tmp_path))
    assert not ok and "no readable" in why


def test_the_cli_records_and_checks_this_tree(tmp_path):
    cli = [sys.executable, str(ROOT / "scripts" / "gpu_prebuilt.py")]
    subprocess.run(cli + ["record", str(tmp_path)], check=True, timeout=120)
    assert json.loads((tmp_path / "manifest.json").read_text())["sources"] == \
        gpu_prebuilt.source_digest()
    proc = subprocess.run(cli + ["check", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_dry_run_says_whether_the_prebuilt_build_will_be_used(tmp_path):
    pre = tmp_path / "pre"
    record(ROOT, pre)
    (pre / "_C.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_SCRATCH": str(tmp_path / "s"),
           "GPU_CHECK_DRY": "1", "GPU_CHECK_PREBUILT": str(pre)}
    run = lambda: subprocess.run(["bash", "scripts/gpu_check.sh", "1"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=300)
    proc = run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the prebuilt extension's sources are this tree's" in proc.stdout, proc.stdout
    record(ROOT, pre, sources="0" * 64)
    proc = run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning: the prebuilt extension will not be used (the sources changed" in proc.stdout
