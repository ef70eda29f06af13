"""Who may write a checkpoint path, and what survives: two saves started at the same instant
never mix (one claims path.tmp atomically, the other is refused before it writes anything, or
they run one after the other); a lone path.old (the only copy after a replace was killed
between its renames) is never deleted or written over by a save, an import or an export;
files tierlift did not write in a checkpoint directory are never deleted (the save is refused).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import tierlift
from tierlift.checkpoint import background
from tierlift.checkpoint import format as fmt
from tierlift.checkpoint.__main__ import main


def _model(seed=0, width=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Linear(width, 4))


def _files(path) -> dict[str, bytes]:
    path = str(path)
    return {os.path.relpath(os.path.join(r, f), path): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(path) for f in fs}


def _weights_equal(model, seed, width=16):
    want = _model(seed, width).state_dict()
    return all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def _lone_old(tmp_path, n=1):
    """ck.old as a replace killed between its renames leaves it: the only copy."""
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, _model(n), extra={"n": n})
    fmt.move_aside(str(ck), f"{ck}.old")
    return ck, _files(f"{ck}.old")


def _cli_error(args, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ---- a lone path.old ---------------------------------------------------------------------


@pytest.mark.parametrize("empty_dir", [False, True], ids=["absent", "empty-dir"])
def test_import_dcp_refuses_a_path_whose_checkpoint_is_its_old(tmp_path, dcp_dir, capsys,
                                                                empty_dir):
    ck, before = _lone_old(tmp_path)
    if empty_dir:
        ck.mkdir()
    err = _cli_error(["import-dcp", dcp_dir, ck], capsys)
    assert f"{str(ck) + '.old'!r} is the checkpoint at {str(ck)!r}" in err, err
    assert _files(f"{ck}.old") == before
    assert sorted(os.listdir(tmp_path)) == sorted(["ck.old", "dcp"] + (["ck"] * empty_dir))
    assert tierlift.checkpoint.load(ck, _model(0)) == {"n": 1}  # still found there


@pytest.mark.parametrize("command", ["export", "export-optimizer", "export-hf"])
def test_an_export_does_not_hide_a_lone_old(tmp_path, capsys, command):
    """An export to `ck` would make `ck` a file or a folder of safetensors: load(ck) would no
    longer find its checkpoint at ck.old."""
    source = tmp_path / "src"
    tierlift.checkpoint.save(source, _model(2), torch.optim.AdamW(_model(2).parameters()))
    ck, before = _lone_old(tmp_path)
    args = (["export", source, ck, "--format", "hf"] if command == "export-hf" else
            [command, source, ck])
    if command == "export-hf":
        pytest.importorskip("safetensors")
    err = _cli_error(args, capsys)
    assert "is the checkpoint at" in err, err
    assert not os.path.lexists(ck) and _files(f"{ck}.old") == before


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
@pytest.mark.parametrize("empty_dir", [False, True], ids=["absent", "empty-dir"])
def test_a_save_replaces_a_lone_old_only_once_it_is_in_place(tmp_path, monkeypatch, blocking,
                                                             empty_dir):
    ck, _ = _lone_old(tmp_path)
    if empty_dir:
        ck.mkdir()
    from tierlift.checkpoint import format as fmt

    real_rename, seen = os.rename, []

    def rename(src, dst):
        seen.append(tierlift.checkpoint.load(ck, _model(0)) == {"n": 1})
        real_rename(src, dst)

    monkeypatch.setattr(fmt.os, "rename", rename)
    tierlift.checkpoint.save(ck, _model(5), extra={"n": 5}, blocking=blocking)
    tierlift.checkpoint.close()
    monkeypatch.undo()
    assert seen and all(seen)  # the old one loaded at every step of the replace
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    fresh = _model(0)
    assert tierlift.checkpoint.load(ck, fresh) == {"n": 5} and _weights_equal(fresh, 5)


# ---- files tierlift did not write ----------------------------------------------------------


@pytest.mark.parametrize("where", ["ck", "ck.old"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_save_keeps_files_it_did_not_write(tmp_path, where, blocking):
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, _model(1), extra={"n": 1})
    if where == "ck.old":  # a stale ck.old (ck is complete): a save would delete it
        tierlift.checkpoint.save(tmp_path / "x", _model(1))
        fmt.move_aside(str(tmp_path / "x"), f"{ck}.old")
    target = tmp_path / where
    (target / "notes.txt").write_text("precious")
    (target / "sub").mkdir()
    before = {d: _files(tmp_path / d) for d in os.listdir(tmp_path)}
    with pytest.raises(FileExistsError,
                       match=re.escape(f"{str(target)!r} holds files tierlift did not write "
                                       "(notes.txt, sub/)")):
        tierlift.checkpoint.save(ck, _model(2), extra={"n": 2}, blocking=blocking)
    tierlift.checkpoint.close()
    assert {d: _files(tmp_path / d) for d in os.listdir(tmp_path)} == before
    assert (target / "sub").is_dir()


def test_a_file_put_in_during_a_background_save_is_kept(tmp_path, monkeypatch):
    """The check runs again when the save publishes: a notes.txt put into the checkpoint
    while the files were written fails the save, and stays."""
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, _model(1), extra={"n": 1})
    real, calls = background.targets.check_save_target, []

    def check(path, **kw):
        calls.append(path)
        if len(calls) == 2:  # the publish
            (ck / "notes.txt").write_text("precious")
        return real(path, **kw)

    monkeypatch.setattr(background.targets, "check_save_target", check)
    h = tierlift.checkpoint.save(ck, _model(2), extra={"n": 2}, blocking=False)
    with pytest.raises(FileExistsError, match="holds files tierlift did not write"):
        h.wait()
    assert len(calls) == 2 and (ck / "notes.txt").read_text() == "precious"
    assert not os.path.lexists(f"{ck}.tmp")
    os.unlink(ck / "notes.txt")
    assert tierlift.checkpoint.load(ck, _model(0)) == {"n": 1}


# ---- claims on path.tmp --------------------------------------------------------------------


def _owner(tmp, **fields):
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, ".owner.json"), "w") as f:
        json.dump(fields, f)


def test_a_claim_of_another_host_is_refused_and_kept(tmp_path):
    ck = tmp_path / "ck"
    _owner(f"{ck}.tmp", pid=1, host=socket.gethostname() + "-other", token="t")
    with pytest.raises(RuntimeError, match=r"being written by another save \(process 1 on "):
        tierlift.checkpoint.save(ck, _model(1))
    assert os.listdir(f"{ck}.tmp") == [".owner.json"] and not os.path.lexists(ck)


def test_a_dead_owners_claim_is_cleared(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    ck = tmp_path / "ck"
    _owner(f"{ck}.tmp", pid=int(dead.stdout), host=socket.gethostname(), token="t")
    open(f"{ck}.tmp/rank00000.pt", "wb").write(b"half")
    tierlift.checkpoint.save(ck, _model(1), extra={"n": 1})
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert tierlift.checkpoint.load(ck, _model(0)) == {"n": 1}


def test_an_owner_file_being_written_is_a_live_claim(tmp_path):
    ck = tmp_path / "ck"
    os.makedirs(f"{ck}.tmp")
    open(f"{ck}.tmp/.owner.json", "w").close()  # created (O_EXCL), not yet written
    with pytest.raises(RuntimeError, match="being written by another save"):
        tierlift.checkpoint.save(ck, _model(1))
    old = os.path.getmtime(f"{ck}.tmp/.owner.json") - 3600  # its writer died long ago
    os.utime(f"{ck}.tmp/.owner.json", (old, old))
    tierlift.checkpoint.save(ck, _model(1), extra={"n": 1})
    assert tierlift.checkpoint.load(ck, _model(0)) == {"n": 1}


def _saver(who, ck, rounds, barrier, results):
    import time

    from tierlift.checkpoint import targets

    torch.set_num_threads(1)
    model = _model(10 + who, width=256)
    make_parent = targets.make_parent

    def slow(path):  # between the checks of the target and the claim, as a busy drive is
        time.sleep(0.02)
        make_parent(path)

    targets.make_parent = slow
    for r in range(rounds):
        barrier.wait()  # both start at the same instant
        try:
            tierlift.checkpoint.save(ck, model, extra={"who": who, "round": r})
            results.put((r, who, None))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put((r, who, f"{type(e).__name__}: {e}"))
        try:
            barrier.wait()  # the test checks what is on disk
            barrier.wait()
        except threading.BrokenBarrierError:
            return  # the test failed


def test_two_saves_started_at_the_same_instant(tmp_path):
    ck, rounds = str(tmp_path / "ck"), 16
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(3, timeout=120), ctx.Queue()
    procs = [ctx.Process(target=_saver, args=(w, ck, rounds, barrier, results))
             for w in (0, 1)]
    for p in procs:
        p.start()
    refused = 0
    try:
        for r in range(rounds):
            barrier.wait()
            barrier.wait()
            got = sorted(results.get(timeout=60) for _ in range(2))
            assert [g[0] for g in got] == [r, r], got
            won = [who for _, who, err in got if err is None]
            for *_, err in got:
                assert err is None or "is being written by another save" in err, err
            assert won, got
            refused += 2 - len(won)
            fresh = _model(0, width=256)
            extra = tierlift.checkpoint.load(ck, fresh)
            assert extra["round"] == r and extra["who"] in won, (extra, got)
            assert _weights_equal(fresh, 10 + extra["who"], 256), "a mixed checkpoint"
            assert sorted(os.listdir(tmp_path)) == ["ck"], os.listdir(tmp_path)
            barrier.wait()
    except BaseException:
        barrier.abort()  # the savers stop at once
        raise
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    print(f"{refused} of {rounds} rounds refused one save (the others ran one after the other)")
