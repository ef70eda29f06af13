"""The user actions of the optimizer conformance suite (test_optim_conformance*.py): each is a
function of the optimizer returning conformance_util.train() keyword arguments, built fresh per
run (schedulers and EMAs hold state), and applied the same way to tierlift's optimizer and to
torch's."""

from __future__ import annotations

import copy

import torch
from conformance_util import STEPS, build_model

CLIPS, NO_CLIP = 0.3, 10.0  # this MLP's gradient norms are 0.44-0.92


def _even(model):
    return [p for i, p in enumerate(model.parameters()) if i % 2 == 0]  # the weights


def clip_norm(max_norm, clips):
    def hook(i, model, opt):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        assert (norm > max_norm) == clips  # the case is what it says
    return {"before_step": hook}


def _grad_edit(edit):
    """Edits the weights' gradients after backward, before step, by one route."""
    def hook(i, model, opt):
        for p in _even(model):
            edit(p)
    return {"before_step": hook}


def _set_grad(p):
    p.grad = p.grad * 0.5


def _numpy_grad(p):
    p.grad.numpy()[:] *= 0.5


def _weights_at(step, edit):
    def hook(i, model, opt):
        if i == step:
            with torch.no_grad():
                edit(model)
    return {"after_step": hook}


def _load_other(model):
    model.load_state_dict(build_model(seed=7).state_dict())


def _numpy_weight(model):
    model[2].weight.detach().numpy()[:] *= 0.9  # one parameter, in the middle chunks


def _ema():
    """p.data.copy_(ema) at step 3, an EMA of the weights kept since the start."""
    ema = {}

    def hook(i, model, opt):
        with torch.no_grad():
            for k, p in enumerate(model.parameters()):
                ema[k] = p.detach().clone() if k not in ema else ema[k].lerp_(p, 0.2)
                if i == 3:
                    p.data.copy_(ema[k])
    return {"after_step": hook}


def _mul_before_step(i, model, opt):
    if i == 2:  # after backward: the overlap already stepped chunks from the old weights
        with torch.no_grad():
            for p in list(model.parameters())[2:4]:
                p.mul_(0.9)


def _load_halved_moments(i, model, opt):
    """After backward, loads the optimizer's own state with exp_avg halved (same step counts):
    chunks the overlap stepped ahead from the old state must be stepped again."""
    if i == 2:
        sd = copy.deepcopy(opt.state_dict())
        for st in sd["state"].values():
            st["exp_avg"].mul_(0.5)
        opt.load_state_dict(sd)


# name -> opt -> train() keyword arguments, fresh per run (schedulers and EMAs hold state)
ACTIONS = {
    "plain": lambda opt: {},
    "accumulate": lambda opt: {"micro": 3},
    "clip_norm_clips": lambda opt: clip_norm(CLIPS, True),
    "clip_norm_noop": lambda opt: clip_norm(NO_CLIP, False),
    "clip_value": lambda opt: {"before_step": lambda i, m, o: torch.nn.utils.clip_grad_value_(
        m.parameters(), 0.05)},
    "lambda_lr": lambda opt: {"sched": torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 1.0 / (1 + s))},
    # OneCycleLR also cycles betas[0] every step
    "onecycle": lambda opt: {"sched": torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=2e-2, total_steps=STEPS + 1)},
    "grad_data_mul": lambda opt: _grad_edit(lambda p: p.grad.data.mul_(0.5)),
    "grad_numpy_mul": lambda opt: _grad_edit(_numpy_grad),
    "grad_mul": lambda opt: _grad_edit(lambda p: p.grad.mul_(0.5)),
    "grad_replace": lambda opt: _grad_edit(_set_grad),
    # a batch dropped after backward (a bad loss, say): zero_grad() without step()
    "skip_step": lambda opt: {"skip_step": lambda i: i == 2},
    # a checkpoint (or a look at the state) taken between backward and step
    "state_dict_before_step": lambda opt: {"before_step": lambda i, m, o: o.state_dict()},
    "w_load_state_dict": lambda opt: _weights_at(2, _load_other),
    "w_mul": lambda opt: _weights_at(2, lambda m: [p.mul_(0.9) for p in m.parameters()]),
    "w_data_copy_ema": lambda opt: _ema(),
    "w_numpy": lambda opt: _weights_at(2, _numpy_weight),
    "w_mul_before_step": lambda opt: {"before_step": _mul_before_step},
    "opt_load_before_step": lambda opt: {"before_step": _load_halved_moments},
}
