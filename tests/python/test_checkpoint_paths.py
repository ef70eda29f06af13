"""One checkpoint folder however its path names it: a read of the folder this process's
background save is writing (export_hf, the CLI's exports, full_state_dict,
optimizer_state_dict) waits for that save and gets the new checkpoint, exactly, or the save's
error, when the folder is reached through a symbolic link, a relative path, `a/../a`, a
trailing slash or a bind mount; a read of another folder does not wait. A background save of a
relative path writes where the path named at the save, even after a chdir. Ranks that reach
one folder by different paths save into it; ranks given different folders are refused
(one spawn of 2 gloo ranks). A `run.old` its user made (mv, cp -r) is neither deleted nor
read as the copy a save moves aside; an export through `link/..` writes beside its output; a
folder that cannot be renamed (a mount point) is refused, or stays whole."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading

import pytest
import torch
from zero_model import make_model, raised, spawn_ranks

import tierlift
from tierlift.checkpoint import handoff
from tierlift.checkpoint import writer as ckpt_writer
from tierlift.checkpoint.__main__ import main as cli


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    return model, opt


def _step(model, opt):
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _copy(sd: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _same_optim(a: dict, b: dict) -> None:
    assert json.loads(json.dumps(a["param_groups"])) == json.loads(json.dumps(b["param_groups"]))
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        _same({k: torch.as_tensor(v) for k, v in a["state"][i].items()},
              {k: torch.as_tensor(v) for k, v in b["state"][i].items()})


@pytest.fixture
def gated(monkeypatch):
    """Holds every background write until the returned event is set."""
    gate = threading.Event()
    write = ckpt_writer.Writer._write
    monkeypatch.setattr(ckpt_writer.Writer, "_write",
                        lambda writer, piece: (gate.wait(60), write(writer, piece))[1])
    yield gate
    gate.set()


def _in_flight(ck: str, gate, open_after: float | None = 0.3):
    """A checkpoint at `ck`, then a background save of a later state to it, held by `gate`
    (opened `open_after` s later): returns (handle, model state dict, optimizer state dict)
    of it."""
    model, opt = _trained(0)
    gate.set()
    tierlift.checkpoint.save(ck, model, opt)  # the previous checkpoint, a step before
    gate.clear()
    _step(model, opt)
    weights, optim = _copy(model.state_dict()), opt.state_dict()
    optim = {"state": {i: _copy(st) for i, st in optim["state"].items()},
             "param_groups": optim["param_groups"]}
    h = tierlift.checkpoint.save(ck, model, opt, blocking=False)
    _step(model, opt)  # training goes on: the save holds the state at save()
    if open_after is not None:
        threading.Timer(open_after, gate.set).start()
    return h, weights, optim


def _hf(out: str) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "model.safetensors"))


READERS = {
    "export_hf": lambda ck, out: (handoff.export_hf(ck, out), _hf(out))[1],
    "cli_export_hf": lambda ck, out: (cli(["export", ck, out, "--format", "hf"]), _hf(out))[1],
    "full_state_dict": lambda ck, out: tierlift.checkpoint.full_state_dict(ck),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_read_of_the_folder_being_saved_gets_the_new_checkpoint(tmp_path, gated, reader):
    """export_hf (and the CLI's --format hf) read the checkpoint before the one in flight,
    without a word; they wait for it, as full_state_dict does."""
    ck = str(tmp_path / "ck")
    h, weights, _ = _in_flight(ck, gated)
    got = READERS[reader](ck, str(tmp_path / "out"))
    assert h.done()
    _same(got, weights)


def test_the_cli_exports_of_the_folder_being_saved_get_the_new_checkpoint(tmp_path, gated):
    ck = str(tmp_path / "ck")
    h, weights, optim = _in_flight(ck, gated)
    assert cli(["export", ck, str(tmp_path / "model.pt")]) == 0
    assert h.done()
    _same(torch.load(tmp_path / "model.pt"), weights)
    assert cli(["export-optimizer", ck, str(tmp_path / "optim.pt")]) == 0
    _same_optim(torch.load(tmp_path / "optim.pt"), optim)
    _same_optim(tierlift.checkpoint.optimizer_state_dict(ck), optim)


def test_export_hf_raises_the_failed_save_and_writes_nothing(tmp_path, gated, monkeypatch):
    def drive_full(self, buf, runs):
        raise OSError(errno.ENOSPC, "injected: no space left on device")

    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    model, opt = _trained(0)
    gated.set()
    tierlift.checkpoint.save(ck, model, opt)  # written before the drive "fills"
    _step(model, opt)
    monkeypatch.setattr(ckpt_writer.Writer, "_submit", drive_full)
    tierlift.checkpoint.save(ck, model, opt, blocking=False)
    with pytest.raises(OSError, match="no space left"):
        handoff.export_hf(ck, out)
    assert not os.path.exists(out)


def _bind(src: str, dst: str) -> bool:
    os.makedirs(dst)
    return subprocess.run(["mount", "--bind", src, dst], capture_output=True).returncode == 0


@pytest.mark.parametrize("alias", ["symlink", "relative", "dotdot", "trailing_slash", "bind"])
def test_an_alias_of_the_folder_being_saved_waits_for_the_save(tmp_path, gated, monkeypatch,
                                                                alias):
    real = tmp_path / "real"
    real.mkdir()
    h, weights, optim = _in_flight(str(real / "ck"), gated)
    bound = str(tmp_path / "bound")
    if alias == "bind" and not _bind(str(real), bound):
        gated.set()
        h.wait()
        pytest.skip("mount --bind is not permitted here")
    try:
        if alias == "symlink":
            os.symlink(real, tmp_path / "link")
            path = str(tmp_path / "link" / "ck")
        elif alias == "relative":
            monkeypatch.chdir(real)
            path = "ck"
        elif alias == "dotdot":
            path = str(real / ".." / "real" / "ck")
        elif alias == "trailing_slash":
            path = str(real / "ck") + "/"
        else:
            path = os.path.join(bound, "ck")
        _same(tierlift.checkpoint.full_state_dict(path), weights)
        assert h.done()
        _same_optim(tierlift.checkpoint.optimizer_state_dict(path), optim)
    finally:
        if alias == "bind":
            subprocess.run(["umount", bound], check=True)


def test_a_read_of_another_folder_does_not_wait(tmp_path, gated):
    other_model, other_opt = _trained(7)
    gated.set()
    for other in ("ck2", "sub/ck"):  # a sibling; one of the same name elsewhere
        tierlift.checkpoint.save(str(tmp_path / other), other_model, other_opt)
    h, weights, _ = _in_flight(str(tmp_path / "ck"), gated, open_after=None)
    try:
        for other in ("ck2", "sub/ck"):
            _same(tierlift.checkpoint.full_state_dict(str(tmp_path / other)),
                  other_model.state_dict())
        assert not h.done()
    finally:
        gated.set()
    h.wait()
    _same(tierlift.checkpoint.full_state_dict(str(tmp_path / "ck")), weights)


def test_a_relative_background_save_lands_where_it_named_after_a_chdir(tmp_path, gated,
                                                                      monkeypatch):
    """Before, the writer opened its files relative to the new working directory: the save
    failed, and a read of its folder by its absolute path did not wait for it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    h, weights, _ = _in_flight("ck", gated, open_after=None)
    monkeypatch.chdir(tmp_path / "b")
    gated.set()
    _same(tierlift.checkpoint.full_state_dict(str(tmp_path / "a" / "ck")), weights)
    assert h.done()
    h.wait()
    assert os.listdir(tmp_path / "b") == []


def _ranks(rank: int, world: int, tmp: str) -> dict:
    """A sharded model saved by ranks that reach one folder by different paths (a symbolic
    link, a relative path), then by ranks given folders of their own."""
    out = {}
    model = tierlift.zero.shard(make_model(seed=5), stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real = os.path.join(tmp, "real")
    if rank == 0:
        os.makedirs(real)
        os.symlink(real, os.path.join(tmp, "link"))
    torch.distributed.barrier()
    os.chdir(tmp)
    given = {0: os.path.join(real, "ck"), 1: os.path.join("link", "ck")}[rank]
    out["alias"] = raised(lambda: tierlift.checkpoint.save(given, model, opt,
                                                           extra={"step": 1}))
    try:
        tierlift.checkpoint.save(given, model, opt, extra={"step": 2}, blocking=False).wait()
        out["alias_background"] = "<no error>"
    except Exception:  # noqa: BLE001 - the test reads it
        import traceback
        out["alias_background"] = traceback.format_exc()
    out["full"] = tierlift.zero.full_state_dict(model)
    # each rank a folder of its own, of the same name (node-local drives)
    own = os.path.join(tmp, f"node{rank}")
    os.makedirs(own)
    os.chdir(own)
    out["own"] = raised(lambda: tierlift.checkpoint.save("ck", model, opt, extra={"step": 3}))
    out["own_tmp_left"] = os.path.exists(os.path.join(own, "ck.tmp"))
    torch.distributed.barrier()
    return out


def test_ranks_reaching_one_folder_by_different_paths_save_into_it(tmp_path):
    got = spawn_ranks(_ranks, str(tmp_path))
    for r in range(2):
        assert got[r]["alias"] == "<no error>", got[r]["alias"]
        assert got[r]["alias_background"] == "<no error>", got[r]["alias_background"]
        assert "the ranks were given different paths" in got[r]["own"], got[r]["own"]
        assert not got[r]["own_tmp_left"]
    _same(tierlift.checkpoint.full_state_dict(str(tmp_path / "real" / "ck")), got[0]["full"])
    for r in range(2):
        assert not os.path.exists(tmp_path / f"node{r}" / "ck")


def _files(folder) -> dict:
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))}


