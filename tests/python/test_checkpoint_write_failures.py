"""A write that fails is a clear error naming the path and the cause, and leaves nothing behind:
the export commands (a plain file, .safetensors, --format hf, export-optimizer) onto a
read-only drive, a full drive and one out of inodes (real tmpfs), a folder removed while they
write, an output folder that is a symbolic link to nothing; a save that reaches the file size
limit (RLIMIT_FSIZE in a child process). The earlier export or checkpoint there stays as it
was. An export killed with SIGKILL leaves its temporary directory, which the next export to the
same output removes (a live export's is kept)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import resource
import shutil
import signal
import subprocess
import sys

import forkserver
import pytest
import torch
from safetensors.torch import load_file
from tmpfs import mounted_tmpfs
from torch import nn

import tierlift
from tierlift.checkpoint import targets
from tierlift.checkpoint.__main__ import main

FORMATS = {  # name -> (output name, extra arguments)
    "pt": ("out.pt", []),
    "safetensors": ("out.safetensors", []),
    "hf": ("out", ["--format", "hf"]),
    "optimizer": ("optim.pt", []),
}


def _model(seed=0, width=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Linear(width, 4))


def _checkpoint(where, width=16):
    """A checkpoint of _model(1, width) and its AdamW after one step."""
    model = _model(1, width)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    tierlift.checkpoint.save(where, model, opt)
    return model


def _export(fmt: str, ck, out) -> list[str]:
    command = "export-optimizer" if fmt == "optimizer" else "export"
    return [command, str(ck), str(out), *FORMATS[fmt][1]]


def _cli_error(args) -> str:
    """The one-line error of main(args), which must fail with no traceback."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        main(args)
    text = err.getvalue()
    assert e.value.code == 2 and "Traceback" not in text, text
    return text.strip().splitlines()[-1]


def _tree(path) -> dict[str, bytes]:
    path = str(path)
    return {os.path.relpath(os.path.join(r, f), path): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(path) for f in fs}


@pytest.fixture
def drive(tmp_path):
    """A 1 MiB tmpfs holding an earlier export (earlier.pt)."""
    with mounted_tmpfs(tmp_path, "1m") as path:
        assert main(["export", str(_small_ck(tmp_path)), os.path.join(path, "earlier.pt")]) == 0
        yield path


def _small_ck(tmp_path):
    ck = tmp_path / "small"
    if not ck.exists():
        _checkpoint(ck)
    return ck


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_export_onto_a_read_only_drive(tmp_path, drive, fmt):
    before = _tree(drive)
    got = subprocess.run(["mount", "-o", "remount,ro", drive], capture_output=True, text=True)
    if got.returncode:
        pytest.skip(f"cannot remount read-only here: {got.stderr.strip()}")
    for out in (os.path.join(drive, FORMATS[fmt][0]),
                os.path.join(drive, "new", FORMATS[fmt][0])):  # its parent to be created
        err = _cli_error(_export(fmt, _small_ck(tmp_path), out))
        assert f"cannot write {out!r}: not writable: {drive!r} is on a read-only file " \
               "system; nothing was written there" in err, err
    assert _tree(drive) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_export_onto_a_full_drive(tmp_path, drive, fmt):
    ck = tmp_path / "ck"
    _checkpoint(ck, width=1 << 15)  # 1 MiB of one weight, 2 MiB more of optimizer state
    before = _tree(drive)
    out = os.path.join(drive, FORMATS[fmt][0])
    err = _cli_error(_export(fmt, ck, out))
    assert f"[Errno 28] cannot write {out!r}: no space left on the drive of {drive!r} (ENOSPC: " \
           "its blocks or its inodes are used up, or a project quota is reached): " in err, err
    assert "inodes are free there; nothing was written there" in err, err
    assert _tree(drive) == before  # no temporary file left; the earlier export as it was


