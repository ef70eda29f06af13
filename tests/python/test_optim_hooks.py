"""torch.optim.Optimizer's state-dict hooks on tierlift's AdamW, without and with offload, against
torch.optim.AdamW with the same hooks: a load pre-hook's returned (or edited) dict is what is
loaded, moments included; load post-hooks run once the whole state is in place; state_dict()
post-hooks see the moments (read back from the tiers) and may replace the returned dict.
Also: optimizer.state[p]["exp_avg"] of an offloaded optimizer reads the moment from the tiers."""

from __future__ import annotations

import copy

import pytest
import torch
from conformance_util import (
    assert_matches_torch,
    assert_state_matches_torch,
    build_model,
    close,
    num_threads,
    tl_opt,
    torch_opt,
    train,
    twin,
)

import tierlift

pytestmark = pytest.mark.skipif(
    not tierlift._extension.available(), reason="compiled extension not loaded"
)

MODES = ["none", "cpu", "nvme2"]


def _zero_exp_avg(_opt, sd):
    sd = copy.deepcopy(sd)  # a new dict: the one given is left alone
    for s in sd["state"].values():
        s["exp_avg"].zero_()
    return sd


def _halve_exp_avg_sq_in_place(_opt, sd):
    sd["state"] = {i: {**s, "exp_avg_sq": s["exp_avg_sq"] / 2} for i, s in sd["state"].items()}


def _max(opt, key):
    return max(float(s[key].abs().max()) for s in opt.state_dict()["state"].values())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pre_hook", [_zero_exp_avg, _halve_exp_avg_sq_in_place],
                         ids=["returned", "in_place"])
def test_load_hooks_as_torch(tmp_path, mode, pre_hook):
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    ref_opt = torch_opt(ref.parameters())
    seen = {}
    with num_threads(1):
        for name, o in (("ours", opt), ("torch", ref_opt)):
            train(model if o is opt else ref, o, steps=2)
            o.register_load_state_dict_pre_hook(pre_hook)
            # a post-hook sees the loaded state, moments included
            o.register_load_state_dict_post_hook(
                lambda o, name=name: seen.__setitem__(name, (_max(o, "exp_avg"),
                                                             _max(o, "exp_avg_sq"))))
            o.load_state_dict(o.state_dict())
        assert seen["ours"] == pytest.approx(seen["torch"], rel=1e-5)
        if pre_hook is _zero_exp_avg:
            assert seen["ours"][0] == 0.0
        assert_state_matches_torch(opt, ref_opt)
        train(model, opt, steps=2, start=2)
        train(ref, ref_opt, steps=2, start=2)
    assert_matches_torch(model, ref)
    close(opt)


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_hooks_as_torch(tmp_path, mode):
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    ref_opt = torch_opt(ref.parameters())
    calls, keys = [], {}

    def post(o, sd):
        keys[o is opt] = {i: sorted(s) for i, s in sd["state"].items()}
        sd = copy.deepcopy(sd)
        for s in sd["state"].values():
            s["exp_avg"].mul_(0.5)
        return sd

    with num_threads(1):
        for o, m in ((opt, model), (ref_opt, ref)):
            train(m, o, steps=2)
            o.register_state_dict_pre_hook(lambda o: calls.append(o is opt))
            o.register_state_dict_post_hook(post)
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        assert calls == [True, False]
        assert keys[True] == keys[False]  # the full moments, read back from the tiers
        for i, s in ref_sd["state"].items():
            for k, v in s.items():
                assert torch.allclose(sd["state"][i][k], v, rtol=1e-5, atol=1e-7), k
        # the hook's halving is in the returned dict only, not in the optimizer
        again = opt.state_dict()
        for i, s in sd["state"].items():
            assert torch.equal(again["state"][i]["exp_avg"], s["exp_avg"])
    close(opt)


def test_failed_load_runs_no_post_hook(tmp_path):
    model = build_model()
    opt = tl_opt("cpu", model.parameters(), tmp_path)
    calls = []
    with num_threads(1):
        train(model, opt, steps=1)
        sd = opt.state_dict()
        opt.register_load_state_dict_post_hook(lambda o: calls.append(1))
        bad = copy.deepcopy(sd)
        bad["state"][0]["exp_avg"] = torch.zeros(3)
        with pytest.raises(ValueError, match="shape"):
            opt.load_state_dict(bad)
        assert calls == []
        opt.load_state_dict(sd)
        assert calls == [1]
    close(opt)


@pytest.mark.parametrize("mode", ["cpu", "nvme2"])
def test_offloaded_state_reads_moments_by_name_and_says_where_the_rest_is(tmp_path, mode):
    """optimizer.state[p]["exp_avg"] reads the tiers' moment, as torch's state holds it; the
    master weights (torch's AdamW has none) and a moment of a parameter that has not stepped
    raise a KeyError that says where they are."""
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    ref_opt = torch_opt(ref.parameters())
    p, r = next(iter(model.parameters())), next(iter(ref.parameters()))
    with num_threads(1):
        with pytest.raises(KeyError, match=r"offload tiers.*has none"):
            opt.state[p]["exp_avg"]  # not stepped yet
        assert opt.state[p].get("exp_avg") is None and "exp_avg" not in opt.state[p]
        train(model, opt, steps=1)
        train(ref, ref_opt, steps=1)
        assert set(opt.state[p]) == set(ref_opt.state[r]) == {"step", "exp_avg", "exp_avg_sq"}
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][k], ref_opt.state[r][k], rtol=1e-5,
                                       atol=1e-9)
        with pytest.raises(KeyError, match=r"offload tiers.*optimizer\.state_dict\(\)"):
            opt.state[p]["master"]
        with pytest.raises(KeyError) as other:
            opt.state[p]["unknown"]
        assert "offload" not in str(other.value)
        opt.load_state_dict(opt.state_dict())  # still so after a load
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-9)
        assert "master" not in opt.state[p] and opt.state[p].get("master") is None
    close(opt)
