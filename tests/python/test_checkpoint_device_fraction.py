"""tierlift.checkpoint with an optimizer built with device_fraction: the device part's state
(moments, masters, compact kinds, step counts) goes into the same streamed kind files as the
tiers' state, so a resume is bit-exact whatever device_fraction (or none) loads it, a step taken
while a background save runs does not reach the files, a damaged file is refused, a failed load
changes nothing, and ZeRO shards load on the same and on another world size (2 gloo ranks under
torchrun)."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch
from test_checkpoint_reshard import _assert_same_state, _full_state
from torch import nn
from zero_model import batches, make_model, run_torchrun, train

import tierlift
from tierlift.checkpoint import restore, stream, writer
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

DIM, LAYERS = 32, 4
FRACTION = 0.5  # of 4 x (32*32 + 32) elements: the first two layers (w0, b0, w1, b1)
CHUNK = 1024 * 4  # several chunks per tier


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)]).to(dtype=dtype)


def _opt(model, tmp, tier="cpu", fraction=None, **kw):
    kw = dict(kw, chunk_bytes=CHUNK)
    if tier == "none":
        kw = {}
    elif tier == "nvme":
        os.makedirs(tmp, exist_ok=True)
        kw.update(offload="nvme", nvme_path=str(tmp), overlap=True)
    else:
        kw.update(offload="cpu", overlap=tier == "cpu-overlap")
    if fraction is not None:
        kw["device_fraction"] = fraction
    return AdamW(model.parameters(), lr=1e-2, **kw)


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    p0 = next(model.parameters())
    for _ in range(steps):
        model(torch.randn(8, DIM, generator=g).to(p0.dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _state(model, opt) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {i: {k: torch.as_tensor(v).clone() for k, v in s.items()}
                      for i, s in opt.state_dict()["state"].items()}}


def _assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for i, sa in a["optim"].items():
        assert sa.keys() == b["optim"][i].keys(), i
        for k in sa:
            x, y = sa[k], b["optim"][i][k]
            assert x.dtype == y.dtype and torch.equal(x, y), (i, k)


def _resume_case(tmp_path, save_kw: dict, load_kw: dict, dtype=torch.float32, **opt_kw):
    """Trains 2 steps, saves, trains 2 more (the uninterrupted run); a fresh model and
    optimizer (`load_kw`) load the checkpoint and train the same 2 steps: the same bits."""
    model = _model(dtype)
    opt = _opt(model, tmp_path / "a", **save_kw, **opt_kw)
    _train(model, opt, 2, seed=1)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(model, opt, 2, seed=2)
    model2 = _model(dtype)
    opt2 = _opt(model2, tmp_path / "b", **load_kw, **opt_kw)
    tierlift.checkpoint.load(ck, model2, opt2)
    _train(model2, opt2, 2, seed=2)
    _assert_same(_state(model2, opt2), _state(model, opt))
    return opt, opt2


@pytest.mark.parametrize("tier", ["cpu", "cpu-overlap", "nvme"])
def test_resume_is_bit_exact(tmp_path, tier):
    opt, opt2 = _resume_case(tmp_path, dict(tier=tier, fraction=FRACTION),
                             dict(tier=tier, fraction=FRACTION))
    assert opt2._offload.device_part.params == 4  # the device part was loaded, not skipped
    d = tmp_path / "ck" / "optim"
    entries = stream.read_state_json(str(d))["groups"][0]["params"]
    assert [e["index"] for e in entries] == list(range(2 * LAYERS))  # device part's first
    for o in (opt, opt2):
        o.close()


@pytest.mark.parametrize("save,load", [(FRACTION, None), (None, FRACTION), (FRACTION, 0.25)],
                         ids=["part_to_none", "none_to_part", "part_to_other_part"])
def test_resume_across_device_fractions(tmp_path, save, load):
    opt, opt2 = _resume_case(tmp_path, dict(fraction=save), dict(tier="nvme", fraction=load))
    assert opt2._offload.device_part.params == {None: 0, FRACTION: 4, 0.25: 2}[load]
    for o in (opt, opt2):
        o.close()


def test_resume_into_an_optimizer_without_offload(tmp_path):
    opt, _ = _resume_case(tmp_path, dict(fraction=FRACTION), dict(tier="none"))
    opt.close()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_bf16_parameters_and_compact_state(tmp_path, state_dtype):
    """bf16 parameters: the device part's fp32 masters are saved; compact state: its bf16 m,
    uint8 v codes and scales."""
    opt, opt2 = _resume_case(tmp_path, dict(fraction=FRACTION), dict(fraction=0.25),
                             dtype=torch.bfloat16, state_dtype=state_dtype)
    first = opt2.state[opt2.param_groups[0]["params"][0]]
    assert ("master" in first) and (first["exp_avg"].dtype == (
        torch.bfloat16 if state_dtype == "bf16" else torch.float32))
    for o in (opt, opt2):
        o.close()


def test_background_save_is_the_state_when_it_started(tmp_path, monkeypatch):
    """The writer is held until a step has run: the files still hold the state of save()."""
    model = _model()
    opt = _opt(model, tmp_path, fraction=FRACTION)
    _train(model, opt, 2, seed=1)
    at_save = _state(model, opt)
    stepped = threading.Event()
    real = writer.Writer._write

    def after_the_step(self, piece):
        assert stepped.wait(60)
        real(self, piece)

    monkeypatch.setattr(writer.Writer, "_write", after_the_step)
    ck = str(tmp_path / "ck")
    handle = tierlift.checkpoint.save(ck, model, opt, blocking=False)
    _train(model, opt, 1, seed=2)  # changes the device part in place
    stepped.set()
    handle.wait()
    assert not torch.equal(_state(model, opt)["optim"][0]["exp_avg"],
                           at_save["optim"][0]["exp_avg"])
    model2 = _model()
    opt2 = _opt(model2, tmp_path, fraction=FRACTION)
    tierlift.checkpoint.load(ck, model2, opt2)
    _assert_same(_state(model2, opt2), at_save)


def _flip_device_part_byte(ck: str) -> None:
    """A byte inside parameter 0's exp_avg, which the device part held."""
    d = os.path.join(ck, "optim")
    e = stream.read_state_json(d)["groups"][0]["params"][0]
    assert e["index"] == 0
    with open(os.path.join(d, "g0.exp_avg.f32"), "r+b") as f:
        f.seek(4 * (e["offset"] + 5))
        b = f.read(1)
        f.seek(4 * (e["offset"] + 5))
        f.write(bytes([b[0] ^ 0x10]))


