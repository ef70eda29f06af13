"""What users commonly do with an optimizer, done with an offloaded one: a model converted with
model.to(memory_format=torch.channels_last) (or a transposed weight) before the optimizer is
built, stepped, saved and loaded as torch's AdamW does it, its layout kept; amsgrad switched on
after steps (torch raises), refused before anything changes; loops over optimizer.state[p]'s
items that log the moments (read from the tiers, as torch's), reset them (refused before any
change; clear() resets as torch's reset does) or move them to a device (frameworks: a no-op
that keeps training as torch's)."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from conformance_util import (
    CHUNK,
    HYBRID_BUDGET,
    assert_bitwise,
    assert_matches_torch,
    assert_same_snapshot,
    close,
    snapshot,
)
from torch import nn

import tierlift
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

HYPER = dict(lr=1e-2, weight_decay=0.1)
STRIDED_MODES = {
    "cpu": dict(offload="cpu"),
    "cpu_ov": dict(offload="cpu", overlap=True),
    "nvme1": dict(offload="nvme", nvme_generations=1),
    "nvme2": dict(offload="nvme"),
    "nvme2_ov": dict(offload="nvme", overlap=True),
    "hybrid_ov": dict(offload="hybrid", overlap=True, cpu_budget=HYBRID_BUDGET),
    "durable1": dict(offload="nvme", durable=True, nvme_generations=1),
}


class Net(nn.Module):
    """Two convolutions (channels_last after _strided) and a linear layer whose weight is a
    transposed view: every kind of strided parameter a model brings."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 16, 3)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.head = nn.Linear(32, 10)
        self.to(dtype)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x)).mean((2, 3))
        return self.head(x)


def _strided(model: Net) -> Net:
    model.to(memory_format=torch.channels_last)
    w = model.head.weight
    w.data = w.data.t().contiguous().t()  # the same values, column-major
    return model


def _net(strided: bool, dtype=torch.float32) -> Net:
    return _strided(Net(dtype)) if strided else Net(dtype)


def _fit(model, opt, steps) -> None:
    dtype = next(model.parameters()).dtype
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, 3, 10, 10, generator=g).to(dtype)
        y = torch.randn(4, 10, generator=g).to(dtype)
        F.mse_loss(model(x.to(memory_format=torch.channels_last)).float(), y.float()).backward()
        opt.step()
        opt.zero_grad()


MODES = {**STRIDED_MODES, "c_cpu": dict(offload="cpu", state_dtype="bf16")}


def _opt(mode, model, tmp_path, sub="a", **kw):
    kw = {**HYPER, **MODES[mode], **kw, "chunk_bytes": CHUNK}
    if kw["offload"] in ("nvme", "hybrid"):
        path = tmp_path / sub
        path.mkdir(exist_ok=True)
        kw["nvme_path"] = str(path)
    return AdamW(model.parameters(), **kw)


def _layouts(model) -> list:
    return [p.stride() for p in model.parameters()]


def _assert_strided(model) -> None:
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert model.conv2.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.conv2.weight.is_contiguous()
    assert model.head.weight.stride() == (1, 10)


