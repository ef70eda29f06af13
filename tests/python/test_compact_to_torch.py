"""A compact optimizer state dict (state_dtype="bf16") and torch's optimizers: its uint8
exp_avg_sq codes are saved under "exp_avg_sq_codes", so torch.optim.AdamW, which would cast them
to float and step on codes 1..255 as second moments, raises at its step instead. tierlift's own
round trips stay exact (compact -> compact; compact -> fp32 -> torch), a state dict that has the
codes under "exp_avg_sq" (saved before the key) still loads, and a dict whose codes cannot be
read is refused before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch

import tierlift
import tierlift.optim.adam as adam_module
from tierlift.optim import AdamW
from tierlift.reference.optim_compact import dequantize_exp_avg_sq

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))


def _train(model, opt, steps=STEPS, start=0) -> None:
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _compact(model, **kw):
    return AdamW(model.parameters(), lr=1e-2, state_dtype="bf16", **kw)


def _trained(**kw):
    model = _model()
    opt = _compact(model, **kw)
    _train(model, opt)
    return model, opt


def _old_keys(sd: dict) -> dict:
    """`sd` as tierlift saved compact state before "exp_avg_sq_codes": the codes under
    "exp_avg_sq"."""
    sd = copy.deepcopy(sd)
    for st in sd["state"].values():
        st["exp_avg_sq"] = st.pop("exp_avg_sq_codes")
    return sd


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same_state(sd: dict, ref: dict) -> None:
    assert sd["state"].keys() == ref["state"].keys()
    for i, st in ref["state"].items():
        assert st.keys() == sd["state"][i].keys()
        for k, v in st.items():
            assert v.dtype == sd["state"][i][k].dtype and torch.equal(v, sd["state"][i][k]), k


@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("torch_kw", [{}, {"foreach": True}], ids=["default", "foreach"])
def test_torch_adamw_raises_instead_of_stepping_on_codes(offload, torch_kw):
    model, opt = _trained(offload=offload)
    sd = opt.state_dict()
    assert all("exp_avg_sq" not in st and st["exp_avg_sq_codes"].dtype == torch.uint8
               for st in sd["state"].values())
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, **torch_kw)
    plain.load_state_dict(sd)
    before = _weights(model)
    with pytest.raises(KeyError, match="exp_avg_sq"):
        _train(model, plain, steps=1)
    for a, b in zip(_weights(model), before):
        assert torch.equal(a, b)  # no step was taken on the codes


def test_compact_to_compact_is_exact():
    model, opt = _trained()
    ref = copy.deepcopy(model)
    ref_opt = _compact(ref)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load shares the steps
    _assert_same_state(ref_opt.state_dict(), opt.state_dict())
    _train(model, opt, start=STEPS)
    _train(ref, ref_opt, start=STEPS)
    for a, b in zip(_weights(ref), _weights(model)):
        assert torch.equal(a, b)


def test_compact_through_fp32_into_torch_is_exact():
    """The supported route: tierlift's fp32-state AdamW dequantizes, torch's loads its dict and
    steps exactly as torch's AdamW given the dequantized moments directly."""
    model, opt = _trained()
    sd = opt.state_dict()
    fp32_model = copy.deepcopy(model)
    fp32 = AdamW(fp32_model.parameters(), lr=1e-2)
    fp32.load_state_dict(sd)
    via = torch.optim.AdamW(fp32_model.parameters(), lr=1e-2)
    via.load_state_dict(fp32.state_dict())
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    ref.load_state_dict({"param_groups": sd["param_groups"], "state": {
        i: {"step": st["step"].clone(), "exp_avg": st["exp_avg"].float(),
            "exp_avg_sq": dequantize_exp_avg_sq(st["exp_avg_sq_codes"], st["exp_avg_sq_scale"])}
        for i, st in sd["state"].items()}})
    _train(fp32_model, via, start=STEPS)
    _train(ref_model, ref, start=STEPS)
    for a, b in zip(_weights(fp32_model), _weights(ref_model)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_state_dict_with_codes_under_exp_avg_sq_still_loads(offload):
    model, opt = _trained()
    new = _compact(copy.deepcopy(model), offload=offload)
    new.load_state_dict(opt.state_dict())
    old = _compact(copy.deepcopy(model), offload=offload)
    old.load_state_dict(_old_keys(opt.state_dict()))
    _assert_same_state(old.state_dict(), new.state_dict())
    _assert_same_state(old.state_dict(), opt.state_dict())
    # and into an fp32-state optimizer, dequantized as from the new keys
    fp32_new, fp32_old = AdamW(_model().parameters()), AdamW(_model().parameters())
    fp32_new.load_state_dict(opt.state_dict())
    fp32_old.load_state_dict(_old_keys(opt.state_dict()))
    _assert_same_state(fp32_old.state_dict(), fp32_new.state_dict())


def _both_keys(sd):
    for st in sd["state"].values():
        st["exp_avg_sq"] = st["exp_avg_sq_codes"].float()


def _through_torch(sd):
    """What torch.optim.AdamW's state_dict() gives after loading a compact one: the codes (and
    scales) cast to the parameter's dtype."""
    for st in sd["state"].values():
        st["exp_avg_sq_codes"] = st["exp_avg_sq_codes"].float()


def _codes_without_scales(sd):
    for st in sd["state"].values():
        del st["exp_avg_sq_scale"]


def _scales_without_codes(sd):
    """As set_state_dict(flatten_optimizer_state_dict=True) rebuilds a key it did not find."""
    for st in sd["state"].values():
        del st["exp_avg_sq_codes"]
        st["exp_avg_sq"] = {}


def _old_codes_without_scales(sd):
    for st in sd["state"].values():
        st["exp_avg_sq"] = st.pop("exp_avg_sq_codes")
        del st["exp_avg_sq_scale"]


@pytest.mark.parametrize("state_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("edit, match", [
    (_both_keys, "both 'exp_avg_sq' and 'exp_avg_sq_codes'"),
    (_through_torch, "torch.float32 codes under 'exp_avg_sq_codes'.*load the original"),
    (_codes_without_scales, "and no 'exp_avg_sq_scale'"),
    (_scales_without_codes, "'exp_avg_sq_scale' but no codes"),
    (_old_codes_without_scales, "uint8 'exp_avg_sq' without 'exp_avg_sq_scale'"),
], ids=["both_keys", "through_torch", "no_scales", "no_codes", "old_key_no_scales"])
def test_unreadable_codes_refused_before_any_change(state_dtype, offload, edit, match):
    model, opt = _trained()
    bad = copy.deepcopy(opt.state_dict())
    edit(bad)
    target_model = copy.deepcopy(model)
    target = AdamW(target_model.parameters(), lr=1e-3, state_dtype=state_dtype, offload=offload)
    _train(target_model, target, steps=1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=match) as e:
        target.load_state_dict(bad)
    assert "Nothing was changed" in str(e.value)
    _assert_same_state(target.state_dict(), before)
    assert target.param_groups[0]["lr"] == 1e-3