def test_a_damaged_device_part_file_is_refused_and_nothing_changes(tmp_path):
    model = _model()
    opt = _opt(model, tmp_path, fraction=FRACTION)
    _train(model, opt, 2, seed=1)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(model, opt, 1, seed=2)
    before = _state(model, opt)
    _flip_device_part_byte(ck)
    with pytest.raises(ValueError, match=r"g0\.exp_avg\.f32 is corrupt"):
        tierlift.checkpoint.load(ck, model, opt)
    _assert_same(_state(model, opt), before)


@pytest.mark.parametrize("fail_at", [3, 12], ids=["in_device_part", "in_tiers"])
def test_a_load_failing_half_way_changes_nothing(tmp_path, monkeypatch, fail_at):
    """The device part's 8 reads (exp_avg, exp_avg_sq of 4 parameters) come first: a fault
    among them, or in the tiers' fills after them, leaves both parts as they were."""
    model = _model()
    opt = _opt(model, tmp_path, fraction=FRACTION)
    _train(model, opt, 2, seed=1)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    saved = _state(model, opt)
    _train(model, opt, 1, seed=2)
    before = _state(model, opt)
    calls, real = [0], restore.read_into

    def flaky(f, arr):
        calls[0] += 1
        if calls[0] == fail_at:
            raise OSError(errno.EIO, "injected read error", f.name)
        real(f, arr)

    monkeypatch.setattr(restore, "read_into", flaky)
    with pytest.raises(OSError, match="injected"):
        tierlift.checkpoint.load(ck, model, opt)
    _assert_same(_state(model, opt), before)
    monkeypatch.undo()
    tierlift.checkpoint.load(ck, model, opt)
    _assert_same(_state(model, opt), saved)


def test_a_device_part_that_misses_a_kind_is_refused(tmp_path):
    """bf16 device-part parameters beside fp32 offloaded ones (their own masters: the tier
    holds no master): a checkpoint without the masters the device part needs (here: "master"
    dropped from the plan's kinds) is refused before anything changes."""
    model = _model()
    for layer in list(model)[:2]:
        layer.to(torch.bfloat16)
    opt = _opt(model, tmp_path, fraction=FRACTION)
    assert "master" not in opt._offload.tiers[0].kinds
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    d = str(tmp_path / "ck")
    tierlift.checkpoint.save(d, model, opt)
    optim = os.path.join(d, "optim")
    plan = restore.plan_from_state(optim, stream.read_state_json(optim))
    restore.check_plan(opt._offload, plan, d)  # as saved: it fits
    plan[0].kinds = [k for k in plan[0].kinds if k != "master"]
    with pytest.raises(ValueError, match=r"no \['master'\] for param group 0 .*device part"):
        restore.check_plan(opt._offload, plan, d)


# ---- ZeRO shards ------------------------------------------------------------------------
DATA = batches(4, 8, seed=3)


def _zero(tmp, fraction, **kw):
    model = tierlift.zero.shard(make_model(seed=5), stage=3)
    extra = {} if fraction is None else {"device_fraction": fraction}
    return model, AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, offload="cpu",
                        **extra, **kw)


