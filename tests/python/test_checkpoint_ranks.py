"""All-or-nothing loads across ranks and inside Adam.load_state_dict: a fault on ONE rank after
k chunk reads leaves EVERY rank with the params, optimizer state and steps it had before (the
failing rank raises its own error, the others one naming it), and the same checkpoint loads
on all ranks afterwards; on 2 -> 2 and 1 -> 2 ZeRO ranks and 2 DDP ranks. A rank that dies
half-way leaves the survivor rolled back, with the heartbeat's error naming it. A failure inside
Offloader.ingest leaves a direct opt.load_state_dict() without effect (steps, hyperparameters,
state, params)."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.multiprocessing as mp
from test_checkpoint_reshard import (
    DATA,
    _assert_same,
    _assert_same_state,
    _fresh,
    _full_state,
    _snapshot,
    _train,
)
from zero_model import free_port, init_gloo, shutdown, train

import tierlift
from tierlift.checkpoint import restore
from tierlift.offload.runner import Offloader


# ---- Adam.load_state_dict: a failure inside ingest changes nothing --------------------------
@pytest.mark.parametrize("tier", ["cpu", "cpu-overlap", "nvme"])
def test_a_state_dict_load_failing_inside_ingest_changes_nothing(tmp_path, monkeypatch, tier):
    model, opt = _fresh(tmp_path, tier, False)
    _train(model, opt, DATA[:2], False)
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 0.5  # a change a failed load must not leave behind
    _train(model, opt, DATA[2:4], False)
    before = _snapshot(model, opt, False)
    lr = opt.param_groups[0]["lr"]
    real, calls = Offloader._ingest_chunk, [0]

    def fails_after_a_fill(self, *args):
        calls[0] += 1
        real(self, *args)  # this chunk's state is filled (in place on the host tiers)...
        raise OSError(errno.ENOSPC, "injected: no space left on device")  # ...then it fails

    monkeypatch.setattr(Offloader, "_ingest_chunk", fails_after_a_fill)
    with pytest.raises(OSError, match="injected"):
        opt.load_state_dict(sd)
    assert calls[0] == 1
    _assert_same(_snapshot(model, opt, False), before)  # steps, m, v, master, params
    assert opt.param_groups[0]["lr"] == lr
    monkeypatch.undo()
    opt.load_state_dict(sd)  # and it loads once the fault is gone
    assert opt.param_groups[0]["lr"] == 0.5
    got = opt.state_dict()["state"]
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got[i][k]), torch.as_tensor(v)), (i, k)
    opt.close()


def test_a_failing_commit_check_puts_a_plain_adam_back(tmp_path):
    model, opt = _fresh(tmp_path, "cpu", False, offload="none")
    _train(model, opt, DATA[:2], False)
    sd = opt.state_dict()
    _train(model, opt, DATA[2:4], False)
    before = _snapshot(model, opt, False)

    def refuse():
        raise RuntimeError("another rank failed")

    with pytest.raises(RuntimeError, match="another rank"):
        opt._load_state_dict(sd, before_commit=refuse)
    _assert_same(_snapshot(model, opt, False), before)


# ---- a fault on rank 1 only: both ranks roll back --------------------------------------------
def _rank_snapshot(model, opt) -> dict:
    """This rank's own shards and optimizer state (a local view: no collective)."""
    st = opt.state_dict()["state"]
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": {i: {k: torch.as_tensor(v).clone() for k, v in s.items()}
                      for i, s in st.items()}}


def _flaky_reads(k: int) -> list:
    calls, real = [0], restore.read_into

    def flaky(f, arr):
        calls[0] += 1
        if calls[0] > k:
            raise OSError(errno.EIO, "injected read error", f.name)
        real(f, arr)

    restore.read_into = flaky
    return calls


def _load_failing_on_rank1(ck, model, opt, rank) -> None:
    """Loads `ck` with rank 1's reads failing after 3 chunks: rank 1 raises its own error,
    rank 0 the vote's naming rank 1."""
    real = restore.read_into
    calls = _flaky_reads(3) if rank == 1 else None
    try:
        if rank == 1:
            with pytest.raises(OSError, match="injected"):
                tierlift.checkpoint.load(ck, model, opt)
            assert calls[0] == 4  # 3 reads went into the state before the fault
        else:
            with pytest.raises(RuntimeError, match=r"failed on rank\(s\) \[1\]"):
                tierlift.checkpoint.load(ck, model, opt)
    finally:
        restore.read_into = real


