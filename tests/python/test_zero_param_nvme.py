"""Stage-3 parameter offload to NVMe (shard(..., offload_params="nvme", nvme_path=...)).

The fp32 shards live in one mapped file per rank (zero/param_nvme.py). Checked here: weights
bit-identical to offload_params="none" with torch AdamW and with tierlift AdamW(offload="nvme",
overlap=True) in one process and under torchrun with 2 gloo ranks; checkpoints; what the
process keeps resident (RSS); bad nvme_path values; the folder's lifetime; the stats."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.nn.functional as F
from test_zero_offload import (
    CLIP,
    LR,
    WD,
    assert_close_to_torch,
    assert_same,
    data,
    fit,
    make_net,
    offload_kw,
    run_offload,
    run_plain,
    run_torch,
)
from zero_model import run_torchrun

import tierlift
from tierlift.offload import tiers
from tierlift.zero.param_nvme import NvmeParamStore

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

TESTS = os.path.dirname(os.path.abspath(__file__))
MP = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def folders(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith(tiers.DIR_PREFIX))


def run_torch_adamw(clip, *, world=1, rank=0, **shard_kw):
    model = tierlift.zero.shard(make_net(), stage=3, **shard_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    fit(model, opt, world=world, rank=rank, clip=clip)
    stats = dict(model._tierlift_zero.stats)
    stats["shard_bytes"] = sum(4 * p.numel() for p in model.parameters())
    return tierlift.zero.full_state_dict(model), stats


# ---- exactness, one process ---------------------------------------------------------------------
@pytest.mark.parametrize("mp", [None, MP], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clip", [None, CLIP])
def test_torch_adamw_is_bit_identical(tmp_path, mp, clip):
    torch.set_num_threads(1)
    sd, stats = run_torch_adamw(clip, offload_params="nvme", nvme_path=tmp_path,
                                mixed_precision=mp)
    ref, _ = run_torch_adamw(clip, mixed_precision=mp)
    assert_same(sd, ref)
    if mp is None:
        assert_close_to_torch(sd, run_torch(clip))
    # Stats: every gather read its shard from the file, every step wrote every shard.
    assert stats["nvme_read_bytes"] > 0
    assert stats["nvme_write_bytes"] == 20 * stats["shard_bytes"]
    assert stats["nvme_grad_bytes"] == 20 * stats["shard_bytes"]  # gradients went to the file
    if mp is None:  # fp32 compute: the staged bytes are the bytes read
        assert stats["nvme_read_bytes"] == stats["h2d_bytes"]
    assert folders(tmp_path) == []  # the model is gone: so is its folder


@pytest.mark.parametrize("clip", [None, CLIP])
def test_offloaded_overlapped_adamw_is_bit_identical(tmp_path, clip):
    torch.set_num_threads(1)
    params_dir = tmp_path / "params"
    params_dir.mkdir()
    sd, kept, redone, stats = run_offload(3, "nvme", clip, tmp_path, offload_params="nvme",
                                          nvme_path=str(params_dir))
    assert_same(sd, run_plain(3, clip))
    if clip is None:
        assert kept > 0 and redone == 0  # the overlap happened, on file-backed parameters
    assert stats["nvme_read_bytes"] > 0 and stats["nvme_write_bytes"] > 0


# ---- gradients in the file: accumulation, zero_grad(set_to_none=False) ---------------------------
def accumulate(model, opt, mode: str, clip, steps: int = 6) -> set:
    """Two micro-batches per step: the first under no_sync ("no_sync") or both synced
    ("synced", "in-place"; "in-place" zeroes gradients with set_to_none=False). Returns the
    ids of the gradient tensors seen after the backwards."""
    seen = set()
    for seq in data(steps):
        opt.zero_grad(set_to_none=mode != "in-place")
        for m, micro in enumerate(seq.chunk(2)):
            quiet = mode == "no_sync" and m == 0
            with model.no_sync() if quiet else contextlib.nullcontext():
                logits = model(micro[:, :-1])
                (F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten()) / 2).backward()
        seen |= {id(p.grad) for p in model.parameters()}
        if clip is not None:
            tierlift.zero.clip_grad_norm_(model, clip)
        opt.step()
    return seen


def grads_in_file(model) -> bool:
    store = model._tierlift_zero.offload.store
    lo = store._gbase.data_ptr()
    return all(lo <= p.grad.data_ptr() < lo + store.nbytes and p.grad._base is None
               for p in model.parameters())


@pytest.mark.parametrize("mode", ["no_sync", "synced", "in-place"])
def test_accumulated_gradients_in_the_file_are_bit_identical(tmp_path, mode):
    torch.set_num_threads(1)
    results = {}
    for where in ("none", "cpu", "nvme"):
        for clip in (None, CLIP):
            kw = dict(offload_params=where, nvme_path=tmp_path) if where == "nvme" else \
                dict(offload_params=where)
            model = tierlift.zero.shard(make_net(), stage=3, **kw)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
            seen = accumulate(model, opt, mode, clip)
            if where == "nvme":
                assert grads_in_file(model)
                if mode == "in-place":  # zeroed in place: the same views all along
                    assert len(seen) == len(model._tierlift_zero.units)
                store = model._tierlift_zero.offload.store
                assert store.resident_bytes(grads=True) == 0  # dropped after the step
                # A fresh view per step (the second backward accumulates into it), or one.
                shard_bytes = 4 * sum(p.numel() for p in model.parameters())
                assert model._tierlift_zero.stats["nvme_grad_bytes"] == \
                    (1 if mode == "in-place" else 6) * shard_bytes
            results[where, clip] = tierlift.zero.full_state_dict(model)
    for clip in (None, CLIP):
        assert_same(results["nvme", clip], results["none", clip])
        assert_same(results["cpu", clip], results["none", clip])


@pytest.mark.parametrize("mode", ["no_sync", "synced", "in-place"])
def test_accumulated_gradients_with_the_overlapped_nvme_optimizer(tmp_path, mode):
    torch.set_num_threads(1)
    out = {}
    for where in ("none", "nvme"):
        (tmp_path / where).mkdir()
        extra = dict(nvme_path=tmp_path / where / "p") if where == "nvme" else {}
        if extra:
            extra["nvme_path"].mkdir()
        model = tierlift.zero.shard(make_net(), stage=3, offload_params=where, **extra)
        opt = tierlift.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD,
                                   max_grad_norm=CLIP,
                                   **offload_kw("nvme", model, tmp_path / where))
        accumulate(model, opt, mode, None)
        if where == "nvme":
            assert grads_in_file(model)
        out[where] = (tierlift.zero.full_state_dict(model),
                      opt.last_step_stats.get("overlap_redone_chunks", 0))
    assert_same(out["nvme"][0], out["none"][0])
    assert out["nvme"][1] == out["none"][1]  # the overlap kept as many chunks as in RAM


def test_shards_are_views_of_the_file(tmp_path):
    model = tierlift.zero.shard(make_net(), stage=3, offload_params="nvme", nvme_path=tmp_path)
    store = model._tierlift_zero.offload.store
    (name,) = folders(tmp_path)
    path = os.path.join(tmp_path, name, "params.rank0.f32")
    assert os.path.getsize(path) == store.nbytes
    assert os.path.getsize(path) % 4096 == 0
    assert sorted(os.listdir(tmp_path / name)) == ["grads.rank0.f32", "owner.json",
                                                   "params.rank0.f32"]
    assert os.path.getsize(tmp_path / name / "grads.rank0.f32") == store.nbytes
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    fit(model, opt, steps=2)
    assert store.resident_bytes() == 0  # dropped after the step
    assert store.resident_bytes(grads=True) == 0
    raw = {}
    for kind in ("params", "grads"):
        with open(tmp_path / name / f"{kind}.rank0.f32", "rb") as f:
            raw[kind] = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    for unit, off in zip(model._tierlift_zero.units, store.offsets, strict=True):
        p = unit.shard
        assert torch.equal(raw["params"][off // 4:off // 4 + p.numel()], p.detach())
        # The gradient is a view of the gradients' file, with a version counter of its own.
        g = raw["grads"][off // 4:off // 4 + p.numel()]
        assert p.grad.abs().sum() > 0 and torch.equal(g, p.grad)
        assert p.grad._base is None
        ptr = store._gbase.data_ptr()
        assert ptr <= p.grad.data_ptr() < ptr + store.nbytes
    assert store.resident_bytes() > 0  # reading the views maps the pages in again
    assert store.resident_bytes(grads=True) > 0
    del model, opt, store, p, unit
    gc.collect()
    assert folders(tmp_path) == []


# ---- checkpoints --------------------------------------------------------------------------------
def test_checkpoint_round_trip(tmp_path):
    torch.set_num_threads(1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = tierlift.zero.shard(make_net(), stage=3, offload_params="nvme",
                                nvme_path=tmp_path / "a")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    fit(model, opt, steps=3)
    tierlift.checkpoint.save(tmp_path / "ckpt", model, opt)
    fit(model, opt, steps=2)
    want = tierlift.zero.full_state_dict(model)
    fresh = tierlift.zero.shard(make_net(), stage=3, offload_params="nvme",
                                nvme_path=tmp_path / "b")
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR, weight_decay=WD)
    tierlift.checkpoint.load(tmp_path / "ckpt", fresh, fresh_opt)
    fit(fresh, fresh_opt, steps=2)
    assert_same(tierlift.zero.full_state_dict(fresh), want)
    # And into a model without parameter offload.
    plain = tierlift.zero.shard(make_net(), stage=3)
    tierlift.checkpoint.load(tmp_path / "ckpt", plain)
    ckpt = tierlift.checkpoint.full_state_dict(str(tmp_path / "ckpt"))
    assert_same(tierlift.zero.full_state_dict(plain), ckpt)


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,exc,match", [
    (dict(offload_params="nvme"), ValueError, "offload_params='nvme' needs nvme_path="),
    (dict(offload_params="cpu", nvme_path="/tmp"), ValueError,
     "nvme_path is only used with offload_params='nvme'"),
    (dict(stage=2, offload_params="nvme", nvme_path="/tmp"), ValueError,
     "offload_params='nvme' needs stage=3"),
    (dict(offload_params="nvme", nvme_path=3), TypeError, "nvme_path must be a directory path"),
])
def test_bad_arguments(kw, exc, match):
    kw = dict(dict(stage=3), **kw)
    with pytest.raises(exc, match=match):
        tierlift.zero.shard(make_net(), **kw)


def test_missing_or_unwritable_nvme_path(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="is not an existing directory"):
        tierlift.zero.shard(make_net(), offload_params="nvme", nvme_path=tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not an existing directory"):
        tierlift.zero.shard(make_net(), offload_params="nvme", nvme_path=tmp_path / "file")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() == 0:  # root writes anyway: have the kernel refuse the folder instead
        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(PermissionError, match="not writable|cannot create the parameter folder"):
        tierlift.zero.shard(make_net(), offload_params="nvme", nvme_path=ro)
    assert os.listdir(ro) == []


def test_too_small_a_drive_is_refused_with_the_bytes_needed(tmp_path, monkeypatch):
    # The real fallocate path: a store far larger than any drive (parameters + gradients).
    huge = 1 << 50
    with pytest.raises(OSError, match=rf"no room for the parameter and gradient shards: "
                                      rf"{huge * 8} bytes are needed \({huge * 4} for"):
        NvmeParamStore(nvme_path=tmp_path, shard_numels=[huge])
    assert os.listdir(tmp_path) == []
    # Through shard(), with the allocation failing as on a full drive: for the parameters'
    # file, or only for the gradients' one (room for the parameters alone is not enough).
    probe = tierlift.zero.shard(make_net(), stage=3)
    need = NvmeParamStore.layout([u.shard_numel for u in probe._tierlift_zero.units])[1]
    real = tiers._reserve
    for fail_on in ("params", "grads"):
        def full(fd, nbytes, path, total, fail_on=fail_on):
            if os.path.basename(path).startswith(fail_on):
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, nbytes, path, total)

        monkeypatch.setattr(tiers, "_reserve", full)
        with pytest.raises(OSError, match=rf"{2 * need} bytes are needed \({need} for the fp32 "
                                          rf"shards and {need} for the fp32 gradient") as info:
            tierlift.zero.shard(make_net(), offload_params="nvme", nvme_path=tmp_path)
        assert info.value.errno == errno.ENOSPC
        assert fail_on in str(info.value)
        assert os.listdir(tmp_path) == []


# ---- folder lifetime ----------------------------------------------------------------------------
KILLED = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    import tierlift
    from test_zero_offload import make_net
    model = tierlift.zero.shard(make_net(), offload_params="nvme", nvme_path={path!r})
    os._exit(0)  # like SIGKILL: no finalizer runs
""")


