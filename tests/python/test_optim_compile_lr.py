"""A compiled step (torch.compile) under a learning-rate scheduler, as in torch's "compiled
optimizer with LR scheduler" recipe: with lr given as a tensor, which the scheduler updates in
place, the step compiles twice in all (the first step creates the state) however often the lr
changes, and gives the eager step's weights bit for bit; tierlift's op reads the tensor when
it runs. A float lr changed by the scheduler recompiles (dynamo guards on its value), but is
never stale, also past torch's recompile limit (where torch falls back to the eager step).

The counting tests compile with backend="aot_eager" (dynamo's guards and functionalization,
which decide recompiles and staleness, without inductor's slow C++ builds on a small CPU box);
test_optim_compile.py runs the same op under inductor."""

from __future__ import annotations

import pytest
import torch
from conformance_util import TOL, num_threads
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tierlift
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _backward(model, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 12, generator=g), torch.randn(6, 3, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def _train(cls, lr, steps, schedule, compile_backend=None):
    """`steps` steps of `cls` with `schedule` (a function of the optimizer) stepped after each;
    compiled as the recipe does (optimizer and scheduler steps in one compiled function) if
    `compile_backend` is given. Returns the weights, the lrs used and the compile count."""
    model = _model()
    opt = cls(model.parameters(), lr=lr)
    sched = schedule(opt)

    def fn():
        opt.step()
        sched.step()

    counter = CompileCounterWithBackend(compile_backend) if compile_backend else None
    step = torch.compile(fn, backend=counter) if counter else fn
    lrs = []
    for i in range(steps):
        opt.zero_grad()
        _backward(model, i)
        lrs.append(float(opt.param_groups[0]["lr"]))
        step()
    return _flat(model), lrs, counter.frame_count if counter else 0


def _lambda(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.8**epoch)


def _cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)


@pytest.mark.parametrize("schedule", [_lambda, _cosine], ids=["lambda", "cosine"])
def test_tensor_lr_scheduler_compiles_once(schedule):
    torch._dynamo.reset()
    with num_threads(1):
        got, lrs, compiles = _train(AdamW, torch.tensor(1e-2), 10, schedule, "aot_eager")
        want, want_lrs, _ = _train(AdamW, torch.tensor(1e-2), 10, schedule)
        ref, _, _ = _train(torch.optim.AdamW, torch.tensor(1e-2), 10, schedule)
    assert len(set(lrs)) == 10 and lrs == want_lrs  # the schedule changed lr at every step
    # once, and once more when the first step has made the state (it recompiled per step)
    assert compiles <= 2, f"{compiles} compilations in 10 steps"
    assert torch.equal(got, want), f"{int((got != want).sum())} weights differ from eager"
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err <= TOL, f"rel_err {err:.2e} against torch.optim.AdamW(lr=tensor)"


def test_float_lr_scheduler_is_never_stale():
    """A float lr is a constant of the graph: each new value recompiles (dynamo guards on it)
    until the recompile limit, then torch steps eagerly; right at every step either way."""
    torch._dynamo.reset()
    with num_threads(1), torch._dynamo.config.patch(recompile_limit=2):
        got, lrs, _ = _train(AdamW, 1e-2, 4, _lambda, "aot_eager")
        want, _, _ = _train(AdamW, 1e-2, 4, _lambda)
    assert len(set(lrs)) == 4  # steps 3 and 4 past the limit
    assert torch.equal(got, want), f"{int((got != want).sum())} weights differ from eager"


def _groups(model, lr):
    # as torch's docs write per-layer groups: generators, which the optimizer reads once
    return [{"params": model[0].parameters(), "lr": lr},
            {"params": model[2].parameters(), "lr": lr}]


