"""Offloaded optimizer state loaded from a state dict (or a checkpoint) that has no state for
some parameters: those start fresh, as in torch (zero moments, step 0 at their next step, a
bf16 parameter's master from its current value), while the tiers still hold their old state.
Compared with torch.optim.AdamW (fp32 parameters) and with tierlift's in-memory optimizer (bf16
parameters, compact state), for a state dict with a parameter's entry removed and one saved
before a parameter ever had a gradient, loaded into the same optimizer after more steps and
into a new one, with the weights edited in between. A step that fails after such a load, and a
durable reopen, leave the parameters without state as they are."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from conformance_util import (
    CHUNK,
    HYBRID_BUDGET,
    HYBRID_BUDGET_COMPACT,
    TOL,
    assert_matches_torch,
    batch,
    build_model,
    flat,
)

import tierlift
from tierlift.offload.runner import Offloader

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

HYPER = dict(lr=1e-2, weight_decay=0.1)
# The MLP's parameters: w0 [96, 32], b0, w1 [96, 96], b1, w2, b2; CHUNK holds 4096 of their
# elements: the chunks are [w0, b0], [w1 ...], [... w1 ...], [... w1, b1, w2, b2].
DROPPED = 2  # its entry is removed from the saved state dict
NEVER = 1  # no gradient before the save: the saved state dict has none for it
MODES = {
    "cpu": dict(offload="cpu"),
    "cpu_ov": dict(offload="cpu", overlap=True),
    "nvme1": dict(offload="nvme", nvme_generations=1),
    "nvme2": dict(offload="nvme"),
    "nvme2_ov": dict(offload="nvme", overlap=True),
    "hybrid_ov": dict(offload="hybrid", overlap=True, cpu_budget=HYBRID_BUDGET),
}


def _opt(mode: str, params, path=None, state_dtype: str = "fp32"):
    """`mode` of MODES, "none" (tierlift in memory) or "torch"; NVMe files under `path`."""
    kw = dict(HYPER, state_dtype=state_dtype, **MODES.get(mode, {}))
    if mode == "torch":
        return torch.optim.AdamW(params, **HYPER, fused=True)
    if mode != "none":
        kw["chunk_bytes"] = CHUNK
    if kw.get("offload") in ("nvme", "hybrid"):
        kw["nvme_path"] = str(path)
    if state_dtype == "bf16" and mode == "hybrid_ov":
        kw["cpu_budget"] = HYBRID_BUDGET_COMPACT
    return tierlift.optim.AdamW(params, **kw)


def _close(opt) -> None:
    if getattr(opt, "_offload", None) is not None:
        opt.close()


def _grads(model, i: int, skip=()) -> None:
    """Gradients of batch i, computed without backward hooks (the overlap steps nothing early:
    every chunk is stepped in step())."""
    x, y = batch(0, i, 0, next(model.parameters()).dtype)
    params = list(model.parameters())
    grads = torch.autograd.grad(F.mse_loss(model(x).float(), y.float()), params)
    for j, (p, g) in enumerate(zip(params, grads, strict=True)):
        p.grad = None if j in skip else g


def _step(model, opt, i: int, skip=()) -> None:
    x, y = batch(0, i, 0, next(model.parameters()).dtype)
    F.mse_loss(model(x).float(), y.float()).backward()  # hooks on: the overlap steps early
    for j, p in enumerate(model.parameters()):
        if j in skip:
            p.grad = None
    opt.step()
    opt.zero_grad()


@torch.no_grad()
def _edit(model) -> None:
    for p in model.parameters():
        p.copy_(p * 1.01 + 0.001)


def _partial_state_dict(opt, drop: int = DROPPED) -> dict:
    sd = copy.deepcopy(opt.state_dict())  # torch's holds the live state tensors
    del sd["state"][drop]
    return sd


def _train_and_load(mode: str, dtype, state_dtype: str, into: str, path=None) -> tuple:
    """Two steps (NEVER without a gradient), a state dict without DROPPED's state, two more
    steps, the weights edited, the state dict loaded (`into` the same optimizer or a new one),
    two more steps: (weights, state dict)."""
    model = build_model(0, dtype)
    opt = _opt(mode, model.parameters(), path, state_dtype)
    try:
        for i in range(2):
            _step(model, opt, i, skip=(NEVER,))
        sd = _partial_state_dict(opt)
        assert NEVER not in sd["state"]
        for i in range(2, 4):
            _step(model, opt, i)
        if into == "new":
            _close(opt)
            opt = _opt(mode, model.parameters(), path and path / "new", state_dtype)
        _edit(model)
        opt.load_state_dict(sd)
        for i in range(4, 6):
            _step(model, opt, i)
        return flat(model).clone(), copy.deepcopy(opt.state_dict())
    finally:
        _close(opt)


_reference = functools.cache(_train_and_load)  # the same for every mode


def _assert_state_close(sd: dict, ref: dict) -> None:
    """Step counts equal, moments within TOL of torch's relative to their largest."""
    assert sd["state"].keys() == ref["state"].keys()
    for i, rst in ref["state"].items():
        assert float(sd["state"][i]["step"]) == float(rst["step"]), i
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = sd["state"][i][k].float(), rst[k].float()
            assert float((a - b).abs().max() / b.abs().max()) <= 10 * TOL, (i, k)


