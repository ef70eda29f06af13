"""A stage-3 forward that some ranks run and others do not (an eval under torch.no_grad() on
rank 0 only) would pair its weight gathers with the other rank's backward gathers: gloo aborted
the process ("Received data size doesn't match expected size"), or the sizes matched. Both ranks
now raise RankFailureError naming the cause, before the first mismatched collective; the same
eval on every rank is fine (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from test_zero_unused import _make
from zero_model import spawn_ranks

import tierlift


def _step(model, opt, x) -> None:
    opt.zero_grad()
    model(x, (True, True)).pow(2).mean().backward()
    opt.step()


def _cases(rank: int, world: int, tmp: str) -> dict:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    model = tierlift.zero.shard(_make(), stage=3, units=["l1", "l2", "head"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, x)
    with torch.no_grad():  # on every rank: fine
        model(x, (True, False))
    _step(model, opt, x)
    opt.zero_grad()
    loss = model(x, (True, True)).pow(2).mean()
    with torch.no_grad():  # on every rank, between a forward and its backward: fine
        model(x, (True, False))
    loss.backward()
    opt.step()
    out = {"same_eval": "<no error>"}
    try:
        if rank == 0:
            with torch.no_grad():
                model(x, (True, False))
        _step(model, opt, x)
        out["one_rank_eval"] = "<no error>"
    except tierlift.zero.RankFailureError as e:
        out["one_rank_eval"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_unused_forward")))


def test_same_eval_on_every_rank_runs(ranks):
    for out in ranks:
        assert out["same_eval"] == "<no error>"


def test_eval_forward_on_one_rank_named_on_every_rank(ranks):
    for out in ranks:
        msg = out["one_rank_eval"]
        assert "ran on some ranks only" in msg and "torch.no_grad()" in msg, msg