@pytest.mark.parametrize("load", [None, 0.6])
def test_zero_shards_in_one_process(tmp_path, load):
    model, opt = _zero(tmp_path, 0.3)
    train(model, opt, DATA[:2], accum=1, clip=1.0, zero=True)
    assert opt.last_step_stats["device_part_params"] > 0
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    train(model, opt, DATA[2:], accum=1, clip=1.0, zero=True)
    model2, opt2 = _zero(tmp_path, load)
    tierlift.checkpoint.load(ck, model2, opt2)
    train(model2, opt2, DATA[2:], accum=1, clip=1.0, zero=True)
    a, b = tierlift.zero.full_state_dict(model), tierlift.zero.full_state_dict(model2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k]))
               for i in sa for k in sa[i])


TWO_RANKS = """
import tierlift
from zero_model import batches, make_model, train
data = batches(4, 8, seed=3)

def build(fraction, **kw):
    model = tierlift.zero.shard(make_model(seed=5), stage=3)
    extra = {{}} if fraction is None else {{"device_fraction": fraction}}
    return model, tierlift.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1,
                                       offload="cpu", **extra, **kw)

def fit(model, opt, part):
    train(model, opt, part, accum=1, clip=1.0, world=world, rank=rank, zero=True)

model, opt = build(0.3)
fit(model, opt, data[:2])
parts = opt.last_step_stats["device_part_params"]
tierlift.checkpoint.save({ck_root!r} + "/ck", model, opt, blocking=False).wait()
fit(model, opt, data[2:])
ref = tierlift.zero.full_state_dict(model)
model2, opt2 = build(None)  # the same world size, without a device part
tierlift.checkpoint.load({ck_root!r} + "/ck", model2, opt2)
fit(model2, opt2, data[2:])
got = tierlift.zero.full_state_dict(model2)
same = all(torch.equal(ref[k], got[k]) for k in ref)
model3, opt3 = build(0.3, state_dtype="bf16")
fit(model3, opt3, data[:1])
tierlift.checkpoint.save({ck_root!r} + "/compact", model3, opt3)
all_parts = [None] * world
dist.all_gather_object(all_parts, parts)
out = dict(same=same, parts=all_parts)
"""


def test_two_ranks_under_torchrun_and_resharded_to_one(tmp_path):
    """Saved on 2 ranks (in the background) with a device part; loaded on 2 without one, it
    resumes bit-exact; loaded on 1 (another fraction) it holds the exact saved state; compact
    state, which does not reshard, is refused before anything changes."""
    root = str(tmp_path)
    out = run_torchrun(TWO_RANKS, root, ck_root=root)
    assert out["same"] and all(n > 0 for n in out["parts"]), out
    model, opt = _zero(tmp_path, 0.6)
    tierlift.checkpoint.load(os.path.join(root, "ck"), model, opt)
    assert opt._offload.device_part.params > 0
    got = str(tmp_path / "ck1")
    tierlift.checkpoint.save(got, model, opt)
    _assert_same_state(_full_state(got), _full_state(os.path.join(root, "ck")))
    full, mine = tierlift.checkpoint.full_state_dict(got), tierlift.zero.full_state_dict(model)
    assert all(torch.equal(full[k], mine[k]) for k in full)
    model3, opt3 = _zero(tmp_path, 0.6, state_dtype="bf16")
    before = {k: v.clone() for k, v in tierlift.zero.full_state_dict(model3).items()}
    with pytest.raises(ValueError, match="compact state .* another world size"):
        tierlift.checkpoint.load(os.path.join(root, "compact"), model3, opt3)
    after = tierlift.zero.full_state_dict(model3)
    assert all(torch.equal(before[k], after[k]) for k in before) and not opt3.state


def test_hf_trainer_saves_and_resumes_a_device_part(tmp_path):
    """tierlift.hf.Trainer no longer refuses such an optimizer: resumed from checkpoint-1, it
    ends with the uninterrupted run's weights bit for bit (step 2 needs step 1's moments)."""
    pytest.importorskip("transformers", reason="needs transformers")
    pytest.importorskip("accelerate", reason="needs accelerate")
    import hf_worker as W

    import tierlift.hf
    from tierlift.hf.trainer import unwrap_optimizer

    def trainer(out: str):
        W.quiet()
        torch.set_num_threads(1)
        zero = tierlift.hf.ZeroConfig(stage=3, optimizer_kwargs={"offload": "cpu",
                                                                 "device_fraction": 0.3})
        return tierlift.hf.Trainer(
            model=W.build("llama"), train_dataset=W.Data(), zero=zero,
            args=W.training_args(out, batch=2, max_steps=2, save_steps=1,
                                 gradient_accumulation_steps=1))

    out = str(tmp_path / "run")
    first = trainer(out)
    first.train()
    inner = unwrap_optimizer(first.optimizer)
    assert inner.last_step_stats["device_part_params"] > 0
    again = trainer(out)
    again.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
    for (name, a), b in zip(first.model.named_parameters(), again.model.parameters()):
        assert torch.equal(a, b), name
