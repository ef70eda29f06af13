"""tierlift.lowp used the way a torchao float8 / Transformer Engine user uses it: checkpoints in and
out (strict, assign=True, a model built on the meta device), frozen weights, activation
checkpointing, loss scaling, resuming a stochastic-rounding run; and the configurations that would
be silently ignored are refused before anything changes."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierlift.lowp import FP4_RECIPES, RECIPES, Float8Recipe, FP4Recipe, convert, fp4

ALL_RECIPES = sorted(RECIPES) + sorted(FP4_RECIPES)


def _mlp(bias: bool = True) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64, bias=bias), nn.GELU(), nn.Linear(64, 32, bias=bias))


def _step(model, x, seed=3):
    """Outputs, input grad and parameter grads of one forward + backward (seeded: SR draws)."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    y = model(x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _equal(a, b) -> bool:
    return all((u is None and v is None) or torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "nvfp4"])
def test_checkpoints_load_strict_with_assign_and_into_a_meta_built_model(recipe, one_thread):
    torch.manual_seed(0)
    low = _mlp()
    convert(low, recipe, min_features=0)
    x = torch.randn(2, 8, 64)
    want = _step(copy.deepcopy(low), x)
    with torch.device("meta"):
        meta = _mlp()
    convert(meta, recipe, min_features=0)  # as torchao users do before to_empty + load
    meta.to_empty(device="cpu")
    meta.load_state_dict(low.state_dict(), strict=True)
    fresh = _mlp()
    convert(fresh, recipe, min_features=0)
    fresh.load_state_dict(low.state_dict(), strict=True, assign=True)
    assert set(fresh.state_dict()) == set(_mlp().state_dict())
    for model in (meta, fresh):
        assert _equal(_step(model, x), want)


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_frozen_weight_gets_no_grad_and_the_same_input_grad(recipe, one_thread):
    torch.manual_seed(0)
    model = _mlp()
    convert(model, recipe, min_features=0)
    frozen = copy.deepcopy(model)
    frozen[0].weight.requires_grad_(False)
    x = torch.randn(24, 64)
    a, b = _step(model, x), _step(frozen, x)
    assert b[2] is None  # frozen[0].weight: no gradient at all
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # output, input grad
    assert _equal(a[3:], b[3:])  # the other parameters


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, reentrant: bool):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("recipe", sorted(FP4_RECIPES))
@pytest.mark.parametrize("reentrant", [False, True])
def test_fp4_activation_checkpointing_matches_bit_for_bit(recipe, reentrant, one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.GELU(), nn.Linear(64, 64))
    convert(model, recipe, min_features=0)
    ckpt = copy.deepcopy(model)
    x = torch.randn(40, 64)
    assert _equal(_step(Checkpointed(ckpt, reentrant), x), _step(model, x))


@pytest.mark.parametrize("recipe", sorted(RECIPES) + ["mxfp4-rtn"])
def test_loss_scaling_by_a_power_of_two_is_exact_as_for_nn_linear(recipe, one_thread):
    # What GradScaler does under bf16 autocast: plain nn.Linear's unscaled gradients are exactly
    # the unscaled run's; power-of-two scales (or an amax scaled by 2^16) keep FP8/FP4 exact too.
    torch.manual_seed(0)
    model = _mlp()
    convert(model, recipe, min_features=0)
    x = torch.randn(2, 12, 64)
    grads = []
    for scale in (1.0, 65536.0):
        m = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().square().mean()
        (loss * scale).backward()
        grads.append([p.grad / scale for p in m.parameters()])
    assert _equal(*grads)


def test_fp4_stochastic_rounding_resumes_exactly_with_the_rng_state(one_thread):
    # Quartet's signs and SR seeds come from torch's CPU generator: saving it with the model and
    # optimizer state makes a resumed run repeat the uninterrupted one's losses bit for bit.
    torch.manual_seed(0)
    init = _mlp()
    convert(init, "mxfp4-quartet", min_features=0)
    data = [torch.randn(32, 64) for _ in range(4)]

    def train(model, opt, batches):
        losses = []
        for x in batches:
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    model = copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    whole = train(model, opt, data)

    model = copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    train(model, opt, data[:2])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), torch.get_rng_state()))
    torch.manual_seed(123)  # the interrupted process moves on
    resumed = copy.deepcopy(init)
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    torch.set_rng_state(saved[2])
    assert torch.equal(torch.stack(train(resumed, opt, data[2:])), torch.stack(whole[2:]))


@pytest.mark.parametrize("field", ["forward_dtype", "grad_dtype"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.bfloat16])
def test_a_recipe_dtype_the_quantizers_lack_is_refused_when_made(field, dtype):
    # It used to be accepted, so convert() swapped every layer and the first forward then failed
    # inside the quantizer, leaving the model converted to a recipe that cannot run.
    with pytest.raises(ValueError, match=field):
        Float8Recipe(name="custom", scaling="row", pow2_scale=True,
                     grad_weight_high_precision=False, **{field: dtype})


def test_a_dgrad_hadamard_the_2d_weight_path_would_ignore_is_refused():
    # With weight_2d the dgrad reuses the forward's 16x16-block W, so dgrad_hadamard was dropped
    # without a word: gradients bit-identical to nvfp4's although a rotation was asked for.
    kw = {f: getattr(FP4_RECIPES["nvfp4"], f) for f in FP4Recipe.__dataclass_fields__}
    kw.update(name="nvfp4-dgrad-h16", dgrad_hadamard=16)
    with pytest.raises(ValueError, match="dgrad_hadamard=16 with weight_2d"):
        FP4Recipe(**kw)


def test_min_features_with_a_module_filter_is_refused_before_any_change():
    # The filter alone decides: min_features was ignored, so layers below it were converted.
    model = _mlp()
    with pytest.raises(ValueError, match="both module_filter_fn and min_features=2048"):
        convert(model, "fp8-rowwise", lambda mod, fqn: True, min_features=2048)
    assert all(type(m) is nn.Linear for m in model if isinstance(m, nn.Linear))
    assert convert(model, "fp8-rowwise").converted == []  # the default size rule
    assert convert(model, "fp8-rowwise", lambda mod, fqn: fqn == "0").converted == ["0"]


def test_fp4_draws_come_from_the_cpu_generator_whatever_the_default_device():
    # Under torch.set_default_device("cuda") the signs and SR seeds came from the CUDA generator
    # (a device sync per draw, and state torch.get_rng_state() does not save); "meta" shows it
    # on any machine: the draw failed there.
    torch.manual_seed(5)
    want = [fp4._draw(62), fp4._draw(32)]
    torch.manual_seed(5)
    with torch.device("meta"):
        got = [fp4._draw(62), fp4._draw(32)]
    assert got == want
