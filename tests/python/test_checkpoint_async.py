"""Background saves (save(blocking=False)): training steps on while the files are written and
the checkpoint is still the state at the save, bit for bit (plain and ZeRO-3, optimizer state
in RAM, in host tiers and on NVMe, 2 gloo ranks loaded on 1); a failing write surfaces at
wait(), the next save or close() with the previous checkpoint intact; kill -9 in the middle
leaves the previous one loadable; small budgets stream; bad budgets and busy paths are refused.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from zero_model import batches, free_port, init_gloo, make_model, shutdown, train

import tierlift
from tierlift.checkpoint import staging as ckpt_staging
from tierlift.checkpoint import writer as ckpt_writer
from tierlift.offload import tiers

ROOT = Path(__file__).resolve().parents[2]
OPT = dict(lr=3e-3, weight_decay=0.1)
DATA = batches(6, 8, seed=3)
TIERS = {
    "ram": {},
    "cpu": dict(offload="cpu"),
    "cpu-overlap": dict(offload="cpu", overlap=True),
    "nvme": dict(offload="nvme", cpu_budget=1 << 20),
    "hybrid": dict(offload="hybrid", cpu_budget=300_000),  # 9 of 22 chunks in RAM
    "hybrid-1gen": dict(offload="hybrid", cpu_budget=300_000, nvme_generations=1),
    "nvme-1gen": dict(offload="nvme", cpu_budget=1 << 20, nvme_generations=1),
}
HELD = ("cpu-overlap", "nvme", "hybrid", "hybrid-1gen", "nvme-1gen")  # held by a save, not copied
# Chunks rewritten in place (a hybrid's RAM part, one NVMe generation): the very next step
# writes into the held chunks, so it waits for the writer.
IN_PLACE = ("hybrid", "hybrid-1gen", "nvme-1gen")


def _fresh(tmp, tier: str, zero: bool):
    model = make_model(seed=5)
    if zero:
        model = tierlift.zero.shard(model, stage=3)
    kw = dict(TIERS[tier])
    if kw.get("offload") in ("nvme", "hybrid"):
        kw["nvme_path"] = str(tmp)
    return model, tierlift.optim.AdamW(model.parameters(), **OPT, **kw)


def _train(model, opt, data, zero):
    return train(model, opt, data, accum=1, clip=None if zero else 1.0, zero=zero)


def _state(ck, tmp, tier, zero):
    """Weights and optimizer state of checkpoint `ck`, loaded into a fresh model."""
    model, opt = _fresh(tmp, tier, zero)
    extra = tierlift.checkpoint.load(ck, model, opt)
    sd = tierlift.zero.full_state_dict(model) if zero else model.state_dict()
    out = {f"w.{k}": v.clone() for k, v in sd.items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    opt.close() if hasattr(opt, "close") else None
    return out, extra


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class Gate:
    """Holds the writer before its first piece until open(), and before it reads a held
    generation until a training step tries to write into that generation: training steps
    meanwhile, and that write must wait for the save to read the chunk (without the wait, the
    save reads the new state and fails its CRC check or saves the wrong step)."""

    def __init__(self, monkeypatch):
        self.event, self.blocked = threading.Event(), threading.Event()
        write, write_held = ckpt_writer.Writer._write, ckpt_writer.Writer._write_held
        wait_unheld = tiers._Holdable._wait_unheld

        def gated(writer, piece):
            self.event.wait(60)
            return write(writer, piece)

        def late(writer, held):
            self.event.wait(60)
            self.blocked.wait(30)
            return write_held(writer, held)

        def watched(tier, ci, gen):
            if any(h.blocks(ci, gen) for h in list(tier.holds)):
                self.blocked.set()
            return wait_unheld(tier, ci, gen)

        monkeypatch.setattr(ckpt_writer.Writer, "_write", gated)
        monkeypatch.setattr(ckpt_writer.Writer, "_write_held", late)
        monkeypatch.setattr(tiers._Holdable, "_wait_unheld", watched)

    def open(self):
        self.event.set()


@pytest.mark.parametrize("zero", [False, True], ids=["plain", "zero3"])
@pytest.mark.parametrize("tier", list(TIERS))
def test_training_on_during_the_write_leaves_the_snapshot_exact(tmp_path, monkeypatch, tier,
                                                                zero):
    model, opt = _fresh(tmp_path, tier, zero)
    _train(model, opt, DATA[:2], zero)
    sync, bg = str(tmp_path / "sync"), str(tmp_path / "bg")
    tierlift.checkpoint.save(sync, model, opt, extra={"step": 2})
    gate = Gate(monkeypatch)
    h = tierlift.checkpoint.save(bg, model, opt, extra={"step": 2}, blocking=False)
    assert isinstance(h, tierlift.checkpoint.SaveHandle)
    assert not h.done()
    if tier not in IN_PLACE:  # (there, it would wait for the gated writer)
        _train(model, opt, DATA[2:3], zero)  # changes weights and state while nothing is written
    gate.open()
    _train(model, opt, DATA[3:5], zero)  # writes into the held generation wait for it
    h.wait()
    assert h.done() and h.stall_s <= h.total_s and h.bytes > 0
    assert not os.path.exists(bg + ".tmp")
    a, extra_a = _state(bg, tmp_path, tier, zero)
    b, extra_b = _state(sync, tmp_path, tier, zero)
    assert extra_a == extra_b == {"step": 2}
    _assert_same(a, b)
    waited = sum(t.held_wait_s for t in opt._offload.tiers) if tier in HELD else 0.0
    assert (waited > 0) == (tier in HELD), waited


def test_a_small_budget_streams_in_pieces_and_stays_within_it(tmp_path):
    model, opt = _fresh(tmp_path, "nvme", False)
    _train(model, opt, DATA[:2], False)
    budget = 256 << 10
    h = tierlift.checkpoint.save(tmp_path / "ck", model, opt, blocking=False,
                                 staging_budget=budget)
    h.wait()
    assert 0 < h.staging_peak <= budget < h.bytes
    tierlift.checkpoint.save(tmp_path / "ref", model, opt)
    _assert_same(_state(str(tmp_path / "ck"), tmp_path, "nvme", False)[0],
                 _state(str(tmp_path / "ref"), tmp_path, "nvme", False)[0])


def test_a_budget_below_one_piece_is_refused_with_the_smallest_that_works(tmp_path):
    model, opt = _fresh(tmp_path, "nvme", False)
    _train(model, opt, DATA[:1], False)
    chunk = opt._offload.chunk_elems * 4
    with pytest.raises(ValueError, match=f"smallest budget that works is {chunk} bytes"):
        tierlift.checkpoint.save(tmp_path / "ck", model, opt, blocking=False,
                                 staging_budget=chunk - 4096)
    assert not os.path.exists(tmp_path / "ck.tmp")
    tierlift.checkpoint.save(tmp_path / "ck", model, opt, blocking=False,
                             staging_budget=chunk).wait()


def _failing_engine(monkeypatch, after: int, code: int):
    """The writer's engine fails every write from its `after`-th on with `code` (a full
    drive, a dying one) until the test undoes it."""
    real = ckpt_writer.engine()
    calls = [0]

    class Failing:
        def __getattr__(self, name):
            return getattr(real, name)

        def write(self, tensor, path, offset=0):
            calls[0] += 1
            if calls[0] >= after:
                raise OSError(code, f"injected: {os.strerror(code)}", path)
            return real.write(tensor, path, offset)

    monkeypatch.setattr(ckpt_writer, "engine", lambda: Failing())
    return calls


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["full", "eio"])
@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_a_failed_background_write_surfaces_and_keeps_the_previous_checkpoint(
        tmp_path, monkeypatch, tier, code):
    model, opt = _fresh(tmp_path, tier, False)
    _train(model, opt, DATA[:2], False)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    before, _ = _state(ck, tmp_path, tier, False)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _failing_engine(monkeypatch, 3, code)
    # at wait()
    h = tierlift.checkpoint.save(ck, model, opt, extra={"step": 3}, blocking=False)
    with pytest.raises(OSError, match="injected"):
        h.wait()
    h.wait()  # reported once
    _assert_same(_state(ck, tmp_path, tier, False)[0], before)
    assert not os.path.exists(ck + ".tmp")
    _assert_same(model.state_dict(), weights)  # a failed save touches no training state
    # at the next save, which then does not start
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 4}, blocking=False)
    with pytest.raises(OSError, match="injected"):
        tierlift.checkpoint.save(ck, model, opt, extra={"step": 5}, blocking=False)
    # at close()
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 6}, blocking=False)
    with pytest.raises(OSError, match="injected"):
        tierlift.checkpoint.close()
    assert tierlift.checkpoint.load(ck, *_fresh(tmp_path, tier, False)) == {"step": 2}
    monkeypatch.undo()
    _train(model, opt, DATA[2:3], False)  # training goes on, then a save succeeds
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 3}, blocking=False).wait()
    assert tierlift.checkpoint.load(ck, *_fresh(tmp_path, tier, False)) == {"step": 3}


_KILLED = r"""
import os, signal, sys, threading
sys.path.insert(0, sys.argv[2])
import torch, tierlift
from tierlift.checkpoint import writer
from zero_model import batches, make_model, train
root = sys.argv[1]
model = make_model(seed=5)
opt = tierlift.optim.AdamW(model.parameters(), lr=3e-3, offload="nvme", nvme_path=root,
                           cpu_budget=1 << 20)
