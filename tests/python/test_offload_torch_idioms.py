"""What users do with torch.optim.AdamW, done to tierlift's offloaded AdamW: each gives torch's
result, or is refused with a clear error before any weight, gradient or state changes.

- a param group key switched between backward and step() (the overlap compares every key);
- a parameter listed twice in a group (refused: the tiers give it one state, torch two updates);
- a group's params list filtered, appended to or replaced (refused: the state is laid out once);
- an inf gradient without GradScaler (NaN in the weights, as torch; skip_nonfinite=True skips);
- a 0-element parameter (its state round-trips through torch's AdamW);
- hyperparameters of the wrong type, parameters on the meta device (refused)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from conformance_util import (
    MODES,
    OFFLOADED,
    TOL,
    assert_matches_torch,
    assert_same_snapshot,
    batch,
    build_model,
    close,
    flat,
    num_threads,
    snapshot,
    tl_opt,
    torch_opt,
    train,
    twin,
)
from torch import nn

import tierlift

pytestmark = [
    pytest.mark.skipif(not tierlift._extension.available(), reason="compiled extension not loaded"),
    pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate"),
]

OVERLAP = [m for m in OFFLOADED if MODES[m].get("overlap")]
CLASSES = {"Adam": (tierlift.optim.Adam, torch.optim.Adam),
           "AdamW": (tierlift.optim.AdamW, torch.optim.AdamW)}


def _drive_empty(tmp_path) -> None:
    assert os.listdir(tmp_path) == [], "a refusal leaves nothing on the drive"


# ---- a group key switched between backward and step() ---------------------------------------
def _flip_decoupled(i, model, opt) -> None:
    if i == 2:
        for g in opt.param_groups:
            g["decoupled_weight_decay"] = not g["decoupled_weight_decay"]


@pytest.mark.parametrize("cls_name", list(CLASSES))
@pytest.mark.parametrize("mode", ["none", *OVERLAP])
def test_decoupled_weight_decay_switched_before_step(tmp_path, mode, cls_name):
    tl_cls, ref_cls = CLASSES[cls_name]
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path, cls=tl_cls, weight_decay=0.1)
    ref_opt = torch_opt(ref.parameters(), cls=ref_cls, weight_decay=0.1)
    with num_threads(1):
        train(model, opt, steps=4, before_step=_flip_decoupled)
        train(ref, ref_opt, steps=4, before_step=_flip_decoupled)
    assert_matches_torch(model, ref)
    close(opt)


@pytest.mark.parametrize("mode", OVERLAP)
def test_any_group_key_changed_before_step_redoes_the_chunks(tmp_path, mode):
    """A key this optimizer does not read (one a later torch may add) still counts as a change:
    the chunks stepped during backward are stepped again."""
    model = build_model()
    opt = tl_opt(mode, model.parameters(), tmp_path)

    def touch(i, m, o):
        if i == 1:
            o.param_groups[0]["a_later_torch_key"] = 1

    with num_threads(1):
        train(model, opt, steps=1)
        assert opt.last_step_stats["overlap_kept_chunks"] > 0
        train(model, opt, steps=1, start=1, before_step=touch)
    assert opt.last_step_stats["overlap_kept_chunks"] == 0
    assert opt.last_step_stats["overlap_redone_chunks"] > 0
    close(opt)


def test_decoupled_weight_decay_switched_under_zero3_nvme(tmp_path):
    model = build_model()
    ref = twin(model)
    sharded = tierlift.zero.shard(model, stage=3)
    opt = tierlift.optim.Adam(sharded.parameters(), lr=1e-2, weight_decay=0.1, offload="nvme",
                              nvme_path=str(tmp_path), overlap=True, chunk_bytes=16 << 10)
    ref_opt = torch_opt(ref.parameters(), cls=torch.optim.Adam, weight_decay=0.1)
    with num_threads(1):
        train(sharded, opt, steps=4, before_step=_flip_decoupled)
        train(ref, ref_opt, steps=4, before_step=_flip_decoupled)
    got = tierlift.zero.full_state_dict(sharded)
    for k, v in ref.state_dict().items():
        err = float((got[k] - v).abs().max() / v.abs().max())
        assert err <= TOL, f"{k}: rel_err={err:.2e}"
    close(opt)


# ---- a parameter listed twice ----------------------------------------------------------------
@pytest.mark.parametrize("mode", OFFLOADED)
def test_parameter_listed_twice_is_refused(tmp_path, mode):
    params = list(build_model().parameters())
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[6\] is the same "
                       r"parameter as param_groups\[0\]\['params'\]\[1\].*list it once"):
        tl_opt(mode, [*params, params[1]], tmp_path)
    _drive_empty(tmp_path)


# ---- a group's params list changed after construction ----------------------------------------
def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)], nn.Linear(32, 8))


def _fit(model, opt, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        x, y = batch(0, i)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _filter(model, group) -> None:
    """Freezes block 1 and removes it from the group (blocks of equal shape)."""
    model[1].requires_grad_(False)
    frozen = {id(p) for p in model[1].parameters()}
    group["params"] = [p for p in group["params"] if id(p) not in frozen]


def _append(model, group) -> None:
    group["params"].append(nn.Parameter(torch.zeros(3)))


def _replace(model, group) -> None:
    group["params"][2] = nn.Parameter(group["params"][2].detach().clone())


@pytest.mark.parametrize("change", [_filter, _append, _replace], ids=["filter", "append",
                                                                       "replace"])
@pytest.mark.parametrize("mode", OFFLOADED)
def test_changed_params_list_is_refused_before_anything_changes(tmp_path, mode, change):
    model = _blocks()
    opt = tl_opt(mode, model.parameters(), tmp_path)
    with num_threads(1):
        _fit(model, opt, 2)
        before = snapshot(model, opt)
        group = opt.param_groups[0]
        listed = list(group["params"])
        change(model, group)
        x, y = batch(0, 2)
        # step() refuses it (with overlap the first gradient hook only stops stepping ahead).
        with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\] is not the list "
                           r"the optimizer was built with.*build a new optimizer"):
            F.mse_loss(model(x), y).backward()
            opt.step()
        with pytest.raises(RuntimeError, match="is not the list the optimizer was built with"):
            opt.state_dict()
        group["params"] = listed
        model.requires_grad_(True)
        assert_same_snapshot(before, snapshot(model, opt), "refused step")
        opt.zero_grad()
        _fit(model, opt, 1, start=2)  # the list put back, it trains on
    close(opt)


@pytest.mark.parametrize("change", [_append, _replace], ids=["append", "replace"])
@pytest.mark.parametrize("mode", OVERLAP)
def test_changed_params_list_is_refused_by_step_after_a_whole_backward(tmp_path, mode, change):
    """The overlap's first gradient hook sees the changed list and steps nothing ahead; the
    refusal is step()'s, after backward ran whole: the list put back, step() is torch's."""
    model = _blocks()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    ref_opt = torch_opt(ref.parameters())
    with num_threads(1):
        _fit(model, opt, 1)
        _fit(ref, ref_opt, 1)
        group = opt.param_groups[0]
        listed = list(group["params"])
        change(model, group)
        x, y = batch(0, 1)
        F.mse_loss(model(x), y).backward()  # a refusal raised here would stop backward
        with pytest.raises(RuntimeError, match="is not the list the optimizer was built with"):
            opt.step()
        group["params"] = listed
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_matches_torch(model, ref)
    close(opt)


def test_changed_params_list_without_offload_is_as_torch(tmp_path):
    """Without offload the state is keyed by the parameter, as torch's: filtering is allowed."""
    model = _blocks()
    ref = twin(model)
    opt = tl_opt("none", model.parameters(), tmp_path)
    ref_opt = torch_opt(ref.parameters())
    with num_threads(1):
        _fit(model, opt, 2)
        _fit(ref, ref_opt, 2)
        _filter(model, opt.param_groups[0])
        _filter(ref, ref_opt.param_groups[0])
        _fit(model, opt, 2, start=2)
        _fit(ref, ref_opt, 2, start=2)
    assert_matches_torch(model, ref)


