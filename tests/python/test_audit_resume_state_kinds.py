"""Resume audit of the newer state kinds together: an FP8 delayed-scaling model (amax
histories in its state_dict) trained by tierlift's AdamW with compact or fp32 state, offloaded
to the CPU or NVMe tiers with or without a device share, saved mid-run and resumed into fresh
objects configured otherwise. The losses and weights after the resume must equal the
uninterrupted run's bit for bit; a state kind that cannot move exactly must be refused."""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
from torch import nn

import tierlift
from tierlift.lowp import convert

DELAYED = "fp8-tensorwise-delayed"
GEN = torch.Generator().manual_seed(5)
# the last batch before the save has the largest range: the scales after it depend on it
XS = [torch.randn(8, 32, generator=GEN) * c for c in (0.5, 0.8, 1.5, 0.3, 1.0, 0.6)]
SPLIT = 3
_DIRS = itertools.count()


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(dtype)
    convert(model, DELAYED, min_features=0)
    return model


def _optimizer(model, tier: str, state_dtype: str, tmp_path):
    """tier: none, cpu, nvme, hybrid, then `-df` (a device share of 0.4) or `-g1` (one
    generation of NVMe state: a step writes it in place)."""
    offload, _, option = tier.partition("-")
    share = option == "df"
    kwargs = dict(lr=1e-2, weight_decay=0.01, state_dtype=state_dtype, offload=offload)
    if offload in ("nvme", "hybrid"):
        path = tmp_path / f"nvme-{next(_DIRS)}"
        path.mkdir(exist_ok=True)
        kwargs["nvme_path"] = str(path)
    if offload == "hybrid":
        kwargs["cpu_budget"] = 96 << 10  # part RAM, part NVMe
    if share:
        kwargs.update(overlap=True, device_fraction=0.4)
    if option == "g1":
        kwargs["nvme_generations"] = 1
    return tierlift.optim.AdamW(model.parameters(), **kwargs)


def _train(model, opt, xs) -> list[torch.Tensor]:
    losses = []
    for x in xs:
        opt.zero_grad()
        loss = model(x.to(model[0].weight.dtype)).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def _assert_same(model_a, model_b, losses_a, losses_b):
    for i, (a, b) in enumerate(zip(losses_a, losses_b, strict=True)):
        assert torch.equal(a, b), f"loss {i} after the resume off by {(a - b).abs().item()}"
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} off by {(sa[k] - sb[k]).abs().max().item()}"


def _uninterrupted(tier, state_dtype, tmp_path, dtype=torch.float32):
    model = _model(dtype=dtype)
    opt = _optimizer(model, tier, state_dtype, tmp_path)
    return model, _train(model, opt, XS)


PAIRS = [  # (saved with, loaded into)
    ("none", "cpu-df"), ("cpu-df", "nvme"), ("nvme-df", "none"), ("hybrid", "cpu"),
    ("cpu", "nvme-df"),
]


