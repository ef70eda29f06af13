"""Everyday training-loop lines on a stage-3 model whose parameters are offloaded
(offload_params="cpu" and "nvme"), each against the same loop on plain torch over the global
batch (computed in the rank itself):

- on 2 gloo ranks: gradient accumulation under no_sync() with torch's clip_grad_norm_,
  tierlift's clip_grad_norm_, evals (no_grad, inference_mode, a block called on its own)
  between steps, load_full_state_dict and model.load_state_dict mid-training, an edit inside
  gathered(modifier_rank=0), torch.amp.GradScaler with an inf on one rank, an AveragedModel
  (EMA) built before shard(), full_state_dict every step; checkpoints saved (blocking and in
  the background) while training goes on;
- in this process: those checkpoints, written by the ranks that have since exited, resumed
  into a model offloaded to the other kind (cpu -> nvme, nvme -> cpu, and -> none);
- the NVMe files under a running job: deleted (the mapping keeps them: training goes on,
  exact), cut short (an OSError naming the file at the next gather or step, before the step
  writes anything; it was a SIGBUS that killed the process); a drive without fallocate
  that is full (refused at shard(), nothing left behind; it was a SIGBUS mid-step)."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from zero_model import batches, make_model, spawn_ranks

import tierlift
from tierlift.offload import tiers

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

TESTS = os.path.dirname(os.path.abspath(__file__))
STEPS, BATCH = 4, 8
OPT = dict(lr=1e-2, weight_decay=0.1)
KINDS = ("cpu", "nvme")
IDIOMS = ("accumulate_torch_clip", "tierlift_clip", "evals", "load_full_state_dict",
          "load_state_dict", "gathered_edit", "grad_scaler", "ema", "full_state_dict")
TOL = 1e-5  # 2 ranks sum their halves in another order than one process over the batch


def _loss(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def _shard_kw(kind: str, folder: str) -> dict:
    if kind == "nvme":
        os.makedirs(folder, exist_ok=True)
        return dict(offload_params="nvme", nvme_path=folder)
    return dict(offload_params=kind)


def _train(model, opt, data, idiom, *, zero, world=1, rank=0, ema=None, scaler=None):
    for i, seq in enumerate(data):
        x = seq.chunk(world)[rank] if zero else seq
        opt.zero_grad()
        if idiom == "accumulate_torch_clip":
            first, second = x.chunk(2)
            with model.no_sync() if zero else torch.enable_grad():
                (_loss(model, first) / 2).backward()
            (_loss(model, second) / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif idiom == "grad_scaler":
            scaler.scale(_loss(model, x)).backward()
            if i == 1 and rank == 0:  # an overflow on one rank: every rank skips the step
                next(p.grad for p in model.parameters() if p.grad is not None).view(-1)[0] = \
                    float("inf")
            scaler.unscale_(opt)
            if zero:
                tierlift.zero.clip_grad_norm_(model, 0.05)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        else:
            _loss(model, x).backward()
        if idiom == "tierlift_clip":
            if zero:
                tierlift.zero.clip_grad_norm_(model, 0.05)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if ema is not None:
            ema.update_parameters(model)
        if idiom == "evals":
            with torch.no_grad():
                model(x[:, :-1])
                model.blocks[1](torch.randn(2, 8, 20, generator=torch.Generator().manual_seed(i)))
            with torch.inference_mode():
                model(x[:, :-1])
        if idiom == "full_state_dict" and zero:
            tierlift.zero.full_state_dict(model)
        if i == 1 and idiom in ("load_full_state_dict", "load_state_dict"):
            new = make_model(seed=5).state_dict()
            if zero and idiom == "load_full_state_dict":
                tierlift.zero.load_full_state_dict(model, new)
            else:
                model.load_state_dict(new)
        if i == 1 and idiom == "gathered_edit":
            with tierlift.zero.gathered(model, modifier_rank=0) if zero else torch.no_grad():
                with torch.no_grad():
                    model.blocks[0].fc.weight.mul_(0.5)
                    model.tok.weight.add_(0.01)


def _run(idiom, data, *, kind=None, folder=None, world=1, rank=0):
    model = make_model()
    # use_buffers=True: with the default, torch's buffer copy zips the copy's buffers with
    # none from a sharded model and raises
    ema = (AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
           if idiom == "ema" else None)
    zero = kind is not None
    if zero:
        model = tierlift.zero.shard(model, stage=3, **_shard_kw(kind, folder))
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if idiom == "grad_scaler" \
        else None
    _train(model, opt, data, idiom, zero=zero, world=world, rank=rank, ema=ema, scaler=scaler)
    sd = tierlift.zero.full_state_dict(model) if zero else \
        {k: v.detach().clone() for k, v in model.state_dict().items()}
    if ema is not None:
        sd |= {f"ema.{k}": v.detach().clone() for k, v in ema.module.state_dict().items()}
    del model, opt, ema
    gc.collect()  # a sharded model left to the collector takes part in the next ones' calls
    return sd


def _max_abs(sd: dict, ref: dict) -> float:
    assert sd.keys() == ref.keys()
    return max(float((sd[k] - ref[k]).abs().max()) for k in ref if ref[k].is_floating_point())


def _checkpoints(rank, world, tmp, data) -> None:
    """Saves after 2 steps (cpu: blocking, nvme: in the background, training on while it
    writes), then trains 2 more steps."""
    for kind in KINDS:
        model = tierlift.zero.shard(make_model(), stage=3,
                                    **_shard_kw(kind, f"{tmp}/ck_params{rank}"))
        opt = torch.optim.AdamW(model.parameters(), **OPT)
        _train(model, opt, data[:2], "plain", zero=True, world=world, rank=rank)
        handle = tierlift.checkpoint.save(f"{tmp}/ckpt_{kind}", model, opt,
                                          blocking=kind == "cpu")
        _train(model, opt, data[2:], "plain", zero=True, world=world, rank=rank)
        if handle is not None:
            handle.wait()
        del model, opt, handle
        gc.collect()


def _cases(rank, world, tmp) -> dict:
    torch.set_num_threads(1)
    data = batches(STEPS, BATCH)
    out = {}
    for idiom in IDIOMS:
        ref = _run(idiom, data)
        for kind in KINDS:
            sd = _run(idiom, data, kind=kind, folder=f"{tmp}/params{rank}", world=world,
                      rank=rank)
            out[idiom, kind] = _max_abs(sd, ref)
    _checkpoints(rank, world, tmp, data)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("param_offload_idioms"))
    return tmp, spawn_ranks(_cases, tmp)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("idiom", IDIOMS)
def test_idiom_matches_plain_torch(ranks, idiom, kind):
    for out in ranks[1]:
        assert out[idiom, kind] < TOL, out[idiom, kind]


@pytest.mark.parametrize("src,dst", [("cpu", "nvme"), ("nvme", "cpu"), ("nvme", "none"),
                                     ("cpu", "none")])
def test_checkpoint_resumes_into_the_other_kind_in_a_fresh_process(ranks, tmp_path, src, dst):
    torch.set_num_threads(1)
    data = batches(STEPS, BATCH)
    ref = _run("plain", data)
    model = tierlift.zero.shard(make_model(seed=3), stage=3, **_shard_kw(dst, str(tmp_path)))
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    tierlift.checkpoint.load(f"{ranks[0]}/ckpt_{src}", model, opt)  # saved on 2 ranks
    _train(model, opt, data[2:], "plain", zero=True)
    assert _max_abs(tierlift.zero.full_state_dict(model), ref) < TOL


# ---- the NVMe files under a running job ---------------------------------------------------------
# In a subprocess: without the checks, touching a cut-short file through the mapping is a SIGBUS.
UNDER_A_RUNNING_JOB = textwrap.dedent("""
    import errno, os, sys, tempfile, warnings
    sys.path.insert(0, {tests!r})
    import torch, torch.nn.functional as F
    import tierlift
    from tierlift.zero import param_nvme
    from zero_model import batches, make_model
    torch.set_num_threads(1)
    data = batches(3, 4)

    def loss(m, x):
        return F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    def start(direct=True):
        if not direct:
            param_nvme.direct_io_error = lambda path: OSError(errno.EINVAL, "Invalid argument")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = tierlift.zero.shard(make_model(), stage=3, offload_params="nvme",
                                    nvme_path=tempfile.mkdtemp())
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        opt.zero_grad(); loss(m, data[0]).backward(); opt.step()
        return m, opt, m._tierlift_zero.offload.store

    def snapshot(opt):
        return [(int(s["step"]), s["exp_avg"].clone()) for s in opt.state.values()]

    def refused(fn, path):
        try:
            fn()
        except OSError as e:
            assert e.errno == errno.EIO and path in str(e) and "cut short" in str(e), e
            return
        raise AssertionError("no error")

    for which in ("path", "grad_path"):
        # Cut short between backward and step: refused before the step writes anything.
        m, opt, store = start()
        opt.zero_grad(); loss(m, data[1]).backward()
        before = snapshot(opt)
        os.truncate(getattr(store, which), store.nbytes // 2)
        refused(opt.step, getattr(store, which))
        after = snapshot(opt)
        assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(before, after))
        print("step refused", which)
    for direct in (True, False):
        # Cut short between steps: the next gather is refused (through the mapping too).
        m, opt, store = start(direct)
        os.truncate(store.path, store.nbytes // 2)
        opt.zero_grad()
        refused(lambda: loss(m, data[1]), store.path)
        print("gather refused", direct)
    # Cut short: full weights and checkpoints are refused too, not read through the mapping.
    m, opt, store = start()
    os.truncate(store.path, store.nbytes // 2)
    refused(lambda: tierlift.zero.full_state_dict(m), store.path)
    refused(lambda: tierlift.checkpoint.save(tempfile.mkdtemp() + "/ck", m, opt), store.path)
    print("full weights refused")
    # Deleted: the mapping keeps the file; training goes on, the same as with it.
    got = []
    for delete in (False, True):
        m, opt, store = start()
        if delete:
            os.remove(store.path); os.remove(store.grad_path)
        for x in data[1:]:
            opt.zero_grad(); loss(m, x).backward(); opt.step()
        got.append(tierlift.zero.full_state_dict(m))
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0])
    print("deleted goes on")
