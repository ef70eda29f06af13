"""What a user keeps when things go wrong: a "latest" checkpoint saved over and over to one
folder survives a kill at any file operation of the next save (and the save after works); a
background save in flight when the training loop raises still lands; a refused load leaves
model and optimizer exactly as they were; a state a failed in-place load left mixed is not
read out nor saved over the last checkpoint; directories and renames reach the drive before the
old checkpoint goes; a weights folder holding two exports is refused, not mixed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from torch import nn

import tierlift
from tierlift.checkpoint import format as fmt
from tierlift.checkpoint import outputs
from tierlift.io import IoEngine
from tierlift.optim import AdamW
from tierlift.zero.weight_files import WeightFiles

ROOT = Path(__file__).resolve().parents[2]
# each killed child leaves its optimizer's folder, which the next optimizer built there removes
pytestmark = pytest.mark.filterwarnings("ignore:tierlift offload. removed:RuntimeWarning")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 5))


def _fresh(nvme: str, gens: int = 2, **kw):
    model = _model()
    return model, AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload="nvme",
                        nvme_path=nvme, cpu_budget=1 << 20, nvme_generations=gens, **kw)


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 40, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt) -> dict:
    out = {f"w.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- a save killed at any file operation -------------------------------------------------

def _child(root: str, kill_at: int, trace: bool) -> None:
    """Saves step 1 to root/ck, then step 2 over it, killing itself (SIGKILL: no cleanup runs)
    before or after file operation `kill_at` of the second save; its states go to s1.pt, s2.pt."""
    torch.set_num_threads(1)
    model, opt = _fresh(root)
    ck = os.path.join(root, "ck")
    for step in (1, 2):
        _step(model, opt, step)
        torch.save(_snapshot(model, opt), os.path.join(root, f"s{step}.pt"))
        if step == 1:
            tierlift.checkpoint.save(ck, model, opt, extra={"step": 1})
    events = []

    def wrap(owner, attr, label):
        fn = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            for when in ("before", "after"):
                events.append(f"{when} {label(*args)}")
                if len(events) - 1 == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if when == "before":
                    out = fn(*args, **kwargs)
            return out

        setattr(owner, attr, wrapped)

    name = os.path.basename
    for attr in ("rename", "replace"):
        wrap(os, attr, lambda a, b, *_, attr=attr, **__: f"{attr} {name(a)} {name(b)}")
    for attr in ("unlink", "rmdir", "mkdir"):
        wrap(os, attr, lambda a, *_, attr=attr, **__: f"{attr} {name(a)}")
    wrap(os, "fsync", lambda fd: "fsync")
    wrap(shutil, "rmtree", lambda a, *_, **__: f"rmtree {name(a)}")
    wrap(IoEngine, "write", lambda self, t, p, o=0: f"write {name(p)}")
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    if trace:
        with open(os.path.join(root, "trace"), "w") as f:
            f.write("\n".join(events))
    os._exit(0)


def _run_child(root: Path, kill_at: int = -1, trace: bool = False) -> int:
    root.mkdir()
    proc = forkserver.CTX.Process(target=_child, args=(str(root), kill_at, trace))
    proc.start()
    proc.join()
    return proc.exitcode


def test_a_save_over_the_last_one_killed_anywhere_leaves_one_whole_and_saves_on(tmp_path):
    """The "latest" idiom with offloaded state (a checkpoint with a subfolder): a kill at any
    file operation of the next save leaves the previous checkpoint or the new one, exactly, and
    the save after that works. A kill while the replaced checkpoint was being removed (its
    optim/ emptied, not yet removed) made every later save refuse the folder as holding files
    tierlift did not write."""
    assert _run_child(tmp_path / "trace", trace=True) == 0
    events = (tmp_path / "trace" / "trace").read_text().splitlines()
    first_rename = next(i for i, e in enumerate(events) if e.startswith("before rename"))
    # right after every operation from the publish on (a kill before one leaves what a kill
    # after the one before it does); the writes before it (a partial ck.tmp) are sampled
    picks = list(range(0, first_rename, 8)) + [
        i for i in range(first_rename, len(events)) if events[i].startswith("after")]
    found = set()
    for k in picks:
        trial = tmp_path / f"kill{k}"
        assert _run_child(trial, kill_at=k) == -signal.SIGKILL, (k, events[k])
        model, opt = _fresh(str(trial))
        step = tierlift.checkpoint.load(trial / "ck", model, opt)["step"]
        assert _same(_snapshot(model, opt), torch.load(trial / f"s{step}.pt")), (k, events[k])
        found.add(step)
        _step(model, opt, 3)
        tierlift.checkpoint.save(trial / "ck", model, opt, extra={"step": 3})
        left = sorted(n for n in os.listdir(trial) if n.startswith("ck"))
        assert left == ["ck"], (k, events[k], left)
        opt.close()
    assert found == {1, 2}


def test_an_emptied_optimizer_folder_in_the_old_checkpoint_is_not_a_users(tmp_path):
    """A sharded checkpoint's rankNNNNN.optim/ left empty in ck.old by a killed removal."""
    model = tierlift.zero.shard(_model(), stage=3)
    opt = AdamW(model.parameters(), lr=1e-2, offload="nvme", nvme_path=str(tmp_path),
                cpu_budget=1 << 20)
    _step(model, opt, 1)
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 1})
    shutil.copytree(ck, tmp_path / "copy")
    fmt.move_aside(str(tmp_path / "copy"), f"{ck}.old")
    optim = Path(f"{ck}.old") / "rank00000.optim"
    for f in optim.iterdir():
        f.unlink()
    _step(model, opt, 2)
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    assert not os.path.exists(f"{ck}.old")
    (tmp_path / "ck" / "notes").mkdir()  # an empty folder of the user's is still refused
    with pytest.raises(FileExistsError, match="notes/"):
        tierlift.checkpoint.save(ck, model, opt, extra={"step": 3})
    opt.close()