def test_param_groups_given_as_generators_step_every_param():
    """torch's add_param_group keeps the list it read from a generator; ours passed on the
    generator it had already read, and the groups were empty: step() trained nothing."""
    models = [_model(), _model()]
    opts = [AdamW(_groups(models[0], 1e-2)), torch.optim.AdamW(_groups(models[1], 1e-2))]
    assert [len(g["params"]) for g in opts[0].param_groups] == [2, 2]
    for model, opt in zip(models, opts, strict=True):
        _backward(model, 0)
        opt.step()
    got, ref, start = _flat(models[0]), _flat(models[1]), _flat(_model())
    assert bool((got != start).all()), "some weights were not stepped"
    assert float((got - ref).abs().max() / ref.abs().max()) <= TOL


def _state(opt, model):
    return [t.clone() for p in model.parameters() for t in (p, *opt.state[p].values())]


@pytest.mark.parametrize("groups", [1, 2])
def test_bad_tensor_lr_refused_before_any_group_changes(groups):
    """A group's op checks its tensor lr before it changes anything; with several groups one op
    checks them all first, and every group's op reads its lr from that op's output: a negative
    or NaN lr in the last group leaves the first group's weights, moments and counts as they
    were too, as the eager step does."""
    torch._dynamo.reset()
    model = _model()
    layers = [list(model[i].parameters()) for i in (0, 2)]
    if groups == 1:
        layers = [layers[0] + layers[1]]
    opt = AdamW([{"params": ps, "lr": torch.tensor(1e-2)} for ps in layers])
    step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    for i in range(2):
        opt.zero_grad()
        _backward(model, i)
        step()
    for bad, match in ((-1e-3, "lr must be >= 0"), (float("nan"), "lr must be finite")):
        opt.param_groups[-1]["lr"].fill_(bad)
        before = _state(opt, model)
        with pytest.raises(ValueError, match=match):
            step()
        after = _state(opt, model)
        assert len(after) == 16  # 4 params: weight, step, exp_avg, exp_avg_sq
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    opt.param_groups[-1]["lr"].fill_(1e-2)
    step()  # and steps again once the lr is good
    assert all(float(s["step"]) == 3 for s in opt.state.values())


def test_tensor_lr_with_foreach_set_after_construction_refused_as_torch():
    """torch refuses a tensor lr with foreach=True (capturable=False) at construction and, put
    into a group later, at step(); so does ours, before anything changes."""
    for cls in (torch.optim.AdamW, AdamW):
        model = _model()
        opt = cls(model.parameters(), lr=1e-2, foreach=True)
        opt.param_groups[0]["lr"] = torch.tensor(1e-2)
        _backward(model, 0)
        before = _flat(model)
        with pytest.raises(RuntimeError, match="lr as a Tensor is not supported for "
                           "capturable=False and foreach=True"):
            opt.step()
        assert torch.equal(_flat(model), before)


def test_fullgraph_step_after_shard_in_the_process():
    # shard() installs a global step pre-hook (an optimizer built before shard() is refused);
    # it must not be a graph break in any optimizer's fullgraph-compiled step afterwards.
    stale = nn.Linear(4, 4)
    before = torch.optim.AdamW(stale.parameters())
    tierlift.zero.shard(stale, stage=1)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ref = nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = AdamW(model.parameters(), lr=1e-2), AdamW(ref.parameters(), lr=1e-2)
    step = torch.compile(opt.step, fullgraph=True, backend="eager")
    for _ in range(2):
        x = torch.randn(3, 8)
        for m in (model, ref):
            m(x).square().sum().backward()
        step()
        ref_opt.step()
    assert torch.equal(model.weight, ref.weight)
    stale(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="parameters that tierlift.zero.shard.. replaced"):
        before.step()  # still checked in eager


def test_fullgraph_step_follows_a_changing_float_lr():
    # dynamo makes a float that changed between calls symbolic: the lr check must stay
    # traceable (math.isfinite of it was an "op returned non-Tensor" error at the 2nd value)
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 4), nn.Linear(4, 4)
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = AdamW(model.parameters(), lr=1e-2), AdamW(ref.parameters(), lr=1e-2)
    step = torch.compile(opt.step, fullgraph=True, backend="eager")
    for i in range(4):
        x = torch.randn(2, 4)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).sum().backward()
            o.param_groups[0]["lr"] = 1e-2 / (i + 1)
        step()
        ref_opt.step()
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
