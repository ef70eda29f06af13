"""A relative directory given to tierlift names the folder it named when it was given, even after
the process changes its working directory (a launcher or a logger calling os.chdir): the stage-3
parameter shards (offload_params="nvme") and the activation spill file stay where they were
put, are read back from there, and are removed from there. (The offloaded optimizer's state:
test_offload_*; background checkpoints: test_checkpoint_paths.py.)"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from test_zero_offload import LR, assert_same, fit, make_net

import tierlift
from tierlift.activations import offload
from tierlift.offload import tiers

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def folders(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith(tiers.DIR_PREFIX))


@pytest.fixture
def two_dirs(tmp_path, monkeypatch):
    """Working in a/ (which holds nvme/), then moved to b/ (which holds an nvme/ too, so a path
    read again relative to the new directory would name other files, not fail)."""
    for d in ("a/nvme", "b/nvme"):
        (tmp_path / d).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    yield lambda: monkeypatch.chdir(tmp_path / "b")
    assert os.listdir(tmp_path / "b" / "nvme") == []


def _fit_zero3(**shard_kw):
    model = tierlift.zero.shard(make_net(), stage=3, **shard_kw)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def test_zero3_nvme_params_under_a_relative_path_after_a_chdir(tmp_path, two_dirs):
    """Before, the next gather refused the shard file as replaced (its watch looked the relative
    name up in b/), and the folder was left behind in a/nvme when the model went."""
    torch.set_num_threads(1)
    model, opt = _fit_zero3(offload_params="nvme", nvme_path="nvme")
    assert len(folders(tmp_path / "a" / "nvme")) == 1
    two_dirs()
    fit(model, opt, steps=3)
    ref, ref_opt = _fit_zero3()
    fit(ref, ref_opt, steps=3)
    assert_same(tierlift.zero.full_state_dict(model), tierlift.zero.full_state_dict(ref))
    tierlift.zero.close(model)
    assert folders(tmp_path / "a" / "nvme") == []
    # And when the model is only dropped, without close().
    model, opt = _fit_zero3(offload_params="nvme", nvme_path="nvme")  # "nvme" of b/ now
    assert len(folders(tmp_path / "b" / "nvme")) == 1
    os.chdir(tmp_path / "a")
    fit(model, opt, steps=1)
    del model, opt
    gc.collect()
    assert folders(tmp_path / "b" / "nvme") == []


def _spill_dirs() -> set[str]:
    """The folders of this process's open files under an nvme/ (the anonymous activation file
    and the io engine's descriptors of it)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "/nvme/" in target:
            out.add(os.path.dirname(target))
    return out


def test_activation_spill_under_a_relative_path_after_a_chdir(tmp_path, two_dirs):
    """Before, the spill file was made at the first forward, under the relative name looked up
    in the new working directory: b/nvme here, another drive than the one given (or an OSError
    where the new directory has no such folder)."""
    tl = offload(cpu_budget=0, nvme_path="nvme", min_bytes=0)
    two_dirs()
    x = torch.randn(64, 64, requires_grad=True)
    for _ in range(2):  # the second forward makes its file again
        with tl:
            y = x.exp().tanh().sum()
        assert tl.last_stats["nvme_bytes"] > 0
        assert _spill_dirs() == {str(tmp_path / "a" / "nvme")}
        y.backward()
    x2 = x.detach().clone().requires_grad_()  # the same steps without offload
    for _ in range(2):
        x2.exp().tanh().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    tl.close()