data = batches(3, 8, seed=3)
train(model, opt, data[:2], accum=1, clip=None)
ck = os.path.join(root, "ck")
tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
original = writer.Writer._submit
count = [0]
def submit(self, buf, runs):
    count[0] += 1
    if count[0] == 4:  # some files of the new save are on the drive, others not
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, buf, runs)
writer.Writer._submit = submit
train(model, opt, data[2:], accum=1, clip=None)
tierlift.checkpoint.save(ck, model, opt, extra={"step": 3}, blocking=False).wait()
"""


def test_kill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path),
                          str(ROOT / "tests" / "python")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert out.returncode == -9, out.stderr[-2000:]
    ck = str(tmp_path / "ck")
    assert os.path.isdir(ck + ".tmp")  # the killed save's files
    model, opt = _fresh(tmp_path, "nvme", False)
    assert tierlift.checkpoint.load(ck, model, opt) == {"step": 2}
    # the dead process's directory does not block the next save
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 9}, blocking=False).wait()
    assert tierlift.checkpoint.load(ck, *_fresh(tmp_path, "nvme", False)) == {"step": 9}


@pytest.mark.parametrize("zero", [False, True], ids=["plain", "zero3"])
@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_a_load_of_the_path_being_saved_waits_for_the_save(tmp_path, monkeypatch, tier, zero):
    """load() (and full_state_dict()) of the path this process's background save is writing
    returned the checkpoint before it, without a word; they wait for the save to commit."""
    model, opt = _fresh(tmp_path, tier, zero)
    ck, ref = str(tmp_path / "ck"), str(tmp_path / "ref")
    _train(model, opt, DATA[:2], zero)
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    _train(model, opt, DATA[2:4], zero)
    tierlift.checkpoint.save(ref, model, opt, extra={"step": 4})
    gate = threading.Event()
    write = ckpt_writer.Writer._write
    monkeypatch.setattr(ckpt_writer.Writer, "_write",
                        lambda writer, piece: (gate.wait(60), write(writer, piece))[1])
    h = tierlift.checkpoint.save(ck + "/", model, opt, blocking=False, extra={"step": 4})
    threading.Timer(0.3, gate.set).start()
    try:
        _assert_same(tierlift.checkpoint.full_state_dict(ck),
                     tierlift.checkpoint.full_state_dict(ref))
        assert h.done()
        got, extra = _state(ck, tmp_path, tier, zero)
        assert extra == {"step": 4}
        _assert_same(got, _state(ref, tmp_path, tier, zero)[0])
    finally:
        gate.set()
        h.wait()
        opt.close() if hasattr(opt, "close") else None


def test_a_path_another_live_save_is_writing_is_refused(tmp_path):
    model, opt = _fresh(tmp_path, "ram", False)
    ck = tmp_path / "ck"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.makedirs(f"{ck}.tmp")
        from tierlift.offload.tiers import _start_time
        with open(f"{ck}.tmp/.owner.json", "w") as f:
            f.write(f'{{"pid": {other.pid}, "start_time": {_start_time(other.pid)}}}')
        with pytest.raises(RuntimeError, match="being written by another save"):
            tierlift.checkpoint.save(ck, model, opt, blocking=False)
        assert os.path.isdir(f"{ck}.tmp")  # the other save's files are left alone
    finally:
        other.kill()
        other.wait()
    tierlift.checkpoint.save(ck, model, opt, blocking=False).wait()  # its owner is gone


def test_a_snapshot_error_is_raised_by_save_itself(tmp_path):
    model, opt = _fresh(tmp_path, "ram", False)
    with pytest.raises(TypeError, match="JSON"):
        tierlift.checkpoint.save(tmp_path / "ck", model, opt, extra={"x": object()},
                                 blocking=False)
    tierlift.checkpoint.close()  # the ranks' vote on it ran in the background: reported once
    assert not os.path.exists(tmp_path / "ck.tmp") and not os.path.exists(tmp_path / "ck")
    tierlift.checkpoint.save(tmp_path / "ck", model, opt, blocking=False).wait()


# ---- 2 gloo ranks: a background save equals a blocking one, and loads on 1 rank -------------
def _two_ranks(rank, world, port, root, tier):
    init_gloo(rank, world, port)
    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = _fresh(nvme, tier, True)
    kw = dict(accum=1, clip=1.0, world=world, rank=rank, zero=True)
    train(model, opt, DATA[:2], **kw)
    tierlift.checkpoint.save(os.path.join(root, "sync"), model, opt, extra={"step": 2})
    h = tierlift.checkpoint.save(os.path.join(root, "bg"), model, opt, extra={"step": 2},
                                 blocking=False)
    train(model, opt, DATA[2:5], **kw)  # collectives on the training group meanwhile
    h.wait()
    opt.close() if hasattr(opt, "close") else None
    shutdown()


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_two_ranks_background_save_loads_on_one_as_the_blocking_one(tmp_path, tier):
    mp.spawn(_two_ranks, args=(2, free_port(), str(tmp_path), tier), nprocs=2)
    torch.set_num_threads(1)
    a, extra = _state(str(tmp_path / "bg"), tmp_path, tier, True)
    b, _ = _state(str(tmp_path / "sync"), tmp_path, tier, True)
    assert extra == {"step": 2}
    _assert_same(a, b)


@pytest.mark.gpu
def test_gpu_tensors_are_snapshotted_before_the_next_kernel_changes_them(tmp_path):
    """The device-to-host copies into pinned staging are queued on the current stream, so a
    kernel queued after save() returns cannot change what is written."""
    model = make_model(seed=5).cuda()
    opt = tierlift.optim.AdamW(model.parameters(), **OPT)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    h = tierlift.checkpoint.save(tmp_path / "ck", model, opt, blocking=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # queued behind the copies
    h.wait()
    fresh = make_model(seed=6).cuda()
    tierlift.checkpoint.load(tmp_path / "ck", fresh, None)
    _assert_same({k: v.cpu() for k, v in fresh.state_dict().items()}, before)


class FakeEvent:
    """A CUDA event that logs where it was recorded and which thread waited for it."""

    def __init__(self, log):
        self.log, self.device = log, None

    def record(self, stream):
        self.device = stream  # FakeCurrentStream below: the stream is its device
        self.log.append(("record", stream))

    def synchronize(self):
        self.log.append(("wait", self.device, threading.current_thread().name))


@pytest.mark.parametrize("budget", [None, 1 << 16], ids=["whole", "streamed"])
def test_save_waits_for_the_copies_from_every_device_before_it_returns(tmp_path, monkeypatch,
                                                                       budget):
    """The bookkeeping of GPU snapshots, on CPU tensors that pose as on two GPUs: a copy is
    queued on the current stream of its tensor's device, so every piece gets an event on each
    device it read, the writer waits for them all, and save() waits for the last of each device
    before it returns (only then may training change the tensors on any stream)."""
    model = make_model(seed=5)
    opt = tierlift.optim.AdamW(model.parameters(), **OPT)
    _train(model, opt, DATA[:1], False)
    second = {t.data_ptr() for t in model.blocks[-1].state_dict().values()}
    log: list = []
    monkeypatch.setattr(ckpt_staging, "_cuda_device", lambda t: torch.device(
        "cuda", 1 if t.data_ptr() in second else 0))
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    h = tierlift.checkpoint.save(tmp_path / "ck", model, None, blocking=False,
                                 staging_budget=budget)
    me = threading.current_thread().name
    devices = {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert {e[1] for e in log if e[0] == "record"} == devices
    assert {e[1] for e in log if e[0] == "wait" and e[2] == me} == devices  # settled
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    h.wait()
    recorded = [e[1] for e in log if e[0] == "record"]
    by_writer = [e[1] for e in log if e[0] == "wait" and e[2] == "tierlift-checkpoint"]
    assert sorted(by_writer, key=str) == sorted(recorded, key=str)  # each piece's events
    fresh = make_model(seed=6)
    tierlift.checkpoint.load(tmp_path / "ck", fresh, None)
    _assert_same(fresh.state_dict(), before)


@pytest.mark.gpu
def test_gpu_tensors_are_snapshotted_before_a_kernel_on_another_stream_changes_them(tmp_path):
    """save() returns once its device-to-host copies are done: a kernel on another stream, queued
    right after save() while the copies still wait behind earlier work on the current stream,
    cannot change what is written (before, it ran first and the checkpoint held its result)."""
    model = make_model(seed=5).cuda()
    opt = tierlift.optim.AdamW(model.parameters(), **OPT)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    torch.cuda._sleep(1 << 30)  # the current stream busy for about half a second
    h = tierlift.checkpoint.save(tmp_path / "ck", model, opt, blocking=False)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # waits for nothing on the current stream
    torch.cuda.synchronize()
    h.wait()
    fresh = make_model(seed=6).cuda()
    tierlift.checkpoint.load(tmp_path / "ck", fresh, None)
    _assert_same({k: v.cpu() for k, v in fresh.state_dict().items()}, before)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensors_on_a_second_gpu_are_written_after_their_copies_land(tmp_path):
    """A tensor on cuda:1 is copied on cuda:1's stream: the writer waits for an event there, not
    on the current device's stream (where the copy is not), or it writes the staging buffer's
    old bytes."""
    model = make_model(seed=5).cuda(0)
    model.blocks[-1].to("cuda:1")
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    with torch.cuda.device(1):
        torch.cuda._sleep(1 << 30)  # the copies from cuda:1 land about half a second late
    tierlift.checkpoint.save(tmp_path / "ck", model, None)
    fresh = make_model(seed=6)
    tierlift.checkpoint.load(tmp_path / "ck", fresh, None)
    _assert_same(fresh.state_dict(), before)


def _rank_lost(rank, world, port, root):
    init_gloo(rank, world, port, timeout_s=20)
    model, opt = _fresh(root, "ram", True)
    train(model, opt, DATA[:1], accum=1, clip=None, world=world, rank=rank, zero=True)
    ck = os.path.join(root, "ck")
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 1})
    h = tierlift.checkpoint.save(ck, model, opt, extra={"step": 2}, blocking=False)
    if rank == 1:
        os._exit(0)  # gone before it votes
    with pytest.raises(Exception) as info:  # gloo's error for the lost peer
        h.wait()
    assert any("as it was before this save" in n for n in info.value.__notes__)
    with open(os.path.join(root, "rank0.ok"), "w") as f:
        f.write("ok")
    os._exit(0)  # the process group cannot be shut down cleanly without rank 1


def test_a_rank_lost_during_a_background_save_fails_it_on_the_others(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_lost, args=(r, 2, port, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert (tmp_path / "rank0.ok").exists()
    meta = tierlift.checkpoint.format.read_metadata(str(tmp_path / "ck"))
    assert meta["extra"] == {"step": 1} and meta["world_size"] == 2


def test_the_votes_group_is_made_again_after_the_process_group_is_destroyed(tmp_path):
    """A background save's vote group cached by the ranks' tuple outlived
    destroy_process_group(): a save in the next process group voted over the destroyed one
    (its processes may hold other ranks there)."""
    script = f"""
import torch.distributed as dist
from tierlift.checkpoint import background as bg
for i in range(2):
    dist.init_process_group("gloo", init_method="file://{tmp_path}/pg" + str(i), rank=0,
                            world_size=1)
    g = bg.side_group(dist.group.WORLD)
    assert g in dist.distributed_c10d._world.pg_map, i
    dist.barrier(group=g)
    dist.destroy_process_group()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
