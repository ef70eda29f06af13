"""The optimizer's own state folders under nvme_path: a durable one has one owner at a time,
even when two optimizers claim it at the same instant, belongs to one process (ranks would
reopen at different steps), and one left by a load that was interrupted is mended by the next
load, as its error says.
"""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
from torch import nn

import tierlift
from tierlift.io import IoEngine
from tierlift.offload import durable
from tierlift.optim import AdamW


def test_two_optimizers_claiming_one_durable_folder_at_once(tmp_path, monkeypatch):
    """Both read "no owner" before either wrote its owner.json: both took the folder, and
    would have stepped on each other's state files (two processes started together: both in 1
    of 10 tries, a bare FileNotFoundError in the other 9). Now the second waits, then is
    refused."""
    folder = str(tmp_path / "state")
    paused, go = threading.Event(), threading.Event()
    owner = durable._owner
    first: list[threading.Thread] = []

    def slow_owner():  # the first claim stops right before it writes its owner.json
        if threading.current_thread() is first[0]:
            paused.set()
            go.wait(30)
        return owner()

    monkeypatch.setattr(durable, "_owner", slow_owner)
    results = {}

    def claim(name):
        try:
            results[name] = durable.claim_dir(folder)
        except RuntimeError as e:
            results[name] = str(e)

    a = threading.Thread(target=claim, args=("a",))
    b = threading.Thread(target=claim, args=("b",))
    first.append(a)
    a.start()
    assert paused.wait(30)
    b.start()
    b.join(1.0)  # without the claim lock, b took the folder meanwhile
    go.set()
    a.join(30)
    b.join(30)
    assert results["a"] is True, results
    assert isinstance(results["b"], str) and "in use" in results["b"], results


def test_durable_state_is_refused_on_several_ranks(tmp_path, monkeypatch):
    """Each rank's folder commits on its own: ranks killed a moment apart reopened at
    different steps (measured: DDP replicas at steps 2 and 1, weights 1e-2 apart, no error)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    params = [torch.randn(3000, requires_grad=True)]
    with pytest.raises(ValueError, match="durable=True is for one process.*rank 1 of 2"):
        AdamW(params, lr=1e-2, offload="nvme", nvme_path=str(tmp_path), cpu_budget=1 << 20,
              durable=True)
    assert os.listdir(tmp_path) == []


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 5))


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 40, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _durable(model, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "reopened the durable ... state"
        return AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload="nvme",
                     nvme_path=str(path), cpu_budget=1 << 20, chunk_bytes=4096,
                     nvme_generations=1, durable=True)


@pytest.mark.parametrize("how", ["checkpoint", "load_state_dict"])
def test_a_durable_state_left_by_an_interrupted_load_is_mended_by_a_load(tmp_path, monkeypatch,
                                                                         how):
    """A load into one generation rewrites chunks in place; interrupted (here: a full drive,
    then the process gone), the reopened optimizer refuses to step "until a load succeeds".
    But that load checked every chunk against the CRCs committed before the interrupted load
    and refused each chunk it had rewritten as corrupt: no load could succeed."""
    model = _model()
    opt = _durable(model, tmp_path)
    twin = _model()
    twin_opt = AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    other = _model()
    other_opt = AdamW(other.parameters(), lr=1e-2, weight_decay=0.1)
    for step in (1, 2):
        _step(model, opt, step)
        _step(twin, twin_opt, step)
        _step(other, other_opt, 10 + step)
    writes, write = [0], IoEngine.write

    def failing(self, *args, **kwargs):
        writes[0] += 1
        if writes[0] == 3:  # the first chunk is rewritten, the second is not
            raise OSError(28, "injected full drive")
        return write(self, *args, **kwargs)

    monkeypatch.setattr(IoEngine, "write", failing)
    with pytest.raises(OSError, match="injected"):
        opt.load_state_dict(other_opt.state_dict())
    monkeypatch.undo()
    opt.close()  # the process ends: its folder stays, its manifest says a load was under way
    model = _model()
    opt = _durable(model, tmp_path)
    with pytest.raises(RuntimeError, match="was interrupted; load a checkpoint"):
        opt.step()
    if how == "checkpoint":
        ck = tmp_path / "ck"
        tierlift.checkpoint.save(ck, twin, twin_opt)
        tierlift.checkpoint.load(ck, model, opt)
    else:
        model.load_state_dict(twin.state_dict())
        opt.load_state_dict(twin_opt.state_dict())
    _step(model, opt, 3)
    _step(twin, twin_opt, 3)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    got, want = opt.state_dict()["state"], twin_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[i][k], want[i][k]) for i in want for k in want[i])
    opt.close()
