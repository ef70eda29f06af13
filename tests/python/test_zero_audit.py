"""Less-travelled tierlift.zero paths against plain torch on the same data, on 2 gloo ranks
(one spawn runs every case): weights= files that hold both names of a tied weight."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from zero_model import TinyGPT, make_model, spawn_ranks

import tierlift

pytest.importorskip("safetensors", reason="needs safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402


def _tied_file(rank: int, tmp: str) -> dict:
    """Files holding two different tensors under the two names of the model's tied weight:
    weights= keeps what torch's load_state_dict keeps (the last name in model order)."""
    path = os.path.join(tmp, "tied.safetensors")
    if rank == 0:
        sd = {k: v.clone() for k, v in make_model().state_dict().items()}
        sd["head.weight"] = sd["tok.weight"] + 1.0
        save_file(sd, path)
    dist.barrier()
    ref = make_model()
    ref.load_state_dict(load_file(path))
    out = {}
    for stage in (3, 1):
        with tierlift.zero.deferred_init():
            model = TinyGPT()
        model = tierlift.zero.shard(model, stage=stage, device="cpu", weights=path)
        sd = tierlift.zero.full_state_dict(model)
        out[stage] = [k for k, v in ref.state_dict().items() if not torch.equal(v, sd[k])]
    return out


def _cases(rank: int, world: int, tmp: str) -> dict:
    return {"tied_file": _tied_file(rank, tmp)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("audit")))


def test_weights_tied_names_last_wins(ranks):
    for res in ranks:
        assert res["tied_file"] == {3: [], 1: []}