@pytest.mark.parametrize("mode", list(STRIDED_MODES))
def test_strided_params_step_save_and_load_as_torch(tmp_path, mode):
    """Weights and moments as torch's AdamW after 3 steps, the layout kept; a state dict and a
    checkpoint saved then, loaded into a new strided model and optimizer, continue as torch."""
    ref = _net(True)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    _fit(ref, ref_opt, range(3))
    model = _net(True)
    layouts = _layouts(model)
    opt = _opt(mode, model, tmp_path)
    try:
        _fit(model, opt, range(3))
        if opt._offload.config.overlap:  # chunks were stepped during backward, and kept
            assert opt.last_step_stats["overlap_kept_chunks"] > 0
        assert _layouts(model) == layouts
        _assert_strided(model)
        assert_matches_torch(model, ref)
        sd, rsd = opt.state_dict(), ref_opt.state_dict()
        for i, rst in rsd["state"].items():
            assert float(sd["state"][i]["step"]) == float(rst["step"])
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(sd["state"][i][k], rst[k], rtol=1e-5, atol=1e-9)
        ck = str(tmp_path / "ckpt")
        tierlift.checkpoint.save(ck, model, opt)
        _fit(ref, ref_opt, range(3, 5))
        # the state is held in logical order: a contiguous model and torch's AdamW load it too
        for how in ("state_dict", "checkpoint", "contiguous", "torch"):
            again = _net(how not in ("contiguous", "torch"))
            if how == "torch":
                again_opt = torch.optim.AdamW(again.parameters(), fused=True, **HYPER)
            else:
                again_opt = _opt(mode, again, tmp_path, sub=how)
            try:
                if how in ("state_dict", "torch"):
                    again.load_state_dict(model.state_dict())
                    again_opt.load_state_dict(
                        sd if how == "state_dict" else tierlift.checkpoint.optimizer_state_dict(ck))
                else:
                    tierlift.checkpoint.load(ck, again, again_opt)
                _fit(again, again_opt, range(3, 5))
                if how in ("state_dict", "checkpoint"):
                    _assert_strided(again)
                    assert _layouts(again) == layouts
                assert_matches_torch(again, ref, what=how)
            finally:
                close(again_opt)
    finally:
        close(opt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["cpu", "nvme2_ov"])
def test_strided_params_step_as_contiguous_ones(tmp_path, mode, dtype):
    """Bit for bit as the same model with contiguous parameters (bf16: its fp32 masters too)."""
    got, want = _net(True, dtype), _net(False, dtype)
    opts = [_opt(mode, got, tmp_path, "s"), _opt(mode, want, tmp_path, "c")]
    try:
        # the same gradients (a convolution's backward rounds differently in each layout)
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            for a, b in zip(got.parameters(), want.parameters()):
                grad = torch.randn(b.shape, generator=g).to(dtype)
                a.grad, b.grad = torch.empty_like(a).copy_(grad), grad  # each in its layout
            for o in opts:
                o.step()
        _assert_strided(got)
        assert_bitwise(got, want)
        (_, sa), (_, sb) = snapshot(got, opts[0]), snapshot(want, opts[1])
        for i, st in sb["state"].items():
            for k, v in st.items():
                assert torch.equal(sa["state"][i][k], v), (i, k)
    finally:
        for o in opts:
            close(o)


def test_strided_param_changed_to_another_layout_steps_as_torch(tmp_path):
    """A parameter laid out strided may take another layout later (its state is held in logical
    order); torch's AdamW steps it the same. The reference is torch's single-tensor AdamW: its
    fused one, whose moments keep the old layout, is 14% off it after 2 more steps."""
    ref, model = _net(True), _net(True)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **HYPER)
    opt = _opt("nvme2", model, tmp_path)
    try:
        for m, o in ((ref, ref_opt), (model, opt)):
            _fit(m, o, range(2))
            m.to(memory_format=torch.contiguous_format)
            _fit(m, o, range(2, 4))
        assert model.conv2.weight.is_contiguous()
        assert_matches_torch(model, ref)
    finally:
        close(opt)


@pytest.mark.parametrize("gens", [1, 2])
def test_strided_params_reopened_from_durable_state(tmp_path, gens):
    """A durable reopen puts the committed weights into strided parameters, layout kept."""
    ref, ref_opt = _torch_twin(range(5), strided=True)
    model = _net(True)
    kw = dict(durable=True, nvme_generations=gens)
    opt = _opt("nvme2", model, tmp_path, **kw)
    _fit(model, opt, range(3))
    close(opt)
    again = _net(True)
    with torch.no_grad():
        again.conv2.weight.zero_()
    with pytest.warns(RuntimeWarning, match="reopen"):
        again_opt = _opt("nvme2", again, tmp_path, **kw)
    try:
        assert_bitwise(again, model)
        _assert_strided(again)
        _fit(again, again_opt, range(3, 5))
        assert_matches_torch(again, ref)
    finally:
        close(again_opt)


