"""setup.py's ccache wiring: a clone elsewhere must hit what an earlier checkout compiled, on
the torch that wraps the compilers in ccache itself (2.15, CI's) and on the one that does not
(2.11, the GPU machine's, which scripts/test_torch211.sh builds for in CI)."""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import pytest
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[2]
MASQUERADE = "/usr/lib/ccache/c++"
ENV = ("CCACHE_BASEDIR", "CCACHE_NOHASHDIR", "CXX", "PYTORCH_NVCC")


@pytest.fixture
def setup_py(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("tierlift_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines; main() runs only as a script
    return module


def _older_torch(monkeypatch):
    """torch.utils.cpp_extension as torch 2.11 has it: no _wrap_compiler."""
    older = types.SimpleNamespace(CUDA_HOME="/usr/local/cuda")
    monkeypatch.setattr("torch.utils.cpp_extension", older)


def test_a_torch_that_wraps_the_compilers_is_left_to_do_so(setup_py):
    assert hasattr(cpp_extension, "_wrap_compiler")  # CI's torch
    setup_py._use_ccache()
    assert os.environ["CCACHE_BASEDIR"] == str(ROOT)
    assert os.environ["CCACHE_NOHASHDIR"] == "1"  # -g would hash the clone's build folder
    assert "CXX" not in os.environ and "PYTORCH_NVCC" not in os.environ


def test_an_older_torch_gets_both_compilers_through_ccache(setup_py, monkeypatch):
    if not Path(MASQUERADE).exists():
        pytest.skip("no ccache masquerade (apt-get install ccache)")
    _older_torch(monkeypatch)
    setup_py._use_ccache()
    assert os.environ["CXX"] == MASQUERADE
    assert os.environ["PYTORCH_NVCC"] == "ccache /usr/local/cuda/bin/nvcc"
    assert os.environ["CCACHE_NOHASHDIR"] == "1"


def test_compilers_the_user_chose_are_kept(setup_py, monkeypatch):
    _older_torch(monkeypatch)
    monkeypatch.setenv("CXX", "clang++")
    monkeypatch.setenv("PYTORCH_NVCC", "/opt/nvcc")
    monkeypatch.setenv("CCACHE_NOHASHDIR", "")
    setup_py._use_ccache()
    assert (os.environ["CXX"], os.environ["PYTORCH_NVCC"]) == ("clang++", "/opt/nvcc")
    assert os.environ["CCACHE_NOHASHDIR"] == ""