# ---- an inf gradient without GradScaler ------------------------------------------------------
def _poke_inf(i, model, opt) -> None:
    if i == 2:
        model[2].weight.grad[3, 5] = float("inf")


def _assert_same_with_nan(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got, ref = got.float().flatten(), ref.float().flatten()
    assert torch.equal(got.isnan(), ref.isnan()), f"{what}: NaN where torch has none or v.v."
    assert torch.equal(got.isinf(), ref.isinf()), f"{what}: inf where torch has none or v.v."
    fin = ref.isfinite()
    err = float((got[fin] - ref[fin]).abs().max() / ref[fin].abs().max().clamp_min(1e-30))
    assert err <= 1e-5, f"{what}: rel_err={err:.2e}"


@pytest.mark.parametrize("mode", ["none", *OFFLOADED])
def test_inf_gradient_without_scaler_steps_as_torch(tmp_path, mode):
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    ref_opt = torch_opt(ref.parameters())
    with num_threads(1), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "step skipped" warning
        train(model, opt, steps=3, before_step=_poke_inf)
        train(ref, ref_opt, steps=3, before_step=_poke_inf)
    assert bool(flat(ref).isnan().any()), "torch writes NaN into the weights"
    _assert_same_with_nan(flat(model), flat(ref), "weights")
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    for i, rst in rsd["state"].items():
        assert float(sd["state"][i]["step"]) == float(rst["step"]) == 3.0
        for k in ("exp_avg", "exp_avg_sq"):
            _assert_same_with_nan(sd["state"][i][k], rst[k], f"state[{i}][{k!r}]")
    close(opt)


@pytest.mark.parametrize("mode", OFFLOADED)
def test_skip_nonfinite_skips_the_step(tmp_path, mode):
    model = build_model()
    opt = tl_opt(mode, model.parameters(), tmp_path, skip_nonfinite=True)
    with num_threads(1):
        train(model, opt, steps=2)
        before = snapshot(model, opt)
        with pytest.warns(RuntimeWarning, match="NaN/Inf.*skipped"):
            train(model, opt, steps=1, start=2, before_step=_poke_inf)
        assert opt.last_step_stats["skipped"]
        assert_same_snapshot(before, snapshot(model, opt), "skipped step")
    close(opt)


def test_skip_nonfinite_is_typed_and_needs_offload(tmp_path):
    params = list(build_model().parameters())
    with pytest.raises(TypeError, match="skip_nonfinite must be a bool"):
        tierlift.optim.AdamW(params, offload="cpu", skip_nonfinite=1)
    with pytest.raises(ValueError, match="skip_nonfinite=True needs offload"):
        tierlift.optim.AdamW(params, skip_nonfinite=True)


# ---- a 0-element parameter -------------------------------------------------------------------
class _WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(32, 8)
        self.empty = nn.Parameter(torch.zeros(0))
        self.empty2 = nn.Parameter(torch.zeros(0, 5))
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return self.lin(x) + self.bias + self.empty.sum() + self.empty2.sum()


def _fit_empty(model, opt, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        x, y = batch(0, i)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("mode", OFFLOADED)
def test_empty_parameter_round_trips_through_torch(tmp_path, mode, amsgrad):
    model = _WithEmpty()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path, amsgrad=amsgrad)
    ref_opt = torch_opt(ref.parameters(), amsgrad=amsgrad)
    with num_threads(1):
        _fit_empty(model, opt, 2)
        _fit_empty(ref, ref_opt, 2)
        sd = opt.state_dict()
        rsd = ref_opt.state_dict()
        for i, rst in rsd["state"].items():
            assert sd["state"][i].keys() == rst.keys(), f"state[{i}]"
            for k, v in rst.items():
                assert sd["state"][i][k].shape == v.shape, f"state[{i}][{k!r}]"
        # ours -> torch, one step
        there = twin(model)
        there_opt = torch_opt(there.parameters(), amsgrad=amsgrad)
        there_opt.load_state_dict(sd)
        _fit_empty(there, there_opt, 1, start=2)
        # torch -> ours, one more step
        back = twin(there)
        sub = tmp_path / "back"
        sub.mkdir()
        back_opt = tl_opt(mode, back.parameters(), sub, amsgrad=amsgrad)
        back_opt.load_state_dict(there_opt.state_dict())
        _fit_empty(back, back_opt, 1, start=3)
        _fit_empty(ref, ref_opt, 2, start=2)
    assert_matches_torch(back, ref)
    close(opt)
    close(back_opt)


# ---- hyperparameter types, meta parameters ---------------------------------------------------
BAD_TYPES = [
    (dict(lr="0.001"), "lr"),
    (dict(lr=None), "lr"),
    (dict(lr=True), "lr"),
    (dict(betas=("0.9", 0.999)), r"betas\[0\]"),
    (dict(betas=0.9), "betas"),
    (dict(eps="1e-8"), "eps"),
    (dict(weight_decay=None), "weight_decay"),
    (dict(amsgrad="no"), "amsgrad"),
    (dict(maximize=1), "maximize"),
    (dict(foreach="yes"), "foreach"),
    (dict(capturable=0), "capturable"),
    (dict(fused="no"), "fused"),
]


@pytest.mark.parametrize("cls_name", list(CLASSES))
@pytest.mark.parametrize("kw,name", BAD_TYPES, ids=[str(k) for k, _ in BAD_TYPES])
@pytest.mark.parametrize("mode", ["none", "cpu", "nvme2"])
def test_hyperparameter_of_wrong_type_is_refused(tmp_path, mode, kw, name, cls_name):
    params = list(build_model().parameters())
    with pytest.raises(TypeError, match=rf"^{name} must be "):
        tl_opt(mode, params, tmp_path, cls=CLASSES[cls_name][0], **kw)
    _drive_empty(tmp_path)


def test_decoupled_weight_decay_must_be_a_bool():
    params = list(build_model().parameters())
    with pytest.raises(TypeError, match="^decoupled_weight_decay must be a bool"):
        tierlift.optim.Adam(params, decoupled_weight_decay="yes")


@pytest.mark.parametrize("mode", ["none", *OFFLOADED])
def test_hyperparameter_of_wrong_type_in_a_group_is_refused_at_step(tmp_path, mode):
    model = build_model()
    opt = tl_opt(mode, model.parameters(), tmp_path)
    with num_threads(1):
        train(model, opt, steps=1)
        before = snapshot(model, opt)
        opt.param_groups[0]["lr"] = "0.01"
        with pytest.raises(TypeError, match=r"param_groups\[0\]\['lr'\] must be a float"):
            train(model, opt, steps=1, start=1)
        opt.param_groups[0]["lr"] = before[1]["param_groups"][0]["lr"]
        assert_same_snapshot(before, snapshot(model, opt), "refused step")
        opt.zero_grad()
        train(model, opt, steps=1, start=1)  # and it steps again once fixed
    close(opt)


def test_valid_hyperparameter_types_are_accepted():
    params = list(build_model().parameters())
    tierlift.optim.AdamW(params, lr=1, eps=0, weight_decay=0)  # ints, as torch takes them
    tierlift.optim.AdamW(params, lr=torch.tensor(1e-3), betas=[0.9, 0.99])
    tierlift.optim.AdamW(params, lr=torch.tensor([1e-3]), foreach=None, fused=None)


@pytest.mark.parametrize("mode", OFFLOADED)
def test_meta_parameter_is_refused(tmp_path, mode):
    params = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.empty(8, device="meta"))]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape "
                       r"\(8,\)\) is on the meta device.*to_empty"):
        tl_opt(mode, params, tmp_path)
    _drive_empty(tmp_path)


# ---- an optimizer dropped while a thread starts ----------------------------------------------
_DROP = """
import gc, sys, threading, torch, tierlift
p = torch.nn.Parameter(torch.randn(3000))
opt = tierlift.optim.AdamW([p], offload="cpu", overlap=True)
for _ in range(2):
    (p * p).sum().backward()
    opt.step()
    opt.zero_grad()
del opt  # the optimizer and its Offloader reference each other: freed by the collector
# The collector may run in a thread that is starting, which holds this lock.
with threading._shutdown_locks_lock:
    gc.collect()
print("collected")
"""


@pytest.mark.skipif(not hasattr(threading, "_shutdown_locks_lock"), reason="threading internals")
def test_optimizer_collected_while_a_thread_starts_does_not_deadlock():
    out = subprocess.run([sys.executable, "-c", _DROP], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "collected" in out.stdout, out.stderr[-2000:]
