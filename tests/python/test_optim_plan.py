"""The step plan (tierlift.optim.adam_plan): a group's kernel lists kept between steps must never
go stale. Each case edits the optimizer between steps the way user code does (a scheduler's lr, a
new group, a loaded state dict, a gradient or requires_grad turned off, a state tensor replaced)
and steps three optimizers alike: ours, ours with its plans dropped before every step (the
general path), and torch's. Ours must match the general path bit for bit, weights and state, and
torch's within the tolerance of test_optim."""

import pytest
import torch

from tierlift.optim import AdamW
from tierlift.optim.adam import Adam

SHAPES = [(3,), (17,), (8, 5), (300,)]
STEPS = 6


class World:
    """One optimizer with its parameters; the same gradients at each step in every world."""

    def __init__(self, kind, dtype, **config):
        self.kind = kind
        pdtype = torch.float32 if kind == "torch" else dtype
        g = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(pdtype))
                       for s in SHAPES]
        self.extra = torch.nn.Parameter(torch.randn(9, generator=g).to(dtype).to(pdtype))
        cls = torch.optim.AdamW if kind == "torch" else AdamW
        kwargs = {"foreach": False} if kind == "torch" else {}
        self.opt = cls(self.params, lr=1e-2, weight_decay=0.1, **kwargs, **config)
        self.gen = torch.Generator().manual_seed(1)
        self.dtype = dtype

    def set_grads(self):
        for p in self.params + [self.extra]:
            g = torch.randn(p.shape, generator=self.gen).to(self.dtype) * 0.1
            p.grad = g.to(p.dtype) if p.requires_grad else None

    def step(self):
        if self.kind == "general":
            self.opt.__dict__.pop("_plans", None)
        self.opt.step()


def set_lr(w, i):
    for group in w.opt.param_groups:
        group["lr"] = 1e-2 * (0.5 + i)


def scheduler(w, i):
    if i == 0:
        w.sched = torch.optim.lr_scheduler.LambdaLR(w.opt, lambda s: 1.0 / (1 + s))
    else:
        w.sched.step()


def add_group(w, i):
    if i == 2:
        w.opt.add_param_group({"params": [w.extra], "lr": 3e-2})


def load_state(w, i):
    if i == 2:
        w.saved = w.opt.state_dict()
    if i == 4:
        w.opt.load_state_dict(w.saved)


def grad_none(w, i):
    # set_grads gives every parameter a gradient; the edit runs after it.
    if i in (3, 4):
        w.params[i - 2].grad = None


def requires_grad(w, i):
    w.params[0].requires_grad_(i not in (2, 3))


def replace_state_tensor(w, i):
    if i == 3:
        st = w.opt.state[w.params[1]]
        st["exp_avg"] = torch.zeros_like(st["exp_avg"])
        st["step"] = torch.tensor(1.0)


def reset_state(w, i):
    if i == 3:
        w.opt.state[w.params[2]] = {}
    if i == 4:
        w.opt.state.clear()


def replace_params(w, i):
    if i == 3:
        w.opt.param_groups[0]["params"] = w.params[:2]


def toggle_amsgrad(w, i):
    w.opt.param_groups[0]["amsgrad"] = i >= 3
    if i == 3:  # a bare switch is refused (torch raises KeyError): the maximum starts from zeros
        for p in w.params:
            st = w.opt.state[p]
            st["max_exp_avg_sq"] = torch.zeros_like(st["exp_avg_sq"])


def transposed_grad(w, i):
    if i == 3:
        w.params[2].grad = w.params[2].grad.t().contiguous().t()


def data_strided(w, i):
    # `p.data = x` keeps the Parameter and changes its layout: the general (copy) path's.
    if i == 3:
        p = w.params[3]
        view = torch.empty(2 * p.numel(), dtype=p.dtype)[::2].view(p.shape)
        p.data = view.copy_(p.data)


# Edits after which torch's AdamW does something else by design: its fp32 weights are not the
# masters ours makes afresh from bf16 weights when the state is reset.
NO_TORCH = {"reset_state": (torch.bfloat16,)}
EDITS = [set_lr, scheduler, add_group, load_state, grad_none, requires_grad,
         replace_state_tensor, reset_state, replace_params, toggle_amsgrad, transposed_grad,
         data_strided]


def run(kind, dtype, edit):
    w = World(kind, dtype)
    for i in range(STEPS):
        w.set_grads()
        edit(w, i)
        w.step()
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("edit", EDITS, ids=lambda e: e.__name__)
def test_plan_sees_every_edit(monkeypatch, edit, dtype):
    planned = []
    step_planned = Adam._step_planned

    def spy(self, *args):
        planned.append(self)
        return step_planned(self, *args)

    monkeypatch.setattr(Adam, "_step_planned", spy)
    ours, general = run("ours", dtype, edit), run("general", dtype, edit)
    ref = None if dtype in NO_TORCH.get(edit.__name__, ()) else run("torch", dtype, edit)
    assert any(o is ours.opt for o in planned), "the planned path never ran"
    assert not any(o is general.opt for o in planned)
    for a, b in zip(ours.params + [ours.extra], general.params + [general.extra]):
        assert torch.equal(a.detach(), b.detach())
        sa, sb = ours.opt.state.get(a, {}), general.opt.state.get(b, {})
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    if ref is None:
        return
    for a, r in zip(ours.params + [ours.extra], ref.params + [ref.extra]):
        sa, sr = ours.opt.state.get(a, {}), ref.opt.state.get(r, {})
        assert ("step" in sa) == ("step" in sr)
        scale = max(r.detach().abs().max().item(), 1.0)
        torch.testing.assert_close(sa.get("master", a).detach().float(), r.detach(), rtol=1e-6,
                                   atol=1e-6 * scale)
        for k in ("step", "exp_avg", "exp_avg_sq"):
            if k in sr:
                torch.testing.assert_close(sa[k], sr[k], rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("bad", ["float64", "sparse", "nan_lr"])
def test_planned_step_still_refuses_before_any_change(bad):
    """A bad gradient or hyperparameter met by a planned step raises as the general path does,
    before either group changes."""
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    opt = AdamW([{"params": [a]}, {"params": [b]}], lr=1e-2)
    for _ in range(2):
        a.grad, b.grad = torch.full((4,), 0.5), torch.full((3,), 0.5)
        opt.step()
    assert opt._plans[0] is not None and opt._plans[1] is not None
    before = [t.clone() for t in (a, b, opt.state[a]["exp_avg"], opt.state[a]["step"])]
    a.grad = torch.full((4,), 0.5)
    if bad == "float64":
        if hasattr(b, "grad_dtype"):
            b.grad_dtype = None  # newer torch refuses the assignment otherwise
        b.grad = torch.full((3,), 0.5, dtype=torch.float64)
    elif bad == "sparse":
        b.grad = torch.full((3,), 0.5).to_sparse()
    else:
        b.grad = torch.full((3,), 0.5)
        opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises((TypeError, RuntimeError, ValueError)):
        opt.step()
    after = (a, b, opt.state[a]["exp_avg"], opt.state[a]["step"])
    assert all(torch.equal(x.detach(), y.detach()) for x, y in zip(before, after))