def test_an_export_onto_a_drive_out_of_inodes(tmp_path):
    """ENOSPC with most bytes free: the message says what is free rather than "disk full"."""
    with mounted_tmpfs(tmp_path, "1m,nr_inodes=8") as drive:  # mount's -o list
        taken = 0
        with pytest.raises(OSError):
            while True:
                open(os.path.join(drive, f"f{taken}"), "w").close()
                taken += 1
        out = os.path.join(drive, "out.pt")
        err = _cli_error(_export("pt", _small_ck(tmp_path), out))
        free = os.statvfs(drive).f_bavail * os.statvfs(drive).f_frsize
        assert free > 512 << 10
        assert f"[Errno 28] cannot write {out!r}: no space left on the drive of {drive!r} " \
               f"(ENOSPC: its blocks or its inodes are used up, or a project quota is " \
               f"reached): {free} bytes and 0 inodes are free there" in err, err
        assert len(os.listdir(drive)) == taken


def test_a_quota_is_not_called_a_full_drive(tmp_path):
    """EDQUOT keeps its errno and says quota; a save's size is said when known."""
    ck = str(tmp_path / "ck")
    assert targets.no_space(RuntimeError("save failed"), ck, 10) is None  # not about space
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), ck + ".tmp/rank00000.pt")
    got = targets.no_space(quota, ck, 4096)
    assert got.errno == errno.EDQUOT
    assert str(got).startswith(
        f"[Errno {errno.EDQUOT}] cannot save checkpoint {ck!r}: disk quota exceeded on the drive "
        f"of {str(tmp_path)!r} (EDQUOT: this user's or group's quota there is used up): ")
    assert ", and this save writes about 4096 bytes (on this rank); nothing was saved" in str(got)
    full = targets.no_space(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), ck, None)
    assert full.errno == errno.ENOSPC and "no space left on the drive" in str(full)
    assert "this save writes" not in str(full)


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_output_under_a_dangling_symlink(tmp_path, below):
    """The output's folder (or one above it) is a symbolic link to a folder that is gone: the
    error says so, and neither the link nor its target is touched."""
    link, gone = tmp_path / "exports", tmp_path / "gone"
    link.symlink_to(gone)
    out = os.path.join(link, below, "out.pt")
    want = f"cannot create the parent directory of {out!r}: {str(link)!r} is a symbolic link " \
           f"to a missing folder ({str(gone)!r} does not exist)"
    err = _cli_error(_export("pt", _small_ck(tmp_path), out))
    assert f"[Errno 2] {want}" in err, err
    with pytest.raises(FileNotFoundError) as e:
        tierlift.checkpoint.save(os.path.join(link, below, "ck"), _model())
    assert want.replace("out.pt", "ck.tmp") in str(e.value)
    assert os.path.islink(link) and not os.path.lexists(gone)
    assert sorted(os.listdir(tmp_path)) == ["exports", "small"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_export_whose_folder_is_removed_meanwhile(tmp_path, monkeypatch, fmt):
    """Another process (a cleanup) removes the output's folder right after it was created."""
    ck = _small_ck(tmp_path)
    folder = tmp_path / "exports"
    real = targets.make_parent

    def made_then_removed(path):
        real(path)
        shutil.rmtree(folder)

    monkeypatch.setattr(targets, "make_parent", made_then_removed)
    out = str(folder / FORMATS[fmt][0])
    err = _cli_error(_export(fmt, ck, out))
    assert f"[Errno 2] cannot write {out!r}: missing parent folder: {str(folder)!r} does not " \
           "exist" in err, err
    assert sorted(os.listdir(tmp_path)) == ["small"]


def _save_past_file_limit(ck: str, limit: int) -> tuple[int, str] | None:
    """In a child process: a save of a larger model to `ck` with RLIMIT_FSIZE at `limit` (and
    SIGXFSZ ignored, so the write fails with EFBIG rather than killing the process)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        tierlift.checkpoint.save(ck, _model(2, width=1024))
    except OSError as e:
        return e.errno, str(e)
    return None


def _in_child(fn, *args):
    """fn(*args) in a child of the fork server; returns what it returns."""
    with forkserver.CTX.Pool(1) as pool:
        return pool.apply(fn, args)


def test_a_save_past_the_file_size_limit(tmp_path):
    ck = str(tmp_path / "ck")
    earlier = _checkpoint(ck)
    before = _tree(ck)
    got = _in_child(_save_past_file_limit, ck, 16 << 10)
    assert got is not None, "the save should have failed"
    code, text = got
    assert code == 27 and text.startswith(
        f"[Errno 27] cannot write {ck!r}: file size limit (EFBIG): a file would grow past "
        "16384 bytes, the most this process may write (RLIMIT_FSIZE"), text
    assert f"nothing was saved and the temporary directory {ck + '.tmp'!r} was removed" in text
    assert sorted(os.listdir(tmp_path)) == ["ck"] and _tree(ck) == before
    fresh = _model(5)
    tierlift.checkpoint.load(ck, fresh)
    assert all(torch.equal(v, earlier.state_dict()[k]) for k, v in fresh.state_dict().items())


# ---- leftovers of killed exports -----------------------------------------------------------


def _paused_export(args: list[str], pause_after: int, paused, go) -> None:
    """main(args) in a child, which after the `pause_after`-th file safetensors writes sets
    `paused` and waits for `go` (the test kills it meanwhile, or lets it go on)."""
    import safetensors.torch as st

    real, written = st.save_file, [0]

    def save_file(*a, **k):
        real(*a, **k)
        written[0] += 1
        if written[0] == pause_after:
            paused.set()
            go.wait(60)

    st.save_file = save_file
    sys.exit(main(args))


def _start_paused(args: list[str], pause_after: int):
    paused, go = forkserver.CTX.Event(), forkserver.CTX.Event()
    p = forkserver.CTX.Process(target=_paused_export, args=(args, pause_after, paused, go))
    p.start()
    assert paused.wait(60), "the export did not get to its pause"
    return p, go


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_a_later_export_removes_what_killed_ones_left(tmp_path, fmt):
    ck = tmp_path / "ck"
    model = _checkpoint(ck)
    folder = tmp_path / "exports"
    out = folder / FORMATS[fmt][0]
    args = _export(fmt, ck, out) + (["--max-shard-size", "100"] if fmt == "hf" else [])
    left: list[str] = []
    for pause_after in [1, 2, 3] if fmt == "hf" else [1, 1, 1]:
        p, _ = _start_paused(args, pause_after)
        os.kill(p.pid, signal.SIGKILL)
        p.join()  # as its shell would: a zombie is gone too, but not its pid
        # each export removed what the one killed before it left, and left its own
        now = sorted(os.listdir(folder))
        assert len(now) == 1 and now != left and now[0].startswith(f".{out.name}.tmp-"), now
        left = now
    live, go = _start_paused(args, 1)  # a live export to the same output: not touched
    (mine,) = set(os.listdir(folder)) - set(left)
    assert len(os.listdir(folder)) == 1  # the live one removed the last leftover too

    assert main(args) == 0
    assert sorted(os.listdir(folder)) == sorted([out.name, mine])
    if fmt == "hf":
        files = sorted(os.listdir(out))
        assert "model.safetensors.index.json" in files and len(files) > 2, files
        got = {k: v for f in files if f.endswith(".safetensors")
               for k, v in load_file(out / f).items()}
    else:
        got = load_file(out)
    want = model.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

    result = _tree(folder)
    go.set()  # the live one finds its output taken: refused, its directory removed
    live.join(60)
    assert live.exitcode == 2
    assert sorted(os.listdir(folder)) == [out.name]
    assert _tree(folder) == {k: v for k, v in result.items() if not k.startswith(mine)}
