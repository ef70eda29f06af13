"""tierlift.checkpoint never writes over what it did not write, and checks every file it reads:
a save (blocking or not) refuses a file, a symbolic link or a foreign directory at its path (and
at path.tmp / path.old) before anything is written; manifest.json covers the JSON files, so a
changed digit, a random byte or a truncation is an error naming the file that changes nothing;
a full drive is an error naming the path and the bytes needed, with path.tmp removed."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import warnings

import dcp_source
import pytest
import torch
from torch import nn

import tierlift
from tierlift.checkpoint import background
from tierlift.checkpoint import format as fmt
from tierlift.checkpoint import writer as ckpt_writer


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8))


def _trained(offload="none", tmp=None):
    model = _model()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if offload == "none" else
           tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload=offload))
    for _ in range(2):
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
             for i, st in opt.state_dict()["state"].items()},
            [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups])


def _assert_same(a, b):
    (wa, sa, ga), (wb, sb, gb) = a, b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sa.keys() == sb.keys()
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(v, sb[i][k]) if isinstance(v, torch.Tensor) else v == sb[i][k]
    assert ga == gb


def _tree(path):
    return sorted(os.path.relpath(os.path.join(r, f), path)
                  for r, _, fs in os.walk(path) for f in fs)


# ---- what a save may replace ---------------------------------------------------------------


def _foreign(tmp_path, kind):
    """A target that is not a tierlift checkpoint, and how to check it is untouched."""
    target = tmp_path / "target"
    if kind == "file":
        target.write_bytes(b"precious")
        return target, lambda: target.read_bytes() == b"precious"
    if kind == "directory":
        target.mkdir()
        (target / "notes.txt").write_text("precious")
        return target, lambda: _tree(target) == ["notes.txt"]
    if kind == "symlink":
        real = tmp_path / "real"
        real.mkdir()
        (real / "metadata.json").write_text("{}")
        target.symlink_to(real)
        return target, lambda: target.is_symlink() and _tree(real) == ["metadata.json"]
    # a directory that looks like a checkpoint at first sight but is not tierlift's
    target.mkdir()
    (target / "metadata.json").write_text(json.dumps({"format": "something-else"}))
    return target, lambda: _tree(target) == ["metadata.json"]


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
@pytest.mark.parametrize("kind", ["file", "directory", "symlink", "other-metadata"])
def test_save_refuses_what_is_not_a_checkpoint(tmp_path, kind, blocking):
    target, untouched = _foreign(tmp_path, kind)
    model, opt = _trained()
    with pytest.raises(FileExistsError, match=re.escape(repr(str(target))) + " exists and is"):
        tierlift.checkpoint.save(target, model, opt, blocking=blocking)
    tierlift.checkpoint.close()  # nothing in flight, nothing to report
    assert untouched()
    assert not os.path.lexists(str(target) + ".tmp")
    assert not os.path.lexists(str(target) + ".old")


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_sharded_save_refuses_a_file(tmp_path, blocking):
    target, untouched = _foreign(tmp_path, "file")
    model = tierlift.zero.shard(_model(), stage=3)
    with pytest.raises(FileExistsError, match="a save replaces only a tierlift checkpoint"):
        tierlift.checkpoint.save(target, model, blocking=blocking)
    tierlift.checkpoint.close()
    assert untouched() and not os.path.lexists(str(target) + ".tmp")


@pytest.mark.parametrize("suffix", [".tmp", ".old"])
def test_save_refuses_a_foreign_tmp_or_old(tmp_path, suffix):
    ck = tmp_path / "ck"
    model, opt = _trained()
    tierlift.checkpoint.save(ck, model, opt)
    other = tmp_path / f"ck{suffix}"
    other.mkdir()
    (other / "notes.txt").write_text("precious")
    before = _tree(ck)
    with pytest.raises(FileExistsError, match=re.escape(repr(str(other)))):
        tierlift.checkpoint.save(ck, model, opt)
    assert _tree(other) == ["notes.txt"] and _tree(ck) == before


def test_save_replaces_a_checkpoint_and_takes_an_empty_directory(tmp_path):
    model, opt = _trained()
    empty = tmp_path / "empty"
    empty.mkdir()
    tierlift.checkpoint.save(empty, model, opt, extra={"n": 1})
    tierlift.checkpoint.save(empty, model, opt, extra={"n": 2})  # a tierlift checkpoint
    assert tierlift.checkpoint.load(empty, _model(1)) == {"n": 2}
    nested = tmp_path / "a" / "b" / "ck"  # missing parents are created
    tierlift.checkpoint.save(nested, model, opt)
    assert (nested / "manifest.json").is_file()


# ---- every file checked ------------------------------------------------------------------


def _digit_changed(text: str, key: str) -> str:
    """The JSON text with the first digit of the value of `key` changed (1 -> 2, else -> 1)."""
    m = re.search(rf'"{re.escape(key)}": *-?(\d)', text)
    assert m, key
    i = m.start(1)
    return text[:i] + ("2" if text[i] == "1" else "1") + text[i + 1:]


DAMAGE = ["digit", "byte", "truncate"]

def _damage(file: str, how: str, key: str | None) -> None:
    data = open(file, "rb").read()
    if how == "digit":
        data = _digit_changed(data.decode(), key).encode()
    elif how == "byte":
        i = len(data) // 3
        data = data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1:]
    else:
        data = data[:len(data) // 2]
    open(file, "wb").write(data)


FILES = [("metadata.json", "lr"), ("optim/state.json", "step"), ("manifest.json", "bytes"),
         ("rank00000.sha256", None)]


@pytest.mark.parametrize("name,key,how", [(n, k, h) for n, k in FILES for h in DAMAGE
                                          if k is not None or h != "digit"])
def test_a_changed_json_file_is_named_and_changes_nothing(tmp_path, name, key, how):
    model, opt = _trained("cpu")
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    for _ in range(2):  # the state moves on; a failed load must leave it here
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    before = _snapshot(model, opt)
    _damage(str(ck / name), how, key)
    with pytest.raises(ValueError, match=re.escape(os.path.basename(name)) + " is corrupt"):
        tierlift.checkpoint.load(ck, model, opt)
    _assert_same(_snapshot(model, opt), before)
    from tierlift.checkpoint.__main__ import main

    with pytest.raises(SystemExit):  # the command line checks too, in one line
        main(["export-optimizer", str(ck), str(tmp_path / "o.pt")])
    assert not (tmp_path / "o.pt").exists()


def test_a_changed_hyperparameter_in_a_sharded_checkpoint(tmp_path):
    model = tierlift.zero.shard(_model(), stage=3)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3)
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt)
    meta = ck / "metadata.json"
    meta.write_text(meta.read_text().replace('"lr": 0.001', '"lr": 2.001'))
    with pytest.raises(ValueError, match=r"metadata\.json is corrupt"):
        tierlift.checkpoint.load(ck, model, opt)
    assert opt.param_groups[0]["lr"] == 1e-3


def test_a_checkpoint_without_manifest_loads_only_when_asked(tmp_path):
    model, opt = _trained()
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    os.unlink(ck / "manifest.json")  # as an older tierlift wrote it (or someone deleted it)
    with pytest.raises(ValueError, match="has no manifest.json.*verify=False"):
        tierlift.checkpoint.load(ck, _model(1), opt)
    with pytest.warns(UserWarning, match="has no manifest.json"):
        assert tierlift.checkpoint.load(ck, _model(1), opt, verify=False) == {"step": 2}
    (ck / "metadata.json").write_text("{not json")
    with warnings.catch_warnings(), pytest.raises(ValueError,
                                                   match=r"metadata\.json is corrupt"):
        warnings.simplefilter("ignore")
        tierlift.checkpoint.load(ck, _model(1), opt, verify=False)


# ---- a full drive ------------------------------------------------------------------------


def _no_space_checks(err: BaseException, ck, at_least: int) -> None:
    text = str(err)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC, repr(err)
    assert repr(str(ck)) in text
    needed = int(re.search(r"writes about (\d+) bytes", text).group(1))
    assert needed >= at_least
    assert not os.path.lexists(str(ck) + ".tmp")


def test_full_drive_at_claim_names_path_and_bytes(tmp_path, monkeypatch):
    """0 bytes left: the first file of the save (the owner file of path.tmp) cannot be
    written; simulated by failing that write with ENOSPC (the tmpfs test below does it for
    real where mounting is allowed)."""
    real_open = open

    def full(file, mode="r", *a, **k):
        if "w" in mode or "x" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(background, "open", full, raising=False)
    model = _model()
    ck = tmp_path / "ck"
    with pytest.raises(OSError) as e:
        tierlift.checkpoint.save(ck, model)
    _no_space_checks(e.value, ck, sum(p.numel() * 4 for p in model.parameters()))


def test_full_drive_while_writing_names_path_and_bytes(tmp_path, monkeypatch):
    real = ckpt_writer.engine()

    class Full:
        def __getattr__(self, name):
            return getattr(real, name)

        def write(self, tensor, path, offset=0):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(ckpt_writer, "engine", lambda: Full())
    model = _model()
    ck = tmp_path / "ck"
    with pytest.raises(OSError) as e:
        tierlift.checkpoint.save(ck, model)
    _no_space_checks(e.value, ck, sum(p.numel() * 4 for p in model.parameters()))


@pytest.fixture
def small_tmpfs(tmp_path):
    where = tmp_path / "small"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                       capture_output=True)
    if r.returncode:
        pytest.skip("mounting a tmpfs is not permitted here (the simulated tests cover it)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("left", ["nothing", "some"])
def test_full_tmpfs(small_tmpfs, left):
    fill = small_tmpfs / "fill"
    fd = os.open(fill, os.O_WRONLY | os.O_CREAT)  # fill it up, then free what the case leaves
    try:
        while os.write(fd, b"\1" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    if left == "some":
        os.truncate(fill, os.path.getsize(fill) - (64 << 10))
    model = _model()
    model[0] = nn.Linear(256, 512)  # 512 KiB: more than the 256 KiB drive
    ck = small_tmpfs / "ck"
    with pytest.raises(OSError) as e:
        tierlift.checkpoint.save(ck, model)
    _no_space_checks(e.value, ck, 512 * 256 * 4)
    assert sorted(os.listdir(small_tmpfs)) == ["fill"]


# ---- the command line --------------------------------------------------------------------


def _cli_fails(args, capsys, match):
    from tierlift.checkpoint.__main__ import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # usage, then the one-line error
    assert e.value.code == 2 and "Traceback" not in err, err
    assert last.startswith("python -m tierlift.checkpoint: error: ") and match in last, err


def test_import_dcp_refuses_a_non_empty_target(tmp_path, dcp_dir, capsys):
    from tierlift.checkpoint.__main__ import main

    model, opt = _trained()
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 7})
    before = {f: (ck / f).read_bytes() for f in _tree(ck)}
    _cli_fails(["import-dcp", dcp_dir, ck], capsys, "exists and is not an empty directory")
    assert {f: (ck / f).read_bytes() for f in _tree(ck)} == before  # optimizer, extra kept
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("precious")
    _cli_fails(["import-dcp", dcp_dir, busy], capsys, "exists and is not an empty directory")
    assert _tree(busy) == ["notes.txt"]
    _cli_fails(["import-dcp", busy / "notes.txt", tmp_path / "c2"], capsys,
               "is not a directory")
    # a new path (its parents created) or an empty directory is fine
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert main(["import-dcp", str(dcp_dir), str(tmp_path / "new" / "ck")]) == 0
        (tmp_path / "empty").mkdir()
        assert main(["import-dcp", str(dcp_dir), str(tmp_path / "empty")]) == 0
    fresh = dcp_source.model(1)
    tierlift.checkpoint.load(tmp_path / "empty", fresh)
    want = dcp_source.model().state_dict()  # what dcp_dir holds (conftest.py)
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("command", ["export", "export-optimizer"])
def test_export_errors_are_one_line_and_nothing_is_overwritten(tmp_path, command, capsys):
    from tierlift.checkpoint.__main__ import main

    _cli_fails([command, tmp_path / "nope", tmp_path / "o.pt"], capsys,
               "is not a tierlift checkpoint (it does not exist)")
    (tmp_path / "plain").mkdir()
    _cli_fails([command, tmp_path / "plain", tmp_path / "o.pt"], capsys,
               "is not a tierlift checkpoint (no metadata.json)")
    (tmp_path / "file").write_text("x")
    _cli_fails([command, tmp_path / "file", tmp_path / "o.pt"], capsys,
               "is not a tierlift checkpoint (it is a file)")
    model, opt = _trained()
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt)
    kept = tmp_path / "kept.pt"
    kept.write_bytes(b"precious")
    _cli_fails([command, ck, kept], capsys, "exists already")
    assert kept.read_bytes() == b"precious"
    out = tmp_path / "a" / "b" / "o.pt"  # missing parents are created
    assert main([command, str(ck), str(out)]) == 0
    assert sorted(os.listdir(out.parent)) == ["o.pt"]  # and no temporary file is left
    sd = torch.load(out, weights_only=True)
    if command == "export":
        assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    else:
        assert sd["state"].keys() == opt.state_dict()["state"].keys()


def test_a_save_over_a_lone_old_keeps_it_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """A replace killed between its renames leaves only ck.old (which load() falls back to);
    the next save must not delete it before its own directory is in place."""
    model, opt = _trained()
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt, extra={"n": 1})
    fmt.move_aside(str(ck), str(ck) + ".old")
    real_rename = os.rename
    seen = []

    def rename(src, dst):
        seen.append(os.path.isdir(str(ck) + ".old"))  # still there at every rename
        real_rename(src, dst)

    monkeypatch.setattr(fmt.os, "rename", rename)
    tierlift.checkpoint.save(ck, model, opt, extra={"n": 2})
    monkeypatch.undo()
    assert seen and all(seen)
    assert not os.path.exists(str(ck) + ".old")
    assert tierlift.checkpoint.load(ck, _model(1)) == {"n": 2}


def test_a_path_with_a_trailing_slash_names_the_directory(tmp_path):
    """save("ckpt/", ...) (as the README writes it) used ckpt/.tmp inside the target, and the
    second save failed renaming ckpt/ into itself."""
    model, opt = _trained()
    ck = str(tmp_path / "ckpt") + os.sep
    tierlift.checkpoint.save(ck, model, opt, extra={"n": 1})
    tierlift.checkpoint.save(ck, model, opt, extra={"n": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert ".tmp" not in os.listdir(ck) and tierlift.checkpoint.load(ck, _model(1)) == {"n": 2}
