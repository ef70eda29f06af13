"""A checkpoint load or save that ONE rank refuses (its own folder missing, another checkpoint
than the others', a file corrupt on its copy only, its model or optimizer not matching, its
drive full, in a blocking or a background save) ends with every rank raising within seconds:
the failing rank its own error, the others one naming it and its error; no rank waits in a
collective for it. Nothing changes on any rank (a step afterwards matches a twin that never
tried), and a correct load and save work afterwards; a DDP model's replicated checkpoint too.
One spawn of 2 gloo ranks with a 20 s process-group timeout, so that a rank left waiting fails
the test instead of hanging it."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time

import pytest
import torch
import torch.multiprocessing as mp
from zero_model import batches, free_port, init_gloo, make_model, raised, shutdown, train

import tierlift
from tierlift.checkpoint import format as fmt
from tierlift.checkpoint.writer import Writer

DATA = batches(5, 8, seed=3)
PG_TIMEOUT_S = 20.0
FAST_S = 8.0  # a refusal agreed on takes well under a second; a rank left waiting takes 20 s


def _fresh():
    model = tierlift.zero.shard(make_model(seed=5), stage=3)
    return model, tierlift.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1,
                                       offload="cpu")


def _steps(model, opt, data, rank, world):
    return train(model, opt, data, accum=1, clip=None, world=world, rank=rank, zero=True)


def _local(model, opt) -> dict:
    """This rank's shards, buffers and optimizer state (no collective)."""
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": {i: {k: torch.as_tensor(v).clone() for k, v in st.items()}
                      for i, st in opt.state_dict()["state"].items()},
            "groups": [{k: v for k, v in g.items() if k != "params"}
                       for g in opt.param_groups]}


def _equal(a: dict, b: dict) -> bool:
    if a["model"].keys() != b["model"].keys() or a["optim"].keys() != b["optim"].keys():
        return False
    if a["groups"] != b["groups"]:
        return False
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and all(
        a["optim"][i].keys() == b["optim"][i].keys()
        and all(torch.equal(a["optim"][i][k], b["optim"][i][k]) for k in a["optim"][i])
        for i in a["optim"])


def _tree(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), path)] = \
                    hashlib.sha256(f.read()).hexdigest()
    return out


def _timed(fn) -> tuple[str, float]:
    t0 = time.monotonic()
    error = raised(fn)
    return error, time.monotonic() - t0