""")


def test_nvme_files_cut_short_or_deleted_under_a_running_job():
    run = subprocess.run([sys.executable, "-c", UNDER_A_RUNNING_JOB.format(tests=TESTS)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]  # -7: SIGBUS
    assert run.stdout.split("\n")[:-1] == [
        "step refused path", "step refused grad_path", "gather refused True",
        "gather refused False", "full weights refused", "deleted goes on"]


def test_full_drive_without_fallocate_is_refused_at_shard(tmp_path, monkeypatch):
    real_pwrite = os.pwrite

    def sparse(fd, nbytes, path, total):  # a file system without fallocate: a sparse file
        os.ftruncate(fd, nbytes)

    monkeypatch.setattr(tiers, "_reserve", sparse)
    # Room: both files get their blocks at shard() (a write through the mapping into a hole
    # of a full drive is a SIGBUS mid-step).
    model = tierlift.zero.shard(make_model(), stage=3, offload_params="nvme", nvme_path=tmp_path)
    store = model._tierlift_zero.offload.store
    for path in (store.path, store.grad_path):
        assert os.stat(path).st_blocks * 512 >= store.nbytes
    tierlift.zero.close(model)
    del model, store

    def full(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="no room for the parameter and gradient shards") as info:
        tierlift.zero.shard(make_model(), stage=3, offload_params="nvme", nvme_path=tmp_path)
    assert info.value.errno == errno.ENOSPC
    assert [n for n in os.listdir(tmp_path) if n.startswith(tiers.DIR_PREFIX)] == []