def _load_with_fault(rank, world, port, root, tier, saved_world):
    init_gloo(rank, world, port)
    torch.set_num_threads(1)
    nvme = os.path.join(root, f"nvme{tier}{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = _fresh(nvme, tier, True)
    ck = os.path.join(root, f"ck{saved_world}")
    if saved_world == world:  # the same world: saves its own checkpoint, then trains on
        train(model, opt, DATA[:2], accum=1, clip=None, world=world, rank=rank, zero=True)
        tierlift.checkpoint.save(ck, model, opt)
        saved = _rank_snapshot(model, opt)
    train(model, opt, DATA[2:4], accum=1, clip=None, world=world, rank=rank, zero=True)
    before = _rank_snapshot(model, opt)
    _load_failing_on_rank1(ck, model, opt, rank)
    _assert_same(_rank_snapshot(model, opt), before)
    tierlift.checkpoint.load(ck, model, opt)  # both ranks load it once the reads work
    if saved_world == world:
        _assert_same(_rank_snapshot(model, opt), saved)
    check = os.path.join(root, f"check{saved_world}{tier}")
    tierlift.checkpoint.save(check, model, opt)  # what it loaded, compared by the parent
    opt.close()
    shutdown()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_fault_on_one_rank_rolls_back_every_rank(tmp_path, tier):
    root = str(tmp_path)
    mp.spawn(_load_with_fault, args=(2, free_port(), root, tier, 2), nprocs=2)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_fault_on_one_rank_of_a_one_to_two_reshard_rolls_back_both(tmp_path, tier):
    root = str(tmp_path)
    model, opt = _fresh(tmp_path, tier, True)
    _train(model, opt, DATA[:2], True)
    ck = os.path.join(root, "ck1")
    tierlift.checkpoint.save(ck, model, opt)
    opt.close()
    mp.spawn(_load_with_fault, args=(2, free_port(), root, tier, 1), nprocs=2)
    full = tierlift.checkpoint.full_state_dict(ck)
    check = os.path.join(root, f"check1{tier}")
    got = tierlift.checkpoint.full_state_dict(check)
    assert all(torch.equal(full[k], got[k]) for k in full)
    _assert_same_state(_full_state(check), _full_state(ck))  # m, v, master and steps


# ---- replicated (DDP) ranks: every rank reads the same files, and they agree too -------------
def _ddp_with_fault(rank, world, port, root, tier):
    init_gloo(rank, world, port)
    torch.set_num_threads(1)
    nvme = os.path.join(root, f"nvme{tier}{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = _fresh(nvme, tier, False)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    kw = dict(accum=1, clip=None, world=world, rank=rank)
    train(ddp, opt, DATA[:2], **kw)
    ck = os.path.join(root, "ck")
    tierlift.checkpoint.save(ck, ddp, opt)  # rank 0 writes
    saved = _rank_snapshot(ddp, opt)
    train(ddp, opt, DATA[2:4], **kw)
    before = _rank_snapshot(ddp, opt)
    _load_failing_on_rank1(ck, ddp, opt, rank)
    _assert_same(_rank_snapshot(ddp, opt), before)
    tierlift.checkpoint.load(ck, ddp, opt)
    _assert_same(_rank_snapshot(ddp, opt), saved)
    opt.close()
    shutdown()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_fault_on_one_ddp_rank_rolls_back_every_rank(tmp_path, tier):
    mp.spawn(_ddp_with_fault, args=(2, free_port(), str(tmp_path), tier), nprocs=2)


# ---- a rank that dies in the middle of a load: the survivor rolls back ----------------------
def _dies_half_way(rank, world, port, root):
    init_gloo(rank, world, port, timeout_s=20.0)
    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = _fresh(nvme, "cpu", True)
    train(model, opt, DATA[:2], accum=1, clip=None, world=world, rank=rank, zero=True)
    ck = os.path.join(root, "ck")
    tierlift.checkpoint.save(ck, model, opt)
    train(model, opt, DATA[2:4], accum=1, clip=None, world=world, rank=rank, zero=True)
    before = _rank_snapshot(model, opt)
    if rank == 1:
        real = restore.read_into

        def dies(f, arr):
            real(f, arr)
            os._exit(3)  # killed after its first read changed its state

        restore.read_into = dies
    with pytest.raises(Exception, match="rank 1") as err:  # the heartbeat names the dead rank
        tierlift.checkpoint.load(ck, model, opt)
    _assert_same(_rank_snapshot(model, opt), before)
    with open(os.path.join(root, "survivor-rolled-back"), "w") as f:
        f.write(f"{type(err.value).__name__}: {err.value}")
    opt.close()
    os._exit(0)


def test_a_rank_dying_half_way_leaves_the_survivor_as_it_was(tmp_path):
    ctx, port = mp.get_context("spawn"), free_port()  # mp.spawn would kill the survivor
    procs = [ctx.Process(target=_dies_half_way, args=(r, 2, port, str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert codes == [0, 3], codes
    print((tmp_path / "survivor-rolled-back").read_text())