@pytest.mark.parametrize("blocking", [True, False])
def test_a_checkpoint_named_like_a_saves_old_copy_is_neither_deleted_nor_read(tmp_path,
                                                                               blocking):
    """A checkpoint a user saved as run.old was taken for the copy a save of run moves aside:
    a save of run deleted it, and a load of a missing run returned its weights."""
    theirs, theirs_opt = _trained(3)
    tierlift.checkpoint.save(str(tmp_path / "run.old"), theirs, theirs_opt)
    before = _files(tmp_path / "run.old")
    model, opt = _trained(4)
    with pytest.raises(FileExistsError, match="saved under that name"):
        tierlift.checkpoint.save(str(tmp_path / "run"), model, opt, blocking=blocking).wait()
    assert sorted(os.listdir(tmp_path)) == ["run.old"]
    assert _files(tmp_path / "run.old") == before
    for read in (tierlift.checkpoint.full_state_dict, tierlift.checkpoint.optimizer_state_dict,
                 lambda ck: tierlift.checkpoint.load(ck, model, opt)):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            read(str(tmp_path / "run"))
    _same(tierlift.checkpoint.full_state_dict(str(tmp_path / "run.old")), theirs.state_dict())


def test_what_a_rank_sees_of_the_claim_has_one_length_whatever_its_folder_holds(tmp_path):
    # Each rank's view goes into one collective of fixed width: a token of another length in
    # an owner file not of a claim (a folder of that rank's own) made the ranks' sizes differ.
    from tierlift.checkpoint import background

    tmp = tmp_path / "ck.tmp"
    tmp.mkdir()
    seen = []
    for token in ("ab" * 16, "abcd", "ab" * 40, "not hex", 7):
        (tmp / background.OWNER).write_text(json.dumps({"token": token}))
        seen.append(background.claim_seen(str(tmp), writes=True))
    assert seen[0] == bytes.fromhex("ab" * 16)
    assert all(s == seen[1] for s in seen[1:]) and len(seen[1]) == 16 and seen[1] != seen[0]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_path_going_up_from_a_symbolic_link_saves_where_the_os_reads_it(tmp_path, blocking,
                                                                          monkeypatch):
    # `link/../ck` is real/ck to the OS (and to load); the save folded it to ./ck, so a load
    # of the same path found nothing (or an older checkpoint kept there).
    (tmp_path / "real" / "dir").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "dir")
    monkeypatch.chdir(tmp_path)
    model, opt = _trained(6)
    for given in ("link/../ck", str(tmp_path / "link" / ".." / "new" / "ck")):
        tierlift.checkpoint.save(given, model, opt, blocking=blocking).wait()
        _same(tierlift.checkpoint.full_state_dict(given), model.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]
    assert sorted(os.listdir(tmp_path / "real")) == ["ck", "dir", "new"]