@pytest.mark.parametrize("mode", ["cpu_ov", "nvme2_ov"])
def test_strided_param_edited_between_backward_and_step_steps_as_torch(tmp_path, mode):
    """The chunks the overlap stepped from the weights before the edit are stepped again."""
    ref, model = _net(True), _net(True)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = _opt(mode, model, tmp_path)
    try:
        for m, o in ((ref, ref_opt), (model, opt)):
            _fit(m, o, range(2))
            g = torch.Generator().manual_seed(2)
            x = torch.randn(4, 3, 10, 10, generator=g).to(memory_format=torch.channels_last)
            F.mse_loss(m(x), torch.randn(4, 10, generator=g)).backward()
            with torch.no_grad():
                m.conv2.weight.mul_(0.5)
            o.step()
            o.zero_grad()
        assert opt.last_step_stats["overlap_redone_chunks"] > 0
        _assert_strided(model)
        assert_matches_torch(model, ref)
    finally:
        close(opt)


def test_parameter_sharing_memory_is_refused(tmp_path):
    """An expanded parameter: torch's in-place update fails on it too; refused at build."""
    p = nn.Parameter(torch.zeros(4, 1).expand(4, 3))
    with pytest.raises(ValueError, match="share memory"):
        AdamW([p], offload="cpu")


@pytest.mark.parametrize("mode", ["none", "cpu", "nvme2"])
def test_amsgrad_switched_on_after_steps_is_refused_before_any_change(tmp_path, mode):
    """torch's AdamW raises KeyError ('max_exp_avg_sq'); ours says why, changing nothing. Without
    offload, a maximum put into the state as the message asks steps as torch steps it."""
    ref, model = Net(), Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **HYPER)
    kw = {} if mode == "none" else {"chunk_bytes": CHUNK, **STRIDED_MODES[mode]}
    if mode == "nvme2":
        kw["nvme_path"] = str(tmp_path)
    opt = AdamW(model.parameters(), **HYPER, **kw)
    try:
        for m, o in ((ref, ref_opt), (model, opt)):
            _fit(m, o, range(2))
            o.param_groups[0]["amsgrad"] = True
        with pytest.raises(KeyError, match="max_exp_avg_sq"):
            _fit(ref, ref_opt, [2])
        before = snapshot(model, opt)
        with pytest.raises(ValueError, match="amsgrad"):
            _fit(model, opt, [2])
        assert_same_snapshot(snapshot(model, opt), before, "refused step")
        if mode != "none":
            return  # the state kinds of an offloaded optimizer are laid out at construction
        for m, o in ((ref, ref_opt), (model, opt)):
            for p in m.parameters():
                o.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
            _fit(m, o, range(2, 4))
        assert_matches_torch(model, ref)
    finally:
        close(opt)


def _torch_twin(steps, strided=False):
    ref = _net(strided)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    _fit(ref, ref_opt, steps)
    return ref, ref_opt