def _assert_same(got: tuple, ref: tuple) -> None:
    (w, sd), (rw, rsd) = got, ref
    assert torch.equal(w, rw), f"weights: max diff {float((w - rw).abs().max()):.2e}"
    assert sd["state"].keys() == rsd["state"].keys()
    for i, st in rsd["state"].items():
        assert st.keys() == sd["state"][i].keys(), i
        for k, v in st.items():
            assert torch.equal(v, sd["state"][i][k]), (i, k)


CASES = [(m, torch.float32, "fp32", "same") for m in MODES] + [
    (m, torch.bfloat16, "fp32", "same") for m in MODES] + [
    (m, torch.bfloat16, "bf16", "same") for m in ("cpu_ov", "nvme1", "hybrid_ov")] + [
    ("nvme2_ov", torch.float32, "fp32", "new"), ("nvme2_ov", torch.bfloat16, "fp32", "new"),
    ("cpu", torch.bfloat16, "bf16", "new")]


@pytest.mark.parametrize(("mode", "dtype", "state_dtype", "into"), [
    pytest.param(*c, id=f"{c[0]}-{str(c[1])[6:]}-{c[2]}-{c[3]}") for c in CASES])
def test_parameters_without_loaded_state_start_fresh(mode, dtype, state_dtype, into,
                                                     tmp_path):
    (tmp_path / "new").mkdir()
    got = _train_and_load(mode, dtype, state_dtype, into, tmp_path)
    if dtype == torch.float32 and state_dtype == "fp32":
        ref = _reference("torch", dtype, state_dtype, into)
        assert_matches_torch(got[0], ref[0])
        _assert_state_close(got[1], ref[1])
    else:  # bf16 masters and compact state: tierlift's in-memory optimizer, bit for bit
        _assert_same(got, _reference("none", dtype, state_dtype, into))


def _fail_after_stepping(monkeypatch) -> None:
    """The step fails once every chunk was stepped into its other generation, waiting for
    those writes (an I/O error, an interrupt): it must put back what it changed."""
    def failing(self, stats):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(Offloader, "_sync", failing)


@pytest.mark.parametrize("mode", ["nvme2", "nvme2_ov", "cpu_ov"])
def test_a_failed_step_leaves_parameters_it_did_not_step_as_they_are(mode, monkeypatch,
                                                                     tmp_path):
    """b0 lost its state in the load and b1 kept it; both are edited and get no gradient in a
    step that fails after stepping their chunks (w0's, w1's). Each keeps its edited value (the
    undo used to put back the masters the tiers held: b0's from before the load), and the
    retried step is the in-memory optimizer's."""
    dropped, kept = 1, 3
    models = [build_model(0, torch.bfloat16) for _ in range(2)]
    opts = [_opt(m, model.parameters(), tmp_path) for m, model in zip((mode, "none"), models)]
    try:
        for model, opt in zip(models, opts):
            for i in range(2):
                _step(model, opt, i)
            sd = _partial_state_dict(opt, dropped)
            _edit(model)
            opt.load_state_dict(sd)
            _grads(model, 2, skip=(dropped, kept))
        model, opt = models[0], opts[0]
        before = [p.detach().clone() for p in model.parameters()]
        with monkeypatch.context() as m:
            _fail_after_stepping(m)
            with pytest.raises(RuntimeError, match="injected failure"):
                opt.step()
        for j, (a, p) in enumerate(zip(before, model.parameters(), strict=True)):
            assert torch.equal(a, p), f"parameter {j} changed by a failed step"
        for opt in opts:
            opt.step()
        # the in-memory load leaves an empty entry for b0 (torch's none): not compared
        ref_sd = opts[1].state_dict()
        ref_sd["state"] = {i: st for i, st in ref_sd["state"].items() if st}
        _assert_same((flat(models[0]), opts[0].state_dict()), (flat(models[1]), ref_sd))
    finally:
        _close(opts[0])


