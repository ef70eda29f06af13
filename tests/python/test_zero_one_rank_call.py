"""A collective called by one rank only (`if rank == 0: tierlift.zero.full_state_dict(model)`,
as `if trainer.is_world_process_zero(): trainer.save_model()` does) is named on both ranks
within seconds, instead of hanging until the process group's timeout (2 gloo ranks):

- the other rank reaches its next forward after the call was made: both raise at once, before
  any collective, and both can go on training (each raised before communicating);
- the other rank was already inside its next forward's all-gather: the caller raises at once;
  once it exits, the waiting rank's collective fails and its error names the call."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from zero_model import batches, make_model

import tierlift

NAME = "tierlift.zero.full_state_dict"


def _forward(model, rank):
    local = batches(1, 4)[0].chunk(2)[rank]
    return model(local[:, :-1]).sum()


def _attempt(fn) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        fn()
    except tierlift.zero.RankFailureError as e:
        return str(e), time.monotonic() - t0
    return "<no error>", time.monotonic() - t0


def _cases(rank: int, tmp: str) -> None:
    # The store lives in a file, not in rank 0's process, as torchrun's agent hosts it: the
    # waiting rank can still read it once rank 0 has left.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    out = {}
    model = tierlift.zero.shard(make_model(), stage=3)
    _forward(model, rank).backward()  # a normal step first
    # The other rank starts its next forward after the call was made.
    if rank == 0:
        out["late"] = _attempt(lambda: tierlift.zero.full_state_dict(model))
    else:
        time.sleep(1.0)
        out["late"] = _attempt(lambda: _forward(model, rank))
    # Nothing was communicated: both go on together.
    out["after"] = float(_forward(model, rank).detach())
    # The other rank is inside its forward's all-gather before the call.
    if rank == 0:
        time.sleep(1.0)
        out["early"] = _attempt(lambda: tierlift.zero.full_state_dict(model))
    else:
        out["early"] = _attempt(lambda: _forward(model, rank))
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))
    os._exit(0)  # rank 0 leaves: rank 1's pending collective fails and names the call


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("one_rank_call"))
    mp.spawn(_cases, args=(tmp,), nprocs=2)
    return [torch.load(os.path.join(tmp, f"out{r}.pt")) for r in range(2)]


def test_later_forward_and_caller_both_name_the_call(ranks):
    caller, other = ranks[0]["late"], ranks[1]["late"]
    assert caller[0].startswith(f"tierlift.zero: rank 0 called {NAME}, a collective that every "
                                "rank must call, but rank 1 went on to forward step"), caller
    assert other[0].startswith(f"tierlift.zero: rank 0 called {NAME}, a collective that every "
                               "rank must call, but rank 1 went on to forward step 2 "), other
    assert caller[1] < 10 and other[1] < 10
    assert ranks[0]["after"] != 0 and ranks[1]["after"] != 0


def test_rank_inside_a_collective_is_told_which_call(ranks):
    caller, other = ranks[0]["early"], ranks[1]["early"]
    assert caller[0].startswith(f"tierlift.zero: rank 0 called {NAME}, a collective that every "
                                "rank must call, but rank 1 went on to forward step"), caller
    assert caller[1] < 10
    assert f"rank 0 called {NAME}, a collective that every rank must call, and rank 1 did " \
           "not" in other[0], other