@pytest.mark.parametrize("how", ["mv", "cp"])
def test_a_backup_renamed_or_copied_to_old_is_neither_deleted_nor_read(tmp_path, how):
    """`mv run run.old` or `cp -r run run.old` (a user's backup) looked like the copy a save
    moves aside: the next save of run deleted it, and a load of a missing run read it."""
    run = str(tmp_path / "run")
    theirs, theirs_opt = _trained(7)
    tierlift.checkpoint.save(run, theirs, theirs_opt)
    if how == "mv":
        os.rename(run, run + ".old")
    else:
        subprocess.run(["cp", "-r", run, run + ".old"], check=True)
    before = _files(tmp_path / "run.old")
    model, opt = _trained(8)
    with pytest.raises(FileExistsError, match="renamed or copied there by hand"):
        tierlift.checkpoint.save(run, model, opt)
    assert _files(tmp_path / "run.old") == before
    if how == "mv":
        with pytest.raises(FileNotFoundError, match="does not exist"):
            tierlift.checkpoint.load(run, model, opt)
    # the backup loads under its own name, and saves there too
    os.rename(run + ".old", str(tmp_path / "bak"))
    _same(tierlift.checkpoint.full_state_dict(str(tmp_path / "bak")), theirs.state_dict())
    tierlift.checkpoint.save(str(tmp_path / "bak"), model, opt)
    _same(tierlift.checkpoint.full_state_dict(str(tmp_path / "bak")), model.state_dict())