@pytest.mark.parametrize("mode", ["cpu", "nvme2", "nvme2_ov"])
def test_state_items_yield_the_moments_as_torch(tmp_path, mode):
    """optimizer.state[p] as a mapping (keys, iteration, `in`, len(), get(), [name], items(),
    values()) holds torch's keys, moments before "step", with torch's values; read when used, so
    a value taken before a step reads the stepped moment, as torch's live state tensor does."""
    ref, ref_opt = _torch_twin(range(2))
    model = Net()
    opt = _opt(mode, model, tmp_path)
    try:
        _fit(model, opt, range(2))
        held = {}
        for p, r in zip(model.parameters(), ref.parameters()):
            items, rst = dict(opt.state[p].items()), ref_opt.state[r]
            assert list(items) == ["exp_avg", "exp_avg_sq", "step"]
            st = opt.state[p]
            assert list(st) == list(st.keys()) == list(items) and len(st) == 3
            assert "exp_avg" in st and "exp_avg_sq" in st and "max_exp_avg_sq" not in st
            assert len(st.values()) == 3 and st.keys() == rst.keys()
            for k in rst:  # by name, as monitoring code reads them
                torch.testing.assert_close(st[k], rst[k], rtol=1e-5, atol=1e-9)
                torch.testing.assert_close(st.get(k), rst[k], rtol=1e-5, atol=1e-9)
            assert st.get("max_exp_avg_sq", 7) == 7
            for k, v in items.items():
                assert torch.is_tensor(v) and v.shape == rst[k].shape and v.dtype == rst[k].dtype
                torch.testing.assert_close(v, rst[k], rtol=1e-5, atol=1e-9)
                assert float(v.norm()) == pytest.approx(float(rst[k].norm()), rel=1e-5)
            torch.testing.assert_close(torch.stack([items["exp_avg"]])[0], rst["exp_avg"])
            with pytest.raises(RuntimeError, match="cannot be changed in place"):
                torch.mul(rst["exp_avg"], 0, out=items["exp_avg"])
            held[p] = items["exp_avg"]
        # a copy of the state holds the moments, as a copy of torch's does
        copied = list(copy.deepcopy(opt.state).values())
        for st, r in zip(copied, ref.parameters()):
            assert type(st) is dict and st.keys() == ref_opt.state[r].keys()
            torch.testing.assert_close(st["exp_avg"], ref_opt.state[r]["exp_avg"])
        _fit(model, opt, [2])
        _fit(ref, ref_opt, [2])
        for v, r in zip(held.values(), ref.parameters()):
            torch.testing.assert_close(v * 1, ref_opt.state[r]["exp_avg"], rtol=1e-5, atol=1e-9)
    finally:
        close(opt)


def test_compact_state_items_are_the_state_dict_s(tmp_path):
    model = Net()
    opt = _opt("c_cpu", model, tmp_path)
    try:
        _fit(model, opt, range(2))
        sd = opt.state_dict()["state"]
        for i, p in enumerate(model.parameters()):
            items = dict(opt.state[p].items())
            assert items.keys() == sd[i].keys() - {"master"}
            for k, v in items.items():
                assert torch.equal(v * 1 if v.dtype.is_floating_point else v.clone(), sd[i][k])
    finally:
        close(opt)


def _reset_every_state_tensor(opt, params) -> None:
    for p in params:
        for _, v in opt.state[p].items():
            if torch.is_tensor(v):
                v.zero_()


def _reset_every_state_tensor_by_key(opt, params) -> None:
    for p in params:
        for k in opt.state[p]:
            if torch.is_tensor(opt.state[p][k]):
                opt.state[p][k].zero_()


def _reset_every_state_tensor_by_assignment(opt, params) -> None:
    for p in params:
        st = opt.state[p]
        for k in st:
            if torch.is_tensor(st[k]):
                st[k] = torch.zeros_like(st[k])  # the step count after the moments


def _reset_every_state_tensor_by_update(opt, params) -> None:
    for p in params:
        st = opt.state[p]
        st.update({k: torch.zeros_like(v) for k, v in st.items() if torch.is_tensor(v)})


@pytest.mark.parametrize("reset", [_reset_every_state_tensor, _reset_every_state_tensor_by_key,
                                   _reset_every_state_tensor_by_assignment,
                                   _reset_every_state_tensor_by_update],
                         ids=["items", "keys", "assigned", "updated"])
