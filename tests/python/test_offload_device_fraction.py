"""OffloadConfig.device_fraction: a prefix of the parameters keeps its optimizer state beside
it and is stepped by the optimizer's own kernel, bit-identical to the plain step and to the
all-offloaded one (clipping, GradScaler, skipped steps, bf16, param groups, state dicts)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import tierlift
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)  # the same test on a GPU ("offload exact")
LAYERS, DIM = 6, 64
FRACTION = 0.4  # of 6 x (64*64 + 64) elements: the first two layers (w0, b0, w1, b1)
CHUNK = 4096 * 4  # several chunks, so the overlap steps chunks during backward


def _model(dtype=torch.float32, device="cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)]).to(device, dtype)


def _groups(model, two: bool):
    params = list(model.parameters())
    if not two:
        return params
    return [{"params": params[:5], "lr": 1e-2},
            {"params": params[5:], "lr": 3e-3, "weight_decay": 0.0}]


def _opt(model, *, fraction=None, offload="cpu", overlap=False, clip=None, two=False):
    kw = {} if offload == "none" else dict(offload=offload, overlap=overlap,
                                            max_grad_norm=clip, chunk_bytes=CHUNK)
    if fraction is not None:
        kw["device_fraction"] = fraction
    return AdamW(_groups(model, two), lr=1e-2, **kw)


def _train(model, opt, steps, *, clip_torch=None, scaler=None, inf_at=(), seed=1):
    g = torch.Generator().manual_seed(seed)
    p0 = next(model.parameters())
    for i in range(steps):
        x = torch.randn(16, DIM, generator=g).to(p0.device, p0.dtype)
        loss = model(x).float().square().mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if i in inf_at:  # a device-part gradient: the scaler's check must see it
            p0.grad.view(-1)[3] = float("inf")
        if clip_torch is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_torch)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)


def _same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        assert sa.keys() == sb.keys(), i
        for k in sa:
            x, y = sa[k], sb[k]
            assert x.dtype == y.dtype and x.shape == y.shape, (i, k)
            assert torch.equal(x.cpu(), y.cpu()), (i, k)


def _same_weights(m1, m2) -> None:
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("clip", [None, 1e6, 1e-3])
def test_bit_identical_to_plain_and_all_offloaded(overlap, clip):
    ref, full, part = _model(), _model(), _model()
    o_ref = _opt(ref, offload="none")
    o_full = _opt(full, overlap=overlap, clip=clip)
    o_part = _opt(part, fraction=FRACTION, overlap=overlap, clip=clip)
    _train(ref, o_ref, 4, clip_torch=clip)
    _train(full, o_full, 4)
    _train(part, o_part, 4)
    _same_weights(ref, part)
    _same_weights(full, part)
    _same_state(o_ref.state_dict(), o_part.state_dict())
    _same_state(o_full.state_dict(), o_part.state_dict())
    stats = o_part.last_step_stats
    assert stats["device_part_params"] == 4
    assert stats["device_part_elems"] == 2 * (DIM * DIM + DIM)
    if clip == 1e-3:  # the norm is over every parameter, the device part's included
        assert stats["grad_norm"] == o_full.last_step_stats["grad_norm"]


def test_device_part_gets_no_tier_space_and_no_hooks():
    model = _model()
    opt = _opt(model, fraction=FRACTION, overlap=True)
    full = _opt(_model(), overlap=True)
    off = opt._offload
    assert off.layouts[0].reserved == [False] * 4 + [True] * 8
    assert all(s.pi >= 4 for c in off.layouts[0].chunks for s in c.segments)
    assert len(off.layouts[0].chunks) < len(full._offload.layouts[0].chunks)
    assert len(off.overlap._handles) == 8
    _train(model, opt, 1)
    first = next(model.parameters())
    assert opt.state[first]["exp_avg"].device == first.device  # beside the parameter


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("skip", [False, True])
def test_grad_scaler(skip, device):
    """On a GPU the scaler's inf check is torch's own (scaler_scan takes host gradients only)
    and its found_inf a device tensor."""
    ref, part = _model(device=device), _model(device=device)
    o_ref = _opt(ref, offload="none")
    o_part = _opt(part, fraction=FRACTION, overlap=True)
    inf_at = (2,) if skip else ()
    for m, o in ((ref, o_ref), (part, o_part)):
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
        _train(m, o, 4, scaler=scaler, inf_at=inf_at)
    _same_weights(ref, part)
    _same_state(o_ref.state_dict(), o_part.state_dict())
    if skip:  # the skipped step changed no count, the device part's included
        steps = {int(s["step"]) for s in o_part.state_dict()["state"].values()}
        assert steps == {3}


def test_skip_nonfinite_sees_the_device_part():
    model = _model()
    opt = _opt(model, fraction=FRACTION)
    opt._offload.config.skip_nonfinite = True
    _train(model, opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    with pytest.warns(RuntimeWarning, match="skipped"):
        _train(model, opt, 1, inf_at=(0,))  # only a device-part gradient is inf
    assert opt.last_step_stats["skipped"]
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    _same_state(sd, opt.state_dict())


@pytest.mark.parametrize("overlap", [False, True])
def test_bf16_and_two_groups(overlap):
    ref, part = _model(torch.bfloat16), _model(torch.bfloat16)
    o_ref = _opt(ref, offload="none", two=True)
    o_part = _opt(part, fraction=FRACTION, overlap=overlap, two=True)
    _train(ref, o_ref, 3)
    _train(part, o_part, 3)
    _same_weights(ref, part)
    sd = o_part.state_dict()
    _same_state(o_ref.state_dict(), sd)
    assert sd["state"][0]["master"].dtype == torch.float32  # a bf16 parameter's master


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("direction", ["into_part", "out_of_part"])
def test_state_dict_round_trip_mid_training(direction, device):
    """A state dict of one optimizer loads into the other (device part or all offloaded, or
    the plain one) and training goes on bit-identically; a device part's state (host copies
    in the state dict) goes back beside its parameters."""
    fractions = (None, FRACTION) if direction == "into_part" else (FRACTION, None)
    src_model = _model(device=device)
    src = _opt(src_model, fraction=fractions[0], overlap=True)
    _train(src_model, src, 2)
    sd = src.state_dict()
    dst_model = _model(device=device)
    dst_model.load_state_dict(src_model.state_dict())
    dst = _opt(dst_model, fraction=fractions[1], overlap=True)
    dst.load_state_dict(sd)
    _same_state(sd, dst.state_dict())
    if fractions[1] is not None:
        first = next(dst_model.parameters())
        assert dst.state[first]["exp_avg"].device == first.device
    plain_model = _model(device=device)
    plain_model.load_state_dict(src_model.state_dict())
    plain = _opt(plain_model, offload="none")
    plain.load_state_dict(sd)
    for m, o in ((src_model, src), (dst_model, dst), (plain_model, plain)):
        _train(m, o, 2, seed=5)
    _same_weights(src_model, dst_model)
    _same_weights(src_model, plain_model)
    _same_state(src.state_dict(), dst.state_dict())
    _same_state(src.state_dict(), plain.state_dict())


def test_failed_load_changes_nothing():
    model = _model()
    opt = _opt(model, fraction=FRACTION)
    _train(model, opt, 1)
    before = opt.state_dict()
    bad = opt.state_dict()
    bad["state"][1]["exp_avg"] = torch.zeros(7)  # a device-part parameter's
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 1 has shape \(7,\) but the "
                       r"parameter has shape \(64,\)"):
        opt.load_state_dict(bad)
    _same_state(before, opt.state_dict())


@pytest.mark.parametrize("value,error", [(-0.1, ValueError), (1.0, ValueError),
                                         (1.5, ValueError), (float("nan"), ValueError),
                                         (True, TypeError), ("0.3", TypeError)])
def test_bad_fractions_refused(value, error):
    with pytest.raises(error, match="device_fraction"):
        _opt(_model(), fraction=value)


def test_refused_without_offload_and_with_durable(tmp_path):
    with pytest.raises(ValueError, match="device_fraction needs offload"):
        _opt(_model(), fraction=FRACTION, offload="none")
    with pytest.raises(ValueError, match="durable"):
        AdamW(_model().parameters(), offload="nvme", nvme_path=tmp_path, durable=True,
              device_fraction=FRACTION)


def test_zero_fraction_and_small_fraction_keep_everything_offloaded():
    """0.0, and a fraction below the first parameter's share, hold no parameter."""
    for fraction in (0.0, 0.01):
        opt = _opt(_model(), fraction=fraction)
        assert not opt._offload.device_part
        assert all(opt._offload.layouts[0].reserved)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_device_part(overlap):
    """CUDA parameters: the device part is stepped by the fused CUDA kernel, the rest by the
    CPU Adam; the same bits as the plain CUDA step."""
    ref = _model(torch.bfloat16, "cuda")
    part = _model(torch.bfloat16, "cuda")
    o_ref = _opt(ref, offload="none")
    o_part = _opt(part, fraction=FRACTION, overlap=overlap, clip=1e6)
    _train(ref, o_ref, 3, clip_torch=1e6)
    _train(part, o_part, 3)
    torch.cuda.synchronize()
    _same_weights(ref, part)
    _same_state(o_ref.state_dict(), o_part.state_dict())
    first = next(part.parameters())
    assert o_part.state[first]["exp_avg"].is_cuda


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("overlap", [False, True])
def test_clipped_bf16_steps(device, overlap):
    """Every step clipped (the norm is over the device part's gradients and the offloaded
    ones, on one device; the overlap's chunks are all redone): the same bits as torch's
    clip_grad_norm_ then the plain step."""
    ref, part = _model(torch.bfloat16, device), _model(torch.bfloat16, device)
    o_ref = _opt(ref, offload="none")
    o_part = _opt(part, fraction=FRACTION, overlap=overlap, clip=1e-3)
    _train(ref, o_ref, 3, clip_torch=1e-3)
    _train(part, o_part, 3)
    _same_weights(ref, part)
    _same_state(o_ref.state_dict(), o_part.state_dict())
    stats = o_part.last_step_stats
    assert stats["grad_norm"] > 1e-3 and stats["device_part_params"] == 4


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_background_checkpoint_of_the_device_part(tmp_path, device):
    """tierlift.checkpoint.save(blocking=False) of a device part on its device: its state is
    copied before save() returns (on a GPU: copies queued behind a long kernel, the state then
    changed on another stream), loads beside the parameters of a fresh optimizer, and that
    one steps from it."""
    model = _model(torch.bfloat16, device)
    opt = _opt(model, fraction=FRACTION, overlap=True)
    _train(model, opt, 2)
    at_save = opt.state_dict()
    weights = [p.detach().cpu().clone() for p in model.parameters()]
    first = next(model.parameters())
    side = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 30)  # the current stream busy for about half a second
        side = torch.cuda.Stream()
    ck = str(tmp_path / "ck")
    handle = tierlift.checkpoint.save(ck, model, opt, blocking=False)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for k in ("exp_avg", "exp_avg_sq", "master"):
            opt.state[first][k].add_(1.0)  # waits for nothing on the current stream
    if side is not None:
        torch.cuda.synchronize()
    handle.wait()
    model2 = _model(torch.bfloat16, device)
    opt2 = _opt(model2, fraction=FRACTION, overlap=True)
    tierlift.checkpoint.load(ck, model2, opt2)
    _same_state(at_save, opt2.state_dict())
    for p, w in zip(model2.parameters(), weights):
        assert torch.equal(p.detach().cpu(), w)
    first2 = next(model2.parameters())
    assert opt2.state[first2]["exp_avg"].device == first2.device
    _train(model2, opt2, 1)
    assert int(opt2.state_dict()["state"][0]["step"]) == 3
    for o in (opt, opt2):
        o.close()