@pytest.mark.parametrize("state_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("saved", "loaded"), PAIRS)
@pytest.mark.parametrize("optimizer_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: fp32 masters too
def test_state_dicts_resume_in_another_tier_exactly(tmp_path, one_thread, state_dtype, saved,
                                                    loaded, optimizer_first, dtype):
    want_model, want = _uninterrupted(saved, state_dtype, tmp_path, dtype)
    model = _model(dtype=dtype)
    opt = _optimizer(model, saved, state_dtype, tmp_path)
    _train(model, opt, XS[:SPLIT])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    del model, opt
    buf.seek(0)
    saved_dicts = torch.load(buf, weights_only=True)
    fresh = _model(seed=9, dtype=dtype)  # other weights, never-filled histories
    opt2 = _optimizer(fresh, loaded, state_dtype, tmp_path)
    if optimizer_first:
        opt2.load_state_dict(saved_dicts["optim"])
        fresh.load_state_dict(saved_dicts["model"], strict=True)
    else:
        fresh.load_state_dict(saved_dicts["model"], strict=True)
        opt2.load_state_dict(saved_dicts["optim"])
    got = _train(fresh, opt2, XS[SPLIT:])
    _assert_same(want_model, fresh, want[SPLIT:], got)


@pytest.mark.parametrize("state_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("saved", "loaded"), [("cpu-df", "nvme"), ("nvme-df", "none"),
                                               ("none", "hybrid"), ("nvme-g1", "cpu-df"),
                                               ("hybrid", "nvme-g1"), ("cpu", "cpu-df")])
@pytest.mark.parametrize("build_optimizer_after_model_load", [False, True])
def test_background_checkpoint_mid_run_resumes_exactly(tmp_path, one_thread, state_dtype, saved,
                                                       loaded, build_optimizer_after_model_load):
    """tierlift.checkpoint.save(blocking=False) after step 3 while the run steps on; the run
    itself must be unchanged by the save, and a fresh model and optimizer resume exactly."""
    want_model, want = _uninterrupted(saved, state_dtype, tmp_path)
    model = _model()
    opt = _optimizer(model, saved, state_dtype, tmp_path)
    _train(model, opt, XS[:SPLIT])
    ck = str(tmp_path / "ck")
    handle = tierlift.checkpoint.save(ck, model, opt, blocking=False, extra={"step": SPLIT},
                                      staging_budget=64 << 10)
    on = _train(model, opt, XS[SPLIT:])  # while the files are written
    handle.wait()
    _assert_same(want_model, model, want[SPLIT:], on)
    fresh = _model(seed=9)
    if build_optimizer_after_model_load:
        tierlift.checkpoint.load(ck, fresh)
        opt2 = _optimizer(fresh, loaded, state_dtype, tmp_path)
        extra = tierlift.checkpoint.load(ck, fresh, opt2)
    else:
        opt2 = _optimizer(fresh, loaded, state_dtype, tmp_path)
        extra = tierlift.checkpoint.load(ck, fresh, opt2)
    assert extra == {"step": SPLIT}
    got = _train(fresh, opt2, XS[SPLIT:])
    _assert_same(want_model, fresh, want[SPLIT:], got)


@pytest.mark.parametrize("loaded", ["none", "cpu-df", "nvme"])
def test_compact_state_loads_into_fp32_state_as_its_exact_values(tmp_path, one_thread, loaded):
    """Compact -> fp32 is exact (each code is an fp32 value): every target tier holds the same
    dequantized moments and steps on to the same bits."""
    from tierlift.reference.optim_compact import dequantize_exp_avg_sq

    model = _model()
    opt = _optimizer(model, "cpu-df", "bf16", tmp_path)
    _train(model, opt, XS[:SPLIT])
    sd = copy.deepcopy(opt.state_dict())
    msd = copy.deepcopy(model.state_dict())

    def resume(tier):
        fresh = _model(seed=9)
        fresh.load_state_dict(msd)
        o = _optimizer(fresh, tier, "fp32", tmp_path)
        o.load_state_dict(copy.deepcopy(sd))  # as torch's, it steps the loaded "step" on
        return fresh, o

    ref_model, ref_opt = resume("none")
    got_model, got_opt = resume(loaded)
    for i, s in sd["state"].items():
        want_v = dequantize_exp_avg_sq(s["exp_avg_sq_codes"], s["exp_avg_sq_scale"])
        got = got_opt.state_dict()["state"][i]
        assert torch.equal(got["exp_avg"], s["exp_avg"].float())
        assert torch.equal(got["exp_avg_sq"], want_v.reshape(got["exp_avg_sq"].shape))
    _assert_same(ref_model, got_model, _train(ref_model, ref_opt, XS[SPLIT:]),
                 _train(got_model, got_opt, XS[SPLIT:]))


def test_a_delayed_state_dict_loads_into_a_plain_model_only_without_strict():
    model = _model()
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, XS[:SPLIT])
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    with pytest.raises(RuntimeError, match="fp8_amax_history_x"):
        plain.load_state_dict(sd)
    result = plain.load_state_dict(sd, strict=False)
    assert sorted(result.unexpected_keys) == sorted(k for k in sd if "amax_history" in k)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


@pytest.mark.parametrize("state_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("saved_on_nvme", "loaded_on_nvme"), [(True, False), (False, True)])
def test_zero3_with_parameters_on_nvme_resumes_exactly(tmp_path, one_thread, state_dtype,
                                                       saved_on_nvme, loaded_on_nvme):
    """ZeRO-3 units (each parameter a piece of its unit's flat shard), the shards in RAM or on
    the NVMe parameter tier, the optimizer state on the NVMe tier or beside a device share."""
    def build(seed, on_nvme, tier):
        kw = {}
        if on_nvme:
            path = tmp_path / f"params-{next(_DIRS)}"
            path.mkdir()
            kw = dict(offload_params="nvme", nvme_path=str(path))
        model = tierlift.zero.shard(_model(seed), stage=3, min_unit_numel=1, **kw)
        return model, _optimizer(model, tier, state_dtype, tmp_path)

    model, opt = build(0, saved_on_nvme, "nvme")
    _train(model, opt, XS[:SPLIT])
    ck = str(tmp_path / "ck")
    handle = tierlift.checkpoint.save(ck, model, opt, blocking=False, staging_budget=64 << 10)
    want = _train(model, opt, XS[SPLIT:])
    handle.wait()
    fresh, opt2 = build(9, loaded_on_nvme, "cpu-df")
    tierlift.checkpoint.load(ck, fresh, opt2)
    got = _train(fresh, opt2, XS[SPLIT:])
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    full, again = tierlift.zero.full_state_dict(model), tierlift.zero.full_state_dict(fresh)
    assert full.keys() == again.keys()
    assert all(torch.equal(v, again[k]) for k, v in full.items())


@pytest.mark.parametrize("state_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize(("saved", "loaded"), [("cpu-df", "nvme"), ("nvme", "none")])
def test_torch_distributed_checkpoint_resumes_exactly(tmp_path, one_thread, state_dtype, flatten,
                                                      saved, loaded):
    """get_state_dict -> dcp.save, then dcp.load -> set_state_dict into fresh objects (one
    process, no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    want_model, want = _uninterrupted(saved, state_dtype, tmp_path)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = _model()
    opt = _optimizer(model, saved, state_dtype, tmp_path)
    _train(model, opt, XS[:SPLIT])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says so
        msd, osd = get_state_dict(model, opt, options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
        fresh = _model(seed=9)
        opt2 = _optimizer(fresh, loaded, state_dtype, tmp_path)
        msd, osd = get_state_dict(fresh, opt2, options=options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
        set_state_dict(fresh, opt2, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
    _assert_same(want_model, fresh, want[SPLIT:], _train(fresh, opt2, XS[SPLIT:]))