# ---- a background save in flight when the loop raises -------------------------------------

_RAISES = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
import torch, tierlift
from tierlift.checkpoint import writer
from test_checkpoint_data_loss import _fresh, _step
root = sys.argv[1]
slow = writer.Writer._submit
def submit(self, buf, runs):  # the loop raises long before the files are written
    time.sleep(0.02)
    return slow(self, buf, runs)
writer.Writer._submit = submit
def train():
    model, opt = _fresh(root)
    for step in (1, 2):
        _step(model, opt, step)
    tierlift.checkpoint.save(os.path.join(root, "ck"), model, opt, extra={"step": 2},
                             blocking=False, staging_budget=128 << 10)
    raise RuntimeError("the loop failed")
train()
"""


def test_a_background_save_in_flight_lands_when_the_loop_raises(tmp_path):
    out = subprocess.run([sys.executable, "-c", _RAISES, str(tmp_path),
                          str(ROOT / "tests" / "python")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert out.returncode == 1 and "the loop failed" in out.stderr, out.stderr[-2000:]
    model, opt = _fresh(str(tmp_path))
    assert tierlift.checkpoint.load(tmp_path / "ck", model, opt) == {"step": 2}
    twin, twin_opt = _fresh(str(tmp_path))
    for step in (1, 2):
        _step(twin, twin_opt, step)
    assert _same(_snapshot(model, opt), _snapshot(twin, twin_opt))
    opt.close()
    twin_opt.close()


# ---- a refused load changes nothing -------------------------------------------------------

def _mixed_steps(ck, older):
    for name in ("rank00000.pt", "rank00000.sha256"):  # weights of another step
        shutil.copy(os.path.join(older, name), os.path.join(ck, name))


def _optimizer_of_another_step(ck, older):
    shutil.rmtree(os.path.join(ck, "optim"))
    shutil.copytree(os.path.join(older, "optim"), os.path.join(ck, "optim"))


def _truncated(ck, older):
    file = os.path.join(ck, "optim", "g0.exp_avg.f32")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def _another_model(ck, older):
    shutil.rmtree(ck)
    torch.manual_seed(1)
    other = nn.Sequential()
    other.add_module("a", nn.Linear(40, 30))  # the same shapes under other names
    other.add_module("b", nn.Linear(30, 5))
    tierlift.checkpoint.save(ck, other, AdamW(other.parameters(), lr=1e-2))


@pytest.mark.parametrize("damage", [_mixed_steps, _optimizer_of_another_step, _truncated,
                                    _another_model], ids=lambda f: f.__name__.strip("_"))
def test_a_refused_load_leaves_model_and_optimizer_as_they_were(tmp_path, damage):
    """Into one NVMe generation (stepped in place): a step after the refused load equals the
    step of a twin that never tried it, bit for bit."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, opt = _fresh(str(tmp_path / "a"), gens=1)
    twin, twin_opt = _fresh(str(tmp_path / "b"), gens=1)
    ck, older = str(tmp_path / "ck"), str(tmp_path / "older")
    for step in (1, 2, 3):
        _step(model, opt, step)
        _step(twin, twin_opt, step)
        if step < 3:
            tierlift.checkpoint.save(older if step == 1 else ck, model, opt)
    damage(ck, older)
    with pytest.raises(ValueError):
        tierlift.checkpoint.load(ck, model, opt)
    _step(model, opt, 4)
    _step(twin, twin_opt, 4)
    assert _same(_snapshot(model, opt), _snapshot(twin, twin_opt))
    opt.close()
    twin_opt.close()


