"""Files of the NVMe tiers changed under a running job by another process (io/file_watch.py):
the parameter shards and gradients of offload_params="nvme" and the optimizer state of
offload="nvme", truncated and regrown, replaced under the same name, or overwritten in part.
Each is refused before the next gather or step reads it (OSError EIO naming the file, "resume
from a checkpoint"), with the parameters and state as they were; the job's own writes over many
steps trip nothing."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_zero_offload import LR, data, make_net, state_bytes

import tierlift
from tierlift.io import file_watch
from tierlift.io.file_watch import FileWatch

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

CHANGES = ["truncate_regrow", "replace", "overwrite"]
_CHANGE = """
import os, sys
path, how = sys.argv[1], sys.argv[2]
n = os.path.getsize(path)
if how == "truncate_regrow":  # truncate -s 0 f; truncate -s N f
    os.truncate(path, 0)
    os.truncate(path, n)
elif how == "replace":  # a file of the same size put under the same name
    with open(path + ".new", "wb") as f:
        f.write(bytes(n))
    os.replace(path + ".new", path)
else:  # dd conv=notrunc over the first page
    with open(path, "r+b") as f:
        f.write(b"\\x7f" * 4096)
"""


def change(path: str, how: str) -> None:
    """Changes `path` from another process, as a user's script would."""
    subprocess.run([sys.executable, "-c", _CHANGE, path, how], check=True)


def watched() -> bool:
    return file_watch._notifier() is not None


def refused(fn, path: str, how: str) -> OSError:
    with pytest.raises(OSError) as e:
        fn()
    err = e.value
    while err.errno != errno.EIO and err.__cause__ is not None:  # (a step wraps it)
        err = err.__cause__
    assert err.errno == errno.EIO and path in str(err), err
    assert "resume from a checkpoint" in str(err), err
    assert ("replaced" if how == "replace" else "another process") in str(err), err
    return err


def train_step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    loss(model, batch).backward()
    opt.step()


def loss(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def torch_state(opt) -> list:
    return [(float(s["step"]), s["exp_avg"].clone(), s["exp_avg_sq"].clone())
            for s in opt.state.values()]


def same_state(a, b) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and torch.equal(x[1], y[1])
                                    and torch.equal(x[2], y[2]) for x, y in zip(a, b))


# ---- offload_params="nvme": the parameter shards' and gradients' files --------------------------
def nvme_params(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no O_DIRECT on the test's file system)
        model = tierlift.zero.shard(make_net(), stage=3, offload_params="nvme",
                                    nvme_path=tmp_path)
    return model, model._tierlift_zero.offload.store


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize("which", ["path", "grad_path"])
def test_shard_files_changed_before_the_step(tmp_path, which, how):
    if how != "replace" and not watched():
        pytest.skip("fanotify is unavailable here")
    torch.manual_seed(0)
    model, store = nvme_params(tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = data(3)
    train_step(model, opt, batches[0])
    opt.zero_grad(set_to_none=True)
    loss(model, batches[1]).backward()
    shards = [p.detach().clone() for p in model.parameters()]
    state = torch_state(opt)
    path = getattr(store, which)
    change(path, how)
    refused(opt.step, path, how)  # before the step writes anything through the mapping
    assert same_state(torch_state(opt), state)
    if which == "grad_path":  # (the parameters' own file was not touched)
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), shards))
    refused(lambda: loss(model, batches[2]), path, how)  # and every later gather


