"""A ZeRO checkpoint of an offloading optimizer loaded into one of another state_dtype (compact
"bf16" <-> "fp32"): the sharded load does not convert, so it is refused before anything changes,
with an error that names both state_dtypes and a way that works (load into an optimizer of the
saved state_dtype, then hand its state_dict() to this one's load_state_dict, which converts)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import tierlift

GEN = torch.Generator().manual_seed(6)
XS = [torch.randn(8, 32, generator=GEN) for _ in range(3)]
_DIRS = itertools.count()


def _build(seed, tmp_path, state_dtype, offload="nvme", fraction=0.0):
    torch.manual_seed(seed)
    model = tierlift.zero.shard(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
                                stage=3, min_unit_numel=1)
    kw = dict(lr=1e-2, state_dtype=state_dtype, offload=offload)
    if offload == "nvme":
        path = tmp_path / f"nvme{next(_DIRS)}"
        path.mkdir()
        kw["nvme_path"] = str(path)
    if fraction:
        kw.update(overlap=True, device_fraction=fraction)
    return model, tierlift.optim.AdamW(model.parameters(), **kw)


def _train(model, opt, xs):
    for x in xs:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize(("saved", "loaded"), [("bf16", "fp32"), ("fp32", "bf16")])
@pytest.mark.parametrize(("offload", "fraction"), [("nvme", 0.0), ("cpu", 0.4)])
def test_another_state_dtype_is_refused_with_a_way_that_works(tmp_path, one_thread, saved,
                                                              loaded, offload, fraction):
    model, opt = _build(0, tmp_path, saved, offload, fraction)
    _train(model, opt, XS)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)

    target, target_opt = _build(9, tmp_path, loaded, offload, fraction)
    _train(target, target_opt, XS[:1])
    weights = copy.deepcopy(tierlift.zero.full_state_dict(target))
    state = copy.deepcopy(target_opt.state_dict())
    with pytest.raises(ValueError, match=rf"state_dtype='{saved}'.*state_dtype='{loaded}'"):
        tierlift.checkpoint.load(ck, target, target_opt)
    after = tierlift.zero.full_state_dict(target)
    assert all(torch.equal(v, after[k]) for k, v in weights.items())
    now = target_opt.state_dict()
    assert all(torch.equal(v, now["state"][i][k])
               for i, s in state["state"].items() for k, v in s.items())

    # the way the error names: the saved state_dtype first, then load_state_dict converts
    same, same_opt = _build(9, tmp_path, saved, offload, fraction)
    tierlift.checkpoint.load(ck, same, same_opt)
    target.load_state_dict(same.state_dict())
    target_opt.load_state_dict(copy.deepcopy(same_opt.state_dict()))
    ref, ref_opt = _build(9, tmp_path, loaded, "none")  # the one-process conversion
    ref.load_state_dict(model.state_dict())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    got, want = target_opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        assert got[i].keys() == want[i].keys()
        assert all(torch.equal(got[i][k], want[i][k]) for k in want[i]), i