def _save_killed_at_rename(monkeypatch, run: str, model, opt, src: str) -> None:
    """A save of `run` by a process that dies as it is about to rename `src`."""
    from tierlift.checkpoint import format as fmt

    real_rename = os.rename

    def killed(a, b):
        if a == src:
            raise KeyboardInterrupt
        real_rename(a, b)

    monkeypatch.setattr(fmt.os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        tierlift.checkpoint.save(run, model, opt)
    monkeypatch.undo()


def test_a_save_killed_between_its_renames_is_still_found_and_replaced(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    model, opt = _trained(9)
    tierlift.checkpoint.save(run, model, opt)
    weights, optim = _copy(model.state_dict()), opt.state_dict()
    optim = {"state": {i: _copy(st) for i, st in optim["state"].items()},
             "param_groups": optim["param_groups"]}
    _step(model, opt)
    _save_killed_at_rename(monkeypatch, run, model, opt, run + ".tmp")  # after moving run aside
    assert not os.path.exists(run) and os.path.isdir(run + ".old")
    _same(tierlift.checkpoint.full_state_dict(run), weights)
    _same_optim(tierlift.checkpoint.optimizer_state_dict(run), optim)
    tierlift.checkpoint.save(run, model, opt)
    assert not os.path.exists(run + ".old")
    _same(tierlift.checkpoint.full_state_dict(run), model.state_dict())


def test_an_export_through_link_dotdot_writes_beside_its_output(tmp_path, monkeypatch):
    # os.path.abspath folded `link/..` to the working directory: the temporary folder went
    # there (another drive: the rename failed) and that folder, not the output's, was flushed.
    from tierlift.checkpoint import outputs

    (tmp_path / "real" / "dir").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "dir")
    model, opt = _trained(10)
    tierlift.checkpoint.save(str(tmp_path / "ck"), model, opt)
    monkeypatch.chdir(tmp_path)
    synced, made = [], []
    real_mkdir = os.mkdir
    monkeypatch.setattr(outputs, "fsync_path", lambda p: synced.append(p))
    monkeypatch.setattr(outputs.os, "mkdir", lambda p, *a: (made.append(p), real_mkdir(p, *a)))
    assert cli(["export", str(tmp_path / "ck"), "link/../out.pt"]) == 0
    assert os.path.samefile(os.path.dirname(made[-1]), tmp_path / "real")
    assert synced and os.path.samefile(synced[-1], tmp_path / "real")
    assert sorted(os.listdir(tmp_path)) == ["ck", "link", "real"]
    _same(torch.load(tmp_path / "real" / "out.pt", weights_only=True), model.state_dict())


@pytest.mark.parametrize("fails", ["aside", "in_place"])
def test_a_checkpoint_folder_that_cannot_be_renamed_stays_whole(tmp_path, monkeypatch, fails):
    """A mount point (EBUSY) or a folder on another drive than its parent (EXDEV): a save
    raises saying so, and the checkpoint stays at its name, exactly as it was."""
    from tierlift.checkpoint import format as fmt

    run = str(tmp_path / "run")
    model, opt = _trained(11)
    tierlift.checkpoint.save(run, model, opt)
    weights, before = _copy(model.state_dict()), _files(tmp_path / "run")
    real_rename = os.rename
    code, src = (errno.EBUSY, run) if fails == "aside" else (errno.EXDEV, run + ".tmp")

    def rename(a, b):
        if a == src:
            raise OSError(code, os.strerror(code), a, None, b)
        real_rename(a, b)

    _step(model, opt)
    monkeypatch.setattr(fmt.os, "rename", rename)
    with pytest.raises(OSError, match="is a mount point, or on another drive") as e:
        tierlift.checkpoint.save(run, model, opt, blocking=False).wait()
    assert e.value.errno == code
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["run"] and _files(tmp_path / "run") == before
    _same(tierlift.checkpoint.full_state_dict(run), weights)


def test_a_mount_point_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from tierlift.checkpoint import targets

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(targets.os.path, "ismount", lambda p: os.fspath(p) == str(run))
    model, opt = _trained(12)
    with pytest.raises(FileExistsError, match="is a mount point"):
        tierlift.checkpoint.save(str(run), model, opt)
    assert sorted(os.listdir(tmp_path)) == ["run"] and not os.listdir(run)


@pytest.mark.parametrize("writes", ["save", "export"])
def test_a_full_drive_through_link_dotdot_says_the_free_space_of_its_own_drive(tmp_path,
                                                                             monkeypatch,
                                                                             writes):
    # The folder was folded to the working directory's: on another drive, the error quoted
    # that drive's free bytes and inodes.
    from tierlift.checkpoint import outputs, write_errors

    (tmp_path / "real" / "dir").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "dir")
    model, opt = _trained(13)
    tierlift.checkpoint.save(str(tmp_path / "ck"), model, opt)
    monkeypatch.chdir(tmp_path)
    asked, statvfs = [], os.statvfs
    monkeypatch.setattr(write_errors.os, "statvfs", lambda p: (asked.append(p), statvfs(p))[1])

    def drive_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "injected")

    with pytest.raises(OSError, match="no space left on the drive of 'link/..'|"
                       f"no space left on the drive of '{tmp_path}/link/..'"):
        if writes == "save":
            monkeypatch.setattr(ckpt_writer.Writer, "_submit", drive_full)
            tierlift.checkpoint.save("link/../new", model, opt)
        else:
            outputs.write_new("link/../out.pt",
                              lambda where: (open(where, "wb").close(), drive_full()))
    assert asked and all(os.path.samefile(p, tmp_path / "real") for p in asked)