def test_state_dict_is_a_snapshot():
    """As the offloaded part's entries: later steps do not change a state dict taken before."""
    model = _model()
    opt = _opt(model, fraction=FRACTION)
    _train(model, opt, 1)
    sd = opt.state_dict()
    kept = {k: v.clone() for k, v in sd["state"][0].items()}
    _train(model, opt, 1)
    assert all(torch.equal(sd["state"][0][k], v) for k, v in kept.items())
    assert int(opt.state_dict()["state"][0]["step"]) == 2


def test_planner_counts_the_device_part_on_the_gpu():
    from tierlift.plan.measure import Bandwidths
    from tierlift.plan.planner import PlanInput, make_plan

    bw = Bandwidths(memory_bps=20e9, adam_elems_per_s=1e9)
    gib, n = 1 << 30, 8e9
    base = make_plan(PlanInput(params=n, gpu_mem=140 * gib, cpu_mem=512 * gib), bw)
    part = make_plan(PlanInput(params=n, gpu_mem=140 * gib, cpu_mem=512 * gib,
                               device_fraction=0.3), bw)
    dev = int(0.3 * n)
    extra = sum(part.tiers["gpu"].values()) - sum(base.tiers["gpu"].values())
    assert extra == 12 * dev  # fp32 master, m, v of bf16 weights
    assert part.tiers["cpu"] == base.tiers["cpu"]  # the host side stays a bound for all n
    with pytest.raises(ValueError, match="device_fraction=0.9"):
        make_plan(PlanInput(params=n, gpu_mem=80 * gib, cpu_mem=512 * gib,
                            device_fraction=0.9), bw)
    with pytest.raises(ValueError, match="device_fraction"):
        PlanInput(params=n, gpu_mem=80 * gib, cpu_mem=512 * gib, device_fraction=1.0)