def test_replicated_checkpoint_keeps_loading_and_refuses_torch(tmp_path, monkeypatch):
    """tierlift.checkpoint's files hold the state dict's keys: a new file loads back exactly and
    its optimizer_state_dict() makes torch's AdamW raise; a file written before the codes key
    (codes under "exp_avg_sq") still loads exactly."""
    model, opt = _trained()
    tierlift.checkpoint.save(str(tmp_path / "new"), model, opt)
    with monkeypatch.context() as m:
        m.setattr(adam_module, "saved_codes", lambda sd: sd)  # as saved before the key
        tierlift.checkpoint.save(str(tmp_path / "old"), model, opt)
    _train(model, opt, start=STEPS)
    for name in ("new", "old"):
        fresh_model = _model()
        fresh = _compact(fresh_model)
        tierlift.checkpoint.load(str(tmp_path / name), fresh_model, fresh)
        _train(fresh_model, fresh, start=STEPS)
        for a, b in zip(_weights(fresh_model), _weights(model)):
            assert torch.equal(a, b), name
    model, opt = _trained(offload="cpu")  # the tiers' files name the codes exp_avg_sq
    tierlift.checkpoint.save(str(tmp_path / "offloaded"), model, opt)
    opt.close()
    for name in ("new", "old", "offloaded"):
        plain_model = _model()
        plain = torch.optim.AdamW(plain_model.parameters())
        plain.load_state_dict(tierlift.checkpoint.optimizer_state_dict(str(tmp_path / name)))
        before = _weights(plain_model)
        with pytest.raises(KeyError, match="exp_avg_sq"):
            _train(plain_model, plain, steps=1)
        assert all(torch.equal(a, b) for a, b in zip(_weights(plain_model), before)), name


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_distributed_checkpoint_state_dict_round_trip(flatten):
    """torch.distributed.checkpoint's get_state_dict/set_state_dict: flattened, it rebuilds the
    state from optimizer.state's keys, so those are the state dict's (the codes' key in both).
    Into torch's AdamW the state loads and its step raises."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, opt = _trained()
    _, osd = get_state_dict(model, opt, options=options)
    twin = copy.deepcopy(model)
    twin_opt = _compact(twin)
    set_state_dict(twin, twin_opt, model_state_dict=model.state_dict(),
                   optim_state_dict=copy.deepcopy(osd), options=options)
    _assert_same_state(twin_opt.state_dict(), opt.state_dict())
    _train(model, opt, start=STEPS)
    _train(twin, twin_opt, start=STEPS)
    for a, b in zip(_weights(twin), _weights(model)):
        assert torch.equal(a, b)
    plain_model = copy.deepcopy(model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    set_state_dict(plain_model, plain, model_state_dict=model.state_dict(),
                   optim_state_dict=copy.deepcopy(osd), options=options)
    before = _weights(plain_model)
    with pytest.raises((KeyError, AttributeError)):  # no "exp_avg_sq" / DCP's {} in its place
        _train(plain_model, plain, steps=1)
    if not flatten:  # flattened, torch's step decays a weight before it reaches the {}
        for a, b in zip(_weights(plain_model), before):
            assert torch.equal(a, b)


def test_optimizer_pickled_with_codes_under_exp_avg_sq_steps_on():
    """An optimizer pickled (torch.save(optimizer)) before the codes had their own key."""
    model, opt = _trained()
    ref = copy.deepcopy(model)
    ref_opt = _compact(ref)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    pickled = copy.deepcopy(opt.__getstate__())
    for st in pickled["state"].values():
        st["exp_avg_sq"] = st.pop("exp_avg_sq_codes")
    old = AdamW.__new__(AdamW)
    old.__setstate__(pickled)
    old.param_groups[0]["params"] = list(model.parameters())  # the pickled ones are copies
    old.state = {p: st for p, st in zip(model.parameters(), pickled["state"].values())}
    _train(model, old, start=STEPS)
    _train(ref, ref_opt, start=STEPS)
    for a, b in zip(_weights(ref), _weights(model)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_offloaded_flattened_distributed_checkpoint_loads_as_nested(state_dtype, param_dtype):
    """Flattened, set_state_dict rebuilds each state from optimizer.state's keys: under offload
    they are the state dict's (moments, and a bf16 parameter's master, read from the tiers), so
    the flattened load steps on exactly as the nested one. Keys of "step" alone restarted the
    moments from zero (8e-2 relative off in the weights three steps later); without the master
    key a bf16 parameter's master was re-made from the rounded parameter (7e-3 off)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    model = _model().to(param_dtype)
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype, offload="cpu")
    _train_in(model, opt)
    loaded = []
    for flatten in (True, False):
        twin = copy.deepcopy(model)
        twin_opt = AdamW(twin.parameters(), lr=1e-2, state_dtype=state_dtype, offload="cpu")
        _train_in(twin, twin_opt, steps=1)
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        _, osd = get_state_dict(model, opt, options=options)
        set_state_dict(twin, twin_opt, model_state_dict=model.state_dict(),
                       optim_state_dict=copy.deepcopy(osd), options=options)
        _assert_same_state(twin_opt.state_dict(), opt.state_dict())
        loaded.append((twin, twin_opt))
    # a state dict with step counts and no moments is still refused, not restarted from zero
    steps_only = copy.deepcopy(opt.state_dict())
    steps_only["state"] = {i: {"step": st["step"]} for i, st in steps_only["state"].items()}
    before = copy.deepcopy(loaded[0][1].state_dict())
    with pytest.raises(ValueError, match="step count but no 'exp_avg'.*Nothing was changed"):
        loaded[0][1].load_state_dict(steps_only)
    _assert_same_state(loaded[0][1].state_dict(), before)
    _train_in(model, opt, start=STEPS)
    for twin, twin_opt in loaded:
        _train_in(twin, twin_opt, start=STEPS)
        for a, b in zip(_weights(twin), _weights(model)):
            assert torch.equal(a, b)


def _train_in(model, opt, steps=STEPS, start=0) -> None:
    """_train in the model's dtype."""
    dtype = next(model.parameters()).dtype
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