# ---- a failed in-place load is neither read out nor saved --------------------------------

def _break_by_a_failed_load(monkeypatch, opt, state_dict, torn: bool = False) -> None:
    """Loads `state_dict` into `opt` (one NVMe generation), failing at its third write (`torn`:
    after writing half of it, as a drive that fills up mid-write): some chunks are rewritten in
    place, the rest are not, and step() refuses from here on."""
    writes, write = [0], IoEngine.write

    def failing(self, tensor, path, offset=0):
        writes[0] += 1
        if writes[0] == 3:
            if torn:
                write(self, tensor[:tensor.numel() // 2], path, offset).wait()
            raise OSError(28, "injected full drive")
        return write(self, tensor, path, offset)

    monkeypatch.setattr(IoEngine, "write", failing)
    with pytest.raises(OSError, match="injected"):
        opt.load_state_dict(state_dict)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="load a checkpoint before stepping"):
        opt.step()


def test_a_state_left_mixed_by_a_failed_load_is_not_saved_over_the_last_checkpoint(
        tmp_path, monkeypatch):
    """state_dict() and a checkpoint save read such a state as if it were one: measured, 73-85%
    of the moments from the state being loaded, the rest and every step count from the old one,
    saved over the last good checkpoint, which then loaded without a word."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, opt = _fresh(str(tmp_path / "a"), gens=1, chunk_bytes=4096)  # two chunks
    other, other_opt = _fresh(str(tmp_path / "b"))
    for step in (1, 2):
        _step(model, opt, step)
        _step(other, other_opt, 10 + step)
    _step(other, other_opt, 13)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    good = _snapshot(model, opt)
    _break_by_a_failed_load(monkeypatch, opt, other_opt.state_dict())
    with pytest.raises(RuntimeError, match="cannot be read out"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match="cannot be read out"):
        tierlift.checkpoint.save(ck, model, opt, extra={"step": "mixed"})
    # the last checkpoint is intact, and loading it is the way on
    assert tierlift.checkpoint.load(ck, model, opt) == {"step": 2}
    assert _same(_snapshot(model, opt), good)
    twin, twin_opt = _fresh(str(tmp_path / "b"))
    tierlift.checkpoint.load(ck, twin, twin_opt)
    _step(model, opt, 3)
    _step(twin, twin_opt, 3)
    assert _same(_snapshot(model, opt), _snapshot(twin, twin_opt))
    for o in (opt, other_opt, twin_opt):
        o.close()


def test_a_sharded_load_of_state_saved_in_ram_mends_such_a_state(tmp_path, monkeypatch):
    """That load starts from the optimizer's state_dict() (for its groups): it must not read
    the mixed tiers it is about to replace."""
    def sharded(offload):
        model = tierlift.zero.shard(_model(), stage=3)
        kw = dict(offload="nvme", nvme_path=str(tmp_path), cpu_budget=1 << 20,
                  nvme_generations=1, chunk_bytes=4096) if offload else {}
        return model, AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)

    in_ram, in_ram_opt = sharded(False)
    _step(in_ram, in_ram_opt, 1)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, in_ram, in_ram_opt)  # its state saved as tensors
    model, opt = sharded(True)
    _step(model, opt, 2)
    _break_by_a_failed_load(monkeypatch, opt, in_ram_opt.state_dict())
    tierlift.checkpoint.load(ck, model, opt)
    _step(model, opt, 3)
    _step(in_ram, in_ram_opt, 3)
    assert _same(_snapshot(model, opt), _snapshot(in_ram, in_ram_opt))
    opt.close()


@pytest.mark.parametrize("how", ["load_state_dict", "checkpoint"])
def test_a_chunk_torn_by_a_failed_load_does_not_block_the_load_that_mends_it(tmp_path,
                                                                           monkeypatch, how):
    """The mending load read each chunk and checked it against the CRC it had before the failed
    load, so a torn chunk made every later load fail ("file is corrupt"): the optimizer could
    neither step nor be loaded again."""
    model, opt = _fresh(str(tmp_path), gens=1, chunk_bytes=4096)
    twin, twin_opt = _fresh(str(tmp_path))
    other, other_opt = _fresh(str(tmp_path))
    for step in (1, 2):
        _step(model, opt, step)
        _step(twin, twin_opt, step)
        _step(other, other_opt, 10 + step)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, twin, twin_opt)
    _break_by_a_failed_load(monkeypatch, opt, other_opt.state_dict(), torn=True)
    if how == "checkpoint":
        tierlift.checkpoint.load(ck, model, opt)
    else:
        opt.load_state_dict(twin_opt.state_dict())
    _step(model, opt, 3)
    _step(twin, twin_opt, 3)
    assert _same(_snapshot(model, opt), _snapshot(twin, twin_opt))
    for o in (opt, twin_opt, other_opt):
        o.close()


# ---- what reaches the drive before the old checkpoint goes --------------------------------

def test_a_save_flushes_the_new_folders_and_renames_before_the_old_one_goes(tmp_path,
                                                                          monkeypatch):
    """A power loss right after the old checkpoint's files are unlinked must not find the new
    checkpoint's entries or its rename still unwritten (neither checkpoint would be there)."""
    model, opt = _fresh(str(tmp_path))
    _step(model, opt, 1)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 1})
    _step(model, opt, 2)
    events = []
    fsync, rename, unlink = fmt.fsync_path, os.rename, os.unlink
    monkeypatch.setattr(fmt, "fsync_path",
                        lambda p: (events.append(("fsync", os.path.abspath(p))), fsync(p)))
    monkeypatch.setattr(os, "rename",
                        lambda a, b: (events.append(("rename", os.path.abspath(b))),
                                      rename(a, b)))
    monkeypatch.setattr(os, "unlink",
                        lambda a, *x, **k: (events.append(("unlink", os.path.abspath(a))),
                                            unlink(a, *x, **k)))
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    monkeypatch.undo()
    published = events.index(("rename", ck))
    first_removal = next(i for i in range(published, len(events))
                         if events[i][0] == "unlink" and events[i][1].startswith(ck + ".old/"))
    synced = [p for what, p in events[:published] if what == "fsync"]
    assert {ck + ".tmp", os.path.join(ck + ".tmp", "optim")} <= set(synced), events
    assert ("fsync", str(tmp_path)) in events[published:first_removal], events
    opt.close()


