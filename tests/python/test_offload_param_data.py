"""A parameter's data replaced after an offloaded optimizer was built (`p.data = x`: an
embedding grown or cut in place, model.to(torch.bfloat16), a layout change such as
model.to(memory_format=torch.channels_last)): the tiers were laid out for the parameter as it
was (its element count, its dtype, flat contiguous memory), so step(), state_dict() and
checkpoint saves refuse it with a clear error before anything changes. A grown embedding was
once stepped silently over its first rows only; a changed dtype or layout failed half way
(and left nvme_generations=1 refusing every later step). Once the change is undone, training
goes on as torch's."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from conformance_util import (
    OFFLOADED,
    assert_matches_torch,
    assert_same_snapshot,
    close,
    num_threads,
    snapshot,
    tl_opt,
    torch_opt,
)
from torch import nn

import tierlift

pytestmark = [
    pytest.mark.skipif(not tierlift._extension.available(), reason="compiled extension not loaded"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # durable reopens say so
]

ROWS = 100


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(ROWS, 16), nn.Linear(16, 4))


def _fit(model, opt, steps) -> None:
    for i in steps:
        _loss(model, i).backward()
        opt.step()
        opt.zero_grad()


def _loss(model, i: int):
    emb = model[0].weight
    g = torch.Generator().manual_seed(i)
    idx = torch.randint(0, emb.shape[0], (8,), generator=g)
    return F.mse_loss(model(idx).float(), torch.randn(8, 4, generator=g))


@contextlib.contextmanager
def _trained(tmp_path, mode: str, ref_steps: list):
    """(torch's model trained on `ref_steps`, tierlift's trained on steps 0 and 1 with `mode`,
    its optimizer, their snapshot), one thread, the optimizer closed at the end."""
    ref = _model()
    ref_opt = torch_opt(ref.parameters())
    model = _model()
    opt = tl_opt(mode, model.parameters(), tmp_path)
    with num_threads(1):
        try:
            _fit(ref, ref_opt, ref_steps)
            _fit(model, opt, [0, 1])
            yield ref, model, opt, snapshot(model, opt)
        finally:
            close(opt)


def _grow(model) -> None:  # new token rows, as a resize done in place would add
    w = model[0].weight
    w.data = torch.cat([w.data, torch.randn(20, 16)])


def _shrink(model) -> None:
    w = model[0].weight
    w.data = w.data[:80].clone()


def _bf16(model) -> None:
    model.to(torch.bfloat16)


def _transposed(model) -> None:  # the same values, strided as channels_last would be
    w = model[1].weight
    w.data = w.data.t().contiguous().t()


CHANGES = {"grow": (_grow, "1600 elements, now 1920"),
           "shrink": (_shrink, "1600 elements, now 1280"),
           "bf16": (_bf16, "dtype torch.float32, now torch.bfloat16"),
           "transposed": (_transposed, "now non-contiguous")}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("mode", OFFLOADED)
def test_replaced_param_data_is_refused_before_anything_changes(tmp_path, mode, change):
    edit, what = CHANGES[change]
    with _trained(tmp_path, mode, [0, 1, 3]) as (ref, model, opt, before):
        data = [p.data for p in model.parameters()]
        edit(model)
        msg = f"is not the tensor the offloaded state was laid out for \\({what}"
        # With overlap the gradient hooks may step chunks ahead; step() refuses them all.
        with pytest.raises(RuntimeError, match=msg):
            _loss(model, 2).backward()
            opt.step()
        with pytest.raises(RuntimeError, match=msg):
            opt.state_dict()
        with pytest.raises(RuntimeError, match=msg):
            tierlift.checkpoint.save(str(tmp_path / "ckpt"), model, opt)
        opt.zero_grad()
        for p, d in zip(model.parameters(), data):  # undone
            p.data = d
        assert_same_snapshot(before, snapshot(model, opt), "refused step")
        _fit(model, opt, [3])
        assert_matches_torch(model, ref)


@pytest.mark.parametrize("mode", ["cpu", "nvme2"])
def test_replaced_param_data_is_refused_by_load_state_dict(tmp_path, mode):
    """A state dict for the grown parameter would fill only its laid-out elements."""
    model = _model()
    opt = tl_opt(mode, model.parameters(), tmp_path)
    try:
        _fit(model, opt, [0])
        sd = opt.state_dict()
        _grow(model)
        for k in ("exp_avg", "exp_avg_sq"):
            sd["state"][0][k] = torch.zeros(ROWS + 20, 16)
        with pytest.raises(RuntimeError, match="1600 elements, now 1920"):
            opt.load_state_dict(sd)
    finally:
        close(opt)


@pytest.mark.parametrize("mode", ["none", "c_none", "cpu", "nvme2", "c_hybrid_ov"])
def test_state_of_another_shape_is_refused_by_load_state_dict(tmp_path, mode):
    """Moments with the parameter's element count but another shape (a transposed weight,
    another model's config) were loaded and stepped as if their elements lined up; torch's
    AdamW fails at its next step. Refused at the load, which changes nothing."""
    with _trained(tmp_path, mode, [0, 1, 2]) as (ref, model, opt, before):
        for i, shape in ((0, (16, ROWS)), (1, (16, 4))):  # (ROWS, 16), (4, 16)
            sd = copy.deepcopy(opt.state_dict())  # torch's holds the live state's dicts
            sd["state"][i]["exp_avg"] = sd["state"][i]["exp_avg"].reshape(shape)
            with pytest.raises(ValueError, match=f"'exp_avg' of parameter {i} has shape "
                               f"\\({shape[0]}, {shape[1]}\\) but the parameter has shape"):
                opt.load_state_dict(sd)
            assert_same_snapshot(before, snapshot(model, opt), "refused load")
        if not mode.startswith("c_"):  # compact state is compared with itself elsewhere
            _fit(model, opt, [2])
            assert_matches_torch(model, ref)