def _corrupt_copy(src: str, dst: str) -> str:
    """A copy of `src` whose rank-1 tensor file is cut short (same manifest)."""
    shutil.copytree(src, dst)
    f = os.path.join(dst, fmt.rank_file(1))
    os.truncate(f, os.path.getsize(f) // 2)
    return dst


def _cases(rank: int, world: int, tmp: str) -> dict:
    out = {}
    model, opt = _fresh()
    twin, twin_opt = _fresh()  # never sees a failed load or save
    for m, o in ((model, opt), (twin, twin_opt)):
        _steps(m, o, DATA[:2], rank, world)
    ck_a, ck_b = os.path.join(tmp, "ck_a"), os.path.join(tmp, "ck_b")
    tierlift.checkpoint.save(ck_a, model, opt, extra={"step": 2})
    for m, o in ((model, opt), (twin, twin_opt)):
        _steps(m, o, DATA[2:3], rank, world)
    tierlift.checkpoint.save(ck_b, model, opt, extra={"step": 3})
    before = _local(model, opt)
    ck_b_files = _tree(ck_b)

    def load_case(name: str, path: str, target=None, optimizer=None) -> None:
        error, seconds = _timed(lambda: tierlift.checkpoint.load(
            path, target if target is not None else model,
            optimizer if optimizer is not None else opt))
        out[name] = {"error": error, "seconds": seconds,
                     "unchanged": _equal(before, _local(model, opt))}

    # the reviewer's case: rank 1 was given a folder of its own, which does not exist
    load_case("own_folder", ck_b if rank == 0 else os.path.join(tmp, "ck_rank1"))
    # each rank its own folder, both valid checkpoints, of different steps
    load_case("other_checkpoint", ck_b if rank == 0 else ck_a)
    # rank 1's copy has a file cut short
    load_case("corrupt_copy", ck_b if rank == 0 else
              _corrupt_copy(ck_b, os.path.join(tmp, "ck_b_rank1")))
    # rank 1's optimizer has another number of param groups
    if rank == 1:
        shards = list(model.parameters())
        wrong_opt = torch.optim.AdamW([{"params": shards[:1]}, {"params": shards[1:]}])
    load_case("wrong_optimizer", ck_b, optimizer=wrong_opt if rank == 1 else None)
    # rank 1's model holds a buffer of another shape
    scale = model.logit_scale
    if rank == 1:
        model.logit_scale = torch.full((2,), 0.9)
    try:
        load_case("wrong_model", ck_b)
    finally:
        model.logit_scale = scale
    out["wrong_model"]["unchanged"] = _equal(before, _local(model, opt))  # its own buffer back

    def save_case(name: str, optimizer=None, blocking: bool = True, path=ck_b) -> None:
        def save():
            h = tierlift.checkpoint.save(path, model, optimizer if optimizer is not None
                                         else opt, extra={"step": -1}, blocking=blocking)
            h.wait()  # a background save's votes run on a gloo group of their own

        error, seconds = _timed(save)
        torch.distributed.barrier()  # rank 0 removes `ck_b`.tmp after the vote
        out[name] = {"error": error, "seconds": seconds,
                     "unchanged": _equal(before, _local(model, opt)),
                     "files_kept": _tree(ck_b) == ck_b_files,
                     "no_tmp": not os.path.exists(ck_b + ".tmp")}

    # rank 1's drive fills up while it writes its shard
    real_submit = Writer._submit

    def drive_full(self, buf, runs):
        raise OSError(errno.ENOSPC, "injected: no space left on device")

    if rank == 1:
        Writer._submit = drive_full
    try:
        save_case("drive_full")
        save_case("drive_full_background", blocking=False)
    finally:
        Writer._submit = real_submit
    # rank 1's optimizer holds state for a parameter that is not one of the model's shards
    if rank == 1:
        foreign = torch.nn.Parameter(torch.zeros(3))
        other_opt = torch.optim.AdamW(list(model.parameters()) + [foreign])
        other_opt.state[foreign] = {"step": torch.tensor(1.0)}
    save_case("foreign_param", optimizer=other_opt if rank == 1 else None)
    # rank 1 given a path of its own, whose temporary folder happens to be there: rank 0 would
    # publish ck_b without rank 1's shard, over the good one
    own = os.path.join(tmp, "ck_rank1_save")
    if rank == 1:
        os.makedirs(own + ".tmp")
    save_case("own_save_path", path=ck_b if rank == 0 else own)

    # nothing changed: a step matches the twin's
    for m, o in ((model, opt), (twin, twin_opt)):
        _steps(m, o, DATA[3:4], rank, world)
    out["step_matches_twin"] = _equal(_local(model, opt), _local(twin, twin_opt))
    # and the same checkpoint loads, and a new save and load work, on every rank
    out["load_after"] = raised(lambda: tierlift.checkpoint.load(ck_b, model, opt))
    out["loaded_is_ck_b"] = _equal(before, _local(model, opt))
    ck_c = os.path.join(tmp, "ck_c")
    out["save_after"] = raised(lambda: tierlift.checkpoint.save(ck_c, model, opt))
    out["load_ck_c"] = raised(lambda: tierlift.checkpoint.load(ck_c, model, opt))
    opt.close()
    twin_opt.close()
    out.update(_ddp_cases(rank, tmp))
    return out


def _ddp_cases(rank: int, tmp: str) -> dict:
    """A DDP model (replicated checkpoint, rank 0 writes): rank 1 given a folder of its own."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ck = os.path.join(tmp, "ck_ddp")
    tierlift.checkpoint.save(ck, model, opt)
    before = {"model": {k: v.clone() for k, v in model.state_dict().items()},
              "optim": {i: {k: torch.as_tensor(v).clone() for k, v in st.items()}
                        for i, st in opt.state_dict()["state"].items()},
              "groups": [{k: v for k, v in g.items() if k != "params"}
                         for g in opt.param_groups]}
    error, seconds = _timed(lambda: tierlift.checkpoint.load(
        ck if rank == 0 else os.path.join(tmp, "ck_ddp_rank1"), model, opt))
    after = {"model": dict(model.state_dict()),
             "optim": {i: {k: torch.as_tensor(v) for k, v in st.items()}
                       for i, st in opt.state_dict()["state"].items()},
             "groups": [{k: v for k, v in g.items() if k != "params"}
                        for g in opt.param_groups]}
    return {"ddp_own_folder": {"error": error, "seconds": seconds,
                               "unchanged": _equal(before, after)},
            "ddp_load_after": raised(lambda: tierlift.checkpoint.load(ck, model, opt))}


def _spawned(rank: int, world: int, port: int, tmp: str) -> None:
    init_gloo(rank, world, port, timeout_s=PG_TIMEOUT_S)
    out = _cases(rank, world, tmp)
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))
    shutdown()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("refusals"))
    mp.spawn(_spawned, args=(2, free_port(), tmp), nprocs=2)
    return [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False) for r in range(2)]


def _both_fast_and_unchanged(ranks, case: str) -> None:
    for r in range(2):
        got = ranks[r][case]
        assert got["error"] != "<no error>", (r, case)
        assert got["seconds"] < FAST_S, (r, case, got)  # not a process-group timeout
        assert got["unchanged"], (r, case)
    # the other rank names rank 1 and quotes its error
    assert "rank(s) [1]: rank 1 (" in ranks[0][case]["error"], ranks[0][case]["error"]


@pytest.mark.parametrize("case, own_error", [
    ("own_folder", "FileNotFoundError"),
    ("corrupt_copy", "corrupt or truncated"),
    ("wrong_optimizer", "param groups"),
    ("wrong_model", "logit_scale"),
    ("ddp_own_folder", "FileNotFoundError"),
])
def test_a_load_refused_on_one_rank_raises_on_every_rank_and_changes_nothing(
        ranks, case, own_error):
    _both_fast_and_unchanged(ranks, case)
    assert own_error in ranks[1][case]["error"], ranks[1][case]["error"]
    assert own_error in ranks[0][case]["error"], ranks[0][case]["error"]  # quoted


def test_ranks_that_read_different_checkpoints_all_refuse(ranks):
    for r in range(2):
        got = ranks[r]["other_checkpoint"]
        assert "the ranks read different checkpoints" in got["error"], got
        assert got["seconds"] < FAST_S and got["unchanged"], got


@pytest.mark.parametrize("case, own_error", [
    ("drive_full", "no space left"),
    ("drive_full_background", "no space left"),
    ("foreign_param", "not a shard of the sharded model"),
])
def test_a_save_refused_on_one_rank_raises_on_every_rank_and_keeps_the_checkpoint(
        ranks, case, own_error):
    _both_fast_and_unchanged(ranks, case)
    assert own_error in ranks[1][case]["error"], ranks[1][case]["error"]
    assert own_error in ranks[0][case]["error"], ranks[0][case]["error"]
    for r in range(2):
        assert ranks[r][case]["files_kept"] and ranks[r][case]["no_tmp"], (r, ranks[r][case])


def test_ranks_given_different_save_paths_all_refuse_and_keep_the_checkpoint(ranks):
    for r in range(2):
        got = ranks[r]["own_save_path"]
        assert "the ranks were given different paths" in got["error"], got
        assert got["seconds"] < FAST_S and got["unchanged"], got
        assert got["files_kept"] and got["no_tmp"], got


def test_after_the_refusals_training_matches_a_twin_and_checkpoints_work(ranks):
    for r in range(2):
        assert ranks[r]["step_matches_twin"], r
        assert ranks[r]["load_after"] == "<no error>", ranks[r]["load_after"]
        assert ranks[r]["loaded_is_ck_b"], r
        assert ranks[r]["save_after"] == "<no error>", ranks[r]["save_after"]
        assert ranks[r]["load_ck_c"] == "<no error>", ranks[r]["load_ck_c"]
        assert ranks[r]["ddp_load_after"] == "<no error>", ranks[r]["ddp_load_after"]