@pytest.mark.parametrize("how", CHANGES)
def test_shard_file_changed_between_steps(tmp_path, how):
    if how != "replace" and not watched():
        pytest.skip("fanotify is unavailable here")
    model, store = nvme_params(tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = data(2)
    train_step(model, opt, batches[0])
    state = torch_state(opt)
    change(store.path, how)
    opt.zero_grad(set_to_none=True)
    err = refused(lambda: loss(model, batches[1]), store.path, how)  # at the first gather
    assert "reading parameter shards" in str(err) and "fp32 shards" in str(err)
    refused(lambda: loss(model, batches[1]), store.path, how)  # and at every later one
    assert same_state(torch_state(opt), state)


# ---- offload="nvme": the optimizer state's files ------------------------------------------------
def offloaded(tmp_path, overlap: bool, generations: int = 2):
    model = make_net()
    opt = tierlift.optim.AdamW(model.parameters(), lr=LR, offload="nvme",
                               nvme_path=str(tmp_path), cpu_budget=state_bytes(model) // 3,
                               overlap=overlap, nvme_generations=generations)
    return model, opt, opt._offload


def step_counts(opt, model) -> list:
    return [float(opt.state[p]["step"]) for p in model.parameters()]


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize("kind", [0, -1], ids=["first_kind", "last_kind"])
@pytest.mark.parametrize("overlap,generations", [(False, 2), (True, 2), (False, 1)])
def test_state_files_changed_between_steps(tmp_path, how, kind, overlap, generations):
    if how != "replace" and not watched():
        pytest.skip("fanotify is unavailable here")
    model, opt, off = offloaded(tmp_path, overlap, generations)
    batches = data(3)
    train_step(model, opt, batches[0])
    tier = off.tiers[0]
    # (master, exp_avg, exp_avg_sq; no master with one generation: the parameters are)
    path = tier.paths[(tier.kinds[kind], tier.gen[0])]  # the first chunk's committed copy
    steps = step_counts(opt, model)
    params = [p.detach().clone() for p in model.parameters()]
    change(path, how)
    opt.zero_grad(set_to_none=True)
    loss(model, batches[1]).backward()
    refused(opt.step, path, how)  # before any chunk is stepped
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    refused(opt.step, path, how)  # and at every later step
    assert step_counts(opt, model) == steps
    refused(opt.state_dict, path, how)  # and its state is not handed out
    opt.close()


# ---- the job's own writes -----------------------------------------------------------------------
def test_own_writes_over_many_steps_trip_nothing(tmp_path):
    """NVMe parameters (pwrites of gradients and warm ranges, writes through the mapping) and
    NVMe optimizer state (io_uring writes) over several steps: no refusal."""
    (tmp_path / "p").mkdir()
    model, store = nvme_params(tmp_path / "p")
    opt = tierlift.optim.AdamW(model.parameters(), lr=LR, offload="nvme",
                               nvme_path=str(tmp_path), cpu_budget=state_bytes(model) // 3,
                               overlap=True)
    losses = []
    for batch in data(6):
        opt.zero_grad(set_to_none=True)
        out = loss(model, batch)
        out.backward()
        opt.step()
        losses.append(float(out.detach()))
    assert losses[-1] < losses[0]
    store.check_files()
    for tier in opt._offload.tiers:
        tier.watch.check()
        assert tier.watch.watching == watched()
    assert store._watch.watching == watched() and store._watch.problem is None
    opt.close()


# ---- where fanotify is unavailable --------------------------------------------------------------
def test_without_fanotify_a_warning_and_the_stat_checks(tmp_path, monkeypatch):
    monkeypatch.setattr(file_watch, "_notifier", lambda: None)
    monkeypatch.setattr(file_watch, "_NOTIFIER_ERROR", "fanotify is unavailable: test")
    monkeypatch.setattr(file_watch, "_warned", False)
    paths = [str(tmp_path / n) for n in ("a", "b", "c")]
    for p in paths:
        with open(p, "wb") as f:
            f.write(bytes(8192))
    with pytest.warns(RuntimeWarning, match="not watched.*truncated and regrown"):
        watch = FileWatch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        FileWatch().close()
    for p in paths:
        watch.add(p, "test data", 8192)
    watch.check()
    change(paths[1], "replace")
    refused(watch.check, paths[1], "replace")
    watch.check(paths=[paths[0]])  # the other files still answer
    os.truncate(paths[2], 4096)
    with pytest.raises(OSError, match=f"{paths[2]}.*cut short.*: 4096 of its 8192 bytes"):
        watch.check(paths=[paths[2]])
    watch.close()


def test_a_watch_collected_during_a_check_does_not_deadlock(tmp_path, monkeypatch):
    """The garbage collector may run a dropped watch's finalizer (which unmarks its files)
    inside another watch's check(), on the same thread."""
    if not watched():
        pytest.skip("fanotify is unavailable here")
    paths = [str(tmp_path / n) for n in ("kept", "dropped")]
    for p in paths:
        with open(p, "wb") as f:
            f.write(bytes(4096))
    kept, dropped = FileWatch(), FileWatch()
    kept.add(paths[0], "test data", 4096)
    dropped.add(paths[1], "test data", 4096)
    dropped.cycle = dropped  # collected only by the cycle collector
    del dropped
    real_read = os.read

    def read_after_a_collection(fd, n):
        gc.collect()
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", read_after_a_collection)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (kept.check(), done.set()), daemon=True)
    worker.start()
    worker.join(timeout=30)
    monkeypatch.undo()
    assert done.is_set(), "check() deadlocked in the collector's finalizer"
    kept.close()