def test_an_export_flushes_its_rename(tmp_path, monkeypatch):
    synced = []
    fsync = outputs.fsync_path
    monkeypatch.setattr(outputs, "fsync_path", lambda p: (synced.append(p), fsync(p)))
    out = tmp_path / "sub" / "model.pt"
    outputs.write_new(str(out), lambda f: torch.save({"w": torch.ones(2)}, f))
    assert out.is_file() and synced[-1] == str(out.parent)


# ---- a weights folder holding two exports ---------------------------------------------------

def _export(folder: Path, tensors: dict, shards: list[list[str]] | None) -> None:
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    if shards is None:
        save_file(tensors, folder / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, folder / file)
        weight_map.update(dict.fromkeys(names, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_weights_folder_of_two_exports_is_refused(tmp_path):
    pytest.importorskip("safetensors")
    old = {n: torch.full((4,), 1.0) for n in ("a", "b", "c")}
    new = {n: torch.full((4,), 2.0) for n in ("a", "b", "c")}
    # a single-file export over a sharded one: transformers reads the new file, the index the
    # old shards
    _export(tmp_path / "both", old, [["a"], ["b", "c"]])
    _export(tmp_path / "both", new, None)
    with pytest.raises(ValueError, match="holds both model.safetensors and"):
        WeightFiles(tmp_path / "both")
    # shards of an export with other shard sizes copied over: a tensor where the index does not
    # put it
    _export(tmp_path / "mixed", old, [["a", "b"], ["c"]])
    _export(tmp_path / "newer", new, [["a"], ["b", "c"]])
    shutil.copy(tmp_path / "newer" / "model-00002-of-00002.safetensors", tmp_path / "mixed")
    with pytest.raises(ValueError, match="of different exports"):
        WeightFiles(tmp_path / "mixed")
    _export(tmp_path / "good", new, [["a"], ["b", "c"]])
    assert torch.equal(WeightFiles(tmp_path / "good").read("c"), new["c"])