def test_finetune_check_with_a_device_fraction():
    """bench_offload.py --finetune-check's tierlift case with --device-fraction: the row says
    how much stayed on the device."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "benchmarks"), str(root / "examples")]
    try:
        import argparse

        import finetune_sizing as fs
        import offload_finetune as of
    finally:
        del sys.path[:2]
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    of.add_finetune_args(ap)
    args = ap.parse_args(["--finetune-check", "--tier", "cpu", "--overlap", "--device-fraction",
                          "0.4", "--chunk-bytes", "16384", "--steps", "2", "--warmup", "1",
                          "--seq-len", "32", "--batch-size", "2"])
    out = of.run_tierlift(args, {"model": "tiny", "tier": "cpu"}, torch.device("cpu"))
    assert out["case"].endswith("device_fraction=0.4")
    n = fs.config("tiny", 32).num_params()
    part = out["device_part"]
    assert 0 < part["device_part_elems"] <= 0.4 * n and part["device_part_params"] >= 1
    assert "kept their state beside them" in of.case_note(out)
    need = fs.needs("tiny", args)
    assert need["device_part_gpu_bytes"] == 12 * int(0.4 * n)


@pytest.mark.parametrize("offload", ["nvme", "hybrid"])
def test_nvme_tiers(tmp_path, offload):
    ref, part = _model(), _model()
    o_ref = _opt(ref, offload="none")
    kw = dict(offload=offload, nvme_path=tmp_path, overlap=True, chunk_bytes=CHUNK,
              max_grad_norm=1e-3, device_fraction=FRACTION)
    if offload == "hybrid":
        kw["cpu_budget"] = 1 << 20
    o_part = AdamW(part.parameters(), lr=1e-2, **kw)
    _train(ref, o_ref, 3, clip_torch=1e-3)
    _train(part, o_part, 3)
    _same_weights(ref, part)
    _same_state(o_ref.state_dict(), o_part.state_dict())
    o_part.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_shards_single_process(stage):
    """tierlift.zero shards in one process: the device part is a prefix of the shards, the
    same bits as the all-offloaded optimizer over the same shards."""
    out = []
    for fraction in (None, FRACTION):
        model = tierlift.zero.shard(_model(), stage=stage)
        opt = _opt(model, fraction=fraction, overlap=True, clip=1e-3)
        _train(model, opt, 3)
        out.append((tierlift.zero.full_state_dict(model), opt))
    (a, o_a), (b, o_b) = out
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert o_b.last_step_stats["device_part_params"] > 0
    for m in (o_a, o_b):
        m.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_compact_state(overlap):
    """state_dtype='bf16': the device part keeps compact state too, the same bits."""
    ref, part = _model(), _model()
    o_ref = AdamW(ref.parameters(), lr=1e-2, state_dtype="bf16")
    o_part = AdamW(part.parameters(), lr=1e-2, state_dtype="bf16", offload="cpu",
                   overlap=overlap, chunk_bytes=CHUNK, device_fraction=FRACTION)
    _train(ref, o_ref, 3)
    _train(part, o_part, 3)
    _same_weights(ref, part)
    sd = o_part.state_dict()
    _same_state(o_ref.state_dict(), sd)
    assert sd["state"][0]["exp_avg"].dtype == torch.bfloat16
