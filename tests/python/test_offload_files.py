"""The optimizer's own state folders under nvme_path: a durable one has one owner at a time,
even when two optimizers claim it at the same instant, and belongs to one process (ranks would
reopen at different steps).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

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
