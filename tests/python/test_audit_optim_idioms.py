"""Ordinary torch script lines around tierlift's AdamW, in memory and in the offloaded tiers
that run on a CPU, against torch.optim.AdamW on the same model and data: each gives torch's
result, or is refused with a clear error before any weight or state changes.

- a parameter whose data was replaced by one of another shape (`p.data = p.data.t()
  .contiguous()`, a weight stored transposed as GPT-2's Conv1D keeps it; an embedding grown in
  place): refused before anything changes. The same element count used to be stepped with each
  element's moments taken from another element (torch's step raises); without offload a new
  element count was refused by the kernel only after earlier groups had stepped and every step
  count had advanced;
- step(closure), step() twice after one backward, zero_grad() before step(), gradients from
  torch.autograd.grad assigned by hand, backward(inputs=...), a step pre-hook scaling the
  gradients, named parameters, an empty param group, tensor betas, SequentialLR and
  ChainedScheduler, activation checkpointing, model.share_memory(), vector_to_parameters, the
  state replaced by a fresh mapping: torch's result;
- non-contiguous gradients: the same bits as contiguous ones (torch's fused CPU AdamW, the
  reference elsewhere, misreads them: 0.29 relative off its own single-tensor AdamW);
- two optimizers (a GAN's) offloaded to one nvme_path: each trains as torch's;
- NaN/inf gradients without GradScaler: NaN where torch puts it, in the weights and moments,
  amsgrad's running max included (torch.maximum's NaN)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from conformance_util import (
    TOL,
    assert_bitwise,
    assert_matches_torch,
    assert_same_snapshot,
    assert_state_matches_torch,
    batch,
    build_model,
    close,
    flat,
    snapshot,
    tl_opt,
    torch_opt,
    train,
    twin,
)
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.optim import lr_scheduler
from torch.utils.checkpoint import checkpoint

import tierlift

pytestmark = [
    pytest.mark.skipif(not tierlift._extension.available(), reason="compiled extension not loaded"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # durable reopens, strided params
]

# In memory, a file tier without overlap, a host tier with overlap (gradient hooks step ahead).
MODES = ["none", "nvme1", "cpu_ov"]


# ---- a parameter's data replaced by one of another shape -------------------------------------
class ConvOrLinear(nn.Module):
    """A projection whose weight may be stored transposed (as GPT-2's Conv1D stores it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 24)
        self.proj = nn.Parameter(torch.randn(8, 24) * 0.1)

    def forward(self, x):
        w = self.proj if self.proj.shape == (8, 24) else self.proj.t()
        return torch.relu(self.inp(x)) @ w.t()


def _fit(model, opt, steps) -> None:
    for i in steps:
        x, y = batch(0, i)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", ["none", "c_none", "cpu", "nvme1", "cpu_ov"])
def test_param_stored_transposed_is_refused_before_anything_changes(tmp_path, mode, one_thread):
    ref = ConvOrLinear()
    model = twin(ref)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    try:
        _fit(ref, torch_opt(ref.parameters()), range(4))
        _fit(model, opt, range(2))
        before = snapshot(model, opt)
        kept = model.proj.data
        model.proj.data = kept.t().contiguous()
        x, y = batch(0, 2)
        F.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\] (has shape "
                           r"\(24, 8\) but its optimizer state 'exp_avg' has shape \(8, 24\)|is "
                           r"not the tensor the offloaded state was laid out for \(shape "
                           r"\(8, 24\), now \(24, 8\)).*Nothing was changed"):
            opt.step()
        model.proj.data = kept  # undone
        opt.zero_grad()
        assert_same_snapshot(before, snapshot(model, opt), "refused step")
        _fit(model, opt, range(2, 4))
        if not mode.startswith("c_"):  # compact state is compared with itself elsewhere
            assert_matches_torch(model, ref)
    finally:
        close(opt)


def _transpose_moments(state: dict) -> None:
    for k in ("exp_avg", "exp_avg_sq"):
        state[k] = state[k].t().contiguous()