def test_a_backup_renamed_after_a_save_was_killed_before_moving_run_aside_is_kept(
        tmp_path, monkeypatch):
    """A save killed between marking run and renaming it aside left the mark in run, and a later
    `mv run run.old` (a backup) read as the copy a save moves aside, which the next save of run
    deleted."""
    from tierlift.checkpoint import format as fmt

    run = str(tmp_path / "run")
    model, opt = _trained(13)
    tierlift.checkpoint.save(run, model, opt)
    weights = _copy(model.state_dict())
    _step(model, opt)
    _save_killed_at_rename(monkeypatch, run, model, opt, run)  # right before moving run aside
    marker = os.path.join(run, fmt.MOVED_ASIDE)
    if os.path.exists(marker):  # the kill was a while ago
        ago = os.stat(marker).st_mtime_ns - 2 * fmt.RENAMED_WITHIN_NS
        os.utime(marker, ns=(ago, ago))
    os.rename(run, run + ".old")  # then the user keeps run as a backup
    before = _files(tmp_path / "run.old")
    with pytest.raises(FileExistsError, match="renamed or copied there by hand"):
        tierlift.checkpoint.save(run, model, opt)
    assert _files(tmp_path / "run.old") == before
    _same(tierlift.checkpoint.full_state_dict(run + ".old"), weights)


def test_a_mark_that_cannot_be_written_puts_the_checkpoint_back(tmp_path, monkeypatch):
    from tierlift.checkpoint import format as fmt

    run = str(tmp_path / "run")
    model, opt = _trained(14)
    tierlift.checkpoint.save(run, model, opt)
    weights, before = _copy(model.state_dict()), _files(tmp_path / "run")
    real_write = fmt.write_json

    def full(file, obj):
        if file.endswith(fmt.MOVED_ASIDE):
            with open(file, "w") as f:
                f.write("{")  # part of it, then the drive is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)
        real_write(file, obj)

    _step(model, opt)
    monkeypatch.setattr(fmt, "write_json", full)
    with pytest.raises(OSError) as e:
        tierlift.checkpoint.save(run, model, opt)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["run"] and _files(tmp_path / "run") == before
    _same(tierlift.checkpoint.full_state_dict(run), weights)
    tierlift.checkpoint.save(run, model, opt)
    _same(tierlift.checkpoint.full_state_dict(run), model.state_dict())


def test_an_export_to_a_file_name_with_a_trailing_slash_is_refused_leaving_nothing(
        tmp_path, monkeypatch, capsys):
    # `out.pt/` made a folder out.pt (as the output's parent), then failed writing into it
    # with an error naming a temporary path, and left the empty folder behind.
    model, opt = _trained(15)
    tierlift.checkpoint.save(str(tmp_path / "ck"), model, opt)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        cli(["export", "ck", "out.pt/"])
    assert "'out.pt/' names a directory" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ck"]