@pytest.mark.parametrize("mode", ["cpu", "nvme2_ov"])
def test_reset_loop_is_refused_and_clear_resets_as_torch(tmp_path, mode, reset):
    """torch's reset of every state tensor (pruning, rewinding), over the items or the keys, met
    an offloaded optimizer's "step" alone and left the moments (Adam went on from them with a
    restarted bias correction): refused before any change. clear() is the reset."""
    ref, ref_opt = _torch_twin(range(2))
    model = Net()
    opt = _opt(mode, model, tmp_path)
    try:
        _fit(model, opt, range(2))
        before = snapshot(model, opt)
        with pytest.raises(RuntimeError, match="cannot be changed in place.*Nothing was changed"):
            reset(opt, model.parameters())
        st = opt.state[model.head.weight]
        for k in ("exp_avg", "exp_avg_sq"):
            with pytest.raises(RuntimeError, match="cannot be changed in place"):
                dict(st.items())[k].detach().mul_(0)
            for remove, args in ((st.pop, (k,)), (st.pop, (k, None)), (st.__delitem__, (k,))):
                with pytest.raises(RuntimeError, match=r"clear\(\).*Nothing was changed"):
                    remove(*args)
        with pytest.raises(RuntimeError, match="Nothing was changed"):
            st.popitem()
        assert_same_snapshot(snapshot(model, opt), before, "refused reset")
        assert torch.is_tensor(st.setdefault("exp_avg", None))  # held: nothing put in
        assert list(st) == ["exp_avg", "exp_avg_sq", "step"]
        reset(ref_opt, ref.parameters())
        for p in model.parameters():
            opt.state[p].clear()
        _fit(model, opt, range(2, 4))
        _fit(ref, ref_opt, range(2, 4))
        assert_matches_torch(model, ref)
    finally:
        close(opt)


def _move_each_value(opt, device) -> None:  # Lightning's _optimizer_to_device
    for state in opt.state.values():
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device=device)


def _rebuild_as_dict(opt, device) -> None:  # a resume script's
    for p in list(opt.state):
        opt.state[p] = {k: v.to(device) if torch.is_tensor(v) else v
                        for k, v in opt.state[p].items()}


def _rebuild_as_its_type(opt, device) -> None:  # Lightning's apply_to_collection
    for p in list(opt.state):
        st = opt.state[p]
        opt.state[p] = type(st)(OrderedDict((k, v.to(device) if torch.is_tensor(v) else v)
                                            for k, v in st.items()))


@pytest.mark.parametrize("move", [_move_each_value, _rebuild_as_dict, _rebuild_as_its_type])
@pytest.mark.parametrize("mode", ["cpu", "nvme2_ov"])
def test_frameworks_moving_the_state_train_on_as_torch(tmp_path, mode, move):
    ref, ref_opt = _torch_twin(range(2))
    model = Net()
    opt = _opt(mode, model, tmp_path)
    try:
        _fit(model, opt, range(2))
        move(opt, "cpu")
        move(ref_opt, "cpu")
        for p in model.parameters():
            assert list(dict(opt.state[p].items())) == ["exp_avg", "exp_avg_sq", "step"]
        _fit(model, opt, range(2, 4))
        _fit(ref, ref_opt, range(2, 4))
        assert_matches_torch(model, ref)
        assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    finally:
        close(opt)


def test_moment_of_another_parameter_put_into_the_state_is_refused(tmp_path):
    model = Net()
    opt = _opt("cpu", model, tmp_path)
    try:
        _fit(model, opt, range(2))
        before = snapshot(model, opt)
        a, b = model.conv1.bias, model.head.bias
        dict.__setitem__(opt.state[b], "exp_avg", dict(opt.state[a].items())["exp_avg"])
        with pytest.raises(RuntimeError, match="another parameter"):
            _fit(model, opt, [2])
        dict.__delitem__(opt.state[b], "exp_avg")
        assert_same_snapshot(snapshot(model, opt), before, "refused step")
    finally:
        close(opt)