@pytest.mark.parametrize("mode", ["none", "nvme1", "cpu_ov"])
def test_param_stored_transposed_trains_on_as_the_refusal_says(tmp_path, mode, one_thread):
    """What the refusal says to do, against torch's AdamW whose state is transposed too:
    without offload the state in optimizer.state changed the same way; offloaded, the state
    dict saved before the change, its moments changed the same way, loaded into a new one."""
    ref = ConvOrLinear()
    model = twin(ref)
    ref_opt = torch_opt(ref.parameters())
    opt = tl_opt(mode, model.parameters(), tmp_path)
    try:
        _fit(ref, ref_opt, range(2))
        _fit(model, opt, range(2))
        kept = model.proj.data
        for m in (ref, model):
            m.proj.data = m.proj.data.t().contiguous()
        _transpose_moments(ref_opt.state[ref.proj])
        if mode == "none":
            _transpose_moments(opt.state[model.proj])
        else:
            # The state dict saved before the change (state_dict() now refuses, as step()).
            with pytest.raises(RuntimeError, match="load it into the new one with its moments "
                               "in that state dict changed the same way"):
                opt.state_dict()
            changed, model.proj.data = model.proj.data, kept
            sd = opt.state_dict()
            close(opt)
            model.proj.data = changed
            _transpose_moments(sd["state"][0])
            opt = tl_opt(mode, model.parameters(), tmp_path)
            opt.load_state_dict(sd)
        _fit(ref, ref_opt, range(2, 4))
        _fit(model, opt, range(2, 4))
        assert_matches_torch(model, ref)
    finally:
        close(opt)


