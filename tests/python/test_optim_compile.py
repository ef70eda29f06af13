"""torch.compile(optimizer.step, fullgraph=True), torch's "compiling the optimizer" recipe, with
tierlift's AdamW without offload: the step is one graph (no graph break: GradScaler's verdict
and scale are read by the op when it runs, and the eager step's plan is not traced), and it
gives the eager step's weights and state bit for bit, and torch.optim.AdamW's within the usual
tolerance, in each kind of step (fp32, bf16 params with fp32 masters, compact state, amsgrad,
maximize, GradScaler's grad_scale and found_inf). Schedulers: test_optim_compile_lr.py.

The step counts are advanced and read inside one op (tierlift::adam_group_step_): traced, the
one that returns them as integers (advance_steps_) failed functionalization, and counts read on
the host would recompile the step at every new count. Compilation is slow on a small CPU box:
four cases of a tiny model, four steps each (the offloaded step: test_offload_compile.py)."""

from __future__ import annotations

import pytest
import torch
from conformance_util import TOL, MasterAdamW, num_threads, torch_opt
from torch import nn

import tierlift
from tierlift.optim import AdamW
from tierlift.reference.optim_compact import scale_count

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

STEPS = 4
INF_STEP = 2  # with a GradScaler, a gradient is made inf after this step's backward
# (dtype, tierlift's keywords, GradScaler's init_scale or None, a parameter without a gradient
# at step 2 so that step 3 runs two step counts in one group)
CASES = {
    "fp32": (torch.float32, {}, None, False),
    "bf16_masters_skip": (torch.bfloat16, {}, None, True),
    "compact_amp": (torch.float32, {"state_dtype": "bf16"}, 1000.0, False),
    "amsgrad_maximize_amp": (torch.float32, {"amsgrad": True, "maximize": True}, 2.0**16, False),
}


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def _train(model, opt, scaler, *, skip, steps=STEPS, last_steps_no_recompile=False):
    """Trains `steps` steps; returns the optimizer's step counts after each step."""
    counts = []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(6, 12, generator=g).to(next(model.parameters()).dtype)
        y = torch.randn(6, 3, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if skip and step == 2:
            model[2].bias.grad = None
        if scaler is not None and step == INF_STEP:
            model[0].weight.grad.view(-1)[5] = float("inf")
        # From step 3 on, nothing the compiled step depends on changes but the counts' values.
        with torch._dynamo.config.patch(error_on_recompile=last_steps_no_recompile and step > 2):
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        state = opt.inner.state if isinstance(opt, MasterAdamW) else opt.state
        counts.append(sorted(float(s["step"]) for s in state.values()))
    return counts


def _flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _scaler(init_scale):
    if init_scale is None:
        return None
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_matches_eager_and_torch(case):
    dtype, kw, init_scale, skip = CASES[case]
    torch._dynamo.reset()
    with num_threads(1):
        eager, compiled = _model(dtype), _model(dtype)
        eager_opt = AdamW(eager.parameters(), lr=1e-2, **kw)
        opt = AdamW(compiled.parameters(), lr=1e-2, **kw)
        # an instance attribute: GradScaler.step calls it
        opt.step = torch.compile(opt.step, fullgraph=True)
        want_counts = _train(eager, eager_opt, _scaler(init_scale), skip=skip)
        got_counts = _train(compiled, opt, _scaler(init_scale), skip=skip,
                            last_steps_no_recompile=case == "fp32")

        a, b = _flat(compiled), _flat(eager)
        assert torch.equal(a, b), f"{int((a != b).sum())} weights differ from the eager step"
        assert got_counts == want_counts
        assert opt.state_dict()["state"].keys() == eager_opt.state_dict()["state"].keys()
        for p, q in zip(compiled.parameters(), eager.parameters()):
            for k, v in eager_opt.state[q].items():
                assert torch.equal(opt.state[p][k], v), f"state {k!r} differs from eager"

        theirs = _model(dtype)
        torch_kw = {k: v for k, v in kw.items() if k != "state_dtype"}
        if dtype == torch.float32:
            ref_opt = torch_opt(theirs.parameters(), **torch_kw)
        else:  # torch's AdamW on fp32 masters, rounded into the bf16 weights
            ref_opt = MasterAdamW(theirs.parameters(), **torch_kw)
        _train(theirs, ref_opt, _scaler(init_scale), skip=skip)
        ref = _flat(theirs)
        # compact moments are quantized; bf16 weights are one rounding of the master apart
        tol = {"compact_amp": 1e-2, "bf16_masters_skip": 2.0**-8}.get(case, TOL)
        err = float((a - ref).abs().max() / ref.abs().max())
        assert err <= tol, f"rel_err {err:.2e} against torch.optim.AdamW (tol {tol})"


@pytest.mark.parametrize("compact", [False, True], ids=["fp32_amsgrad", "compact"])
@pytest.mark.parametrize("tensors", [False, True], ids=["floats", "tensor_lr_found_inf"])
def test_group_step_opcheck(compact, tensors):
    # Two step counts in one call; in the fp32 case, an fp32 param is its own copy beside bf16
    # copies (a mixed group), as the optimizer passes it.
    torch.manual_seed(0)
    n = 3
    params = [torch.randn(4, 70) for _ in range(n)]
    grads = [torch.randn(4, 70) for _ in range(n)]
    steps = [torch.tensor(2.0), torch.tensor(0.0), torch.tensor(2.0)]
    if compact:
        m = [torch.zeros(4, 70, dtype=torch.bfloat16) for _ in range(n)]
        v = [torch.zeros(4, 70, dtype=torch.uint8) for _ in range(n)]
        extra = [torch.zeros(scale_count(280)) for _ in range(n)]
        copies = [p.to(torch.bfloat16) for p in params]
    else:
        m = [torch.randn(4, 70) * 0.1 for _ in range(n)]
        v = [torch.rand(4, 70) * 0.01 for _ in range(n)]
        extra = [x.clone() for x in v]
        copies = [params[0].to(torch.bfloat16), params[1], params[2].to(torch.bfloat16)]
    args = (steps, params, grads, m, v, extra, copies, 1e-2, 0.9, 0.999, 1e-8, 0.01, True,
            not compact, False, compact, torch.tensor([8.0]), True)
    if tensors:  # a tensor lr (a scheduler's) and GradScaler's found_inf, both read in the op
        args = (*args, torch.tensor(2e-2, dtype=torch.float64), torch.tensor([0.0]))
    torch.library.opcheck(torch.ops.tierlift.adam_group_step_.default, args)


def test_lr_values_opcheck():
    lrs = [torch.tensor(1e-2), torch.tensor([3e-4], dtype=torch.float64)]
    torch.library.opcheck(torch.ops.tierlift.adam_lr_values.default, (lrs,))


def _refused_then_retried(compiled: bool):
    """A GradScaler step whose tensor lr is refused when the step runs, the lr fixed, then
    scaler.step again (and once more if that is refused); the weights after."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = AdamW(model.parameters(), lr=torch.tensor(1e-2))
    if compiled:
        opt.step = torch.compile(opt.step, fullgraph=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    before = _flat(model).clone()
    opt.param_groups[0]["lr"].fill_(-1.0)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        scaler.step(opt)
    assert torch.equal(_flat(model), before)
    opt.param_groups[0]["lr"].fill_(1e-2)
    refused = False
    try:
        scaler.step(opt)
    except RuntimeError as e:  # the compiled step's stale grad_scale, cleared by the refusal
        assert "stale one" in str(e) and "call scaler.step(optimizer) again" in str(e)
        assert torch.equal(_flat(model), before)
        refused = True
        scaler.step(opt)
    return _flat(model), refused


def test_compiled_step_that_raised_leaves_no_stale_grad_scale():
    """Eager, the step clears GradScaler's grad_scale and found_inf when it raises; compiled, its
    `except` does not run when an op in the graph refuses, and GradScaler's retry multiplied
    its scale into the stale one (1024**2: the gradients unscaled 1024 times too much). The
    retry is refused with both cleared, and the next one is the eager step's, bit for bit."""
    torch._dynamo.reset()
    with num_threads(1):
        want, eager_refused = _refused_then_retried(False)
        got, refused = _refused_then_retried(True)
    assert not eager_refused and refused
    assert torch.equal(got, want), float((got - want).abs().max())


def test_grad_scale_attributes_as_plain_ones():
    opt = AdamW(nn.Linear(2, 2).parameters())
    assert not hasattr(opt, "grad_scale") and getattr(opt, "found_inf", None) is None
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.zeros(())
    assert float(opt.grad_scale) == 2.0
    opt.step()  # no gradients: changes nothing, takes the pair
    opt.grad_scale = torch.tensor(4.0)  # the next step's, set by hand: not stale
    del opt.grad_scale, opt.found_inf
    with pytest.raises(AttributeError):
        del opt.grad_scale
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.zeros(())
    with pytest.raises(RuntimeError, match="no step"):  # a pair no step took
        opt.grad_scale = torch.tensor(4.0)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_tensor_betas_refused_by_a_fullgraph_compiled_step():
    """Tensor betas (torch takes them) would be read as data at trace time; refused by name
    before anything changes. Without fullgraph the refusal breaks the graph and the step runs
    eagerly: the eager step's result, bit for bit."""
    torch._dynamo.reset()
    results = []
    with num_threads(1):
        for how in ("fullgraph", "graph_break", "eager"):
            torch.manual_seed(0)
            model = nn.Linear(4, 4)
            opt = AdamW(model.parameters(), betas=(torch.tensor(0.9), torch.tensor(0.99)))
            model(torch.ones(2, 4)).sum().backward()
            before = _flat(model).clone()
            step = opt.step if how == "eager" else torch.compile(
                opt.step, fullgraph=how == "fullgraph")
            if how == "fullgraph":
                with pytest.raises(Exception, match=r"(?s)\['betas'\] are Tensors.*pass floats"):
                    step()
                assert torch.equal(_flat(model), before) and len(opt.state) == 0
                continue
            step()
            results.append(_flat(model))
    assert torch.equal(results[0], results[1]) and not torch.equal(results[1], before)