def test_a_killed_run_leaves_a_folder_the_next_run_removes(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(TESTS, "..", "..", "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", KILLED.format(tests=TESTS, path=str(tmp_path))],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (stale,) = folders(tmp_path)
    with pytest.warns(RuntimeWarning, match="removed 1 state folder"):
        model = tierlift.zero.shard(make_net(), offload_params="nvme", nvme_path=tmp_path)
    assert stale not in folders(tmp_path) and len(folders(tmp_path)) == 1
    model._tierlift_zero.offload.store.close()  # explicit removal
    assert folders(tmp_path) == []


# ---- resident memory ----------------------------------------------------------------------------
RSS = textwrap.dedent("""
    import gc, json, sys, torch
    from torch import nn
    import tierlift
    torch.set_num_threads(2)

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

    gc.collect()
    rss_before_model = status("VmRSS")
    torch.manual_seed(0)
    dim, blocks = 1024, 32
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
                            for _ in range(blocks)])
    n = sum(p.numel() for p in model.parameters())
    model = tierlift.zero.shard(model, stage=3, offload_params="nvme", nvme_path={path!r},
                                units=list(model))
    store = model._tierlift_zero.offload.store
    largest = 4 * max(u.shard_numel for u in model._tierlift_zero.units)
    gc.collect()
    shard_growth = status("VmRSS") - rss_before_model
    budget = 0
    if {opt!r} == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:  # the overlapped offload optimizer, its state on NVMe with a RAM budget of 2 units
        budget = 2 * 12 * n // blocks
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="nvme", overlap=True,
                                   nvme_path={path!r}, cpu_budget=budget)
    x = torch.randn(4, dim)
    model(x).square().mean().backward()  # a first step: code pages, allocator pools
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    base_rss, base_file, base_anon = status("VmRSS"), status("RssFile"), status("RssAnon")
    samples, anon = [], []
    def sample(*args):
        samples.append((status("RssFile") - base_file, store.resident_bytes()))
        anon.append(status("RssAnon") - base_anon)
    for m in model:
        m.register_forward_pre_hook(sample)
        m.register_forward_hook(sample)
        m.register_full_backward_pre_hook(sample)
        m.register_full_backward_hook(sample)
    peaks, step_peaks, after = [], [], []
    for step in range(1):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        model(x).square().mean().backward()
        peaks.append(status("VmHWM") - base_rss)
        anon.append(status("RssAnon") - base_anon)  # what the step starts with
        opt.step()
        step_peaks.append(status("VmHWM") - base_rss)
        opt.zero_grad(set_to_none=True)
        samples.append((0, store.resident_bytes()))
        anon.append(status("RssAnon") - base_anon)
        after.append(status("VmRSS") - base_rss)
    print(json.dumps(dict(shard_bytes=4 * n, largest=largest, shard_growth=shard_growth,
                          budget=budget, samples=samples, anon=anon, peaks=peaks,
                          step_peaks=step_peaks, after=after,
                          stats=model._tierlift_zero.stats)))
""")


@pytest.mark.parametrize("opt", ["sgd", "overlapped-nvme-adamw"])
def test_rss_holds_the_units_in_flight_not_the_shards_or_gradients(tmp_path, opt):
    """A 268 MB model (32 units of 8.4 MB): neither the mapped shards nor the gradient shards
    stay in the process.

    Bounds: (1) building the model (268 MB in RAM) and sharding it leaves the process less
    than a quarter of the shard bytes larger; (2) at every unit boundary of forward and
    backward and after the step, the parameters' file is not mapped in (smaps Rss 0; with the
    overlapped optimizer at most the two units its worker is checking) and (SGD) the growth of
    RssFile stays under one unit; (3) the process's anonymous memory (RssAnon) at
    every unit boundary, when the step starts and after it, grows by at most 8 units (+ the
    optimizer's cpu_budget): the fp32 gradients (as many bytes as the shards, 4x that bound)
    are in the gradients' file, not in RAM; (4) with torch SGD, the peak RSS growth over
    forward + backward is at most 8 units (gathered units in flight, their gradient,
    reduce-scatter and landing buffers; before gradients went to the file it was the shard
    bytes + 1 unit). The step itself maps what it touches (torch SGD: every shard and gradient;
    the overlapped optimizer: the gradients it reads, the shards it writes): file pages the
    kernel can write back and reclaim, dropped by the step post-hook; after the step the RSS is
    back within 128 MB of where it was before forward. glibc is told to mmap every allocation
    of 1 MiB or more (MALLOC_MMAP_THRESHOLD_), so freed buffers leave the RSS at once and the
    numbers do not depend on its heap trimming."""
    env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_MMAP_THRESHOLD_=str(1 << 20),
               PYTHONPATH=os.pathsep.join([os.path.join(TESTS, "..", "..", "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", RSS.format(path=str(tmp_path), opt=opt)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    r = json.loads(proc.stdout.strip().splitlines()[-1])
    shard, unit, mib = r["shard_bytes"], r["largest"], 1 << 20
    bound = 8 * unit
    assert shard > 200 * mib and shard >= 4 * bound
    assert r["shard_growth"] < shard // 4
    assert len(r["samples"]) > 32 * 4
    for file_growth, mapped in r["samples"]:
        # The overlapped optimizer's worker reads the parameters of the chunks it steps during
        # backward (it checks what it steps from by content): the units it is on stay mapped
        # until the next hand-over unmaps them.
        assert mapped == 0 if opt == "sgd" else mapped <= 2 * unit
        # (the overlapped optimizer's worker maps the gradients it reads, and its state file)
        assert file_growth < unit or opt != "sgd"
    for a in r["anon"]:
        assert a <= bound + r["budget"]
    if opt == "sgd":
        for peak in r["peaks"]:
            assert peak <= bound
        assert r["stats"]["nvme_read_bytes"] == 2 * 2 * shard  # forward + backward, 2 steps
        assert r["stats"]["nvme_write_bytes"] == 2 * shard
    assert r["stats"]["nvme_grad_bytes"] == 2 * shard
    for rss in r["after"]:
        assert rss <= 128 * mib
    print(f"\nRSS ({opt}): shards {shard / mib:.0f} MiB, largest unit {unit / mib:.1f} MiB, "
          f"RSS growth model + shard() {r['shard_growth'] / mib:.0f} MiB, peak growth fwd+bwd "
          f"{[round(p / mib) for p in r['peaks']]} MiB, fwd+bwd+step "
          f"{[round(p / mib) for p in r['step_peaks']]} MiB, max RssAnon growth "
          f"{max(r['anon']) / mib:.1f} MiB, after step {[round(a / mib) for a in r['after']]} "
          f"MiB, max RssFile growth at unit boundaries "
          f"{max(s[0] for s in r['samples']) / mib:.1f} MiB")


@pytest.mark.gpu
def test_offload_params_nvme_on_cuda(tmp_path):
    """bf16 compute on the GPU with the fp32 shards in the mapped file, against the same run
    with the shards in pinned RAM (offload_params="cpu"): the host shards are stepped by the
    same CPU optimizer and staged through the same pinned staging and copy stream."""
    out = {}
    for op in ("cpu", "nvme"):
        kw = dict(nvme_path=tmp_path) if op == "nvme" else {}
        model = tierlift.zero.shard(make_net().cuda(), stage=3, mixed_precision=MP,
                                    offload_params=op, **kw)
        assert all(p.device.type == "cpu" for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        fit(model, opt, steps=5, device="cuda")
        torch.cuda.synchronize()
        stats = model._tierlift_zero.stats
        assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
        if op == "nvme":
            assert stats["nvme_read_bytes"] > 0
            assert model._tierlift_zero.offload.store.resident_bytes() == 0
        out[op] = {k: v.float().cpu() for k, v in tierlift.zero.full_state_dict(model).items()}
    for k, v in out["cpu"].items():
        # The same inputs on both sides; the tolerance only covers GPU kernels that are not
        # bitwise deterministic from run to run.
        torch.testing.assert_close(out["nvme"][k], v, rtol=1e-6, atol=1e-7)


# ---- under torchrun, 2 gloo ranks ---------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    from test_zero_offload import run_offload, run_plain
    from test_zero_param_nvme import run_torch_adamw
    out = {{}}
    nvme = tempfile.mkdtemp(dir={tmp!r})
    sd, _ = run_torch_adamw(None, world=world, rank=rank, offload_params="nvme",
                            nvme_path=nvme)
    ref, _ = run_torch_adamw(None, world=world, rank=rank)
    out["torch"] = (sd, ref)
    state = tempfile.mkdtemp(dir={tmp!r})
    sd, kept, redone, _ = run_offload(3, "nvme", {clip!r}, state, world=world, rank=rank,
                                      offload_params="nvme", nvme_path=nvme)
    ref = run_plain(3, {clip!r}, world=world, rank=rank)
    out["tierlift"] = (sd, ref)
    out["left"] = os.listdir(nvme)
""")


def test_torchrun_two_ranks(tmp_path):
    results = run_torchrun(SCRIPT, tmp_path, tmp=str(tmp_path), clip=CLIP)
    for key in ("torch", "tierlift"):
        sd, ref = results[key]
        assert_same(sd, ref)
    assert results["left"] == []  # every rank's folder went with its model


def test_train_gpt_example_with_parameters_on_nvme(tmp_path):
    """examples/train_gpt.py --zero 3 --offload-params nvme under torchrun: it trains, and the
    parameter shards were read from the files."""
    from test_example_train_gpt import run_example

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"]
    out = run_example("--zero", "3", "--offload-params", "nvme", "--offload", "nvme",
                      "--nvme-path", str(tmp_path), "--device", "cpu", "--steps", "12",
                      launcher=torchrun)
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first, out
    assert re.search(r"zero stats .*'nvme_read_bytes': [1-9]", out), out


def test_close_removes_the_folder_and_keeps_the_shards(tmp_path):
    model = tierlift.zero.shard(make_net(), stage=3, offload_params="nvme", nvme_path=tmp_path)
    before = [p.detach().clone() for p in model.parameters()]
    assert folders(tmp_path)
    tierlift.zero.close(model)
    assert not folders(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    fit(model, opt, clip=None)  # still trains with the folder gone
    tierlift.zero.close(model)  # idempotent


# ---- the O_DIRECT read path ---------------------------------------------------------------------
def direct_store(tmp_path, numels=(1000, 3000, 70000)):
    store = NvmeParamStore(nvme_path=tmp_path, shard_numels=list(numels))
    if not store.stats["nvme_direct"]:
        pytest.skip("the file system of tmp_path has no O_DIRECT")
    torch.manual_seed(0)
    views = [store.alloc(torch.randn(n)) for n in numels]
    return store, views


def gather(store, view):
    out = store.fetch(view).clone()
    store.staged(view)
    return out


def test_direct_reads_see_what_was_written_through_the_mapping(tmp_path):
    store, views = direct_store(tmp_path)
    expect = [v.clone() for v in views]
    views[1].mul_(3.0)  # dirty pages in the page cache: an O_DIRECT read writes them back first
    expect[1].mul_(3.0)
    for _ in range(3):
        for v, e in zip(views, expect, strict=True):
            assert torch.equal(gather(store, v), e)
    # Rounds 2 and 3 were predicted and read ahead (round 1 learns the order).
    assert store.stats["nvme_prefetch_hits"] >= 4
    assert store.stats["nvme_read_wait_s"] > 0
    assert store.resident_bytes() == 0


@pytest.mark.parametrize("stepped", [False, True], ids=["other-write", "optimizer-step"])
def test_a_read_ahead_of_a_range_written_since_is_discarded(tmp_path, stepped):
    store, views = direct_store(tmp_path)
    for _ in range(2):  # learn the order 0, 1, 2
        for v in views:
            gather(store, v)
    gather(store, views[0])
    gather(store, views[1])  # reads unit 2 ahead
    misses = store.stats["nvme_prefetch_misses"]
    with torch.no_grad():
        views[2].add_(1.0)  # e.g. load_state_dict, or an optimizer
    if stepped:
        store.stepped(views[2])
    assert torch.equal(gather(store, views[2]), views[2])
    assert store.stats["nvme_prefetch_misses"] == misses + 1  # read again


def test_without_o_direct_gathers_read_the_mapping_with_a_warning(tmp_path, monkeypatch):
    from tierlift.zero import param_nvme

    monkeypatch.setattr(param_nvme, "direct_io_error",
                        lambda path: OSError(errno.EINVAL, "Invalid argument"))
    torch.set_num_threads(1)
    with pytest.warns(RuntimeWarning, match="does not support O_DIRECT.*through the mapping"):
        sd, stats = run_torch_adamw(None, offload_params="nvme", nvme_path=tmp_path)
    assert stats["nvme_direct"] is False and stats["nvme_prefetch_hits"] == 0
    assert_same(sd, run_torch_adamw(None)[0])


def test_a_read_error_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    store, views = direct_store(tmp_path)
    gather(store, views[0])  # the engine is started

    class Failed:
        def wait(self):
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(store._reader._engine, "read", lambda *a, **k: Failed())
    with pytest.raises(OSError, match=re.escape(store.path) + ".*Input/output error") as e:
        store.fetch(views[1])
    assert e.value.errno == errno.EIO
    monkeypatch.undo()
    os.truncate(store.path, store.offsets[2])  # a file cut short: the read hits its end
    where = re.escape(store.path) + f"' at offset {store.offsets[2]}"
    with pytest.raises(OSError, match=where + ".*cut short"):
        store.fetch(views[2])


def test_the_page_cache_holds_a_few_units_not_the_tier(tmp_path):
    from tierlift.zero import param_nvme
    from tierlift.zero.param_nvme_reader import resident_pages

    model = tierlift.zero.shard(make_net(), stage=3, offload_params="nvme", nvme_path=tmp_path)
    store = model._tierlift_zero.offload.store
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    fit(model, opt, steps=3)
    stats = model._tierlift_zero.stats
    assert stats["nvme_warm_bytes"] > 0  # the gathers before a step warmed their range
    assert stats["nvme_prefetch_hits"] > 0
    # The first unit of forward was read from the page cache (just stepped, under write-back).
    assert stats["nvme_cached_reads"] > 0
    largest = max(e - o for o, e in store._slot_end.items())
    cached = resident_pages(store._flat.data_ptr(), store.nbytes) * 4096
    assert cached <= (param_nvme._WARM_CAP_UNITS + 2) * largest


def test_a_unit_gathered_twice_in_a_row_reuses_its_buffer_unless_written(tmp_path):
    store, views = direct_store(tmp_path)
    order = [0, 1, 2, 2, 1, 0]  # forward, then backward: the last unit is gathered twice
    for _ in range(2):
        for i in order:
            gather(store, views[i])
    for write in (False, True):
        gather(store, views[0])
        gather(store, views[1])
        gather(store, views[2])  # "reads" unit 2 ahead: it is still in the buffer
        misses = store.stats["nvme_prefetch_misses"]
        if write:
            with torch.no_grad():
                views[2].mul_(-1.0)
        assert torch.equal(gather(store, views[2]), views[2])
        assert store.stats["nvme_prefetch_misses"] == misses + write
        gather(store, views[1])
        gather(store, views[0])


@pytest.mark.parametrize("code,fallback", [(errno.EMFILE, False), (errno.EINVAL, True)])
def test_only_einval_falls_back_from_o_direct(tmp_path, monkeypatch, code, fallback):
    """Too many open files is an error naming the limit (nothing left behind), not a file
    system without O_DIRECT; EINVAL is, and falls back to reads through the mapping."""
    real = os.open

    def fake(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(code, os.strerror(code))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake)
    if fallback:
        with pytest.warns(RuntimeWarning, match="does not support O_DIRECT"):
            store = NvmeParamStore(nvme_path=str(tmp_path), shard_numels=[1000])
        assert not store.stats["nvme_direct"]
        store.close()
        return
    with pytest.raises(OSError, match=r"limit on open files \(RLIMIT_NOFILE = \d+\)"):
        NvmeParamStore(nvme_path=str(tmp_path), shard_numels=[1000])
    assert os.listdir(tmp_path) == []  # the parameter folder was removed