def test_grown_param_in_a_later_group_is_refused_before_any_group_steps(one_thread):
    """Without offload the kernel refused the grown embedding, but only after the first group
    had stepped and every step count had advanced."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 4))
    ref = twin(model)
    emb, *rest = model.parameters()
    opt = tierlift.optim.AdamW([{"params": rest}, {"params": [emb]}], lr=1e-2)

    def fit(m, o, steps):
        for i in steps:
            g = torch.Generator().manual_seed(i)
            idx = torch.randint(0, 100, (8,), generator=g)
            F.mse_loss(m(idx), torch.randn(8, 4, generator=g)).backward()
            o.step()
            o.zero_grad()

    fit(ref, torch_opt([{"params": list(ref[1].parameters())},
                        {"params": [ref[0].weight]}]), range(3))
    fit(model, opt, range(2))
    before = snapshot(model, opt)
    kept = emb.data
    emb.data = torch.cat([kept, torch.randn(20, 16)])
    model(torch.tensor([0, 119])).sum().backward()
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\] has shape "
                       r"\(120, 16\) but its optimizer state 'exp_avg' has shape \(100, 16\)"):
        opt.step()
    emb.data = kept
    opt.zero_grad()
    assert_same_snapshot(before, snapshot(model, opt), "refused step")
    fit(model, opt, [2])
    assert_matches_torch(model, ref)


# ---- idioms that give torch's result ---------------------------------------------------------
def _closure(model, opt):
    for i in range(3):
        x, y = batch(0, i)

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        assert opt.step(closure) is not None


def _step_twice(model, opt):  # the same gradients stepped twice (with overlap: ahead once)
    for i in range(3):
        x, y = batch(0, i)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.step()
        opt.zero_grad()


def _zero_grad_before_step(model, opt):  # None: not stepped; zeros: stepped, as in torch
    for i in range(4):
        x, y = batch(0, i)
        F.mse_loss(model(x), y).backward()
        if i == 1:
            opt.zero_grad()
        if i == 2:
            opt.zero_grad(set_to_none=False)
        opt.step()
        opt.zero_grad()


def _autograd_grad(model, opt):  # no gradient hook fires: every chunk is stepped in step()
    params = list(model.parameters())
    for i in range(3):
        x, y = batch(0, i)
        for p, g in zip(params, torch.autograd.grad(F.mse_loss(model(x), y), params)):
            p.grad = g
        opt.step()
        opt.zero_grad()


def _backward_inputs(model, opt):  # one step with gradients for the last layer only
    for i in range(3):
        x, y = batch(0, i)
        F.mse_loss(model(x), y).backward(inputs=list(model[4].parameters()) if i == 1 else None)
        opt.step()
        opt.zero_grad()


def _step_pre_hook(model, opt):  # scales the gradients the overlap already stepped with
    def scale(o, args, kwargs):
        for p in model.parameters():
            p.grad.mul_(0.3)

    handle = opt.register_step_pre_hook(scale)
    train(model, opt, steps=3)
    handle.remove()


def _warmup_then_cosine(model, opt):  # SequentialLR, the usual warmup schedule
    sched = lr_scheduler.SequentialLR(
        opt, [lr_scheduler.LinearLR(opt, 0.1, total_iters=2),
              lr_scheduler.CosineAnnealingLR(opt, T_max=3)], milestones=[2])
    train(model, opt, steps=5, sched=sched)


def _chained(model, opt):
    sched = lr_scheduler.ChainedScheduler([lr_scheduler.ConstantLR(opt, 0.5, total_iters=2),
                                           lr_scheduler.ExponentialLR(opt, 0.8)])
    train(model, opt, steps=4, sched=sched)


def _checkpointed(model, opt):  # recomputed in backward; the middle layer also used outside
    for i in range(3):
        x, y = batch(0, i)
        h = checkpoint(lambda t: model[2](torch.relu(model[0](t))), x, use_reentrant=False)
        F.mse_loss(model[4](torch.relu(model[2](torch.relu(h)))), y).backward()
        opt.step()
        opt.zero_grad()


def _share_memory(model, opt):  # new storage for every weight (Hogwild's setup)
    train(model, opt, steps=2)
    model.share_memory()
    train(model, opt, steps=2, start=2)


def _vector_to_parameters(model, opt):  # weights become views of one vector, rescaled
    train(model, opt, steps=2)
    vector_to_parameters(parameters_to_vector(model.parameters()) * 0.9, model.parameters())
    train(model, opt, steps=2, start=2)


def _state_replaced(model, opt):  # "reset the optimizer" by a fresh state mapping
    train(model, opt, steps=2)
    opt.state = collections.defaultdict(dict)
    train(model, opt, steps=2, start=2)


IDIOMS = {
    "closure": (_closure, lambda m: m.parameters(), {}),
    "step_twice": (_step_twice, lambda m: m.parameters(), {}),
    "zero_grad_before_step": (_zero_grad_before_step, lambda m: m.parameters(), {}),
    "autograd_grad": (_autograd_grad, lambda m: m.parameters(), {}),
    "backward_inputs": (_backward_inputs, lambda m: m.parameters(), {}),
    "step_pre_hook": (_step_pre_hook, lambda m: m.parameters(), {}),
    "named_parameters": (lambda m, o: train(m, o, steps=3), lambda m: m.named_parameters(), {}),
    "empty_group": (lambda m, o: train(m, o, steps=3),
                    lambda m: [{"params": []}, {"params": list(m.parameters())}], {}),
    "tensor_betas": (lambda m, o: train(m, o, steps=3), lambda m: m.parameters(),
                     {"betas": (torch.tensor(0.8), torch.tensor(0.99))}),
    "warmup_then_cosine": (_warmup_then_cosine, lambda m: m.parameters(), {}),
    "chained_scheduler": (_chained, lambda m: m.parameters(), {}),
    "checkpointed": (_checkpointed, lambda m: m.parameters(), {}),
    "share_memory": (_share_memory, lambda m: m.parameters(), {}),
    "vector_to_parameters": (_vector_to_parameters, lambda m: m.parameters(), {}),
    "state_replaced": (_state_replaced, lambda m: m.parameters(), {}),
}


@pytest.mark.parametrize("idiom", list(IDIOMS))
@pytest.mark.parametrize("mode", MODES)
def test_idiom_matches_torch(tmp_path, mode, idiom, one_thread):
    loop, params, kw = IDIOMS[idiom]
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, params(model), tmp_path, **kw)
    ref_opt = torch_opt(params(ref), **kw)
    try:
        loop(model, opt)
        loop(ref, ref_opt)
        assert_matches_torch(model, ref)
        steps = [float(s["step"]) for s in opt.state_dict()["state"].values()]
        assert steps == [float(s["step"]) for s in ref_opt.state_dict()["state"].values()]
    finally:
        close(opt)


@pytest.mark.parametrize("mode", MODES)
def test_noncontiguous_gradients_step_as_contiguous_ones(tmp_path, mode, one_thread):
    """Bit for bit against the same gradients made contiguous. torch's fused CPU AdamW (the
    reference of the tests above) misreads them, so it cannot be the reference here."""

    def transposed(i, model, opt):
        for p in model.parameters():
            if p.dim() == 2:
                p.grad = p.grad.t().contiguous().t()
                assert not p.grad.is_contiguous()

    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    ref_opt = tl_opt("none", ref.parameters(), tmp_path)
    try:
        train(model, opt, steps=3, before_step=transposed)
        train(ref, ref_opt, steps=3)
        assert_bitwise(model, ref)
    finally:
        close(opt)


@pytest.mark.parametrize("mode", ["nvme1", "nvme2_ov"])
def test_two_optimizers_on_one_nvme_path_train_as_torch(tmp_path, mode, one_thread):
    """A GAN's generator and discriminator, each with its own optimizer on one drive."""
    models = [build_model(0), build_model(1)]
    refs = [twin(m) for m in models]
    opts = [tl_opt(mode, m.parameters(), tmp_path) for m in models]
    ref_opts = [torch_opt(m.parameters()) for m in refs]
    try:
        for i in range(3):  # interleaved, as a GAN steps them
            for pair in (zip(models, opts), zip(refs, ref_opts)):
                for model, opt in pair:
                    train(model, opt, steps=1, start=i)
        for model, ref in zip(models, refs):
            assert_matches_torch(model, ref)
    finally:
        for opt in opts:
            close(opt)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_gradients_without_scaler_as_torch(tmp_path, mode, amsgrad, one_thread):
    """One step with a NaN and an inf gradient element: NaN lands in the same weights and
    moments as torch's, the other elements as torch's. Where the new v is NaN, amsgrad's
    max_exp_avg_sq turns NaN, as torch's."""

    def poison(i, model, opt):
        if i == 1:
            w = model[4].weight.grad
            w[0, 0], w[1, 0] = float("nan"), float("inf")

    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path, amsgrad=amsgrad)
    ref_opt = torch_opt(ref.parameters(), amsgrad=amsgrad)
    try:
        train(model, opt, steps=2, before_step=poison)
        train(ref, ref_opt, steps=2, before_step=poison)
        got, want = flat(model), flat(ref)
        assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
        ok = ~want.isnan()
        err = float((got[ok] - want[ok]).abs().max() / want[ok].abs().max())
        assert err <= TOL, f"finite weights: rel_err={err:.2e}"
        sd, rsd = opt.state_dict()["state"][4], ref_opt.state_dict()["state"][4]
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd[k].isnan(), rsd[k].isnan()), k
            assert torch.equal(sd[k].isinf(), rsd[k].isinf()), k
        if amsgrad:
            m, rm = sd["max_exp_avg_sq"], rsd["max_exp_avg_sq"]
            assert bool(rm[0, 0].isnan()) and bool(m[0, 0].isnan())
            assert bool(m[1, 0].isinf()) and bool(rm[1, 0].isinf())
    finally:
        close(opt)


@pytest.mark.parametrize("mode", ["nvme1", "nvme2_ov", "durable1"])
def test_relative_nvme_path_survives_a_change_of_directory(tmp_path, monkeypatch, mode,
                                                           one_thread):
    """nvme_path="nvme" and then os.chdir (a launcher or a logger changing directory): the
    state files were watched and reopened by the relative path, so the next step() refused
    them as "removed under the running job", and close() could not remove them."""
    (tmp_path / "nvme").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), "nvme")
    ref_opt = torch_opt(ref.parameters())
    try:
        train(model, opt, steps=2)
        monkeypatch.chdir(tmp_path / "elsewhere")
        train(model, opt, steps=2, start=2)
        train(ref, ref_opt, steps=4)
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
    finally:
        close(opt)
    if mode != "durable1":  # a durable state stays for the next run to reopen
        assert list((tmp_path / "nvme").iterdir()) == []