@pytest.mark.parametrize("generations", [1, 2])
def test_a_durable_reopen_leaves_a_parameter_without_loaded_state_as_it_is(tmp_path,
                                                                           generations):
    """A reopen puts the committed masters into the parameters: a parameter whose state a load
    dropped has none (it used to take its master from before the load)."""
    def build(model):
        return tierlift.optim.AdamW(model.parameters(), **HYPER, offload="nvme", durable=True,
                                    nvme_generations=generations, nvme_path=str(tmp_path),
                                    chunk_bytes=CHUNK)

    model = build_model(0, torch.bfloat16)
    opt = build(model)
    for i in range(2):
        _step(model, opt, i)
    opt.load_state_dict(_partial_state_dict(opt))
    expected = opt.state_dict()
    opt.close()
    model = build_model(0, torch.bfloat16)
    constructed = list(model.parameters())[DROPPED].detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "reopened the durable state"
        opt = build(model)
    try:
        assert torch.equal(list(model.parameters())[DROPPED], constructed)
        _assert_same((flat(model), opt.state_dict()), (flat(model), expected))
        for j, p in enumerate(model.parameters()):
            if j != DROPPED:
                assert torch.equal(p, expected["state"][j]["master"].to(p.dtype)), j
    finally:
        opt.close()


def _checkpoint_run(mode: str, into: str, tmp_path) -> tuple:
    """As _train_and_load, through tierlift.checkpoint: the checkpoint is saved right after a
    load that dropped DROPPED's state (NEVER has none either) and loaded after two more steps
    (model and optimizer); the reference saves and loads the state dicts themselves."""
    model = build_model(0, torch.bfloat16)
    opt = _opt(mode, model.parameters(), tmp_path)
    try:
        for i in range(2):
            _step(model, opt, i, skip=(NEVER,))
        opt.load_state_dict(_partial_state_dict(opt))
        ck = str(tmp_path / f"ck-{mode}-{into}")
        if mode == "none":
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        else:
            tierlift.checkpoint.save(ck, model, opt)
        for i in range(2, 4):
            _step(model, opt, i)
        if into == "new":
            _close(opt)
            opt = _opt(mode, model.parameters(), tmp_path / "new")
        _edit(model)
        if mode == "none":
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        else:
            tierlift.checkpoint.load(ck, model, opt)
        for i in range(4, 6):
            _step(model, opt, i)
        return flat(model).clone(), copy.deepcopy(opt.state_dict())
    finally:
        _close(opt)


@pytest.mark.parametrize(("mode", "into"), [("nvme2_ov", "same"), ("cpu", "new")])
def test_checkpoint_without_state_for_some_parameters(mode, into, tmp_path):
    (tmp_path / "new").mkdir()
    _assert_same(_checkpoint_run(mode, into, tmp_path), _checkpoint_run("none", into, tmp_path))


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_state_dict_after_a_partial_load_lists_what_torchs_lists(state_dtype):
    # The in-memory optimizer once kept an empty entry for each parameter the loaded dict had
    # no state for, so its state_dict() listed `i: {}` where torch's lists nothing.
    def listed(make):
        a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
        opt = make([a, b])
        a.grad, b.grad = torch.ones(3), torch.ones(2)
        opt.step()
        sd = opt.state_dict()
        del sd["state"][1]
        fresh = make([a, b])
        fresh.load_state_dict(sd)
        return sorted(fresh.state_dict()["state"])

    ours = listed(lambda ps: tierlift.optim.AdamW(ps, state_dtype=state_dtype, **HYPER))
    assert ours == listed(lambda ps: torch.optim.AdamW(ps, **HYPER)) == [0]
